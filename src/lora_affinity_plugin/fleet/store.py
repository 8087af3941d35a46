"""Pod records in Redis: the one place the scraper and every proxy replica meet.

Layout (all keys share the `{prefix}` hash tag so pipelines stay on one Redis Cluster slot):
    {prefix}:pod:<pod key>  ->  JSON record, expires after `metrics_ttl_ms`
A record carries the metrics or the reason a pod could not be read, and when it was scraped.

Records outlive the process that wrote them and are read by other versions during a rolling upgrade.
Every record says its format (`v`); readers ignore fields they do not know and default the ones a
record lacks, so a newer writer never drains an older fleet. Format 1 readers (the plugin before `v`
existed) build `PodMetrics` from the `metrics` object as it is: new fields go at the top level, never
inside `metrics`, until no format 1 reader is left. `scraped_at` is on Redis's clock (`TIME`) from
format 2 on, so proxies on other hosts measure ages without trusting their clocks to agree (`clock.py`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Sequence

from ..config.connection import async_client
from ..config.settings import Settings
from ..routing.podstate import RATE_BOUNDS, PodCounters, PodMetrics, PodRates


@dataclass(frozen=True, slots=True)
class PodRecord:
    """What the scraper last learnt about one pod."""

    pod: str
    scraped_at: float
    """Unix time of the scrape (seconds)."""
    metrics: PodMetrics | None
    error: str | None = None
    scraper: str | None = None
    """`worker#token` of the scraper that wrote it."""
    rates: PodRates | None = None
    """The pod's speeds as the scraper learned them from its histograms (None: not learned)."""
    proven: bool = False
    """Its page has parsed as a known model server's, now or at an earlier scrape: a pod the plugin routes.
    A deployment that never was one (a hosted provider's api_base) stays LiteLLM's."""
    degraded: tuple[str, ...] = ()
    """What a page that parsed in part lacked or got wrong: the pod is routed on the rest."""

    def __post_init__(self) -> None:
        if self.metrics is not None and not self.proven:  # a page that parsed proves its pod
            object.__setattr__(self, "proven", True)

    @property
    def ok(self) -> bool:
        return self.metrics is not None

    def age_s(self, now: float | None = None) -> float:
        return max(0.0, (time.time() if now is None else now) - self.scraped_at)

    def to_json(self) -> bytes:
        body: dict[str, Any] = {"v": FORMAT, "pod": self.pod, "scraped_at": self.scraped_at, "error": self.error,
                                "scraper": self.scraper, "proven": self.proven}
        if self.degraded:
            body["degraded"] = list(self.degraded)
        if self.metrics is not None:
            metrics = asdict(self.metrics)
            for key, value in metrics.items():
                if isinstance(value, frozenset):
                    metrics[key] = sorted(value)
            body["metrics"] = metrics
        if self.rates is not None:
            body["rates"] = self.rates.to_dict()
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> PodRecord:
        """Any format's record: unknown fields ignored, missing ones defaulted. KeyError/ValueError/TypeError
        only when it names no pod or no scrape time."""
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("a pod record is a JSON object")
        metrics = _metrics(body.get("metrics"))
        degraded = body.get("degraded")
        return cls(pod=str(body["pod"]), scraped_at=float(body["scraped_at"]), metrics=metrics,
                   error=_text(body.get("error")), scraper=_text(body.get("scraper")), rates=_rates(body.get("rates")),
                   proven=body.get("proven") is True,
                   degraded=tuple(str(d)[:200] for d in degraded[:16]) if isinstance(degraded, list) else ())


FORMAT = 2
"""The record format this version writes (`v`). 1: no `v` field, scraped_at on the scraper's own clock."""

_SETS = frozenset({"running_lora_adapters", "waiting_lora_adapters", "loaded_lora_adapters", "model_names"})
_METRICS_FIELDS = {f.name: f.default for f in fields(PodMetrics)}
_COUNTER_FIELDS = frozenset(f.name for f in fields(PodCounters))


def _metrics(body: Any) -> PodMetrics | None:
    """`PodMetrics` from what a record holds: the fields this version knows, each checked for its type
    (a field another version means differently falls back to its default, never the whole record). A number
    no server reports (not finite, negative, a KV usage past 1) makes the metrics unusable: that pod is left
    out until a good record comes, where a default would route it as an idle pod."""
    if not isinstance(body, dict):
        return None
    values: dict[str, Any] = {}
    for name, default in _METRICS_FIELDS.items():
        if name not in body or name == "counters":
            continue
        value = body[name]
        if name in _SETS:
            if isinstance(value, list):
                values[name] = frozenset(str(v)[:256] for v in value[:1024])
        elif isinstance(default, float):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if not 0.0 <= value <= _MAX.get(name, math.inf) * 1.01 or not math.isfinite(value):
                    return None
                values[name] = min(float(value), _MAX.get(name, math.inf))  # (rounding past 1: 1)
        elif name == "engine":
            if isinstance(value, str):
                values[name] = value[:64]
        elif isinstance(value, int) and not isinstance(value, bool):
            if value < 0:
                return None
            values[name] = value
        elif value is None and default is None:
            values[name] = value
    counters = body.get("counters")
    if isinstance(counters, dict):
        known = {k: float(v) for k, v in counters.items()
                 if k in _COUNTER_FIELDS and isinstance(v, (int, float)) and not isinstance(v, bool)
                 and math.isfinite(v) and v >= 0}
        values["counters"] = PodCounters(**known)
    return PodMetrics(**values)


_MAX = {"kv_cache_usage": 1.0}
"""Upper bounds of the float fields that have one."""


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _rates(body: Any) -> PodRates | None:
    """Rates from a record, held within `RATE_BOUNDS` here too (records may come from any scraper); unreadable
    ones are dropped (the pod is routed at the default rates), never the record."""
    if not isinstance(body, dict):
        return None
    base = PodRates()
    try:
        return PodRates.bounded(bool(body.get("learned")),
                                **{name: float(body.get(name, getattr(base, name))) for name in RATE_BOUNDS})
    except (TypeError, ValueError):
        return None


def pod_key(settings: Settings, pod: str) -> str:
    return f"{{{settings.key_prefix}}}:pod:{pod}"


def connect(settings: Settings, *, blocking: bool = False) -> Any:
    """An asyncio client for `redis_url` (a server, Sentinel or Cluster) with short timeouts: the plugin
    must fall back, never hang a request. `blocking` clients (pub/sub) wait without a read timeout."""
    return async_client(settings.redis_url, max(0.05, settings.scrape_timeout_ms / 1000), blocking=blocking)


def decode_records(pods: Sequence[str], raws: Sequence[bytes | None]) -> dict[str, PodRecord]:
    out: dict[str, PodRecord] = {}
    for pod, raw in zip(pods, raws):
        if raw is None:
            continue
        try:
            out[pod] = PodRecord.from_json(raw)
        except (ValueError, TypeError, KeyError):
            continue
    return out
