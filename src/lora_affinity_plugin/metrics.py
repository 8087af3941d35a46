"""The plugin's own Prometheus metrics, in prometheus_client's default registry.

Inside the proxy they appear on LiteLLM's `/metrics` when its Prometheus callback is on; the scraper
serves them with `--metrics-port`.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

DECISIONS = Counter("lora_affinity_decisions_total", "Routing decisions by rule branch", ["branch"])
SHEDS = Counter("lora_affinity_shed_total", "Sheddable requests refused with 429 (every pod saturated)")
NO_CAPACITY = Counter("lora_affinity_no_capacity_total", "Requests refused with 503 (no candidate pod)")
FALLBACKS = Counter("lora_affinity_fallbacks_total", "Decisions made like simple-shuffle, by cause", ["cause"])
DECISION_SECONDS = Histogram("lora_affinity_decision_seconds", "Time to choose a pod (plugin's own part)",
                             buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3))
SNAPSHOT_AGE = Gauge("lora_affinity_snapshot_age_seconds", "Age of the oldest pod record in the proxy's view")
SETTINGS_VERSION = Gauge("lora_affinity_settings_version", "Version of the live settings in force")
SETTINGS_APPLIED = Counter("lora_affinity_settings_changes_applied_total", "Live settings versions applied")
SETTINGS_REJECTED = Counter("lora_affinity_settings_rejected_total", "Live settings versions refused as invalid")
SCRAPE_SECONDS = Histogram("lora_affinity_scrape_duration_seconds", "One scrape cycle over every pod")
SCRAPE_ERRORS = Counter("lora_affinity_scrape_errors_total", "Pages that could not be read", ["pod"])
INFLIGHT = Gauge("lora_affinity_inflight_requests", "Requests this process sent to a pod that have not ended", ["pod"])
INFLIGHT_SWEPT = Counter("lora_affinity_inflight_swept_total", "In-flight entries released by the sweeper (no hook ended them)")
