"""End to end: real redis-server, three fake vLLM pods, the scraper and a real `litellm --config` proxy.

One stack for the whole module (a proxy takes ~9 s to start). Each test scripts the pods' metrics,
waits for the scrape to reach the proxy, then sends real HTTP requests through the proxy and reads
which pod served them.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis as redis_client
from fake_pods import BASE_MODEL
from lora_affinity_plugin.fleet.store import PodRecord
from procs import (
    MASTER_KEY,
    Proc,
    child_env,
    fake_pods,
    free_port,
    litellm_proxy,
    lora_affinity,
    redis_server,
    write_config,
)

SCRAPE_S = 0.1
SETTLE_S = 0.5  # a few scrape + refresh intervals, when Redis cannot be asked


class Stack:
    def __init__(self, tmp, redis: Proc, redis_port: int, pods: list[int], proxy_port: int, procs: dict):
        self.tmp, self.redis, self.redis_port, self.pods, self.proxy_port, self.procs = (
            tmp, redis, redis_port, pods, proxy_port, procs)
        self.http = httpx.Client(timeout=30)

    def pod_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.pods[i]}"

    def script(self, *states: dict) -> None:
        """Set the pods' metrics, then wait until the proxy can have read them: every pod's record in Redis
        scraped after the change, then as long again (at least 3 refreshes) for the proxy's refresh. On a busy
        machine the scraper's lag, measured here, sets the wait, not a constant."""
        for i, state in enumerate(states):
            self.http.post(self.pod_url(i) + "/_control/metrics", json=state).raise_for_status()
            self.http.post(self.pod_url(i) + "/_control/reset").raise_for_status()
        changed = time.time()
        try:
            client = redis_client.Redis(port=self.redis_port, socket_timeout=1)
            while time.time() - changed < 15:
                keys = client.keys("{lora_affinity}:pod:*")
                records = [PodRecord.from_json(raw) for raw in client.mget(keys)] if keys else []
                if len(records) >= len(self.pods) and all(r.scraped_at >= changed for r in records):
                    break
                time.sleep(SCRAPE_S / 4)
            lag = time.time() - changed
        except redis_client.RedisError:
            lag = SETTLE_S
        time.sleep(max(3 * SCRAPE_S, lag))

    def served(self) -> Counter:
        counts: Counter = Counter()
        for i in range(len(self.pods)):
            counts["ABC"[i]] += len(self.http.get(self.pod_url(i) + "/_control/requests").json())
        return counts

    def complete(self, model: str, headers: dict | None = None, **body) -> httpx.Response:
        return self.http.post(
            f"http://127.0.0.1:{self.proxy_port}/v1/completions",
            headers={"Authorization": f"Bearer {MASTER_KEY}", **(headers or {})},
            json={"model": model, "prompt": "Is the Necronomicon in the movie: Army of Darkness?", "max_tokens": 5,
                  **body},
        )

    def send(self, model: str, n: int, pace_s: float = 0.0, decided: bool = True, **kw) -> list[httpx.Response]:
        """`n` requests; with `decided`, each must be a decision of the plugin's rules (its DEBUG line), not
        LiteLLM's pick, so a routing test cannot pass on a fallback."""
        before = self.procs["proxy"].log().count(") among [")
        out = []
        for _ in range(n):
            out.append(self.complete(model, **kw))
            time.sleep(pace_s)
        if decided:
            count = self.procs["proxy"].log().count(") among [") - before
            assert count == n, f"{count} of {n} requests were decided by the plugin"
        return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    redis_port, proxy_port = free_port(), free_port()
    pods = [free_port() for _ in range(3)]
    procs: dict[str, Proc] = {}
    redis = redis_server(redis_port, tmp)
    s: Stack | None = None
    try:
        procs["pods"] = fake_pods(pods, tmp)
        config = write_config(tmp / "config.yaml", pods, redis_port, stale_after_ms=500, metrics_ttl_ms=1000)
        procs["scraper"] = lora_affinity(["scrape", "--config", str(config)], tmp, "scraper")
        procs["proxy"] = litellm_proxy(config, proxy_port, tmp, env=child_env(LORA_AFFINITY_LOG_LEVEL="DEBUG"))
        s = Stack(tmp, redis, redis_port, pods, proxy_port, procs)
        s.script({}, {}, {})
        # A proxy routes by metrics once its plugin is installed and has read a snapshot; until then (the
        # first moments after start, longer on a busy machine) LiteLLM picks. Warm up until a decision is
        # logged, so every test measures the rules.
        deadline = time.monotonic() + 60
        while ") among [" not in procs["proxy"].log() and time.monotonic() < deadline:
            s.complete("warm-up")
            time.sleep(SCRAPE_S)
        assert ") among [" in procs["proxy"].log(), "the plugin never routed a request"
        yield s
    finally:
        for proc in procs.values():
            proc.stop()
        (s.redis if s is not None else redis).stop()  # the outage test replaces the server


