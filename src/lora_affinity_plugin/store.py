"""Pod records in Redis: the one place the scraper and every proxy replica meet.

Layout (all keys share the `{prefix}` hash tag so pipelines stay on one Redis Cluster slot):
    {prefix}:pod:<pod key>  ->  JSON record, expires after `metrics_ttl_ms`
A record carries the metrics or the reason a pod could not be read, and when it was scraped.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from .connection import async_client
from .cost import PodRates
from .rates import PodCounters
from .scheduling import PodMetrics
from .settings import Settings


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

    @property
    def ok(self) -> bool:
        return self.metrics is not None

    def age_s(self, now: float | None = None) -> float:
        return max(0.0, (time.time() if now is None else now) - self.scraped_at)

    def to_json(self) -> bytes:
        body: dict[str, Any] = {"pod": self.pod, "scraped_at": self.scraped_at, "error": self.error,
                                "scraper": self.scraper}
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
        body = json.loads(raw)
        metrics = body.get("metrics")
        if metrics is not None:
            for key in ("running_lora_adapters", "waiting_lora_adapters", "loaded_lora_adapters", "model_names"):
                metrics[key] = frozenset(metrics.get(key) or ())
            counters = metrics.get("counters")
            metrics["counters"] = PodCounters(**counters) if counters else None
            metrics = PodMetrics(**metrics)
        rates = body.get("rates")
        return cls(pod=body["pod"], scraped_at=float(body["scraped_at"]), metrics=metrics, error=body.get("error"),
                   scraper=body.get("scraper"), rates=_rates(rates))


def _rates(body: Any) -> PodRates | None:
    """Rates from a record: bounded here too (records may come from any scraper); unreadable ones are
    dropped (the pod is routed at the default rates), never the record."""
    if not isinstance(body, dict):
        return None

    def bounded(name: str, low: float, high: float, default: float) -> float:
        value = float(body.get(name, default))
        return min(max(value, low), high) if value == value else default

    base = PodRates()
    try:
        return PodRates(bounded("prefill_factor", 0.05, 100.0, base.prefill_factor),
                        bounded("decode_step_s", 1e-4, 10.0, base.decode_step_s),
                        bounded("queue_s_per_request", 1e-4, 60.0, base.queue_s_per_request),
                        bounded("mean_output_tokens", 1.0, 1e6, base.mean_output_tokens), bool(body.get("learned")),
                        bounded("decode_factor", 0.01, 100.0, base.decode_factor))
    except (TypeError, ValueError):
        return None


def pod_key(settings: Settings, pod: str) -> str:
    return f"{{{settings.key_prefix}}}:pod:{pod}"


def connect(settings: Settings, *, blocking: bool = False) -> Any:
    """An asyncio client for `redis_url` (a server, Sentinel or Cluster) with short timeouts: the plugin
    must fall back, never hang a request. `blocking` clients (pub/sub) wait without a read timeout."""
    return async_client(settings.redis_url, max(0.05, settings.scrape_timeout_ms / 1000), blocking=blocking)


async def read_records(client: Any, settings: Settings, pods: Sequence[str]) -> dict[str, PodRecord]:
    """Every known pod's record in one MGET; pods with no (or an unreadable) record are left out."""
    if not pods:
        return {}
    return decode_records(pods, await client.mget([pod_key(settings, pod) for pod in pods]))


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
