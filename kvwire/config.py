"""Frozen, torch-free configuration objects.

Built once (in a service's ``__main__`` or a script) and passed down; nothing here reads the
environment. ``ModelConfig.from_hf`` is the one place that understands Hugging Face
``config.json`` dialects (``rope_scaling`` + ``rope_theta`` as in transformers 4.x checkpoints,
``rope_parameters`` as transformers 5 writes them).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The embedded model, shipped in the repository: the default wherever a model is optional.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "kvwire-tiny"

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class ConfigError(ValueError):
    """A config.json this project cannot run, with a message that says what and where."""


class DType(str, enum.Enum):
    """Floating dtype that weights are held in (before any quantization)."""

    FP32 = "fp32"
    BF16 = "bf16"


class WeightsMode(str, enum.Enum):
    """How linear-layer weights are stored and multiplied (``--weights``; ``WeightsMode`` on the wire)."""

    NONE = "none"  # weights kept in ModelConfig's dtype
    BF16 = "bf16"
    INT8 = "int8"
    FP8 = "fp8"
    # A GGUF file's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks as stored (kvwire.model.gguf_linear);
    # int8 for every other layer, and for everything in a checkpoint that is not a GGUF file.
    GGUF = "gguf"
    # Group-wise 4-bit from a float checkpoint, written as GGUF Q4_1 blocks (kvwire.model.int4), lm_head
    # Q8_0: round-to-nearest, or with activation-aware scales from calibration text (kvwire.model.awq),
    # or those scales then GPTQ's error feedback, layer by layer (kvwire.model.gptq).
    INT4 = "int4"
    INT4_AWQ = "int4-awq"
    INT4_GPTQ = "int4-gptq"


QuantMode = WeightsMode  # deprecated name of WeightsMode


class KVDtype(str, enum.Enum):
    FP8_E4M3 = "fp8_e4m3"
    BF16 = "bf16"


@dataclass(frozen=True)
class RuntimeConfig:
    """What ``kvwire.runtime.load_runtime`` loads: a model, its weights mode and its KV page format.
    Built from ``EngineArgs`` (``kvwire.args``: the model and cache sections)."""

    model_dir: Path
    weights: WeightsMode = WeightsMode.NONE  # none = the checkpoint in fp32
    kv_dtype: KVDtype = KVDtype.FP8_E4M3
    block_size: int = 16
    num_pages: int = 512
    device: str = "cpu"


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # Per layer: None (full attention) or the number of most recent positions a query sees.
    layer_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def sliding_window(self) -> int | None:
        ws = [w for w in self.layer_windows if w is not None]
        return max(ws) if ws else None

    @staticmethod
    def from_hf(cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "")
        arch = archs[0] if archs else {
            "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
        }.get(model_type, model_type or "<missing>")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{source}: architecture {arch!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
                raise ConfigError(f"{source}: {key!r} must be a positive integer, got {cfg.get(key)!r}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        n_layers = cfg["num_hidden_layers"]
        n_heads = cfg["num_attention_heads"]
        n_kv = cfg.get("num_key_value_heads") or n_heads
        if n_heads % n_kv:
            raise ConfigError(f"{source}: num_attention_heads {n_heads} is not a multiple of "
                              f"num_key_value_heads {n_kv}")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads

        rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        kind = rp.get("rope_type", rp.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3"):
            raise ConfigError(f"{source}: rope type {kind!r} is not supported "
                              "(supported: default, linear, llama3)")
        rope = RopeConfig(
            theta=theta, kind=kind, factor=float(rp.get("factor", 1.0)),
            low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rp.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rp.get("original_max_position_embeddings", 8192)))

        windows = _layer_windows(cfg, arch, n_layers)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        return ModelConfig(
            architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=n_layers, num_heads=n_heads,
            num_kv_heads=n_kv, head_dim=head_dim,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            layer_windows=windows, bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids)


def _layer_windows(cfg: dict[str, Any], arch: str, n_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
        return (None,) * n_layers
    if window is None:
        return (None,) * n_layers
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if arch == "Qwen2ForCausalLM":
        first_full = cfg.get("max_window_layers", n_layers)
        return tuple(window if i >= first_full else None for i in range(n_layers))
    return (int(window),) * n_layers
