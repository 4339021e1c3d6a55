"""Our model against HF transformers on tiny random checkpoints written with save_pretrained."""
from __future__ import annotations

import pytest
import torch
import transformers

from kvwire.generate import generate
from kvwire.kv.dense import DenseKVCache
from kvwire.model.loader import load_model
from kvwire.sampling_params import SamplingParams

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2)

CASES = {
    "llama-llama3-rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        rope_theta=500000.0)),
    "llama-linear-rope-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True)),
    "qwen2-bias": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict()),
    "mistral-sliding-window": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(
        sliding_window=16)),
}


def make_checkpoint(tmp_path_factory, name: str):
    config_cls, model_cls, extra = CASES[name]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**COMMON, **extra)).eval()
    if name == "qwen2-bias":  # random init leaves biases at zero; make them matter
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    hf, path = make_checkpoint(tmp_path_factory, request.param)
    return request.param, hf, load_model(path)


def test_logits_match_transformers(pair):
    name, hf, ours = pair
    torch.manual_seed(1)
    ids = torch.randint(3, COMMON["vocab_size"], (64,))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0].float()
    cache = DenseKVCache(ours.config, num_slots=1, max_len=64)
    got = ours.model(ids, cache.prepare([0], [64]), cache)
    assert (got - expected).abs().max().item() < 1e-4, name


def test_greedy_tokens_match_generate(pair):
    name, hf, ours = pair
    torch.manual_seed(2)
    prompt = torch.randint(3, COMMON["vocab_size"], (24,))
    with torch.no_grad():
        out = hf.generate(prompt[None], attention_mask=torch.ones(1, 24, dtype=torch.long),
                          max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    expected = out[0, 24:].tolist()
    got = generate(ours.model, prompt.tolist(), SamplingParams(max_tokens=32))
    assert got == expected, name
    if name == "mistral-sliding-window":  # 24 + 32 positions > 16: the window really applied
        assert ours.config.sliding_window == 16
