"""deploy/k8s/: every manifest validated offline against the Kubernetes schemas (kubernetes-validate,
strict: unknown fields fail), the CRDs against the documented subsets in crd_schemas.yaml, the
kustomizations complete, and the pieces agreeing with each other and with the gateway's code.
No cluster is involved (docs/deploy.md)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from usefulwork import config as uwconfig

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy/k8s"
K8S_VERSION = "1.33"  # a current Kubernetes minor; autoscaling/v2 and policy/v1 are GA since 1.23 / 1.21
SUBSETS = yaml.safe_load((Path(__file__).parent / "crd_schemas.yaml").read_text())
SEED_BEHAVIOR = {  # the seed's HPA policy (its "Autoscaling Configuration")
    "scaleUp": {"stabilizationWindowSeconds": 60, "policies": [{"type": "Pods", "value": 2, "periodSeconds": 120}]},
    "scaleDown": {"stabilizationWindowSeconds": 300},
}


def manifests() -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path, doc))
    return out


def find(kind: str, name: str | None = None, directory: str | None = None) -> dict:
    hits = [d for p, d in manifests() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
            and (directory is None or p.parent.name == directory)]
    assert len(hits) == 1, (kind, name, directory, len(hits))
    return hits[0]


def validate(doc: dict) -> None:
    """Raise on an invalid object: core kinds by the Kubernetes schema, others by our subsets."""
    if doc.get("apiVersion", "").startswith("keda.sh/"):
        jsonschema.validate(doc, SUBSETS["ScaledObject"])
        for trig in doc["spec"]["triggers"]:
            if trig["type"] == "prometheus":
                jsonschema.validate(trig["metadata"], SUBSETS["PrometheusTrigger"])
        behavior = doc["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
        if behavior is not None:  # the same type as an HPA's: check it with autoscaling/v2's schema
            validate({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "x"},
                      "spec": {"scaleTargetRef": {"kind": "Deployment", "name": "x"}, "maxReplicas": 1,
                               "behavior": behavior}})
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_every_manifest_is_valid():
    docs = manifests()
    assert len(docs) >= 12
    for path, doc in docs:
        try:
            validate(doc)
        except Exception as exc:  # noqa: BLE001 - name the file in the failure
            pytest.fail(f"{path.relative_to(ROOT)}: {doc['kind']} {doc['metadata'].get('name')}: {exc}")


@pytest.mark.parametrize("kind,name,path", [
    ("Deployment", "usefulwork-gateway", ["spec", "selector"]),
    ("Deployment", "vllm-llama-8b", ["spec", "template", "spec", "containers"]),
    ("Service", "redis", ["spec", "ports", 0, "port"]),
    ("PodDisruptionBudget", "usefulwork-gateway", None),  # a typo'd field: strict mode rejects it
    ("HorizontalPodAutoscaler", "vllm-llama-8b", ["spec", "maxReplicas"]),
    ("HorizontalPodAutoscaler", "vllm-llama-8b", ["spec", "metrics", 0, "external", "metric", "name"]),
    ("ScaledObject", "vllm-llama-8b", ["spec", "triggers"]),
    ("ScaledObject", "vllm-llama-8b", ["spec", "triggers", 0, "metadata", "query"]),
    ("ScaledObject", "vllm-llama-8b", ["spec", "scaleTargetRef", "name"]),
])
def test_a_missing_required_field_is_caught(kind, name, path):
    doc = copy.deepcopy(find(kind, name))
    validate(doc)  # valid as shipped
    if path is None:
        doc["spec"]["minAvailabel"] = 1
    else:
        node = doc
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    with pytest.raises(Exception) as info:
        validate(doc)
    assert isinstance(info.value, (kubernetes_validate.ValidationError, jsonschema.ValidationError))


def test_kustomizations_list_every_manifest_and_only_existing_ones():
    listed: set[Path] = set()
    for kfile in K8S.rglob("kustomization.yaml"):
        k = yaml.safe_load(kfile.read_text())
        assert k["kind"] == "Kustomization"
        for res in k["resources"]:
            target = (kfile.parent / res).resolve()
            assert target.exists(), f"{kfile}: {res} does not exist"
            if target.is_dir():
                assert (target / "kustomization.yaml").exists(), f"{kfile}: {res} is not a kustomization"
            else:
                listed.add(target)
    files = {p.resolve() for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert files == listed, f"not in any kustomization: {sorted(map(str, files - listed))}"
    # the two overlays are alternatives: each holds exactly one autoscaler for vLLM
    for overlay, kind in (("prometheus-adapter", "HorizontalPodAutoscaler"), ("keda", "ScaledObject")):
        kinds = [d["kind"] for p, d in manifests() if p.parent.name == overlay]
        assert kinds.count(kind) == 1, overlay


def test_gateway_configmap_loads_with_the_gateway_loader(tmp_path):
    cm = find("ConfigMap", "usefulwork-gateway")
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    cfg = uwconfig.load(path, environ={})
    assert "admission" in cfg.filters
    # What a deploy pipeline runs on it (outside the cluster: its Redis does not answer, a warning).
    r = subprocess.run([sys.executable, "-m", "usefulwork.cli", "serve", "--config", str(path), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("config OK"), r.stderr
    assert f"pool {cfg.pools[0].name}: models {cfg.pools[0].models[0]}; 0 static replica(s) + discovery" in r.stdout
    # a new key or limit reaches the pods without a rollout: the file is watched, and mounted as a directory
    # (a subPath mount is never updated by the kubelet)
    assert "reload of tenants, keys and access: on SIGHUP, and when the file changes (looked at every 10 s)" in r.stdout
    gw_pod = find("Deployment", "usefulwork-gateway")["spec"]["template"]["spec"]
    mount = next(m for m in gw_pod["containers"][0]["volumeMounts"] if m["name"] == "config")
    assert "subPath" not in mount and next(v for v in gw_pod["volumes"] if v["name"] == "config")["configMap"]["name"] \
        == cm["metadata"]["name"]
    pool = cfg.pools[0]
    vllm = find("Deployment", "vllm-llama-8b")
    assert vllm["metadata"]["labels"]["usefulwork.dev/pool"] == pool.name
    pods = find("Service", "vllm-llama-8b-pods")  # per-pod routing: the headless Service's name
    assert pods["spec"]["clusterIP"] == "None" and pods["spec"]["selector"] == vllm["spec"]["selector"]["matchLabels"]
    assert pool.discovery.dns == pods["metadata"]["name"] and pool.discovery.port == pods["spec"]["ports"][0]["port"]
    assert pool.replicas == [] and pool.gpu.per_replica == 1  # the bill follows the pods
    assert cfg.scale_out.redis_url.startswith("redis://redis:6379/")
    args = vllm["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--served-model-name={pool.models[0]}" in args
    redis = find("Service", "redis")
    assert cfg.ledger.redis_url.startswith(f"redis://{redis['metadata']['name']}:{redis['spec']['ports'][0]['port']}/")
    gw = find("Deployment", "usefulwork-gateway")
    c = gw["spec"]["template"]["spec"]["containers"][0]
    assert cfg.listen.port == c["ports"][0]["containerPort"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")["mountPath"]
    assert c["args"][c["args"].index("--config") + 1] == f"{mount}/config.yaml"


def test_gateway_pod_is_non_root_with_probes_and_resources():
    gw = find("Deployment", "usefulwork-gateway")
    pod = gw["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    c = pod["containers"][0]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    pdb = find("PodDisruptionBudget", "usefulwork-gateway")
    assert pdb["spec"]["selector"]["matchLabels"] == gw["spec"]["selector"]["matchLabels"]
    hpa = find("HorizontalPodAutoscaler", "usefulwork-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "usefulwork-gateway"
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"


def test_vllm_pods_ask_for_a_gpu_and_report_cached_tokens():
    pod = find("Deployment", "vllm-llama-8b")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "--enable-prompt-tokens-details" in c["args"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])


def test_vllm_autoscalers_scale_on_the_gateway_queue_with_the_seed_windows():
    hpa = find("HorizontalPodAutoscaler", "vllm-llama-8b")
    so = find("ScaledObject", "vllm-llama-8b")
    assert hpa["spec"]["behavior"] == SEED_BEHAVIOR
    assert so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == SEED_BEHAVIOR
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (2, 8)
    assert hpa["spec"]["scaleTargetRef"]["name"] == so["spec"]["scaleTargetRef"]["name"] == "vllm-llama-8b"
    # the HPA's metric is the adapter rule's output, selected by pool
    ext = hpa["spec"]["metrics"][0]["external"]
    cfg = yaml.safe_load(find("ConfigMap", "prometheus-adapter-usefulwork")["data"]["config.yaml"])
    jsonschema.validate(cfg, SUBSETS["AdapterConfig"])
    rule = cfg["externalRules"][0]
    assert rule["name"]["as"] == ext["metric"]["name"]
    assert ext["metric"]["selector"]["matchLabels"] == {"pool": "llama-8b"}
    # both read the series the admission filter exports (OTel name -> Prometheus name)
    source = (ROOT / "usefulwork/gateway/admission/filter.py").read_text()
    assert '"usefulwork.admission.queue.depth"' in source
    assert "usefulwork_admission_queue_depth" in rule["seriesQuery"]
    assert '"usefulwork.admission.shed.demand"' in source
    assert "vllm:num_requests_(running|waiting)" in rule["metricsQuery"]  # the what-if's metric: queued + shed + held
    assert "usefulwork_admission_shed_demand{<<.LabelMatchers>>}" in rule["metricsQuery"]
    trig = so["spec"]["triggers"][0]
    for series in ('usefulwork_admission_queue_depth{pool="llama-8b"}', 'usefulwork_admission_shed_demand{pool="llama-8b"}',
                   'vllm:num_requests_running{model_name="llama-3.1-8b"}',
                   'vllm:num_requests_waiting{model_name="llama-3.1-8b"}'):
        assert series in trig["metadata"]["query"]
    # the same per-replica target either way, and the one the what-if ran with
    from usefulwork.loadtest.autoscale import GATEWAY_QUEUE_TARGET

    assert float(ext["target"]["averageValue"]) == float(trig["metadata"]["threshold"]) == GATEWAY_QUEUE_TARGET


def test_grafana_dashboard_configmap_is_current():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import k8s_dashboard
    finally:
        sys.path.pop(0)
    assert (K8S / "base/grafana-dashboard.yaml").read_text() == k8s_dashboard.render(), \
        "run: python scripts/k8s_dashboard.py"
    cm = find("ConfigMap", "usefulwork-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
