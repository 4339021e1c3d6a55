"""``--weights int4-gptq``: 4-bit blocks rounded with GPTQ's error feedback.

The feedback lowers a layer's output error on its inputs below both round-to-nearest and the same
groups' weighted fit without feedback; the weights it returns are exactly what its Q4_1 blocks
dequantize to (``gguf.quants``); a channel the inputs never drive neither breaks the inverse nor
keeps its weights; the embedded model computes its blocks once, caches them, reads them back
bit for bit, and its fingerprint names them."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kvwire.config import DEFAULT_MODEL_DIR, RuntimeConfig, WeightsMode
from kvwire.generate import generate
from kvwire.kv.dense import DenseKVCache
from kvwire.model import awq, gptq, int4
from kvwire.model.gguf_linear import GGUFLinear
from kvwire.model.loader import load_model
from kvwire.runtime import load_runtime
from kvwire.sampling_params import SamplingParams
from kvwire.tokenizer import ModelTokenizer


def layer(rows: int = 64, cols: int = 256, tokens: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [rows, cols] and inputs [tokens, cols] with correlated channels of varied scale (as a
    transformer's are): where the feedback has something to work with."""
    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(cols, cols, generator=gen) / cols ** 0.5 + torch.eye(cols)
    x = torch.randn(tokens, cols, generator=gen) @ mix * torch.exp(torch.randn(cols, generator=gen))
    return torch.randn(rows, cols, generator=gen) * 0.05, x


def output_error(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    return (x @ (w - wq).T).pow(2).mean().item()


def test_error_feedback_beats_rounding_each_weight_on_the_layer_output():
    w, x = layer()
    h = x.T @ x / x.shape[0]
    wq, (d, m) = gptq.gptq(w, h)
    rtn = int4.fake_quant(w)
    fitted = int4.fake_quant(w, dm=awq.fit_groups(w, torch.diag(h)))  # the same group fit, no feedback
    ours, theirs, fit = output_error(x, w, wq), output_error(x, w, rtn), output_error(x, w, fitted)
    assert ours < 0.7 * fit < 0.7 * theirs, (ours, fit, theirs)
    # Each weight is one of its group's 16 levels, and the blocks dequantize to exactly those values.
    assert torch.equal(d, d.half().float()) and torch.equal(m, m.half().float())
    levels = ((wq.view(64, 8, 32) - m[..., None]) / d[..., None])
    assert torch.allclose(levels, levels.round(), atol=1e-3) and levels.round().min() >= 0 and levels.round().max() <= 15
    raw = int4.q4_blocks(wq, "Q4_1", dm=(d, m))
    back = torch.from_numpy(dequantize(raw.numpy(), Q.Q4_1).astype(np.float32))
    assert torch.equal(back, wq)


def test_a_channel_the_inputs_never_drive_is_rounded_as_zero():
    w, x = layer()
    x[:, 5] = 0.0
    wq, (d, _) = gptq.gptq(w, x.T @ x / x.shape[0])
    assert torch.isfinite(wq).all()
    assert (wq[:, 5].abs() <= d[:, 0] * 0.5001).all()  # its group's level nearest zero
    assert (wq[:, 6].abs() > d[:, 0] * 0.5001).any()  # a driven channel keeps its weights
    with pytest.raises(ValueError, match="multiples of the group"):
        gptq.gptq(w[:, :48], torch.eye(48))


def _logits(model, cfg, ids: list[int]) -> torch.Tensor:
    cache = DenseKVCache(cfg, 1, len(ids))
    return model(torch.tensor(ids), cache.prepare([0], [len(ids)]), cache)


def _blocks(rt) -> dict[str, torch.Tensor]:
    return {n: m.dequantized_weight() for n, m in rt.model.named_modules() if isinstance(m, GGUFLinear)}


def test_int4_gptq_computes_once_caches_and_names_its_blocks(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVWIRE_AWQ_CACHE", str(tmp_path))
    monkeypatch.setattr(awq, "CALIBRATION", awq.Calibration(samples=4, tokens=64))
    cfg = RuntimeConfig(DEFAULT_MODEL_DIR, weights=WeightsMode.INT4_GPTQ, num_pages=32)
    with caplog.at_level(logging.INFO, logger="kvwire.model.gptq"):
        first = load_runtime(cfg)
    assert "computed" in caplog.text and awq.CALIBRATION.describe() in caplog.text
    assert len(list(tmp_path.glob("gptq-*.safetensors"))) == 1
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvwire.model.gptq"):
        second = load_runtime(cfg)
    assert "read from cache" in caplog.text
    a, b = _blocks(first), _blocks(second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for i, block in enumerate(first.model.layers):
        for name in awq.BLOCK_LINEARS:
            assert block.get_submodule(name).qtype == int4.INT4_TYPE, f"layers.{i}.{name}"
    assert first.model.lm_head.qtype == int4.HEAD_TYPE
    awq_rt = load_runtime(RuntimeConfig(DEFAULT_MODEL_DIR, weights=WeightsMode.INT4_AWQ, num_pages=32))
    assert any(not torch.equal(a[k], v) for k, v in _blocks(awq_rt).items() if k in a)  # feedback moved weights
    assert first.fingerprint == second.fingerprint and first.fingerprint.quantization == "int4-gptq"
    assert first.fingerprint.weights_sha256 not in (awq_rt.fingerprint.weights_sha256, first.checkpoint_sha256)
    # Close to the float model: the top token agrees at the prompt's end.
    prompt = ModelTokenizer(DEFAULT_MODEL_DIR).encode("The list type")
    ref = load_model(DEFAULT_MODEL_DIR).model
    ours, theirs = _logits(first.model, first.model_config, prompt)[-1], _logits(ref, first.model_config, prompt)[-1]
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0) > 0.99
    out = generate(first.model, prompt, SamplingParams(max_tokens=8, ignore_eos=True), cache=first.new_cache(8))
    assert len(out) == 8
