"""The Kubernetes manifests, rendered offline with ``kubectl kustomize`` and checked object by object:
schema (kubernetes-validate --strict), then the invariants an operator relies on."""
from __future__ import annotations

import re

import pytest

from tests.deploy.k8s import (OVERLAYS, REPO, SERVICES, Container, containers, help_text, of_kind, one,
                              render, selects)

# Prometheus Operator custom resources: kubernetes-validate ships schemas for built-in kinds only,
# so these are checked by test_observability.py instead (rules by promtool, shape by hand).
CRD_KINDS = {("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}


def kvwire_deployments(objs):
    return [d for d in of_kind(objs, "Deployment") if d["metadata"]["name"] in SERVICES]


def main_container(objs, name) -> Container:
    [c] = containers(objs, one(objs, "Deployment", name))
    return c


def host_port(addr: str) -> tuple[str, int]:
    host, port = addr.rsplit(":", 1)
    return host, int(port)


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_overlay_renders_and_every_object_is_valid(overlay):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed "
                             "(pip install -e '.[test]')")
    objs = render(overlay)
    kinds = {o["kind"] for o in objs}
    assert {"Namespace", "ConfigMap", "Service", "Deployment", "PodDisruptionBudget",
            "HorizontalPodAutoscaler", "NetworkPolicy"} <= kinds
    for o in objs:
        if (o["apiVersion"], o["kind"]) in CRD_KINDS:
            continue
        kv.validate(o, kv.latest_version(), strict=True)  # raises ValidationError with the path


def test_kubernetes_validate_refuses_a_wrong_field():
    """The validator really validates: an unknown field in a rendered Deployment is refused."""
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    import copy
    dep = copy.deepcopy(one(render("cpu"), "Deployment", "decode"))
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 50052
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, kv.latest_version(), strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_probes_and_listen_flags_agree(overlay):
    objs = render(overlay)
    for name, (module, otel_name, proto_service) in SERVICES.items():
        c = main_container(objs, name)
        assert c.argv[:3] == ("python", "-m", module)
        _, listen = host_port(c.flag("--listen"))
        assert c.port("grpc") == listen, f"{name}: --listen {listen} vs containerPort {c.port('grpc')}"
        assert c.port("metrics") == int(c.flag("--metrics-port"))
        if c.flag("--http-listen") is not None:
            assert c.port("http") == host_port(c.flag("--http-listen"))[1]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c.spec[probe]["grpc"]["port"] == listen, f"{name} {probe}"
        assert c.spec["readinessProbe"]["grpc"]["service"] == proto_service  # ready = this service SERVING
        # Started = loaded: decode's own status follows prefill's reachability, which must not make
        # Kubernetes restart a decode pod that started while prefill was down.
        started = c.spec["startupProbe"]["grpc"].get("service")
        assert started == (None if name == "decode" else proto_service), f"{name} startupProbe"
        assert c.env["OTEL_SERVICE_NAME"] == otel_name
        svc = one(objs, "Service", name)
        assert svc["spec"]["clusterIP"] == "None", f"Service {name} must be headless for round_robin"
        [grpc_port] = [p for p in svc["spec"]["ports"] if p["name"] == "grpc"]
        assert grpc_port["port"] == listen and grpc_port["targetPort"] == "grpc"
        assert selects({"matchLabels": svc["spec"]["selector"]},
                       one(objs, "Deployment", name)["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_peers_are_headless_dns_names_of_the_right_service(overlay):
    objs = render(overlay)
    for name, flag, peer in (("tokenizer", "--decode-addr", "decode"), ("decode", "--prefill-addr", "prefill")):
        c = main_container(objs, name)
        target = c.flag(flag)
        m = re.fullmatch(r"dns:///([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local:(\d+)", target or "")
        assert m, f"{name} {flag}={target!r}: want dns:///<service>.<namespace>.svc.cluster.local:<port>"
        svc_name, ns, port = m.group(1), m.group(2), int(m.group(3))
        assert (svc_name, ns) == (peer, c.namespace)
        svc = one(objs, "Service", svc_name)
        assert svc["spec"]["clusterIP"] == "None"
        assert port in [p["port"] for p in svc["spec"]["ports"]]
        assert port == host_port(main_container(objs, peer).flag("--listen"))[1]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_deployment_has_probes_resources_pdb_hpa_and_network_policy(overlay):
    objs = render(overlay)
    pdbs, hpas, policies = of_kind(objs, "PodDisruptionBudget"), of_kind(objs, "HorizontalPodAutoscaler"), \
        of_kind(objs, "NetworkPolicy")
    for dep in of_kind(objs, "Deployment"):
        name, labels = dep["metadata"]["name"], dep["spec"]["template"]["metadata"]["labels"]
        pod = dep["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c.get("resources", {}).get(kind, {})), f"{name}/{c['name']} {kind}"
        for c in pod["containers"]:
            assert "readinessProbe" in c and "livenessProbe" in c, f"{name}/{c['name']} probes"
        assert any(p["spec"]["podSelector"] and selects(p["spec"]["podSelector"], labels) for p in policies), \
            f"no NetworkPolicy selects {name}'s pods"
        if name not in SERVICES:
            continue  # the observability component's single-replica demo backends
        assert all("startupProbe" in c for c in pod["containers"])
        assert [p for p in pdbs if selects(p["spec"]["selector"], labels)], f"no PodDisruptionBudget for {name}"
        assert [h for h in hpas if h["spec"]["scaleTargetRef"]["name"] == name], f"no HPA for {name}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_isolate_the_services(overlay):
    objs = render(overlay)
    policies = of_kind(objs, "NetworkPolicy")
    labels = {n: one(objs, "Deployment", n)["spec"]["template"]["metadata"]["labels"] for n in SERVICES}
    default_deny = one(objs, "NetworkPolicy", "kvwire-default-deny")["spec"]
    assert set(default_deny["policyTypes"]) == {"Ingress", "Egress"}
    assert "ingress" not in default_deny and "egress" not in default_deny
    assert all(selects(default_deny["podSelector"], lab) for lab in labels.values())

    def ingress_rules(name):
        return [r for p in policies if "Ingress" in p["spec"]["policyTypes"]
                and selects(p["spec"]["podSelector"], labels[name]) for r in p["spec"].get("ingress", [])]

    metrics = main_container(objs, "decode").port("metrics")
    for name, allowed_from in (("tokenizer", None), ("decode", "tokenizer"), ("prefill", "decode")):
        grpc_port = main_container(objs, name).port("grpc")
        for rule in ingress_rules(name):
            ports = {p["port"] for p in rule["ports"]}
            if ports == {metrics}:  # Prometheus, from the monitoring namespace only
                assert [f["namespaceSelector"]["matchLabels"] for f in rule["from"]] == \
                    [{"kubernetes.io/metadata.name": "monitoring"}]
                continue
            assert grpc_port in ports
            if allowed_from is None:
                assert "from" not in rule, "the front door is open to clients outside the namespace"
            else:
                assert rule["from"] == [{"podSelector": {"matchLabels": {
                    "app.kubernetes.io/name": labels[allowed_from]["app.kubernetes.io/name"]}}}], \
                    f"{name} admits more than {allowed_from}: {rule['from']}"
    egress_ports = {p["port"] for p in policies if "Egress" in p["spec"]["policyTypes"]
                    for r in p["spec"].get("egress", []) for p in r.get("ports", [])}
    assert {53, 4317} <= egress_ports  # DNS and OTLP to a collector


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_security_restricted_and_no_latest_tags(overlay):
    objs = render(overlay)
    ns = one(objs, "Namespace", "kvwire")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for dep in of_kind(objs, "Deployment"):
        name, pod = dep["metadata"]["name"], dep["spec"]["template"]["spec"]
        assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), name
        assert not any("hostPath" in v for v in pod.get("volumes", [])), name
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod.get("automountServiceAccountToken") is False, f"{name} needs no API token"
        tmp_volumes = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
        for c in pod.get("initContainers", []) + pod["containers"]:
            sc, where = c["securityContext"], f"{name}/{c['name']}"
            assert sc["allowPrivilegeEscalation"] is False and sc.get("privileged") is not True, where
            assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert sc["seccompProfile"]["type"] == "RuntimeDefault", where
            image = c["image"]
            repo, _, tag = image.rpartition(":")
            assert repo and "/" not in tag and tag not in ("", "latest"), f"{where}: image {image} needs a pinned tag"
            if name in SERVICES:  # Python writes only under /tmp (HOME, caches): an emptyDir
                mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
                assert mounts.get("/tmp") in tmp_volumes, where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_drain_outlasts_prestop_delay_and_grace(overlay):
    """SIGTERM comes after preStop; the pod then needs the drain delay and --grace-s before the kill."""
    objs = render(overlay)
    for name in SERVICES:
        dep = one(objs, "Deployment", name)
        c = main_container(objs, name)
        cmd = c.spec["lifecycle"]["preStop"]["exec"]["command"]
        assert cmd[0] == "sleep"
        needed = float(cmd[1]) + float(c.flag("--drain-delay-s") or 0) + float(c.flag("--grace-s"))
        assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > needed, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_model_comes_from_the_fetch_init_container_and_one_config_map(overlay):
    objs = render(overlay)
    [config] = [c for c in of_kind(objs, "ConfigMap") if c["metadata"]["name"].startswith("kvwire-config")]
    prefill, decode = main_container(objs, "prefill"), main_container(objs, "decode")
    for flag in ("--model-dir", "--weights", "--kv-dtype", "--block-size"):  # must match, decode checks
        assert prefill.flag(flag) == decode.flag(flag), flag
    for name in SERVICES:
        dep = one(objs, "Deployment", name)
        [init] = containers(objs, dep, init=True)
        assert init.argv[:3] == ("python", "-m", "tools.fetch_model")
        assert init.argv[3] == config["data"]["KVWIRE_MODEL"]
        model_dir = main_container(objs, name).flag("--model-dir")
        init_mounts = {m["mountPath"]: m["name"] for m in init.spec["volumeMounts"]}
        main_mounts = {m["mountPath"]: m for m in main_container(objs, name).spec["volumeMounts"]}
        root = next(p for p in init_mounts if model_dir.startswith(p + "/"))
        assert main_mounts[root]["name"] == init_mounts[root] and main_mounts[root]["readOnly"] is True


def test_gpu_overlay_requests_gpus_and_the_cuda_image():
    gpu, cpu = render("gpu"), render("cpu")
    for name in ("prefill", "decode"):
        c = main_container(gpu, name)
        assert c.spec["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert c.spec["image"].endswith("-cuda")
        assert "nvidia.com/gpu" not in main_container(cpu, name).spec["resources"]["limits"]
    assert "nvidia.com/gpu" not in main_container(gpu, "tokenizer").spec["resources"]["limits"]


def test_gpu_overlay_runs_the_front_door_on_the_cpu_image():
    """The tokenizer never touches a GPU: the CUDA image (CUDA libraries, a C compiler) is not its."""
    gpu = render("gpu")
    dep = one(gpu, "Deployment", "tokenizer")
    pod = dep["spec"]["template"]["spec"]
    assert {c["image"] for c in pod["containers"] + pod.get("initContainers", [])} == {"kvwire:0.1.0-cpu"}
    assert main_container(gpu, "decode").spec["image"] == "kvwire:0.1.0-cuda"
    assert main_container(render("cpu"), "tokenizer").spec["image"] == "kvwire:0.1.0-cpu"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replicated_deployments_spread_over_zones_and_nodes(overlay):
    objs = render(overlay)
    for dep in kvwire_deployments(objs):
        name = dep["metadata"]["name"]
        replicas = max(dep["spec"].get("replicas", 1), *[h["spec"]["maxReplicas"] for h in
                       of_kind(objs, "HorizontalPodAutoscaler") if h["spec"]["scaleTargetRef"]["name"] == name])
        assert replicas > 1, name
        labels = dep["spec"]["template"]["metadata"]["labels"]
        spread = dep["spec"]["template"]["spec"].get("topologySpreadConstraints", [])
        assert {c["topologyKey"] for c in spread} == {"topology.kubernetes.io/zone", "kubernetes.io/hostname"}, name
        for c in spread:
            assert selects(c["labelSelector"], labels), f"{name}: the spread does not count its own pods"
            assert c["maxSkew"] == 1 and "pod-template-hash" in c.get("matchLabelKeys", []), name
            # Never DoNotSchedule: a small cluster must run every replica and a drain must never block.
            assert c["whenUnsatisfiable"] == "ScheduleAnyway", name


def test_every_flag_the_manifests_pass_exists():
    """Each container's command starts (``--help``) and accepts every flag the manifests give it."""
    seen: dict[str, set[str]] = {}
    for overlay in OVERLAYS:
        objs = render(overlay)
        for dep in kvwire_deployments(objs):
            for c in containers(objs, dep) + containers(objs, dep, init=True):
                assert c.argv[:2] == ("python", "-m")
                seen.setdefault(c.argv[2], set()).update(c.flags())
    assert set(seen) == {"tokenizer_svc", "decode_svc", "prefill_svc", "tools.fetch_model"}
    for module, flags in sorted(seen.items()):
        text = help_text(module)
        missing = [f for f in sorted(flags) if not re.search(re.escape(f) + r"\b", text)]
        assert not missing, f"python -m {module} has no {missing}"


def test_service_names_agree_between_code_and_manifests():
    """The OTel service.name a service picks by itself is the one the manifests set and Jaeger users
    are told to pick (the running services are checked in tests/integration/test_trace_metrics.py)."""
    for name, (module, otel_name, _) in SERVICES.items():
        source = "".join(p.read_text() for p in (REPO / module / "__main__.py", REPO / module / "app.py") if p.exists())
        assert re.findall(r'setup_tracing\("([^"]+)"', source) == [otel_name], module
        for overlay in OVERLAYS:
            assert main_container(render(overlay), name).env["OTEL_SERVICE_NAME"] == otel_name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_decode_readiness_does_not_follow_prefill(overlay):
    """A prefill outage must not turn every decode pod NotReady: decode serves through local prefill."""
    c = main_container(render(overlay), "decode")
    assert c.spec["readinessProbe"]["grpc"] == {"port": c.port("grpc"), "service": "kvwire.v1.DecodeService"}
    assert c.spec["startupProbe"]["grpc"] == {"port": c.port("grpc")}  # the overall status: loaded
    assert "--readiness-follows-prefill" not in c.flags()
    assert re.search(r"--readiness-follows-prefill[^\n]*\n(?:[^\n]*\n)*?\s*opt-in", help_text("decode_svc"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_internet_egress_only_for_pods_that_fetch_the_model(overlay):
    """HTTPS out of the cluster exists for the model fetch alone: port 443 only, public addresses
    only, and only pods with the fetch init container get it (a NetworkPolicy cannot narrow it to
    the init container itself: see the comment on kvwire-egress-model-fetch)."""
    objs = render(overlay)
    for policy in of_kind(objs, "NetworkPolicy"):
        for rule in policy["spec"].get("egress", []):
            blocks = [t["ipBlock"] for t in rule.get("to", []) if "ipBlock" in t]
            if not blocks:
                continue
            assert policy["metadata"]["name"] == "kvwire-egress-model-fetch"
            assert [p["port"] for p in rule["ports"]] == [443]
            assert all(b["cidr"] == "0.0.0.0/0" and set(b["except"]) >= {"10.0.0.0/8", "172.16.0.0/12",
                                                                        "192.168.0.0/16"} for b in blocks)
            for dep in of_kind(objs, "Deployment"):
                if selects(policy["spec"]["podSelector"], dep["spec"]["template"]["metadata"]["labels"]):
                    inits = containers(objs, dep, init=True)
                    assert [c.argv[:3] for c in inits] == [("python", "-m", "tools.fetch_model")], \
                        dep["metadata"]["name"]
