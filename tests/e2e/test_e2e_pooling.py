"""Upstream connections through a real proxy: pooled with the plugin, one per text completion without.

Real processes: redis-server, simulated vLLM replicas (which count the TCP connections they accept),
the scraper and two `litellm --config` proxies with the plugin, one with `pooled_clients: false`.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
from procs import (
    MASTER_KEY,
    child_env,
)
from stacks import Stack

CONCURRENCY = 20
SERVER_KEEPALIVE_S = 5  # the replicas close connections idle this long (vLLM's default)
PROXY_KEEPALIVE_S = 3
"""The pooled proxy drops connections idle this long: below the server's by 2 s (a busy machine returns a
connection to the pool a while after the server's last byte, which starts the server's idle clock; with a 1 s
margin a slow machine reused a closing one), and long enough that a busy machine's stall between two requests
does not expire the pool."""
ADAPTERS = ["sql-lora", "tweet-summary"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with Stack(tmp_path_factory.mktemp("pooling")) as s:
        redis_port = s.redis()
        replicas = s.sim(2, "--speed", "5", "--warm-adapters", ",".join(ADAPTERS), "--min-output-tokens", "20",
                         "--keep-alive-s", str(SERVER_KEEPALIVE_S))
        pooled = s.config(replicas, redis_port, "pooled.yaml", models_refresh_ms=1000)
        # Its own key prefix: pooled_clients is a live setting, and the other proxy published `true`.
        unpooled = s.config(replicas, redis_port, "unpooled.yaml", pooled_clients=False, key_prefix="unpooled")
        s.scraper(pooled)
        # The pool is LiteLLM's transport: its idle timeout is LiteLLM's AIOHTTP_KEEPALIVE_TIMEOUT (below the server's).
        (pooled_proc, pooled_url), (unpooled_proc, unpooled_url) = (
            s.proxy(pooled, env=child_env(AIOHTTP_KEEPALIVE_TIMEOUT=str(PROXY_KEEPALIVE_S)), name="proxy-pooled"),
            s.proxy(unpooled, name="proxy-unpooled"))
        time.sleep(0.5)
        yield {"reads": [0], "urls": {"pooled": pooled_url, "unpooled": unpooled_url},
               "proxies": {"pooled": pooled_proc, "unpooled": unpooled_proc},
               "replicas": [f"http://127.0.0.1:{p}" for p in replicas]}


_COUNTERS = {"accepted": r"^sim_connections_accepted_total (\S+)", "idle_closed": r"^sim_connections_idle_closed_total (\S+)",
             "open": r"^sim_connections_open (\S+)", "peak": r"^sim_requests_in_flight_peak (\S+)",
             "aborted": r'finished_reason="abort"[^}]*\} (\S+)'}


def replica_counters(stack) -> list[dict[str, int]]:
    """Per replica; "accepted" leaves out the readings' own connections (one each, closed by the reader)."""
    pages = [httpx.get(url + "/metrics", headers={"Connection": "close"}).text for url in stack["replicas"]]
    stack["reads"][0] += 1
    counters = [{key: int(float(re.search(pattern, page, re.M).group(1))) for key, pattern in _COUNTERS.items()}
                for page in pages]
    for c in counters:
        c["accepted"] -= stack["reads"][0]
    return counters


def sim_counters(stack) -> dict[str, int]:
    """Summed over the replicas."""
    per_replica = replica_counters(stack)
    return {key: sum(r[key] for r in per_replica) for key in _COUNTERS}


async def _load(url: str, requests: int, *, stream_share: float = 0.0, abandon_share: float = 0.0) -> dict[str, int]:
    """Text completions, CONCURRENCY at a time; a share streamed, a share of those hung up after 2 chunks."""
    outcome = {"completed": 0, "abandoned": 0, "bad": 0}
    headers = {"Authorization": f"Bearer {MASTER_KEY}"}
    semaphore = asyncio.Semaphore(CONCURRENCY)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        stream = i < requests * stream_share
        abandon = stream and i < requests * abandon_share
        # A stream to hang up on asks for a long generation: still running upstream when the proxy reads the
        # hang-up, however slowly a busy machine relays (a finished generation has nothing left to abort).
        body = {"model": ADAPTERS[i % 2], "prompt": "Is the Necronomicon in it?", "max_tokens": 3000 if abandon else 30,
                "stream": stream, **({"ignore_eos": True} if abandon else {})}
        async with semaphore:
            if not stream:
                response = await client.post(url + "/v1/completions", json=body, headers=headers)
                ok = response.status_code == 200 and response.json()["usage"]["completion_tokens"] > 0
                outcome["completed" if ok else "bad"] += 1
                return
            async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as response:
                chunks, done = 0, False
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
                    done = done or line == "data: [DONE]"
                    if abandon and chunks == 2:
                        break
            if abandon:
                outcome["abandoned"] += 1
            else:
                outcome["completed" if response.status_code == 200 and done else "bad"] += 1

    # One client connection per request: the proxy, not this client, must do the pooling.
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        await asyncio.gather(*(one(client, i) for i in range(requests)))
    return outcome


def unclosed_sessions(stack, name: str) -> int:
    return stack["proxies"][name].log().count("Unclosed client session")


def test_the_plugin_pools_text_completions_to_each_pod(stack):
    before = replica_counters(stack)
    outcome = asyncio.run(_load(stack["urls"]["pooled"], 150, stream_share=0.5))
    after = replica_counters(stack)
    assert outcome == {"completed": 150, "abandoned": 0, "bad": 0}
    for b, a in zip(before, after):
        opened, idle_closed = a["accepted"] - b["accepted"], a["idle_closed"] - b["idle_closed"]
        # A pooled proxy holds a connection to a pod per request it is relaying to that pod, and the client
        # sends CONCURRENCY at a time: so no pod sees more connections than that (plus any it closed when
        # idle), however late a loaded machine returns them to the pool. Unpooled, each request opens one.
        assert opened <= CONCURRENCY + idle_closed, (opened, a["peak"], idle_closed)
    assert sum(a["accepted"] - b["accepted"] for b, a in zip(before, after)) < 150 / 3  # unpooled: 150
    assert unclosed_sessions(stack, "pooled") == 0


