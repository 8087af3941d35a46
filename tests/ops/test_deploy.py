"""deploy/ checked offline: no cluster and no container daemon here, so the manifests are validated
against the Kubernetes schemas (kubernetes-validate, strict) and the Dockerfile is linted (hadolint)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from lora_affinity_plugin.fleet.pods import discover_pods
from lora_affinity_plugin.config.settings import settings_from_config
from paths import DEPLOY

KUBERNETES_VERSION = "1.30.0"
MANIFESTS = sorted(p for p in (DEPLOY / "kubernetes").glob("*.yaml") if p.name != "kustomization.yaml")


def documents() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_is_valid_kubernetes(doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_refuses_a_misspelt_field():
    deployment = next(d for d in documents() if d["kind"] == "Deployment")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = broken["spec"]["template"]["spec"][
        "containers"][0].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_layout_the_readme_describes():
    kinds = {(d["kind"], d["metadata"]["name"]) for d in documents()}
    assert {("Deployment", "litellm"), ("Service", "litellm"), ("PodDisruptionBudget", "litellm"),
            ("ConfigMap", "litellm-config"), ("StatefulSet", "redis"), ("Service", "redis")} <= kinds
    proxy = next(d for d in documents() if d["kind"] == "Deployment" and d["metadata"]["name"] == "litellm")
    containers = {c["name"]: c for c in proxy["spec"]["template"]["spec"]["containers"]}
    assert containers["litellm"]["readinessProbe"]["httpGet"]["path"] == "/health/readiness"
    assert containers["litellm"]["livenessProbe"]["httpGet"]["path"] == "/health/liveliness"
    assert containers["scraper"]["command"][:2] == ["lora-affinity", "scrape"]
    assert containers["scraper"]["livenessProbe"]["httpGet"]["port"] == "scraper-metrics"


def test_the_configmaps_config_is_one_the_plugin_accepts():
    configmap = next(d for d in documents() if d["kind"] == "ConfigMap")
    config = yaml.safe_load(configmap["data"]["config.yaml"])
    assert "lora_affinity_plugin.strategy.proxy_plugin" in config["litellm_settings"]["callbacks"]
    settings = settings_from_config(config, {"LORA_AFFINITY_REDIS_URL": "redis://redis:6379/0"})
    assert settings.redis_url == "redis://redis:6379/0"
    assert discover_pods(config["model_list"]) == ["http://vllm-0.vllm:8000", "http://vllm-1.vllm:8000"]


def test_the_dockerfile_passes_hadolint_and_sets_what_an_air_gapped_proxy_needs():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    result = subprocess.run([hadolint, str(DEPLOY / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (DEPLOY / "Dockerfile").read_text()
    assert "FROM ghcr.io/berriai/litellm:" in text
    for env in ("HF_HUB_OFFLINE=1", "LITELLM_LOCAL_MODEL_COST_MAP=True"):
        assert env in text


def test_the_layout_is_hardened_scraped_persistent_and_lets_long_generations_finish():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in documents()}
    proxy = docs["Deployment", "litellm"]["spec"]["template"]
    pod = proxy["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    for container in pod["containers"]:
        ctx = container["securityContext"]
        assert ctx["readOnlyRootFilesystem"] and not ctx["allowPrivilegeEscalation"] and ctx["capabilities"]["drop"] == ["ALL"]
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
        env = {e["name"]: e for e in container["env"]}
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "redis", "key": "password"}
        assert env["LORA_AFFINITY_REDIS_URL"]["value"] == "redis://:$(REDIS_PASSWORD)@redis:6379/0"
    config = yaml.safe_load(docs["ConfigMap", "litellm-config"]["data"]["config.yaml"])
    assert pod["terminationGracePeriodSeconds"] > config["litellm_settings"]["request_timeout"]
    assert "prometheus" in config["litellm_settings"]["callbacks"]
    assert {c["topologyKey"] for c in pod["topologySpreadConstraints"]} == {"kubernetes.io/hostname",
                                                                            "topology.kubernetes.io/zone"}
    assert proxy["metadata"]["annotations"]["prometheus.io/port"] == "9400"
    redis = docs["StatefulSet", "redis"]["spec"]
    args = redis["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and "--requirepass" in args
    assert redis["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    monitor = yaml.safe_load((DEPLOY / "prometheus" / "servicemonitor.yaml").read_text())
    ports = {e["port"]: e for e in monitor["spec"]["endpoints"]}
    service_ports = {p["name"] for p in docs["Service", "litellm"]["spec"]["ports"]}
    assert set(ports) <= service_ports and ports["http"]["path"] == "/metrics/"
    assert monitor["spec"]["selector"]["matchLabels"] == docs["Service", "litellm"]["spec"]["selector"]
