"""Activation-aware scales for 4-bit weights (``--weights int4-awq``), in the manner of AWQ.

Per Linear input channel c, s_c = mean|x_c| ** alpha (normalized so max * min = 1), with alpha
searched on a grid to minimize the layer's output error on calibration activations,
||X W^T - (X / s) Q(W s)^T||. The weights are multiplied by s before rounding and 1/s is folded
into the op that makes X, so the float model is unchanged (exact up to rounding):

* q/k/v (one input, attn_norm(x)): attn_norm's weight / s;   gate/up: mlp_norm's weight / s;
* o (input: attention output): the V rows / s; one scale per kv-head channel, shared by the query
  heads that read that kv head (grouped-query attention), so any head layout folds;
* down (input: silu(gate) * up): the up rows / s.

Activations come from one pass of the float model over calibration text that bench accuracy does not
score (``CALIBRATION``); alpha = 0 is round-to-nearest, so on the calibration objective the result is
never worse than RTN. Then each Q4_1 group's scale and minimum are fitted to its scaled weights,
weighted by the inputs' mean squares E[(x / s)^2] (``clip_search``, then ``fit_groups``).
Measurements and choices: docs/decisions/066-int4-weights.md.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvwire import envs
from kvwire.config import ModelConfig
from kvwire.files import LoadError
from kvwire.kv.dense import DenseKVCache
from kvwire.model import int4
from kvwire.model.linear import Linear
from kvwire.model.model import Transformer

log = logging.getLogger(__name__)

ALPHAS = tuple(i / 20 for i in range(20))  # the search grid: 0 (round-to-nearest) .. 0.95
CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)  # a group's range ratios tried (1.0: its extremes)
FIT_STEPS = 4  # weighted least-squares refits of each group's (d, m)
LOSS_ROWS = 512  # calibration tokens per layer the output error is measured on (a fixed subsample)
LOSS_OUT_ROWS = 512  # output rows per layer it is measured on
VERSION = 2  # the cache holds the search's scales and importances; clipping and fitting run at load  # of the search; part of the cache key
HELD_OUT_EVERY = 10  # bench accuracy's held-out topics: sorted names[::10] (tools/train_embedded.load_corpus)


@dataclass(frozen=True)
class Calibration:
    """Which text calibrates: pydoc_data.topics (Python's own help topics, shipped with CPython,
    PSF license), the sorted topic names at offset ``offset`` modulo 10, so never a held-out topic."""

    offset: int = 5
    samples: int = 32  # windows of ``tokens`` token ids
    tokens: int = 256

    def names(self) -> list[str]:
        from pydoc_data.topics import topics
        return sorted(topics)[self.offset::HELD_OUT_EVERY]

    def describe(self) -> str:
        return (f"pydoc_data.topics, sorted topic names[{self.offset}::{HELD_OUT_EVERY}] (not bench accuracy's "
                f"held-out [0::{HELD_OUT_EVERY}]), {self.samples} windows x {self.tokens} tokens")

    def windows(self, encode) -> list[list[int]]:
        """``samples`` windows of token ids, consecutive in the concatenated topics' text."""
        from pydoc_data.topics import topics
        stream: list[int] = []
        for name in self.names():
            stream += encode(topics[name])
            if len(stream) >= self.samples * self.tokens:
                break
        return [stream[i:i + self.tokens] for i in range(0, len(stream) - self.tokens + 1, self.tokens)][:self.samples]


CALIBRATION = Calibration()
AWQ_TYPE = int4.INT4_TYPE


@dataclass(frozen=True)
class AWQResult:
    calibration: str
    scales: dict[str, torch.Tensor]  # Linear path -> s [in] fp32 (o: equal across a kv head's query heads)
    importance: dict[str, torch.Tensor]  # Linear path -> mean x^2 [in] of its float input (the clipping search's weights)
    alphas: dict[str, float]  # Linear path -> the alpha chosen
    seconds: float
    cached: bool = False


