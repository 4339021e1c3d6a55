"""Sampling controls across the disaggregated path: token 0 sampled by prefill_svc with the same
processing decode would apply (repetition penalty over the prompt, min_tokens holding decode's
whole stop set back), later tokens by decode; refusals are INVALID_ARGUMENT naming the field."""
from __future__ import annotations

import grpc
import pytest

from kvwire.generate import generate
from kvwire.runtime import load_engine
from kvwire.sampling_params import SamplingParams
from protos.kvwire.v1 import kvwire_pb2 as pb
from tests.decode_svc.harness import Harness
from tests.decode_svc.test_engine import expect_status

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], list(range(20, 47))]


async def test_remote_and_local_first_tokens_are_the_processed_ones(cfg):
    ref = load_engine(cfg)
    async with Harness(cfg) as h:
        for prompt in PROMPTS:
            plain = await h.generate(prompt, max_tokens=6, kv_source=pb.KV_SOURCE_REMOTE)
            controls = [dict(repetition_penalty=3.0), dict(logit_bias={plain[0]: -100.0}),
                        dict(presence_penalty=1.5, frequency_penalty=1.0, temperature=0.9, seed=4, min_p=0.05),
                        dict(min_tokens=3, stop_token_ids=[plain[0]])]
            for kw in controls:
                local = await h.generate(prompt, max_tokens=6, kv_source=pb.KV_SOURCE_LOCAL, **kw)
                remote = await h.generate(prompt, max_tokens=6, kv_source=pb.KV_SOURCE_REMOTE, **kw)
                want = generate(ref.model, prompt, SamplingParams(max_tokens=6, **kw), cache=ref.new_cache(64))
                assert remote == local == want, kw
            assert (await h.generate(prompt, max_tokens=6, kv_source=pb.KV_SOURCE_REMOTE,
                                     logit_bias={plain[0]: -100.0}))[0] != plain[0]
            # min_tokens at token 0 on prefill_svc: the stop token is held back there too
            held = await h.generate(prompt, max_tokens=6, kv_source=pb.KV_SOURCE_REMOTE, min_tokens=1,
                                    stop_token_ids=[plain[0]])
            assert held[0] != plain[0]
        assert await h.pools_back_to(64, 128)


@pytest.mark.parametrize("sampling, match", [
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(min_p=1.5), "min_p must be in [0, 1]"),
    (dict(logit_bias={300: 1.0}), "sampling.logit_bias has token ids [300] outside the vocabulary"),
    (dict(min_tokens=9), "min_tokens (9) must not exceed max_tokens (5)"),
    (dict(logprobs=21), "logprobs must be in [0, 20]"),
])
async def test_invalid_controls_are_invalid_argument(cfg, sampling, match):
    async with Harness(cfg) as h:
        await expect_status(h.generate([5, 6], max_tokens=5, **sampling), grpc.StatusCode.INVALID_ARGUMENT, match)


async def test_logprobs_come_with_their_tokens_wherever_token_0_was_sampled(cfg):
    async def run(h, kv_source, **sampling):
        ids, lps = [], []
        async for m in h.decode.GenerateTokens(pb.GenerateTokensRequest(
                prompt_token_ids=PROMPTS[1], sampling=pb.SamplingParams(max_tokens=7, **sampling), kv_source=kv_source)):
            assert len(m.logprobs) == (len(m.token_ids) if "logprobs" in sampling else 0)
            ids += m.token_ids
            lps += [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top_logprobs]) for lp in m.logprobs]
        return ids, lps

    async with Harness(cfg) as h:
        local = await run(h, pb.KV_SOURCE_LOCAL, logprobs=4, temperature=0.8, seed=2)
        remote = await run(h, pb.KV_SOURCE_REMOTE, logprobs=4, temperature=0.8, seed=2)
        assert [t for t, _, _ in local[1]] == local[0] and len(local[1][0][2]) == 4
        assert remote[0] == local[0]
        for (_, a, top_a), (_, b, top_b) in zip(local[1], remote[1]):
            assert a == pytest.approx(b, abs=1e-5)
            assert [t for t, _ in top_a] == [t for t, _ in top_b]
        assert (await run(h, pb.KV_SOURCE_REMOTE))[1] == []


async def test_prompt_logprobs_prefill_in_decode_and_refuse_a_forced_remote(cfg):
    async with Harness(cfg) as h:  # the policy sends every AUTO prompt to prefill_svc (which computes no
        # prompt logprobs), but not these
        msgs = [m async for m in h.decode.GenerateTokens(pb.GenerateTokensRequest(
            prompt_token_ids=PROMPTS[1], sampling=pb.SamplingParams(max_tokens=3, prompt_logprobs=2)))]
        assert [lp.token_id for lp in msgs[0].prompt_logprobs] == PROMPTS[1][1:]
        assert all(len(lp.top_logprobs) == 2 for lp in msgs[0].prompt_logprobs)
        assert not any(m.prompt_logprobs for m in msgs[1:])
        await expect_status(h.generate(PROMPTS[1], kv_source=pb.KV_SOURCE_REMOTE, max_tokens=3, prompt_logprobs=0),
                            grpc.StatusCode.INVALID_ARGUMENT, "prompt_logprobs are computed by decode's own prefill")


def test_prefill_is_sent_decodes_whole_stop_set_when_min_tokens_holds_it_back():
    """prefill_svc's own EOS set may differ from decode's: with min_tokens, decode sends its stops
    (EOS included) as stop_token_ids with ignore_eos, so token 0 is masked exactly as decode would."""
    from decode_svc.remote_prefill import first_token_params
    from kvwire.engine.request import Request

    params = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[7])
    sent = first_token_params(Request("r", 0, [5, 6], params, frozenset({7, 1, 299})))
    assert sent.stop_token_ids == (1, 7, 299) and sent.ignore_eos and sent.min_tokens == 2
    plain = SamplingParams(max_tokens=8, stop_token_ids=[7])
    assert first_token_params(Request("r", 0, [5, 6], plain, frozenset({7, 1}))) is plain  # nothing to hold back
