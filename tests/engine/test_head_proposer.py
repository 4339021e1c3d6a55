"""The draft head (kvwire/model/draft_head.py) in the engine: it continues from the right hidden
state, greedy output stays plain greedy's, seeded sampling does not depend on the batch, and a head
made for other weights does not load."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvwire import LLM, SamplingParams
from kvwire.config import KVDtype, QuantMode
from kvwire.files import LoadError
from kvwire.model.draft_head import DraftHead, DraftHeadConfig, load_for_target, save_draft_head
from kvwire.model.quant import Int8Linear
from kvwire.runtime import EngineConfig, load_engine
from kvwire.spec import HeadProposer
from tests.decode_svc.harness import tiny_model

PROMPTS = [[40, 41, 42] * 6, list(range(5, 25)), [7, 8, 9, 10] * 4]


def make_head(target_dir, out, seed: int = 0, sha: str | None = None, copy: bool = False):
    """A head for ``target_dir`` with random layers, or (``copy``) one that proposes what the
    target's LM head says for the feature it is given: fc passes the feature through, the MLP adds
    nothing, the head rows are the target's LM head (all of the vocabulary) - so on a sequence where
    the target repeats its last token, every proposal is accepted."""
    rt = load_engine(EngineConfig(model_dir=target_dir, weights=QuantMode.NONE))
    cfg = rt.model_config
    vocab = torch.arange(cfg.vocab_size) if copy else torch.randperm(cfg.vocab_size)[:cfg.vocab_size // 2].sort().values
    hcfg = DraftHeadConfig(cfg.hidden_size, 2 * cfg.hidden_size, 1, len(vocab), cfg.vocab_size, cfg.rms_norm_eps,
                           rt.fingerprint.weights_sha256 if sha is None else sha, rt.fingerprint.tokenizer_sha256)
    head = DraftHead(hcfg, rt.model.embed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        head.head_vocab.copy_(vocab)
        if copy:
            h = cfg.hidden_size
            head.fc.weight.zero_()
            head.fc.weight[:, :h] = torch.eye(h)
            head.blocks[0].down.weight.zero_()
            head.head.weight.zero_()
            head.head.weight[:cfg.vocab_size] = rt.model.lm_head.weight
    return save_draft_head(head, out)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-head")
    target = tiny_model(root / "target")
    return target, make_head(target, root / "head"), make_head(target, root / "copy", copy=True)


def _run(llm, prompts, params):
    reqs = [llm.core.requests[llm.add_request(p, params)] for p in prompts]
    while llm.has_unfinished():
        llm.step()
    return reqs


@pytest.mark.parametrize("kv", [KVDtype.FP8_E4M3, KVDtype.BF16])
def test_greedy_with_a_draft_head_equals_plain_greedy(pair, kv):
    target, head, copy = pair
    for h, adaptive in ((head, False), (copy, False), (copy, True)):
        # not adaptive: every step proposes k (on the tiny model a head call costs about a step,
        # so the adaptive rule proposes little; it is exact either way)
        llm = LLM(target, kv_dtype=kv, num_pages=128, draft_model=h, speculative="draft",
                  speculative_auto_off=False, speculative_adaptive=adaptive)
        llm.core.spec_cfg = dataclasses.replace(llm.core.spec_cfg, greedy_max_batch=0)
        plain = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True, speculative="none"))
        reqs = _run(llm, PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True, num_speculative_tokens=4))
        assert [r.output_ids for r in reqs] == [o.token_ids for o in plain]
        assert (sum(r.spec.drafted for r in reqs) > 0 or adaptive) and llm.stats()["used"] == 0
        assert not llm.core.draft.features  # freed with their sequences


def test_the_head_continues_from_the_hidden_state_that_chose_the_pending_token(pair):
    """After plain and verification steps alike, a sequence's feature is the target's final normed
    hidden state at the position before its pending token (checked against a fresh forward)."""
    target, _, copy = pair
    llm = LLM(target, weights="none", kv_dtype="bf16", num_pages=128, draft_model=copy, speculative="draft",
              speculative_auto_off=False, speculative_adaptive=False)
    runner, head = llm.core.runner, llm.core.draft
    req = llm.core.requests[llm.add_request([5] * 12, SamplingParams(max_tokens=60, ignore_eos=True))]
    checked = 0
    while req.generated < 40:
        llm.step()
        ctx = req.context
        check = runner.runtime.new_cache(64)
        positions = check.prepare([0], [len(ctx) - 1])
        runner.runtime.model(torch.tensor(ctx[:-1]), positions, check, logits_rows=torch.tensor([len(ctx) - 2]))
        want = runner.runtime.model.last_hidden[0]
        got = head.features[req.seq]
        assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())), (req.generated, got, want)
        checked += 1
    assert req.spec.accepted > 0 and checked >= 5  # verification steps that kept proposals were checked too
    llm.abort(req.request_id)


def test_the_copying_head_is_accepted_where_the_target_repeats(pair):
    """Proposals are accepted, not only rejected: the head that repeats the target's own choice is
    right whenever the target repeats its last token (the tiny model does, on these prompts)."""
    target, _, copy = pair
    llm = LLM(target, num_pages=128, draft_model=copy, speculative="draft", speculative_auto_off=False,
              speculative_adaptive=False)  # the head's own proposals, not the lookup's
    llm.core.spec_cfg = dataclasses.replace(llm.core.spec_cfg, greedy_max_batch=0)
    prompts = [[t] * 12 for t in range(3, 60)]
    reqs = _run(llm, prompts, SamplingParams(max_tokens=16, ignore_eos=True, num_speculative_tokens=4))
    assert sum(r.spec.accepted for r in reqs) > 0


def test_seeded_sampling_with_a_head_does_not_depend_on_the_batch(pair):
    target, head, _ = pair
    llm = LLM(target, num_pages=256, draft_model=head, speculative="draft")
    llm.core.spec_cfg = dataclasses.replace(llm.core.spec_cfg, auto_off=False)
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True)
    alone = [o.token_ids for o in (llm.generate([p], params)[0] for p in PROMPTS)]
    batched = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert alone == batched


def test_a_head_is_quantized_like_the_target_and_must_match_its_weights(pair, tmp_path):
    target, head, _ = pair
    llm = LLM(target, num_pages=64, draft_model=head)
    assert any(isinstance(m, Int8Linear) for m in llm.core.draft.head.modules())
    other = make_head(target, tmp_path / "other", sha="0" * 64)
    rt = load_engine(EngineConfig(model_dir=target))
    with pytest.raises(LoadError, match="distilled from other target weights"):
        load_for_target(other, rt, QuantMode.INT8)
    bigger = tiny_model(tmp_path / "bigger", hidden_size=96)
    with pytest.raises(LoadError, match="width 64"):
        load_for_target(head, load_engine(EngineConfig(model_dir=bigger)), QuantMode.INT8)


def test_the_heads_confidence_sizes_the_proposal_and_a_long_quote_wins():
    from kvwire.engine.request import Request
    from kvwire.sampling_params import SpeculativeMode
    from kvwire.spec import SpecConfig, SpecState
    from kvwire.spec import head as spec
    cfg = SpecConfig(mode=SpeculativeMode.DRAFT)
    req = Request("r", 0, [1, 2, 3], SamplingParams(), frozenset(),
                  SpecState(SpeculativeMode.DRAFT, k_max=4, k=0, by_confidence=True), context=[1, 2, 3, 9])
    req.spec.costs = [0.0, 0.2, 0.4, 0.6, 0.8]
    q = torch.rand(4, 10)
    tokens, got_q = spec.head_proposal(req, [5, 6, 7, 8], q, [0.9, 0.9, 0.1, 0.9], 4, cfg)
    assert tokens == [5, 6] and torch.equal(got_q, q[:2])  # the third would be accepted 1 time in 10
    assert spec.head_proposal(req, [5, 6, 7, 8], None, [0.1, 0.9, 0.9, 0.9], 4, cfg) == ([], None)
    # the context ends with a 6-token run seen before: the lookup expects more than the head
    req.context = [4, 10, 11, 12, 13, 14, 15, 20, 21, 22, 23, 4, 10, 11, 12, 13, 14, 15]
    assert spec.head_proposal(req, [5, 6, 7, 8], None, [0.6, 0.6, 0.6, 0.6], 4, cfg)[0] == [20, 21, 22, 23]
    # never past the step's limit (the tokens left before max_tokens), whichever source proposes
    assert spec.head_proposal(req, [5, 6, 7, 8], None, [0.6, 0.6, 0.6, 0.6], 2, cfg)[0] == [20, 21]
    assert spec.head_proposal(req, [5, 6, 7, 8], None, [0.6] * 4, 4, dataclasses.replace(cfg, adaptive=False)) \
        == ([5, 6, 7, 8], None)


@pytest.mark.parametrize("weights", [QuantMode.NONE, QuantMode.BF16, QuantMode.INT8])
def test_the_c_chain_proposes_what_the_torch_chain_does(pair, weights):
    """kvwire.model.fast_head against HeadProposer's torch chain, on the target's real hidden states:
    the same tokens, confidences and chain lengths (the stop rule and each sequence's k). fp32
    layers: exact up to the norms' last bits; int8 and bf16 (where the C side rounds activations to
    bf16, as the fused decode step does): those last bits can move an activation across a rounding
    step, so near ties (this random head's are close) may go either way."""
    from kvwire.engine.runner import ModelRunner
    from kvwire_kernels import cpu
    if not cpu.available():
        pytest.skip(cpu.unavailable_reason)
    target, head, _ = pair
    rt = load_engine(EngineConfig(model_dir=target, weights=weights, num_pages=64))
    runner = ModelRunner(rt, 64)
    proposer = HeadProposer(load_for_target(head, rt, weights), runner)
    assert proposer.fast_head is not None
    tokens = torch.randint(3, rt.model_config.vocab_size, (48,), generator=torch.Generator().manual_seed(1))
    positions = runner.cache.prepare([0], [48])
    rt.model(tokens, positions, runner.cache)
    seqs = list(range(48))
    proposer.features = dict(zip(seqs, rt.model.last_hidden))
    ks = [1 + i % 5 for i in seqs]
    args = (seqs, [[int(t)] for t in tokens], ks, [SamplingParams()] * 48, [0] * 48)
    for stop in (0.0, 0.25):
        fast = proposer.draft(*args, stop_below=stop)
        fast_head, proposer.fast_head = proposer.fast_head, None
        torch_chain = proposer.draft(*args, stop_below=stop)
        proposer.fast_head = fast_head
        same = [f[0] == t[0] for f, t in zip(fast, torch_chain)]
        assert all(len(p) == k for (p, _, _), k in zip(fast, ks)) if stop == 0.0 else \
            all(1 <= len(p) <= k for (p, _, _), k in zip(fast, ks))
        if weights is not QuantMode.NONE:
            assert sum(same) >= 0.8 * len(same)
            continue
        assert all(same), [(f, t) for f, t in zip(fast, torch_chain) if f[0] != t[0]]
        for (_, q, conf), (_, _, want) in zip(fast, torch_chain):
            assert q is None and conf == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_one_c_head_evaluation_equals_the_heads_forward(pair):
    """FastHead.forward (what a sampling chain calls per proposal) against DraftHead.forward, fp32."""
    from kvwire.model.fast_head import FastHead
    from kvwire_kernels import cpu
    if not cpu.available():
        pytest.skip(cpu.unavailable_reason)
    target, head, _ = pair
    rt = load_engine(EngineConfig(model_dir=target, weights=QuantMode.NONE))
    h = load_for_target(head, rt, QuantMode.NONE)
    fast = FastHead.build(h)
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(5, h.cfg.hidden_size, generator=g)
    toks = torch.randint(0, h.cfg.vocab_size, (5,), generator=g)
    x, logits = fast.forward(feats, toks)
    want_x, want_logits = h(feats, toks)
    assert logits.shape == want_logits.shape == (5, h.cfg.head_vocab)
    torch.testing.assert_close(x, want_x, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(temperature=1.0, top_p=0.9),
                                dict(temperature=0.8, top_k=20), dict(temperature=1.3, top_k=5000, top_p=0.95)])
