"""Writes deploy/grafana/lora-affinity.json, the plugin's Grafana dashboard: `python deploy/grafana/dashboard.py`.

Plain Python, no Grafana library: each panel is a title, its PromQL and a unit, which keeps the queries
readable and lets tests/e2e/test_e2e_prometheus.py evaluate every one of them on a real Prometheus (and
tests/ops/test_alerts.py check the JSON is what this file writes). Works for one proxy or many: every
query aggregates or groups by labels (`instance`, `model_group`, `pod`), never a hard-coded pod.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("lora-affinity.json")
RATE = "$__rate_interval"

# (title, unit, [(PromQL, legend)], description); rows of two panels, in reading order.
PANELS: list[tuple[str, str, list[tuple[str, str]], str]] = [
    ("Decisions per second, by branch and model group", "reqps",
     [(f'sum by (model_group, branch) (rate(lora_affinity_decisions_total{{model_group=~"$model_group"}}[{RATE}]))',
       "{{model_group}} {{branch}}")],
     "Which rule chose the pod: affinity, place, spill, low_queue, high_queue, base_model, prefix..."),
    ("Fallbacks to shuffling per second, by cause", "reqps",
     [(f"sum by (cause) (rate(lora_affinity_fallbacks_total[{RATE}]))", "{{cause}}")],
     "no_metrics: the group's pods had no fresh record; error: the plugin failed and LiteLLM's pick was used."),
    ("Refused per second (429 shed, 503 no capacity), by criticality", "reqps",
     [("sum by (criticality, model_group) (rate({__name__=~\"lora_affinity_(shed|no_capacity)_total\", "
       f'model_group=~"$model_group"}}[{RATE}]))', "{{criticality}} {{model_group}}")],
     "Sheddable requests are refused when every pod is over the critical queue or KV threshold; a critical "
     "one only when no pod can take it (alert LoraAffinityRefusesCriticalTraffic)."),
    ("Decision time (the plugin's own part)", "s",
     [(f"histogram_quantile(0.5, sum by (le) (rate(lora_affinity_decision_seconds_bucket[{RATE}])))", "p50"),
      (f"histogram_quantile(0.99, sum by (le) (rate(lora_affinity_decision_seconds_bucket[{RATE}])))", "p99")],
     "Time to choose a pod, measured inside the proxy."),
    ("Waiting requests per pod", "short",
     [('max by (pod) (lora_affinity_pod_requests_waiting{pod=~"$pod"})', "{{pod}}")],
     "From the scraper's last page of each pod."),
    ("Running requests per pod", "short",
     [('max by (pod) (lora_affinity_pod_requests_running{pod=~"$pod"})', "{{pod}}")], ""),
    ("KV-cache use per pod", "percentunit",
     [('max by (pod) (lora_affinity_pod_kv_cache_usage{pod=~"$pod"})', "{{pod}}")], ""),
    ("Adapters running or waiting per pod (and --max-loras)", "short",
     [('max by (pod) (lora_affinity_pod_active_adapters{pod=~"$pod"})', "{{pod}}"),
      ('max by (pod) (lora_affinity_pod_max_lora{pod=~"$pod"})', "max_lora {{pod}}")],
     "More active adapters than GPU slots means requests wait for a slot."),
    ("Fleet prefix-cache hit rate (vLLM's counters)", "percentunit",
     [(f"sum(rate(vllm:prefix_cache_hits_total[{RATE}])) / sum(rate(vllm:prefix_cache_queries_total[{RATE}]))",
       "hit rate")],
     "Hit / queried prompt tokens over the pods Prometheus scrapes."),
    ("Pods whose page was read (1) or not (0)", "short",
     [('min by (pod) (lora_affinity_pod_up{pod=~"$pod"})', "{{pod}}")],
     "0: the scraper could not read or parse the page; that pod gets no traffic by metrics."),
    ("Scraper lease holder", "short",
     [("max by (instance) (lora_affinity_scraper_leader)", "{{instance}}")],
     "Exactly one scraper process should hold the lease (1)."),
    ("Age of the oldest pod record, per proxy", "s",
     [("max by (instance) (lora_affinity_snapshot_age_seconds)", "{{instance}}")],
     "Past metrics_ttl_ms (10 s by default) a record is not used; past stale_after_ms a pod is a backup."),
    ("Requests in flight per pod (all proxies)", "short",
     [('sum by (pod) (lora_affinity_inflight_requests{pod=~"$pod"})', "{{pod}}")],
     "Sent by the proxies and not ended yet, summed over proxy processes."),
    ("KV events: lag and gaps per pod (when kv_events is on)", "s",
     [('max by (pod) (lora_affinity_kv_events_lag_seconds{pod=~"$pod"})', "lag {{pod}}"),
      (f'max by (pod, outcome) (increase(lora_affinity_kv_events_gaps_total{{pod=~"$pod"}}[{RATE}]))',
       "gaps {{outcome}} {{pod}}")],
     "How old the last applied batch of each pod's KV events is (a growing lag: the subscriber falls behind), and "
     "gaps in its sequence: replayed, or lost (that pod's exact index is partial until it clears its cache). The "
     "lease holder and one standby both follow each pod: the worse of the two is shown, a gap once."),
    ("KV events: pods whose index is partial", "short",
     [('max by (pod) (lora_affinity_kv_index_partial{pod=~"$pod"})', "{{pod}}")],
     "1 while a pod's exact index may lack blocks its engine holds (the scraper joined it past its replay buffer, "
     "or a gap was lost): the proxies count their inferred index for it too, until the pod clears its cache (a "
     "restart). Many partial pods after a scraper redeploy: its checkpoint was not used (see the scraper's log)."),
    ("KV events: inputs dropped per pod, and processes that cannot reach Redis", "short",
     [(f'sum by (pod, kind) (increase(lora_affinity_kv_events_dropped_total{{pod=~"$pod"}}[{RATE}]))',
       "{{kind}} {{pod}}"),
      (f"sum by (kind) (increase(lora_affinity_inputs_dropped_total[{RATE}]))", "proxies: unreadable {{kind}}"),
      ("count(lora_affinity_redis_up == 0) or vector(0)", "processes without Redis")],
     "bad: frames or batches a pod's follower could not read or apply (that pod's index is partial); restart: its "
     "follower ended by an error and was started again. Proxies: pod records and exact-index snapshots in Redis they "
     "could not use (each costs its pod, or sends the proxies back to the inferred index until a good snapshot). "
     "Processes without Redis: proxies and scrapers whose last round trip failed (alert LoraAffinityRedisUnreachable)."),
    ("Settings version, per process", "short",
     [("max by (instance) (lora_affinity_settings_version)", "{{instance}}")],
     "Every proxy and scraper should show the same version within a second of a change."),
]

ANNOTATION = "changes(lora_affinity_settings_version[1m]) > 0"
VARIABLES = {"model_group": "label_values(lora_affinity_decisions_total, model_group)",
             "pod": "label_values(lora_affinity_pod_up, pod)"}


def queries() -> list[str]:
    """Every PromQL the dashboard runs: panels, the annotation and the variables' metrics."""
    return [expr for _, _, targets, _ in PANELS for expr, _ in targets] + [ANNOTATION]


def dashboard() -> dict:
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    panels = []
    for i, (title, unit, targets, description) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title, "description": description, "datasource": datasource,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend, "datasource": datasource}
                        for j, (expr, legend) in enumerate(targets)],
        })
    variables = [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}]
    variables += [{"name": name, "type": "query", "datasource": datasource, "query": query, "refresh": 2,
                   "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}}
                  for name, query in VARIABLES.items()]
    return {
        "title": "lora-affinity", "uid": "lora-affinity", "tags": ["litellm", "vllm", "lora"],
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": variables},
        "annotations": {"list": [{"name": "settings changes", "datasource": datasource, "enable": True,
                                  "expr": ANNOTATION, "iconColor": "orange", "step": "15s",
                                  "titleFormat": "settings version changed on {{instance}}"}]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
