"""The alert rules and the dashboard, offline: promtool checks and unit-tests the rules (each alert fires
when it should and stays quiet when it should not), the PrometheusRule says what rules.yaml says, the
dashboard JSON is what deploy/grafana/dashboard.py writes, and every metric they name is one the plugin
registers or vLLM exports. tests/e2e/test_e2e_prometheus.py runs the same queries on a real Prometheus."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import yaml

from paths import DEPLOY, FIXTURES

PROMETHEUS = DEPLOY / "prometheus"

sys.path.insert(0, str(DEPLOY / "grafana"))
import dashboard  # noqa: E402  (deploy/grafana/dashboard.py)

VLLM_PAGES = FIXTURES


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    assert binary, "promtool is not installed (Debian's prometheus package; bash .ci/run installs it)"
    return subprocess.run([binary, *args], capture_output=True, text=True, cwd=PROMETHEUS, timeout=60)


def test_promtool_checks_the_rules():
    out = promtool("check", "rules", "rules.yaml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 6 rules found" in out.stdout


def test_promtool_unit_tests_every_alert_firing_and_quiet():
    out = promtool("test", "rules", "rules_test.yaml")
    assert out.returncode == 0, out.stdout + out.stderr
    tested = set(re.findall(r"alertname: (\w+)", (PROMETHEUS / "rules_test.yaml").read_text()))
    assert tested == {rule["alert"] for rule in _rules()}


def test_a_broken_expectation_fails_promtool(tmp_path):
    """The unit tests can fail: the same tests with one alert expected to stay quiet where it fires."""
    broken = (PROMETHEUS / "rules_test.yaml").read_text().replace(
        "      - eval_time: 11m\n        alertname: LoraAffinityFallingBack\n        exp_alerts:\n",
        "      - eval_time: 11m\n        alertname: LoraAffinityFallingBack\n        exp_alerts: []\n        unused:\n", 1)
    (tmp_path / "rules.yaml").write_text((PROMETHEUS / "rules.yaml").read_text())
    (tmp_path / "rules_test.yaml").write_text(broken)
    out = subprocess.run([shutil.which("promtool"), "test", "rules", "rules_test.yaml"], capture_output=True,
                         text=True, cwd=tmp_path, timeout=60)
    assert out.returncode != 0


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load((PROMETHEUS / "rules.yaml").read_text())["groups"] for r in g["rules"]]


def test_the_prometheusrule_manifest_says_what_rules_yaml_says():
    manifest = yaml.safe_load((PROMETHEUS / "prometheusrule.yaml").read_text())
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1" and manifest["kind"] == "PrometheusRule"
    assert manifest["spec"] == yaml.safe_load((PROMETHEUS / "rules.yaml").read_text())


def test_the_dashboard_json_is_what_its_generator_writes():
    assert (DEPLOY / "grafana" / "lora-affinity.json").read_text() == dashboard.render(), \
        "run: python deploy/grafana/dashboard.py"


def _exported_names() -> set[str]:
    """The plugin's registered metric names (counters with and without _total) and vLLM's, from real pages."""
    import lora_affinity_plugin.telemetry.metrics  # noqa: F401  (registers them)
    from prometheus_client import REGISTRY

    names = set()
    for family in REGISTRY.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}.get(family.type, ("",))
        names |= {family.name + suffix for suffix in suffixes}  # also for a labelled family with no child yet
    for page in VLLM_PAGES.rglob("*.txt"):
        names |= set(re.findall(r"^(vllm:[a-z_:]+?)(?:\{| )", page.read_text(errors="replace"), re.M))
    return names


@pytest.mark.parametrize("expr", dashboard.queries() + [r["expr"] for r in _rules()], ids=lambda e: e[:50])
def test_every_query_names_only_metrics_the_plugin_or_vllm_exports(expr):
    names = set(re.findall(r"\b(lora_affinity_[a-z_]+|vllm:[a-z_:]+)", expr)) - {"lora_affinity_"}
    for group in re.findall(r"lora_affinity_\(([a-z_|]+)\)_total", expr):
        names |= {f"lora_affinity_{m}_total" for m in group.split("|")}
    unknown = names - _exported_names()
    assert names and not unknown, unknown
