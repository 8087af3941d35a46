"""The scraper's side of exact cache state: which pods publish KV events, following them (the lease holder and
one standby, so a failover's index is whole), and sharing the index with every proxy through Redis
(`kv/exact_share.py`: the lease holder only), with a checkpoint of each pod's stream for whichever scraper starts next
(`kv/kv_checkpoint.py`).

Imported only when `kv_events` is on: it needs the `kv-events` extra (pyzmq, msgspec).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Collection, Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from ..config.settings import MAX_DATA_PARALLEL_RANKS, Settings
from ..fleet.lease import fenced_write
from ..fleet.pods import deployment_pod
from ..fleet.store import PodRecord
from ..kv.exact_index import ExactIndex
from ..kv.exact_share import (
    SNAPSHOT_PART_TTL_MS,
    changes_key,
    encode_changes,
    rank_key,
    rank_pod,
    snapshot_header,
    snapshot_key,
    snapshot_part_key,
    snapshot_parts,
)
from ..kv.kv_checkpoint import (
    PodCheckpoint,
    checkpoints_key,
    decode_checkpoint,
    encode_checkpoint,
)
from ..kv.kv_subscriber import EventEndpoints, KVEventSubscriber
from ..telemetry.metrics import (
    KV_EVENTS_BATCHES,
    KV_EVENTS_DROPPED,
    KV_EVENTS_GAPS,
    KV_EVENTS_LAG,
    KV_INDEX_BLOCKS,
    KV_INDEX_PARTIAL,
)

logger = logging.getLogger("lora_affinity.kv_events")

STREAM_LENGTH = 2_000
"""Change sets kept in the stream (10 minutes at 200 ms when every interval changes): a proxy further behind
loads the snapshot again."""
SNAPSHOT_EVERY_S = 5.0
CHECKPOINT_EVERY_S = 10.0
"""How often the lease holder writes each pod's checkpoint (the pods whose stream moved): a scraper starting after
every scraper was down resumes a pod whose replay buffer still reaches back to it (vLLM keeps 10,000 batches)."""
CHECKPOINTS_PER_WRITE = 8
"""Pods per HSET: a command of a few MB, not one of every pod's (tens of MB would hold Redis up for the proxies)."""


_OVERRIDES = ("kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_data_parallel_size")
"""What a deployment's `model_info` may set for its pod."""


def event_endpoints(model_list: Sequence[Mapping[str, Any]], pods: Sequence[str],
                    settings: Settings) -> dict[str, EventEndpoints]:
    """Each scraped pod's event sockets: the settings' templates with the pod's host, or its deployment's
    `model_info.kv_events_endpoint` / `kv_events_replay_endpoint` (an empty one: that pod publishes none); one pair
    per data-parallel rank (`kv_events_data_parallel_size`), keyed by `exact_share.rank_key`."""
    overrides: dict[str, dict[str, Any]] = {}
    for deployment in model_list:
        pod = deployment_pod(deployment)
        info = deployment.get("model_info") or {}
        if pod and isinstance(info, dict) and any(name in info for name in _OVERRIDES):
            overrides[pod] = info
    out = {}
    for pod in pods:
        host = urlsplit(pod).hostname or ""
        info = overrides.get(pod, {})
        publisher = info.get("kv_events_endpoint", settings.kv_events_endpoint)
        replay = info.get("kv_events_replay_endpoint", settings.kv_events_replay_endpoint)
        if not publisher:
            continue
        publisher, replay = str(publisher).format(host=host), str(replay).format(host=host) if replay else None
        for rank in range(_ranks(info.get("kv_events_data_parallel_size"), settings.kv_events_data_parallel_size)):
            out[rank_key(pod, rank)] = EventEndpoints(offset_endpoint(publisher, rank), offset_endpoint(replay, rank),
                                                      settings.kv_events_topic)
    return out


