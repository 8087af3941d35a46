"""Beyond one Redis server: the whole product on Redis Sentinel and on Redis Cluster.

Real processes per topology: the Redis nodes (tests/redis_topologies.py), two fake vLLM pods, the
scraper and a `litellm --config` proxy whose `redis_url` is a `redis+sentinel://` or `redis+cluster://`
URL. Requests are routed by the scraped metrics, live settings and status work, the in-flight tables
are shared, every key sits in one Cluster slot, and a Sentinel failover is followed with no failed request.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import redis
import yaml
from procs import (
    MASTER_KEY,
    Decisions,
    Proc,
    child_env,
    debug_env,
    fake_pods,
    free_port,
    litellm_proxy,
    lora_affinity,
    proxy_config,
)
from redis_topologies import cluster_setup, sentinel_setup

SETUPS = {"sentinel": sentinel_setup, "cluster": cluster_setup}


class Stack:
    def __init__(self, kind: str, topology: dict, pods: list[int], proxy_port: int, config: Path):
        self.kind, self.topology, self.pods, self.config = kind, topology, pods, config
        self.proxy = f"http://127.0.0.1:{proxy_port}"
        self.http = httpx.Client(timeout=30, headers={"Authorization": f"Bearer {MASTER_KEY}"})

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lora_affinity_plugin.ops.cli", *args, "--config", str(self.config)],
                              capture_output=True, text=True, env=child_env(), timeout=60)

    def status(self) -> dict:
        out = self.cli("status", "--json")
        # 3: no leader or no fresh pod yet; 4: Redis unreachable (mid-failover), said on stderr
        assert out.returncode in (0, 3, 4), out.stderr
        return json.loads(out.stdout) if out.returncode in (0, 3) else {"pods": []}

    def script(self, *states: dict) -> None:
        for port, state in zip(self.pods, states):
            self.http.post(f"http://127.0.0.1:{port}/_control/metrics", json=state).raise_for_status()
            self.http.post(f"http://127.0.0.1:{port}/_control/reset").raise_for_status()

    def served(self) -> Counter:
        return Counter({"AB"[i]: len(self.http.get(f"http://127.0.0.1:{p}/_control/requests").json())
                        for i, p in enumerate(self.pods)})

    def complete(self, model: str = "sql-lora") -> httpx.Response:
        return self.http.post(self.proxy + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 5})


def _stack(kind: str, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(kind)
    pods, proxy_port = [free_port() for _ in range(2)], free_port()
    procs: list[Proc] = []
    with SETUPS[kind](tmp) as topology:
        try:
            procs.append(fake_pods(pods, tmp))
            config = proxy_config(pods, 0, scrape_interval_ms=100)
            config["lora_affinity"]["redis_url"] = topology["url"]
            path = tmp / "config.yaml"
            path.write_text(yaml.safe_dump(config))
            procs.append(lora_affinity(["scrape", "--config", str(path)], tmp, "scraper"))
            procs.append(litellm_proxy(path, proxy_port, tmp, env=debug_env()))
            stack = Stack(kind, topology, pods, proxy_port, path)
            stack.proxy_proc = procs[-1]
            yield stack
        finally:
            for proc in reversed(procs):
                proc.stop()


@pytest.fixture(scope="module")
def sentinel_stack(tmp_path_factory):
    yield from _stack("sentinel", tmp_path_factory)


@pytest.fixture(scope="module")
def cluster_stack(tmp_path_factory):
    yield from _stack("cluster", tmp_path_factory)


@pytest.fixture(params=list(SETUPS))
def stack(request):
    return request.getfixturevalue(f"{request.param}_stack")


IDLE = {"running": 1, "waiting": 0, "kv": 0.2, "running_adapters": ["tweet-summary"]}


def test_requests_are_routed_by_metrics_read_through_the_topology(stack):
    stack.script(IDLE, {**IDLE, "running_adapters": ["sql-lora"]})
    time.sleep(0.8)
    decisions = Decisions(stack.proxy_proc)
    responses = [stack.complete() for _ in range(6)]
    assert [r.status_code for r in responses] == [200] * 6, responses[0].text
    assert stack.served() == Counter({"B": 6, "A": 0})
    assert decisions.count() == 6  # the rules decided every one (B by chance would be 1 in 64)


def test_live_settings_status_and_shared_inflight_work(stack):
    changed = stack.cli("thresholds", "set", "kv_cache_threshold=0.7", "--by", "test")
    assert changed.returncode == 0, changed.stderr
    shown = json.loads(stack.cli("thresholds", "show", "--json").stdout)
    assert shown["kv_cache_threshold"] == 0.7 and shown["version"] >= 2
    status = stack.status()
    assert status["leader"] and status["proxies_sharing"] == 1
    assert [p["state"] for p in status["pods"]] == ["fresh", "fresh"]


def test_every_key_lives_in_one_cluster_slot(cluster_stack):
    stack = cluster_stack
    slots = set()
    for port in stack.topology["ports"]:
        node = redis.Redis(port=port)
        for key in node.scan_iter("*"):
            slots.add(node.cluster("keyslot", key))
    assert len(slots) == 1  # pod records, settings, audit stream, lease, in-flight tables: one hash tag


def test_a_sentinel_failover_is_followed_without_a_failed_request(sentinel_stack):
    stack = sentinel_stack
    stack.script(IDLE, {**IDLE, "running_adapters": ["sql-lora"]})
    statuses: list[int] = []
    done = threading.Event()

    def keep_sending():
        client = httpx.Client(timeout=30, headers={"Authorization": f"Bearer {MASTER_KEY}"})
        while not done.is_set():
            statuses.append(client.post(stack.proxy + "/v1/completions",
                                        json={"model": "sql-lora", "prompt": "hi", "max_tokens": 5}).status_code)
            time.sleep(0.05)

    sender = threading.Thread(target=keep_sending, daemon=True)
    sender.start()
    time.sleep(0.5)
    stack.topology["procs"]["master"].stop(signal.SIGKILL)
    killed = time.monotonic()
    promoted = None
    while time.monotonic() - killed < 20:
        if promoted is None and redis.Redis(port=stack.topology["replica"]).info("replication")["role"] == "master":
            promoted = time.monotonic() - killed
        if promoted is not None and [p["state"] for p in stack.status()["pods"]] == ["fresh", "fresh"]:
            break
        time.sleep(0.1)
    recovered = time.monotonic() - killed
    time.sleep(0.5)
    done.set()
    sender.join()
    assert promoted is not None, "the sentinel never promoted the replica"
    assert [p["state"] for p in stack.status()["pods"]] == ["fresh", "fresh"]  # the scraper writes to the new master
    assert len(statuses) > 20 and set(statuses) == {200}
    print(f"replica promoted {promoted:.1f} s after the master died, fresh records {recovered:.1f} s; "
          f"{len(statuses)} requests meanwhile, all 200")
    stack.http.post(f"http://127.0.0.1:{stack.pods[1]}/_control/reset")
    time.sleep(0.5)
    assert [stack.complete().status_code for _ in range(4)] == [200] * 4
    assert stack.served()["B"] == 4  # routing by metrics again, read from the new master
