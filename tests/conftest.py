"""Suite-wide settings and fixtures."""
import os

import pytest

# Services started by tests stop at once on SIGTERM: the production drain delay (NOT_SERVING while
# load balancers notice) would only slow every teardown. Tests of the delay pass the flag themselves.
os.environ.setdefault("KVWIRE_DRAIN_DELAY_S", "0")


@pytest.fixture(scope="module")
def receiver():
    """A real OTLP/gRPC trace receiver on loopback, one per test module."""
    from tools.otlp_receiver import OtlpReceiver

    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def otlp_env(receiver):
    """Environment that makes a started service export its spans to ``receiver`` quickly."""
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_BSP_SCHEDULE_DELAY": "100"}
