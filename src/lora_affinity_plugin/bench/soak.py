"""`lora-affinity bench --scenario soak --minutes N`: steady Poisson load with faults on a schedule.

Real processes: redis-server, 3 simulated replicas (one process each, so one can be killed), the
scraper and a proxy with the plugin. Every quarter of the run a fault is injected: Redis restarted,
a replica killed and brought back, a client hanging up mid-stream. At the end it reports request errors,
the proxy's and the scraper's memory growth, work left on the replicas, and the proxy's requests in
flight as its peers see them in Redis (a leak would show in either; both must be back to zero).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import time
from pathlib import Path

import httpx
import redis
import yaml

from ..inflight import read_shared
from ..processes import (
    MASTER_KEY,
    Proc,
    free_port,
    litellm_proxy,
    proxy_config,
    redis_server,
    scratch_dir,
    wait_port,
)


def _rss_mb(proc: Proc) -> float:
    try:
        status = Path(f"/proc/{proc.popen.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024
    except (OSError, AttributeError):
        return float("nan")


def _sim(port: int, workdir: Path) -> Proc:
    return Proc(f"sim-{port}", [sys.executable, "-m", "lora_affinity_plugin.cli", "sim", "--replicas", "1",
                                "--base-port", str(port), "--speed", "20"], workdir)


def _inflight_after(redis_port: int, within_s: float = 5.0) -> tuple[int, int]:
    """(processes sharing, requests in flight) once the load is over (the proxy publishes every refresh)."""
    client = redis.Redis(port=redis_port)
    deadline = time.monotonic() + within_s
    while True:
        processes, counts = read_shared(client, "lora_affinity")
        total = sum(counts.values())
        if (processes and total == 0) or time.monotonic() > deadline:
            return processes, total
        time.sleep(0.1)


def _left_on_replicas(ports: list[int]) -> int:
    total = 0
    for port in ports:
        page = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        total += sum(int(float(v)) for v in re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)", page, re.M))
    return total


async def _client(url: str, rate: float, until: float, rng: random.Random, counts: dict) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        async def one(i: int) -> None:
            body = {"model": f"adapter-{rng.randrange(8)}", "prompt": "x", "max_tokens": 24}
            headers = {"Authorization": f"Bearer {MASTER_KEY}"}
            try:
                if i % 5 == 0:  # a streaming client that hangs up after the first chunk
                    async with client.stream("POST", url + "/v1/completions", headers=headers,
                                             json={**body, "stream": True}) as resp:
                        async for _ in resp.aiter_lines():
                            break
                    counts["ok" if resp.status_code == 200 else "errors"] += 1
                else:
                    resp = await client.post(url + "/v1/completions", headers=headers, json=body)
                    counts["ok" if resp.status_code == 200 else "errors"] += 1
            except httpx.HTTPError:
                counts["errors"] += 1

        tasks, i = [], 0
        while time.monotonic() < until:
            tasks.append(asyncio.create_task(one(i)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)


def run_soak(args: argparse.Namespace) -> int:
    minutes = args.minutes
    workdir = scratch_dir("lora-affinity-soak-")
    redis_port, proxy_port = free_port(), free_port()
    ports = [free_port() for _ in range(3)]
    sims = {p: _sim(p, workdir) for p in ports}
    store = {"redis": redis_server(redis_port, workdir, allow_embedded=True)}
    procs: list[Proc] = []
    try:
        for p in ports:
            wait_port(p)
        config = proxy_config(ports, redis_port, scrape_interval_ms=100, stale_after_ms=500, metrics_ttl_ms=2000)
        config["router_settings"]["num_retries"] = 2
        path = workdir / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        scraper = Proc("scraper", [sys.executable, "-m", "lora_affinity_plugin.cli", "scrape", "--config", str(path)],
                       workdir)
        proxy = litellm_proxy(path, proxy_port, workdir)
        procs += [scraper, proxy]
        time.sleep(1)
        rss_start = {"proxy": _rss_mb(proxy), "scraper": _rss_mb(scraper)}
        counts = {"ok": 0, "errors": 0}
        duration = minutes * 60
        faults: list[str] = []

        async def schedule(start: float) -> None:
            quarter = duration / 4
            await asyncio.sleep(quarter)
            store["redis"].stop()
            await asyncio.sleep(min(3.0, quarter / 3))
            store["redis"] = redis_server(redis_port, workdir, allow_embedded=True)
            faults.append(f"{time.monotonic() - start:6.1f}s Redis restarted")
            await asyncio.sleep(quarter)
            victim = ports[0]
            sims[victim].stop()
            await asyncio.sleep(min(3.0, quarter / 3))
            sims[victim] = _sim(victim, workdir)
            faults.append(f"{time.monotonic() - start:6.1f}s replica {victim} killed and restarted")

        async def main() -> None:
            start = time.monotonic()
            await asyncio.gather(_client(f"http://127.0.0.1:{proxy_port}", (args.rate or 20.0), start + duration,
                                         random.Random(args.seed), counts), schedule(start))

        print(f"soak: {minutes:g} min of Poisson load at {(args.rate or 20.0):g} req/s with faults; logs in {workdir}")
        asyncio.run(main())
        time.sleep(1)
        rss_end = {"proxy": _rss_mb(proxy), "scraper": _rss_mb(scraper)}
        left = _left_on_replicas(ports)
        sharing, inflight = _inflight_after(redis_port)
        for line in faults:
            print(f"  fault at {line}")
        total = counts["ok"] + counts["errors"]
        print(f"requests {total}, errors {counts['errors']}")
        for name in ("proxy", "scraper"):
            print(f"{name} memory {rss_start[name]:.0f} MB -> {rss_end[name]:.0f} MB "
                  f"({rss_end[name] - rss_start[name]:+.0f} MB)")
        print(f"left running or waiting on the replicas after the load: {left}")
        print(f"in flight in the proxy after the load (shared in Redis by {sharing} process): {inflight}")
        return 0 if counts["errors"] == 0 and left == 0 and sharing and inflight == 0 else 1
    finally:
        for proc in reversed(procs):
            proc.stop()
        for proc in sims.values():
            proc.stop()
        store["redis"].stop()
