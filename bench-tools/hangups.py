"""Whether every client that hangs up mid-stream stops its generation upstream, through real proxies under load.

Starts Redis, two simulated replicas, the scraper and three `litellm --config` proxies on this venv's LiteLLM:
LiteLLM alone (`simple-shuffle`), the plugin with its pooled clients, and the plugin with `pooled_clients: false`
(LiteLLM's own client). Each takes rounds of streamed text completions (chats with `--chat`), CONCURRENCY at a
time, the first `--hang-up` of each round asking for a long generation and hung up after two chunks (as
tests/e2e/test_e2e_pooling.py does); then the replicas' `finished_reason="abort"` count is read until every
hang-up is there or `--wait` seconds pass. A hang-up missing after the wait is a generation still running that
long after it, for no one. Prints, per proxy and try, the hang-ups and the aborts the replicas counted.

With `--before-first-token` the replicas run at a tenth of real time, and each try is one stream with a long prompt
(about 3,300 tokens: seconds of prefill there) hung up a second after it was sent, before its first token; it
prints how long after the hang-up the replica aborted it.

    .venv/bin/python bench-tools/hangups.py [--tries 3] [--rounds 3] [--streams 60] [--hang-up 12] [--chat]
    .venv/bin/python bench-tools/hangups.py --before-first-token [--chat]
    .venv-1108/bin/python bench-tools/hangups.py     # the same on another LiteLLM release
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import sys
import time
import uuid
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


LONG_PROMPT = "word " * 2000
"""About 3,300 tokens for the simulator: at `--speed 0.1` its first token comes 7-8 s after it is sent (each try's
begins with words of its own, so no replica holds it in its prefix cache)."""


def body_of(chat: bool, question: str, **extra: object) -> tuple[str, dict]:
    """The path and body of a streamed chat or text completion asking `question`."""
    body = {"model": ADAPTERS[0], "stream": True, **extra,
            **({"messages": [{"role": "user", "content": question}]} if chat else {"prompt": question})}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


async def hang_up_before_first_token(url: str, chat: bool, after_s: float = 1.0) -> bool:
    """One stream with `LONG_PROMPT`, its connection closed `after_s` after it was sent unless a chunk came first;
    True when it was hung up before its first token."""
    path, body = body_of(chat, f"{uuid.uuid4().hex} {LONG_PROMPT}", max_tokens=50)

    async def read(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", url + path, json=body,
                                 headers={"Authorization": f"Bearer {MASTER_KEY}"}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and _has_text(json.loads(line[6:])):
                    return  # a chat's first chunk may carry only the assistant's role: that is no token yet

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        try:
            await asyncio.wait_for(read(client), after_s)  # the timeout cancels the read: the connection closes
        except asyncio.TimeoutError:
            return True
    return False


def _has_text(chunk: dict) -> bool:
    choice = (chunk.get("choices") or [{}])[0]
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


async def one_round(url: str, streams: int, hang_up: int, chat: bool = False) -> int:
    """`streams` streamed completions (chats with `chat`), the first `hang_up` hung up after two chunks; returns
    the failures."""
    semaphore, failed = asyncio.Semaphore(CONCURRENCY), 0

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal failed
        abandon = i < hang_up
        question = "Is the Necronomicon in it?"
        path, body = body_of(chat, question, model=ADAPTERS[i % 2], max_tokens=3000 if abandon else 30,
                             **({"ignore_eos": True} if abandon else {}))
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
    parser.add_argument("--before-first-token", action="store_true",
                        help="each try one long prompt hung up before its first token, on replicas at 0.1x speed")
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
                                  "--base-port", str(base), "--speed", "0.1" if args.before_first_token else "5",
                                  "--warm-adapters", ",".join(ADAPTERS),
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
        if args.before_first_token:
            early(urls, replicas, args)
            return 0
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


def early(urls: dict[str, str], replicas: list[int], args: argparse.Namespace) -> None:
    """`--before-first-token`: per proxy, `--tries` streams hung up before their first token, and how soon each
    reached the replicas as an abort (up to `--wait`)."""
    kind = "chats" if args.chat else "text completions"
    print(f"LiteLLM {version('litellm')}: {args.tries} streamed {kind} a proxy, each with a ~3,300-token prompt "
          f"hung up 1 s after it was sent, before its first token (7-8 s at 0.1x speed)")
    for name, url in urls.items():
        delays = []
        for _ in range(args.tries):
            before = aborted(replicas)
            if not asyncio.run(hang_up_before_first_token(url, args.chat)):
                print(f"{name:26s} a first token came within 1 s: not a hang-up before it", flush=True)
                continue
            hung, deadline = time.monotonic(), time.monotonic() + args.wait
            while aborted(replicas) == before and time.monotonic() < deadline:
                time.sleep(0.05)
            delays.append(time.monotonic() - hung if aborted(replicas) > before else None)
            time.sleep(1)
        shown = ", ".join("not within the wait" if d is None else f"{d:.2f} s" for d in delays)
        print(f"{name:26s} aborted upstream after the hang-up: {shown}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
