"""Every dashboard query and every alert, proven on a real Prometheus.

Real processes: redis-server, simulated vLLM replicas, the scraper (its metrics port), a `litellm --config`
proxy with the plugin and LiteLLM's Prometheus callback, and Debian's `prometheus` scraping all three
every second. After a short load (shared-prefix completions, then a settings change that makes every pod
too busy for sheddable traffic while another client's long requests run on each pod), each panel's query
returns series, the counters agree with what the load did, and each alert's expression is quiet.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from procs import CLI, MASTER_KEY, Proc, child_env, free_port, free_port_range, litellm_proxy, lora_affinity, proxy_config
from procs import redis_server, wait_port

from paths import DEPLOY

sys.path.insert(0, str(DEPLOY / "grafana"))
import dashboard  # noqa: E402  (deploy/grafana/dashboard.py)

ADAPTERS = ["sql-lora", "tweet-summary"]
SHARED = "You are a careful assistant for the support team. " * 30  # ~1.5 KB: a prefix the pods cache


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    prometheus = shutil.which("prometheus")
    assert prometheus, "Debian's prometheus package is not installed (bash .ci/run installs it)"
    tmp = tmp_path_factory.mktemp("prometheus")
    base = free_port_range(2)
    redis_port, proxy_port, scraper_port, prom_port = (next(p for p in iter(free_port, None)
                                                            if p not in (base, base + 1)) for _ in range(4))
    pods = [base, base + 1]
    procs: list[Proc] = []
    state = {"redis": redis_server(redis_port, tmp)}
    try:
        events, replay = free_port_range(2), free_port_range(2)  # the replicas publish KV events (the dashboard's lag)
        procs.append(Proc("sim", [sys.executable, "-m", "lora_affinity_plugin.ops.cli", "sim", "--replicas", "2",
                                  "--base-port", str(base), "--speed", "5", "--warm-adapters", ",".join(ADAPTERS),
                                  "--mean-output-tokens", "20", "--kv-events-config", json.dumps(
                                      {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events}",
                                       "replay_endpoint": f"tcp://*:{replay}"})], tmp))
        for port in pods:
            wait_port(port)
        config = proxy_config(pods, redis_port, kv_events=True)
        for i, deployment in enumerate(config["model_list"]):
            deployment["model_info"] = {"kv_events_endpoint": f"tcp://127.0.0.1:{events + i}",
                                        "kv_events_replay_endpoint": f"tcp://127.0.0.1:{replay + i}"}
        config["litellm_settings"]["callbacks"].insert(0, "prometheus")
        config["litellm_settings"]["require_auth_for_metrics_endpoint"] = False
        path = tmp / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        scraper_args = ["scrape", "--config", str(path), "--metrics-port", str(scraper_port)]
        procs.append(lora_affinity(scraper_args, tmp, "scraper"))
        procs.append(litellm_proxy(path, proxy_port, tmp))
        scrape = {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"}
        (tmp / "rules.yaml").write_text(yaml.safe_dump(_drill_rules()))
        (tmp / "prometheus.yml").write_text(yaml.safe_dump({
            "global": scrape,
            "rule_files": [str(tmp / "rules.yaml")],
            "scrape_configs": [
                {"job_name": "litellm", "metrics_path": "/metrics/",
                 "static_configs": [{"targets": [f"127.0.0.1:{proxy_port}"]}]},
                {"job_name": "lora-affinity-scraper", "static_configs": [{"targets": [f"127.0.0.1:{scraper_port}"]}]},
                {"job_name": "vllm", "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in pods]}]},
            ]}))
        procs.append(Proc("prometheus", [prometheus, f"--config.file={tmp / 'prometheus.yml'}",
                                         f"--storage.tsdb.path={tmp / 'tsdb'}",
                                         f"--web.listen-address=127.0.0.1:{prom_port}"], tmp))
        wait_port(prom_port)
        load = _load(f"http://127.0.0.1:{proxy_port}", path, pods)
        _scraped_since(f"http://127.0.0.1:{prom_port}", time.time() + 0.5)
        yield {"proxy": f"http://127.0.0.1:{proxy_port}", "prometheus": f"http://127.0.0.1:{prom_port}",
               "config": path, "load": load, "procs": procs, "scraper_args": scraper_args, "state": state,
               "redis_port": redis_port, "tmp": tmp}
    finally:
        for proc in reversed(procs):
            proc.stop()
        state["redis"].stop()


def _complete(proxy: str, i: int, *, sheddable: bool = False, tokens: int = 8) -> int:
    body = {"model": ADAPTERS[i % 2], "prompt": f"{SHARED}Question {i}: what changed?", "max_tokens": tokens,
            "ignore_eos": True, **({"metadata": {"criticality": "sheddable"}} if sheddable else {})}
    return httpx.post(proxy + "/v1/completions", json=body, headers={"Authorization": f"Bearer {MASTER_KEY}"},
                      timeout=60).status_code


def _thresholds(config: Path, *words: str) -> None:
    out = subprocess.run(CLI + ["thresholds", *words, "--config", str(config)], capture_output=True, text=True,
                         env=child_env(), timeout=60)
    assert out.returncode == 0, out.stderr


def _load(proxy: str, config: Path, pods: list[int]) -> dict:
    """What the queries must agree with: HTTP statuses of every request sent through the proxy, counted; and
    whether the long requests outlasted the sheddable ones (what makes every sheddable one shed)."""
    statuses: list[int] = []
    with ThreadPoolExecutor(4) as pool, ThreadPoolExecutor(6) as burst:
        statuses += pool.map(lambda i: _complete(proxy, i), range(40))
        # No pod may take sheddable traffic while anything runs or waits there.
        _thresholds(config, "set", "queue_threshold_critical=0", "kv_cache_threshold=0.0")
        time.sleep(0.5)
        # Another client's long requests, one on each pod past the gateway (600 tokens: about 7 s at the fleet's
        # 5x), keep both busy whatever the router would pick; through the proxy both could land on one pod.
        long = [pool.submit(_complete, f"http://127.0.0.1:{port}", i, tokens=600) for i, port in enumerate(pods)]
        time.sleep(1.0)  # running, and scraped (every 100 ms)
        statuses += burst.map(lambda i: _complete(proxy, i, sheddable=True), range(6))
        outlasted = not any(f.done() for f in long)
        assert [f.result() for f in long] == [200, 200]
        _thresholds(config, "reset")
    return {"statuses": {code: statuses.count(code) for code in set(statuses)}, "long_outlasted": outlasted}


def _scraped_since(prometheus: str, since: float, timeout: float = 60) -> None:
    """Until Prometheus has scraped every target after `since` (however slowly this machine runs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = httpx.get(prometheus + "/api/v1/query", params={"query": "timestamp(up == 1)"}, timeout=10).json()
        stamps = [float(r["value"][1]) for r in body["data"]["result"]]
        if len(stamps) == 4 and min(stamps) > since:  # the proxy, the scraper, two replicas
            return
        time.sleep(0.5)
    raise AssertionError(f"Prometheus did not scrape every target after the load: {body}")


def query(stack, expr: str) -> list[dict]:
    expr = expr.replace("$__rate_interval", "1m").replace("$model_group", ".*").replace("$pod", ".*")
    body = httpx.get(stack["prometheus"] + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def value(stack, expr: str) -> float:
    (series,) = query(stack, expr)
    return float(series["value"][1])


def test_the_load_was_routed_and_shed_as_arranged(stack):
    load = stack["load"]["statuses"]
    assert stack["load"]["long_outlasted"], f"the long requests ended before the sheddable ones: {load}"
    assert load.get(200, 0) == 40 and load.get(429, 0) == 6, load  # every sheddable one shed, the rest routed
    assert set(load) <= {200, 429}, load


@pytest.mark.parametrize("expr", dashboard.queries(), ids=lambda e: e[:60])
def test_every_dashboard_query_returns_series(stack, expr):
    assert query(stack, expr), f"no series for {expr}"


def test_the_dashboards_figures_agree_with_the_load(stack):
    load = stack["load"]["statuses"]
    assert value(stack, "sum(lora_affinity_decisions_total)") == load[200]  # one decision per routed request
    assert value(stack, 'sum(lora_affinity_shed_total{criticality="sheddable"})') == load[429]
    assert not query(stack, 'lora_affinity_shed_total{criticality="critical"} > 0')
    assert value(stack, "sum(lora_affinity_fallbacks_total)") == 0
    assert value(stack, "sum(lora_affinity_scraper_leader)") == 1
    assert value(stack, "min(lora_affinity_pod_up)") == 1 and len(query(stack, "lora_affinity_pod_up")) == 2
    assert value(stack, "sum(lora_affinity_inflight_requests)") == 0  # everything ended
    # Two settings changes (set, reset) on top of the seeded version.
    assert value(stack, "max(lora_affinity_settings_version)") >= 3
    # Shared 1.5 KB prefixes: most prompt tokens after the first few requests hit the pods' caches.
    hits = value(stack, "sum(vllm:prefix_cache_hits_total) / sum(vllm:prefix_cache_queries_total)")
    assert 0.5 < hits <= 1.0, hits


def _alerts() -> list[dict]:
    groups = yaml.safe_load((DEPLOY / "prometheus" / "rules.yaml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


@pytest.mark.parametrize("rule", _alerts(), ids=lambda r: r["alert"])
def test_every_alert_reads_exported_metrics_and_is_quiet_on_a_healthy_fleet(stack, rule):
    names = set(re.findall(r"lora_affinity_[a-z_]+", rule["expr"]))
    names |= {f"lora_affinity_{m}_total" for group in re.findall(r"lora_affinity_\(([a-z_|]+)\)_total", rule["expr"])
              for m in group.split("|")}
    exported = {s["metric"]["__name__"] for s in query(stack, '{__name__=~"lora_affinity_.+"}')}
    # no_capacity_total appears once a 503 happened, which a healthy fleet never gives; the registry has it.
    assert names - {"lora_affinity_no_capacity_total", "lora_affinity_"} <= exported, names - exported
    assert query(stack, rule["expr"]) == [], f"{rule['alert']} fires on a healthy fleet"


OUTAGES = {"LoraAffinityNoScraperLeader", "LoraAffinityNoFreshMetrics", "LoraAffinityRedisUnreachable"}
DRILL_FOR = "5s"


def _drill_rules() -> dict:
    """The shipped rules, the outage alerts' `for:` cut to `DRILL_FOR` (promtool's unit tests hold the shipped
    durations; the drill proves the expressions fire on real outages and clear after them)."""
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules.yaml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule["alert"] in OUTAGES:
                rule["for"] = DRILL_FOR
    return rules


def _firing(stack) -> set[str]:
    alerts = httpx.get(stack["prometheus"] + "/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    return {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}


def _until(check, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def test_each_outage_fires_its_critical_alert_and_clears_after_recovery(stack):
    """The drill: the scraper killed, then Redis stopped, on the real Prometheus evaluating the shipped rules. Each
    outage's critical alert fires, and clears once the part is back. (Last in the module: it breaks the fleet.)"""
    _until(lambda: not _firing(stack) & OUTAGES)  # a healthy start
    scraper = next(p for p in stack["procs"] if p.name == "scraper")
    scraper.stop(signal.SIGKILL)
    _until(lambda: {"LoraAffinityNoScraperLeader", "LoraAffinityNoFreshMetrics"} <= _firing(stack))
    stack["procs"].append(lora_affinity(stack["scraper_args"], stack["tmp"], "scraper-back"))
    _until(lambda: not _firing(stack) & OUTAGES)
    stack["state"]["redis"].stop()
    _until(lambda: "LoraAffinityRedisUnreachable" in _firing(stack))
    stack["state"]["redis"] = redis_server(stack["redis_port"], stack["tmp"])
    _until(lambda: not _firing(stack) & OUTAGES)
