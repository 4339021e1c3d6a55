"""kvwire_serving.telemetry: configured by OTEL_* only, exporting to a real OTLP receiver."""
import urllib.request

import pytest

from kvwire_serving.telemetry import TracingConfig, setup_tracing, start_metrics_server
from tests.integration.otlp_receiver import OtlpReceiver


@pytest.mark.parametrize("env, exporters", [
    ({}, ()),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}, ()),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}, ("otlp",)),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:4317"}, ("otlp",)),
    ({"OTEL_TRACES_EXPORTER": "otlp,console"}, ("otlp", "console")),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, ()),
])
def test_exporters_come_from_the_environment(env, exporters):
    assert TracingConfig.from_env(env, "svc").exporters == exporters


def test_unknown_exporter_is_refused_and_service_name_defaults():
    with pytest.raises(ValueError, match="jaeger"):
        TracingConfig.from_env({"OTEL_TRACES_EXPORTER": "jaeger"}, "svc")
    assert TracingConfig.from_env({}, "svc").service_name == "svc"
    assert TracingConfig.from_env({"OTEL_SERVICE_NAME": "mine"}, "svc").service_name == "mine"


def test_nothing_configured_is_a_noop(monkeypatch):
    for var in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    t = setup_tracing("svc", set_global=False)
    assert not t.enabled
    t.shutdown()


def test_otlp_export_from_env_and_shutdown_flushes(monkeypatch):
    with OtlpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "kvwire-test")
        monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
        t = setup_tracing("default-name", set_global=False)
        assert t.enabled
        with t.provider.get_tracer("t").start_as_current_span("one"):
            pass
        t.shutdown()  # flushes the batch processor: the span must already be there
        [span] = rx.spans()
    assert span.name == "one" and span.service_name == "kvwire-test"


def test_metrics_server_serves_prometheus_text():
    t = setup_tracing("svc", env={}, set_global=False)
    port = start_metrics_server(t, 0, addr="127.0.0.1")
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "python_info" in body or "process_" in body
    finally:
        t.shutdown()
    assert start_metrics_server(t, None) is None
