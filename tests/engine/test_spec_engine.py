"""The engine's speculative step: one-call verification over the paged cache, exact rollback,
speculation turning itself off at low acceptance, and cancellation during a verification step."""
from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
import torch

from kvwire import LLM, SamplingParams
from kvwire.config import KVDtype
from kvwire.engine.request import Request
from kvwire.engine.runner import ModelRunner
from kvwire.runtime import EngineConfig, load_engine
from kvwire.sampling_params import SpeculativeMode
from kvwire.spec import SpecConfig, SpecState, Tuned
from kvwire.spec import state as spec
from protos.kvwire.v1 import kvwire_pb2 as pb
from tests.decode_svc.harness import Harness, tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-engine")
    return tiny_model(root / "target"), tiny_model(root / "draft", seed=1, hidden_size=32, num_layers=1)


def _page_bytes(cache, seq: int) -> list[torch.Tensor]:
    idx = torch.tensor(cache.page_ids(seq))
    out = [cache.k.view(torch.uint8)[:, idx], cache.v.view(torch.uint8)[:, idx]]
    if cache.k_scale is not None:
        out += [cache.k_scale.view(torch.int16)[:, idx], cache.v_scale.view(torch.int16)[:, idx]]
    return out


@pytest.mark.parametrize("kv", [KVDtype.FP8_E4M3, KVDtype.BF16])
def test_verification_is_one_prepare_and_one_forward_and_rolls_back_exactly(models, kv, monkeypatch):
    """A k+1-token step of two sequences is one ``prepare`` and one model forward over the cache
    itself (no rounds, no stand-in cache); each row's logits are plain decoding's (bit for bit on
    the fused decode path, whose rows are independent; to GEMM rounding on the eager one); keep()
    leaves the very page bytes plain decoding would have."""
    target, _ = models
    eng = load_engine(EngineConfig(model_dir=target, kv_dtype=kv))
    prompts = [list(range(3, 40)), list(range(50, 61))]
    plain, ver = ModelRunner(eng, 64), ModelRunner(eng, 64)
    for r in (plain, ver):
        for s, p in enumerate(prompts):
            r.prefill(s, p)
    toks, ref = [[11], [12]], [[], []]
    for _ in range(20):
        rows = plain.step([0, 1], [[t[-1]] for t in toks])
        for s in (0, 1):
            ref[s].append(rows[s][-1])
            toks[s].append(int(rows[s][-1].argmax()))
    calls = []
    for obj, name in ((ver.cache, "prepare"), (eng.model, "forward")):
        inner = getattr(obj, name)
        monkeypatch.setattr(obj, name, lambda *a, _f=inner, _n=name, **kw: calls.append((_n, a[2] if _n == "forward"
                                                                                        else None)) or _f(*a, **kw))
    exact = eng.model.step_fn is not None
    g = [0, 0]
    for k, wrong in [((5, 9), (2, None)), ((12, 3), (None, 0)), ((2, 1), (1, None))]:  # crosses pages, rejects
        feeds = []
        for s in (0, 1):
            props = toks[s][g[s] + 1:g[s] + 1 + k[s]]
            if wrong[s] is not None:
                props[wrong[s]] = (props[wrong[s]] + 1) % 300
            feeds.append([toks[s][g[s]], *props])
        calls.clear()
        rows = ver.step([0, 1], feeds)
        assert calls == [("prepare", None), ("forward", ver.cache)]
        for s in (0, 1):
            kept = (wrong[s] if wrong[s] is not None else k[s]) + 1
            for i in range(kept):
                if exact:
                    assert torch.equal(rows[s][i], ref[s][g[s] + i]), (k, s, i)
                else:
                    torch.testing.assert_close(rows[s][i], ref[s][g[s] + i], rtol=0, atol=1e-5)
            ver.keep(s, kept)
            g[s] += kept
            assert ver.cache.length(s) == len(prompts[s]) + g[s]
    for s in (0, 1):  # the plain run's cache, cut to the same length: the very same bytes
        plain.cache.truncate(s, len(prompts[s]) + g[s])
        for a, b in zip(_page_bytes(plain.cache, s), _page_bytes(ver.cache, s)):
            assert torch.equal(a, b)
    assert ver.cache.stats()["used"] == plain.cache.stats()["used"]
    with pytest.raises(ValueError, match="cannot keep 0 of 3"):
        ver.step([0], [[1, 2, 3]])
        ver.keep(0, 0)


