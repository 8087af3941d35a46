"""`lora-affinity bench --scenario parse`: our parser vs prometheus_client's full parse, same page, same run."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from lora_affinity_plugin.scraping.parsing import parse_metrics
from lora_affinity_plugin.routing.podstate import PodMetrics

REFERENCE_PAGE = "synthetic_full_page_v1_48k.txt"


def reference_page() -> Path:
    here = Path(__file__).resolve()
    for root in (here.parents[4] / "tests" / "fixtures" / "vllm-metrics", here.parents[5] / "shared" / "fixtures" / "vllm-metrics"):
        if (root / REFERENCE_PAGE).exists():
            return root / REFERENCE_PAGE
    raise SystemExit(f"{REFERENCE_PAGE} not found (run from a clone of the repository)")


def full_parse(text: str) -> PodMetrics:
    """What a scraper without a filtered parser does: every family parsed, then the few it needs kept."""
    values: dict[str, float] = {}
    running: set[str] = set()
    waiting: set[str] = set()
    max_lora = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:lora_requests_info":
                running.update(a for a in sample.labels.get("running_lora_adapters", "").split(",") if a)
                waiting.update(a for a in sample.labels.get("waiting_lora_adapters", "").split(",") if a)
                max_lora = int(sample.labels.get("max_lora", 0)) or None
            elif sample.name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return PodMetrics(num_requests_waiting=int(values.get("vllm:num_requests_waiting", 0)),
                      num_requests_running=int(values.get("vllm:num_requests_running", 0)),
                      kv_cache_usage=values.get("vllm:kv_cache_usage_perc", 0.0),
                      running_lora_adapters=frozenset(running), waiting_lora_adapters=frozenset(waiting), max_lora=max_lora)


def _time(fn, text: str, rounds: int) -> list[float]:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn(text)
        samples.append(time.perf_counter() - start)
    return samples


def run_parse(args: argparse.Namespace) -> int:
    path = reference_page()
    text = path.read_text()
    full = lambda t: list(text_string_to_metric_families(t))  # noqa: E731  (a naive full parse, for comparison)
    ours_all, full_all = [], []
    for _ in range(5):  # interleaved rounds
        ours_all += _time(parse_metrics, text, 400)
        full_all += _time(full, text, 40)
    ours, ref = statistics.median(ours_all) * 1000, statistics.median(full_all) * 1000
    print(f"parse of {path.name} ({len(text) / 1024:.0f} KB), median ms per page")
    print(f"  lora_affinity parse_metrics        {ours:8.3f}")
    print(f"  prometheus_client full text parse  {ref:8.3f}")
    print(f"  ratio                              {ref / ours:8.1f}x faster")
    return 0
