"""The scraper's side of exact cache state: which pods publish KV events, following them (the lease holder and
one standby, so a failover's index is whole), and sharing the index with every proxy through Redis
(`exact_share.py`: the lease holder only).

Imported only when `kv_events` is on: it needs the `kv-events` extra (pyzmq, msgspec).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Collection, Mapping, Sequence
from urllib.parse import urlsplit

from .exact_index import ExactIndex
from .exact_share import changes_key, encode_changes, snapshot_key
from .kv_subscriber import EventEndpoints, KVEventSubscriber
from .metrics import KV_EVENTS_BATCHES, KV_EVENTS_GAPS, KV_EVENTS_LAG, KV_INDEX_BLOCKS
from .pods import deployment_pod
from .settings import Settings

logger = logging.getLogger("lora_affinity.kv_events")

STREAM_LENGTH = 2_000
"""Change sets kept in the stream (10 minutes at 200 ms when every interval changes): a proxy further behind
loads the snapshot again."""
SNAPSHOT_EVERY_S = 5.0


def event_endpoints(model_list: Sequence[Mapping[str, Any]], pods: Sequence[str],
                    settings: Settings) -> dict[str, EventEndpoints]:
    """Each scraped pod's event sockets: the settings' templates with the pod's host, or its deployment's
    `model_info.kv_events_endpoint` / `kv_events_replay_endpoint` (an empty one: that pod publishes none)."""
    overrides: dict[str, dict[str, Any]] = {}
    for deployment in model_list:
        pod = deployment_pod(deployment)
        info = deployment.get("model_info") or {}
        if pod and isinstance(info, dict) and ("kv_events_endpoint" in info or "kv_events_replay_endpoint" in info):
            overrides[pod] = info
    out = {}
    for pod in pods:
        host = urlsplit(pod).hostname or ""
        info = overrides.get(pod, {})
        publisher = info.get("kv_events_endpoint", settings.kv_events_endpoint)
        replay = info.get("kv_events_replay_endpoint", settings.kv_events_replay_endpoint)
        if not publisher:
            continue
        out[pod] = EventEndpoints(str(publisher).format(host=host), str(replay).format(host=host) if replay else None,
                                  settings.kv_events_topic)
    return out


class KVEventSharing:
    """Follows every proven pod's events, and writes the index's changes while this worker holds the lease.

    A standby follows too (`stand_by`): a worker that joined a pod's stream late knows only what the pod's replay
    buffer still held, so one that starts following only when it takes the lease would under-count every pod
    until the caches turn over."""

    def __init__(self, endpoints: Mapping[str, EventEndpoints]) -> None:
        self.endpoints = dict(endpoints)
        self.subscriber: KVEventSubscriber | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._epoch = uuid.uuid4().hex[:12]
        """Names this term's numbering: a proxy that sees another epoch loads the snapshot."""
        self._number = 0
        self._last_id = "0-0"
        self._next_snapshot = 0.0
        self._exported: dict[str, int] = {}
        """What `export` has counted so far, per pod (the streams count from their start)."""

    def start(self, proven: Collection[str]) -> None:
        """Follow the proven pods' events (a hosted provider's api_base is never proven: it gets no connection)."""
        if self._task is not None:
            for pod in proven:
                if pod in self.endpoints:
                    self.subscriber.add(pod, self.endpoints[pod])
            return
        followed = {pod: ep for pod, ep in self.endpoints.items() if pod in proven}
        if not followed:
            return
        self.subscriber = KVEventSubscriber(followed, ExactIndex())
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self.subscriber.run(self._stop), name="lora-affinity-kv-events")
        self._epoch, self._number, self._last_id, self._next_snapshot = uuid.uuid4().hex[:12], 0, "0-0", 0.0
        self._exported = {}
        logger.info("following the KV events of %d pods", len(followed))

    def take_over(self) -> None:
        """A new lease term: numbering starts again under a new epoch, and the next `share` writes a snapshot of
        all the standby learned (the changes it gathered meanwhile are in it)."""
        self._epoch, self._number, self._last_id, self._next_snapshot = uuid.uuid4().hex[:12], 0, "0-0", 0.0
        if self.subscriber is not None:
            self.subscriber.index.take_changes()

    def stand_by(self) -> None:
        """Another worker shares: the changes followed are not written, only dropped (the index itself is kept)."""
        if self.subscriber is not None:
            self.export()
            self.subscriber.index.take_changes()

    async def stop(self) -> None:
        if self._task is None:
            return
        self._stop.set()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task, self.subscriber = None, None

    def export(self) -> None:
        """Each followed pod's stream on the scraper's /metrics: its lag, batches, gaps and index size (the counters
        exported from 0, so an alert's increase() sees the first gap too)."""
        if self.subscriber is None:
            return
        for pod, stream in self.subscriber.streams.items():
            KV_EVENTS_LAG.labels(pod).set(stream.lag_s)
            batches = KV_EVENTS_BATCHES.labels(pod)
            batches.inc(max(0, stream.batches - self._exported.get(pod, 0)))
            self._exported[pod] = stream.batches
            for outcome, count in (("replayed", stream.gaps - stream.lost), ("lost", stream.lost)):
                key = f"{pod}\x00{outcome}"
                KV_EVENTS_GAPS.labels(pod, outcome).inc(max(0, count - self._exported.get(key, 0)))
                self._exported[key] = count
            KV_INDEX_BLOCKS.labels(pod).set(self.subscriber.index.size(pod))

    async def share(self, client, prefix: str) -> None:
        """This interval's changes into the stream; every few seconds a snapshot the stream continues from."""
        if self.subscriber is None:
            return
        self.export()
        index = self.subscriber.index
        changes = index.take_changes()
        if changes or self._number == 0:  # (a term's first, even empty: the snapshot's place in the stream)
            number, self._number = self._number, self._number + 1
            try:
                self._last_id = _text(await client.xadd(changes_key(prefix), {
                    "e": self._epoch, "n": number, "c": encode_changes(changes)},
                    maxlen=STREAM_LENGTH, approximate=True))
            except Exception:
                # Those changes are lost: the number they had is a gap readers notice, and the next snapshot,
                # written as soon as Redis answers, holds them.
                self._next_snapshot = 0.0
                raise
        if time.monotonic() >= self._next_snapshot:
            self._next_snapshot = time.monotonic() + SNAPSHOT_EVERY_S
            await client.hset(snapshot_key(prefix), mapping={
                "e": self._epoch, "n": self._number - 1, "i": self._last_id, "c": encode_changes(index.snapshot())})


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
