"""Tuned constants of the model code, each chosen by a measurement recorded in its decision doc."""
from __future__ import annotations

# Rows at or above which a bf16 weight is upcast to fp32 for the matmul on CPUs without native bf16
# (compute-bound regime). See docs/decisions/042-bf16-linear-and-loading.md.
UPCAST_MIN_ROWS = 16
# Bytes of converted weight per block of an upcast: under glibc's mmap threshold, so blocks are reused
# from the heap instead of faulted in afresh each call. See docs/decisions/042-bf16-linear-and-loading.md.
UPCAST_BLOCK_BYTES = 4 << 20
# int8, other CPUs than VNNI: rows at or above which the wide-input paths run instead of weight-only
# int8pack_mm, whose cost jumps there. See docs/decisions/041-quantized-linear-paths.md.
W8A8_MIN_ROWS = 8
# Layers (by name suffix) whose wide inputs take per-token W8A8 through fbgemm; none by default:
# outlier input channels cost more than the budget. See docs/decisions/041-quantized-linear-paths.md.
W8A8_LAYERS: tuple[str, ...] = ()
# Values the loader quantizes at a time, so fp32 temporaries are a block, not a whole matrix.
# See docs/decisions/041-quantized-linear-paths.md.
QUANT_BLOCK_ELEMS = 1 << 20
# Bytes of parameters built between two malloc_trim calls of the loader (freed temporaries go back
# to the OS without a trim per parameter). See docs/decisions/042-bf16-linear-and-loading.md.
TRIM_EVERY_BYTES = 64 << 20
