"""Speculative decoding: the pure functions, greedy exactness through the services, the sampled
distribution (chi-square), rollback, metrics and span attributes, request validation."""
from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
import torch

from kvwire.config import KVDtype
from kvwire.generate import generate
from kvwire.runtime import EngineConfig, load_engine
from kvwire.sampler import probabilities
from kvwire.sampling_params import SamplingParams, SpeculativeMode
from kvwire.engine import async_engine as engine_mod
from kvwire.engine.core import EngineCore
from kvwire.engine.runner import ModelRunner
from kvwire.engine.scheduler import SchedulerConfig
from kvwire.spec import HeadProposer, SpecConfig, attach_draft
from kvwire.spec import ngram, state, verify
from protos.kvwire.v1 import kvwire_pb2 as pb
from tests.decode_svc.harness import Harness, tiny_model

SM = pb.SamplingParams


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return tiny_model(root / "target"), tiny_model(root / "draft", seed=1, hidden_size=32, num_layers=1)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness of fit; cells with expectation < 5 are pooled into one."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


# ---- pure functions ---------------------------------------------------------------------------------

def test_ngram_propose_latest_longest_match():
    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram.ngram_propose(ctx, 3) == [7, 8, 5]  # "2 3" matched at its latest earlier place
    assert ngram.ngram_propose(ctx, 1) == [7]
    assert ngram.ngram_propose([4, 5, 6, 4, 5], 4) == [6, 4, 5]  # continuation stops at the end
    assert ngram.ngram_propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert ngram.ngram_propose([5, 6, 5, 9, 7, 6, 5], 2, max_n=2) == [9, 7]  # "6 5" beats "5"
    assert ngram.ngram_propose([7], 3) == [] and ngram.ngram_propose([1, 1], 0) == []


def test_accept_greedy_prefix_then_correction_or_bonus():
    logits = torch.zeros(4, 10)
    for row, best in enumerate([3, 5, 7, 2]):
        logits[row, best] = 1.0
    assert verify.accept_greedy(logits, [3, 5, 7]) == [3, 5, 7, 2]  # all accepted + bonus
    assert verify.accept_greedy(logits, [3, 6, 7]) == [3, 5]  # first mismatch gets the target's argmax
    assert verify.accept_greedy(logits[:1], []) == [3]


def test_adapt_k():
    assert state.adapt_k(4, 4, 4, 6) == 6 and state.adapt_k(4, 4, 4, 5) == 5
    assert state.adapt_k(4, 4, 1, 8) == 3 and state.adapt_k(1, 1, 0, 8) == 1
    assert state.adapt_k(3, 0, 0, 8) == 3  # no proposal this step: unchanged


@pytest.mark.parametrize("point_mass", [False, True])
def test_acceptance_rule_preserves_the_target_distribution(point_mass):
    # The first emitted token of a step must follow p_0 whatever q proposes; also the second one
    # (conditioned on the first being accepted it follows p_1).
    p_logits = torch.tensor([[2.0, 0.5, 0.0, -1.0, 1.0], [0.0, 1.5, -0.5, 0.3, 0.8], [0.0] * 5])
    q = torch.softmax(torch.tensor([[0.0, 2.0, 1.0, 0.0, -2.0], [1.0, 0.0, 0.0, 2.0, 0.0]]), -1)
    params = SamplingParams(temperature=1.0)
    p = torch.softmax(p_logits, -1)
    first, second = torch.zeros(5), torch.zeros(5)
    n = 3000
    for seed in range(n):
        params = SamplingParams(temperature=1.0, seed=seed)
        if point_mass:
            proposed, draft = [0, 1], None
        else:
            g = verify.draft_generator(seed, 0)
            proposed = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
            draft = q
        out = verify.accept_sampled(p_logits, proposed, draft, params, first_step=0)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert chi2_pvalue(first, p[0]) > 1e-3
    assert chi2_pvalue(second, p[1]) > 1e-3
    # and the test can fail: the draft's own distribution is far from p_0
    assert chi2_pvalue(first, q[0]) < 1e-6