def test_a_heads_sampled_proposal_is_drawn_over_its_vocabulary_as_over_the_whole(kw):
    """draft_sample over the head's scores and its vocabulary ids: q equals the distribution over
    the full vocabulary with -inf outside the head's (what it was drawn from before), and every
    proposal is a head-vocabulary token drawn from q (chi-square over the most likely ones)."""
    from kvwire.spec.verify import draft_sample
    from kvwire.sampler import probabilities
    g = torch.Generator().manual_seed(4)
    vocab, support = 3000, torch.randperm(3000, generator=g)[:700].sort().values
    small = torch.randn(700, generator=g) * 2
    full_logits = torch.full((vocab,), float("-inf"))
    full_logits[support] = small
    params = SamplingParams(**kw)
    want = probabilities(full_logits, params)
    counts = torch.zeros(vocab)
    for step in range(3000):
        tok, q = draft_sample(small, params, step, support, vocab)
        counts[tok] += 1
    torch.testing.assert_close(q, want, rtol=1e-5, atol=1e-7)
    assert counts[want == 0].sum() == 0
    top = want.argsort(descending=True)[:5]
    expected = want[top] * 3000
    chi2 = float(((counts[top] - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (counts[top], expected)  # df 5, p = 0.001 (the 5 most likely, each against the rest)


def test_warm_up_prices_a_head_proposal(pair):
    from kvwire.engine.runner import ModelRunner
    target, head, _ = pair
    rt = load_engine(EngineConfig(model_dir=target, num_pages=64))
    runner = ModelRunner(rt, 64)
    proposer = HeadProposer(load_for_target(head, rt, QuantMode.INT8), runner)
    assert proposer.cost(1) is None
    runner.warm_up()
    # a head call against the tiny target's step (tens of microseconds): several plain steps here
    assert 0 < proposer.cost(1) < float("inf") and not proposer.features and runner.cache.stats()["used"] == 0
