"""``--weights int4`` / ``int4-awq``: group-wise 4-bit weights from a float checkpoint as GGUF blocks.

Round-to-nearest takes, per group, the nearest of the 16 levels its fp16 scale and minimum define
(against a brute-force search over the levels); the blocks dequantize with ``gguf.quants`` to exactly
those values; AWQ's folded scales leave the float model's output unchanged; the embedded model loads
and generates in both modes, and int4-awq's scales and int4-gptq's blocks are cached and read back."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvwire.config import DEFAULT_MODEL_DIR, KVDtype, RuntimeConfig, WeightsMode
from kvwire.generate import generate
from kvwire.kv.dense import DenseKVCache
from kvwire.model import awq, int4
from kvwire.model.gguf_linear import GGUFLinear
from kvwire.model.loader import load_model
from kvwire.runtime import load_runtime
from kvwire.sampling_params import SamplingParams
from kvwire.tokenizer import ModelTokenizer
from tools.train_embedded import load_corpus


def weights(rows: int = 48, cols: int = 256) -> torch.Tensor:
    """Rows of varied magnitude, one group constant and one all zeros (d == 0)."""
    torch.manual_seed(0)
    w = torch.randn(rows, cols) * torch.rand(rows, 1) * 0.1
    w[0, :32] = 0.25
    w[1, 32:64] = 0.0
    return w


@pytest.mark.parametrize("symmetric", [False, True], ids=["q4_1", "q4_0"])
def test_rtn_takes_the_nearest_level_of_fp16_scale_and_minimum(symmetric):
    w = weights()
    q, d, m = int4.int4_grid(w, 32, symmetric)
    assert torch.equal(d, d.half().float()) and torch.equal(m, m.half().float())
    g = w.reshape(48, 8, 32)
    if symmetric:  # the largest magnitude is a level: -8 d
        big = g.gather(2, g.abs().argmax(2, keepdim=True))[..., 0]
        assert torch.equal(d, (big / -8).half().float()) and torch.equal(m, -8 * d)
    else:
        assert torch.equal(m, g.amin(2).half().float()) and torch.equal(d, ((g.amax(2) - g.amin(2)) / 15).half().float())
    levels = d[..., None] * torch.arange(16.0) + m[..., None]  # [rows, groups, 16]
    err = (levels[:, :, None, :] - g[..., None]).abs()  # [rows, groups, 32, 16]
    ours = err.gather(3, q.reshape(48, 8, 32, 1).long())[..., 0]
    assert torch.equal(ours, err.min(3).values)  # the nearest level (ties either way)
    assert q.max() <= 15 and torch.equal(int4.fake_quant(w, 32, symmetric)[0, :32], w[0, :32])  # constant group exact


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_blocks_dequantize_with_gguf_to_the_rtn_values(qtype):
    w = weights()
    raw = int4.q4_blocks(w, qtype)
    assert raw.shape == (48, 8 * (18 if qtype == "Q4_0" else 20)) and raw.dtype == torch.uint8
    ours = dequantize(raw.numpy(), Q[qtype])
    np.testing.assert_array_equal(ours, int4.fake_quant(w, 32, qtype == "Q4_0").numpy())
    # No worse than llama.cpp's own quantizer of the same format (which rounds against the unrounded scale).
    theirs = dequantize(quantize(w.numpy(), Q[qtype]), Q[qtype])
    assert ((ours - w.numpy()) ** 2).sum() <= ((theirs - w.numpy()) ** 2).sum()
    layer = int4.block_layer(w, qtype)
    assert isinstance(layer, GGUFLinear) and torch.equal(layer.dequantized_weight(), torch.from_numpy(ours))


def test_head_blocks_are_llamacpp_q8_0():
    w = weights()
    np.testing.assert_array_equal(int4.q8_0_blocks(w).numpy(), quantize(w.numpy(), Q.Q8_0))


def test_calibration_text_is_not_bench_accuracy_held_out_text():
    _, _, held = load_corpus()
    cal = awq.Calibration(samples=4, tokens=64)
    assert cal.names() and not set(cal.names()) & set(held)
    windows = cal.windows(ModelTokenizer(DEFAULT_MODEL_DIR).encode)
    assert len(windows) == 4 and all(len(w) == 64 for w in windows)
    assert "names[5::10]" in cal.describe() and "4 windows x 64 tokens" in cal.describe()


def _logits(model, cfg, ids: list[int]) -> torch.Tensor:
    cache = DenseKVCache(cfg, 1, len(ids))
    return model(torch.tensor(ids), cache.prepare([0], [len(ids)]), cache)


def test_awq_scales_fold_without_changing_the_float_model():
    loaded = load_model(DEFAULT_MODEL_DIR)  # grouped-query attention: 8 heads over 4 kv heads
    model, cfg = loaded.model, loaded.config
    ids = ModelTokenizer(DEFAULT_MODEL_DIR).encode("def f(x):\n    return x + 1\n")
    before = _logits(model, cfg, ids)
    qkv_before = model.layers[0].attn.qkv.weight.clone()
    found = awq.search(model, cfg, awq.Calibration(samples=2, tokens=64).windows(
        ModelTokenizer(DEFAULT_MODEL_DIR).encode))
    assert set(found.scales) == {f"layers.{i}.{n}" for i in range(cfg.num_layers) for n in awq.BLOCK_LINEARS}
    assert any(a > 0 for a in found.alphas.values())  # some scale is not all ones
    awq.fold(model, cfg, found.scales)
    assert not torch.equal(model.layers[0].attn.qkv.weight, qkv_before) or found.alphas["layers.0.attn.qkv"] == 0
    after = _logits(model, cfg, ids)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_search_never_loses_to_round_to_nearest_on_its_objective():
    torch.manual_seed(1)
    x = torch.randn(256, 64) * torch.linspace(0.1, 8.0, 64)  # a few loud input channels
    w = torch.randn(32, 64) * 0.05
    s, alpha = awq.search_scale(x, w, x.abs().mean(0))
    y = x @ w.T
    rtn = (x @ int4.fake_quant(w).T - y).pow(2).mean()
    scaled = (x @ (int4.fake_quant(w * s) / s).T - y).pow(2).mean()
    assert alpha > 0 and scaled < rtn


def test_clip_search_never_loses_to_the_full_range_and_its_blocks_dequantize_as_searched():
    w = weights()
    w[2, 0] = 1.5  # one outlier: clipping its group's range pays where its input is quiet
    importance = torch.rand(256) + 0.1
    importance[0] = 1e-3
    clip = awq.clip_search(w, importance)
    assert clip.shape == (48, 8) and torch.isin(clip, torch.tensor(awq.CLIP_GRID)).all() and clip[2, 0] < 1.0

    def err(c):
        return ((int4.fake_quant(w, clip=c) - w).pow(2) * importance).view(48, 8, 32).sum(2)
    assert torch.all(err(clip) <= err(torch.ones(48, 8)))
    raw = int4.q4_blocks(w, "Q4_1", clip)
    np.testing.assert_array_equal(dequantize(raw.numpy(), Q.Q4_1), int4.fake_quant(w, clip=clip).numpy())


def test_fitted_scale_and_minimum_never_lose_to_the_searched_range():
    w = weights()
    w[2, 0] = 1.5
    importance = torch.rand(256) + 0.1
    d, m = awq.fit_groups(w, importance)
    assert torch.equal(d, d.half().float()) and torch.equal(m, m.half().float()) and bool((d >= 0).all())

    def err(**kw):
        return ((int4.fake_quant(w, **kw) - w).pow(2) * importance).view(48, 8, 32).sum(2)
    clipped = err(clip=awq.clip_search(w, importance))
    fitted = err(dm=(d, m))
    assert torch.all(fitted <= clipped) and fitted.sum() < clipped.sum()
    raw = int4.q4_blocks(w, "Q4_1", dm=(d, m))
    np.testing.assert_array_equal(dequantize(raw.numpy(), Q.Q4_1), int4.fake_quant(w, dm=(d, m)).numpy())


def _dequantized(rt) -> dict[str, torch.Tensor]:
    return {n: m.dequantized_weight() for n, m in rt.model.named_modules() if isinstance(m, GGUFLinear)}


def test_int4_loads_blocks_of_the_checkpoint_and_generates():
    rt = load_runtime(RuntimeConfig(DEFAULT_MODEL_DIR, weights=WeightsMode.INT4, kv_dtype=KVDtype.FP8_E4M3, num_pages=32))
    ref = load_model(DEFAULT_MODEL_DIR).model
    for i, block in enumerate(rt.model.layers):
        for name in awq.BLOCK_LINEARS:
            layer = block.get_submodule(name)
            assert isinstance(layer, GGUFLinear) and layer.qtype == int4.INT4_TYPE
            torch.testing.assert_close(layer.dequantized_weight(), int4.fake_quant(ref.layers[i].get_submodule(name).weight),
                                       rtol=0, atol=0)
    assert isinstance(rt.model.lm_head, GGUFLinear) and rt.model.lm_head.qtype == "Q8_0"
    assert rt.fingerprint.quantization == "int4"
    prompt = ModelTokenizer(DEFAULT_MODEL_DIR).encode("The list type")
    out = generate(rt.model, prompt, SamplingParams(max_tokens=8, ignore_eos=True), cache=rt.new_cache(8))
    assert len(out) == 8
    # Close to the fp32 model (4-bit weights and int8 activations: the top token agrees at the prompt's end).
    ours = _logits(rt.model, rt.model_config, prompt)[-1]
    theirs = _logits(ref, rt.model_config, prompt)[-1]
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0) > 0.99


def _load_twice(weights: WeightsMode, logger: str, samples: int, tmp_path, monkeypatch, caplog):
    """The embedded model loaded in ``weights`` twice over one empty calibration cache (``samples`` windows
    of 64 tokens): (first runtime, its ``logger`` text, second runtime, its ``logger`` text)."""
    monkeypatch.setenv("KVWIRE_AWQ_CACHE", str(tmp_path))
    monkeypatch.setattr(awq, "CALIBRATION", awq.Calibration(samples=samples, tokens=64))
    cfg = RuntimeConfig(DEFAULT_MODEL_DIR, weights=weights, num_pages=32)
    logs = []
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=logger):
            logs += [load_runtime(cfg), caplog.text]
    return logs


def test_int4_awq_searches_once_caches_and_logs_its_calibration_text(tmp_path, monkeypatch, caplog):
    first, first_log, second, second_log = _load_twice(WeightsMode.INT4_AWQ, "kvwire.model.awq", 2,
                                                       tmp_path, monkeypatch, caplog)
    assert "searched" in first_log and awq.CALIBRATION.describe() in first_log
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1
    assert "read from cache" in second_log and awq.CALIBRATION.describe() in second_log
    a, b = _dequantized(first), _dequantized(second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rtn_rt = load_runtime(RuntimeConfig(DEFAULT_MODEL_DIR, weights=WeightsMode.INT4, num_pages=32))
    rtn = _dequantized(rtn_rt)
    assert any(not torch.equal(a[k], rtn[k]) for k in a)  # the scales changed what was rounded
    # The fingerprint names the scales too (peers with other scales refuse each other's KV); the checkpoint is the same.
    assert first.fingerprint == second.fingerprint and first.fingerprint.quantization == "int4-awq"
    assert first.fingerprint.weights_sha256 != rtn_rt.fingerprint.weights_sha256
    assert first.checkpoint_sha256 == rtn_rt.fingerprint.weights_sha256 == rtn_rt.checkpoint_sha256
    prompt = ModelTokenizer(DEFAULT_MODEL_DIR).encode("The list type")
    out = generate(first.model, prompt, SamplingParams(max_tokens=8, ignore_eos=True), cache=first.new_cache(8))
    assert len(out) == 8


def test_int4_gptq_computes_once_caches_and_names_its_blocks(tmp_path, monkeypatch, caplog):
    first, first_log, second, second_log = _load_twice(WeightsMode.INT4_GPTQ, "kvwire.model.gptq", 4,
                                                       tmp_path, monkeypatch, caplog)
    assert "computed" in first_log and awq.CALIBRATION.describe() in first_log
    assert len(list(tmp_path.glob("gptq-*.safetensors"))) == 1
    assert "read from cache" in second_log
    a, b = _dequantized(first), _dequantized(second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for i, block in enumerate(first.model.layers):
        for name in awq.BLOCK_LINEARS:
            assert block.get_submodule(name).qtype == int4.INT4_TYPE, f"layers.{i}.{name}"
    assert first.model.lm_head.qtype == int4.HEAD_TYPE
    awq_rt = load_runtime(RuntimeConfig(DEFAULT_MODEL_DIR, weights=WeightsMode.INT4_AWQ, num_pages=32))
    assert any(not torch.equal(a[k], v) for k, v in _dequantized(awq_rt).items() if k in a)  # feedback moved weights
    assert first.fingerprint == second.fingerprint and first.fingerprint.quantization == "int4-gptq"
    assert first.fingerprint.weights_sha256 not in (awq_rt.fingerprint.weights_sha256, first.checkpoint_sha256)
    # Close to the float model: the top token agrees at the prompt's end.
    prompt = ModelTokenizer(DEFAULT_MODEL_DIR).encode("The list type")
    ref = load_model(DEFAULT_MODEL_DIR).model
    ours, theirs = _logits(first.model, first.model_config, prompt)[-1], _logits(ref, first.model_config, prompt)[-1]
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0) > 0.99
    out = generate(first.model, prompt, SamplingParams(max_tokens=8, ignore_eos=True), cache=first.new_cache(8))
    assert len(out) == 8
