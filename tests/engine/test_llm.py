"""The public in-process API: ``from kvwire import LLM, SamplingParams``, with no server."""
from __future__ import annotations

import dataclasses

import pytest

from kvwire import LLM, SamplingParams
from kvwire.errors import InvalidRequest, ResourceExhausted
from kvwire.generate import generate
from kvwire.runtime import EngineConfig, load_engine
from kvwire.sampling_params import FinishReason
from tests.decode_svc.harness import tiny_model

PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 31, 48)] + [[40, 41, 42] * 9]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, num_pages=128)


def reference(model_dir, prompt, params, weights):
    eng = load_engine(EngineConfig(model_dir=model_dir, weights=weights))  # the LLM's weights
    return generate(eng.model, prompt, params, cache=eng.new_cache(64))


def test_generate_batched_equals_one_sequence_reference(llm, model_dir):
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=3)] * 3
    outs = llm.generate(PROMPTS, params[:len(PROMPTS)])
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    for prompt, p, out in zip(PROMPTS, params, outs):
        assert out.token_ids == reference(model_dir, prompt, p, llm.runtime.cfg.weights)
        assert out.finish_reason is FinishReason.LENGTH and out.text is None  # no tokenizer here
    assert llm.stats()["used"] == 0 and not llm.has_unfinished()


def test_stream_yields_the_same_tokens_as_deltas(llm):
    params = SamplingParams(max_tokens=10)
    deltas = list(llm.stream(PROMPTS[1], params))
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].finish_reason is FinishReason.LENGTH
    assert [t for d in deltas for t in d.token_ids] == llm.generate(PROMPTS[1], params)[0].token_ids


def test_add_request_and_step_then_abort_frees_pages(llm):
    base = llm.stats()["free"]
    a = llm.add_request(PROMPTS[3], SamplingParams(max_tokens=200))
    b = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=3))
    seen = {a: [], b: []}
    for _ in range(4):
        for out in llm.step():
            seen[out.request_id] += out.token_ids
    assert len(seen[b]) == 3 and 1 <= len(seen[a]) < 200  # b finished (released); a still running
    assert llm.stats()["free"] < base and llm.has_unfinished()
    llm.abort(a)
    assert llm.stats()["free"] == base and not llm.has_unfinished()


def test_speculative_greedy_equals_plain(model_dir):
    spec = LLM(model_dir, num_pages=128, speculative="ngram", num_speculative_tokens=5)
    spec.core.spec_cfg = dataclasses.replace(spec.core.spec_cfg, greedy_max_batch=0)  # speculate batched too
    plain = spec.generate(PROMPTS, SamplingParams(max_tokens=20, speculative="none"))
    ngram = spec.generate(PROMPTS, SamplingParams(max_tokens=20))
    assert [o.token_ids for o in ngram] == [o.token_ids for o in plain]


def test_bad_requests_are_refused_with_actionable_errors(llm):
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        llm.add_request([5, 300])
    with pytest.raises(InvalidRequest, match="max_tokens must be positive"):
        llm.add_request([5], SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequest, match="exceeds the model's context of 512"):
        llm.add_request([5] * 500, SamplingParams(max_tokens=100))
    small = LLM(llm.runtime.cfg.model_dir, num_pages=8)
    with pytest.raises(ResourceExhausted, match="needs 13 KV pages"):
        small.add_request([5] * 100, SamplingParams(max_tokens=100))
    assert not llm.has_unfinished()


def test_text_in_text_out_with_the_embedded_model():
    from kvwire.config import DEFAULT_MODEL_DIR
    llm = LLM(DEFAULT_MODEL_DIR, num_pages=64)
    [out] = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out.token_ids) == 8 and out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_the_draft_is_quantized_like_the_target_unless_told(model_dir, tmp_path):
    from kvwire.config import QuantMode
    from kvwire.model.quant import Int8Linear
    draft = tiny_model(tmp_path / "draft", seed=1, hidden_size=32, num_layers=1)
    llm = LLM(model_dir, num_pages=128, draft_model=draft, speculative="draft")
    rt = llm.core.draft.runtime
    assert rt.cfg.weights is QuantMode.INT8 and any(isinstance(m, Int8Linear) for m in rt.model.modules())
    fp32 = LLM(model_dir, num_pages=128, draft_model=draft, draft_weights="none").core.draft.runtime
    assert fp32.cfg.weights is QuantMode.NONE and not any(isinstance(m, Int8Linear) for m in fp32.model.modules())
    llm.core.spec_cfg = dataclasses.replace(llm.core.spec_cfg, greedy_max_batch=0, auto_off=False)
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=12, speculative="none"))
    reqs = [llm.core.requests[llm.add_request(p, SamplingParams(max_tokens=12, num_speculative_tokens=3))]
            for p in PROMPTS]
    while llm.has_unfinished():
        llm.step()
    assert [r.output_ids for r in reqs] == [o.token_ids for o in plain]
    assert sum(r.spec.drafted for r in reqs) > 0 and llm.stats()["used"] == 0


def test_a_prompt_computed_beside_decoding_requests_gives_its_tokens_alone(model_dir):
    """Prompts arriving while others decode are computed in chunks inside the decode steps (in the
    same forward where the kernels' rows are independent), a few chunks a step: every request's
    tokens, greedy and seeded, are the ones it gets alone, and the running ones' are unchanged."""
    params = [SamplingParams(max_tokens=40), SamplingParams(max_tokens=12, temperature=0.8, seed=5),
              SamplingParams(max_tokens=12)]
    prompts = [PROMPTS[1], [(i * 7) % 200 + 3 for i in range(150)], [(i * 13) % 200 + 3 for i in range(70)]]
    alone = LLM(model_dir, num_pages=128, prefill_chunk_size=16)  # the same cuts, each prompt alone
    expect = [alone.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    llm = LLM(model_dir, num_pages=128, max_num_batched_tokens=48, prefill_chunk_size=16)
    runner, rode = llm.core.runner, []
    inner = runner.step

    def step(seqs, tokens, chunks=()):
        rode.append(len(chunks))
        return inner(seqs, tokens, chunks)
    runner.step = step
    first = llm.add_request(prompts[0], params[0])
    outs = {first: []}
    for _ in range(3):
        for o in llm.step():
            outs[o.request_id] += o.token_ids
    for p, q in zip(prompts[1:], params[1:]):
        outs[llm.add_request(p, q)] = []
    while llm.has_unfinished():
        for o in llm.step():
            outs[o.request_id] += o.token_ids
    assert list(outs.values()) == expect
    if runner.rows_independent:  # the 150-token prompt took 16-token chunks in several decode steps
        assert sum(1 for n in rode if n) >= 3 and max(rode) >= 2
