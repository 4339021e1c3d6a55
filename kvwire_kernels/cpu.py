"""The CPU decode kernels (``kvwire_kernels/cpu/kvwire_cpu.c``): built on first use, called through ctypes.

Compiled with ``-march=native`` into a cache keyed by source, compiler and CPU flags (never a binary
built for another CPU); without a compiler, the best prebuilt ISA level the flags allow (``--prebuild
DIR``). Otherwise, or with ``KVWIRE_CPU_KERNELS=0``, ``library()`` is None and callers keep the
PyTorch path the tests compare against (``KVWIRE_CPU_KERNELS=1``: absence is an error). torch is
imported first so the library's libgomp reuses torch's OpenMP runtime (one thread pool).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from kvwire import envs
from kvwire_kernels import reference

SOURCE = Path(__file__).resolve().parent / "cpu" / "kvwire_cpu.c"
# Every source the build reads (SOURCE includes the others): the cache key covers them all.
SOURCES = (SOURCE, SOURCE.parent / "gguf_blocks.c")
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno"]
PREBUILT = Path(__file__).resolve().parent / "cpu" / "prebuilt"
# Portable ISA levels for prebuilt binaries, best first, with the /proc/cpuinfo flags each needs.
# x86-64-v4-vnni adds vpdpbusd (the int8 x int8 GEMM) to x86-64-v4, x86-64-v4-vnni-bf16 also
# vdpbf16ps (bf16 activations into bf16 layers: Sapphire Rapids, Zen 4 and later), and
# x86-64-v4-vnni-bf16-amx the AMX-INT8 tiles of the GEMM's many-row case (Sapphire Rapids and later).
_V4 = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "bmi2")
_BF16 = _V4 + ("avx512_vnni", "avx512_bf16")
LEVELS = {"x86-64-v4-vnni-bf16-amx": _BF16 + ("amx_tile", "amx_int8"), "x86-64-v4-vnni-bf16": _BF16,
          "x86-64-v4-vnni": (_V4 + ("avx512_vnni",)), "x86-64-v4": _V4, "x86-64-v3": ("avx2", "fma", "bmi2", "f16c", "movbe")}
MARCH = {"x86-64-v4-vnni-bf16-amx": ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-int8"],
         "x86-64-v4-vnni-bf16": ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"],  # where not -march=LEVEL
         "x86-64-v4-vnni": ["-march=x86-64-v4", "-mavx512vnni"]}
ABI_VERSION = 13
MAX_HEAD_DIM, MAX_GQA_RATIO = 256, 8

P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "kvw_linear_i8": [P, I64, I64, P, I64, P, P, P, P, I32],
    "kvw_linear_bf16": [P, I64, I64, P, I64, P, P, P, P, I32],
    "kvw_linear_f32": [P, I64, I64, P, I64, P, P, P, P, I32],
    "kvw_rms_norm": [P, I64, I64, P, F32, P],
    "kvw_silu_mul": [P, I64, I64, P],
    "kvw_sample_rows": [P, I64, I64, P, P, P, I32],
    "kvw_write_kv": [P, P, I64, I64, I64, P, I64, P, P, P, P, I32],
    "kvw_rope_split": [P, I64, I64, I64, I64, P, P, P, P, P],
    "kvw_paged_attention": [P, I64, I64, I64, I64, P, P, P, P, I64, P, I64, P, I64, F32, P, I32, I32],
    "kvw_prefill_attention": [P, I64, I64, I64, I64, P, P, I64, I64, I64, I64, F32, P, I32],
    "kvw_linear_i8a8": [P, I64, I64, P, I64, P, P, P, P, I32],
    "kvw_quantize_act8": [P, I64, I64, P, P, P],
    "kvw_gemm_i8a8": [P, I64, I64, P, I64, P, P, P, P, I32],
    "kvw_linear_bf16a16": [P, I64, I64, P, I64, P, P, P, P, I32],
    "kvw_decode_layers": [P, I64, P, I64, I64, I64, I64, I64, I64, F32, P, P, P, P, I64, P, P, P, P, P, I64, I64,
                          I64, I32, F32, I32],
    "kvw_prefill_layers": [P, I64, P, I64, I64, I64, I64, I64, I64, F32, P, P, P, I64, P, P, P, P, I64, P, P, P, P,
                           I64, I64, I64, I32, F32, I32, P, I64, P, I64, P],
    "kvw_gemm_q4_0": [P, I64, I64, P, I64, P, P, P, P, I32],
    "kvw_gemm_q4_1": [P, I64, I64, P, I64, P, P, P, P, I32],
    "kvw_gemm_q8_0": [P, I64, I64, P, I64, P, P, P, P, I32],
    "kvw_gemm_q4_k": [P, I64, I64, P, I64, P, P, P, P, I32],
    "kvw_gemm_q5_k": [P, I64, I64, P, I64, P, P, P, P, I32],
    "kvw_gemm_q6_k": [P, I64, I64, P, I64, P, P, P, P, I32],
    "kvw_quantize_blocks": [P, I64, I64, P, P, P, P],
    "kvw_draft_head_eval": [P, I64, P, P, P, P, I32],
    "kvw_draft_head_chain": [P, I64, P, P, P, I64, F32, P, P, I32],
}
RESTYPES = {"kvw_draft_head_chain": I64}
LAYER_CALLBACK = ctypes.CFUNCTYPE(I32, I64)  # kvw_prefill_layers' after_layer: next thread count, 0 stops
WEIGHT_TYPES = {torch.int8: 0, torch.bfloat16: 1, torch.float32: 2}  # the C file's WT_* codes
WT_I8A8 = 3  # int8 weights x int8 activations (blocks of 32), AVX512-VNNI builds only
WT_I8A8_PACKED = 4  # the same, weights as pack_i8a8 lays them out (kvw_gemm_i8a8)
WT_BF16A16 = 5  # bf16 weights x bf16 activations (kvw_linear_bf16a16), AVX512-BF16 builds only
# GGUF block formats as stored (kvw_gemm_q4_0 ... q6_k, every build), weights as pack_gguf lays them out
WT_GGUF = {"Q4_0": 6, "Q4_1": 7, "Q8_0": 8, "Q4_K": 9, "Q5_K": 10, "Q6_K": 11}
WT_ROWS = 12  # w: an array of LinearDesc parts (the last with out_features 0), outputs side by side


class LinearDesc(ctypes.Structure):
    """kvw_linear_t: one linear layer's weights, as the C side reads them."""
    _fields_ = [("w", P), ("scale", P), ("bias", P), ("in_features", I64), ("out_features", I64), ("wt", I64)]


