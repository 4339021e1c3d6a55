"""KVPageSpec: the one definition of a KV page, shared by prefill, decode, the kernels and the wire.

Torch-free on purpose (the wire codec and the scheduler import it without tensors).

Layout of one page of one layer, the same in memory and on the wire:

    K values  [num_kv_heads, block_size, head_dim]   fp8_e4m3 (1 byte) or bf16 (2 bytes)
    V values  [num_kv_heads, block_size, head_dim]
    K scales  [num_kv_heads] float32                  fp8 only: value = fp8 * scale
    V scales  [num_kv_heads] float32

A pool holds, per layer, ``k: [num_pages, num_kv_heads, block_size, head_dim]`` (and ``v`` alike)
plus ``k_scale: [num_pages, num_kv_heads]`` (and ``v_scale``). Head-major inside a page keeps each
(page, kv-head) scale group contiguous.
"""
from __future__ import annotations

import enum
from dataclasses import asdict, dataclass

from kvwire.config import KVDtype, ModelConfig

FP8_E4M3_MAX = 448.0


class ScaleGranularity(str, enum.Enum):
    PER_PAGE_HEAD = "per_page_head"  # one float32 scale per (page, kv-head), for K and for V


@dataclass(frozen=True)
class KVPageSpec:
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: KVDtype = KVDtype.FP8_E4M3
    scale_granularity: ScaleGranularity = ScaleGranularity.PER_PAGE_HEAD

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVPageSpec.{name} must be positive, got {getattr(self, name)}")

    @staticmethod
    def for_model(cfg: ModelConfig, block_size: int = 16,
                  dtype: KVDtype = KVDtype.FP8_E4M3) -> "KVPageSpec":
        return KVPageSpec(block_size=block_size, num_layers=cfg.num_layers,
                          num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=KVDtype(dtype))

    @property
    def itemsize(self) -> int:
        return 1 if self.dtype == KVDtype.FP8_E4M3 else 2

    @property
    def has_scales(self) -> bool:
        return self.dtype == KVDtype.FP8_E4M3

    @property
    def values_per_page(self) -> int:
        """Elements of K (or of V) in one page of one layer."""
        return self.num_kv_heads * self.block_size * self.head_dim

    @property
    def page_bytes_per_layer(self) -> int:
        """Bytes of one page of one layer: K + V values, plus K and V scales for fp8."""
        scales = 2 * self.num_kv_heads * 4 if self.has_scales else 0
        return 2 * self.values_per_page * self.itemsize + scales

    @property
    def bytes_per_token(self) -> float:
        """KV bytes per token over all layers, scale overhead included (full pages)."""
        return self.page_bytes_per_layer * self.num_layers / self.block_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dtype"] = self.dtype.value
        d["scale_granularity"] = self.scale_granularity.value
        return d

    def diff(self, other: "KVPageSpec") -> list[str]:
        """Readable field-by-field differences (empty when equal)."""
        a, b = self.to_dict(), other.to_dict()
        return [f"{k}: {a[k]!r} != {b[k]!r}" for k in a if a[k] != b[k]]
