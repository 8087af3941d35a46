"""Keeps one proxy process current: pod records into its FleetView, and the live settings.

Every `scrape_interval_ms` one Lua call writes this process's in-flight table and reads the settings
key, every pod's record and the peers' in-flight tables together; a pub/sub notice of a new settings
version wakes it early. A lost notice or a reconnect therefore still converges within one interval,
and no request ever waits on Redis. The same loop sweeps in-flight entries no hook released.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Callable

from ..config.live_settings import (
    LiveCopy,
    LiveFollower,
    live_values,
    new_epoch,
    notify_channel,
    settings_key,
)
from ..config.settings import Settings
from ..kv.exact_share import (
    CHANGE_SETS_PER_REFRESH,
    apply_entries,
    changes_key,
    read_snapshot,
    snapshot_key,
    snapshot_part_keys,
)
from ..kv.prefix_index import (
    SHARE_ENTRIES_PER_PROCESS,
    SHARE_MAX_BLOCKS,
    SHARE_STREAM_LENGTH,
    decode_entries,
    encode_entries,
)
from ..telemetry.episodes import Episode
from ..telemetry.metrics import (
    INFLIGHT,
    INFLIGHT_SWEPT,
    INPUTS_DROPPED,
    POD_CHARS_PER_TOKEN,
    REDIS_UP,
    SETTINGS_APPLIED,
    SETTINGS_REJECTED,
    SETTINGS_VERSION,
    SNAPSHOT_AGE,
)
from .clock import RedisClock, redis_seconds
from .discovery import decode_served, served_models_key
from .inflight import (
    REFRESH_SCRIPT,
    applied_key,
    decode_shares,
    encode_share,
    inflight_key,
    members_key,
    prefix_stream_key,
)
from .lease import worker_id
from .store import connect, decode_records, pod_key
from .view import FleetView

logger = logging.getLogger("lora_affinity")


MIN_REDIS = (5, 0)
"""Streams (the shared prefix index) arrived in Redis 5.0; everything else the plugin uses is older."""


async def check_redis_version(client, settings: Settings) -> tuple[int, ...] | None:
    """Log the server's version once, and an error naming what is needed when it is too old."""
    try:
        info = await client.info("server")
        found = str(info.get("redis_version") or info.get("valkey_version") or "")
        version = tuple(int(part) for part in found.split(".")[:2] if part.isdigit())
    except Exception as exc:  # unreachable now (the refresh reports it), or INFO not permitted to this user
        logger.info("could not read the Redis server's version (%s); it needs %d.%d or newer",
                    type(exc).__name__, *MIN_REDIS)
        return None
    if version and version < MIN_REDIS:
        logger.error("Redis at %s is %s; lora-affinity needs %d.%d or newer (streams): routing stays at the "
                     "fallback until it is upgraded", settings.redacted_redis_url(), found, *MIN_REDIS)
    else:
        logger.info("Redis at %s is version %s", settings.redacted_redis_url(), found or "unknown")
    return version


