"""Pod records as format 1 wrote and read them (the plugin before records carried `v`), kept to prove that
format 2 and format 1 processes share one Redis during a rolling upgrade, both ways.

The reader is format 1's: it rebuilds `PodMetrics` from the `metrics` object as it is, so any field it
does not know there makes it drop the record. The writer stamps `scraped_at` with its own clock.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from lora_affinity_plugin.routing.podstate import PodCounters
from lora_affinity_plugin.routing.podstate import PodMetrics

FORMAT1_METRICS = ("num_requests_waiting", "num_requests_running", "kv_cache_usage", "running_lora_adapters",
                   "waiting_lora_adapters", "max_lora", "loaded_lora_adapters", "block_size", "num_gpu_blocks",
                   "model_names", "engine", "counters")
"""The fields of format 1's PodMetrics, in its order."""


def write(pod: str, scraped_at: float, metrics: PodMetrics | None, error: str | None = None,
          scraper: str | None = None) -> bytes:
    body: dict[str, Any] = {"pod": pod, "scraped_at": scraped_at, "error": error, "scraper": scraper}
    if metrics is not None:
        values = {f.name: getattr(metrics, f.name) for f in fields(metrics) if f.name in FORMAT1_METRICS}
        values["counters"] = None
        body["metrics"] = {k: sorted(v) if isinstance(v, frozenset) else v for k, v in values.items()}
    return json.dumps(body, separators=(",", ":")).encode()


def read(raw: bytes) -> dict[str, Any]:
    """What a format 1 proxy made of a record: its fields, or KeyError/TypeError where it dropped it."""
    body = json.loads(raw)
    metrics = body.get("metrics")
    if metrics is not None:
        for key in ("running_lora_adapters", "waiting_lora_adapters", "loaded_lora_adapters", "model_names"):
            metrics[key] = frozenset(metrics.get(key) or ())
        counters = metrics.get("counters")
        metrics["counters"] = PodCounters(**counters) if counters else None
        unknown = set(metrics) - set(FORMAT1_METRICS)
        if unknown:  # format 1's PodMetrics(**metrics) raised TypeError here
            raise TypeError(f"unexpected keyword argument {sorted(unknown)[0]!r}")
        metrics = PodMetrics(**metrics)
    return {"pod": body["pod"], "scraped_at": float(body["scraped_at"]), "metrics": metrics,
            "error": body.get("error"), "scraper": body.get("scraper")}
