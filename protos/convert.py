"""The one mapping between wire messages and kvwire's typed objects (used only at the wire edge)."""
from __future__ import annotations

from kvwire.config import KVDtype
from kvwire.fingerprint import Fingerprint
from kvwire.kv.spec import KVPageSpec, ScaleGranularity
from kvwire.sampling import SamplingParams
from protos import kvwire_pb2 as pb

DEFAULT_MAX_TOKENS = 128

_KV_DTYPE = {KVDtype.FP8_E4M3: pb.KVPageSpec.FP8_E4M3, KVDtype.BF16: pb.KVPageSpec.BF16}
_KV_DTYPE_BACK = {v: k for k, v in _KV_DTYPE.items()}
_SPEC_MODE = {None: pb.SamplingParams.SPECULATIVE_MODE_UNSPECIFIED, "none": pb.SamplingParams.NONE,
              "draft": pb.SamplingParams.DRAFT, "ngram": pb.SamplingParams.NGRAM}
_SPEC_MODE_BACK = {v: k for k, v in _SPEC_MODE.items()}


def sampling_from_pb(m: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields take defaults; set-but-invalid values are left for validate() to refuse."""
    return SamplingParams(
        max_tokens=m.max_tokens if m.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        temperature=m.temperature, top_k=m.top_k, top_p=m.top_p if m.HasField("top_p") else 1.0,
        seed=m.seed if m.HasField("seed") else None, stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        # An enum value this build does not know becomes a string validate() refuses by name.
        speculative=_SPEC_MODE_BACK.get(m.speculative, f"unknown enum value {m.speculative}"),
        num_speculative_tokens=m.num_speculative_tokens if m.HasField("num_speculative_tokens") else None)


def sampling_to_pb(p: SamplingParams) -> pb.SamplingParams:
    m = pb.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                          stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos)
    if p.seed is not None:
        m.seed = p.seed
    if p.speculative is not None:
        m.speculative = _SPEC_MODE[p.speculative]
    if p.num_speculative_tokens is not None:
        m.num_speculative_tokens = p.num_speculative_tokens
    return m


def spec_to_pb(s: KVPageSpec) -> pb.KVPageSpec:
    return pb.KVPageSpec(block_size=s.block_size, num_layers=s.num_layers, num_kv_heads=s.num_kv_heads,
                         head_dim=s.head_dim, dtype=_KV_DTYPE[s.dtype],
                         scale_granularity=pb.KVPageSpec.PER_PAGE_HEAD)


def spec_from_pb(m: pb.KVPageSpec) -> KVPageSpec:
    if m.dtype not in _KV_DTYPE_BACK:
        raise ValueError(f"KV page dtype {m.dtype} is not supported")
    return KVPageSpec(block_size=m.block_size, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                      head_dim=m.head_dim, dtype=_KV_DTYPE_BACK[m.dtype],
                      scale_granularity=ScaleGranularity.PER_PAGE_HEAD)


def fingerprint_to_pb(f: Fingerprint) -> pb.ModelFingerprint:
    return pb.ModelFingerprint(model_name=f.model_name, architecture=f.architecture,
                               model_config_sha256=f.model_config_sha256, weights_sha256=f.weights_sha256,
                               tokenizer_sha256=f.tokenizer_sha256, quantization=f.quantization,
                               weights_dtype=f.weights_dtype)


def fingerprint_from_pb(m: pb.ModelFingerprint) -> Fingerprint:
    return Fingerprint(model_name=m.model_name, architecture=m.architecture,
                       model_config_sha256=m.model_config_sha256, weights_sha256=m.weights_sha256,
                       tokenizer_sha256=m.tokenizer_sha256, quantization=m.quantization,
                       weights_dtype=m.weights_dtype)


def chunk_to_pb(c) -> pb.KVChunk:
    return pb.KVChunk(layer=c.layer, first_page=c.first_page, num_pages=c.num_pages, k_values=c.k,
                      v_values=c.v, k_scales=c.k_scales, v_scales=c.v_scales, crc32=c.crc32)


def chunk_from_pb(m: pb.KVChunk):
    from kvwire.kv.wire import KVChunk  # here, not at the top: the tokenizer service never loads torch
    return KVChunk(layer=m.layer, first_page=m.first_page, num_pages=m.num_pages, k=m.k_values, v=m.v_values,
                   k_scales=m.k_scales, v_scales=m.v_scales, crc32=m.crc32)