IDLE = {"running": 2, "waiting": 0, "kv": 0.2, "running_adapters": ["tweet-summary"]}


def test_adapter_running_on_b_goes_to_b(stack):
    stack.script(IDLE, {**IDLE, "running_adapters": ["sql-lora"]}, IDLE)
    responses = stack.send("sql-lora", 8, pace_s=0.25)
    assert all(r.status_code == 200 for r in responses), responses[0].text
    assert stack.served() == Counter({"B": 8, "A": 0, "C": 0})


def test_response_headers_name_the_pod_and_the_branch_only_when_asked(stack):
    """`response_headers` (a live setting): each routed response, streamed or not, names its pod and the
    decision's branch; off (the default), no such header."""
    stack.script(IDLE, {**IDLE, "running_adapters": ["sql-lora"]}, IDLE)
    (plain,) = stack.send("sql-lora", 1)
    assert not any(name.startswith("x-lora-affinity") for name in plain.headers)
    _cli(stack, "thresholds", "set", "response_headers=true")
    try:
        deadline = time.monotonic() + 30
        while "x-lora-affinity-pod" not in stack.complete("sql-lora").headers:
            assert time.monotonic() < deadline, "the setting never reached the proxy"
            time.sleep(SCRAPE_S)
        for stream in (False, True):
            response = stack.complete("sql-lora", stream=stream)
            assert response.status_code == 200
            assert response.headers["x-lora-affinity-pod"] == stack.pod_url(1)  # where the adapter runs
            if not stream:  # (LiteLLM names the api_base on a whole response only)
                assert response.headers["x-litellm-model-api-base"].rstrip("/").removesuffix("/v1") == stack.pod_url(1)
            assert response.headers["x-lora-affinity-reason"]  # the branch, e.g. affinity
    finally:
        _cli(stack, "thresholds", "set", "response_headers=false")


def test_pod_over_the_lora_queue_threshold_is_avoided(stack):
    stack.script({**IDLE, "waiting": 1}, {**IDLE, "waiting": 200, "running_adapters": ["sql-lora"]},
                 {**IDLE, "waiting": 1})
    print("sending", time.time())
    stack.send("sql-lora", 8, pace_s=0.25)
    served = stack.served()
    assert served["B"] == 0 and served["A"] + served["C"] == 8


def test_higher_kv_pod_is_avoided_among_equals(stack):
    sized = {**IDLE, "num_gpu_blocks": 700}  # 11,200 tokens: the prediction prices a fuller cache's slower steps
    stack.script({**sized, "kv": 0.95}, {**sized, "kv": 0.1}, {**sized, "kv": 0.1})
    stack.send("new-adapter", 8, pace_s=0.25)
    served = stack.served()
    assert served["A"] == 0 and served["B"] + served["C"] == 8


def test_sheddable_request_gets_429_when_all_pods_are_saturated(stack):
    saturated = {**IDLE, "waiting": 10}
    stack.script(saturated, saturated, saturated)
    by_body = stack.complete("sql-lora", metadata={"criticality": "sheddable"})
    by_header = stack.complete("sql-lora", headers={"x-criticality": "Sheddable"})
    critical = stack.complete("sql-lora")
    assert by_body.status_code == 429, by_body.text
    assert "limited backend resources" in by_body.text
    assert by_header.status_code == 429
    assert critical.status_code == 200


