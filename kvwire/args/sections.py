"""The sections of ``EngineArgs``: frozen dataclasses whose fields declare their flags (``arg``), with
their range checks (``validate``: ValueError naming the flag)."""
from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvwire.config import DEFAULT_MODEL_DIR, KVDtype, WeightsMode
from kvwire.sampling_params import MAX_SPECULATIVE_TOKENS, SpeculativeMode

DEFAULT_DRAIN_DELAY_S = 5.0  # long enough for a Kubernetes endpoint update to reach load balancers
# Mirrors of defaults owned by torch-importing or service modules (tests/kvwire/test_args.py keeps them equal).
DEFAULT_TRANSFER_TIMEOUT_S = 30.0  # decode_svc.remote_prefill
SPEC_NGRAM_MAX, SPEC_GREEDY_MAX_BATCH = 16, 2  # kvwire.spec.SpecConfig
MAX_NUM_BATCHED_TOKENS, PREFILL_CHUNK, MAX_PREFILL_STALL = 512, 256, 0.0  # kvwire.engine.scheduler.SchedulerConfig
ROUTING_LOAD_FACTOR = 1.25  # tokenizer_svc.routing.RoutingConfig
FRONT_DOOR_MESSAGE_BYTES, MAX_PROMPT_BYTES, MAX_PROMPT_TOKENS, TOKENIZE_WORKERS = 2 << 20, 1 << 20, 131_072, 2


class DecodeRouting(str, enum.Enum):
    """How the front door picks a decode replica (tokenizer_svc/routing.py)."""
    ROUND_ROBIN = "round_robin"  # gRPC's round_robin over --decode-addr's addresses
    PREFIX = "prefix"  # consistent hashing on the prompt's first KV page, with bounded load


def arg(default: Any = None, help: str = "", *, dest: str | None = None, metavar: str | None = None,
        env: str | None = None, store_true: bool = False, aliases: tuple[str, ...] = ()) -> Any:
    """A field declaring its flag: ``dest`` (default: the field name), ``env`` (a ``kvwire.envs`` variable
    that is the flag's default when set), ``store_true`` (a bare switch, no --no- form), ``aliases``
    (deprecated LLM keyword names)."""
    meta = dict(help=help, dest=dest, metavar=metavar, env=env, store_true=store_true, aliases=aliases)
    return field(default=default, metadata=meta)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class Section:
    """Base of the sections: coerces enum and Path fields given as text (a flag, a TOML value, an
    LLM keyword) and runs ``validate``."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            kind, value = base_type(type(self), f.name), getattr(self, f.name)
            if value is not None and isinstance(kind, type) and not isinstance(value, kind) and kind is not bool:
                object.__setattr__(self, f.name, kind(value))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the flag when a value is out of range."""


def base_type(cls: type, name: str) -> Any:
    """A field's type without ``| None``."""
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args and type(None) in typing.get_args(hint) else hint


@dataclass(frozen=True)
class ModelArgs(Section):
    model_dir: Path = arg(DEFAULT_MODEL_DIR, "local HF model directory (config.json + safetensors), a .gguf file "
                          "or a directory holding one, or a fetched model's name (python -m tools.fetch_model --list)")
    weights: WeightsMode = arg(WeightsMode.INT8, "weight mode: int8 (default: weight-only, the fastest within the "
                               "accuracy budget), bf16, fp8 (weight-only e4m3), none (the checkpoint as fp32), gguf "
                               "(a GGUF file's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K layers as stored, int8 for the others), "
                               "int4 (group-wise 4-bit, round-to-nearest, from a float checkpoint), int4-awq (int4 "
                               "with activation-aware scales searched on calibration text), int4-gptq (int4-awq's scales, then each layer "
                               "rounded with GPTQ's error feedback; both cached in KVWIRE_AWQ_CACHE)")
    device: str = arg("cpu", "torch device for weights and KV pages: cpu (default) or cuda[:N] (Triton kernels)")


@dataclass(frozen=True)
class CacheArgs(Section):
    kv_dtype: KVDtype = arg(KVDtype.FP8_E4M3, "KV page dtype, in memory and on the wire")
    block_size: int = arg(16, "tokens per KV page")
    num_pages: int = arg(512, "KV pages in this service's pool")
    prefix_caching: bool = arg(False, "keep full prompt pages and reuse them for prompts with the same prefix")

    def validate(self) -> None:
        _check(self.block_size >= 1, f"--block-size must be at least 1, got {self.block_size}")
        _check(self.num_pages >= 1, f"--num-pages must be at least 1, got {self.num_pages}")


