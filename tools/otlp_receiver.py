"""An in-process OTLP/gRPC trace receiver (opentelemetry-proto's TraceService), for tests and
``python -m bench trace``.

Method and details: tools/README.md, section ``tools/otlp_receiver.py``.
"""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str  # 32 lowercase hex digits
    span_id: str  # 16 lowercase hex digits
    parent_span_id: str  # "" for a root span
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind (2 = SERVER, 3 = CLIENT)
    service_name: str
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    start_ns: int
    end_ns: int


def any_value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every exported span; thread-safe; binds 127.0.0.1 on a free port."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self.port: int | None = None

    # -- the OTLP TraceService --------------------------------------------------------------

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context):
        received = []
        for rs in request.resource_spans:
            service = _attributes(rs.resource.attributes).get("service.name", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    received.append(ReceivedSpan(
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(), name=s.name, kind=s.kind,
                        service_name=service, attributes=_attributes(s.attributes),
                        status_code=s.status.code, start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano))
        with self._cond:
            self._spans.extend(received)
            self._cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> str:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return self.endpoint

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait()
            self._server = None

    def __enter__(self) -> "OtlpReceiver":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        """For ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the http scheme makes the exporter insecure)."""
        return f"http://127.0.0.1:{self.port}"

    # -- queries -----------------------------------------------------------------------------

    def spans(self) -> list[ReceivedSpan]:
        with self._cond:
            return list(self._spans)

    def clear(self) -> None:
        with self._cond:
            self._spans.clear()

    def traces(self) -> dict[str, list[ReceivedSpan]]:
        """Spans grouped by trace id, each list in start-time order."""
        out: dict[str, list[ReceivedSpan]] = {}
        for s in sorted(self.spans(), key=lambda s: s.start_ns):
            out.setdefault(s.trace_id, []).append(s)
        return out

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], Any],
                 timeout: float = 10.0) -> list[ReceivedSpan]:
        """Block until ``predicate(spans)`` is truthy; return the spans (AssertionError on timeout)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({s.name for s in self._spans})
                    raise AssertionError(f"spans not received within {timeout}s; got {names}")
                self._cond.wait(left)
            return list(self._spans)
