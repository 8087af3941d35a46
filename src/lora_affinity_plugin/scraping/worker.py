"""The scraper worker: every pod's `/metrics`, parsed and written to Redis once per interval.

One pooled HTTP session per event loop (the lesson of pooling the proxy's client: never one client
per call), private to scraping so scrapes never queue behind the proxy's busy streams. It is aiohttp's:
at 256 pods every 200 ms, httpx's pool cost ~9 ms of CPU per scrape against ~0.4 ms for aiohttp's
(`lora-affinity bench --scenario scrape-scale`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Mapping, Sequence

import aiohttp

from ..config.live_settings import LiveFollower, settings_key
from ..config.settings import Settings
from ..fleet.clock import RedisClock
from ..fleet.discovery import model_ids, served_models_key
from ..fleet.lease import (
    LeaseResult,
    hold_standby,
    lease_and_write,
    release_standby,
    worker_id,
)
from ..fleet.pods import discover_pods, pod_marks, token_pods
from ..fleet.store import PodRecord, connect, decode_records, pod_key
from ..routing.podstate import PodMetrics
from ..routing.rates import RateTracker, decode_load
from ..telemetry.episodes import Episode
from ..telemetry.metrics import (
    POD_ADAPTERS,
    POD_KV,
    POD_MAX_LORA,
    POD_RUNNING,
    POD_UP,
    POD_WAITING,
    REDIS_UP,
    SCRAPE_ERRORS,
    SCRAPE_SECONDS,
    SCRAPER_LEADER,
)
from .engines import pod_engines
from .parsing import MetricsPageError, parse_metrics

__all__ = ["Scraper", "parse_metrics", "MetricsPageError"]

logger = logging.getLogger("lora_affinity.scraper")

STANDBY_READ_S = 5.0
"""With KV events on, how often a standby asks for the standby role (held 3 times as long) and, holding it, reads
the leader's records for the pods it proved (then follows their events)."""


