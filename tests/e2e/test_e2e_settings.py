"""Live settings across three real proxy processes sharing one real Redis.

Observed by behaviour: pods wait 4 requests each, so a sheddable request is served while
queue_threshold_critical >= 4 and refused with 429 below it, on every proxy.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
import redis
from procs import (
    MASTER_KEY,
    child_env,
)
from stacks import Stack

from lora_affinity_plugin.config.live_settings import LiveCopy, settings_key
from lora_affinity_plugin.config.settings import build_settings

CLI = [sys.executable, "-m", "lora_affinity_plugin.ops.cli", "--log-level", "WARNING"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with Stack(tmp_path_factory.mktemp("settings")) as s:
        redis_port = s.redis()
        pods = s.fake_pods(2)
        for p in pods:
            httpx.post(f"http://127.0.0.1:{p}/_control/metrics", json={"waiting": 4, "running": 2, "kv": 0.5})

        def observed(config):
            config["litellm_settings"]["callbacks"].insert(0, "prometheus")
            config["litellm_settings"]["require_auth_for_metrics_endpoint"] = False
            config["litellm_settings"]["json_logs"] = True  # the plugin's lines follow: one JSON object each

        path = s.config(pods, redis_port, edit=observed, scrape_interval_ms=100)
        s.scraper(path)
        started = s.proxies(path, ["proxy-0", "proxy-1"])  # two replicas show "every replica follows"
        yield {"config": path, "ports": [int(url.rsplit(":", 1)[1]) for _, url in started],
               "redis": redis.Redis(port=redis_port), "proxies": [proc for proc, _ in started]}


def sheddable_status(port: int) -> int:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers={"Authorization": f"Bearer {MASTER_KEY}"},
                   json={"model": "sql-lora", "prompt": "x", "max_tokens": 3, "metadata": {"criticality": "sheddable"}},
                   timeout=10)
    return r.status_code


def wait_all(ports, status, timeout=3.0) -> list[float]:
    """Seconds until each proxy answers a sheddable request with `status`."""
    start = time.monotonic()
    seen: dict[int, float] = {}
    while len(seen) < len(ports) and time.monotonic() - start < timeout:
        for port in ports:
            if port not in seen and sheddable_status(port) == status:
                seen[port] = time.monotonic() - start
    assert len(seen) == len(ports), f"not every proxy reached {status}: {seen}"
    return list(seen.values())


def cli(stack, *args) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + ["thresholds", *args, "--config", str(stack["config"])], capture_output=True,
                          text=True, env=child_env(), timeout=60)


def test_a_change_reaches_every_proxy_within_a_second(stack):
    wait_all(stack["ports"], 200)
    out = cli(stack, "set", "queue_threshold_critical=3", "--by", "test")
    assert out.returncode == 0, out.stderr
    assert max(wait_all(stack["ports"], 429)) < 1.0
    metrics = httpx.get(f"http://127.0.0.1:{stack['ports'][0]}/metrics/").text
    version = json.loads(cli(stack, "show", "--json").stdout)["version"]
    assert f"lora_affinity_settings_version {float(version)}" in metrics


def test_a_lost_notice_still_converges(stack):
    client, base = stack["redis"], build_settings({}, environ={})
    current = LiveCopy.from_json(client.get(settings_key(base.key_prefix)))
    values = {**current.values, "queue_threshold_critical": 5}
    client.set(settings_key(base.key_prefix), LiveCopy(current.version + 1, values, time.time(), "no-publish").to_json())
    assert max(wait_all(stack["ports"], 200)) < 1.0  # no pub/sub message was sent: the periodic check saw it


def test_racing_writes_one_wins(stack):
    version = json.loads(cli(stack, "show", "--json").stdout)["version"]
    first = cli(stack, "set", "kv_cache_threshold=0.75", "--if-version", str(version))
    second = cli(stack, "set", "kv_cache_threshold=0.7", "--if-version", str(version))
    assert first.returncode == 0 and second.returncode == 3
    assert "someone else changed them" in second.stderr
    assert json.loads(cli(stack, "show", "--json").stdout)["kv_cache_threshold"] == 0.75


def test_a_bad_hand_written_value_is_refused_and_the_last_good_stays(stack):
    client, base = stack["redis"], build_settings({}, environ={})
    out = cli(stack, "set", "queue_threshold_critical=3")
    assert out.returncode == 0
    wait_all(stack["ports"], 429)
    current = LiveCopy.from_json(client.get(settings_key(base.key_prefix)))
    bad = {**current.values, "queue_threshold_critical": -7}
    client.set(settings_key(base.key_prefix), LiveCopy(current.version + 1, bad, time.time(), "by hand").to_json())
    time.sleep(0.6)
    assert all(sheddable_status(p) == 429 for p in stack["ports"])  # still version N's threshold of 3
    assert all("refused live settings" in p.log() for p in stack["proxies"])
    for proxy in stack["proxies"]:  # LiteLLM logs JSON (`json_logs`), and so does the plugin
        (line,) = [line for line in proxy.log().splitlines() if "refused live settings" in line][:1]
        assert json.loads(line)["level"] == "ERROR", line
    # `show` says what each proxy applies beside what Redis holds: both proxies kept version N
    shown = cli(stack, "show")
    assert f"proxies: 0 of 2 apply version {current.version + 1}" in shown.stdout, shown.stdout
    assert shown.stdout.count("WARNING") == 2 and f"applies version {current.version} " in shown.stdout
    cli(stack, "reset")
    deadline = time.monotonic() + 5
    while (data := json.loads(cli(stack, "show", "--json").stdout)).get("disagree"):
        assert time.monotonic() < deadline, data
        time.sleep(0.1)
    assert len(data["proxies"]) == 2 and all(v.endswith(f":{data['version']}") for v in data["proxies"].values())


def test_a_settings_file_is_applied_once_checked_for_drift_and_every_proxy_follows(stack, tmp_path):
    cli(stack, "reset")
    wait_all(stack["ports"], 200)
    wanted = tmp_path / "routing.yaml"
    wanted.write_text("lora_affinity:\n  queue_threshold_critical: 3\n  model_group_overrides:\n"
                      "    batch-lora: {rule_set: gie-v0.2}\n")
    assert cli(stack, "apply", str(wanted), "--check").returncode == 1  # drift: the live values are not the file's
    out = cli(stack, "apply", str(wanted), "--by", "pipeline")
    assert out.returncode == 0, out.stderr
    assert "queue_threshold_critical: 5 -> 3" in out.stdout and "model_group_overrides" in out.stdout
    assert max(wait_all(stack["ports"], 429)) < 1.0  # every proxy follows within a second
    version = json.loads(cli(stack, "show", "--json").stdout)["version"]
    # The same file again changes nothing: no new version, no audit entry; the drift check passes.
    again = cli(stack, "apply", str(wanted))
    assert again.returncode == 0 and "no change" in again.stdout
    assert json.loads(cli(stack, "show", "--json").stdout)["version"] == version
    assert cli(stack, "apply", str(wanted), "--check").returncode == 0
    (entry,) = json.loads(cli(stack, "history", "--json", "--count", "1").stdout)
    assert entry["version"] == version and entry["by"] == "pipeline" and entry["source"] == str(wanted)
    # A hand change is drift; a bad file is refused with the field named, and nothing changes.
    cli(stack, "set", "queue_threshold_critical=4")
    assert cli(stack, "apply", str(wanted), "--check").returncode == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("queue_threshold_critical: -1\nredis_url: redis://elsewhere:6379/0\n")
    refused = cli(stack, "apply", str(bad))
    assert refused.returncode == 2 and "nothing changed" in refused.stderr
    assert "redis_url" in refused.stderr or "queue_threshold_critical" in refused.stderr
    cli(stack, "reset")


def test_enabled_false_hands_every_request_to_litellm_within_a_second_and_true_brings_the_rules_back(stack):
    """Observed by behaviour: with a threshold every pod is over, the rules shed a sheddable request (429);
    LiteLLM's own strategy serves it (200)."""
    cli(stack, "set", "queue_threshold_critical=3")
    wait_all(stack["ports"], 429)
    assert cli(stack, "set", "enabled=false", "--by", "test").returncode == 0
    assert max(wait_all(stack["ports"], 200)) < 1.0
    assert all(sheddable_status(p) == 200 for p in stack["ports"] for _ in range(3))
    assert cli(stack, "set", "enabled=true").returncode == 0
    assert max(wait_all(stack["ports"], 429)) < 1.0
    cli(stack, "reset")


