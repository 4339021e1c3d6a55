"""4-bit weights with error feedback (``--weights int4-gptq``), in the manner of GPTQ.

On top of int4-awq's folded scales (``kvwire.model.awq``), each block Linear is rounded one input
column at a time, and the rounding error of each column is pushed onto the columns not yet rounded
through the inverse Hessian of the layer's inputs (H = X^T X / n on calibration text), so the layer's
output error ||X W^T - X Q^T|| is minimized column by column instead of weight by weight:

    for column j:  q_j = Q(w_j);  e = (w_j - q_j) / U[j, j];  w_{j+1:} -= e U[j, j+1:]

with U the upper Cholesky factor of H^-1 (H damped by ``DAMP`` of its mean diagonal). Each Q4_1
group's scale and minimum are fitted (``awq.fit_groups``, weighted by H's diagonal) when the group's
first column is reached, on the weights as the earlier columns' errors left them, so the written
blocks hold exactly the levels the feedback saw. Sequential: the blocks are quantized in order, and
within a block Q/K/V, O, gate/up and down in turn, each Hessian taken from the inputs the layers
already rounded produce (int8 activations included). Measurements: docs/decisions/067-int4-gptq.md.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time

import torch
from safetensors.torch import load_file, save_file

from kvwire.config import ModelConfig
from kvwire.kv.dense import DenseKVCache
from kvwire.model import awq, int4
from kvwire.model.gguf_linear import GGUFLinear, native_shape
from kvwire.model.model import Transformer, rope_cos_sin

log = logging.getLogger(__name__)

BLOCK = 128  # columns whose updates are applied together before the rest is touched (a multiple of GROUP)
DAMP = 0.01  # of the mean Hessian diagonal, added to the diagonal: H stays invertible for dead channels
WINDOWS_PER_FORWARD = 8
COMPUTE_ORDER = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")  # awq.BLOCK_LINEARS, as Block.forward runs them
VERSION = 2  # part of the cache key: bumped whenever the blocks computed for the same inputs change


@torch.no_grad()
def gptq(w: torch.Tensor, h: torch.Tensor, group: int = int4.GROUP, block: int = BLOCK, damp: float = DAMP
         ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """w [out, in] fp32, h [in, in] the inputs' second moments -> (the rounded weights [out, in] fp32,
    each value d * q + m exactly; (d, m) [out, in / group] the groups' fp16-valued scales and minimums)."""
    out, n = w.shape
    if n % group or block % group:
        raise ValueError(f"gptq: {n} input channels, block {block} are not multiples of the group {group}")
    w = w.float().clone()
    h = h.double().clone()
    dead = torch.diag(h) == 0  # a channel the text never drove: its weights cannot matter, round them as zero
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.diag(h).mean() * torch.eye(n, dtype=h.dtype)
    importance = torch.diag(h).float()
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()  # [in, in]
    d_all = torch.zeros(out, n // group)
    m_all = torch.zeros(out, n // group)
    q_all = torch.empty_like(w)
    for b0 in range(0, n, block):
        b1 = min(b0 + block, n)
        wb, err, ub = w[:, b0:b1].clone(), torch.zeros(out, b1 - b0), u[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            g = col // group
            if col % group == 0:  # this group's (d, m), on its weights as the errors so far left them
                d, m = awq.fit_groups(wb[:, i:i + group], importance[col:col + group], group)
                d_all[:, g], m_all[:, g] = d[:, 0], m[:, 0]
            d, m = d_all[:, g], m_all[:, g]
            q = torch.round((wb[:, i] - m) / torch.where(d != 0, d, torch.ones_like(d))).clamp_(0, int4.LEVELS)
            q_all[:, col] = d * q + m
            e = (wb[:, i] - q_all[:, col]) / ub[i, i]
            wb[:, i:] -= e[:, None] * ub[i, i:][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ u[b0:b1, b1:]
    return q_all, (d_all, m_all)


class _Reached(Exception):
    """Raised by the hook once the Linear's input is taken: the rest of the block's forward is not needed."""


class _Hessian:
    """A forward pre-hook on one Linear of a block: sum x^T x (fp32) and the rows seen, then _Reached."""

    def __init__(self, block: torch.nn.Module, name: str):
        self.h: torch.Tensor | int = 0
        self.n = 0
        self.handle = block.get_submodule(name).register_forward_pre_hook(self._hook)

    def _hook(self, _mod, args):
        x = args[0].float()  # [tokens, in]
        self.h = self.h + x.T @ x
        self.n += x.shape[0]
        raise _Reached

    def remove(self) -> None:
        self.handle.remove()


@torch.inference_mode()
def quantize_sequential(model: Transformer, cfg: ModelConfig, windows: list[list[int]], progress: bool = False
                        ) -> dict[str, torch.Tensor]:
    """Round every block Linear of ``model`` (scales already folded) in place, block by block; returns
    {Linear path: its Q4_1 blocks, uint8 [out, in / 32 * 20]}. A shape the kernels do not take stays float."""
    batches = []  # [hidden states [tokens, hidden], cos, sin, cache] per forward of WINDOWS_PER_FORWARD windows
    for i in range(0, len(windows), WINDOWS_PER_FORWARD):
        part = windows[i:i + WINDOWS_PER_FORWARD]
        cache = DenseKVCache(cfg, len(part), max(len(w) for w in part))
        positions = cache.prepare(list(range(len(part))), [len(w) for w in part])
        cos, sin = rope_cos_sin(model.inv_freq, positions)
        batches.append([model.embed(torch.tensor([t for w in part for t in w])).float(), cos, sin, cache])
    blocks: dict[str, torch.Tensor] = {}
    layers = enumerate(model.layers)
    if progress:
        from tqdm import tqdm
        layers = tqdm(layers, total=len(model.layers), desc="int4-gptq", unit="layer")
    for i, block in layers:
        for name in COMPUTE_ORDER:  # each Hessian from the inputs the layers rounded before it produce
            lin = block.get_submodule(name)
            if not native_shape(int4.INT4_TYPE, *lin.weight.shape):
                continue
            stats = _Hessian(block, name)
            try:
                for x, cos, sin, cache in batches:  # up to this Linear; re-running rewrites the same KV positions
                    try:
                        block(x, cos, sin, cache)
                    except _Reached:
                        pass
            finally:
                stats.remove()
            wq, dm = gptq(lin.weight.float(), stats.h / stats.n)
            raw = int4.q4_blocks(wq, int4.INT4_TYPE, dm=dm)
            blocks[f"layers.{i}.{name}"] = raw
            _replace(block, name, GGUFLinear(raw, int4.INT4_TYPE, lin.in_features), lin)
        for b in batches:
            b[0] = block(b[0], b[1], b[2], b[3])  # the next block's inputs, through this block's 4-bit layers
    return blocks


def _replace(parent: torch.nn.Module, name: str, layer: GGUFLinear, old: torch.nn.Module) -> None:
    layer.bias = None if old.bias is None else old.bias.float()
    owner, _, child = name.rpartition(".")
    setattr(parent.get_submodule(owner), child, layer)


def cache_key(weights_sha256: str, calibration: awq.Calibration) -> str:
    spec = f"gptq|{awq.cache_key(weights_sha256, calibration)}|{BLOCK}|{DAMP}|{WINDOWS_PER_FORWARD}|{int4.INT4_TYPE}|{VERSION}"
    return hashlib.sha256(spec.encode()).hexdigest()[:24]


def calibrate_model(model: Transformer, cfg: ModelConfig, model_dir, weights_sha256: str,
                    calibration: awq.Calibration | None = None) -> str:
    """Fold int4-awq's scales into ``model``, then replace its block Linears by their GPTQ blocks (from the
    cache, or computed on ``calibration``'s text and cached). Returns the sha256 the fingerprint names:
    the checkpoint's hash extended by every block's bytes, so peers that rounded differently refuse each other's KV."""
    calibration = calibration or awq.CALIBRATION
    found = awq.calibrate_model(model, cfg, model_dir, weights_sha256, calibration)
    if model.embed.weight.device.type != "cpu":  # the blocks run on the CPU kernels: as int4-awq, whose layers stay float here
        awq.quantize_blocks(model, found)
        return awq.scales_sha256(weights_sha256, found)
    path = awq.cache_dir() / f"gptq-{cache_key(weights_sha256, calibration)}.safetensors"
    t0 = time.perf_counter()
    if path.is_file():
        blocks = load_file(str(path))
        for name, raw in blocks.items():
            i, _, rest = name.removeprefix("layers.").partition(".")
            block = model.layers[int(i)]
            old = block.get_submodule(rest)
            _replace(block, rest, GGUFLinear(raw, int4.INT4_TYPE, old.in_features), old)
        how = "read from cache"
    else:
        windows = calibration.windows(awq.tokenizer_for(model_dir).encode)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one thread's sums: bit-identical blocks in every process, whatever its threads
        try:
            blocks = quantize_sequential(model, cfg, windows, progress=cfg.num_layers * cfg.hidden_size > 8192)
        finally:
            torch.set_num_threads(threads)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save_file({k: v.contiguous() for k, v in blocks.items()}, str(tmp), metadata={"calibration": calibration.describe()})
        os.replace(tmp, path)  # atomic: a cached file is always whole
        how = "computed"
    log.info("int4-gptq: %d layers' blocks %s (calibration text: %s) in %.1f s", len(blocks), how,
             calibration.describe(), time.perf_counter() - t0)
    sha = hashlib.sha256(weights_sha256.encode())
    for name in sorted(blocks):
        sha.update(name.encode())
        sha.update(blocks[name].numpy().tobytes())
    return sha.hexdigest()