class LayerDesc(ctypes.Structure):
    """kvw_layer_t: one transformer block's weights for kvw_decode_layers."""
    _fields_ = [("attn_norm", P), ("mlp_norm", P), ("qkv", LinearDesc), ("o", LinearDesc),
                ("gate_up", LinearDesc), ("down", LinearDesc), ("window", I64)]


class HeadBlockDesc(ctypes.Structure):
    """kvw_head_block_t: one block of a draft head (kvwire.model.draft_head.HeadBlock)."""
    _fields_ = [("norm", P), ("gate_up", LinearDesc), ("down", LinearDesc)]


class DraftHeadDesc(ctypes.Structure):
    """kvw_draft_head_t: a whole draft head (kvwire.model.draft_head.DraftHead) for kvw_draft_head_*."""
    _fields_ = [("embed", P), ("embed_bf16", I64), ("tok_norm", P), ("fc", LinearDesc), ("blocks", P),
                ("num_blocks", I64), ("head", LinearDesc), ("head_vocab", P), ("head_vocab_n", I64),
                ("hidden", I64), ("inter", I64), ("eps", F32)]

unavailable_reason: str | None = None


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return "unknown"


def cache_dir() -> Path:
    return Path(envs.get("KVWIRE_KERNEL_CACHE"))


