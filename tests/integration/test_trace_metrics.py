"""What an operator sees of one request: its trace (real OTLP export into an in-process receiver)
and the services' /metrics (scraped over HTTP), against the dashboard and alert rules in deploy/.

The stack runs with each service's default OpenTelemetry service.name (no OTEL_SERVICE_NAME), the
names the README and the Kubernetes manifests tell Jaeger users to pick.
"""
from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tests.deploy.test_observability import alert_exprs, dashboard_exprs, metric_names
from tools.stack import Stack, free_port

SERVICE_NAMES = {"tokenizer_svc": "kvwire-tokenizer", "decode_svc": "kvwire-decode", "prefill_svc": "kvwire-prefill"}
PROMPT = "The for statement"


@pytest.fixture(scope="module")
def stack(otlp_env, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.delenv("OTEL_SERVICE_NAME", raising=False)
    env = otlp_env
    metrics_ports = {name: free_port() for name in SERVICE_NAMES}
    s = Stack(decode_pages=256, prefill_pages=256, env=env, log_dir=tmp_path_factory.mktemp("logs"),
              extra={name: ["--metrics-port", str(port)] for name, port in metrics_ports.items()})
    # The n-gram request below must propose whatever its lookup finds: priced proposals depend on
    # this machine's measured row costs, and on a loaded 1-thread decode they may all be declined.
    s.extra["decode_svc"] += ["--no-adaptive-speculation"]
    s.metrics_ports = metrics_ports
    try:
        with s:
            yield s
    finally:
        mp.undo()


async def generate(addr: str, request: pb.GenerateTextRequest) -> list[int]:
    async with grpc.aio.insecure_channel(addr) as ch:
        ids: list[int] = []
        async for msg in pbg.TokenizerServiceStub(ch).GenerateText(request):
            ids += msg.token_ids
        return ids


def scrape(port: int) -> dict[str, list]:
    """Family name -> samples, from one service's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def exported_names(families: dict[str, list]) -> set[str]:
    """Every series name PromQL can select: the names of samples present (a family declared with no
    series yet, e.g. a labelled metric nothing recorded, exports nothing)."""
    return {s.name for samples in families.values() for s in samples}


def test_one_request_is_one_trace_across_the_three_services(stack, receiver):
    receiver.clear()
    ids = asyncio.run(generate(stack.addr("tokenizer_svc"), pb.GenerateTextRequest(  # short: prefill_svc on request
        text=PROMPT, sampling=pb.SamplingParams(max_tokens=8), kv_source=pb.KV_SOURCE_REMOTE)))
    assert len(ids) == 8
    wanted = {"tokenize", "detokenize", "kv_transfer", "prefill.forward", "decode"}

    def complete(spans):  # spans export as they end: wait for the wanted ones and every parent
        have = {s.span_id for s in spans}
        return wanted <= {s.name for s in spans} and all(not s.parent_span_id or s.parent_span_id in have
                                                         for s in spans)
    spans = receiver.wait_for(complete, timeout=30)
    assert len({s.trace_id for s in spans}) == 1, "one request, one trace"
    by_id = {s.span_id: s for s in spans}
    [root] = [s for s in spans if not s.parent_span_id]
    assert root.name.endswith("TokenizerService/GenerateText") and root.kind == 2  # SERVER
    assert 8 <= len(spans) <= 14, sorted(s.name for s in spans)
    assert {s.service_name for s in spans} == set(SERVICE_NAMES.values())

    def parent(s):
        return by_id[s.parent_span_id]

    def server(suffix):
        [s] = [s for s in spans if s.name.endswith(suffix) and s.kind == 2]
        return s
    decode, prefill = server("DecodeService/GenerateTokens"), server("PrefillService/Prefill")
    assert root.service_name == "kvwire-tokenizer"
    assert decode.service_name == "kvwire-decode" and prefill.service_name == "kvwire-prefill"
    # each hop: the caller's CLIENT span (same service as the caller) is the callee's parent
    assert parent(decode).kind == 3 and parent(decode).service_name == "kvwire-tokenizer"
    assert parent(parent(decode)) is root
    assert parent(prefill).kind == 3 and parent(prefill).service_name == "kvwire-decode"
    named = {s.name: s for s in spans if s.name in wanted}
    assert parent(named["tokenize"]) is root and parent(named["detokenize"]) is root
    assert parent(named["kv_transfer"]) is decode and parent(named["decode"]) is decode
    assert parent(parent(prefill)) is decode  # the call to prefill and kv_transfer are siblings
    assert parent(named["prefill.forward"]) is prefill
    # the KV transfer overlaps prefill's forward: pages stream while later layers compute
    kv, fwd = named["kv_transfer"], named["prefill.forward"]
    assert kv.start_ns < fwd.end_ns and fwd.start_ns < kv.end_ns
    for s in spans:  # children within their parents (one host clock; 5 ms slack for export rounding)
        if s.parent_span_id:
            assert parent(s).start_ns - 5_000_000 <= s.start_ns <= s.end_ns <= parent(s).end_ns + 5_000_000, s.name


def test_dashboard_and_alerts_name_only_metrics_the_services_export(stack):
    addr = stack.addr("tokenizer_svc")
    ids = asyncio.run(generate(addr, pb.GenerateTextRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=6),
                                                            kv_source=pb.KV_SOURCE_REMOTE)))  # a KV transfer, counted
    # a repetitive prompt, so that the n-gram lookup finds something to propose
    asyncio.run(generate(addr, pb.GenerateTextRequest(text=(PROMPT + " ") * 8, sampling=pb.SamplingParams(
        max_tokens=32, speculative=pb.SamplingParams.SPECULATIVE_MODE_NGRAM))))
    with pytest.raises(grpc.aio.AioRpcError):
        asyncio.run(generate(addr, pb.GenerateTextRequest(text="")))  # an error status, counted
    scraped = {name: scrape(port) for name, port in stack.metrics_ports.items()}
    exported = set().union(*(exported_names(f) for f in scraped.values()))

    named = {f"alert {a}": metric_names(e) for a, e in alert_exprs().items()}
    named |= {f"panel {t}": set().union(*map(metric_names, es)) for t, es in dashboard_exprs().items()}
    missing = {where: sorted(n - exported) for where, n in named.items() if n - exported}
    assert not missing, f"named but exported by no service: {missing}"

    front, decode, prefill = scraped["tokenizer_svc"], scraped["decode_svc"], scraped["prefill_svc"]

    def value(fam, name, **labels):
        return sum(s.value for s in fam if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
    assert value(front["kvwire:time_to_first_token_seconds"], "kvwire:time_to_first_token_seconds_count") >= 2
    assert value(front["kvwire:generation_tokens"], "kvwire:generation_tokens_total") >= len(ids) + 1
    assert value(front["kvwire:request_success"], "kvwire:request_success_total") >= 2
    assert value(front["kvwire:grpc_errors"], "kvwire:grpc_errors_total", grpc_code="INVALID_ARGUMENT",
                 grpc_method="/kvwire.v1.TokenizerService/GenerateText") >= 1  # what the alerts' regexes match
    assert value(decode["kvwire:kv_transfer_bytes"], "kvwire:kv_transfer_bytes_total") > 0
    assert value(decode["kvwire:spec_decode_num_draft_tokens"], "kvwire:spec_decode_num_draft_tokens_total",
                 method="ngram") > 0
    assert value(decode["kvwire:num_requests_running"], "kvwire:num_requests_running") == 0  # all done
    assert value(decode["kvwire:kv_cache_total_pages"], "kvwire:kv_cache_total_pages") == 256
    assert 0 <= value(prefill["kvwire:kv_cache_usage_perc"], "kvwire:kv_cache_usage_perc") <= 1
    # each service's series are its own (families are declared everywhere, series only where recorded)
    assert not exported_names({"ttft": decode["kvwire:time_to_first_token_seconds"]})
