"""The one mapping between wire messages and kvwire's typed objects (used only at the wire edge)."""
from __future__ import annotations

from kvwire.config import KVDtype, QuantMode
from kvwire.fingerprint import Fingerprint
from kvwire.kv.spec import KVPageSpec, ScaleDtype, ScaleGranularity
from kvwire.errors import FailedPrecondition, InvalidRequest
from kvwire.sampling_params import (FinishReason, KVSourceChoice, SamplingParams, SpeculativeMode, StructuredKind,
                                   StructuredOutput, TokenLogprobs)
from protos.kvwire.v1 import kvwire_pb2 as pb

DEFAULT_MAX_TOKENS = 128

_KV_DTYPE = {KVDtype.FP8_E4M3: pb.KVPageSpec.KV_DTYPE_FP8_E4M3, KVDtype.BF16: pb.KVPageSpec.KV_DTYPE_BF16}
_KV_DTYPE_BACK = {v: k for k, v in _KV_DTYPE.items()}
_SCALE_GRAN = {ScaleGranularity.PER_PAGE_HEAD: pb.KVPageSpec.SCALE_GRANULARITY_PER_PAGE_HEAD,
               ScaleGranularity.PER_TOKEN_HEAD: pb.KVPageSpec.SCALE_GRANULARITY_PER_TOKEN_HEAD}
_SCALE_GRAN_BACK = {v: k for k, v in _SCALE_GRAN.items()}
_SCALE_DTYPE = {ScaleDtype.FLOAT32: pb.KVPageSpec.SCALE_DTYPE_FLOAT32, ScaleDtype.BF16: pb.KVPageSpec.SCALE_DTYPE_BF16}
_SCALE_DTYPE_BACK = {v: k for k, v in _SCALE_DTYPE.items()}
_SPEC_MODE = {None: pb.SamplingParams.SPECULATIVE_MODE_UNSPECIFIED,
              SpeculativeMode.NONE: pb.SamplingParams.SPECULATIVE_MODE_NONE,
              SpeculativeMode.DRAFT: pb.SamplingParams.SPECULATIVE_MODE_DRAFT,
              SpeculativeMode.NGRAM: pb.SamplingParams.SPECULATIVE_MODE_NGRAM}
_SPEC_MODE_BACK = {v: k for k, v in _SPEC_MODE.items()}
_WEIGHTS_MODE = {QuantMode.NONE: pb.WEIGHTS_MODE_NONE, QuantMode.BF16: pb.WEIGHTS_MODE_BF16,
                 QuantMode.INT8: pb.WEIGHTS_MODE_INT8, QuantMode.FP8: pb.WEIGHTS_MODE_FP8,
                 QuantMode.GGUF: pb.WEIGHTS_MODE_GGUF, QuantMode.INT4: pb.WEIGHTS_MODE_INT4,
                 QuantMode.INT4_AWQ: pb.WEIGHTS_MODE_INT4_AWQ, QuantMode.INT4_GPTQ: pb.WEIGHTS_MODE_INT4_GPTQ}
_WEIGHTS_MODE_BACK = {v: k.value for k, v in _WEIGHTS_MODE.items()}
_FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, FinishReason.STOP: pb.FINISH_REASON_STOP,
           FinishReason.LENGTH: pb.FINISH_REASON_LENGTH}
_FINISH_BACK = {v: k for k, v in _FINISH.items()}


_KV_SOURCE = {KVSourceChoice.AUTO: pb.KV_SOURCE_UNSPECIFIED, KVSourceChoice.LOCAL: pb.KV_SOURCE_LOCAL,
              KVSourceChoice.REMOTE: pb.KV_SOURCE_REMOTE}
_KV_SOURCE_BACK = {v: k for k, v in _KV_SOURCE.items()}


def kv_source_to_pb(choice: KVSourceChoice) -> int:
    return _KV_SOURCE[choice]


def kv_source_from_pb(value: int) -> KVSourceChoice:
    if value not in _KV_SOURCE_BACK:
        raise InvalidRequest(f"kv_source {value} is not a KVSource value this service knows")
    return _KV_SOURCE_BACK[value]


def finish_to_pb(reason: FinishReason | None) -> int:
    return _FINISH[reason]


def finish_from_pb(value: int) -> FinishReason | None:
    return _FINISH_BACK[value]


