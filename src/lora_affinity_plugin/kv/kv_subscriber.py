"""Following every pod's KV-cache events: one SUB socket per pod, gaps filled from its replay socket.

Each batch carries its sequence number. In order, a batch is applied to the `ExactIndex`. A gap (a message
lost, a slow subscriber past the publisher's high-water mark) asks the pod's replay socket for everything
from the first missing number, applies that, and goes on; what the pod no longer buffers is lost, and the
pod is marked `partial` until its cache is known whole again (an `AllBlocksCleared`): the proxies are told,
and count what they sent there too. A pod quiet for a second is asked for anything after its last batch, so a
lost last message is not missed until the next one. A sequence that starts over is a restarted server: its
blocks are forgotten. A pod given a checkpoint
(`kv_checkpoint.py`: where a scraper before this one stood) is resumed from it when its replay socket proves the
same server, unbroken, and joined afresh otherwise. Runs in the scraper worker that holds the lease, and in one
standby.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from .exact_index import ExactIndex
from .kv_checkpoint import PodCheckpoint
from .kv_events import (
    END_SEQ,
    AllBlocksCleared,
    KVEventFormatError,
    decode_batch,
    sequence_bytes,
    sequence_of,
)

logger = logging.getLogger("lora_affinity.kv_events")

CATCH_UP_AFTER_S = 1.0
"""A pod silent this long is asked for anything after its last batch (one small request to its replay socket)."""
FOLLOWER_RESTART_S = 1.0
"""A pod's follower that ended by an error starts again after this long."""
REPLAY_TIMEOUT_S = 2.0
"""How long a replay may stay silent before the pod's index is marked partial and the stream followed on. A
silence, not a total: a long gap replays for as long as batches keep coming, however busy this host is."""


@dataclass(frozen=True, slots=True)
class EventEndpoints:
    publisher: str
    """The pod's PUB socket, e.g. `tcp://10.0.0.7:5557`."""
    replay: str | None = None
    """Its ROUTER socket for missed batches (None: gaps are lost)."""
    topic: str = ""


@dataclass(slots=True)
class PodStream:
    """Where one pod's stream stands."""

    last_seq: int | None = None
    first_ts: float | None = None
    """Batch 0's timestamp, once applied: a live copy of it that comes after a replay is no restart."""
    last_ts: float | None = None
    """The last batch's timestamp, as the engine wrote it (a checkpoint's proof of which server it came from)."""
    partial: bool = True
    """The index may lack blocks stored before this subscriber could see them (joined late, a gap lost)."""
    batches: int = 0
    events: int = 0
    gaps: int = 0
    """Gaps in the live sequence, each counted once as filled by replay or lost (`gaps_replayed`, `gaps_lost`)."""
    gaps_replayed: int = 0
    gaps_lost: int = 0
    lost: int = 0
    """Times history could not be had (a gap the pod no longer buffered, or a replay it did not answer)."""
    replayed: int = 0
    restarts: int = 0
    resumed: bool = False
    """Started from a checkpoint the pod's replay proved, not from an empty index."""
    bad_payloads: int = 0
    follower_restarts: int = 0
    """Times the pod's follower ended by an error and was started again (`KVEventSubscriber._supervised`)."""
    lag_s: float = 0.0
    """The last batch's age when it was applied (its timestamp against this host's clock: a skew shows here)."""
    last_at: float = field(default=0.0)


