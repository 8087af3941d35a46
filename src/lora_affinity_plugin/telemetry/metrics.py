"""The plugin's own Prometheus metrics, in prometheus_client's default registry.

Inside the proxy they appear on LiteLLM's `/metrics` when its Prometheus callback is on; the scraper
serves them with `--metrics-port`. `model_group` is the deployment's `model_name` (a wildcard's
pattern, not each requested name), so its values are bounded by the proxy's config. The dashboard
(deploy/grafana/) and the alerts (deploy/prometheus/) query these names: tests/e2e/test_e2e_prometheus.py
proves each of their queries on a real Prometheus.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

DECISIONS = Counter("lora_affinity_decisions_total", "Routing decisions by rule branch and model group",
                    ["branch", "model_group"])
SHEDS = Counter("lora_affinity_shed_total", "Requests refused with 429 (every pod saturated), by criticality",
                ["criticality", "model_group"])
NO_CAPACITY = Counter("lora_affinity_no_capacity_total", "Requests refused with 503 (no candidate pod), by criticality",
                      ["criticality", "model_group"])
FALLBACKS = Counter("lora_affinity_fallbacks_total", "Requests the plugin could not decide for, left to LiteLLM's own pick, by cause", ["cause"])
for _cause in ("no_metrics", "error"):  # exported at 0 from the start: a rate of nothing is 0, not absent
    FALLBACKS.labels(_cause)
DECISION_SECONDS = Histogram("lora_affinity_decision_seconds", "Time to choose a pod (plugin's own part)",
                             buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 1e-2, 2.5e-2))
SHADOW = Counter("lora_affinity_shadow_total", "Shadow mode: requests LiteLLM routed, by whether the plugin would "
                 "have picked the same pod (agree: yes, no; or shed: it would have refused it)",
                 ["agree", "model_group"])
SHADOW_GAIN = Histogram("lora_affinity_shadow_predicted_gain_seconds",
                        "Shadow mode: the predicted time to first token on LiteLLM's pick minus on the plugin's "
                        "(ttft.py; positive: the plugin's pick was predicted to start sooner)",
                        buckets=(-1.0, -0.1, 0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
SNAPSHOT_AGE = Gauge("lora_affinity_snapshot_age_seconds",
                     "Age of the oldest pod record in the proxy's view; it grows while no record can be read "
                     "(Redis down, the scraper stopped, records expired)")
REDIS_UP = Gauge("lora_affinity_redis_up", "1 while this process's last round trip to Redis succeeded, else 0")
SETTINGS_VERSION = Gauge("lora_affinity_settings_version", "Version of the live settings in force")
SETTINGS_APPLIED = Counter("lora_affinity_settings_changes_applied_total", "Live settings versions applied")
SETTINGS_REJECTED = Counter("lora_affinity_settings_rejected_total", "Live settings versions refused as invalid")
SCRAPE_SECONDS = Histogram("lora_affinity_scrape_duration_seconds", "One scrape cycle over every pod")
SCRAPE_ERRORS = Counter("lora_affinity_scrape_errors_total",
                        "Pages that could not be read, by kind: page (unparsable, too big, HTTP error), partial (read in "
                        "part: the pod is routed on the rest), timeout, connection", ["pod", "kind"])
SCRAPER_LEADER = Gauge("lora_affinity_scraper_leader", "1 while this scraper process holds the lease (it scrapes), else 0")
POD_UP = Gauge("lora_affinity_pod_up", "1 when the pod's last page was read and parsed, else 0 (scraper leader)", ["pod"])
POD_WAITING = Gauge("lora_affinity_pod_requests_waiting", "The pod's waiting requests, last scrape", ["pod"])
POD_RUNNING = Gauge("lora_affinity_pod_requests_running", "The pod's running requests, last scrape", ["pod"])
POD_KV = Gauge("lora_affinity_pod_kv_cache_usage", "The pod's KV-cache use (0-1), last scrape", ["pod"])
POD_ADAPTERS = Gauge("lora_affinity_pod_active_adapters", "Adapters running or waiting on the pod, last scrape", ["pod"])
POD_MAX_LORA = Gauge("lora_affinity_pod_max_lora", "The pod's --max-loras, when its page says", ["pod"])
INFLIGHT = Gauge("lora_affinity_inflight_requests", "Requests this process sent to a pod that have not ended", ["pod"])
POD_CHARS_PER_TOKEN = Gauge("lora_affinity_pod_chars_per_token",
                            "Characters a token on the pod, learned from its engine's prompt token counts "
                            "(learn_chars_per_token; absent until learned)", ["pod"])
POD_REFUSED = Counter("lora_affinity_pod_connection_refused_total",
                      "Requests that could not connect to the pod (it leaves routing until a later scrape reads it)",
                      ["pod"])
INFLIGHT_SWEPT = Counter("lora_affinity_inflight_swept_total", "In-flight entries released by the sweeper (no hook ended them)")
KV_EVENTS_LAG = Gauge("lora_affinity_kv_events_lag_seconds",
                      "Age of the last KV-event batch applied from the pod (its timestamp against the scraper's clock)",
                      ["pod"])
KV_EVENTS_BATCHES = Counter("lora_affinity_kv_events_batches_total", "KV-event batches applied, per pod", ["pod"])
INPUTS_DROPPED = Counter("lora_affinity_inputs_dropped_total",
                         "What a proxy read from Redis and could not use (a pod's record, the exact index's snapshot), "
                         "by kind", ["kind"])
for _kind in ("record", "snapshot"):  # exported at 0 from the start: an alert's increase() sees the first one too
    INPUTS_DROPPED.labels(_kind)
KV_EVENTS_GAPS = Counter("lora_affinity_kv_events_gaps_total",
                         "Gaps in a pod's event sequence, by outcome: replayed (filled from its replay socket) or lost "
                         "(its index is partial until the pod clears its cache)", ["pod", "outcome"])
KV_EVENTS_DROPPED = Counter("lora_affinity_kv_events_dropped_total",
                            "KV-event inputs a pod's follower could not use, by kind: bad (a frame or batch it could not "
                            "read or apply; the pod's index is partial) or restart (its follower ended by an error and "
                            "was started again)", ["pod", "kind"])
KV_INDEX_BLOCKS = Gauge("lora_affinity_kv_index_blocks", "Blocks the exact index holds for the pod", ["pod"])
KV_INDEX_PARTIAL = Gauge("lora_affinity_kv_index_partial",
                         "1 while the pod's exact index may lack blocks its engine holds (its events joined late or a "
                         "gap lost past the replay buffer): proxies count the inferred index too, until the pod clears "
                         "its cache", ["pod"])
