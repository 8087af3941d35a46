"""`lora-affinity bench --scenario parse`: our parser vs prometheus_client's full parse, same page, same run."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from ..parsing import parse_metrics

REFERENCE_PAGE = "synthetic_full_page_v1_48k.txt"


def _find_page() -> Path:
    here = Path(__file__).resolve()
    for root in (here.parents[3] / "tests" / "fixtures" / "vllm-metrics", here.parents[4] / "shared" / "fixtures" / "vllm-metrics"):
        if (root / REFERENCE_PAGE).exists():
            return root / REFERENCE_PAGE
    raise SystemExit(f"{REFERENCE_PAGE} not found (run from a clone of the repository)")


def _time(fn, text: str, rounds: int) -> list[float]:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn(text)
        samples.append(time.perf_counter() - start)
    return samples


def run_parse(args: argparse.Namespace) -> int:
    path = _find_page()
    text = path.read_text()
    full = lambda t: list(text_string_to_metric_families(t))  # noqa: E731
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