def sampling_from_pb(m: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields take defaults; set-but-invalid values are left for validate() to refuse."""
    return SamplingParams(
        max_tokens=m.max_tokens if m.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        temperature=m.temperature, top_k=m.top_k, top_p=m.top_p if m.HasField("top_p") else 1.0,
        seed=m.seed if m.HasField("seed") else None, stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        # An enum value this build does not know becomes a string validate() refuses by name.
        speculative=_SPEC_MODE_BACK.get(m.speculative, f"unknown enum value {m.speculative}"),
        num_speculative_tokens=m.num_speculative_tokens if m.HasField("num_speculative_tokens") else None,
        presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty") else 1.0,
        min_p=m.min_p, logit_bias=dict(m.logit_bias), min_tokens=m.min_tokens,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        n=m.n if m.HasField("n") else 1,
        structured=structured_from_pb(m.structured) if m.HasField("structured") else None)


def structured_from_pb(m: pb.StructuredOutput) -> StructuredOutput:
    """Unset kind (or json_object false) is left for validate() to refuse by name."""
    kind = m.WhichOneof("kind")
    if kind == "choice":
        return StructuredOutput(StructuredKind.CHOICE, choices=tuple(m.choice.choices))
    if kind == "json_object":
        return StructuredOutput(StructuredKind.JSON_OBJECT if m.json_object else "json_object false")
    if kind is None:
        return StructuredOutput("unset (set one of json_schema, json_object, regex, choice, grammar)")
    return StructuredOutput(StructuredKind(kind), getattr(m, kind))


def structured_to_pb(s: StructuredOutput) -> pb.StructuredOutput:
    if s.kind is StructuredKind.CHOICE:
        return pb.StructuredOutput(choice=pb.StructuredOutput.Choices(choices=list(s.choices)))
    if s.kind is StructuredKind.JSON_OBJECT:
        return pb.StructuredOutput(json_object=True)
    return pb.StructuredOutput(**{s.kind.value: s.spec})


def sampling_to_pb(p: SamplingParams) -> pb.SamplingParams:
    m = pb.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                          stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos)
    if p.seed is not None:
        m.seed = p.seed
    if p.speculative is not None:
        m.speculative = _SPEC_MODE[p.speculative]
    if p.num_speculative_tokens is not None:
        m.num_speculative_tokens = p.num_speculative_tokens
    m.presence_penalty, m.frequency_penalty, m.min_p, m.min_tokens = (p.presence_penalty, p.frequency_penalty,
                                                                      p.min_p, p.min_tokens)
    if p.repetition_penalty != 1.0:
        m.repetition_penalty = p.repetition_penalty
    m.logit_bias.update(dict(p.logit_bias))
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        m.prompt_logprobs = p.prompt_logprobs
    if p.n != 1:
        m.n = p.n
    if p.structured is not None:
        m.structured.CopyFrom(structured_to_pb(p.structured))
    return m


def logprobs_to_pb(entries: list[TokenLogprobs]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=e.token_id, logprob=e.logprob,
                            top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in e.top])
            for e in entries]


def logprobs_from_pb(msgs) -> list[TokenLogprobs]:
    return [TokenLogprobs(m.token_id, m.logprob, tuple((t.token_id, t.logprob) for t in m.top_logprobs))
            for m in msgs]


def spec_to_pb(s: KVPageSpec) -> pb.KVPageSpec:
    return pb.KVPageSpec(block_size=s.block_size, num_layers=s.num_layers, num_kv_heads=s.num_kv_heads,
                         head_dim=s.head_dim, dtype=_KV_DTYPE[s.dtype],
                         scale_granularity=_SCALE_GRAN[s.scale_granularity],
                         scale_dtype=_SCALE_DTYPE[s.scale_dtype], format_version=s.format_version)


def spec_from_pb(m: pb.KVPageSpec) -> KVPageSpec:
    """A peer's page layout; one this build cannot hold is FAILED_PRECONDITION (not a bug here)."""
    if m.dtype not in _KV_DTYPE_BACK:
        raise FailedPrecondition(f"KV page dtype {m.dtype} is not supported "
                                 f"(supported: {', '.join(d.value for d in _KV_DTYPE)})")
    try:
        return KVPageSpec(block_size=m.block_size, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                          head_dim=m.head_dim, dtype=_KV_DTYPE_BACK[m.dtype],
                          # Unset fields are a format 1 peer's: they make the spec diff say so.
                          scale_granularity=_SCALE_GRAN_BACK.get(m.scale_granularity, ScaleGranularity.PER_PAGE_HEAD),
                          scale_dtype=_SCALE_DTYPE_BACK.get(m.scale_dtype, ScaleDtype.FLOAT32),
                          format_version=m.format_version or 1)
    except ValueError as e:  # a zero size
        raise FailedPrecondition(f"KV page spec refused: {e}") from e


def fingerprint_to_pb(f: Fingerprint) -> pb.ModelFingerprint:
    return pb.ModelFingerprint(model_name=f.model_name, architecture=f.architecture,
                               model_config_sha256=f.model_config_sha256, weights_sha256=f.weights_sha256,
                               tokenizer_sha256=f.tokenizer_sha256,
                               weights_mode=_WEIGHTS_MODE[QuantMode(f.quantization)],
                               weights_dtype=f.weights_dtype)


def fingerprint_from_pb(m: pb.ModelFingerprint) -> Fingerprint:
    return Fingerprint(model_name=m.model_name, architecture=m.architecture,
                       model_config_sha256=m.model_config_sha256, weights_sha256=m.weights_sha256,
                       tokenizer_sha256=m.tokenizer_sha256,
                       # An unknown mode stays visible by name so the fingerprint diff shows it.
                       quantization=_WEIGHTS_MODE_BACK.get(m.weights_mode, f"weights mode {m.weights_mode}"),
                       weights_dtype=m.weights_dtype)


def chunk_to_pb(c) -> pb.KVChunk:
    return pb.KVChunk(layer=c.layer, first_page=c.first_page, num_pages=c.num_pages, k_values=c.k,
                      v_values=c.v, k_scales=c.k_scales, v_scales=c.v_scales, crc32=c.crc32)


def chunk_from_pb(m: pb.KVChunk):
    from kvwire.kv.wire import KVChunk  # here, not at the top: the tokenizer service never loads torch
    return KVChunk(layer=m.layer, first_page=m.first_page, num_pages=m.num_pages, k=m.k_values, v=m.v_values,
                   k_scales=m.k_scales, v_scales=m.v_scales, crc32=m.crc32)
