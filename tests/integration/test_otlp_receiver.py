"""The test receiver gets real spans from the real OTLP gRPC exporter."""
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from tests.integration.otlp_receiver import OtlpReceiver


def test_receiver_collects_exported_spans_with_parents_and_attributes():
    with OtlpReceiver() as rx:
        tp = TracerProvider(resource=Resource.create({"service.name": "receiver-test"}))
        tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=rx.endpoint, insecure=True)))
        tracer = tp.get_tracer("test")
        with tracer.start_as_current_span("request", attributes={"gen_ai.request.model": "tiny"}):
            with tracer.start_as_current_span("kv.transfer", attributes={
                    "kv.pages": 3, "kv.dtype": "fp8_e4m3", "kv.ratio": 0.53, "kv.ok": True,
                    "kv.layers": [0, 1]}):
                pass
        assert tp.force_flush(10_000)
        spans = rx.wait_for(lambda s: len(s) >= 2)
        tp.shutdown()
    by_name = {s.name: s for s in spans}
    parent, child = by_name["request"], by_name["kv.transfer"]
    assert len(parent.trace_id) == 32 and parent.trace_id == child.trace_id
    assert parent.parent_span_id == "" and child.parent_span_id == parent.span_id
    assert child.attributes == {"kv.pages": 3, "kv.dtype": "fp8_e4m3", "kv.ratio": 0.53, "kv.ok": True,
                                "kv.layers": [0, 1]}
    assert parent.service_name == "receiver-test" and parent.attributes["gen_ai.request.model"] == "tiny"
    assert list(rx.traces()) == [parent.trace_id]
