"""The open-loop client of the KV-reuse benchmarks: requests arrive on their own clock.

Each request is sent at its arrival time whatever is still in flight (no connection limit), as a
streamed chat completion, so time to first token and inter-token latency are measured per request.
A multi-turn session's next turn is sent a think time after its reply, carrying the reply it got.
Times are in simulated seconds (real seconds x speed).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp

from .loadgen import CLIENT_KEEPALIVE_S
from .prefix_workloads import BACKGROUND_OUTPUT_TOKENS, PrefixWorkload, PromptRequest, background_arrivals
from .results import RequestOutcome


@dataclass
class Background:
    """Another client's requests (kv-pressure-shared, -foreign), sent straight to the replicas, past the gateways,
    on the same schedule as in fast mode; how many failed (a run where some did is not comparable)."""

    replicas: list[str]
    sent: int = 0
    failed: int = 0


async def run_open_loop(workload: PrefixWorkload, targets: list[str], speed: float, deadline_s: float, *,
                        api_key: str | None, on_done=None, background: Background | None = None
                        ) -> tuple[list[RequestOutcome], float]:
    outcomes: dict[int, RequestOutcome] = {}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.monotonic()
    last_event = [0.0]
    tasks: set[asyncio.Task] = set()

    def schedule(session: aiohttp.ClientSession, req: PromptRequest) -> None:
        task = asyncio.create_task(one(session, req))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def one(session: aiohttp.ClientSession, req: PromptRequest) -> None:
        delay = req.arrival / speed - (time.monotonic() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        outcome, reply = await send(session, targets[req.index % len(targets)], req)
        outcomes[req.index] = outcome
        last_event[0] = max(last_event[0], time.monotonic() - start)
        if on_done:
            on_done()
        nxt = workload.follow_up(req, reply, (time.monotonic() - start) * speed)
        if nxt is not None:
            schedule(session, nxt)

    async def send(session: aiohttp.ClientSession, base: str, req: PromptRequest) -> tuple[RequestOutcome, str]:
        body = {"model": req.model, "messages": req.messages, "max_tokens": req.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        if req.sheddable:
            body["metadata"] = {"criticality": "sheddable"}
        sent = time.monotonic()
        created = start + req.arrival / speed
        first = last = None
        tokens, reply = 0, []
        try:
            async with asyncio.timeout(deadline_s / speed):
                async with session.post(base + "/v1/chat/completions", json=body, headers=headers) as resp:
                    if resp.status != 200:
                        text = (await resp.read())[:200].decode(errors="replace")
                        return RequestOutcome(None, False, e2e_s=(time.monotonic() - sent) * speed,
                                              error=f"HTTP {resp.status}: {text[:80]}", sheddable=req.sheddable), ""
                    async for line in resp.content:
                        if not line.startswith(b"data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        for choice in chunk.get("choices") or ():
                            content = (choice.get("delta") or {}).get("content")
                            if content:
                                last = time.monotonic()
                                first = first or last
                                reply.append(content)
                        tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
        except (asyncio.TimeoutError, TimeoutError):
            return RequestOutcome(None, False, sheddable=req.sheddable), ""
        except aiohttp.ClientError as exc:
            return RequestOutcome(None, False, e2e_s=(time.monotonic() - sent) * speed,
                                  error=f"{type(exc).__name__}: {exc}"[:120], sheddable=req.sheddable), ""
        end = time.monotonic()
        itl = (last - first) * speed / (tokens - 1) if first and last and tokens > 1 else None
        return RequestOutcome(None, True, tokens, (first - created) * speed if first else None,
                              (end - created) * speed, itl_s=itl, sheddable=req.sheddable), "".join(reply)

    async def other_client(session: aiohttp.ClientSession, at: float, replica: int, turn: int) -> None:
        delay = at / speed - (time.monotonic() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        adapter, messages, prompt = workload.background(turn)
        body = {"max_tokens": BACKGROUND_OUTPUT_TOKENS, "ignore_eos": True,
                **({"model": adapter} if adapter else {}),
                **({"messages": messages} if messages is not None else {"prompt": prompt})}
        path = "/v1/chat/completions" if messages is not None else "/v1/completions"
        background.sent += 1
        try:
            async with asyncio.timeout(deadline_s / speed):
                async with session.post(background.replicas[replica] + path, json=body) as resp:
                    await resp.read()
                    background.failed += resp.status != 200
        except (asyncio.TimeoutError, TimeoutError, aiohttp.ClientError):
            background.failed += 1

    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        for req in workload.initial():
            schedule(session, req)
        others = [asyncio.create_task(other_client(session, at, replica, turn))
                  for at, replica, turn in (background_arrivals(workload.scenario, workload.seed) if background else ())]
        while tasks:
            await asyncio.gather(*list(tasks))
        for task in others:  # the other client stops with the gateways' load
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
    return [outcomes[i] for i in sorted(outcomes)], last_event[0] * speed