# ---- exactness through the services -----------------------------------------------------------------

PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 31, 48)] + [[7, 8, 9, 10] * 6, [40, 41, 42] * 9]


async def test_greedy_speculative_equals_plain_greedy_batched(models):
    target, draft = models
    cfg = EngineConfig(model_dir=target, num_pages=128)
    ref = load_engine(cfg)
    expected = [generate(ref.model, p, SamplingParams(max_tokens=30), cache=ref.new_cache(64)) for p in PROMPTS]
    modes = [dict(speculative=SM.SPECULATIVE_MODE_DRAFT, num_speculative_tokens=4), dict(speculative=SM.SPECULATIVE_MODE_NGRAM),
             dict(speculative=SM.SPECULATIVE_MODE_DRAFT, num_speculative_tokens=2), dict(speculative=SM.SPECULATIVE_MODE_NONE),
             dict(speculative=SM.SPECULATIVE_MODE_NGRAM, num_speculative_tokens=7), dict()]  # last: the service default
    async with Harness(cfg, draft_cfg=EngineConfig(model_dir=draft, kv_dtype=KVDtype.BF16),
                       spec_config=SpecConfig(mode=SpeculativeMode.DRAFT, num_tokens=3,
                                                   greedy_max_batch=0)) as h:
        for rnd in range(2):  # concurrently (one shared batch), then one at a time
            if rnd == 0:
                outs = await asyncio.gather(*[h.generate(p, max_tokens=30, **m) for p, m in zip(PROMPTS, modes)])
            else:
                outs = [await h.generate(p, max_tokens=30, **m) for p, m in zip(PROMPTS[::-1], modes)]
                outs = outs[::-1]
            for prompt, exp, out in zip(PROMPTS, expected, outs):
                assert out == exp, f"prompt of {len(prompt)} tokens"
        assert await h.pools_back_to(64, 128)
        assert h.engine.core.draft.cache.stats()["used"] == 0


