"""OpenTelemetry tracing and Prometheus metrics setup, called from each service's ``__main__``.

Configured only by the standard ``OTEL_*`` variables, read when ``setup_tracing`` is called (never
at import time):

- ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``: no tracing (a no-op).
- ``OTEL_TRACES_EXPORTER``: comma-separated ``otlp`` | ``console``. When unset, ``otlp`` if an
  ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` is set, else nothing (a laptop run exports nowhere).
- The OTLP gRPC exporter reads its own ``OTEL_EXPORTER_OTLP_*`` (endpoint, headers, insecure,
  timeout); the provider ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
  ``OTEL_TRACES_SAMPLER[_ARG]``; the batch processor ``OTEL_BSP_*``.

Propagation is OpenTelemetry's default, W3C ``traceparent`` (+ baggage), carried in gRPC metadata
by the interceptors that ``kvwire_serving.server`` installs.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Mapping

from opentelemetry import trace

log = logging.getLogger(__name__)

_EXPORTERS = ("otlp", "console")


@dataclass(frozen=True)
class TracingConfig:
    """What ``setup_tracing`` will do, decided from an environment mapping."""

    exporters: tuple[str, ...] = ()
    service_name: str = "kvwire"

    @staticmethod
    def from_env(env: Mapping[str, str], default_service_name: str) -> "TracingConfig":
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return TracingConfig((), default_service_name)
        raw = env.get("OTEL_TRACES_EXPORTER")
        if raw is None:
            endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
            names: tuple[str, ...] = ("otlp",) if endpoint else ()
        else:
            names = tuple(n.strip().lower() for n in raw.split(",") if n.strip())
            names = () if "none" in names else names
        unknown = [n for n in names if n not in _EXPORTERS]
        if unknown:
            raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter(s) {unknown}; "
                             f"use {', '.join(_EXPORTERS)} or none")
        return TracingConfig(names, env.get("OTEL_SERVICE_NAME") or default_service_name)


@dataclass
class Telemetry:
    """Handle returned by ``setup_tracing``; ``shutdown()`` flushes pending spans."""

    config: TracingConfig
    provider: object | None = None  # the SDK TracerProvider, when tracing is on
    _metrics_server: object | None = field(default=None, repr=False)

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.force_flush()
            self.provider.shutdown()
            self.provider = None
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server = None


def setup_tracing(default_service_name: str, env: Mapping[str, str] | None = None,
                  set_global: bool = True) -> Telemetry:
    """Build the tracer provider the environment asks for and (by default) install it globally.

    ``default_service_name`` is used when ``OTEL_SERVICE_NAME`` is unset.
    """
    cfg = TracingConfig.from_env(os.environ if env is None else env, default_service_name)
    if not cfg.exporters:
        log.info("tracing off (set OTEL_TRACES_EXPORTER or OTEL_EXPORTER_OTLP_ENDPOINT to export)")
        return Telemetry(cfg)
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    # Resource.create adds OTEL_RESOURCE_ATTRIBUTES; service_name already honours OTEL_SERVICE_NAME.
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: cfg.service_name}))
    for name in cfg.exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    if set_global:
        trace.set_tracer_provider(provider)
    log.info("tracing on: service %s, exporters %s", cfg.service_name, ",".join(cfg.exporters))
    return Telemetry(cfg, provider)


def start_metrics_server(telemetry: Telemetry, port: int | None, addr: str = "127.0.0.1") -> int | None:
    """Serve Prometheus ``/metrics`` on ``addr:port`` (None = off; 0 = any free port).

    The services pass ``--metrics-host``, else their ``--listen`` host (``kvwire_serving.security.metrics_host``):
    /metrics is never more exposed than the service itself.

    Returns the bound port. The metrics themselves are all defined in ``kvwire.metrics``, named
    like vLLM's where one exists (``kvwire:num_requests_running`` for ``vllm:num_requests_running``).
    """
    if port is None:
        return None
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=addr)
    telemetry._metrics_server = server
    return server.server_port