class Follower:
    def __init__(self, base: Settings, fleet: FleetView, pods: Callable[[], list[str]],
                 on_settings: Callable[[Settings], None]) -> None:
        self.base = base
        self.settings = base
        self.fleet = fleet
        self._pods = pods
        self._on_settings = on_settings
        self.live = LiveFollower(base, "proxy", logger)
        self._wake = asyncio.Event()
        self.served_models: frozenset[str] = frozenset()
        """What the pods' /v1/models list, as the scraper last published it (discovery.py)."""
        self.process = worker_id()
        """host:pid:random, like a scraper's id: names this process's in-flight table."""
        self.peers: list[str] = []
        self.pods_seen: set[str] = set()
        """Other processes sharing in-flight tables, as of the last refresh."""
        self.stream_id = "0-0"
        """The last prefix-stream entry read: peers' index entries after it are new."""
        self.kv_epoch: bytes = b""
        self.kv_id = "0-0"
        """The last exact-index change set read (`_follow_exact`)."""
        self.clock = RedisClock()
        """Times read from Redis (scrapes, peers' dispatches, index entries) are on its clock; see `clock.py`."""
        self._redis_down = Episode(logger, f"cannot read pod metrics from Redis at {base.redacted_redis_url()}")
        self._refresh_failing = Episode(logger, "lora-affinity could not apply a refresh from Redis; the last view stays")
        self._bad_snapshot = Episode(logger, "the exact KV index snapshot in Redis cannot be read; its pods stay on the inferred index")
        self._bad_records = Episode(logger, "some pod records in Redis cannot be read; those pods are left out until a good one")
        self._records_read_at = time.monotonic()
        self._records_age_s = 0.0
        """When the last refresh read any pod record, and the oldest one's age then: the snapshot age grows from
        there while none can be read, whatever the cause."""
        self._pod_count: int | None = None
        """Pods the last refresh read (the model list's, `discover_pods`): none means no age to report."""

    async def run(self) -> None:
        client = connect(self.base)
        listener = asyncio.create_task(self._listen(), name="lora-affinity-settings-notify")
        try:
            await self._seed(client)
            while True:
                try:
                    await self.refresh(client)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # bad data in one refresh must not stop the next one
                    self._refresh_failing.fail(f"{type(exc).__name__}: {exc}")
                    logger.debug("refresh failed", exc_info=True)
                else:
                    self._refresh_failing.recover()
                SNAPSHOT_AGE.set(self.snapshot_age_s())
                try:
                    await asyncio.wait_for(self._wake.wait(), self.settings.scrape_interval_ms / 1000)
                except asyncio.TimeoutError:
                    pass
                self._wake.clear()
        finally:
            listener.cancel()
            await client.aclose()

    async def _seed(self, client) -> None:
        """The file's values become the live copy when Redis has none yet; says which Redis it found."""
        await check_redis_version(client, self.base)
        try:
            await client.set(settings_key(self.base.key_prefix),
                             LiveCopy(1, live_values(self.base), 0.0, "seeded from config", new_epoch()).to_json(),
                             nx=True)
        except Exception as exc:
            self._redis_down.fail(type(exc).__name__)

    async def refresh(self, client) -> None:
        self._sweep()
        prefix = self.base.key_prefix
        pods = self._pods()
        self._pod_count = len(pods)
        sharing = self.settings.share_inflight
        peers = self.peers if sharing else []
        reads = [settings_key(prefix), *(pod_key(self.base, p) for p in pods),
                 *(inflight_key(prefix, peer) for peer in peers), served_models_key(prefix)]
        table = encode_share(self.fleet.inflight.counts(), self.fleet.recent_dispatches(),
                             self.fleet.prefixes.sizes(), self.clock.offset_s) if sharing else ""
        ttl_ms = max(1_000, 5 * self.settings.scrape_interval_ms)
        share_prefixes = self.settings.share_prefixes and self.settings.prefix_affinity
        outbox = self.fleet.prefixes.take_outbox(SHARE_MAX_BLOCKS)
        entries = encode_entries([(pod, self.clock.to_redis(at), hashes) for pod, at, hashes in outbox]) \
            if outbox and share_prefixes else ""
        if self.settings.kv_events and self.fleet.held.number is None:
            await self._load_exact(client)
        exact_from = self.kv_id if self.settings.kv_events and self.fleet.held.number is not None else ""
        try:
            sent = time.time()
            members, raws, stream, redis_now, changes = await client.eval(
                REFRESH_SCRIPT, 5 + len(reads), members_key(prefix), inflight_key(prefix, self.process),
                prefix_stream_key(prefix), changes_key(prefix), applied_key(prefix, self.process), *reads, self.process,
                table, ttl_ms, entries, self.stream_id if share_prefixes else "", SHARE_STREAM_LENGTH,
                SHARE_ENTRIES_PER_PROCESS, exact_from, CHANGE_SETS_PER_REFRESH,
                self.live.applied)
            self.clock.observe(redis_seconds(redis_now), sent, time.time())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._redis_down.fail(type(exc).__name__)
            REDIS_UP.set(0)
            return
        self._redis_down.recover()
        REDIS_UP.set(1)
        if raws[0] is not None:
            self._follow_settings(raws[0])
        to_local = self.clock.to_local
        read = raws[1:1 + len(pods)]
        records = {pod: replace(record, scraped_at=to_local(record.scraped_at))
                   for pod, record in decode_records(pods, read).items()}
        unreadable = sum(1 for raw in read if raw is not None) - len(records)
        if unreadable:  # each costs its pod only; counted per refresh while it lasts, said once per episode
            INPUTS_DROPPED.labels("record").inc(unreadable)
            self._bad_records.fail(", ".join(pod for pod, raw in zip(pods, read) if raw is not None and pod not in records))
        else:
            self._bad_records.recover()
        self.fleet.update(records, time.time())
        self.fleet.update_peers(decode_shares(raws[1 + len(pods):-1], -self.clock.offset_s), time.time())
        served = decode_served(raws[-1])
        if served != self.served_models:
            self.fleet.adapters.serve(served)  # what gateways deal over the pods to agree on placements
        self.served_models = served
        self._follow_prefixes(stream)
        if exact_from:
            self._follow_exact(changes)
        self.fleet.maintain(time.time())
        own = self.process.encode()
        self.peers = [m.decode() for m in members if m != own] if sharing else []
        if records:
            self._records_read_at, self._records_age_s = time.monotonic(), max(r.age_s() for r in records.values())

    def snapshot_age_s(self) -> float:
        """The oldest pod record's age as of the last refresh that read any, plus the time since; 0 for a proxy
        with no model-server pod to read (hosted providers only: nothing is missing)."""
        if self._pod_count is None:  # (before the first refresh: counted here, once)
            self._pod_count = len(self._pods())
        if not self._pod_count:
            self._records_read_at, self._records_age_s = time.monotonic(), 0.0
            return 0.0
        return self._records_age_s + time.monotonic() - self._records_read_at

    def _follow_prefixes(self, stream: list) -> None:
        """Peers' new index entries into ours (our own come back too: skipped)."""
        own = self.process.encode()
        for entry_id, fields in stream:
            self.stream_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            values = dict(zip(fields[::2], fields[1::2]))
            if values.get(b"p") == own:
                continue
            for pod, at, hashes in decode_entries(values.get(b"e", b"")):
                self.fleet.prefixes.add_shared(pod, hashes, self.clock.to_local(at))

    async def _load_exact(self, client) -> None:
        """The exact index's snapshot, when this process has none or missed a change set (`kv/exact_share.py`); the
        change sets after it come with the next refresh."""
        prefix = self.base.key_prefix
        try:
            snap = await client.hgetall(snapshot_key(prefix))
            keys = snapshot_part_keys(prefix, snap)
            parts = await client.mget(keys) if keys else []
        except asyncio.CancelledError:
            raise
        except (KeyError, ValueError, UnicodeDecodeError) as exc:  # a header naming no readable parts
            self.fleet.held.number = None
            self._bad_snapshot.fail(f"{type(exc).__name__}: {exc}")
            INPUTS_DROPPED.labels("snapshot").inc()
            return
        except Exception as exc:
            self._redis_down.fail(type(exc).__name__)
            return
        if snap:
            try:
                changes, number, self.kv_epoch, self.kv_id = read_snapshot(snap, parts)
                self.fleet.held.load(changes, number)
            except (KeyError, ValueError, UnicodeDecodeError) as exc:  # the pods stay on the inferred index
                self.fleet.held.number = None
                self._bad_snapshot.fail(f"{type(exc).__name__}: {exc}")
                INPUTS_DROPPED.labels("snapshot").inc()
            else:
                self._bad_snapshot.recover()

    def _follow_exact(self, changes: list) -> None:
        """The scraper's change sets since the last refresh, read in the refresh's round trip."""
        last = apply_entries(self.fleet.held, self.kv_epoch,
                             ((entry_id, dict(zip(fields[::2], fields[1::2]))) for entry_id, fields in changes))
        if last is not None:
            self.kv_id = last

    def _sweep(self) -> None:
        swept = self.fleet.sweep(time.time() - self.settings.inflight_timeout_ms / 1000)
        if swept:
            INFLIGHT_SWEPT.inc(swept)
            logger.warning("released %d in-flight request(s) that no LiteLLM hook ended within %d ms",
                           swept, self.settings.inflight_timeout_ms)
        counts = self.fleet.inflight.counts()
        for pod in self.pods_seen | set(counts):
            INFLIGHT.labels(pod).set(counts.get(pod, 0))
        self.pods_seen = set(counts)
        for pod, ratio in self.fleet.prompt_tokens.learned().items():
            POD_CHARS_PER_TOKEN.labels(pod).set(round(ratio, 3))

    def _follow_settings(self, raw: bytes) -> None:
        refused = self.live.refused
        settings = self.live.offer(raw)
        if self.live.refused > refused:
            SETTINGS_REJECTED.inc()
        if settings is None:
            return
        self.settings = settings
        SETTINGS_VERSION.set(self.live.version)
        SETTINGS_APPLIED.inc()
        self._on_settings(settings)

    async def _listen(self) -> None:
        """Pub/sub nudges; any failure just leaves the periodic check to converge."""
        while True:
            client = connect(self.base, blocking=True)
            try:
                await client.initialize()  # a Cluster client learns its slots before it can subscribe
                async with client.pubsub() as pubsub:
                    await pubsub.subscribe(notify_channel(self.base.key_prefix))
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception:
                await asyncio.sleep(1.0)
            finally:
                await client.aclose()

