"""Alert rules, dashboard, PodMonitor and the Prometheus adapter rules, checked offline.

Whether the metrics they name are really exported is checked against the running stack in
tests/integration/test_trace_metrics.py.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from tests.deploy.k8s import REPO, one, render

OBS = REPO / "deploy" / "k8s" / "components" / "observability"
RULES = OBS / "rules" / "kvwire-alerts.yaml"
DASHBOARD = OBS / "dashboards" / "kvwire.json"
ADAPTER = REPO / "deploy" / "prometheus-adapter" / "rules.yaml"
_METRIC = re.compile(r"(?<![\w:])((?:kvwire:|process_)[a-zA-Z0-9_:]+)")
_PROMTOOL_REASON = ("promtool is not installed (Debian/Ubuntu: apt-get install prometheus; or the "
                    "Prometheus release tarball): alert rules not checked")


def metric_names(expr: str) -> set[str]:
    """The kvwire (and process_*) series a PromQL expression reads."""
    return set(_METRIC.findall(expr))


def alert_exprs() -> dict[str, str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["alert"]: r["expr"] for g in groups for r in g["rules"]}


def dashboard_exprs() -> dict[str, list[str]]:
    dash = json.loads(DASHBOARD.read_text())
    return {p["title"]: [t["expr"] for t in p["targets"]] for p in dash["panels"]}


def test_promtool_accepts_the_alert_rules(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(_PROMTOOL_REASON)
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_exprs())} rules found" in out.stdout
    broken = tmp_path / "broken.yaml"  # and promtool really checks PromQL
    broken.write_text(RULES.read_text().replace("rate(kvwire:time_to_first_token_seconds_bucket[5m])",
                                                "rate(kvwire:time_to_first_token_seconds_bucket[5m]"))
    assert subprocess.run([promtool, "check", "rules", str(broken)], capture_output=True, timeout=60).returncode != 0


def test_alerts_cover_latency_queue_data_loss_and_pool_exhaustion():
    exprs = alert_exprs()
    named = set().union(*map(metric_names, exprs.values()))
    assert {"kvwire:time_to_first_token_seconds_bucket", "kvwire:grpc_errors_total",
            "kvwire:kv_cache_usage_perc"} <= named
    joined = " ".join(exprs.values())
    assert 'grpc_code="RESOURCE_EXHAUSTED"' in joined and 'grpc_code="DATA_LOSS"' in joined
    assert all(metric_names(e) for e in exprs.values()), "every alert reads a kvwire metric"


def test_prometheus_rule_resource_holds_the_same_rules():
    objs = render("cpu-observability")
    rule = one(objs, "PrometheusRule", "kvwire")
    assert rule["spec"] == yaml.safe_load(RULES.read_text())


def test_dashboard_panels_and_config_map():
    exprs = dashboard_exprs()
    wanted = {"Time to first token", "Inter-token latency", "End-to-end request latency", "Tokens per second",
              "Decode queue", "KV pool use", "KV bytes on the wire", "Speculative acceptance"}
    assert wanted <= set(exprs)
    for title, targets in exprs.items():
        assert targets and all(metric_names(e) for e in targets), title
    objs = render("cpu-observability")
    cm = one(objs, "ConfigMap", "kvwire-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvwire.json"]) == json.loads(DASHBOARD.read_text())


def test_pod_monitor_scrapes_the_metrics_port_of_every_service():
    objs = render("cpu-observability")
    pm = one(objs, "PodMonitor", "kvwire")
    assert pm["metadata"]["namespace"] == "kvwire"
    [endpoint] = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    for name in ("tokenizer", "decode", "prefill"):
        dep = one(objs, "Deployment", name)
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in pm["spec"]["selector"]["matchLabels"].items()), name
        [c] = dep["spec"]["template"]["spec"]["containers"]
        assert any(p["name"] == "metrics" for p in c["ports"]), name


def test_observability_component_turns_tracing_on_towards_its_collector():
    objs = render("cpu-observability")
    [config] = [c for c in objs if c["kind"] == "ConfigMap" and c["metadata"]["name"].startswith("kvwire-config")]
    assert config["data"]["OTEL_TRACES_EXPORTER"] == "otlp"
    endpoint = config["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    host, port = endpoint.removeprefix("http://").split(":")
    svc = one(objs, "Service", host)
    assert int(port) in [p["port"] for p in svc["spec"]["ports"]]
    collector = yaml.safe_load(one(objs, "ConfigMap", "otel-collector")["data"]["config.yaml"])
    exporter = collector["exporters"]["otlp/traces"]["endpoint"]
    jaeger = one(objs, "Service", exporter.split(":")[0])
    assert int(exporter.split(":")[1]) in [p["port"] for p in jaeger["spec"]["ports"]]
    [base_config] = [c for c in render("cpu") if c["kind"] == "ConfigMap"]
    assert base_config["data"]["OTEL_TRACES_EXPORTER"] == "none"  # without the component: off


def test_hpa_custom_metrics_are_served_by_the_adapter_rules():
    rules = yaml.safe_load(ADAPTER.read_text())["rules"]["custom"]
    served = set()
    for r in rules:
        series = re.match(r"[a-zA-Z0-9_:]+", r["seriesQuery"]).group(0)
        served.add(re.sub(r["name"]["matches"], r["name"]["as"].replace("${1}", r"\1"), series))
    hpa = one(render("cpu"), "HorizontalPodAutoscaler", "decode")
    used = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert used and used <= served, f"the adapter does not serve {used - served}"
    assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in hpa["spec"]["metrics"])