class _LoopSession:
    """One aiohttp session (a keep-alive pool) per event loop: recreated if closed or used from another loop."""

    def __init__(self, pool_size: int) -> None:
        self._pool_size = pool_size
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def get(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._pool_size, limit_per_host=0, ttl_dns_cache=60),
                auto_decompress=True, trust_env=False)
            self._loop = loop
        return self._session

    async def fetch(self, url: str, headers: Mapping[str, str] | None, limit: int, timeout_s: float) -> str:
        """The page's text; MetricsPageError for a non-200 answer or a page over `limit` bytes."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self.get().get(url, headers=headers, allow_redirects=False, timeout=timeout) as resp:
            if resp.status != 200:
                raise MetricsPageError(f"HTTP {resp.status} from {resp.url.path}")
            if resp.content_length is not None and resp.content_length > limit:
                raise MetricsPageError(f"page larger than max_page_bytes={limit}")
            chunks, size = [], 0
            async for chunk in resp.content.iter_any():
                size += len(chunk)
                if size > limit:
                    raise MetricsPageError(f"page larger than max_page_bytes={limit}")
                chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", errors="replace")

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None


class Scraper:
    """Scrapes a fixed list of pods (from the config, never from requests) into Redis."""

    def __init__(self, settings: Settings, pods: Sequence[str], redis_client=None,
                 parse: Callable[[str], PodMetrics] = parse_metrics, engines: Mapping[str, str] | None = None,
                 token_pods: Iterable[str] = (), marked_pods: Iterable[str] = (), kv_events: Any = None):
        self.base_settings = settings
        self.settings = settings
        self.live = LiveFollower(settings, "scraper", logger)
        self.pods = list(pods)
        for pod in self.pods:  # at 0 from the start, so an alert's increase() sees the first error too
            for kind in ("page", "partial", "timeout", "connection"):
                SCRAPE_ERRORS.labels(pod, kind)
        self._parse = parse
        """For vLLM pages: `parse_metrics`; the scrape-scale benchmark swaps in a full parse to compare."""
        self.engines = dict(engines or {})
        """pod -> model server (`engines.pod_engines`); others are `default_engine`."""
        self._redis = redis_client
        self._http = _LoopSession(max(4, len(self.pods)))
        self._redis_down = Episode(logger, "scraper cannot write to Redis; metrics will age")
        self.worker = worker_id()
        self.leader = False
        self.holder: str | None = None
        self.redis_ok_at: float | None = None
        """When (monotonic) the last lease round trip reached Redis: readiness, and leadership only while writing."""
        self.written_at: float | None = None
        """When (monotonic) this worker last wrote its pods' records, as leader."""
        self.cycles = 0
        self._next_models = 0.0
        self.rates = RateTracker()
        """Each pod's speeds, learned from the deltas of its histograms between this worker's scrapes."""
        self.token_pods = frozenset(token_pods)
        """The pods `metrics_bearer_token` goes to; no other api_base ever receives it."""
        self.proven: set[str] = set(marked_pods)
        """Pods whose page parsed as a model server's (or the operator marked): they stay pods when they fail."""
        self.clock = RedisClock()
        """Records are stamped on Redis's clock (`fleet/clock.py`)."""
        self._last_good: dict[str, PodRecord] = {}
        """Each pod's last fully read record: a page that cannot be read for a moment does not drain the pod."""
        self._adopted = False
        self.kv_events = kv_events
        """`kv_follow.KVEventSharing` when `kv_events` is on: the pods' KV events, followed by the leader and one
        standby, shared by the leader."""
        self._kv_term: str | None = None
        """The lease term (holder and fencing token) the KV events were last shared under."""
        self._next_standby_read = 0.0
        self._kv_standby = False
        """Whether this worker is the standby that follows the KV events (`lease.hold_standby`)."""
        if settings.metrics_bearer_token is not None and not self.token_pods:
            logger.warning("metrics_bearer_token is set but no pod is named for it (metrics_token_pods, or "
                           "model_info.lora_affinity_pod: true): it is sent to none")

    @classmethod
    def for_config(cls, settings: Settings, model_list: Sequence[Mapping[str, Any]], redis_client=None) -> "Scraper":
        """The scraper of a proxy config's `model_list`: its candidate pods, their engines, who gets the token.
        ValueError names a bad `model_info.engine`, or `kv_events` without the extra it needs."""
        model_list = list(model_list)
        marks = pod_marks(model_list)
        pods = discover_pods(model_list, marks)
        kv_events = None
        if settings.kv_events:
            try:
                from .kv_follow import KVEventSharing, event_endpoints
            except ImportError as exc:
                raise ValueError(f"kv_events: following the pods' KV events needs the kv-events extra "
                                 f"(pip install 'lora-affinity-plugin[kv-events]'): {exc}") from None
            kv_events = KVEventSharing(event_endpoints(model_list, pods, settings))
        return cls(settings, pods, redis_client, engines=pod_engines(model_list, settings.default_engine),
                   token_pods=token_pods(pods, marks, settings.metrics_token_pods),
                   marked_pods=[pod for pod, mark in marks.items() if mark], kv_events=kv_events)

    async def _scrape_pod(self, pod: str) -> PodRecord:
        started = time.time()
        scraped_at = self.clock.to_redis(started)
        token = self.settings.metrics_bearer_token
        headers = {"Authorization": f"Bearer {token.get_secret_value()}"} if token and pod in self.token_pods else None
        try:
            text = await self._http.fetch(pod + self.settings.metrics_path, headers, self.settings.max_page_bytes,
                                          self.settings.scrape_timeout_ms / 1000)
            engine = self.engines.get(pod, self.settings.default_engine)
            problems: list[str] = []
            metrics = (self._parse(text) if self._parse is not parse_metrics and engine == "vllm"
                       else parse_metrics(text, engine, problems))
            rates = self.rates.observe(pod, metrics.counters, started, *decode_load(metrics))
            self.proven.add(pod)
            # The counters served their purpose here; the record carries what they taught.
            record = PodRecord(pod=pod, scraped_at=scraped_at, metrics=replace(metrics, counters=None),
                               rates=rates if rates.learned else None, proven=True, degraded=tuple(problems))
            if problems:
                SCRAPE_ERRORS.labels(pod, "partial").inc()
            else:
                self._last_good[pod] = record
            return record
        except MetricsPageError as exc:
            SCRAPE_ERRORS.labels(pod, "page").inc()
            return self._unreadable(pod, scraped_at, str(exc))
        except asyncio.TimeoutError:
            SCRAPE_ERRORS.labels(pod, "timeout").inc()
            return self._failed(pod, scraped_at, "timed out")
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            SCRAPE_ERRORS.labels(pod, "connection").inc()
            return self._failed(pod, scraped_at, f"{type(exc).__name__}: {exc}"[:200])

    def _failed(self, pod: str, scraped_at: float, error: str) -> PodRecord:
        return PodRecord(pod=pod, scraped_at=scraped_at, metrics=None, error=error, proven=pod in self.proven)

    def _unreadable(self, pod: str, scraped_at: float, error: str) -> PodRecord:
        """A pod that answers with a page it cannot be routed on (its queue figures bad or missing): its last
        good figures, at their own age, while they are fresh (the proxies then age them out as usual); a pod
        that answers is not drained by one bad page."""
        last = self._last_good.get(pod)
        if last is None or scraped_at - last.scraped_at > self.settings.stale_after_ms / 1000:
            return self._failed(pod, scraped_at, error)
        return replace(last, degraded=(f"unreadable page, last good figures kept: {error}"[:200],))

    async def scrape_once(self) -> list[PodRecord]:
        """Scrape every pod concurrently and write all records in one round trip, if holding the lease.

        A worker without the lease only tries to take it (one small round trip) and scrapes nothing.
        """
        started = time.perf_counter()
        if self._redis is None:
            self._redis = connect(self.settings)
        if not self.leader and not await self._lease():
            if self.kv_events is not None:
                await self._stand_by_kv_events()
            return []
        if not self._adopted:
            await self._adopt()
        records = await asyncio.gather(*(self._scrape_pod(pod) for pod in self.pods))
        self.cycles += 1
        for record in records:
            _export(record)
        stamped = [replace(r, scraper=self.holder) for r in records]
        await self._lease([(pod_key(self.settings, r.pod), r.to_json()) for r in stamped])
        if self.kv_events is not None:
            self.kv_events.bound(records)
            await self._share_kv_events()
        SCRAPE_SECONDS.observe(time.perf_counter() - started)
        if self.leader and self.settings.list_served_models and time.monotonic() >= self._next_models:
            self._next_models = time.monotonic() + self.settings.models_refresh_ms / 1000
            await self.publish_served_models()
        return records

    async def _share_kv_events(self) -> None:
        if not self.leader:
            await self._stand_by_kv_events()
            return
        if self._kv_term != self.holder:  # this worker's term began since it last shared
            self._kv_term = self.holder
            self.kv_events.take_over()
            if self._kv_standby:
                self._kv_standby, self._next_standby_read = False, 0.0
                try:
                    await release_standby(self._redis, self.settings.key_prefix, self.worker)
                except Exception as exc:  # it lapses on its own
                    self._redis_down.fail(type(exc).__name__)
        await self.kv_events.begin(self._redis, self.settings.key_prefix, self.proven)
        try:
            await self.kv_events.share(self._redis, self.settings.key_prefix, self.holder)
        except Exception as exc:  # the next interval writes again (a proxy that misses a number reloads)
            self._redis_down.fail(type(exc).__name__)

    async def _stand_by_kv_events(self) -> None:
        """Another worker holds the lease. One standby (its own small lease, renewed every few seconds) follows the
        pods the holder proved, read from its records, so that its index is whole if it takes over; it shares
        nothing. Other standbys follow nothing."""
        self._kv_term = None
        if time.monotonic() >= self._next_standby_read:
            self._next_standby_read = time.monotonic() + STANDBY_READ_S
            try:
                self._kv_standby = await hold_standby(self._redis, self.settings.key_prefix, self.worker,
                                                      int(3 * STANDBY_READ_S * 1000))
                if self._kv_standby:
                    records = await self._records_in_redis()
                    self.proven.update(pod for pod, record in records.items() if record.proven)
            except Exception as exc:
                self._redis_down.fail(type(exc).__name__)
        if not self._kv_standby:
            await self.kv_events.stop()
            return
        await self.kv_events.begin(self._redis, self.settings.key_prefix, self.proven)
        self.kv_events.stand_by()

    async def _records_in_redis(self) -> dict[str, PodRecord]:
        """The pods' records as the lease holder last wrote them."""
        return decode_records(self.pods, await self._redis.mget([pod_key(self.settings, p) for p in self.pods]))

    async def _adopt(self) -> None:
        """On taking the lease: what the previous holder learned, from its records (rates, proven pods), so a
        failover or restart starts from it rather than from the defaults."""
        try:
            records = await self._records_in_redis()
        except Exception as exc:
            self._redis_down.fail(type(exc).__name__)
            return
        self._adopted = True
        for pod, record in records.items():
            if record.rates is not None:
                self.rates.seed(pod, record.rates)
            if record.proven:
                self.proven.add(pod)

    async def publish_served_models(self) -> frozenset[str]:
        """The union of the pods' `/v1/models` into Redis; pods that fail are left out (and the key ages)."""
        async def ids(pod: str) -> list[str]:
            try:
                return model_ids(await self._http.fetch(pod + "/v1/models", None, self.settings.max_page_bytes,
                                                        self.settings.scrape_timeout_ms / 1000))
            except (MetricsPageError, asyncio.TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError):
                return []

        served = frozenset(name for names in await asyncio.gather(*(ids(p) for p in self.pods)) for name in names)
        if served:
            try:
                await self._redis.set(served_models_key(self.settings.key_prefix), json.dumps(sorted(served)),
                                      px=3 * self.settings.models_refresh_ms)
            except Exception as exc:
                self._redis_down.fail(type(exc).__name__)
        return served

    async def _lease(self, records: list[tuple[str, bytes]] | None = None) -> bool:
        """Take or renew the lease, writing `records` only while holding it; False when not the leader."""
        try:
            sent = time.time()
            result: LeaseResult = await lease_and_write(
                self._redis, self.base_settings.key_prefix, self.worker, self.settings.scraper_lease_ms,
                self.settings.metrics_ttl_ms, settings_key(self.base_settings.key_prefix), records or ())
            self.clock.observe(result.redis_time, sent, time.time())
        except Exception as exc:  # redis errors of any kind: keep trying every cycle
            self._redis_down.fail(type(exc).__name__)
            REDIS_UP.set(0)
            lapsed = self.redis_ok_at is None or (
                time.monotonic() - self.redis_ok_at > self.settings.scraper_lease_ms / 1000)
            if self.leader and lapsed:  # it cannot write, and its lease has lapsed: it leads no more
                logger.info("lost the scraper lease (Redis unreachable past the lease period)")
                self.leader, self._adopted = False, False
                SCRAPER_LEADER.set(0)
            return self.leader
        self._redis_down.recover()
        REDIS_UP.set(1)
        self.redis_ok_at = time.monotonic()
        if records and result.leader:
            self.written_at = self.redis_ok_at
        if result.leader != self.leader:
            logger.info("%s the scraper lease (%s)", "took" if result.leader else "lost", result.holder)
            self._adopted = False  # a new term: read what the holder before learned
        self.leader, self.holder = result.leader, result.holder
        SCRAPER_LEADER.set(1 if result.leader else 0)
        if result.settings_raw is not None:
            self._follow_settings(result.settings_raw)
        return result.leader

    def _follow_settings(self, raw: bytes) -> None:
        """Interval, timeouts and TTLs follow `thresholds set` too; a copy that does not validate is refused."""
        settings = self.live.offer(raw)
        if settings is not None:
            self.settings = settings

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Scrape every `scrape_interval_ms` until `stop` is set; closes its clients on the way out."""
        stop = stop or asyncio.Event()
        interval = self.settings.scrape_interval_ms / 1000
        logger.info("scraping %d pods every %d ms into %s", len(self.pods), self.settings.scrape_interval_ms,
                    self.settings.redacted_redis_url())
        try:
            while not stop.is_set():
                started = time.monotonic()
                await self.scrape_once()
                delay = interval - (time.monotonic() - started)
                try:
                    await asyncio.wait_for(stop.wait(), timeout=max(0.0, delay))
                except asyncio.TimeoutError:
                    pass
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self.kv_events is not None:
            if self.leader and self._redis is not None:
                try:  # where every pod's stream stands now, for the next scraper (a redeploy resumes it whole)
                    await self.kv_events.write_checkpoints(self._redis, self.settings.key_prefix)
                except Exception as exc:
                    self._redis_down.fail(type(exc).__name__)
            await self.kv_events.stop()
            if self._kv_standby and self._redis is not None:
                self._kv_standby = False
                try:
                    await release_standby(self._redis, self.settings.key_prefix, self.worker)
                except Exception:
                    pass  # it lapses on its own
        await self._http.aclose()
        if self._redis is not None:
            try:
                await self._redis.aclose()
            except Exception:
                pass
            self._redis = None


def _export(record: PodRecord) -> None:
    """The pod's last scrape as gauges on the scraper's /metrics (what the dashboard shows per pod)."""
    m = record.metrics
    POD_UP.labels(record.pod).set(0 if m is None else 1)
    if m is None:
        return
    POD_WAITING.labels(record.pod).set(m.num_requests_waiting)
    POD_RUNNING.labels(record.pod).set(m.num_requests_running)
    POD_KV.labels(record.pod).set(m.kv_cache_usage)
    POD_ADAPTERS.labels(record.pod).set(len(m.running_lora_adapters | m.waiting_lora_adapters))
    if m.max_lora is not None:
        POD_MAX_LORA.labels(record.pod).set(m.max_lora)
