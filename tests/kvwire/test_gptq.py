"""``--weights int4-gptq``: 4-bit blocks rounded with GPTQ's error feedback.

The feedback lowers a layer's output error on its inputs below both round-to-nearest and the same
groups' weighted fit without feedback; the weights it returns are exactly what its Q4_1 blocks
dequantize to (``gguf.quants``); a channel the inputs never drive neither breaks the inverse nor
keeps its weights. Loading, caching and fingerprinting on the embedded model: tests/kvwire/test_int4.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kvwire.model import awq, gptq, int4


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