@dataclass(frozen=True)
class ComputeArgs(Section):
    threads: int | None = arg(None, "compute threads (torch and the CPU kernels). Default: OMP_NUM_THREADS if set, "
                              "else the CPUs this process may use (its CPU affinity, capped by a cgroup CPU limit such "
                              "as a Kubernetes pod's). Services sharing a host should split its cores between them: "
                              "OpenMP threads that outnumber the cores stall each other at every barrier")
    share_cores: Path | None = arg(None, "prefill_svc and decode_svc on one host, given the same FILE (created if "
                                   "missing): each computes on all usable CPUs while the other is idle and on its "
                                   "--threads share while both compute (tools/stack.py passes one when it splits the "
                                   "cores)", metavar="FILE")

    def validate(self) -> None:
        _check(self.threads is None or self.threads >= 1, f"--threads must be at least 1, got {self.threads}")


@dataclass(frozen=True)
class SchedulerArgs(Section):
    max_running: int = arg(16, "requests admitted (prefilling or decoding) together at most")
    max_waiting: int = arg(1024, "queued requests before RESOURCE_EXHAUSTED (a queued request waits until its "
                           "deadline; one that can never fit the pool is refused at once)")
    max_num_batched_tokens: int = arg(MAX_NUM_BATCHED_TOKENS, "tokens one step feeds at most: every decoding "
                                      "request's rows, then prompt chunks (the oldest prompt's always; younger ones' "
                                      "while they fit). docs/decisions/060-chunked-prefill.md")
    prefill_chunk_size: int = arg(PREFILL_CHUNK, "the unit a prompt is cut into, at fixed places so its KV does not "
                                  "depend on the load; a step takes as many of a prompt's chunks as its budgets allow. "
                                  "docs/decisions/072-prefill-stall-budget.md")
    max_prefill_stall: float = arg(MAX_PREFILL_STALL, "while requests decode, the prompt chunks a step adds take at most "
                                   "this multiple of such a step's time (measured here), or a quarter of the prompt "
                                   "tokens waiting if that is more, so a new prompt delays the running streams' next "
                                   "tokens by a bounded factor: lower ITL p99 at some cost in throughput and TTFT (use "
                                   "it with --prefill-chunk-size 32 to 64); 0: off, only --max-num-batched-tokens "
                                   "limits them. docs/decisions/072-prefill-stall-budget.md")
    chunked_prefill: bool = arg(True, "prefill prompts here in chunks, mixed with decode steps; off: each prompt in "
                                "one forward")

    def validate(self) -> None:
        _check(self.max_running >= 1, f"--max-running must be at least 1, got {self.max_running}")
        _check(self.max_waiting >= 0, f"--max-waiting must not be negative, got {self.max_waiting}")
        _check(self.max_num_batched_tokens >= 1, "--max-num-batched-tokens must be at least 1, got "
               f"{self.max_num_batched_tokens}")
        _check(self.prefill_chunk_size >= 1, f"--prefill-chunk-size must be at least 1, got {self.prefill_chunk_size}")
        _check(self.max_prefill_stall >= 0, f"--max-prefill-stall must not be negative, got {self.max_prefill_stall}")


@dataclass(frozen=True)
class SpeculativeArgs(Section):
    mode: SpeculativeMode = arg(SpeculativeMode.NONE, "default mode for requests that do not set "
                                "sampling.speculative", dest="speculative")
    num_speculative_tokens: int = arg(4, "default tokens proposed per step (k)", metavar=f"1..{MAX_SPECULATIVE_TOKENS}")
    adaptive_speculation: bool = arg(True, "adapt k per request to its acceptance (+2 when all accepted, -1 "
                                     "otherwise, between 1 and the request's k)", aliases=("speculative_adaptive",))
    speculative_auto_off: bool = arg(True, "a request stops speculating while its acceptance is below break-even "
                                     "(and n-gram requests start again when their lookups would have paid)")
    speculative_greedy_max_batch: int = arg(SPEC_GREEDY_MAX_BATCH, "greedy and unseeded sampled requests do not "
                                            "speculate in decode steps of more than N requests (0: no limit); seeded "
                                            "sampled ones keep a batch-independent policy", metavar="N")
    draft_model_dir: str | None = arg(None, "draft model (same tokenizer as --model-dir) or draft head (a directory "
                                      "with draft_head.json, distilled from --model-dir); loaded only when given, or "
                                      "with --speculative draft from <model-dir>-draft beside the model; '' = none",
                                      aliases=("draft_model",))
    draft_weights: WeightsMode | None = arg(None, "draft (or draft head) weight mode (default: the target's --weights)")
    draft_kv_dtype: KVDtype = arg(KVDtype.BF16, "draft KV page dtype (bf16: the draft's writes skip fp8 scale "
                                  "upkeep; its pool has --num-pages pages)")
    ngram_max: int = arg(SPEC_NGRAM_MAX, "n-gram lookup: longest suffix tried")
    ngram_min: int = arg(1, "n-gram lookup: shortest suffix tried")

    def validate(self) -> None:
        k = self.num_speculative_tokens
        _check(1 <= k <= MAX_SPECULATIVE_TOKENS, f"--num-speculative-tokens must be in [1, {MAX_SPECULATIVE_TOKENS}]"
               f", got {k}")
        _check(1 <= self.ngram_min <= self.ngram_max, "--ngram-min and --ngram-max need 1 <= min <= max, got "
               f"{self.ngram_min} and {self.ngram_max}")
        _check(self.speculative_greedy_max_batch >= 0, "--speculative-greedy-max-batch must not be negative")

    @property
    def draft_path(self) -> Path | None:
        """--draft-model-dir as given: None when not given or ''."""
        return Path(self.draft_model_dir) if self.draft_model_dir else None