def test_concurrent_base_model_requests_are_balanced(stack):
    stack.script(IDLE, IDLE, IDLE)
    for i in range(3):  # each answers in 1 s, so the 15 requests overlap: the in-flight counts spread them
        stack.http.post(stack.pod_url(i) + "/_control/behaviour", json={"delay": 1.0}).raise_for_status()
    try:
        with ThreadPoolExecutor(15) as pool:
            responses = list(pool.map(lambda _: stack.complete(BASE_MODEL), range(15)))
    finally:
        for i in range(3):
            stack.http.post(stack.pod_url(i) + "/_control/behaviour", json={}).raise_for_status()
    assert all(r.status_code == 200 for r in responses)
    served = stack.served()
    assert sum(served.values()) == 15 and min(served.values()) >= 4, served


def test_routing_falls_back_while_redis_is_down_and_returns_after(stack):
    stack.script(IDLE, {**IDLE, "running_adapters": ["sql-lora"]}, IDLE)
    stack.redis.stop()
    time.sleep(1.5)  # past metrics_ttl_ms: the proxy's last snapshot is too old to use, even as a backup
    responses = stack.send("sql-lora", 12, decided=False)  # Redis is down: LiteLLM's pick
    assert [r.status_code for r in responses] == [200] * 12
    served = stack.served()
    assert served["A"] + served["C"] > 0, "with no fresh metrics the proxy shuffles"
    log = stack.procs["proxy"].log()
    assert log.count("cannot read pod metrics from Redis") == 1, "one log line per outage, not per request"

    stack.redis = redis_server(stack.redis_port, stack.tmp)
    stack.script(IDLE, {**IDLE, "running_adapters": ["sql-lora"]}, IDLE)
    stack.send("sql-lora", 6, pace_s=0.25)
    assert stack.served() == Counter({"B": 6, "A": 0, "C": 0})


def _cli(stack, *args) -> str:
    import subprocess

    out = subprocess.run([sys.executable, "-m", "lora_affinity_plugin.ops.cli", "--log-level", "WARNING", *args,
                          "--config", str(stack.tmp / "config.yaml")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_status_shows_every_pod_fresh_with_its_metrics(stack):
    import json

    stack.script(IDLE, {**IDLE, "running_adapters": ["sql-lora"], "waiting": 3}, IDLE)
    data = json.loads(_cli(stack, "status", "--json"))
    assert [row["state"] for row in data["pods"]] == ["fresh"] * 3
    b = data["pods"][1]
    assert (b["waiting"], b["running"], b["running_adapters"], b["max_lora"]) == (3, 2, ["sql-lora"], 4)
    assert "fresh" in _cli(stack, "status")


def test_explain_shows_each_rule_and_the_pick(stack):
    import json

    stack.script(IDLE, {**IDLE, "running_adapters": ["sql-lora"]}, IDLE)
    data = json.loads(_cli(stack, "explain", "--model", "sql-lora", "--json"))
    assert data["pick"] == stack.pod_url(1) and data["branch"] == "predicted_ttft"
    rules = {r["rule"]: r for r in data["rules"]}
    assert list(rules)[:6] == ["no_slot_queue_joined", "document_weights", "next_turn_elsewhere",
                               "prefix_affinity_ttft", "new_instructions", "predicted_ttft"]
    assert set(data["costs"]) == set(data["candidates"])
    assert data["slowness"] == {pod: 1.0 for pod in data["candidates"]}  # equal pods: nobody slower
    text = _cli(stack, "explain", "--model", "sql-lora", "--criticality", "sheddable")
    assert "pick: " + stack.pod_url(1) in text and "estimated cost" in text and "adapter load" in text
    predicted = data["predictions"]
    assert set(predicted) == set(data["candidates"]) and "predicted time to first token" in text
    assert predicted[stack.pod_url(1)]["adapter_s"] == 0 < predicted[stack.pod_url(0)]["adapter_s"]