def test_shadow_mode_serves_by_litellm_and_counts_what_the_rules_would_have_done(stack):
    cli(stack, "set", "queue_threshold_critical=3")
    wait_all(stack["ports"], 429)  # the rules shed: every pod is over the threshold
    assert cli(stack, "set", "shadow=true").returncode == 0
    assert max(wait_all(stack["ports"], 200)) < 1.0  # LiteLLM serves them
    for port in stack["ports"]:
        page = httpx.get(f"http://127.0.0.1:{port}/metrics/").text
        shed = [line for line in page.splitlines()
                if line.startswith("lora_affinity_shadow_total{") and 'agree="shed"' in line]
        assert shed and float(shed[0].rsplit(" ", 1)[1]) >= 1, page[-2000:]
    cli(stack, "reset")


def test_a_wiped_redis_starts_a_new_history_that_every_proxy_follows(stack):
    """Redis loses its data (no persistence, a restart): the next `set` writes version 1 of a new history, and the
    proxies, which applied a higher version, apply it anyway, say so, and `show` finds them all on it."""
    assert cli(stack, "set", "queue_threshold_critical=3").returncode == 0
    wait_all(stack["ports"], 429)
    stack["redis"].flushall()
    out = cli(stack, "set", "queue_threshold_critical=1000")
    assert out.returncode == 0 and out.stdout.startswith("version 1:"), out.stdout
    wait_all(stack["ports"], 200, timeout=5.0)  # a version lower than what they applied, of another history
    assert all("start a new history" in proxy.log() for proxy in stack["proxies"])
    deadline = time.monotonic() + 5
    while (data := json.loads(cli(stack, "show", "--json").stdout)).get("disagree") or len(data["proxies"]) < 2:
        assert time.monotonic() < deadline, data
        time.sleep(0.1)
    assert data["version"] == 1 and all(v.endswith(":1") for v in data["proxies"].values())