@dataclass(frozen=True)
class KVSourceArgs(Section):
    prefill_addr: str = arg("127.0.0.1:50053", "prefill_svc address: host:port, or dns:///name:port for several "
                            "replicas; '' = none (every prompt prefills in this process)")
    local_prefill_max_tokens: int = arg(256, "prompts of at most this many tokens prefill here instead of on "
                                        "prefill_svc (unless the request sets kv_source), while fewer than "
                                        "--local-prefill-max-decoding requests decode here; longer ones go remote "
                                        "while prefill_svc is reachable. 0 = all go remote")
    local_prefill_when_idle: bool = arg(True, "a prompt of any length prefills here while nothing else runs here (no "
                                        "request decoding, no prefill of this service's in flight): no steps to hold "
                                        "up, no pages to ship. Turn off when prefill_svc runs on much faster hardware "
                                        "than decode")
    local_prefill_max_decoding: int = arg(8, "short prompts go to prefill_svc too once this many requests are "
                                          "decoding here (a local prefill holds up their steps)")
    remote_prefill_max_inflight: int = arg(8, "with this many remote prefills running, further prompts prefill here "
                                           "(overload)")
    kv_transfer_timeout_s: float = arg(DEFAULT_TRANSFER_TIMEOUT_S, "longest a KV pull from prefill_svc may take "
                                       "(capped further by the caller's deadline); a stalled prefill ends the request "
                                       "DEADLINE_EXCEEDED and frees its pages")
    prefill_health_interval_s: float = arg(5.0, "how often prefill_svc's health is checked; while it is not "
                                           "SERVING, AUTO requests prefill here")
    readiness_follows_prefill: bool = arg(False, "opt-in: report kvwire.v1.DecodeService NOT_SERVING while "
                                          "prefill_svc is unreachable. Off by default: decode serves through "
                                          "its local prefill meanwhile, and a prefill outage must not take every "
                                          "decode pod out of service (the overall health, for liveness, never "
                                          "follows prefill)")

    def validate(self) -> None:
        _check(self.kv_transfer_timeout_s > 0, "--kv-transfer-timeout-s must be positive")
        _check(self.prefill_health_interval_s > 0, "--prefill-health-interval-s must be positive")
        for name in ("local_prefill_max_tokens", "local_prefill_max_decoding", "remote_prefill_max_inflight"):
            _check(getattr(self, name) >= 0, f"--{name.replace('_', '-')} must not be negative")


@dataclass(frozen=True)
class ServingArgs(Section):
    listen: str = arg("127.0.0.1:50051", "host:port to serve on (port 0: any free port)")
    grace_s: float = arg(20.0, "seconds in-flight calls get at SIGTERM")
    drain_delay_s: float = arg(DEFAULT_DRAIN_DELAY_S, "at SIGTERM, seconds health reports NOT_SERVING while calls "
                               "are still accepted (load balancers notice), before the --grace-s drain",
                               env="KVWIRE_DRAIN_DELAY_S")
    metrics_port: int | None = arg(None, "serve Prometheus /metrics on this port (off if unset)")
    metrics_host: str | None = arg(None, "interface /metrics binds (default: --listen's host)", env="KVWIRE_METRICS_HOST")
    no_reflection: bool = arg(False, "do not serve gRPC reflection", env="KVWIRE_NO_REFLECTION", store_true=True)
    log_level: str = arg("INFO", "logging level")

    def validate(self) -> None:
        _check(self.grace_s >= 0, f"--grace-s must not be negative, got {self.grace_s}")
        _check(self.drain_delay_s >= 0, f"--drain-delay-s must not be negative, got {self.drain_delay_s}")
        _check(self.metrics_port is None or 0 <= self.metrics_port < 65536, "--metrics-port must be a TCP port")


