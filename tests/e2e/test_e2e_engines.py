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
from procs import (
    MASTER_KEY,
    Decisions,
    debug_env,
)
from stacks import Stack

ADAPTERS = ["sql-lora", "tweet-summary", "chat-lora"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with Stack(tmp_path_factory.mktemp("engines")) as s:
        redis_port = s.redis()
        pods = s.sim(3, "--speed", "20", "--sglang-replicas", "2")
        path = s.config(pods, redis_port, edit=lambda c: c["model_list"][2].update(model_info={"engine": "sglang"}))
        s.scraper(path)
        proxy, url = s.proxy(path, env=debug_env())
        time.sleep(0.5)
        yield {"proxy": url, "pods": [f"http://127.0.0.1:{p}" for p in pods], "config": path, "proxy_proc": proxy}


def test_status_shows_each_pods_engine_and_all_are_fresh(stack):
    out = subprocess.run([sys.executable, "-m", "lora_affinity_plugin.ops.cli", "status", "--config", str(stack["config"]),
                          "--json"], capture_output=True, text=True, check=True).stdout
    rows = {r["pod"]: r for r in json.loads(out)["pods"]}
    assert [rows[p]["engine"] for p in stack["pods"]] == ["vllm", "vllm", "sglang"]
    assert all(rows[p]["state"] == "fresh" for p in stack["pods"])
    assert rows[stack["pods"][2]]["max_lora"] == 4  # SGLang's lora_pool_slots_total


def _send(client: httpx.Client, stack, adapter: str) -> str:
    # 100 tokens, about 0.3 s at 20x: a scrape sees the adapter running on a vLLM pod. A request that ends between
    # two scrapes (4 tokens: 10 ms) is never seen there, and on a loaded machine the plugin then forgets it once
    # the next scrape is newer than the dispatch, while the SGLang pod stands in with what was sent to it.
    response = client.post(stack["proxy"] + "/v1/completions", headers={"Authorization": f"Bearer {MASTER_KEY}"},
                           json={"model": adapter, "prompt": "hi", "max_tokens": 100})
    assert response.status_code == 200, response.text
    return response.headers["x-litellm-model-api-base"].rstrip("/").removesuffix("/v1")


def test_each_adapter_sticks_to_one_pod_across_the_mixed_fleet(stack):
    served: dict[str, Counter] = defaultdict(Counter)
    decisions = Decisions(stack["proxy_proc"])
    with httpx.Client(timeout=30) as client, ThreadPoolExecutor(3) as pool:
        # Three new adapters at once: each decision counts the ones before it (dispatches since the scrape).
        for adapter, pod in zip(ADAPTERS, pool.map(lambda a: _send(client, stack, a), ADAPTERS)):
            served[adapter][pod] += 1
        for i in range(33):
            adapter = ADAPTERS[i % 3]
            served[adapter][_send(client, stack, adapter)] += 1
            time.sleep(0.05)
    homes = {adapter: pods.most_common(1)[0] for adapter, pods in served.items()}
    assert all(count >= 10 for _, count in homes.values()), served  # of 12: affinity holds on either server
    assert decisions.count() == 36  # every request a decision of the rules, none LiteLLM's pick