def _ranks(given: Any, default: int) -> int:
    """A deployment's `model_info.kv_events_data_parallel_size`, or the settings' (a bad value: the settings')."""
    if isinstance(given, int) and not isinstance(given, bool) and 1 <= given <= MAX_DATA_PARALLEL_RANKS:
        return given
    if given is not None:
        logger.warning("kv_events_data_parallel_size %r is not a whole number from 1 to %d: %d used", given,
                       MAX_DATA_PARALLEL_RANKS, default)
    return default


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Where vLLM's data-parallel rank `rank` publishes, given rank 0's endpoint: the TCP port plus the rank, or the
    name with `_dp<rank>` for inproc (vLLM's `ZmqEventPublisher.offset_endpoint_port`, which refuses any other kind
    for a rank past 0)."""
    if not endpoint or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    head, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        return endpoint
    return f"{head}:{int(port) + rank}"


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
        self._checkpoints: dict[str, PodCheckpoint] = {}
        """Read from Redis before following: where the last scraper stood, per pod."""
        self._checkpointed: dict[str, tuple[int, float]] = {}
        """Per pod, the batch its checkpoint in Redis covers (this term's writes)."""
        self._next_checkpoint = 0.0
        self._pruned = False
        """Whether this term has dropped the checkpoints of pods it does not follow."""

    async def begin(self, client, prefix: str, proven: Collection[str]) -> None:
        """`start`, reading the pods' checkpoints first when nothing is followed yet: a scraper that starts, or a
        standby that starts following, resumes each pod where the last lease holder stood. Without Redis it starts
        anyway, from the pods' replay buffers."""
        if self._task is None and any(rank_pod(key) in proven for key in self.endpoints):
            try:
                raw = await client.hgetall(checkpoints_key(prefix))
            except Exception as exc:
                logger.info("could not read the KV-event checkpoints (%s): the pods are joined afresh",
                            type(exc).__name__)
                raw = {}
            self._checkpoints = {}
            for pod, data in raw.items():
                pod = _text(pod)
                if pod not in self.endpoints:
                    continue
                try:
                    self._checkpoints[pod] = decode_checkpoint(data)
                except ValueError as exc:
                    logger.info("KV-event checkpoint of %s not used (%s): the pod is joined afresh", pod, exc)
        self.start(proven)

    def start(self, proven: Collection[str]) -> None:
        """Follow the proven pods' events (a hosted provider's api_base is never proven: it gets no connection)."""
        if self._task is not None:
            for key, endpoints in self.endpoints.items():
                if rank_pod(key) in proven:
                    self.subscriber.add(key, endpoints, self._checkpoints.pop(key, None))
            return
        followed = {key: ep for key, ep in self.endpoints.items() if rank_pod(key) in proven}
        if not followed:
            return
        checkpoints = {pod: self._checkpoints.pop(pod) for pod in followed if pod in self._checkpoints}
        self.subscriber = KVEventSubscriber(followed, ExactIndex(), checkpoints=checkpoints)
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self.subscriber.run(self._stop), name="lora-affinity-kv-events")
        self._epoch, self._number, self._last_id, self._next_snapshot = uuid.uuid4().hex[:12], 0, "0-0", 0.0
        self._exported, self._checkpointed, self._next_checkpoint, self._pruned = {}, {}, 0.0, False
        logger.info("following the KV events of %d pods", len(followed))

    def take_over(self) -> None:
        """A new lease term: numbering starts again under a new epoch, and the next `share` writes a snapshot of
        all the standby learned (the changes it gathered meanwhile are in it)."""
        self._epoch, self._number, self._last_id, self._next_snapshot = uuid.uuid4().hex[:12], 0, "0-0", 0.0
        self._checkpointed, self._next_checkpoint, self._pruned = {}, 0.0, False
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
        """Each followed pod's stream on the scraper's /metrics: its lag, batches, gaps, index size and whether it is
        partial (the counters exported from 0, so an alert's increase() sees the first gap too)."""
        if self.subscriber is None:
            return
        for pod, stream in self.subscriber.streams.items():
            KV_EVENTS_LAG.labels(pod).set(stream.lag_s)
            batches = KV_EVENTS_BATCHES.labels(pod)
            batches.inc(max(0, stream.batches - self._exported.get(pod, 0)))
            self._exported[pod] = stream.batches
            for outcome, count in (("replayed", stream.gaps_replayed), ("lost", stream.gaps_lost)):
                key = f"{pod}\x00{outcome}"
                KV_EVENTS_GAPS.labels(pod, outcome).inc(max(0, count - self._exported.get(key, 0)))
                self._exported[key] = count
            for kind, count in (("bad", stream.bad_payloads), ("restart", stream.follower_restarts)):
                key = f"{pod}\x00dropped-{kind}"
                KV_EVENTS_DROPPED.labels(pod, kind).inc(max(0, count - self._exported.get(key, 0)))
                self._exported[key] = count
            KV_INDEX_BLOCKS.labels(pod).set(self.subscriber.index.size(pod))
            KV_INDEX_PARTIAL.labels(pod).set(1 if stream.partial else 0)

    def bound(self, records: Iterable[PodRecord]) -> None:
        """Each followed pod's index held to the blocks its engine has (its page's `num_gpu_blocks`): blocks
        past that are ones whose removal was lost; forgetting them is counted (`kind="beyond_engine"`)."""
        if self.subscriber is None:
            return
        by_pod: dict[str, list[str]] = {}
        for key in self.subscriber.streams:
            by_pod.setdefault(rank_pod(key), []).append(key)
        for record in records:
            blocks = record.metrics.num_gpu_blocks if record.metrics is not None else None
            for key in by_pod.get(record.pod, ()) if blocks else ():  # (each rank: an engine with that many)
                forgotten = self.subscriber.index.bound(key, blocks)
                if forgotten:
                    KV_EVENTS_DROPPED.labels(key, "beyond_engine").inc(forgotten)

    async def share(self, client, prefix: str, holder: str) -> None:
        """This interval's changes into the stream; every few seconds a snapshot the stream continues from. Both
        written only while `holder` (this worker's lease term) still holds the lease (`lease.fenced_write`)."""
        if self.subscriber is None:
            return
        self.export()
        index = self.subscriber.index
        changes = index.take_changes()
        if changes or self._number == 0:  # (a term's first, even empty: the snapshot's place in the stream)
            number, self._number = self._number, self._number + 1
            try:
                written = await fenced_write(client, prefix, holder, "xadd", changes_key(prefix), {
                    "e": self._epoch, "n": number, "c": encode_changes(changes)}, maxlen=STREAM_LENGTH)
            except Exception:
                # Those changes are lost: the number they had is a gap readers notice, and the next snapshot,
                # written as soon as Redis answers, holds them.
                self._next_snapshot = 0.0
                raise
            if written is None:  # another worker leads now: it writes; this one will stand by
                self._next_snapshot = 0.0
                return
            self._last_id = _text(written)
        if time.monotonic() >= self._next_snapshot:
            self._next_snapshot = time.monotonic() + SNAPSHOT_EVERY_S
            await self._write_snapshot(client, prefix, holder, snapshot_parts(index.snapshot()))
        if time.monotonic() >= self._next_checkpoint and await self.write_checkpoints(client, prefix):
            self._next_checkpoint = time.monotonic() + CHECKPOINT_EVERY_S

    async def _write_snapshot(self, client, prefix: str, holder: str, parts: list[bytes]) -> None:
        """The parts first, one command each, then the hash that names them (`exact_share.snapshot_header`)."""
        header, named = snapshot_header(self._epoch, self._number - 1, self._last_id, parts)
        for j, part in enumerate(named):
            key = snapshot_part_key(prefix, header["g"], j)
            if await fenced_write(client, prefix, holder, "set", key, {"v": part}, SNAPSHOT_PART_TTL_MS) is None:
                return  # another worker leads now
        await fenced_write(client, prefix, holder, "hreplace", snapshot_key(prefix), header)

    async def write_checkpoints(self, client, prefix: str) -> bool:
        """Each followed pod's checkpoint whose stream moved since this term last wrote it (False: none had, try
        again next interval); a term's first call also drops the checkpoints of pods no longer followed. Any
        writer's checkpoint is safe to resume: the pod's replay proves or refutes it."""
        if self.subscriber is None:
            return False
        streams = self.subscriber.streams
        fresh = {}
        for pod in streams:
            checkpoint = self.subscriber.checkpoint(pod)
            if checkpoint is None or self._checkpointed.get(pod) == (checkpoint.seq, checkpoint.ts):
                continue
            fresh[pod] = (checkpoint.seq, checkpoint.ts), encode_checkpoint(checkpoint)
        key = checkpoints_key(prefix)
        if not self._pruned:
            gone = [name for name in map(_text, await client.hkeys(key)) if name not in streams]
            if gone:
                await client.hdel(key, *gone)
            self._pruned = True
        if not fresh:
            return False
        pods = list(fresh)
        for start in range(0, len(pods), CHECKPOINTS_PER_WRITE):  # one pod's can be a few hundred KB
            batch = pods[start:start + CHECKPOINTS_PER_WRITE]
            await client.hset(key, mapping={pod: fresh[pod][1] for pod in batch})
            self._checkpointed.update((pod, fresh[pod][0]) for pod in batch)
        return True


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