@dataclass(frozen=True)
class SecurityArgs(Section):
    tls_cert: str | None = arg(None, "server certificate chain (PEM); with --tls-key the listener speaks TLS",
                               env="KVWIRE_TLS_CERT")
    tls_key: str | None = arg(None, "server private key (PEM)", env="KVWIRE_TLS_KEY")
    tls_client_ca: str | None = arg(None, "require client certificates signed by this CA (mTLS)",
                                    env="KVWIRE_TLS_CLIENT_CA")
    allowed_peers: str | None = arg(None, "comma-separated client certificate names (CN or SAN) allowed to call; "
                                    "others get PERMISSION_DENIED (default: any certificate the CA signed)",
                                    env="KVWIRE_ALLOWED_PEERS")
    auth_tokens_file: str | None = arg(None, "bearer tokens accepted, one per line; calls without one get "
                                       "UNAUTHENTICATED (health excepted)", env="KVWIRE_AUTH_TOKENS_FILE")
    health_listen: str | None = arg(None, "host:port of a plaintext listener serving only grpc.health.v1 (for probes "
                                    "when the main port needs TLS)", env="KVWIRE_HEALTH_LISTEN")


@dataclass(frozen=True)
class PeerArgs(Section):
    """The channel to the one service this one calls; flags ``--<peer>-tls-ca`` ..., variables ``KVWIRE_<PEER>_...``."""

    tls_ca: str | None = arg(None, "CA that signed {peer}'s certificate: the {peer} channel uses TLS")
    tls_cert: str | None = arg(None, "client certificate presented to {peer} (mTLS)")
    tls_key: str | None = arg(None, "its private key")
    tls_server_name: str | None = arg(None, "name expected in {peer}'s certificate (default: the address's host)")
    token_file: str | None = arg(None, "bearer token sent to {peer} (first line)")


@dataclass(frozen=True)
class TokenizerArgs(Section):
    decode_addr: str = arg("127.0.0.1:50052", "DecodeService target, host:port or dns:///name:port (round-robin)")
    model_name: str = arg("", "model name for traces (default: the dir's name)")
    max_message_bytes: int = arg(FRONT_DOOR_MESSAGE_BYTES, "largest gRPC message and HTTP body accepted; larger "
                                 "ones are refused before parsing (gRPC: RESOURCE_EXHAUSTED; HTTP: 413). Prompts up "
                                 "to it but over --max-prompt-bytes get INVALID_ARGUMENT")
    max_prompt_bytes: int = arg(MAX_PROMPT_BYTES, "larger prompts (UTF-8 bytes of the text or chat contents) are "
                                "refused before tokenizing")
    max_prompt_tokens: int = arg(MAX_PROMPT_TOKENS, "prompts tokenizing to more tokens are refused")
    tokenize_workers: int = arg(TOKENIZE_WORKERS, "prompts tokenized at once (off the event loop); the others wait "
                                "their turn")
    http_listen: str | None = arg(None, "serve the OpenAI-compatible HTTP API (/v1/chat/completions, "
                                  "/v1/completions, /v1/models) on HOST:PORT, e.g. 127.0.0.1:8000; off if unset. Its "
                                  "model id is --model-name", metavar="HOST:PORT")
    cors_allowed_origins: str = arg("", "the HTTP door answers browsers' cross-origin requests (CORS) from these "
                                    "origins: comma-separated, such as https://app.example.com, or '*' for any; "
                                    "off if empty", metavar="ORIGINS")
    http_metrics: bool = arg(False, "also serve Prometheus /metrics on the HTTP door's port (as vLLM does; like "
                             "/health it needs no bearer token)")
    decode_routing: DecodeRouting = arg(DecodeRouting.ROUND_ROBIN, "round_robin: gRPC spreads calls over "
                                        "--decode-addr's addresses; prefix: one channel per decode replica and "
                                        "consistent hashing on the prompt's first KV page (bounded load), so "
                                        "prompts sharing a prefix reach the replica whose prefix cache holds it")
    decode_routing_load_factor: float = arg(ROUTING_LOAD_FACTOR, "prefix routing: a replica takes at most this x "
                                            "the mean in-flight load (>= 1)")

    def validate(self) -> None:
        for name in ("max_message_bytes", "max_prompt_bytes", "max_prompt_tokens", "tokenize_workers"):
            _check(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be at least 1")
        _check(self.decode_routing_load_factor >= 1, "--decode-routing-load-factor must be >= 1")

