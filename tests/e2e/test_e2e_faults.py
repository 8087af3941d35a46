"""Faults survived with real processes: Redis restarted under load, a replica killed and brought back."""

from __future__ import annotations

import asyncio
import re
import sys
import time
from datetime import datetime

import httpx
import pytest
import yaml
from procs import (
    MASTER_KEY,
    Proc,
    child_env,
    free_port,
    litellm_proxy,
    lora_affinity,
    redis_server,
    wait_port,
)

from lora_affinity_lab.processes import proxy_config

INTERVAL_MS = 200
TTL_S = 2


def sim(port: int, tmp) -> Proc:
    return Proc(f"sim-{port}", [sys.executable, "-m", "lora_affinity_plugin.ops.cli", "sim", "--replicas", "1",
                                "--base-port", str(port), "--speed", "20"], tmp)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    redis_port, proxy_port = free_port(), free_port()
    ports = [free_port() for _ in range(3)]
    sims = {p: sim(p, tmp) for p in ports}
    state = {"redis": redis_server(redis_port, tmp)}
    procs = []
    try:
        for p in ports:
            wait_port(p)
        config = proxy_config(ports, redis_port, scrape_interval_ms=INTERVAL_MS, stale_after_ms=300,
                              metrics_ttl_ms=TTL_S * 1000, scrape_timeout_ms=200)
        config["router_settings"]["num_retries"] = 2
        path = tmp / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        procs.append(lora_affinity(["scrape", "--config", str(path)], tmp, "scraper"))
        state["scraper_proc"] = procs[-1]
        procs.append(litellm_proxy(path, proxy_port, tmp, env=child_env(LORA_AFFINITY_LOG_LEVEL="DEBUG")))
        state.update({"tmp": tmp, "redis_port": redis_port, "proxy": f"http://127.0.0.1:{proxy_port}",
                      "ports": ports, "sims": sims, "proxy_proc": procs[-1]})
        time.sleep(0.5)
        yield state
    finally:
        for proc in reversed(procs):
            proc.stop()
        for proc in state["sims"].values():
            proc.stop()
        state["redis"].stop()


async def load(url: str, n: int, concurrency: int = 16, adapters: str = "adapter",
               until: asyncio.Event | None = None) -> list[int]:
    """`n` requests, `concurrency` at a time; with `until`, only until it is set."""
    statuses: list[int] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty() and not (until and until.is_set()):
            i = queue.get_nowait()
            r = await client.post(url + "/v1/completions", headers={"Authorization": f"Bearer {MASTER_KEY}"},
                                  json={"model": f"{adapters}-{i % 6}", "prompt": "x", "max_tokens": 8})
            statuses.append(r.status_code)

    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return statuses


def stamp(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def log_times(log: str, needle: str) -> list[float]:
    return [stamp(line) for line in log.splitlines() if needle in line]


def test_redis_restart_under_load_fails_no_request(stack):
    async def scenario():
        over = asyncio.Event()
        task = asyncio.create_task(load(stack["proxy"], 10_000, until=over))
        await asyncio.sleep(3)
        stack["redis"].stop()
        stack["stopped_at"] = time.time()
        await asyncio.sleep(TTL_S + 1.0)  # past metrics_ttl_ms: last snapshot, then shuffle
        stack["redis"] = redis_server(stack["redis_port"], stack["tmp"])
        stack["restarted_at"] = time.time()
        await asyncio.sleep(2.0)  # the load goes on past the recovery (within two refreshes of it, below)
        over.set()
        return await task

    statuses = asyncio.run(scenario())
    assert len(statuses) >= 100 and set(statuses) == {200}
    log = stack["proxy_proc"].log()
    assert log.count("cannot read pod metrics from Redis") == 2  # one line when it went, one when it came back
    during = [t for t in log_times(log, "LiteLLM's own pick decides: no fresh metrics")
              if stack["stopped_at"] <= t <= stack["restarted_at"]]
    assert len(during) == 1  # one line for the whole outage, not one per request
    recovered = [t for t in log_times(log, "LiteLLM's own pick decides: recovered") if t > stack["stopped_at"]]
    # Routing by metrics needs both ends back: this proxy reading Redis (its second "cannot read" line) and the
    # scraper writing to it (its "cannot write ...: recovered" line). Each reconnects on its own, as slowly as a
    # loaded machine makes it; from the later of the two, the proxy's next refresh routes by metrics again.
    readable_at = log_times(log, "cannot read pod metrics from Redis")[-1]
    written_at = [t for t in log_times(stack["scraper_proc"].log(), "cannot write to Redis; metrics will age: recovered")
                  if t > stack["stopped_at"]]
    assert written_at, "the scraper never wrote to Redis again"
    both_back_at = max(readable_at, written_at[0])
    assert recovered and recovered[0] - both_back_at < 2 * INTERVAL_MS / 1000 + 0.15, (
        recovered[:1], readable_at, written_at[0], stack["restarted_at"])


def test_a_killed_replica_gets_no_new_requests_and_is_used_again_when_back(stack):
    victim = stack["ports"][0]
    pod = f"http://127.0.0.1:{victim}"
    stack["sims"][victim].stop()
    killed_at = time.time()
    statuses = asyncio.run(load(stack["proxy"], 150))
    assert set(statuses) == {200}  # the other replicas absorb its load (LiteLLM retries the few in flight)
    lines = [line for line in stack["proxy_proc"].log().splitlines() if line.startswith("20")]
    picks = [i for i, line in enumerate(lines) if f"-> {pod} " in line and stamp(line) > killed_at]
    refused = [i for i, line in enumerate(lines) if f"{pod} refused a connection" in line]
    assert picks == [] or refused, "requests reached the dead replica and none was seen refused"
    if refused:  # out at its first refused connection, or earlier (a scrape saw it down first)
        assert not [i for i in picks if i > refused[0]], "the dead replica still got requests after it refused one"
    # And in any case well before its last metrics expire (metrics_ttl_ms): the scraper's failed page does it.
    late = [stamp(lines[i]) for i in picks if stamp(lines[i]) > killed_at + 1.0]
    assert late == [], "the dead replica still got requests a second after it died"

    stack["sims"][victim] = sim(victim, stack["tmp"])
    wait_port(victim)
    time.sleep(0.5)
    back_at = time.time()
    # Adapters new to the fleet: the others hold six already, so the emptiest replica takes some of these.
    asyncio.run(load(stack["proxy"], 150, adapters="after-restart"))
    used = [t for t in log_times(stack["proxy_proc"].log(), f"-> {pod} ") if t > back_at]
    assert used, "the replica was not used again after it came back"
    page = httpx.get(pod + "/metrics").text
    served = sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)", page, re.M))
    assert served > 0
