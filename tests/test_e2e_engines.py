"""A mixed fleet: vLLM pods and an SGLang pod in one model group, routed by the same rules.

Real processes: redis-server, simulated replicas (one serving /metrics in SGLang's names), the scraper
and a `litellm --config` proxy. SGLang names no adapters: what the plugin sent there stands in.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml
from procs import (
    MASTER_KEY,
    Decisions,
    Proc,
    debug_env,
    free_port,
    free_port_range,
    litellm_proxy,
    lora_affinity,
    proxy_config,
    redis_server,
    wait_port,
)

ADAPTERS = ["sql-lora", "tweet-summary", "chat-lora"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engines")
    base = free_port_range(3)
    redis_port, proxy_port = (next(p for p in iter(free_port, None) if not base <= p < base + 3) for _ in range(2))
    procs: list[Proc] = []
    store = redis_server(redis_port, tmp)
    try:
        procs.append(Proc("sim", [sys.executable, "-m", "lora_affinity_plugin.cli", "sim", "--replicas", "3",
                                  "--base-port", str(base), "--speed", "20", "--sglang-replicas", "2"], tmp))
        pods = [base, base + 1, base + 2]
        for p in pods:
            wait_port(p)
        config = proxy_config(pods, redis_port)
        config["model_list"][2]["model_info"] = {"engine": "sglang"}
        path = tmp / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        procs.append(lora_affinity(["scrape", "--config", str(path)], tmp, "scraper"))
        procs.append(litellm_proxy(path, proxy_port, tmp, env=debug_env()))
        time.sleep(0.5)
        yield {"proxy": f"http://127.0.0.1:{proxy_port}", "pods": [f"http://127.0.0.1:{p}" for p in pods],
               "config": path, "proxy_proc": procs[-1]}
    finally:
        for proc in reversed(procs):
            proc.stop()
        store.stop()


def test_status_shows_each_pods_engine_and_all_are_fresh(stack):
    out = subprocess.run([sys.executable, "-m", "lora_affinity_plugin.cli", "status", "--config", str(stack["config"]),
                          "--json"], capture_output=True, text=True, check=True).stdout
    rows = {r["pod"]: r for r in json.loads(out)["pods"]}
    assert [rows[p]["engine"] for p in stack["pods"]] == ["vllm", "vllm", "sglang"]
    assert all(rows[p]["state"] == "fresh" for p in stack["pods"])
    assert rows[stack["pods"][2]]["max_lora"] == 4  # SGLang's lora_pool_slots_total


def _send(client: httpx.Client, stack, adapter: str) -> str:
    response = client.post(stack["proxy"] + "/v1/completions", headers={"Authorization": f"Bearer {MASTER_KEY}"},
                           json={"model": adapter, "prompt": "hi", "max_tokens": 4})
    assert response.status_code == 200, response.text
    return response.headers["x-litellm-model-api-base"].rstrip("/").removesuffix("/v1")


def test_each_adapter_sticks_to_one_pod_across_the_mixed_fleet(stack):
    served: dict[str, Counter] = defaultdict(Counter)
    decisions = Decisions(stack["proxy_proc"])
    with httpx.Client(timeout=30) as client, ThreadPoolExecutor(3) as pool:
        # Three new adapters at once: each decision counts the ones before it (fewest adapters), so they
        # land on three pods, the SGLang one included.
        for adapter, pod in zip(ADAPTERS, pool.map(lambda a: _send(client, stack, a), ADAPTERS)):
            served[adapter][pod] += 1
        for i in range(33):
            adapter = ADAPTERS[i % 3]
            served[adapter][_send(client, stack, adapter)] += 1
            time.sleep(0.05)
    homes = {adapter: pods.most_common(1)[0] for adapter, pods in served.items()}
    assert all(count >= 10 for _, count in homes.values()), served  # of 12: affinity holds on either server
    assert {pod for pod, _ in homes.values()} == set(stack["pods"]), served
    assert decisions.count() == 36  # every request a decision of the rules, none LiteLLM's pick
