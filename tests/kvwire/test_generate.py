"""In-process generation: finish reasons, stop tokens and seeded sampling through the KV cache."""
from __future__ import annotations

import pytest
import torch
import transformers

from kvwire.generate import generate, generate_stream
from kvwire.model.loader import load_model
from kvwire.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).eval()
    path = tmp_path_factory.mktemp("gen")
    hf.save_pretrained(path)
    return load_model(path)


PROMPT = [5, 9, 13, 2, 40, 41]


def test_length_finish(loaded):
    out = list(generate_stream(loaded.model, PROMPT, SamplingParams(max_tokens=7)))
    assert len(out) == 7 and out[-1].finish_reason == "length"
    assert all(g.finish_reason is None for g in out[:-1])


def test_stop_token_and_eos(loaded):
    greedy = generate(loaded.model, PROMPT, SamplingParams(max_tokens=10))
    stop = greedy[3]
    first = greedy.index(stop)
    out = list(generate_stream(loaded.model, PROMPT, SamplingParams(max_tokens=10, stop_token_ids=(stop,))))
    assert [g.token for g in out] == greedy[:first + 1] and out[-1].finish_reason == "stop"
    out = list(generate_stream(loaded.model, PROMPT, SamplingParams(max_tokens=10), eos_ids=[stop]))
    assert out[-1].finish_reason == "stop"
    out = list(generate_stream(loaded.model, PROMPT, SamplingParams(max_tokens=10, ignore_eos=True), eos_ids=[stop]))
    assert len(out) == 10


def test_seeded_sampling_reproducible(loaded):
    p = SamplingParams(max_tokens=20, temperature=1.0, top_k=40, top_p=0.95, seed=123)
    a = generate(loaded.model, PROMPT, p)
    assert a == generate(loaded.model, PROMPT, p)
    others = {tuple(generate(loaded.model, PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=s)))
              for s in range(4)}
    assert len(others) > 1


def test_empty_prompt_rejected(loaded):
    with pytest.raises(ValueError, match="empty"):
        generate(loaded.model, [], SamplingParams())