async def test_fp8_exact_verification_matches_plain_decode_logits(models):
    """Verification reproduces plain decoding's KV state and attention: logits agree to fp32 GEMM
    rounding (the BLAS sums differently for different row counts, as batching plain decode does)."""
    target, _ = models
    eng = load_engine(EngineConfig(model_dir=target, kv_dtype=KVDtype.FP8_E4M3))
    prompt = list(range(3, 40))
    plain, ver = ModelRunner(eng, 32), ModelRunner(eng, 32)
    for r in (plain, ver):
        eng.model(torch.tensor(prompt), r.cache.prepare([0], [len(prompt)]), r.cache)
    tokens, ref = [11], []
    for _ in range(24):
        row = plain.step([0], [[tokens[-1]]])[0][-1]
        ref.append(row)
        tokens.append(int(row.argmax()))
    g = 0
    for k, wrong_at in [(5, 2), (9, None), (3, 0), (12, 6)]:  # crosses page boundaries, rejects
        props = tokens[g + 1:g + 1 + k]
        if wrong_at is not None:
            props[wrong_at] = (props[wrong_at] + 1) % 300
        rows = ver.step([0], [[tokens[g], *props]])[0]
        kept = (wrong_at if wrong_at is not None else k) + 1
        for i in range(kept):
            torch.testing.assert_close(rows[i], ref[g + i], rtol=0, atol=1e-5)
        used = ver.cache.stats()["used"]
        ver.keep(0, kept)
        g += kept
        assert ver.cache.length(0) == len(prompt) + g
        assert ver.cache.stats()["used"] == -(-(len(prompt) + g) // 16) <= used  # emptied pages returned


# ---- sampling: the distribution, through the engine's own step ----------------------------------------

def _engine(target_dir, draft_dir, scale: float) -> EngineCore:
    tgt = load_engine(EngineConfig(model_dir=target_dir, kv_dtype=KVDtype.BF16))
    drf = load_engine(EngineConfig(model_dir=draft_dir, kv_dtype=KVDtype.BF16))
    for e in (tgt, drf):  # sharpen the random models' flat logits so draft and target disagree
        e.model.lm_head.weight.mul_(scale)
    runner = ModelRunner(tgt, 2048)
    return EngineCore(runner, SchedulerConfig(2048, max_running=1000, max_waiting=1000), draft=attach_draft(runner, drf))


def _sample_tokens(core: EngineCore, prompt, params, n_requests, n_tokens):
    """n_tokens decode tokens for n_requests (seeds 0..) of the same context, batched, in process,
    through the engine's public step: the prompt but its last token is prefilled, and that last
    token is handed to ``start`` as if sampled, so every request's first decode token has the
    same distribution."""
    vocab = core.runner.runtime.model_config.vocab_size
    counts = torch.zeros(n_tokens, vocab)
    for i in range(n_requests):
        core.add_request(str(i), prompt[:-1], dataclasses.replace(params, seed=1000 + i))
    admitted = core.admit()
    out = {req.request_id: [] for req in admitted}
    for req in admitted:
        core.runner.prefill(req.seq, req.prompt)
        core.start(req, prompt[-1])
    while any(len(t) < n_tokens for t in out.values()):
        plan = core.plan()
        outputs, _ = core.update(plan, core.execute(plan))
        for o in outputs:
            out[o.request_id] += o.token_ids
    for req in list(core.requests.values()):
        core.release(req)
        core.runner.free(req.seq)
    for toks in out.values():
        for j in range(n_tokens):
            counts[j, toks[j]] += 1
    return counts


def _engine_with_head(target_dir, head_dir, scale: float) -> EngineCore:
    """A draft head (random layers, half the vocabulary) proposing every step (not adaptive)."""
    from kvwire.config import QuantMode
    from kvwire.model.draft_head import load_for_target
    tgt = load_engine(EngineConfig(model_dir=target_dir, kv_dtype=KVDtype.BF16))
    tgt.model.lm_head.weight.mul_(scale)
    head = load_for_target(head_dir, tgt, QuantMode.NONE)
    head.head.weight.mul_(scale)
    runner = ModelRunner(tgt, 2048)
    return EngineCore(runner, SchedulerConfig(2048, max_running=1000, max_waiting=1000),
                      SpecConfig(adaptive=False, auto_off=False), draft=attach_draft(runner, head))


@pytest.mark.parametrize("mode", ["draft", "ngram", "head"])
def test_speculative_sampling_matches_plain_sampling_distribution(tmp_path, mode):
    target = tiny_model(tmp_path / "t", vocab_size=12)
    if mode == "head":
        from tests.engine.test_head_proposer import make_head
        core = _engine_with_head(target, make_head(target, tmp_path / "h", seed=3), scale=6.0)
        proposals = []
        inner = core.draft.draft
        core.draft.draft = lambda *a: proposals.append(len(a[0])) or inner(*a)  # sequences drafting
        mode = "draft"
    else:
        draft = tiny_model(tmp_path / "d", seed=5, vocab_size=12, hidden_size=32, num_layers=1)
        core = _engine(target, draft, scale=6.0)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]  # repeats, so n-gram lookup always proposes
    base = SamplingParams(max_tokens=64, temperature=0.9, top_k=8)
    n = 400
    plain = _sample_tokens(core, prompt, dataclasses.replace(base, speculative="none"), n, 3)
    specd = _sample_tokens(core, prompt, dataclasses.replace(base, speculative=mode, num_speculative_tokens=3), n, 3)
    # Exact distribution of the first decode token; the later ones against plain sampling (two-sample).
    logits = core.runner.step([-99], [prompt])[0]  # fresh sequence: a plain prefill of the context
    core.runner.free(-99)
    p1 = probabilities(logits[-1], base)
    assert chi2_pvalue(specd[0], p1) > 1e-3
    assert chi2_pvalue(plain[0], p1) > 1e-3
    for j in (1, 2):
        pooled = (plain[j] + specd[j]) / (2 * n)
        assert chi2_pvalue(specd[j], pooled) > 1e-4, (j, plain[j], specd[j])
    assert core.runner.cache.stats()["used"] == 0
    if isinstance(core.draft, HeadProposer):
        assert sum(proposals) > 400 and not core.draft.features  # the head proposed; nothing of it is left
    else:
        assert core.draft.cache.stats()["used"] == 0


