"""`lora-affinity sim`: simulated vLLM replicas with LoRA, one port each, in one process.

Each replica runs `ReplicaEngine` in real time divided by `--speed` and serves what vLLM serves:
`/v1/completions` and `/v1/chat/completions` (SSE streaming or not, with `usage`), `/v1/models`,
`/health` and `/metrics` with vLLM's metric names. A client that disconnects aborts its request,
counted in `vllm:request_success_total{finished_reason="abort"}` as vLLM does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid
from dataclasses import replace

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from .arguments import parse_profiles
from .engine import EngineConfig, ReplicaEngine, Sequence
from .kv_cache import FileTokenizer, prompt_text
from .kv_publisher import KVEventPublisher, KVEventsConfig, run_forever
from .metrics_page import render_metrics

DISCONNECT_POLL_S = 0.05


class ConnectionStats:
    """What a replica's clients do with TCP: how many connections they open, and how many requests overlap.

    A pooled client opens at most as many connections as it has requests in flight at once; one that
    opens a connection per request shows up as `accepted` close to the request count.
    """

    def __init__(self) -> None:
        self.accepted = 0
        self.idle_closed = 0
        """Connections this server closed after `--keep-alive-s` idle: each forces a client to open another."""
        self.open = 0
        self.in_flight = 0
        self.peak_in_flight = 0

    def request_started(self) -> None:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def request_ended(self) -> None:
        self.in_flight -= 1


def counting_protocol(stats: ConnectionStats) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol, counting the connections it accepts and closes."""

    class CountingProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:
            stats.accepted += 1
            stats.open += 1
            super().connection_made(transport)

        def connection_lost(self, exc) -> None:
            stats.open -= 1
            super().connection_lost(exc)

        def timeout_keep_alive_handler(self) -> None:
            if not self.transport.is_closing():
                stats.idle_closed += 1
            super().timeout_keep_alive_handler()

    return CountingProtocol


class LiveReplica:
    """Drives one engine in (scaled) real time and hands tokens to waiting HTTP handlers."""

    def __init__(self, engine: ReplicaEngine, speed: float, adapters: set[str] | None, kv_metric_name: str,
                 residency_metric: bool, lora_info_style: str = "legacy", metrics_form: str = "vllm") -> None:
        self.engine = engine
        self.speed = speed
        self.adapters = adapters
        self.kv_metric_name = kv_metric_name
        self.residency_metric = residency_metric
        self.lora_info_style = lora_info_style
        self.metrics_form = metrics_form
        """Whose metric names /metrics uses: vllm, or sglang."""
        self._wake = asyncio.Event()
        self._streams: dict[int, asyncio.Queue] = {}
        self._t0 = time.monotonic()
        self.lora_history: list[tuple[float, str, str]] = []
        self.connections = ConnectionStats()
        self.publisher: KVEventPublisher | None = None
        """Where the engine's KV events go (`--kv-events-config`); None: not published."""
        self.lag_s = 0.0
        """Real seconds the simulated GPU lost because this process ran its steps late (a machine too slow for
        `--speed`): a benchmark whose replicas lag measures the machine, not the routing."""

    def now(self) -> float:
        """Simulated seconds since start."""
        return (time.monotonic() - self._t0) * self.speed

    async def run(self) -> None:
        # Steps are scheduled on an absolute timeline, so time spent serving HTTP does not slow the
        # simulated GPU down; a late step runs at once and the timeline catches up.
        step_end = time.monotonic()
        while True:
            duration_ms = self.engine.plan_step()
            if duration_ms <= 0:
                self._wake.clear()
                await self._wake.wait()
                step_end = time.monotonic()
                continue
            now = time.monotonic()
            self.lag_s += max(0.0, now - 0.05 - step_end)
            step_end = max(step_end, now - 0.05) + duration_ms / 1000 / self.speed
            await asyncio.sleep(max(0.0, step_end - time.monotonic()))
            result = self.engine.finish_step((step_end - self._t0) * self.speed)
            self.publish_events()
            for seq in result.tokens:
                queue = self._streams.get(id(seq))
                if queue is not None:
                    queue.put_nowait(seq.done)
            self._note_lora_state()

    def publish_events(self) -> None:
        events = self.engine.pool.events
        if self.publisher is not None and events:
            self.publisher.publish(events)
            events.clear()

    def restart(self) -> bool:
        """A restarted server (when idle): its cache empty, its event sequence from 0 with AllBlocksCleared."""
        if self.engine.running or self.engine.waiting:
            return False
        self.engine.pool.clear()
        if self.engine.pool.events is not None:
            self.engine.pool.events.clear()
        if self.publisher is not None:
            self.publisher.restart()
        return True

    def _note_lora_state(self) -> None:
        """vLLM adds a lora_requests_info series per state change (value = timestamp)."""
        running = ",".join(sorted({s.adapter for s in self.engine.running if s.adapter}))
        waiting = ",".join(sorted({s.adapter for s in self.engine.waiting if s.adapter}))
        if not self.lora_history or self.lora_history[-1][1:] != (running, waiting):
            self.lora_history.append((time.time(), running, waiting))
            del self.lora_history[:-3]

    def submit(self, adapter: str | None, prompt_tokens: int, max_tokens: int, hashes: tuple[int, ...] = (),
               text: str | None = None, salt: str | None = None, exact: bool = False) -> tuple[Sequence, asyncio.Queue]:
        """`exact` (vLLM's `ignore_eos`): generate max_tokens, not a drawn length."""
        length = max(1, max_tokens) if exact else self.engine.output_length(max_tokens)
        seq = Sequence(uuid.uuid4().hex, adapter, prompt_tokens, length, self.now(),
                       block_hashes=hashes, prompt_text=text, salt=salt)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[id(seq)] = queue
        self.engine.add(seq)
        self._wake.set()
        return seq, queue

    def release(self, seq: Sequence) -> None:
        self._streams.pop(id(seq), None)
        if seq.finished_at is None:
            self.engine.abort(seq)
            self._wake.set()


