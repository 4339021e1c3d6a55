"""KVPageSpec: the one definition of a KV page, shared by prefill, decode, the kernels and the wire.

Torch-free on purpose (the wire codec and the scheduler import it without tensors). Page format 2,
one page of one layer, the same in memory and on the wire: K and V values [num_kv_heads,
block_size, head_dim] fp8_e4m3 or bf16, and for fp8 K and V scales [num_kv_heads, block_size] bf16
(value = fp8 * scale). One scale per (token, kv-head), the token's amax / 448 rounded up to bf16:
a write touches only its own token's bytes (rollback is a truncate) and nothing saturates. Format 1
(a per-page scale that grew) is only described, so a peer still sending it is refused readably.
"""
from __future__ import annotations

import enum
from dataclasses import asdict, dataclass

from kvwire.config import KVDtype, ModelConfig

FORMAT_VERSION = 2  # the page format this build writes and reads


class ScaleGranularity(str, enum.Enum):
    PER_PAGE_HEAD = "per_page_head"  # format 1: one scale per (page, kv-head)
    PER_TOKEN_HEAD = "per_token_head"  # format 2: one scale per (token, kv-head)


class ScaleDtype(str, enum.Enum):
    FLOAT32 = "float32"  # format 1
    BF16 = "bf16"  # format 2


SCALE_ITEMSIZE = {ScaleDtype.FLOAT32: 4, ScaleDtype.BF16: 2}


@dataclass(frozen=True)
class KVPageSpec:
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: KVDtype = KVDtype.FP8_E4M3
    scale_granularity: ScaleGranularity = ScaleGranularity.PER_TOKEN_HEAD
    scale_dtype: ScaleDtype = ScaleDtype.BF16
    format_version: int = FORMAT_VERSION

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
    def supported(self) -> bool:
        """Whether this build can hold such pages (format 2 with its scale layout)."""
        return (self.format_version == FORMAT_VERSION
                and self.scale_granularity == ScaleGranularity.PER_TOKEN_HEAD
                and self.scale_dtype == ScaleDtype.BF16)

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
    def scales_per_page(self) -> int:
        """Scales of K (or of V) in one page of one layer (0 for bf16)."""
        if not self.has_scales:
            return 0
        if self.scale_granularity == ScaleGranularity.PER_PAGE_HEAD:
            return self.num_kv_heads
        return self.num_kv_heads * self.block_size

    @property
    def scale_bytes_per_page(self) -> int:
        """Bytes of K (or of V) scales in one page of one layer."""
        return self.scales_per_page * SCALE_ITEMSIZE[self.scale_dtype]

    @property
    def page_bytes_per_layer(self) -> int:
        """Bytes of one page of one layer: K + V values, plus K and V scales for fp8."""
        return 2 * (self.values_per_page * self.itemsize + self.scale_bytes_per_page)

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
        d["scale_dtype"] = self.scale_dtype.value
        return d

    def diff(self, other: "KVPageSpec") -> list[str]:
        """Readable field-by-field differences (empty when equal)."""
        a, b = self.to_dict(), other.to_dict()
        return [f"{k}: {a[k]!r} != {b[k]!r}" for k in a if a[k] != b[k]]
