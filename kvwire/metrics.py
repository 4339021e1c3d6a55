"""Every Prometheus metric kvwire exports, defined once (services import and record them).

Names follow vLLM's where vLLM has one (``vllm:time_to_first_token_seconds`` ->
``kvwire:time_to_first_token_seconds``), so vLLM dashboards and alerts carry over with the prefix
changed. The OpenTelemetry GenAI server metrics they correspond to:

=============================================  ==============================================
kvwire (Prometheus)                            OpenTelemetry GenAI semantic conventions
=============================================  ==============================================
``kvwire:time_to_first_token_seconds``         ``gen_ai.server.time_to_first_token``
``kvwire:inter_token_latency_seconds``         ``gen_ai.server.time_per_output_token``
``kvwire:e2e_request_latency_seconds``         ``gen_ai.server.request.duration``
``kvwire:prompt_tokens_total`` /               ``gen_ai.client.token.usage``
``kvwire:generation_tokens_total``             (``gen_ai.token.type`` = input / output)
=============================================  ==============================================

Who exports what (each service serves only what it records, plus the pool gauges it registers):

- tokenizer_svc (the front door, what a client sees): the request latencies, token counters,
  ``request_success_total`` and the HTTP door's ``http_requests_total`` by route, method and status.
- decode_svc: running/waiting requests, KV pool use, KV bytes received over the wire, the KV
  transfer time, speculative decoding.
- prefill_svc: its own KV pool use.
- every service: ``kvwire:grpc_errors_total`` by method and status code (recorded where errors
  become statuses, in ``kvwire_serving.server``), and prometheus_client's ``process_*`` metrics.

The metric objects live in the default registry; ``kvwire_serving.telemetry.start_metrics_server`` serves it.
Every process declares every family (one module). Labelled families have series only where they
are recorded; the unlabelled ones (the KV transfer's) read 0 in the services that never record them.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Mapping

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets, so quantiles compare with a vLLM deployment's.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)

# ---- front door (tokenizer_svc) --------------------------------------------------------------------
TIME_TO_FIRST_TOKEN = Histogram("kvwire:time_to_first_token_seconds",
                                "Time from the request's arrival at the front door to its first token",
                                ["model_name"], buckets=_TTFT_BUCKETS)
INTER_TOKEN_LATENCY = Histogram("kvwire:inter_token_latency_seconds",
                                "Time between consecutive output tokens (a message of n tokens counts n "
                                "times, its gap / n)", ["model_name"], buckets=_ITL_BUCKETS)
E2E_REQUEST_LATENCY = Histogram("kvwire:e2e_request_latency_seconds",
                                "Time from the request's arrival to its last token", ["model_name"],
                                buckets=_E2E_BUCKETS)
PROMPT_TOKENS = Counter("kvwire:prompt_tokens", "Prompt tokens of requests sent to decode", ["model_name"])
GENERATION_TOKENS = Counter("kvwire:generation_tokens", "Tokens generated and streamed to clients",
                            ["model_name"])
REQUEST_SUCCESS = Counter("kvwire:request_success", "Requests that finished normally",
                          ["model_name", "finished_reason"])

# ---- every service -----------------------------------------------------------------------------------
# The OpenAI HTTP door: route (its template, "unmatched" otherwise), method, status code ("499": the
# client went away first, nginx's convention).
HTTP_REQUESTS = Counter("kvwire:http_requests", "HTTP requests the OpenAI door answered, by route, method and status",
                        ["route", "method", "status"])
GRPC_REQUESTS = Counter("kvwire:grpc_requests", "RPCs this process received, by method", ["grpc_method"])
GRPC_ERRORS = Counter("kvwire:grpc_errors", "RPCs that ended with an error status, by method and code",
                      ["grpc_method", "grpc_code"])

# ---- decode_svc ------------------------------------------------------------------------------------
KV_TRANSFER_BYTES = Counter("kvwire:kv_transfer_bytes", "KV page bytes received from prefill_svc "
                            "(verified chunks: page data + scales)")
KV_TRANSFER_SECONDS = Histogram("kvwire:kv_transfer_duration_seconds",
                                "One prompt's KV pull from prefill_svc, first message to first token",
                                buckets=_TTFT_BUCKETS)

# Named after vLLM's vllm:spec_decode_* metrics; label "method" is draft | ngram.
SPEC_DRAFTS = Counter("kvwire:spec_decode_num_drafts", "Verification steps that checked proposals", ["method"])
SPEC_DRAFT_TOKENS = Counter("kvwire:spec_decode_num_draft_tokens", "Proposed (draft) tokens verified", ["method"])
SPEC_ACCEPTED_TOKENS = Counter("kvwire:spec_decode_num_accepted_tokens", "Proposed tokens accepted", ["method"])
SPEC_EMITTED_TOKENS = Counter("kvwire:spec_decode_num_emitted_tokens",
                              "Tokens emitted by verification steps (accepted + correction/bonus)", ["method"])
SPEC_REQ_ACCEPTANCE = Histogram("kvwire:spec_decode_request_acceptance_rate",
                                "Per finished request: accepted / proposed tokens", ["method"],
                                buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0))
SPEC_REQ_ACCEPTED_PER_STEP = Histogram("kvwire:spec_decode_request_mean_accepted_tokens_per_step",
                                       "Per finished request: accepted tokens per verification step", ["method"],
                                       buckets=(0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16))


# ---- pool gauges, read at scrape time ----------------------------------------------------------------
class PoolCollector:
    """Gauges computed from a service's pool statistics when Prometheus scrapes.

    ``stats`` returns a mapping with ``num_pages`` and ``used`` (the KV pool) and, for decode,
    ``running`` and ``waiting`` (the scheduler). It is called from the metrics server's thread; the
    values are plain ints the service updates under the GIL, so a scrape never blocks serving.
    """

    def __init__(self, stats: Callable[[], Mapping[str, int]]):
        self._stats = stats

    def describe(self):  # lets register() skip calling collect() before the service is ready
        return list(self._families({}))

    def collect(self):
        return list(self._families(self._stats()))

    @staticmethod
    def _families(s: Mapping[str, int]):
        total = s.get("num_pages", 0)
        usage = GaugeMetricFamily("kvwire:kv_cache_usage_perc", "Fraction of the KV pool's pages in use (0-1)")
        pages = GaugeMetricFamily("kvwire:kv_cache_total_pages", "Pages in the KV pool")
        if s:
            usage.add_metric([], s["used"] / total if total else 0.0)
            pages.add_metric([], total)
        yield usage
        yield pages
        if "running" in s or not s:
            running = GaugeMetricFamily("kvwire:num_requests_running", "Requests admitted (pulling KV or decoding)")
            waiting = GaugeMetricFamily("kvwire:num_requests_waiting", "Requests queued for admission")
            if s:
                running.add_metric([], s["running"])
                waiting.add_metric([], s["waiting"])
            yield running
            yield waiting
            preempted = CounterMetricFamily("kvwire:num_preemptions", "Running requests preempted because the KV "
                                            "pool ran short (recomputed when readmitted)")
            if s:
                preempted.add_metric([], s.get("num_preemptions", 0))
            yield preempted


_pool_lock = threading.Lock()
_pool_collector: PoolCollector | None = None


def watch_pool(stats: Callable[[], Mapping[str, int]]) -> None:
    """Export the pool gauges from ``stats`` (one source per process; a second call replaces it)."""
    global _pool_collector
    with _pool_lock:
        if _pool_collector is not None:
            REGISTRY.unregister(_pool_collector)
        _pool_collector = PoolCollector(stats)
        REGISTRY.register(_pool_collector)


class RequestTimer:
    """The front door's per-request latencies, fed as the token stream arrives.

    Created when the request arrives; ``tokens(n)`` for every message carrying n tokens;
    ``finish(reason)`` once, when the request ends normally.
    """

    def __init__(self, model_name: str, clock: Callable[[], float] = time.perf_counter):
        self.model, self.clock = model_name, clock
        self.start = clock()
        self.last: float | None = None  # when the previous tokens arrived

    def prompt(self, num_tokens: int) -> None:
        PROMPT_TOKENS.labels(self.model).inc(num_tokens)

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = self.clock()
        if self.last is None:
            TIME_TO_FIRST_TOKEN.labels(self.model).observe(now - self.start)
            n_gaps, gap = n - 1, 0.0  # tokens after the first in one message arrived with it
        else:
            n_gaps, gap = n, (now - self.last) / n
        itl = INTER_TOKEN_LATENCY.labels(self.model)
        for _ in range(n_gaps):
            itl.observe(gap)
        self.last = now
        GENERATION_TOKENS.labels(self.model).inc(n)

    def finish(self, reason: str) -> None:
        E2E_REQUEST_LATENCY.labels(self.model).observe(self.clock() - self.start)
        REQUEST_SUCCESS.labels(self.model, reason).inc()