def test_without_pooled_clients_litellm_opens_a_connection_per_text_completion(stack):
    """The root cause, kept honest: if a LiteLLM release fixes it, this test says so."""
    before = sim_counters(stack)
    outcome = asyncio.run(_load(stack["urls"]["unpooled"], 100))
    after = sim_counters(stack)
    assert outcome["completed"] == 100
    assert after["accepted"] - before["accepted"] >= 90


ROUND, HUNG_UP = 60, 12
"""A round of streams, and how many of them the client hangs up: on LiteLLM 1.110 rounds this size left some hung-up
text completions generating upstream until the plugin closed their engine streams itself (bench-tools/hangups.py)."""


def test_abandoned_streams_are_aborted_upstream_and_leak_no_connection(stack):
    """Three rounds back to back, then one wait for the hang-ups: a wait between rounds longer than the
    pool's idle expiry (PROXY_KEEPALIVE_S; a loaded machine relays hang-ups seconds late) would empty the
    pool and make the next round's fresh connections look like a leak."""
    before = sim_counters(stack)
    accepted = []
    for _ in range(3):
        outcome = asyncio.run(_load(stack["urls"]["pooled"], ROUND, stream_share=1.0, abandon_share=HUNG_UP / ROUND))
        assert outcome == {"completed": ROUND - HUNG_UP, "abandoned": HUNG_UP, "bad": 0}
        accepted.append(sim_counters(stack)["accepted"])
    deadline = time.monotonic() + 60  # a loaded machine relays the hang-ups late; a quiet one in well under 1 s
    while time.monotonic() < deadline:
        after = sim_counters(stack)
        if after["aborted"] - before["aborted"] >= 3 * HUNG_UP:
            break
        time.sleep(0.1)
    # Every hang-up stopped its generation upstream, and nothing else was aborted.
    assert after["aborted"] - before["aborted"] == 3 * HUNG_UP
    # No leak: once the hang-ups are relayed, the connections open stay within the concurrency (an
    # aborted stream's connection is closed, never returned mid-response; the others are reused).
    assert after["open"] <= before["open"] + CONCURRENCY + 2, (before["open"], after["open"])
    # Later rounds open new connections only for hung-up streams and for returns that overlap new requests,
    # which in-flight requests bound at CONCURRENCY a round (a round at half speed overlapped ~10 of them).
    # Unpooled, a request opens one: 2 * ROUND for these two rounds.
    assert accepted[-1] - accepted[0] <= 2 * (HUNG_UP + CONCURRENCY), accepted
    assert unclosed_sessions(stack, "pooled") == 0


def test_idle_pooled_connections_are_not_reused_after_the_servers_keep_alive(stack):
    """A pool that reuses a connection idle longer than the server keeps it sometimes writes a request to
    a connection the server is closing, and that request fails. The plugin's pool, on LiteLLM's transport,
    drops a connection idle longer than AIOHTTP_KEEPALIVE_TIMEOUT (3 s here, the server's 5 s)."""
    rounds = []
    for i in range(2):
        if i:
            time.sleep(SERVER_KEEPALIVE_S + 0.5)
        before = sim_counters(stack)
        outcome = asyncio.run(_load(stack["urls"]["pooled"], 40, stream_share=0.5))
        assert outcome == {"completed": 40, "abandoned": 0, "bad": 0}
        rounds.append(sim_counters(stack)["accepted"] - before["accepted"])
    assert all(opened > 0 for opened in rounds[1:]), rounds  # after the idle gap: fresh connections


def test_a_streaming_chat_to_a_hugging_face_style_name_is_fast_offline(stack):
    """With HF_HUB_OFFLINE=1 (deploy/Dockerfile, child_env) LiteLLM does not wait for a tokenizer download."""
    started = time.monotonic()
    with httpx.stream("POST", stack["urls"]["pooled"] + "/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {MASTER_KEY}"},
                      json={"model": "meta-llama/Llama-2-7b-hf", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 5, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert response.status_code == 200 and lines[-1] == "data: [DONE]"
    assert time.monotonic() - started < 5


def test_the_proxys_model_list_shows_what_the_fleet_serves(stack):
    """Wildcard deployments list nothing in LiteLLM; the plugin adds the pods' own /v1/models."""
    import openai

    client = openai.OpenAI(base_url=stack["urls"]["pooled"] + "/v1", api_key=MASTER_KEY, max_retries=0)
    deadline, ids = time.monotonic() + 10, set()
    while time.monotonic() < deadline:
        ids = {m.id for m in client.models.list()}
        if {"sql-lora", "tweet-summary"} <= ids:
            break
        time.sleep(0.5)
    assert {"meta-llama/Llama-2-7b-hf", "sql-lora", "tweet-summary"} <= ids
    raw = httpx.get(stack["urls"]["pooled"] + "/models", headers={"Authorization": f"Bearer {MASTER_KEY}"}).json()
    assert len([m for m in raw["data"] if m["id"] == "sql-lora"]) == 1  # once, however many pods serve it
    # LiteLLM's auth still comes first (it answers 500 here: its auth error path imports `prisma`).
    refused = httpx.get(stack["urls"]["pooled"] + "/v1/models")
    assert refused.status_code != 200 and "sql-lora" not in refused.text