class KVEventSubscriber:
    def __init__(self, endpoints: dict[str, EventEndpoints], index: ExactIndex | None = None,
                 context: zmq.asyncio.Context | None = None,
                 checkpoints: dict[str, PodCheckpoint] | None = None) -> None:
        self.endpoints = dict(endpoints)
        self.index = index or ExactIndex()
        self.streams: dict[str, PodStream] = {pod: PodStream() for pod in endpoints}
        self._checkpoints = dict(checkpoints or {})
        """Per pod, where an earlier scraper stood: tried once, when the pod's stream is first followed."""
        self._ctx = context or zmq.asyncio.Context.instance()
        self._stop: asyncio.Event | None = None
        self._tasks: dict[str, asyncio.Task] = {}

    def add(self, pod: str, endpoints: EventEndpoints, checkpoint: PodCheckpoint | None = None) -> None:
        """Follow one more pod (one the scraper has just proven), now if running, else from `run`."""
        if pod in self.endpoints:
            return
        self.endpoints[pod] = endpoints
        self.streams[pod] = PodStream()
        if checkpoint is not None:
            self._checkpoints[pod] = checkpoint
        if self._stop is not None:
            self._tasks[pod] = asyncio.create_task(self._follow(pod, endpoints, self._stop))

    def checkpoint(self, pod: str) -> PodCheckpoint | None:
        """Where the pod's stream stands, for a later scraper to resume (None: nothing applied yet). Not a copy:
        encode it before the next batch is applied."""
        stream, blocks = self.streams.get(pod), self.index.held_by_hash(pod)
        if stream is None or stream.last_seq is None or stream.last_ts is None or blocks is None:
            return None
        return PodCheckpoint(stream.last_seq, stream.last_ts, stream.partial, blocks.block_size, blocks.unresolved,
                             blocks.by_hash, blocks.group, blocks.group_kind)

    async def run(self, stop: asyncio.Event) -> None:
        self._stop = stop
        self._tasks = {pod: asyncio.create_task(self._supervised(pod, ep, stop)) for pod, ep in self.endpoints.items()}
        try:
            await stop.wait()
        finally:
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _supervised(self, pod: str, endpoints: EventEndpoints, stop: asyncio.Event) -> None:
        """`_follow`, started again (after a second) whenever it ends by an error of its own: one bad message or
        bug must not leave a pod's index frozen and still read as exact. Each restart is counted, the pod
        marked partial, and the first of an episode logged with its traceback."""
        stream = self.streams[pod]
        while not stop.is_set():
            try:
                await self._follow(pod, endpoints, stop)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                stream.follower_restarts += 1
                stream.partial = True
                self._share_partial(pod, stream)
                if stream.follower_restarts == 1 or stream.follower_restarts % 100 == 0:
                    logger.warning("KV events of %s: the follower stopped (%s: %s); started again, the pod's index "
                                   "is partial (restart %d)", pod, type(exc).__name__, exc, stream.follower_restarts,
                                   exc_info=stream.follower_restarts == 1)
                try:
                    await asyncio.wait_for(stop.wait(), FOLLOWER_RESTART_S)
                except asyncio.TimeoutError:
                    pass

    async def _follow(self, pod: str, endpoints: EventEndpoints, stop: asyncio.Event) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, endpoints.topic.encode())
        sub.connect(endpoints.publisher)
        stream = self.streams[pod]
        try:
            # What the pod buffered before this subscriber connected: from an earlier scraper's checkpoint when
            # the pod proves it, else its whole history when it still holds batch 0 (then the index is exact).
            checkpoint = self._checkpoints.pop(pod, None)
            if checkpoint is None or not await self._resume(pod, endpoints, stream, checkpoint):
                await self._replay(pod, endpoints, stream, 0, joining=True)
            self._share_partial(pod, stream)
            quiet_since = time.monotonic()
            while not stop.is_set():
                if not await sub.poll(200):
                    if time.monotonic() - quiet_since >= CATCH_UP_AFTER_S:
                        # Nothing for a while: ask for anything after the last batch, in case the last ones were
                        # lost (a subscriber still connecting, a dropped message) and no later one shows the gap.
                        await self._replay(pod, endpoints, stream, 0 if stream.last_seq is None else stream.last_seq + 1,
                                           joining=stream.last_seq is None, catch_up=True)
                        self._share_partial(pod, stream)
                        quiet_since = time.monotonic()
                    continue
                quiet_since = time.monotonic()
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    stream.bad_payloads += 1
                    continue
                await self._receive(pod, endpoints, stream, sequence_of(frames[1]), frames[2])
                self._share_partial(pod, stream)
        finally:
            sub.close(linger=0)

    async def _receive(self, pod: str, endpoints: EventEndpoints, stream: PodStream, seq: int, payload: bytes) -> None:
        last = stream.last_seq
        if last is not None and seq <= last:
            ts = _timestamp(payload)
            later = ts is not None and stream.last_ts is not None and ts > stream.last_ts
            if seq != 0 and not later and not self._restarted(payload):
                return  # already applied (from a replay)
            if seq == 0 and stream.first_ts is not None and ts == stream.first_ts:
                return  # this server's first batch again: sent live while a replay brought it
            # Batch 0, a clear, or a lower number on a batch newer than the last applied: a new server. Its
            # earlier batches, when this is not its batch 0, are unknown: `_apply` marks the pod partial.

            stream.restarts += 1
            logger.info("KV events of %s start over at %d: the server restarted; its blocks are forgotten", pod, seq)
            self.index.clear(pod)
            stream.last_seq = None
            last = None
        if last is not None and seq > last + 1:
            stream.gaps += 1
            lost_before = stream.lost
            await self._replay(pod, endpoints, stream, last + 1, until=seq - 1)
            if stream.lost > lost_before:
                stream.gaps_lost += 1
            else:
                stream.gaps_replayed += 1
            if stream.last_seq is not None and seq <= stream.last_seq:
                return
        self._apply(pod, stream, seq, payload)

    def _lose(self, pod: str, stream: PodStream) -> None:
        """Batches this pod sent are lost for good: the removals among them may be, so its index forgets what it
        can no longer vouch for (blocks the engine may have dropped), and is partial: proxies count their
        inferred index for it until the pod clears its cache. An index that claims less is never wrong in
        the way that sends requests to a cache that no longer holds their prompt."""
        stream.partial = True
        stream.lost += 1
        self.index.clear(pod)
        self.index.track(pod)

    def _share_partial(self, pod: str, stream: PodStream) -> None:
        """The stream's `partial`, onto the index the proxies share (a change only when it flips)."""
        self.index.set_partial(pod, stream.partial)

    @staticmethod
    def _restarted(payload: bytes) -> bool:
        try:
            events = decode_batch(payload).events
        except KVEventFormatError:
            return False
        return bool(events) and isinstance(events[0], AllBlocksCleared)

    def _apply(self, pod: str, stream: PodStream, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except KVEventFormatError as exc:
            stream.bad_payloads += 1
            if stream.bad_payloads == 1:
                logger.warning("KV events of %s: batch %d unreadable (%s); the pod's index is partial", pod, seq, exc)
            stream.partial = True
            stream.last_seq, stream.last_ts = seq, None
            return
        if stream.last_seq is None and seq != 0 and not (batch.events and isinstance(batch.events[0], AllBlocksCleared)):
            stream.partial = True  # joined after the server's first batches: what they stored is unknown
        if any(isinstance(event, AllBlocksCleared) for event in batch.events):
            stream.partial = False  # (anywhere in the batch: what follows it is all the cache holds)
        elif stream.last_seq is None and seq == 0:
            stream.partial = False
        self.index.track(pod)
        try:
            self.index.apply(pod, batch)
        except (TypeError, ValueError, OverflowError) as exc:  # a well-formed batch with values no engine sends
            stream.bad_payloads += 1
            if stream.bad_payloads == 1:
                logger.warning("KV events of %s: batch %d not applicable (%s: %s); the pod's index is partial",
                               pod, seq, exc.__class__.__name__, exc)
            stream.partial = True
        stream.last_seq = seq
        stream.last_ts = batch.ts
        if seq == 0:
            stream.first_ts = batch.ts
        stream.batches += 1
        stream.events += len(batch.events)
        stream.last_at = time.time()
        stream.lag_s = max(0.0, stream.last_at - batch.ts)

    async def _resume(self, pod: str, endpoints: EventEndpoints, stream: PodStream, checkpoint: PodCheckpoint) -> bool:
        """Start from `checkpoint` if the pod's replay holds its batch with its timestamp (the same server, no
        batch since lost), then apply what came after; False leaves the index empty, to be joined afresh."""
        if endpoints.replay is None:
            return False
        if await self._replay(pod, endpoints, stream, checkpoint.seq, resume=checkpoint):
            logger.info("KV events of %s resumed from batch %d (%d blocks), where the last scraper stood", pod,
                        checkpoint.seq, len(checkpoint.blocks))
            return True
        logger.info("KV events of %s: the checkpoint at batch %d is not this server's history (it restarted, or "
                    "its buffer no longer reaches back): joined afresh", pod, checkpoint.seq)
        return False

    def _restore(self, pod: str, stream: PodStream, checkpoint: PodCheckpoint) -> None:
        self.index.restore(pod, checkpoint.blocks, checkpoint.block_size, checkpoint.unresolved, checkpoint.partial,
                           checkpoint.group, checkpoint.group_kind)
        stream.last_seq, stream.last_ts = checkpoint.seq, checkpoint.ts
        stream.partial, stream.resumed = checkpoint.partial, True

    async def _replay(self, pod: str, endpoints: EventEndpoints, stream: PodStream, first: int,
                      joining: bool = False, catch_up: bool = False, until: int | None = None,
                      resume: PodCheckpoint | None = None) -> bool:
        """Apply the pod's buffered batches from `first` on; a missing start marks the index partial. `catch_up`:
        a check on a quiet pod, which finds nothing most of the time (no answer is no loss). `until`: the gap's
        last batch; once it is applied the gap is filled, without waiting for the end mark (a busy ROUTER socket
        drops what passes its high-water mark, and the mark comes last). `resume`: the first answer must be
        the checkpoint's own batch (`first`) with its timestamp, else nothing is applied and False returned.
        An answer that stops after some batches is asked again from where it stopped: a ROUTER socket drops what
        passes its high-water mark (1,000 messages) when the subscriber reads slower than the pod sends, and
        vLLM buffers 10,000 batches. Only a request that brings nothing new ends the replay unfinished."""
        if endpoints.replay is None:
            if not joining and not catch_up:
                self._lose(pod, stream)
            return resume is None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoints.replay)
        expected, progressed = first, False
        try:
            await dealer.send_multipart((b"", sequence_bytes(first)))
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await dealer.poll(int(left * 1000)):
                    if resume is not None:
                        return False  # unproven: no answer
                    if progressed and stream.last_seq is not None:  # cut short, not silent: the rest, again
                        progressed, expected = False, stream.last_seq + 1
                        await dealer.send_multipart((b"", sequence_bytes(expected)))
                        deadline = time.monotonic() + REPLAY_TIMEOUT_S
                        continue
                    if catch_up:
                        return True
                    if not joining:
                        logger.warning("KV events of %s: no replay from %s within %.0f s; the pod's index is partial",
                                       pod, endpoints.replay, REPLAY_TIMEOUT_S)
                        self._lose(pod, stream)
                    stream.partial = True
                    return True
                frames = await dealer.recv_multipart()
                deadline = time.monotonic() + REPLAY_TIMEOUT_S
                reply = _replay_reply(frames)
                if reply is None:
                    stream.bad_payloads += 1
                    continue
                seq, payload = reply
                if resume is not None:
                    if seq != first or _timestamp(payload) != resume.ts:
                        return False  # nothing that old buffered (a restart), or another server's batch
                    self._restore(pod, stream, resume)
                    resume, expected = None, seq + 1
                    continue
                if seq == END_SEQ:
                    self.index.track(pod)  # the pod answers: it reports its cache, empty or not
                    if joining and stream.last_seq is None:
                        stream.partial = False  # nothing buffered: it never published, so it stored nothing
                    return True
                if seq != expected and not (joining and expected == first):
                    self._lose(pod, stream)  # the pod no longer buffers what was missed
                if stream.last_seq is not None and seq <= stream.last_seq:
                    continue
                if joining and seq != 0 and stream.last_seq is None:
                    stream.partial = True
                self._apply(pod, stream, seq, payload)
                stream.replayed += 1
                expected, progressed = seq + 1, True
                if until is not None and seq >= until:
                    return True
        finally:
            dealer.close(linger=0)


def _replay_reply(frames: list[bytes]) -> tuple[int, bytes] | None:
    """A replay answer's (sequence, payload), in either layout vLLM has sent to a DEALER: `(b"", seq, payload)`
    up to 0.25, `(b"", topic, seq, payload)` since 0.26 (the end mark's topic empty). None: neither."""
    if len(frames) == 3 and not frames[0] and len(frames[1]) == 8:
        return sequence_of(frames[1]), frames[2]
    if len(frames) == 4 and not frames[0] and len(frames[2]) == 8:
        return sequence_of(frames[2]), frames[3]
    return None


def _timestamp(payload: bytes) -> float | None:
    try:
        return decode_batch(payload).ts
    except KVEventFormatError:
        return None
