"""The loader: sharded checkpoints, bf16, errors that name the file, tensor and expectation, and int8/fp8
layers built as the checkpoint is read, bit-identical to quantizing a fp32 load."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file

from kvwire.config import DType, QuantMode
from kvwire.fingerprint import fingerprint
from kvwire.kv.dense import DenseKVCache
from kvwire.model import quant, registry
from kvwire.model.loader import LoadError, load_model
from kvwire.model.quant import HEAD_QUANTIZED, load_quantizer, quantize_model
from kvwire.model.source import eos_token_ids
from kvwire.runtime import EngineConfig, load_engine
from kvwire.tokenizer import ModelTokenizer
from tests.kvwire.gguf_files import tiny_bpe, write_from_hf

MODELS = Path(__file__).resolve().parents[2] / "models"
REAL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path)
    return hf, path


def copy_dir(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def logits(loaded, ids):
    cache = DenseKVCache(loaded.config, 1, len(ids))
    return loaded.model(ids, cache.prepare([0], [len(ids)]), cache)


def test_sharded_checkpoint_loads_like_single(checkpoint, tmp_path):
    hf, path = checkpoint
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    ids = torch.arange(3, 40)
    a, b = load_model(path), load_model(sharded)
    torch.testing.assert_close(logits(a, ids), logits(b, ids))
    assert a.weights_sha256 == b.weights_sha256


def test_bf16_load_is_close_to_fp32(checkpoint):
    _, path = checkpoint
    ids = torch.arange(3, 40)
    full, half = load_model(path), load_model(path, dtype=DType.BF16)
    assert half.model.layers[0].mlp.down.weight.dtype == torch.bfloat16
    assert (logits(full, ids) - logits(half, ids)).abs().max() < 0.05


def test_missing_config(tmp_path):
    with pytest.raises(LoadError, match="missing config.json"):
        load_model(tmp_path)


def test_missing_weights(checkpoint, tmp_path):
    d = copy_dir(checkpoint[1], tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(LoadError, match="missing model.safetensors"):
        load_model(d)


def test_unsupported_architecture(checkpoint, tmp_path):
    d = copy_dir(checkpoint[1], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match="GPT2LMHeadModel.*not supported"):
        load_model(d)


def test_wrong_shape_names_file_tensor_and_expectation(checkpoint, tmp_path):
    d = copy_dir(checkpoint[1], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name][:, :16].contiguous()
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(LoadError) as e:
        load_model(d)
    msg = str(e.value)
    assert "model.safetensors" in msg and name in msg and "(64, 16)" in msg and "(64, 32)" in msg


def test_missing_tensor_is_named(checkpoint, tmp_path):
    d = copy_dir(checkpoint[1], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(LoadError, match="'model.norm.weight' is missing"):
        load_model(d)


def test_index_cannot_escape_model_dir(checkpoint, tmp_path):
    d = copy_dir(checkpoint[1], tmp_path / "m")
    (tmp_path / "outside.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    names = load_file(d / "model.safetensors").keys()
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "../outside.safetensors" for n in names}}))
    with pytest.raises(LoadError, match="outside the model directory"):
        load_model(d)


def test_symlink_cannot_escape_model_dir(checkpoint, tmp_path):
    d = copy_dir(checkpoint[1], tmp_path / "m")
    outside = tmp_path / "elsewhere.safetensors"
    (d / "model.safetensors").rename(outside)
    os.symlink(outside, d / "model.safetensors")
    with pytest.raises(LoadError, match="outside the model directory"):
        load_model(d)


# ---- int8/fp8 layers built as the loader reads (no fp32 model first) -------------------------------

def assert_bit_identical(ref: torch.nn.Module, got: torch.nn.Module):
    """Same module tree, same state names, and every tensor bit for bit (dtype, shape, bytes)."""
    assert [(n, type(m)) for n, m in ref.named_modules()] == [(n, type(m)) for n, m in got.named_modules()]
    a, b = ref.state_dict(), got.state_dict()
    assert list(a) == list(b)
    for name in a:
        x, y = a[name], b[name]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), name


def load_then_quantize(path, mode: QuantMode):
    loaded = load_model(path)
    return quantize_model(loaded.model, mode, include_lm_head=mode in HEAD_QUANTIZED), loaded.weights_sha256


@pytest.fixture(scope="module")
def biased_bf16_sharded(tmp_path_factory):
    """Qwen2 layout (q/k/v biases, tied embeddings), stored bf16 in shards."""
    torch.manual_seed(1)
    cfg = transformers.Qwen2Config(vocab_size=tiny_bpe().get_vocab_size(), hidden_size=64,
                                   intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_proj.bias.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("qwen2")
    hf.to(torch.bfloat16).save_pretrained(path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").exists()
    return path


@pytest.mark.parametrize("mode", [QuantMode.INT8, QuantMode.FP8])
@pytest.mark.parametrize("source", ["llama-fp32", "qwen2-bf16-sharded", "qwen2-gguf-q8_0", "kvwire-tiny"])
def test_quantizing_while_loading_is_bit_identical_to_load_then_quantize(
        source, mode, checkpoint, biased_bf16_sharded, tmp_path, monkeypatch):
    monkeypatch.setattr(quant, "QUANT_BLOCK_ELEMS", 256)  # several blocks per piece
    if source == "llama-fp32":
        path = checkpoint[1]
    elif source == "qwen2-bf16-sharded":
        path = biased_bf16_sharded
    elif source == "kvwire-tiny":
        path = MODELS / "kvwire-tiny"
    else:
        hf = transformers.Qwen2ForCausalLM.from_pretrained(biased_bf16_sharded, dtype=torch.float32)
        path = write_from_hf(hf, tiny_bpe(), tmp_path / "tiny.Q8_0.gguf", "qwen2", GGMLQuantizationType.Q8_0)
    ref, ref_sha = load_then_quantize(path, mode)
    got = load_model(path, quantize=load_quantizer(mode, include_lm_head=mode in HEAD_QUANTIZED))
    assert_bit_identical(ref, got.model)
    assert got.weights_sha256 == ref_sha
    if source.startswith("qwen2"):
        assert got.model.layers[0].attn.qkv.bias.abs().sum() > 0  # the biases arrived
        assert got.model.embed.weight.dtype == torch.float32  # the table stays fp32 for the lookup


@pytest.mark.parametrize("mode", [QuantMode.INT8, QuantMode.FP8])
def test_engine_fingerprint_unchanged_by_quantizing_while_loading(mode):
    path = MODELS / "kvwire-tiny"
    engine = load_engine(EngineConfig(model_dir=path, weights=mode))
    ref, ref_sha = load_then_quantize(path, mode)
    assert_bit_identical(ref, engine.model)
    assert engine.fingerprint == fingerprint(path, engine.model_config, ref_sha, mode.value, DType.FP32.value)


@pytest.mark.real_model
@pytest.mark.skipif(not registry.is_cached(REAL), reason=f"{REAL} is not fetched (python -m tools.fetch_model {REAL})")
@pytest.mark.parametrize("mode", [QuantMode.INT8, QuantMode.FP8])
def test_real_model_quantized_while_loading_is_bit_identical(mode):
    ref, ref_sha = load_then_quantize(REAL, mode)
    got = load_model(REAL, quantize=load_quantizer(mode, include_lm_head=mode in HEAD_QUANTIZED), progress=False)
    assert_bit_identical(ref, got.model)
    assert got.weights_sha256 == ref_sha


@pytest.mark.parametrize("weights", ["int8", "bf16"])
def test_loading_imports_neither_dynamo_nor_triton(tmp_path, weights):
    """The loader builds the model on the meta device; arithmetic there (a random init, RoPE
    frequencies) runs torch's Python reference ops, which import torch._dynamo and Triton: about
    130 MB more resident in every service process. Loading, a prompt and a decode step must not."""
    import subprocess
    import sys
    code = (
        "import sys, torch\n"
        "from kvwire.config import DEFAULT_MODEL_DIR\n"
        "from kvwire.config import QuantMode\n"
        "from kvwire.runtime import EngineConfig, load_engine\n"
        f"rt = load_engine(EngineConfig(model_dir=DEFAULT_MODEL_DIR, weights=QuantMode('{weights}')))\n"
        "cache = rt.new_cache(8)\n"
        "rt.model(torch.tensor([1, 2, 3]), cache.prepare([0], [3]), cache)\n"
        "rt.model(torch.tensor([4]), cache.prepare([0], [1]), cache)\n"
        "print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert out.strip().splitlines()[-1] == "[]", out


def test_eos_ids_include_tokenizer_configs_eos_token(tmp_path):
    """eos_token_ids reads tokenizer_config.json's eos_token through tokenizer.json, as ModelTokenizer does."""
    model = tmp_path / "m"
    shutil.copytree(MODELS / "kvwire-tiny", model)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((model / name).read_text())
        cfg["eos_token_id"] = 2
        (model / name).write_text(json.dumps(cfg))
    eos = ModelTokenizer(model).tok.token_to_id("<|eos|>")
    assert eos not in (None, 2)
    assert eos_token_ids(model) == {2, eos} == ModelTokenizer(model).eos_ids
