"""Log-probabilities against transformers' log_softmax of the same weights: raw (before penalties and
temperature), the same with speculative decoding, absent unless asked.

The checkpoint is stored in bf16 and served as stored with bf16 KV pages; transformers computes in
fp32 over the same (exact) weights: 2.3e-4 apart at most on this model. FP8 KV pages add about
4e-3, and weights=bf16 compute about 1e-3 (measured here; docs/serving.md says so)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from kvwire import LLM, SamplingParams
from tests.decode_svc.harness import tiny_model

PROMPTS = [list(range(5, 25)), [40, 41, 42] * 6]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("tiny"))
    transformers.LlamaForCausalLM.from_pretrained(path).to(torch.bfloat16).save_pretrained(path)  # stored bf16
    return path


@pytest.fixture(scope="module")
def oracle(model_dir):
    """transformers' model over the bf16 checkpoint, computed in fp32: log_softmax per position."""
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return logprobs


@pytest.mark.parametrize("speculative", ["none", "ngram"])
def test_logprobs_match_transformers_for_bf16_weights(model_dir, oracle, speculative):
    llm = LLM(model_dir, num_pages=64, weights="none", kv_dtype="bf16", speculative=speculative)
    llm.core.spec_cfg = dataclasses.replace(llm.core.spec_cfg, greedy_max_batch=0)
    # penalties and temperature change what is sampled, never the logprobs reported (raw)
    params = [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5),
              SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3, temperature=0.7, seed=1,
                             repetition_penalty=1.3, presence_penalty=0.5)]
    for out, prompt, p in zip(llm.generate(PROMPTS, params), PROMPTS, params):
        assert len(out.logprobs) == len(out.token_ids) == 12
        want = oracle(prompt + out.token_ids)[len(prompt) - 1:-1]  # row i: the distribution of token i
        for i, (lp, tok) in enumerate(zip(out.logprobs, out.token_ids)):
            assert lp.token_id == tok
            assert abs(lp.logprob - float(want[i, tok])) < 1e-3, (i, lp.logprob, float(want[i, tok]))
            top_ids, top_vals = zip(*lp.top)
            assert len(lp.top) == p.logprobs and list(top_vals) == sorted(top_vals, reverse=True)
            torch.testing.assert_close(torch.tensor(top_vals), want[i, list(top_ids)], atol=1e-3, rtol=0)
            assert top_vals[-1] >= float(want[i].topk(p.logprobs).values[-1]) - 1e-3  # they are the top ones
        if p.greedy:
            assert [lp.top[0][0] for lp in out.logprobs] == out.token_ids


def test_no_logprobs_unless_asked_and_zero_means_the_token_only(model_dir):
    llm = LLM(model_dir, num_pages=64)
    plain, only = llm.generate(PROMPTS[:1] * 2, [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, logprobs=0)])
    assert plain.logprobs is None
    assert [lp.token_id for lp in only.logprobs] == only.token_ids and all(lp.top == () for lp in only.logprobs)
    assert all(lp.logprob <= 0 for lp in only.logprobs)


@pytest.mark.parametrize("chunk", [None, 7])
def test_prompt_logprobs_match_transformers_whole_or_chunked_with_the_prefix_cache_on(model_dir, oracle, chunk):
    """Row r of the prompt scores token r + 1, across chunk boundaries; a cached prefix is not reused
    for it (its rows would be missing), and the first token is sampled from the last row as usual."""
    kw = dict(prefill_chunk_size=chunk, max_num_batched_tokens=16) if chunk else dict(chunked_prefill=False)
    llm = LLM(model_dir, num_pages=64, weights="none", kv_dtype="bf16", prefix_caching=True, **kw)
    prompt = PROMPTS[0] * 2  # 40 tokens: full pages to cache
    llm.generate([prompt], SamplingParams(max_tokens=2))  # its pages are now in the prefix cache
    plain, asked = llm.generate([prompt, prompt], [SamplingParams(max_tokens=4),
                                                   SamplingParams(max_tokens=4, prompt_logprobs=2)])
    assert plain.prompt_logprobs is None and asked.token_ids == plain.token_ids
    want = oracle(prompt)
    assert [lp.token_id for lp in asked.prompt_logprobs] == prompt[1:]
    for i, lp in enumerate(asked.prompt_logprobs):
        assert abs(lp.logprob - float(want[i, prompt[i + 1]])) < 1e-3, i
        assert [t for t, _ in lp.top] == want[i].topk(2).indices.tolist() or \
            abs(lp.top[0][1] - lp.top[1][1]) < 1e-3  # the same top two, up to a near tie
