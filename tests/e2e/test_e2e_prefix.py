"""Routing for KV reuse end to end: real redis-server, simulated replicas with prefix caching, the
scraper and two `litellm --config` proxies sharing one index through Redis.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest
from procs import (
    MASTER_KEY,
    Decisions,
    debug_env,
)
from stacks import Stack

HEADERS = {"Authorization": f"Bearer {MASTER_KEY}"}


def system_prompt(topic: str) -> str:
    return f"You are the {topic} assistant. " + " ".join(f"{topic} rule {i}: answer briefly." for i in range(150))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with Stack(tmp_path_factory.mktemp("prefix")) as s:
        redis_port = s.redis()
        pods = s.sim(3, "--speed", "20", "--warm-adapters", "sql-lora,tweet-summary")
        path = s.config(pods, redis_port)
        s.scraper(path)
        (proxy_a, a), (proxy_b, b) = s.proxies(path, ["proxy-a", "proxy-b"], [debug_env()] * 2)
        time.sleep(0.5)
        yield {"a": a, "b": b, "pods": [f"http://127.0.0.1:{p}" for p in pods], "config": path,
               "proxies": [proxy_a, proxy_b]}


def chat(client: httpx.Client, proxy: str, model: str, system: str, question: str, max_tokens: int = 4) -> str:
    """One chat completion through a proxy; returns the pod it was served by."""
    body = {"model": model, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    response = client.post(proxy + "/v1/chat/completions", headers=HEADERS, json=body)
    assert response.status_code == 200, response.text
    return response.headers["x-litellm-model-api-base"].rstrip("/").removesuffix("/v1")


def hits(pod: str) -> float:
    page = httpx.get(pod + "/metrics", timeout=5).text
    return float(re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)", page, re.M).group(1))


def test_requests_sharing_a_long_system_prompt_land_on_one_pod_and_hit(stack):
    system = system_prompt("billing")
    before = {pod: hits(pod) for pod in stack["pods"]}
    decisions = Decisions(*stack["proxies"])
    with httpx.Client(timeout=30) as client:
        served = [chat(client, stack["a"], "sql-lora", system, f"question {i}?") for i in range(6)]
    assert len(set(served)) == 1, served
    assert decisions.count() == 6  # the rules decided each one, not LiteLLM's pick
    gained = hits(served[0]) - before[served[0]]
    assert gained >= 5 * 0.9 * len(system) / 3  # five repeats of the system prompt hit (3 bytes a simulated token)


def test_a_second_proxy_follows_the_first_ones_entries(stack):
    system = system_prompt("travel")
    decisions = Decisions(*stack["proxies"])
    with httpx.Client(timeout=30) as client:
        first = chat(client, stack["a"], "meta-llama/Llama-2-7b-hf", system, "where to?")
        time.sleep(0.6)  # a few refreshes of both proxies (100 ms)
        followers = [chat(client, stack["b"], "meta-llama/Llama-2-7b-hf", system, f"and then {i}?") for i in range(4)]
    assert set(followers) == {first}
    assert decisions.count() == 5


def test_a_far_busier_pod_holding_the_prefix_is_passed_over_and_explain_shows_the_match(stack):
    system = system_prompt("weather")
    with httpx.Client(timeout=30) as client:
        holder = chat(client, stack["a"], "tweet-summary", system, "rain?")
        # Load the holder directly (not through the proxies) with more long prompts than its KV cache
        # holds: most of them queue (a busy batch alone is no reason to pass a pod over; a queue is).

        def hog(i: int) -> None:
            with httpx.Client(timeout=60) as direct:
                try:  # distinct prompts: identical ones would share their cached blocks
                    direct.post(holder + "/v1/completions", json={"model": "tweet-summary", "max_tokens": 2000,
                                                                   "prompt": f"{i} " + "y " * 3000})
                except httpx.HTTPError:
                    pass

        hogs = [threading.Thread(target=hog, args=(i,), daemon=True) for i in range(40)]
        for t in hogs:
            t.start()
        time.sleep(0.8)  # the scraper sees the holder's new load; the proxies read it
        out = subprocess.run([sys.executable, "-m", "lora_affinity_plugin.ops.cli", "explain", "--config",
                              str(stack["config"]), "--model", "tweet-summary", "--messages", "/dev/stdin", "--json"],
                             input=json.dumps([{"role": "system", "content": system}, {"role": "user", "content": "snow?"}]),
                             capture_output=True, text=True, check=True).stdout
        explained = json.loads(out)
        assert explained["prefix_matches"][holder] >= 10  # the holder still holds the system prompt
        assert explained["pick"] != holder
        costs = explained["costs"]  # each candidate's estimate, part by part
        assert set(costs) == set(explained["candidates"])
        assert costs[holder]["uncached_tokens"] < costs[explained["pick"]]["uncached_tokens"]
        assert costs[holder]["wait_s"] > costs[explained["pick"]]["wait_s"]
        assert explained["rates"][holder]["learned"]  # the scraper learned the busy pod's speeds from its histograms
        decisions = Decisions(*stack["proxies"])
        elsewhere = chat(client, stack["a"], "tweet-summary", system, "snow?")
    assert elsewhere != holder and decisions.count() == 1


def test_status_shows_each_pods_index_size(stack):
    out = subprocess.run([sys.executable, "-m", "lora_affinity_plugin.ops.cli", "status", "--config", str(stack["config"]),
                          "--json"], capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)["pods"]
    assert sum(r["prefix_blocks"] for r in rows) >= 20


def learned_ratios(proxy) -> list[tuple[str, str]]:
    return re.findall(r"pod (\S+): ([0-9.]+) characters a token, learned", proxy.log())


def send_documents(url: str, count: int, **extra) -> None:
    """`count` prompts of about 3 KB each, each its own, through the proxy at `url`."""
    with httpx.Client(timeout=60) as client:
        for i in range(count):
            text = f"Document {i} for {url}. " + " ".join(f"clause {i}.{j} says what it says." for j in range(90))
            body = {"model": "tweet-summary", "max_tokens": 2, "messages": [{"role": "user", "content": text}], **extra}
            response = client.post(url + "/v1/chat/completions", headers=HEADERS, json=body)
            assert response.status_code == 200, response.text


def test_a_proxy_learns_each_pods_characters_a_token_from_the_engines_answers(stack):
    """The simulated engines count 3 bytes of the rendered chat a token; the plugin starts at 4 and learns the
    engines' ratio from `usage.prompt_tokens`: of plain answers (proxy a), and of streams that asked the engine for
    usage (proxy b; LiteLLM 1.110 asks it for every stream, to count spend)."""
    proxy_a, proxy_b = stack["proxies"]
    send_documents(stack["a"], 36)
    send_documents(stack["b"], 36, stream=True, stream_options={"include_usage": True})
    for proxy in (proxy_a, proxy_b):
        deadline = time.monotonic() + 10
        while not (learned := learned_ratios(proxy)):
            assert time.monotonic() < deadline, proxy.log()[-3000:]
            time.sleep(0.2)
        assert {pod for pod, _ in learned} <= set(stack["pods"])
        for _, ratio in learned:
            assert 2.8 <= float(ratio) <= 3.2, learned  # the engines' 3, not the settings' 4
    # `explain` runs apart from the proxies, so it counts at the settings' ratio unless given the learned one.
    system = system_prompt("tokens")

    def explained(*extra: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "lora_affinity_plugin.ops.cli", "explain", "--config",
                              str(stack["config"]), "--model", "tweet-summary", "--messages", "/dev/stdin", "--json",
                              *extra], input=json.dumps([{"role": "system", "content": system}]),
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)

    at_settings, at_learned = explained(), explained("--chars-per-token", learned[0][1])
    assert at_settings["chars_per_token"] == 4.0 and at_learned["chars_per_token"] == float(learned[0][1])
    pod = at_settings["candidates"][0]
    tokens = at_settings["costs"][pod]["uncached_tokens"], at_learned["costs"][pod]["uncached_tokens"]
    assert abs(tokens[1] / tokens[0] - 4.0 / float(learned[0][1])) < 0.02, tokens
