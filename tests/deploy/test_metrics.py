"""kvwire.metrics: the one module defining Prometheus metrics, and what its helpers record."""
from __future__ import annotations

import re

from prometheus_client import REGISTRY

from kvwire import metrics
from tests.deploy.k8s import REPO


def sample(name: str, **labels) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_every_prometheus_metric_is_defined_in_kvwire_metrics():
    pattern = re.compile(r"\b(Counter|Gauge|Histogram|Summary|Info|Enum)\(\s*\"")
    offenders = []
    for path in REPO.rglob("*.py"):
        rel = path.relative_to(REPO)
        if rel.parts[0] in (".venv", "tests", "build") or rel.as_posix() == "kvwire/metrics.py":
            continue
        text = path.read_text(errors="replace")
        if "prometheus_client" in text and pattern.search(text):
            offenders.append(str(rel))
    assert not offenders, f"Prometheus metrics defined outside kvwire/metrics.py: {offenders}"


def test_request_timer_records_ttft_itl_e2e_and_tokens():
    now = [100.0]
    timer = metrics.RequestTimer("timer-test", clock=lambda: now[0])
    timer.prompt(7)
    now[0] = 100.5
    timer.tokens(2)  # first message: TTFT 0.5 s, its second token arrived with it (ITL 0)
    now[0] = 100.8
    timer.tokens(3)  # 0.3 s for 3 tokens: three gaps of 0.1 s
    timer.tokens(0)  # an empty message changes nothing
    now[0] = 101.0
    timer.finish("length")
    m = "timer-test"
    assert sample("kvwire:prompt_tokens_total", model_name=m) == 7
    assert sample("kvwire:generation_tokens_total", model_name=m) == 5
    assert sample("kvwire:time_to_first_token_seconds_count", model_name=m) == 1
    assert abs(sample("kvwire:time_to_first_token_seconds_sum", model_name=m) - 0.5) < 1e-9
    assert sample("kvwire:inter_token_latency_seconds_count", model_name=m) == 4
    assert abs(sample("kvwire:inter_token_latency_seconds_sum", model_name=m) - 0.3) < 1e-9
    assert abs(sample("kvwire:e2e_request_latency_seconds_sum", model_name=m) - 1.0) < 1e-9
    assert sample("kvwire:request_success_total", model_name=m, finished_reason="length") == 1


def test_pool_gauges_read_the_stats_at_scrape_time():
    stats = {"num_pages": 200, "used": 50, "free": 150, "running": 3, "waiting": 1}
    metrics.watch_pool(lambda: stats)
    assert sample("kvwire:kv_cache_usage_perc") == 0.25
    assert sample("kvwire:kv_cache_total_pages") == 200
    assert (sample("kvwire:num_requests_running"), sample("kvwire:num_requests_waiting")) == (3, 1)
    stats["used"], stats["waiting"] = 200, 9
    assert sample("kvwire:kv_cache_usage_perc") == 1.0 and sample("kvwire:num_requests_waiting") == 9
    metrics.watch_pool(lambda: {"num_pages": 10, "used": 1})  # prefill: a pool, no scheduler
    assert sample("kvwire:kv_cache_usage_perc") == 0.1
    assert sample("kvwire:num_requests_running") is None