# ---- speculation turns itself off --------------------------------------------------------------------

def _req(mode=SpeculativeMode.NGRAM, k=4, max_tokens=500) -> Request:
    return Request("r", 0, [1, 2, 3], SamplingParams(max_tokens=max_tokens), frozenset(), SpecState(mode, k_max=k, k=k),
                   generated=1)


def _run(req: Request, cfg: SpecConfig, accepted_per_step, steps: int) -> list[int]:
    """Drive ``req`` through ``steps`` decode steps (as decode_step + the scheduler would count
    them; ``accepted_per_step``: an int, or a list of one per step); returns the proposals made at
    each step."""
    made = []
    for i in range(steps):
        k = spec.num_proposals(req, 512)
        made.append(k)
        req.spec.costs = [cfg.break_even(req.spec.mode) * i for i in range(req.spec.k_max + 1)]  # as decode_step sets them
        if k:
            acc = accepted_per_step if isinstance(accepted_per_step, int) else accepted_per_step[i]
            spec.record(req, k, min(k, acc), cfg)
        req.steps += 1
    return made


def test_low_acceptance_turns_speculation_off_and_a_draft_probes_again():
    tuned = Tuned(probe_steps=4, off_steps=10, ngram_cost=0.2, draft_cost=0.2)
    cfg = SpecConfig(adaptive=False, tuned=tuned)
    req = _req(SpeculativeMode.DRAFT)
    made = _run(req, cfg, accepted_per_step=0, steps=20)
    assert made[:4] == [4] * 4 and made[4:14] == [0] * 10 and made[14:18] == [4] * 4 and made[18:] == [0, 0]
    assert req.spec.turned_off == 2
    assert spec.report(req)["kvwire.spec.turned_off"] == 2
    # n-gram: no probing (the shadow lookup decides when to come back, see below)
    assert _run(_req(), cfg, accepted_per_step=0, steps=40) == [4] * 4 + [0] * 36
    # at break-even or above it stays on: 1 of 4 accepted beats 0.2 per proposed token
    on = _req()
    assert _run(on, cfg, accepted_per_step=1, steps=20) == [4] * 20 and on.spec.turned_off == 0
    # the draft's break-even is its own (drafting costs): 1 of 4 is too little there
    drafted = _req(SpeculativeMode.DRAFT)
    assert _run(drafted, dataclasses.replace(cfg, tuned=dataclasses.replace(tuned, draft_cost=0.5)), accepted_per_step=1, steps=6)[4:] == [0, 0]
    # off_steps 0: off for good; auto_off False: never off
    assert _run(_req(SpeculativeMode.DRAFT), dataclasses.replace(cfg, tuned=dataclasses.replace(tuned, off_steps=0)), 0, 40)[4:] == [0] * 36
    assert _run(_req(), dataclasses.replace(cfg, auto_off=False), 0, 20) == [4] * 20


def test_a_few_rejections_after_accepted_ones_do_not_turn_ngram_off():
    """The running means forgive the end of a quoted run: 4 rejected steps after 10 accepted ones
    keep speculation on; a sustained stretch of rejections still turns it off."""
    cfg = SpecConfig(adaptive=False)  # probe_steps 8, ema 0.125, cost 0.3: a 4-proposal step costs 2.2
    req = _req()
    made = _run(req, cfg, [4] * 10 + [0] * 4 + [4] * 6, steps=20)
    assert made == [4] * 20 and req.spec.turned_off == 0
    made = _run(req, cfg, [0] * 20, steps=20)
    assert req.spec.turned_off == 1 and made[0] == 4 and made[-1] == 0
    first_off = made.index(0)
    assert 8 <= first_off < 20  # more than probe_steps' worth of rejections: the means had to fall
    # a request that starts out rejected turns off as soon as it has probe_steps verifications
    assert _run(_req(), cfg, 0, steps=12) == [4] * 8 + [0] * 4