async def test_seeded_speculative_sampling_is_reproducible_across_batches(models):
    target, draft = models
    cfg = EngineConfig(model_dir=target, num_pages=128)
    kw = dict(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, speculative=SM.SPECULATIVE_MODE_DRAFT, num_speculative_tokens=3)
    async with Harness(cfg, draft_cfg=EngineConfig(model_dir=draft)) as h:
        alone = await h.generate(PROMPTS[1], **kw)
        together = await asyncio.gather(h.generate(PROMPTS[1], **kw), h.generate(PROMPTS[2], max_tokens=16),
                                        h.generate(PROMPTS[0], max_tokens=12, temperature=1.0, seed=3,
                                                   speculative=SM.SPECULATIVE_MODE_NGRAM))
    assert together[0] == alone and len(alone) == 16


# ---- reporting and validation --------------------------------------------------------------------------

def _metric(name: str, method: str) -> float:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value(name, {"method": method}) or 0.0


async def test_acceptance_on_decode_span_and_metrics(models, monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(engine_mod, "tracer", tp.get_tracer("test"))
    target, _ = models
    before = {m: _metric(f"kvwire:spec_decode_num_{m}_tokens_total", "ngram") for m in ("draft", "accepted")}
    async with Harness(EngineConfig(model_dir=target, num_pages=128)) as h:
        await h.generate([40, 41, 42] * 9, max_tokens=30, speculative=SM.SPECULATIVE_MODE_NGRAM, num_speculative_tokens=5)
    span = next(s for s in exporter.get_finished_spans() if s.name == "decode")
    a = span.attributes
    assert a["kvwire.spec.mode"] == "ngram" and a["kvwire.spec.num_speculative_tokens"] == 5
    assert a["kvwire.spec.num_draft_tokens"] > 0
    assert a["kvwire.spec.acceptance_rate"] == pytest.approx(
        a["kvwire.spec.num_accepted_tokens"] / a["kvwire.spec.num_draft_tokens"], abs=1e-4)
    assert a["kvwire.spec.mean_tokens_per_step"] >= 1.0
    assert _metric("kvwire:spec_decode_num_draft_tokens_total", "ngram") - before["draft"] == \
        a["kvwire.spec.num_draft_tokens"]
    assert _metric("kvwire:spec_decode_num_accepted_tokens_total", "ngram") - before["accepted"] == \
        a["kvwire.spec.num_accepted_tokens"]


async def test_invalid_speculative_requests(models):
    target, _ = models
    async with Harness(EngineConfig(model_dir=target, num_pages=128)) as h:  # no draft model
        for sampling, code, match in [
            (dict(speculative=SM.SPECULATIVE_MODE_DRAFT), grpc.StatusCode.FAILED_PRECONDITION, "no draft model loaded"),
            (dict(speculative=9), grpc.StatusCode.INVALID_ARGUMENT, "speculative must be one of"),
            (dict(speculative=SM.SPECULATIVE_MODE_NGRAM, num_speculative_tokens=0), grpc.StatusCode.INVALID_ARGUMENT,
             "num_speculative_tokens must be in [1, 16]"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await h.generate([5, 6, 7], max_tokens=5, **sampling)
            assert e.value.code() == code and match in e.value.details(), e.value.details()


def test_speculative_fields_survive_the_wire_both_ways():
    # tokenizer_svc forwards SamplingParams as sampling_to_pb(sampling_from_pb(m)): nothing may be lost.
    from protos import convert as conv
    for p in (SamplingParams(speculative="ngram", num_speculative_tokens=6),
              SamplingParams(speculative="draft"), SamplingParams(speculative="none"), SamplingParams()):
        assert conv.sampling_from_pb(conv.sampling_to_pb(p)) == p
    assert conv.sampling_from_pb(SM(speculative=SM.SPECULATIVE_MODE_DRAFT, num_speculative_tokens=3)) == \
        SamplingParams(max_tokens=128, speculative="draft", num_speculative_tokens=3)
