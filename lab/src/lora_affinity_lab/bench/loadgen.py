"""The benchmark client: the seed's aiohttp client, generalised.

At most `connections` requests in flight; each request's deadline counts from its creation and
includes the wait for a connection (aiohttp's total timeout), so whatever is not done by then is a
timeout and its connection is closed, which aborts it upstream. Times are reported in simulated
seconds (real seconds x speed).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Callable

import aiohttp

from .fast import Request, workload
from .results import RequestOutcome

CLIENT_KEEPALIVE_S = 4.0
"""Below the proxy's (uvicorn's) 5 s: a request written on a connection the proxy is closing gets a reset."""
from .prompt_shapes import lora_prompt
from .scenarios import SEED_PROMPT, Scenario


async def run_load(scenario: Scenario, targets: list[str], speed: float, seed: int, *, api_key: str | None,
                   per_connection: bool, on_done: Callable[[], None] | None = None) -> tuple[list[RequestOutcome], float]:
    """Send the scenario's requests; `targets` are base URLs (proxies, or replicas when per_connection)."""
    requests = workload(scenario, random.Random(f"{seed}-workload"))
    outcomes: list[RequestOutcome | None] = [None] * len(requests)
    queue: asyncio.Queue[Request] = asyncio.Queue()
    deadline_s = scenario.deadline_s / speed
    pin = random.Random(f"{seed}-connections")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.monotonic()
    last_event = [0.0]  # real seconds since start of the last completion or timeout

    async def feed() -> None:
        for req in requests:
            delay = req.arrival / speed - (time.monotonic() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            queue.put_nowait(req)

    async def one(session: aiohttp.ClientSession, base: str, target_index: int, req: Request) -> RequestOutcome:
        expires = req.arrival / speed + deadline_s
        remaining = expires - (time.monotonic() - start)
        if remaining <= 0:
            last_event[0] = max(last_event[0], expires)
            return RequestOutcome(None, False)
        prompt = lora_prompt(scenario.prompt_shape, scenario.prompt_chars, seed, req.index, req.adapter, SEED_PROMPT)
        body = {"model": req.adapter, "prompt": prompt, "max_tokens": scenario.max_tokens, "stream": req.stream}
        sent = time.monotonic()
        replica = target_index if per_connection else None
        try:
            async with asyncio.timeout(remaining):
                async with session.post(base + "/v1/completions", json=body, headers=headers) as resp:
                    if resp.status != 200:
                        body = (await resp.read())[:200].decode(errors="replace")
                        return RequestOutcome(replica, False, e2e_s=(time.monotonic() - sent) * speed,
                                              error=f"HTTP {resp.status}: {_error_message(body)}")
                    if not req.stream:
                        data = await resp.json()
                        tokens, ttft = data["usage"]["completion_tokens"], None
                    else:
                        tokens, ttft = 0, None
                        async for line in resp.content:
                            if not line.startswith(b"data: {"):
                                continue
                            ttft = ttft if ttft is not None else time.monotonic()
                            chunk = json.loads(line[6:])
                            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
        except (asyncio.TimeoutError, TimeoutError):
            last_event[0] = max(last_event[0], expires)
            return RequestOutcome(replica, False)
        except aiohttp.ClientError as exc:
            return RequestOutcome(replica, False, e2e_s=(time.monotonic() - sent) * speed,
                                  error=f"{type(exc).__name__}: {exc}"[:120])
        now = time.monotonic()
        last_event[0] = max(last_event[0], now - start)
        created = start + req.arrival / speed
        return RequestOutcome(replica, True, tokens, (ttft - created) * speed if ttft else None, (now - created) * speed)

    async def worker(index: int, session: aiohttp.ClientSession) -> None:
        target_index = pin.randrange(len(targets)) if per_connection else index % len(targets)
        while True:
            req = await queue.get()
            outcomes[req.index] = await one(session, targets[target_index], target_index, req)
            if on_done:
                on_done()
            queue.task_done()

    connector = aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=CLIENT_KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        feeder = asyncio.create_task(feed())
        workers = [asyncio.create_task(worker(i, session)) for i in range(scenario.connections)]
        await feeder
        await queue.join()
        for w in workers:
            w.cancel()
    return [o or RequestOutcome(None, False) for o in outcomes], last_event[0] * speed


def _error_message(body: str) -> str:
    """The gist of an error body, short enough to count kinds by (LiteLLM wraps it in JSON)."""
    try:
        return str(json.loads(body)["error"]["message"])[:80]
    except (ValueError, KeyError, TypeError):
        return body[:80]