def _generate(req: Request, tokens: list[int], cfg: SpecConfig) -> list[int]:
    """Plain steps emitting ``tokens`` one by one, as EngineCore.update applies them."""
    made = []
    for t in tokens:
        made.append(spec.num_proposals(req, 512))
        req.spec.costs = [cfg.break_even(req.spec.mode) * i for i in range(req.spec.k_max + 1)]
        req.context.append(t)
        req.generated += 1
        req.steps += 1
        spec.observe(req, cfg)
    return made


def test_ngram_comes_back_on_when_its_shadow_lookup_would_be_accepted():
    cfg = SpecConfig(adaptive=True, tuned=Tuned(probe_steps=3, ngram_cost=0.3))
    req = _req(k=4)
    req.context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    _run(req, cfg, accepted_per_step=0, steps=4)  # 3 rejected verifications: off
    assert req.spec.turned_off == 1 and spec.num_proposals(req, 512) == 0
    # new text, no earlier occurrence: nothing to score, it stays off
    assert _generate(req, [20, 21, 22, 23, 24, 25], cfg) == [0] * 6 and req.spec.turned_on == 0 and req.spec.meter[2] == 0
    # the text repeats itself: after "2 3", lookup proposes "4 5 ..." and is right every time
    _generate(req, [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 1, 2, 3, 4, 5], cfg)
    assert req.spec.turned_on == 1 and spec.num_proposals(req, 512) == 4
    # and a lookup that is wrong keeps it off
    other = _req(k=4)
    other.context = [1, 2, 3, 1, 2, 3]
    _run(other, cfg, accepted_per_step=0, steps=4)
    _generate(other, [1, 2, 9, 1, 2, 8, 1, 2, 7, 1, 2, 6, 1, 2, 5, 1, 2, 4], cfg)
    assert other.spec.meter[2] >= 3 and other.spec.turned_on == 0 and spec.num_proposals(other, 512) == 0


def test_turned_off_request_still_gives_plain_greedy_output(models):
    """On a model that rejects n-gram proposals, speculation turns off (fewer proposals than with
    auto_off disabled) and the output is plain greedy's either way."""
    target, _ = models
    prompts = [[40, 41, 42] * 9, list(range(5, 25)) * 2, [7, 8, 9, 10] * 6]
    params = SamplingParams(max_tokens=40, ignore_eos=True, speculative="ngram", num_speculative_tokens=4)
    runs = {}
    for auto in (True, False):
        llm = LLM(target, num_pages=128, speculative_auto_off=auto, speculative_adaptive=False)
        # a high, fixed break-even (a random model's acceptance is below it); greedy requests speculate in a batch
        llm.core.spec_cfg = dataclasses.replace(llm.core.spec_cfg, greedy_max_batch=0,
                                                tuned=Tuned(ngram_cost=0.9, measure_cost=False))
        reqs = [llm.core.requests[llm.add_request(p, params)] for p in prompts]
        while llm.has_unfinished():
            llm.step()
        runs[auto] = reqs
        assert llm.stats()["used"] == 0
    plain = LLM(target, num_pages=128).generate(prompts, dataclasses.replace(params, speculative="none"))
    assert sum(r.spec.drafted for r in runs[True]) > 0
    for on, off, ref in zip(runs[True], runs[False], plain):
        assert on.output_ids == off.output_ids == ref.token_ids
    assert sum(r.spec.turned_off for r in runs[True]) > 0 and sum(r.spec.turned_off for r in runs[False]) == 0
    assert sum(r.spec.drafted for r in runs[True]) < sum(r.spec.drafted for r in runs[False])