class _Inputs:
    """Forward pre-hooks on the block Linears: mean |x| per input channel and a subsample of rows."""

    def __init__(self, model: Transformer, rows: int, total: int):
        self.sum: dict[str, torch.Tensor] = {}
        self.sq: dict[str, torch.Tensor] = {}
        self.count: dict[str, int] = {}
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.every = max(1, total // rows)  # keep every n-th row: LOSS_ROWS spread over all text
        self.handles = []
        for name, mod in model.named_modules():
            if isinstance(mod, Linear) and name.startswith("layers."):
                self.handles.append(mod.register_forward_pre_hook(self._hook(name)))

    def _hook(self, name: str):
        def hook(_mod, args):
            x = args[0].float()  # [tokens, in]
            self.sum[name] = self.sum.get(name, 0) + x.abs().sum(0)
            self.sq[name] = self.sq.get(name, 0) + (x * x).sum(0)
            self.count[name] = self.count.get(name, 0) + x.shape[0]
            self.rows.setdefault(name, []).append(x[::self.every].clone())
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def search_scale(x: torch.Tensor, w: torch.Tensor, mean_abs: torch.Tensor, group: int = int4.GROUP,
                 symmetric: bool = AWQ_TYPE == "Q4_0") -> tuple[torch.Tensor, float]:
    """The per-input-channel scale s [in] (and its alpha) minimizing ||x w^T - x (Q(w s) / s)^T||; x: [n, in], w: [out, in].
    Rows are quantized independently, so the error is measured on at most LOSS_OUT_ROWS of them (evenly spaced)."""
    w = w[::max(1, w.shape[0] // LOSS_OUT_ROWS)]
    y = x @ w.T  # [n, out]
    base = mean_abs.clamp(min=1e-8)
    best = (float("inf"), torch.ones_like(base), 0.0)
    for alpha in ALPHAS:
        s = base.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        wq = int4.fake_quant(w * s, group, symmetric) / s
        err = (x @ wq.T - y).pow(2).mean().item()
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


def _kv_shared(stat: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """[h * d] per-channel values -> the mean over the query heads sharing each kv head, broadcast back."""
    per = cfg.num_heads // cfg.num_kv_heads
    t = stat.view(cfg.num_kv_heads, per, cfg.head_dim).mean(1, keepdim=True)
    return t.expand(-1, per, -1).reshape(-1)


BLOCK_LINEARS = ("attn.qkv", "mlp.gate_up", "attn.o", "mlp.down")


@torch.no_grad()
def search(model: Transformer, cfg: ModelConfig, windows: list[list[int]], description: str = "",
           progress: bool = False, group: int = int4.GROUP, symmetric: bool = AWQ_TYPE == "Q4_0") -> AWQResult:
    """The scales of every block Linear, searched on ``windows`` (token ids) through the float model."""
    t0 = time.perf_counter()
    total = sum(len(w) for w in windows)
    inputs = _Inputs(model, LOSS_ROWS, total)
    try:
        step = 8  # windows per forward
        for i in range(0, len(windows), step):
            batch = windows[i:i + step]
            cache = DenseKVCache(cfg, len(batch), max(len(w) for w in batch))
            positions = cache.prepare(list(range(len(batch))), [len(w) for w in batch])
            # One logits row: the head's product is not needed, only the blocks' inputs.
            model(torch.tensor([t for w in batch for t in w]), positions, cache, logits_rows=torch.tensor([0]))
    finally:
        inputs.remove()
    scales, alphas, importance = {}, {}, {}
    names = [f"layers.{i}.{n}" for i in range(cfg.num_layers) for n in BLOCK_LINEARS]
    if progress:
        from tqdm import tqdm
        names = tqdm(names, desc="int4-awq scales", unit="layer")
    for name in names:
        lin = model.get_submodule(name)
        mean = inputs.sum[name] / inputs.count[name]  # [in]
        if name.endswith("attn.o"):
            mean = _kv_shared(mean, cfg)
        x = torch.cat(inputs.rows.pop(name))  # [rows, in]
        scales[name], alphas[name] = search_scale(x, lin.weight.float(), mean, group, symmetric)
        importance[name] = inputs.sq[name] / inputs.count[name]
    return AWQResult(description, scales, importance, alphas, time.perf_counter() - t0)


def clip_search(w: torch.Tensor, importance: torch.Tensor, group: int = int4.GROUP,
                symmetric: bool = AWQ_TYPE == "Q4_0") -> torch.Tensor:
    """Per group of ``w`` [out, in], the range ratio in CLIP_GRID minimizing sum_j importance_j (w_j - Q(w)_j)^2
    (the layer's output error with the inputs' cross terms dropped) -> [out, in / group]."""
    out, n = w.shape
    best_err, best = None, None
    for r in CLIP_GRID:
        clip = torch.full((out, n // group), r)
        err = ((int4.fake_quant(w, group, symmetric, clip) - w).pow(2) * importance).view(out, n // group, group).sum(2)
        if best is None:
            best_err, best = err, clip
        else:
            better = err < best_err
            best = torch.where(better, clip, best)
            best_err = torch.where(better, err, best_err)
    return best


def fit_groups(w: torch.Tensor, importance: torch.Tensor, group: int = int4.GROUP
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 groups' (d, m) [out, in / group] (fp16 values) minimizing sum_j importance_j (w_j - d q_j - m)^2:
    the best range of ``clip_search``, then FIT_STEPS rounds of the weighted least-squares (d, m) for the
    levels q taken, q taken again; each group keeps the best it saw (never worse than its clipped range)."""
    out, n = w.shape
    g = w.float().view(out, n // group, group)
    imp = importance.float().view(1, n // group, group).expand(out, -1, -1)

    def levels(d, m):
        return torch.round((g - m[..., None]) / torch.where(d != 0, d, torch.ones_like(d))[..., None]).clamp_(0, int4.LEVELS)

    def err(d, m):
        return (imp * (d[..., None] * levels(d, m) + m[..., None] - g).pow(2)).sum(2)

    _, d, m = int4.int4_grid(w, group, False, clip_search(w, importance, group, False))
    best = err(d, m)
    for _ in range(FIT_STEPS):
        q = levels(d, m)
        s0, s1, s2 = imp.sum(2), (imp * q).sum(2), (imp * q * q).sum(2)
        t0, t1 = (imp * g).sum(2), (imp * q * g).sum(2)
        det = s0 * s2 - s1 * s1
        ok = det > 1e-12 * s0 * s2
        det = torch.where(ok, det, torch.ones_like(det))
        nd = ((s0 * t1 - s1 * t0) / det).half().float()
        nm = ((s2 * t0 - s1 * t1) / det).half().float()
        ok &= (nd > 0) & torch.isfinite(nd) & torch.isfinite(nm)
        e = torch.where(ok, err(torch.where(ok, nd, d), torch.where(ok, nm, m)), best)
        better = e < best
        d, m, best = torch.where(better, nd, d), torch.where(better, nm, m), torch.where(better, e, best)
    return d, m


@torch.no_grad()
def quantize_blocks(model: Transformer, result: AWQResult) -> None:
    """Replace each block Linear (scales already folded) by its int4 blocks, each group's (d, m) from
    ``fit_groups`` weighted by the scaled layer's inputs (mean (x / s)^2); shapes the kernels do not take stay."""
    for name, s in result.scales.items():
        lin = model.get_submodule(name)
        w = lin.weight.float()
        imp = result.importance[name] / (s * s)
        layer = (int4.block_layer(w, int4.INT4_TYPE, dm=fit_groups(w, imp)) if int4.INT4_TYPE == "Q4_1"
                 else int4.block_layer(w, int4.INT4_TYPE, clip_search(w, imp)))
        if layer is None:
            continue
        layer.bias = None if lin.bias is None else lin.bias.float()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)


@torch.no_grad()
def fold(model: Transformer, cfg: ModelConfig, scales: dict[str, torch.Tensor]) -> None:
    """Multiply each block Linear's input channels by its scale and divide the op before by it (in place):
    the float function is unchanged."""
    hd, hkv, per = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    for i, block in enumerate(model.layers):
        p = f"layers.{i}."
        attn, mlp = block.attn, block.mlp
        s = scales[p + "attn.qkv"]
        block.attn_norm.weight.div_(s)
        attn.qkv.weight.mul_(s.to(attn.qkv.weight.dtype))
        s = scales[p + "mlp.gate_up"]
        block.mlp_norm.weight.div_(s)
        mlp.gate_up.weight.mul_(s.to(mlp.gate_up.weight.dtype))
        s = scales[p + "attn.o"]  # [h * d], equal across a kv head's query heads
        t = s.view(cfg.num_kv_heads, per, cfg.head_dim)[:, 0].reshape(-1)  # [hkv * d]
        attn.qkv.weight[hd + hkv:].div_(t[:, None].to(attn.qkv.weight.dtype))  # V rows
        if attn.qkv.bias is not None:
            attn.qkv.bias[hd + hkv:].div_(t.to(attn.qkv.bias.dtype))
        attn.o.weight.mul_(s.to(attn.o.weight.dtype))
        s = scales[p + "mlp.down"]
        mlp.gate_up.weight[cfg.intermediate_size:].div_(s[:, None].to(mlp.gate_up.weight.dtype))  # up rows
        mlp.down.weight.mul_(s.to(mlp.down.weight.dtype))


def cache_key(weights_sha256: str, calibration: Calibration) -> str:
    spec = (f"{weights_sha256}|{calibration.describe()}|{ALPHAS}|{LOSS_ROWS}|{LOSS_OUT_ROWS}|{AWQ_TYPE}|"
            f"{VERSION}")
    return hashlib.sha256(spec.encode()).hexdigest()[:24]


def calibrate_model(model: Transformer, cfg: ModelConfig, model_dir, weights_sha256: str,
                    calibration: Calibration | None = None) -> AWQResult:
    """Scales for ``model`` (from the cache, or searched on ``calibration``'s text, tokenized by the
    model's own tokenizer, and cached), folded into it. Logs which text calibrated (default: CALIBRATION)."""
    calibration = calibration or CALIBRATION
    path = cache_dir() / f"{cache_key(weights_sha256, calibration)}.safetensors"
    if path.is_file():
        t0 = time.perf_counter()
        stored = load_file(str(path))
        scales = {k.removeprefix("scale."): v for k, v in stored.items() if k.startswith("scale.")}
        importance = {k.removeprefix("importance."): v for k, v in stored.items() if k.startswith("importance.")}
        result = AWQResult(calibration.describe(), scales, importance, {}, time.perf_counter() - t0, cached=True)
    else:
        windows = calibration.windows(tokenizer_for(model_dir).encode)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one thread's sums: bit-identical scales in every process, whatever its threads
        try:
            result = search(model, cfg, windows, calibration.describe(), progress=cfg.num_layers * cfg.hidden_size > 8192)
        finally:
            torch.set_num_threads(threads)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save_file({**{f"scale.{k}": v.contiguous() for k, v in result.scales.items()},
                   **{f"importance.{k}": v.contiguous() for k, v in result.importance.items()}}, str(tmp),
                  metadata={"calibration": result.calibration, "alphas": json.dumps(result.alphas)})
        os.replace(tmp, path)  # atomic: a cached file is always whole
    fold(model, cfg, result.scales)
    log.info("int4-awq: scales %s (calibration text: %s) in %.1f s%s", "read from cache" if result.cached
             else "searched", result.calibration, result.seconds,
             "" if result.cached else f"; mean alpha {sum(result.alphas.values()) / len(result.alphas):.2f}")
    return result


def tokenizer_for(model_dir):
    """The model's own tokenizer, which tokenizes the calibration text (a LoadError that says so if it fails)."""
    from kvwire.tokenizer import ModelTokenizer
    try:
        return ModelTokenizer(model_dir)
    except Exception as e:  # noqa: BLE001 - any tokenizer failure: say what the calibration needed it for
        raise LoadError(f"{model_dir}: --weights int4-awq / int4-gptq tokenize their calibration text with the "
                        f"model's tokenizer, which did not load ({e})") from e


def scales_sha256(weights_sha256: str, result: AWQResult) -> str:
    """The checkpoint's hash extended by the scales' and importances' bytes (name order): what
    int4-awq's fingerprint names."""
    sha = hashlib.sha256(weights_sha256.encode())
    for name in sorted(result.scales):
        sha.update(name.encode())
        sha.update(result.scales[name].float().contiguous().numpy().tobytes())
        sha.update(result.importance[name].float().contiguous().numpy().tobytes())
    return sha.hexdigest()


def cache_dir() -> Path:
    return envs.get("KVWIRE_AWQ_CACHE")
