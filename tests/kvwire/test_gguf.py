"""GGUF checkpoints: tiny files written with gguf.GGUFWriter as llama.cpp lays them out, loaded by our
loader and by transformers' own GGUF loading (the oracle): logits, greedy tokens, tokenizer, config,
fingerprint and errors."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter

from kvwire.config import DType, QuantMode
from kvwire.fingerprint import tokenizer_sha256
from kvwire.generate import generate
from kvwire.kv.dense import DenseKVCache
from kvwire.model.loader import LoadError, load_config, load_model
from kvwire.model import registry
from kvwire.model.registry import resolve_model_path
from kvwire.model.source import eos_token_ids
from kvwire.runtime import EngineConfig, load_engine
from kvwire.sampling_params import SamplingParams
from kvwire.tokenizer import ChatMessage, ModelTokenizer
from tests.kvwire.gguf_files import TEXTS, hf_logits, tiny_bpe, write_from_hf, write_random, write_sentencepiece

ARCHS = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, False),
         "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, True)}  # qwen2: tied embeddings


@pytest.fixture(scope="module")
def tok():
    return tiny_bpe()


@pytest.fixture(scope="module")
def hf_models(tok):
    models = {}
    for arch, (config_cls, model_cls, tied) in ARCHS.items():
        torch.manual_seed(0)
        hf = model_cls(config_cls(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256, tie_word_embeddings=tied)).eval()
        if arch == "qwen2":  # random init leaves biases at zero; make them matter
            with torch.no_grad():
                for layer in hf.model.layers:
                    for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                        proj.bias.normal_(0, 0.5)
        models[arch] = hf
    return models


@pytest.fixture(scope="module", params=[(a, q) for a in ARCHS for q in ("F32", "Q8_0")], ids=lambda p: "-".join(p))
def case(request, hf_models, tok, tmp_path_factory):
    arch, qname = request.param
    d = tmp_path_factory.mktemp(f"{arch}-{qname}")
    path = write_from_hf(hf_models[arch], tok, d / f"tiny-{arch}.{qname}.gguf", arch, Q[qname])
    oracle = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=path.name, dtype=torch.float32).eval()
    return arch, qname, path, oracle, hf_models[arch]


def our_logits(loaded, ids: list[int]) -> torch.Tensor:
    cache = DenseKVCache(loaded.config, 1, len(ids))
    return loaded.model(torch.tensor(ids), cache.prepare([0], [len(ids)]), cache)


def test_logits_and_greedy_tokens_match_transformers_gguf_loading(case, tok):
    arch, qname, path, oracle, hf = case
    ours = load_model(path)
    ids = tok.encode("What is the capital of France? The for statement").ids
    got = our_logits(ours, ids)
    torch.testing.assert_close(got, hf_logits(oracle, ids), atol=2e-5, rtol=1e-4)
    if qname == "F32":  # the Q/K permutation round trip gives back the HF model itself
        torch.testing.assert_close(got, hf_logits(hf, ids), atol=2e-5, rtol=1e-4)
    with torch.no_grad():
        expected = oracle.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                                   pad_token_id=0)[0, len(ids):].tolist()
    assert generate(ours.model, ids, SamplingParams(max_tokens=12, ignore_eos=True)) == expected


def test_config_comes_from_metadata(case):
    arch, _, path, oracle, hf = case
    cfg = load_config(path)
    c = hf.config
    assert cfg.architecture == type(hf).__name__
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads) == (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                                  c.num_attention_heads, c.num_key_value_heads)
    assert cfg.tie_word_embeddings == (arch == "qwen2") and cfg.attention_bias == (arch == "qwen2")
    assert cfg.max_position_embeddings == 256 and cfg.rms_norm_eps == pytest.approx(c.rms_norm_eps)


def test_tied_gguf_shares_one_table(case):
    arch, _, path, _, _ = case
    m = load_model(path).model
    assert (m.lm_head.weight.data_ptr() == m.embed.weight.data_ptr()) == (arch == "qwen2")


def test_tokenizer_matches_transformers_gguf_tokenizer(case):
    _, _, path, _, _ = case
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = ModelTokenizer(path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    chat = [ChatMessage("user", "What is a list?")]
    expected = theirs.apply_chat_template([{"role": "user", "content": "What is a list?"}],
                                          add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert ours.encode_chat(chat) == list(expected)
    # eos_token_id, plus the control tokens llama.cpp also stops on
    assert ours.eos_token == "<|im_end|>"
    assert ours.eos_ids == {ours.tok.token_to_id("<|im_end|>"), ours.tok.token_to_id("<|endoftext|>")}


def test_sentencepiece_vocabulary_matches_transformers(tmp_path):
    path = write_sentencepiece(tmp_path / "spm.gguf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = ModelTokenizer(path)
    for text in TEXTS + ["  two leading spaces", "trailing ", "x\ny"]:
        ids = ours.encode(text)  # byte fallback for characters outside the pieces, <s> first
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.bos_token == "<s>" and ours.eos_ids == {2}


def test_directory_holding_one_gguf_and_quantized_modes(case):
    _, qname, path, _, _ = case
    assert load_config(path.parent) == load_config(path)
    engine = load_engine(EngineConfig(model_dir=path.parent, weights=QuantMode.INT8))
    assert engine.fingerprint.weights_sha256 == load_model(path).weights_sha256
    assert engine.fingerprint.tokenizer_sha256 == tokenizer_sha256(path)
    assert engine.fingerprint.model_name == path.stem
    assert load_model(path, dtype=DType.BF16).model.layers[0].mlp.down.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("qname", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_every_tensor_type_dequantizes_like_transformers(qname, tok, tmp_path):
    path = write_random(tmp_path / f"random.{qname}.gguf", Q[qname], tok)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    ids = tok.encode("What is the capital of France?").ids
    expected = hf_logits(oracle, ids)
    got = our_logits(load_model(path), ids)
    torch.testing.assert_close(got, expected, atol=1e-4 * max(1.0, expected.abs().max().item()), rtol=1e-4)


def test_fingerprint_tells_gguf_files_apart(hf_models, tok, tmp_path):
    a = write_from_hf(hf_models["llama"], tok, tmp_path / "a.gguf", "llama", Q.F32)
    b = write_from_hf(hf_models["llama"], tok, tmp_path / "b.gguf", "llama", Q.Q8_0)
    assert load_model(a).weights_sha256 != load_model(b).weights_sha256
    assert tokenizer_sha256(a) == tokenizer_sha256(b)  # same tokenizer metadata
    c = tmp_path / "c.gguf"
    shutil.copy(a, c)
    data = bytearray(c.read_bytes())
    marker = b"<|im_start|>assistant"
    at = data.index(marker)  # in the chat template string
    data[at:at + len(marker)] = b"<|im_start|>ASSISTANT"
    c.write_bytes(bytes(data))
    assert tokenizer_sha256(c) != tokenizer_sha256(a)
    assert load_model(c).weights_sha256 == load_model(a).weights_sha256


def test_eos_ids_without_tokenizer_files(case):
    _, _, path, _, _ = case
    tok_eos = ModelTokenizer(path).eos_ids
    assert eos_token_ids(path) == tok_eos and tok_eos


def test_bad_files_are_one_clear_error(tmp_path, hf_models, tok):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(LoadError, match=r"junk\.gguf: not a readable GGUF file"):
        load_model(junk)
    two = tmp_path / "two"
    two.mkdir()
    write_from_hf(hf_models["llama"], tok, two / "a.gguf", "llama")
    shutil.copy(two / "a.gguf", two / "b.gguf")
    with pytest.raises(LoadError, match="holds 2 GGUF files"):
        load_model(two)
    with pytest.raises(LoadError, match="not supported"):
        _write_arch(tmp_path / "gpt2.gguf", "gpt2")
        load_config(tmp_path / "gpt2.gguf")
    with pytest.raises(LoadError, match="no such file or directory"):
        load_model(tmp_path / "missing.gguf")


def test_registered_name_without_cache_says_how_to_fetch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative name that is not a path here
    name = "smollm2-135m-instruct"
    if registry.is_cached(name):
        assert resolve_model_path(name) == registry.cached_path(name)
    else:
        with pytest.raises(LoadError, match=f"python -m tools.fetch_model {name}"):
            resolve_model_path(name)


def _write_arch(path, arch: str):
    w = GGUFWriter(path, arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