def test_in_a_crowded_step_only_seeded_sampled_requests_speculate(models):
    """Past greedy_max_batch requests in a step, greedy and unseeded sampled requests decode plainly
    (batch_aware); a seeded sampled one keeps proposing, so its tokens never depend on its batch:
    alone or with five others, the same output."""
    target, _ = models
    prompt = [40, 41, 42] * 9
    # a low temperature: the tiny model's output cycles as its greedy output does, so the lookup finds matches
    kinds = {"greedy": dict(), "unseeded": dict(temperature=0.05), "seeded": dict(temperature=0.05, seed=5)}
    llm = LLM(target, num_pages=256, speculative_auto_off=False, speculative_adaptive=False)  # k every step
    assert llm.core.spec_cfg.greedy_max_batch == 2
    drafted, outputs = {}, {}
    for name, kw in kinds.items():
        params = SamplingParams(max_tokens=12, ignore_eos=True, speculative="ngram", num_speculative_tokens=4, **kw)
        reqs = [llm.core.requests[llm.add_request(prompt, params)] for _ in range(6)]  # one step of 6
        while llm.has_unfinished():
            llm.step()
        drafted[name], outputs[name] = sum(r.spec.drafted for r in reqs), [r.output_ids for r in reqs]
    assert drafted["greedy"] == drafted["unseeded"] == 0 and drafted["seeded"] > 0
    alone = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, speculative="ngram",
                                                  num_speculative_tokens=4, **kinds["seeded"]))[0]
    assert all(out == outputs["seeded"][0] for out in outputs["seeded"]) and alone.token_ids == outputs["seeded"][0]
    assert llm.stats()["used"] == 0


# ---- cancellation in the middle of a verification step -------------------------------------------------

@pytest.mark.parametrize("mode", [pb.SamplingParams.SPECULATIVE_MODE_DRAFT, pb.SamplingParams.SPECULATIVE_MODE_NGRAM])
async def test_cancel_during_a_speculative_step_frees_target_and_draft_pages(models, mode):
    target, draft = models
    async with Harness(EngineConfig(model_dir=target, num_pages=128),
                       draft_cfg=EngineConfig(model_dir=draft, kv_dtype=KVDtype.BF16),
                       spec_config=SpecConfig(auto_off=False)) as h:
        runner, draft = h.engine.core.runner, h.engine.core.draft
        inner, inside, release = runner.step, threading.Event(), threading.Event()

        def step(seqs, tokens, chunks=()):  # hold the first verification step until the RPC is cancelled
            if any(len(t) > 1 for t in tokens) and not inside.is_set():
                inside.set()
                release.wait(10)
            return inner(seqs, tokens, chunks)
        runner.step = step
        call = h.decode.GenerateTokens(pb.GenerateTokensRequest(
            prompt_token_ids=[40, 41, 42] * 12, sampling=pb.SamplingParams(
                max_tokens=300, ignore_eos=True, speculative=mode, num_speculative_tokens=4)))
        await call.read()
        assert await asyncio.to_thread(inside.wait, 10)  # the verification step is running now
        if mode == pb.SamplingParams.SPECULATIVE_MODE_DRAFT:
            assert draft.cache.stats()["used"] > 0
        call.cancel()
        await asyncio.sleep(0.2)
        release.set()
        assert await h.pools_back_to(64, 128)
        assert runner.cache.stats()["used"] == 0 and draft.cache.stats()["used"] == 0


def test_warm_up_prices_verification_rows_and_gives_its_pages_back(models):
    runner = ModelRunner(load_engine(EngineConfig(model_dir=models[0], num_pages=64)), 64)
    assert runner.step_cost.extra(1, 1) is None
    runner.warm_up()
    assert all(runner.step_cost.extra(1, i) is not None for i in range(1, 9))
    assert runner.cache.stats()["used"] == 0
