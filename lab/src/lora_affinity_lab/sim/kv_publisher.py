"""A replica's KV-cache events over ZeroMQ, as vLLM publishes them (`--kv-events-config`).

One PUB socket sends `(topic, sequence, payload)` per engine step that cached or evicted blocks; a ROUTER
socket replays the buffered batches from a sequence number on, then `(-1, b"")`. A restarted replica starts
its sequence over at 0 and publishes `AllBlocksCleared` first.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass

import zmq
import zmq.asyncio

from lora_affinity_plugin.kv.kv_events import AllBlocksCleared, EventBatch, KVEvent, encode_batch, sequence_bytes


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` JSON: the fields the simulator reads (others are accepted and ignored)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str | None) -> KVEventsConfig | None:
        if not text:
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--kv-events-config: not JSON: {exc}") from None
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        config = cls(**known)
        if not config.enable_kv_cache_events:
            return None
        if config.publisher != "zmq":
            raise SystemExit(f"--kv-events-config: publisher {config.publisher!r}: the simulator publishes over zmq")
        return config

    def for_replica(self, index: int) -> KVEventsConfig:
        """Replica `index`'s endpoints: each port offset by the index (as vLLM offsets them by data-parallel rank)."""
        from dataclasses import replace

        return replace(self, endpoint=_offset(self.endpoint, index),
                       replay_endpoint=_offset(self.replay_endpoint, index) if self.replay_endpoint else None)


def _offset(endpoint: str, index: int) -> str:
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + index}" if index else endpoint


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, layout: str = "map") -> None:
        self.config = config
        self.layout = layout
        self._ctx = zmq.asyncio.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._topic = config.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.dropped_next = 0
        """Batches to send to the replay buffer only (`/control`): subscribers see a gap, as after a lost message."""

    def publish(self, events: list[KVEvent]) -> None:
        payload = encode_batch(EventBatch(time.time(), tuple(events), 0), self.layout)
        seq, self._seq = self._seq, self._seq + 1
        self._buffer.append((seq, payload))
        if self.dropped_next:
            self.dropped_next -= 1
            return
        try:
            self._pub.send_multipart((self._topic, sequence_bytes(seq), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # past the high-water mark: the subscriber replays it
            pass

    def keep_last(self, batches: int) -> int:
        """Drop all but the last `batches` from the replay buffer (`/control`): a buffer that no longer reaches back
        to where a subscriber would start, as after more than `buffer_steps` batches. Returns how many are kept."""
        while len(self._buffer) > max(0, batches):
            self._buffer.popleft()
        return len(self._buffer)

    def restart(self) -> None:
        """A restarted server: its sequence starts over, its buffer is empty, and it says its cache is empty."""
        self._seq = 0
        self._buffer.clear()
        self.dropped_next = 0  # (a drop asked of the server before it restarted)
        self.publish([AllBlocksCleared()])

    async def serve_replay(self) -> None:
        if self._replay is None:
            return
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart((client, b"", self._topic, sequence_bytes(seq), payload))
            await self._replay.send_multipart((client, b"", b"", sequence_bytes(-1), b""))

    def close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


async def run_forever(publisher: KVEventPublisher) -> None:
    try:
        await publisher.serve_replay()
    except asyncio.CancelledError:
        publisher.close()
        raise
