"""Whether every client that hangs up mid-stream stops its generation upstream, through real proxies under load.

Starts Redis, two simulated replicas, the scraper and three `litellm --config` proxies on this venv's LiteLLM:
LiteLLM alone (`simple-shuffle`), the plugin with its pooled clients, and the plugin with `pooled_clients: false`
(LiteLLM's own client). Each takes rounds of streamed text completions (chats with `--chat`), CONCURRENCY at a
time, the first `--hang-up` of each round asking for a long generation and hung up after two chunks (as
tests/e2e/test_e2e_pooling.py does); then the replicas' `finished_reason="abort"` count is read until every
hang-up is there or `--wait` seconds pass. A hang-up missing after the wait is a generation still running that
long after it, for no one. Prints, per proxy and try, the hang-ups and the aborts the replicas counted.

    .venv/bin/python bench-tools/hangups.py [--tries 3] [--rounds 3] [--streams 60] [--hang-up 12] [--chat]
    .venv-1108/bin/python bench-tools/hangups.py     # the same on another LiteLLM release
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import sys
import time
from importlib.metadata import version

import httpx
import yaml
from lora_affinity_lab.processes import (
    MASTER_KEY,
    Proc,
    free_port,
    free_port_range,
    litellm_proxy,
    lora_affinity,
    proxy_config,
    redis_server,
    scratch_dir,
    wait_port,
)

CONCURRENCY = 20
ADAPTERS = ["sql-lora", "tweet-summary"]
ABORTED = re.compile(r'finished_reason="abort"[^}]*\} (\S+)')


def aborted(replicas: list[int]) -> int:
    """The aborts every replica counted (one series a replica: its base model's)."""
    total = 0
    for port in replicas:
        page = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Connection": "close"}).text
        total += sum(int(float(v)) for v in ABORTED.findall(page))
    return total


async def one_round(url: str, streams: int, hang_up: int, chat: bool = False) -> int:
    """`streams` streamed completions (chats with `chat`), the first `hang_up` hung up after two chunks; returns
    the failures."""
    semaphore, failed = asyncio.Semaphore(CONCURRENCY), 0

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal failed
        abandon = i < hang_up
        question = "Is the Necronomicon in it?"
        body = {"model": ADAPTERS[i % 2], "stream": True, "max_tokens": 3000 if abandon else 30,
                **({"messages": [{"role": "user", "content": question}]} if chat else {"prompt": question}),
                **({"ignore_eos": True} if abandon else {})}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        async with semaphore, client.stream("POST", url + path, json=body,
                                            headers={"Authorization": f"Bearer {MASTER_KEY}"}) as response:
            chunks = 0
            async for line in response.aiter_lines():
                chunks += line.startswith("data: {")
                if abandon and chunks == 2:
                    return
            failed += response.status_code != 200

    # One client connection per request, closed when the client is done with it: a hang-up closes its socket.
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        await asyncio.gather(*(one(client, i) for i in range(streams)))
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tries", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=60)
    parser.add_argument("--hang-up", type=int, default=12)
    parser.add_argument("--wait", type=float, default=60.0)
    parser.add_argument("--chat", action="store_true", help="streamed chats instead of text completions")
    args = parser.parse_args()
    # A run stopped from outside (`timeout`, a kill) still stops what it started, in `finally` below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    workdir = scratch_dir("lora-affinity-hangups-")
    procs: list[Proc] = []
    try:
        redis_port = free_port()
        procs.append(redis_server(redis_port, workdir, allow_embedded=True))
        base = free_port_range(2)
        replicas = [base, base + 1]
        procs.append(Proc("sim", [sys.executable, "-m", "lora_affinity_plugin.ops.cli", "sim", "--replicas", "2",
                                  "--base-port", str(base), "--speed", "5", "--warm-adapters", ",".join(ADAPTERS),
                                  "--min-output-tokens", "20"], workdir))
        for port in replicas:
            wait_port(port)
        configs = {"LiteLLM alone": proxy_config(replicas, redis_port, routing_strategy="simple-shuffle"),
                   "plugin, pooled": proxy_config(replicas, redis_port),
                   "plugin, LiteLLM's client": proxy_config(replicas, redis_port, pooled_clients=False,
                                                            key_prefix="unpooled")}
        urls = {}
        for i, (name, config) in enumerate(configs.items()):
            path = workdir / f"config-{i}.yaml"
            path.write_text(yaml.safe_dump(config))
            if i == 1:
                procs.append(lora_affinity(["scrape", "--config", str(path)], workdir, "scraper"))
            port = free_port()
            procs.append(litellm_proxy(path, port, workdir, f"proxy-{i}"))
            urls[name] = f"http://127.0.0.1:{port}"
        print(f"LiteLLM {version('litellm')}: {args.tries} tries x {args.rounds} rounds of {args.streams} streamed "
              f"{'chats' if args.chat else 'text completions'}, "
              f"{args.hang_up} a round hung up after two chunks, {CONCURRENCY} at a time; logs in {workdir}")
        for name, url in urls.items():
            for t in range(args.tries):
                before = aborted(replicas)
                failed = sum(asyncio.run(one_round(url, args.streams, args.hang_up, args.chat))
                             for _ in range(args.rounds))
                expected, deadline = args.rounds * args.hang_up, time.monotonic() + args.wait
                while (seen := aborted(replicas) - before) < expected and time.monotonic() < deadline:
                    time.sleep(0.5)
                print(f"{name:26s} try {t + 1}: hung up {expected}, aborted upstream {seen}"
                      f"{'' if seen >= expected else f' ({expected - seen} ran on after {args.wait:g} s)'}"
                      f"{f', {failed} failed' if failed else ''}", flush=True)
                time.sleep(args.wait if seen < expected else 0)  # let the ones that ran on end before the next try
    finally:
        for proc in reversed(procs):
            proc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
