"""The loader: sharded checkpoints, bf16, and errors that name the file, tensor and expectation."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kvwire.config import DType
from kvwire.kv.dense import DenseKVCache
from kvwire.model.loader import LoadError, load_model


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