def _compile(cc: str, level: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: processes starting together never load a half file.
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        proc = subprocess.run([cc, *FLAGS, *MARCH.get(level, [f"-march={level}"]), "-o", str(part), str(SOURCE), "-lm"],
                              capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(part, out)


def _native(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\n".join([*(p.read_text() for p in SOURCES), version, _cpu_flags(), " ".join(FLAGS)]).encode())
    target = cache_dir() / f"kvwire_cpu_{key.hexdigest()[:16]}.so"
    if not target.exists():
        _compile(cc, "native", target)
    return target


def _source_key() -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:16]


def prebuilt_path(level: str, root: Path | None = None) -> Path:
    return (root or Path(envs.get("KVWIRE_KERNEL_PREBUILT") or PREBUILT)) / f"kvwire_cpu_{level}_{_source_key()}.so"


def _prebuilt() -> Path:
    flags = set(_cpu_flags().split())
    for level, need in LEVELS.items():
        path = prebuilt_path(level)
        if flags.issuperset(need) and path.exists():
            return path
    raise RuntimeError("no C compiler (gcc) on PATH and no prebuilt kernels for this CPU "
                       "(python -m kvwire_kernels.cpu --prebuild DIR)")


def prebuild(root: Path) -> list[Path]:
    """Compile the portable binaries into ``root`` (for images without a compiler)."""
    cc = envs.get("CC") or shutil.which("gcc") or shutil.which("cc") or "gcc"
    out = []
    for level in LEVELS:
        _compile(cc, level, prebuilt_path(level, root))
        out.append(prebuilt_path(level, root))
    return out


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (``unavailable_reason`` says why) when they cannot be used."""
    global unavailable_reason
    mode = envs.get("KVWIRE_CPU_KERNELS").lower()
    if mode in ("0", "off", "false", "no"):
        unavailable_reason = "disabled by KVWIRE_CPU_KERNELS=0"
        return None
    try:
        cc = envs.get("CC") or shutil.which("gcc") or shutil.which("cc")
        try:
            path = _native(cc) if cc is not None else _prebuilt()
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            if cc is None:
                raise
            try:  # the compiler failed: a prebuilt binary still serves
                path = _prebuilt()
            except RuntimeError:
                raise RuntimeError(f"{cc}: {e}") from e
        lib = ctypes.CDLL(str(path))
        if lib.kvw_abi_version() != ABI_VERSION:
            raise RuntimeError("stale kernel library (ABI version mismatch)")
        for name, args in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, RESTYPES.get(name)
        lib.kvw_gguf_isa.argtypes, lib.kvw_gguf_isa.restype = [], ctypes.c_int
        lib.kvw_has_vnni.argtypes, lib.kvw_has_vnni.restype = [], ctypes.c_int
        lib.kvw_has_bf16.argtypes, lib.kvw_has_bf16.restype = [], ctypes.c_int
        lib.kvw_set_amx.argtypes, lib.kvw_set_amx.restype = [ctypes.c_int], ctypes.c_int
        lib.kvw_set_amx(int(not _switched_off("KVWIRE_AMX")))
        return lib
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        unavailable_reason = f"CPU kernels unavailable: {e}"
        if mode in ("1", "on", "true", "yes"):
            raise RuntimeError(unavailable_reason) from e
        return None


def available() -> bool:
    return library() is not None


def int8_activations() -> bool:
    """Whether int8 layers take int8 activations (blocks of 32, as llama.cpp's q8_0; the packed
    ``kvw_gemm_i8a8`` for prompts and the fused decode step, ``kvw_linear_i8a8`` for weights left in
    [out, in] order): where the library was built with AVX512-VNNI, unless
    ``KVWIRE_INT8_ACTIVATIONS=0`` keeps them fp32 / bf16. Read from the CPU's flags and the
    environment, never from timing, so every process on a machine computes the same numbers."""
    lib = library()
    return lib is not None and bool(lib.kvw_has_vnni()) and not _switched_off("KVWIRE_INT8_ACTIVATIONS")


def _switched_off(variable: str) -> bool:
    return envs.switched_off(variable)


def amx() -> bool:
    """Whether the int8 x int8 GEMM (``kvw_gemm_i8a8``) multiplies 3 rows or more on AMX tiles:
    where the library was built with AMX-INT8 (Sapphire Rapids and later), Linux granted the tile
    state, and ``KVWIRE_AMX=0`` does not switch it off. The numbers are the same bits either way
    (the block sums are exact integers; the fp32 steps after them are VNNI's), so this is a speed
    choice only."""
    lib = library()
    return lib is not None and bool(lib.kvw_set_amx(int(not _switched_off("KVWIRE_AMX"))))


def bf16_activations() -> bool:
    """Whether bf16 layers of the fused decode step take bf16 activations (rounded once per call,
    multiplied by ``vdpbf16ps``, ``kvw_linear_bf16a16``): where the library was built with
    AVX512-BF16, unless ``KVWIRE_BF16_ACTIVATIONS=0`` keeps them fp32. From the CPU's flags and the
    environment only, as ``int8_activations``."""
    lib = library()
    return lib is not None and bool(lib.kvw_has_bf16()) and not _switched_off("KVWIRE_BF16_ACTIVATIONS")


def linear_bf16a16(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                   threads: int | None = None) -> torch.Tensor:
    """``linear`` for bf16 w with x rounded to bf16 first (AVX512-BF16 builds; in % 32 == 0)."""
    _check(x, torch.float32, "x")
    _check(w, torch.bfloat16, "w")
    if x.shape[1] % 32 or w.shape[1] != x.shape[1]:
        raise ValueError(f"linear_bf16a16: in_features must match and be a multiple of 32, got {x.shape[1]}, {w.shape[1]}")
    return _run_linear("kvw_linear_bf16a16", x, w, scale, bias, residual, threads)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name}: expected a contiguous CPU {dtype} tensor, got {t.dtype} "
                         f"{'contiguous' if t.is_contiguous() else 'strided'} on {t.device}")


def _check_f32(**tensors: torch.Tensor | None) -> None:
    """Each given tensor (None: absent) is a contiguous CPU fp32 tensor."""
    for name, t in tensors.items():
        if t is not None:
            _check(t, torch.float32, name)


LINEAR_FN = {torch.int8: "kvw_linear_i8", torch.bfloat16: "kvw_linear_bf16", torch.float32: "kvw_linear_f32"}


def linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """x [rows, in] fp32 @ w [out, in] (int8 / bf16 / fp32).T, times scale [out], plus bias [out],
    plus residual [rows, out] -> [rows, out] fp32."""
    _check(x, torch.float32, "x")
    if w.dtype not in LINEAR_FN or not w.is_contiguous():
        raise ValueError(f"w: expected a contiguous int8, bfloat16 or float32 tensor, got {w.dtype}")
    return _run_linear(LINEAR_FN[w.dtype], x, w, scale, bias, residual, threads)


def _run_linear(fn: str, x: torch.Tensor, w: torch.Tensor, scale, bias, residual, threads) -> torch.Tensor:
    """The kvw_linear_* calls' common part: y [rows, out] fp32 = fn(x, w) * scale + bias + residual."""
    _check_f32(scale=scale, bias=bias, residual=residual)
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    getattr(library(), fn)(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.shape[0], y.data_ptr(),
                           _ptr(scale), _ptr(bias), _ptr(residual), threads or torch.get_num_threads())
    return y


def quantize_act8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, in] fp32 (in % 64 == 0) -> what kvw_linear_i8a8 reads: q [rows, in] int8, lane
    scales s [rows, in / 4] fp32 (each block's scale on its 8 lanes) and k [rows] fp32, the
    128 * sum_b s_b * sum(q_b) that the kernel's unsigned weights add (VNNI builds)."""
    _check(x, torch.float32, "x")
    rows, n = x.shape
    q, s, k = torch.empty(rows, n, dtype=torch.int8), torch.empty(rows, n // 4), torch.empty(rows)
    library().kvw_quantize_act8(x.data_ptr(), rows, n, q.data_ptr(), s.data_ptr(), k.data_ptr())
    return q, s, k


def linear_i8a8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """``kvwire_kernels.reference.linear_i8a8`` (within fp32 round-off): x [rows, in] fp32 quantized per
    block of 32, times int8 w [out, in] with per-row scale [out] -> [rows, out] fp32 (VNNI builds)."""
    _check(x, torch.float32, "x")
    _check(w, torch.int8, "w")
    if x.shape[1] % 64 or w.shape[1] != x.shape[1]:
        raise ValueError(f"linear_i8a8: in_features must match and be a multiple of 64, got {x.shape[1]}, {w.shape[1]}")
    return _run_linear("kvw_linear_i8a8", x, w, scale, bias, residual, threads)


def pack_i8a8(w: torch.Tensor) -> torch.Tensor:
    """int8 w [out, in] -> the layout kvw_gemm_i8a8 reads: [out / 16, in / 4, 16, 4] uint8, each byte
    w ^ 0x80 (out % 16 == 0, in % 64 == 0). One vector of 64 bytes: 16 outputs x 4 inputs."""
    _check(w, torch.int8, "w")
    out, n = w.shape
    if out % 16 or n % 64:
        raise ValueError(f"pack_i8a8: out_features % 16 and in_features % 64 must be 0, got {out}, {n}")
    packed = w.view(out // 16, 16, n // 4, 4).permute(0, 2, 1, 3).contiguous().view(torch.uint8)
    return packed.bitwise_xor_(0x80)  # [out / 16, in / 4, 16, 4]


def unpack_i8a8(packed: torch.Tensor) -> torch.Tensor:
    """``pack_i8a8``'s inverse: [out / 16, in / 4, 16, 4] uint8 -> w [out, in] int8."""
    groups, quads, _, _ = packed.shape
    return (packed ^ 0x80).permute(0, 2, 1, 3).contiguous().view(torch.int8).view(16 * groups, 4 * quads)


def gemm_i8a8(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """``linear_i8a8``'s numbers (within fp32 round-off) from the weights as ``pack_i8a8`` lays
    them out, at any row count -> [rows, out] fp32 (VNNI builds)."""
    _check(x, torch.float32, "x")
    _check(packed, torch.uint8, "packed")
    groups, quads, _, _ = packed.shape
    if x.shape[1] != 4 * quads:
        raise ValueError(f"gemm_i8a8: x has {x.shape[1]} inputs, the packed weight {4 * quads}")
    _check_f32(scale=scale, bias=bias, residual=residual)
    y = torch.empty(x.shape[0], 16 * groups)
    library().kvw_gemm_i8a8(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), 16 * groups, y.data_ptr(),
                            scale.data_ptr(), _ptr(bias), _ptr(residual), threads or torch.get_num_threads())
    return y


# GGUF block formats the kernels multiply as stored: (values, bytes) per block, and the fields of a
# block in the order pack_gguf lays them out for the kernels (kvwire_kernels/cpu/gguf_blocks.c):
# ("vec", a, b): bytes a..b as 64-byte vectors of 16 rows x 4 bytes; ("row2", a, b): a 2-byte field
# (fp16 d, m, dmin) of the 16 rows; ("col", a, b): one byte per (field byte, row) (Q6_K's int8 scales);
# ("kscales", a, b): Q4_K / Q5_K's 12 bytes of 6-bit scales and mins as bytes (16 per row).
GGUF_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176),
               "Q6_K": (256, 210)}
GGUF_FIELDS = {
    "Q4_0": (("vec", 2, 18), ("row2", 0, 2)),
    "Q4_1": (("vec", 4, 20), ("row2", 0, 2), ("row2", 2, 4)),
    "Q8_0": (("vec", 2, 34), ("row2", 0, 2)),
    "Q4_K": (("vec", 16, 144), ("row2", 0, 2), ("row2", 2, 4), ("kscales", 4, 16)),
    "Q5_K": (("vec", 48, 176), ("vec", 16, 48), ("row2", 0, 2), ("row2", 2, 4), ("kscales", 4, 16)),
    "Q6_K": (("vec", 0, 128), ("vec", 128, 192), ("col", 192, 208), ("row2", 208, 210)),
}


def _k_scales_packed(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """``reference.k_scales``' inverse (every one of the 96 bits is a scale's or a min's): [..., 8] x 2 -> [..., 12]."""
    d = sc[..., :4] | ((sc[..., 4:] & 0x30) << 2)
    m = mn[..., :4] | ((mn[..., 4:] & 0x30) << 2)
    return torch.cat((d, m, (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)), dim=-1)


def pack_gguf(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """GGUF rows of blocks, uint8 [out, in / values * bytes] as stored -> the layout kvw_gemm_q* read:
    [out / 16, blocks, packed bytes] uint8: per panel of 16 rows and block, the fields of
    ``GGUF_FIELDS`` in turn. Bytes move; only Q4_K / Q5_K's 6-bit scales are widened to bytes. Every
    bit of the file is kept (``unpack_gguf``)."""
    _check(raw, torch.uint8, "raw")
    _, size = GGUF_BLOCKS[qtype]
    out, width = raw.shape
    if out % 16 or width % size:
        raise ValueError(f"pack_gguf: {qtype} rows must be a multiple of 16 and whole blocks, got {tuple(raw.shape)}")
    panels, nb = out // 16, width // size
    blocks = raw.view(panels, 16, nb, size)  # [panels, 16 rows, blocks, bytes]
    parts = []
    for kind, a, b in GGUF_FIELDS[qtype]:
        f = blocks[..., a:b]  # [P, 16, nb, n]
        if kind == "vec":  # [P, nb, n / 4 vectors, 16 rows, 4]
            parts.append(f.reshape(panels, 16, nb, (b - a) // 4, 4).permute(0, 2, 3, 1, 4).reshape(panels, nb, -1))
        elif kind == "row2":  # [P, nb, 16 rows, 2]
            parts.append(f.permute(0, 2, 1, 3).reshape(panels, nb, 32))
        elif kind == "col":  # [P, nb, n, 16 rows]
            parts.append(f.permute(0, 2, 3, 1).reshape(panels, nb, -1))
        else:  # kscales: [P, nb, 8, 16 rows] scales, then mins
            parts += [t.permute(0, 2, 3, 1).reshape(panels, nb, 128) for t in reference.k_scales(f)]
    return torch.cat(parts, dim=-1).contiguous()  # [out / 16, blocks, packed bytes]


def unpack_gguf(packed: torch.Tensor, qtype: str) -> torch.Tensor:
    """``pack_gguf``'s inverse: the rows of blocks exactly as the file stores them, [out, blocks * bytes]."""
    _, size = GGUF_BLOCKS[qtype]
    panels, nb, _ = packed.shape
    blocks = torch.empty(panels, 16, nb, size, dtype=torch.uint8, device=packed.device)  # any device: torch ops
    at = 0
    for kind, a, b in GGUF_FIELDS[qtype]:
        n = b - a
        if kind == "vec":
            blocks[..., a:b] = packed[..., at:at + 16 * n].reshape(panels, nb, n // 4, 16, 4).permute(0, 3, 1, 2, 4).reshape(
                panels, 16, nb, n)
        elif kind == "row2":
            blocks[..., a:b] = packed[..., at:at + 32].reshape(panels, nb, 16, 2).permute(0, 2, 1, 3)
        elif kind == "col":
            blocks[..., a:b] = packed[..., at:at + 16 * n].reshape(panels, nb, n, 16).permute(0, 3, 1, 2)
        else:
            sc, mn = (packed[..., at + i * 128:at + (i + 1) * 128].reshape(panels, nb, 8, 16).permute(0, 3, 1, 2)
                      for i in (0, 1))
            blocks[..., a:b] = _k_scales_packed(sc, mn)
            n = 16  # 8 scales and 8 mins, a byte each
        at += 16 * n if kind != "row2" else 32
    return blocks.view(panels * 16, nb * size)


def gemm_gguf(x: torch.Tensor, packed: torch.Tensor, qtype: str, bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """``kvwire_kernels.reference.linear_gguf`` (within fp32 round-off): x [rows, in] fp32, quantized per
    block of 32, times the GGUF weight ``pack_gguf`` laid out -> [rows, out] fp32 (every build)."""
    _check(x, torch.float32, "x")
    _check(packed, torch.uint8, "packed")
    panels, nb, _ = packed.shape
    n_in = GGUF_BLOCKS[qtype][0] * nb
    if x.shape[1] != n_in:
        raise ValueError(f"gemm_gguf: x has {x.shape[1]} inputs, the packed weight {n_in}")
    _check_f32(bias=bias, residual=residual)
    y = torch.empty(x.shape[0], 16 * panels)
    getattr(library(), f"kvw_gemm_{qtype.lower()}")(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), 16 * panels,
                                                    y.data_ptr(), None, _ptr(bias), _ptr(residual),
                                                    threads or torch.get_num_threads())
    return y


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, in] fp32 (in % 32 == 0) -> what kvw_gemm_q* read: q [rows, in] int8, block scales and
    block sums of q [rows, in / 32] (fp32, int32), half-block sums [rows, in / 16] int32."""
    _check(x, torch.float32, "x")
    rows, n = x.shape
    q, s = torch.empty(rows, n, dtype=torch.int8), torch.empty(rows, n // 32)
    sums, sums16 = torch.empty(rows, n // 32, dtype=torch.int32), torch.empty(rows, n // 16, dtype=torch.int32)
    library().kvw_quantize_blocks(x.data_ptr(), rows, n, q.data_ptr(), s.data_ptr(), sums.data_ptr(), sums16.data_ptr())
    return q, s, sums, sums16


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, torch.float32, "x")
    _check(w, torch.float32, "w")
    y = torch.empty_like(x)
    library().kvw_rms_norm(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), eps, y.data_ptr())
    return y


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * inter] = [gate | up] -> silu(gate) * up [rows, inter]."""
    _check(gu, torch.float32, "gu")
    rows, width = gu.shape
    out = torch.empty(rows, width // 2)
    library().kvw_silu_mul(gu.data_ptr(), rows, width // 2, out.data_ptr())
    return out


def sample_rows(rows: Sequence[torch.Tensor], temperatures: Sequence[float], uniforms: Sequence[float],
                threads: int | None = None) -> list[int]:
    """One token per row of logits (fp32 [vocab] each, contiguous, the same vocab) from
    softmax(row / temperature), drawn with its uniform in [0, 1) by the inverse of the cumulative
    weights (``kvwire.sampler.draw``'s rule: the first index whose running weight exceeds u times
    the total; a zero weight is never drawn). Raises ValueError where a row's weights do not sum to
    a finite positive total (NaN or infinite logits)."""
    n = len(rows)
    if not n:
        return []
    vocab = rows[0].shape[-1]
    for r in rows:
        _check(r, torch.float32, "logits")
        if r.dim() != 1 or r.shape[0] != vocab or not r.is_contiguous():
            raise ValueError(f"sample_rows: rows must be contiguous [vocab={vocab}], got {tuple(r.shape)}")
    ptrs = torch.tensor([r.data_ptr() for r in rows], dtype=torch.int64)
    temps = torch.tensor(temperatures, dtype=torch.float32)
    us = torch.tensor(uniforms, dtype=torch.float64)
    out = torch.empty(n, dtype=torch.int64)
    library().kvw_sample_rows(ptrs.data_ptr(), n, vocab, temps.data_ptr(), us.data_ptr(), out.data_ptr(),
                              threads or torch.get_num_threads())
    got = out.tolist()
    if min(got) < 0:
        raise ValueError("cannot sample from weights that sum to NaN or inf (NaN or infinite logits)")
    return got


def rope_split(qkv: torch.Tensor, h: int, hkv: int, d: int, cos: torch.Tensor, sin: torch.Tensor):
    """qkv [T, (h + 2 hkv) d] -> q [T, h, d], k [T, hkv, d] with RoPE (cos, sin [T, d]), v [T, hkv, d]."""
    for t, name in ((qkv, "qkv"), (cos, "cos"), (sin, "sin")):
        _check(t, torch.float32, name)
    n = qkv.shape[0]
    q, k, v = torch.empty(n, h, d), torch.empty(n, hkv, d), torch.empty(n, hkv, d)
    library().kvw_rope_split(qkv.data_ptr(), n, h, hkv, d, cos.data_ptr(), sin.data_ptr(),
                             q.data_ptr(), k.data_ptr(), v.data_ptr())
    return q, k, v


def write_kv(k_pages, v_pages, k_scale, v_scale, k_new, v_new, slot_mapping) -> None:
    """``kvwire_kernels.reference.write_kv``, bit for bit."""
    _check(k_new, torch.float32, "k_new")
    _check(v_new, torch.float32, "v_new")
    _check(slot_mapping, torch.int64, "slot_mapping")
    _, hkv, block_size, d = k_pages.shape
    library().kvw_write_kv(k_new.data_ptr(), v_new.data_ptr(), k_new.shape[0], hkv, d, slot_mapping.data_ptr(),
                           block_size, k_pages.data_ptr(), v_pages.data_ptr(), _ptr(k_scale), _ptr(v_scale),
                           int(k_scale is not None))


def supports_attention(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    return (head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GQA_RATIO)


def paged_attention(q, k_pages, v_pages, k_scale, v_scale, block_tables, context_lens, window, sm_scale,
                    threads: int | None = None) -> torch.Tensor:
    """``kvwire_kernels.reference.paged_decode_attention`` (within fp32 round-off), reading pages in place."""
    _check(q, torch.float32, "q")
    _check(block_tables, torch.int32, "block_tables")
    _check(context_lens, torch.int32, "context_lens")
    s, h, d = q.shape
    _, hkv, block_size, _ = k_pages.shape
    if not supports_attention(h, hkv, d):
        raise ValueError(f"unsupported attention shape: {h} heads, {hkv} kv heads, head_dim {d}")
    out = torch.empty_like(q)
    library().kvw_paged_attention(q.data_ptr(), s, h, hkv, d, k_pages.data_ptr(), v_pages.data_ptr(),
                                  _ptr(k_scale), _ptr(v_scale), block_size, block_tables.data_ptr(),
                                  block_tables.shape[1], context_lens.data_ptr(), window or 0, sm_scale,
                                  out.data_ptr(), int(k_scale is not None), threads or torch.get_num_threads())
    return out


MAX_PREFILL_HEAD_DIM = 128


def supports_prefill_attention(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    return head_dim % 16 == 0 and head_dim <= MAX_PREFILL_HEAD_DIM and num_heads % num_kv_heads == 0


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos0: int, k_pos0: int,
                      window: int | None, sm_scale: float, threads: int | None = None) -> torch.Tensor:
    """Causal GQA attention of a prompt's queries over keys that end with their own (flash, fp32).
    q: [n, H, D] at positions q_pos0 ..; k, v: [m, Hkv, D] at positions k_pos0 .. k_pos0 + m - 1, which
    must include every query's position. -> [n, H, D]. Equals ``kvwire.kv.dense.sdpa_gqa`` with the
    causal (and window) mask within fp32 round-off; the same bits at any thread count."""
    n, h, d = q.shape
    m, hkv, _ = k.shape
    if not supports_prefill_attention(h, hkv, d):
        raise ValueError(f"unsupported attention shape: {h} heads, {hkv} kv heads, head_dim {d}")
    if n and not (k_pos0 <= q_pos0 and q_pos0 + n <= k_pos0 + m):
        raise ValueError(f"queries at {q_pos0}..{q_pos0 + n - 1} outside keys {k_pos0}..{k_pos0 + m - 1}")
    q, k, v = (t.contiguous() for t in (q, k, v))
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(t, torch.float32, name)
    out = torch.empty_like(q)
    if n:
        library().kvw_prefill_attention(q.data_ptr(), n, h, hkv, d, k.data_ptr(), v.data_ptr(), m, q_pos0, k_pos0,
                                        window or 0, sm_scale, out.data_ptr(), threads or torch.get_num_threads())
    return out


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(prog="python -m kvwire_kernels.cpu", description="Build the CPU decode kernels.")
    ap.add_argument("--prebuild", type=Path, metavar="DIR", help="compile the portable x86-64-v4-vnni-bf16-amx/v4-vnni-bf16/v4-vnni/v4/v3 binaries into DIR")
    args = ap.parse_args()
    if args.prebuild:
        for p in prebuild(args.prebuild):
            print(p)
    else:
        print("CPU kernels:", "available" if available() else unavailable_reason)