def make_app(replica: LiveReplica, base_model: str, metrics_token: str | None = None,
             api_key: str | None = None) -> Starlette:
    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=status)

    def refused(request: Request) -> JSONResponse | None:
        """vLLM's `--api-key`: every /v1 route wants `Authorization: Bearer KEY`."""
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return None

    async def completions(request: Request):
        if (denied := refused(request)) is not None:
            return denied
        replica.connections.request_started()
        try:
            response = await _completions(request)
        except BaseException:
            replica.connections.request_ended()
            raise
        if isinstance(response, StreamingResponse):  # ends with its body: see _stream
            return response
        replica.connections.request_ended()
        return response

    async def _completions(request: Request):
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return error(400, "request body is not JSON")
        model = body.get("model") or base_model
        if replica.adapters is not None and model != base_model and model not in replica.adapters:
            return error(404, f"The model `{model}` does not exist.")
        adapter = None if model == base_model else model
        chat = request.url.path.endswith("/chat/completions")
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            return error(400, "cache_salt: Input should be a valid string")
        text = prompt_text(body)
        tokenizer = replica.engine.tokenizer
        limit = replica.engine.config.max_model_len
        prompt_tokens = tokenizer.count(text, limit)
        if prompt_tokens + max_tokens > limit:
            return error(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                              f"{max_tokens} in the completion). Please reduce the length of the messages or completion.")
        hashes = tokenizer.block_hashes(text, adapter, salt, replica.engine.config.block_size)
        seq, queue = replica.submit(adapter, prompt_tokens, max_tokens, hashes, text, salt,
                                    exact=bool(body.get("ignore_eos")))
        if body.get("stream"):
            return StreamingResponse(_stream(seq, queue, model, chat), media_type="text/event-stream")
        try:
            next_check = time.monotonic() + DISCONNECT_POLL_S
            while True:
                try:
                    if await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S):
                        break
                except asyncio.TimeoutError:
                    pass
                if time.monotonic() >= next_check:  # tokens may flow faster than the poll: check on a clock
                    if await request.is_disconnected():
                        return PlainTextResponse("", status_code=499)
                    next_check = time.monotonic() + DISCONNECT_POLL_S
        finally:
            replica.release(seq)
        text = "x " * seq.generated
        choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        finish = "length" if seq.generated >= max_tokens else "stop"
        return JSONResponse({
            "id": f"cmpl-{seq.request_id}", "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "finish_reason": finish, **choice}],
            "usage": {"prompt_tokens": seq.prompt_tokens, "completion_tokens": seq.generated,
                      "total_tokens": seq.prompt_tokens + seq.generated},
        })

    async def _stream(seq: Sequence, queue: asyncio.Queue, model: str, chat: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent = 0
        try:
            done = False
            while not done:
                done = await queue.get()
                while not queue.empty():  # coalesce tokens that arrived together (high --speed)
                    done = queue.get_nowait() or done
                text = "x " * (seq.generated - sent)
                sent = seq.generated
                delta = {"delta": {"content": text}} if chat else {"text": text}
                chunk = {"id": f"cmpl-{seq.request_id}", "object": obj, "created": int(time.time()), "model": model,
                         "choices": [{"index": 0, **delta, "finish_reason": "stop" if done else None}]}
                if done:
                    chunk["usage"] = {"prompt_tokens": seq.prompt_tokens, "completion_tokens": seq.generated,
                                      "total_tokens": seq.prompt_tokens + seq.generated}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            replica.release(seq)  # a disconnect mid-stream aborts the request
            replica.connections.request_ended()

    garbled = {"family": ""}
    """A metric family whose values /metrics serves unreadable (`control`: a partly broken exporter)."""

    async def models(request: Request):
        if (denied := refused(request)) is not None:
            return denied
        names = [base_model, *sorted(replica.adapters or replica.engine.cpu)]
        return JSONResponse({"object": "list", "data": [{"id": n, "object": "model", "owned_by": "sim"} for n in names]})

    async def health(_: Request):
        return PlainTextResponse("")

    async def control(request: Request):
        """Change this replica at run time: `{"speed": 0.5}` (a GPU that throttles or is shared),
        `{"garble": "vllm:kv_cache_usage_perc"}` (that family's values unreadable on /metrics; "" ends it),
        `{"restart": true}` (when idle: the cache emptied, KV events from sequence 0 with AllBlocksCleared), or
        `{"drop_events": N}` (the next N event batches reach only the replay buffer: a subscriber sees a gap), or
        `{"replay_keep": N}` (the replay buffer keeps only its last N batches: it no longer reaches back)."""
        if (denied := refused(request)) is not None:
            return denied
        try:
            body = await request.json()
            if body.get("restart"):
                if not replica.restart():
                    return JSONResponse({"error": "restart: the replica is busy; restart it when idle"}, status_code=409)
                return JSONResponse({"restarted": True})
            if "drop_events" in body or "replay_keep" in body:
                field = "drop_events" if "drop_events" in body else "replay_keep"
                if replica.publisher is None:
                    return JSONResponse({"error": f"{field}: KV events are not published (--kv-events-config)"},
                                        status_code=400)
                if field == "replay_keep":
                    return JSONResponse({"replay_keep": replica.publisher.keep_last(int(body["replay_keep"]))})
                replica.publisher.dropped_next = int(body["drop_events"])
                return JSONResponse({"drop_events": replica.publisher.dropped_next})
            if "garble" in body:
                garbled["family"] = str(body["garble"])
                if "speed" not in body:
                    return JSONResponse({"garble": garbled["family"]})
            speed = float(body["speed"])
            if not 0.01 <= speed <= 100:
                raise ValueError
        except (ValueError, KeyError, TypeError, AttributeError):
            return JSONResponse({"error": "speed: a number from 0.01 to 100 is required"}, status_code=400)
        replica.engine.config.speed = speed
        return JSONResponse({"speed": speed})

    async def metrics(request: Request):
        if metrics_token and request.headers.get("authorization") != f"Bearer {metrics_token}":
            return PlainTextResponse("unauthorized", status_code=401)
        page = render_metrics(replica, base_model)
        if garbled["family"]:
            family = garbled["family"]
            page = "\n".join(line.rsplit(" ", 1)[0] + " garbled" if line.startswith(family + "{") else line
                             for line in page.split("\n"))
        return PlainTextResponse(page, media_type="text/plain; version=0.0.4")

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/models", models),
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/control", control, methods=["POST"]),
    ])


