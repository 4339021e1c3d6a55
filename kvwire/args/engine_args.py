"""``EngineArgs`` (the sections together) and ``SERVICES`` (which sections each service reads, with
its own defaults)."""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvwire.args.sections import (CacheArgs, ComputeArgs, KVSourceArgs, ModelArgs, PeerArgs, SchedulerArgs,
                                  SecurityArgs, ServingArgs, SpeculativeArgs, TokenizerArgs)
from kvwire.config import RuntimeConfig

@dataclass(frozen=True)
class EngineArgs:
    model: ModelArgs = field(default_factory=ModelArgs)
    cache: CacheArgs = field(default_factory=CacheArgs)
    compute: ComputeArgs = field(default_factory=ComputeArgs)
    scheduler: SchedulerArgs = field(default_factory=SchedulerArgs)
    speculative: SpeculativeArgs = field(default_factory=SpeculativeArgs)
    kv_source: KVSourceArgs = field(default_factory=KVSourceArgs)
    serving: ServingArgs = field(default_factory=ServingArgs)
    security: SecurityArgs = field(default_factory=SecurityArgs)
    peer: PeerArgs = field(default_factory=PeerArgs)
    tokenizer: TokenizerArgs = field(default_factory=TokenizerArgs)

    def runtime_config(self) -> RuntimeConfig:
        """The target model's runtime (``kvwire.runtime.load_runtime``)."""
        return RuntimeConfig(model_dir=self.model.model_dir, weights=self.model.weights, kv_dtype=self.cache.kv_dtype,
                             block_size=self.cache.block_size, num_pages=self.cache.num_pages, device=self.model.device)

    @staticmethod
    def from_values(values: Mapping[str, Any], service: str = "llm") -> "EngineArgs":
        """From flag dests (``num_pages``, ``speculative``, ``prefill_tls_ca`` ...); a missing one takes
        ``service``'s default. ValueError for a value out of range, TypeError for an unknown name."""
        spec, values = SERVICES[service], dict(values)
        kwargs: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for section, _, f, dest in service_flags(service):
            if dest in spec.defaults:
                kwargs[section][f.name] = spec.defaults[dest]
            if dest in values:
                kwargs[section][f.name] = values.pop(dest)
        if values:
            raise TypeError(f"unknown argument{'s' * (len(values) > 1)}: {', '.join(sorted(values))}")
        return EngineArgs(**{name: SECTIONS[name](**kw) for name, kw in kwargs.items()})

    @staticmethod
    def from_llm_kwargs(model: str | Path, **kwargs: Any) -> "EngineArgs":
        """``LLM(model, **kwargs)``: the flags' names; the deprecated aliases (``draft_model``,
        ``speculative_adaptive``) still work, with a DeprecationWarning."""
        for _, _, f, dest in service_flags("llm"):
            for alias in f.metadata["aliases"]:
                if alias in kwargs:
                    warnings.warn(f"LLM({alias}=) is deprecated: use {dest}=", DeprecationWarning, stacklevel=3)
                    kwargs.setdefault(dest, kwargs.pop(alias))
        return EngineArgs.from_values({"model_dir": model, **kwargs}, "llm")


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(EngineArgs)}  # name -> class


def section_dests(cls: type, peer: str | None = None) -> list[tuple[dataclasses.Field, str]]:
    """A section's fields with their flag dests (``<peer>_`` prefixed for ``PeerArgs``)."""
    out = []
    for f in dataclasses.fields(cls):
        dest = f.metadata.get("dest") or f.name
        out.append((f, f"{peer}_{dest}" if cls is PeerArgs else dest))
    return out


@dataclass(frozen=True)
class ServiceSpec:
    prog: str
    sections: tuple[str, ...]  # the EngineArgs sections it reads (others keep their defaults)
    defaults: Mapping[str, Any] = field(default_factory=dict)  # by dest: where it differs from the section's
    help: Mapping[str, str] = field(default_factory=dict)  # by dest: where its meaning is narrower
    only: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # section -> the dests it takes
    peer: str | None = None  # the service it calls: PeerArgs flags --<peer>-...


_ENGINE = ("model", "cache", "compute")
_SERVE = ("serving", "security")
SERVICES: dict[str, ServiceSpec] = {
    "prefill_svc": ServiceSpec(
        "python -m prefill_svc", _ENGINE + _SERVE,
        defaults={"num_pages": 1024, "listen": "127.0.0.1:50053"},
        help={"prefix_caching": "keep full prompt pages (named by a sha256 chain of their tokens) and reuse them for "
                                "later prompts with the same prefix; evicted LRU when the pool runs short"}),
    "decode_svc": ServiceSpec(
        "python -m decode_svc", _ENGINE + ("scheduler", "speculative", "kv_source", *_SERVE, "peer"),
        defaults={"num_pages": 2048, "listen": "127.0.0.1:50052"}, peer="prefill",
        help={"prefix_caching": "keep full prompt pages and reuse them for prompts with the same prefix; only the "
                                "pages decode lacks are computed locally or asked from prefill_svc"}),
    "tokenizer_svc": ServiceSpec(
        "python -m tokenizer_svc", ("model", "tokenizer", *_SERVE, "peer"),
        defaults={"listen": "127.0.0.1:50051", "grace_s": 30.0}, peer="decode", only={"model": ("model_dir",)},
        help={"model_dir": "directory with tokenizer.json (+ tokenizer_config.json), a .gguf file or a directory "
                           "holding one, or a fetched model's name; default: the embedded model"}),
    "llm": ServiceSpec("LLM", ("model", "cache", "scheduler", "speculative"),
                       defaults={"num_pages": 512, "max_waiting": 1024}),
}

GROUP_TITLES = {  # argparse groups; also the section tables a --config file may use
    "model": "model", "cache": "KV cache", "compute": "compute", "scheduler": "scheduler",
    "speculative": "speculative decoding", "kv_source": "KV source (local or remote prefill)",
    "serving": "serving", "security": "security (each flag's default: the KVWIRE_* variable named)",
    "peer": "outgoing channel to {peer} (each flag's default: the KVWIRE_* variable named)",
    "tokenizer": "front door"}


def service_flags(service: str) -> list[tuple[str, type, dataclasses.Field, str]]:
    """(section, section class, field, dest) of every flag ``service`` takes, in help order."""
    spec, out = SERVICES[service], []
    for name in spec.sections:
        cls = SECTIONS[name]
        for f, dest in section_dests(cls, spec.peer):
            if name not in spec.only or dest in spec.only[name]:
                out.append((name, cls, f, dest))
    return out