def build_replicas(args: argparse.Namespace) -> list[LiveReplica]:
    config = EngineConfig(max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras, kv_blocks=args.kv_blocks,
                          base_model=args.base_model, min_output_tokens=args.min_output_tokens,
                          mean_output_tokens=args.mean_output_tokens,
                          prefix_caching=args.prefix_caching, max_model_len=args.max_model_len)
    adapters = set(args.adapters.split(",")) if args.adapters else None
    warm = args.warm_adapters.split(",") if args.warm_adapters else []
    replicas = []
    sglang = {int(i) for i in args.sglang_replicas.split(",")} if args.sglang_replicas else set()
    profiles = parse_profiles(args.replica_profiles)
    for r in range(args.replicas):
        own = replace(config, **profiles[r % len(profiles)]) if profiles else replace(config)
        gpu = [warm[(r * own.max_loras + j) % len(warm)] for j in range(min(own.max_loras, len(warm)))]
        engine = ReplicaEngine(own, random.Random(f"{args.seed}-replica-{r}"), warm, gpu)
        if getattr(args, "tokenizer", None):
            engine.tokenizer = FileTokenizer(args.tokenizer)
        replica = LiveReplica(engine, args.speed, adapters, args.kv_metric_name, args.residency_metric,
                              args.lora_info_style, "sglang" if r in sglang else "vllm")
        events = KVEventsConfig.parse(getattr(args, "kv_events_config", None))
        if events is not None:
            engine.pool.events = []
            replica.publisher = KVEventPublisher(events.for_replica(r), args.kv_events_layout)
        replicas.append(replica)
    return replicas


async def serve(args: argparse.Namespace) -> None:
    replicas = build_replicas(args)
    servers = [
        uvicorn.Server(uvicorn.Config(make_app(rep, args.base_model, args.metrics_token, args.api_key), host=args.host, port=args.base_port + i,
                                      http=counting_protocol(rep.connections), timeout_keep_alive=args.keep_alive_s,
                                      log_level="warning", access_log=False, timeout_graceful_shutdown=1))
        for i, rep in enumerate(replicas)
    ]
    engines = [asyncio.create_task(rep.run()) for rep in replicas]
    engines += [asyncio.create_task(run_forever(rep.publisher)) for rep in replicas if rep.publisher is not None]
    print(f"simulating {len(replicas)} vLLM replicas on {args.host}:{args.base_port}..{args.base_port + len(replicas) - 1}"
          f" at {args.speed:g}x speed", flush=True)
    try:
        await asyncio.gather(*(s.serve() for s in servers))
    finally:
        for task in engines:
            task.cancel()


def run_sim(args: argparse.Namespace) -> int:
    asyncio.run(serve(args))
    return 0
