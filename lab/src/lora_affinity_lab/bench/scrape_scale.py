"""`lora-affinity bench --scenario scrape-scale`: one scraper worker against many replicas' pages.

256 pages (the 48 KB reference page, the size of a real vLLM page with its histograms) served from
one process, a real Redis, and the scraper scraping them every 200 ms for --seconds, twice in the same
run: with our parser, and with prometheus_client's full parse in its place. Reported per variant: CPU
per scrape (the benchmark process runs nothing but the scraper), cores used, and whether it kept the
interval (cycles done vs due, cycle time p50/p99 against the interval). Goal: <= 1 core, interval kept.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Callable

from lora_affinity_plugin.scraping.parsing import parse_metrics
from ..processes import (
    Proc,
    free_port,
    free_port_range,
    redis_server,
    scratch_dir,
    wait_port,
)
from lora_affinity_plugin.routing.podstate import PodMetrics
from lora_affinity_plugin.scraping.worker import Scraper
from lora_affinity_plugin.config.settings import build_settings
from .parse import full_parse, reference_page

GOAL_CORES = 1.0


async def _measure(scraper: Scraper, seconds: float, interval_s: float) -> dict:
    """Run the scraper's own loop for `seconds`, timing each cycle and the process's CPU."""
    cycles: list[tuple[float, float]] = []  # (start, duration)
    original = scraper.scrape_once

    async def timed():
        started = time.monotonic()
        records = await original()
        cycles.append((started, time.monotonic() - started))
        return records

    scraper.scrape_once = timed
    await original()  # take the lease, open the connections: not measured
    stop = asyncio.Event()
    cpu0, wall0 = time.process_time(), time.monotonic()
    task = asyncio.create_task(scraper.run(stop))
    await asyncio.sleep(seconds)
    stop.set()
    await task
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    durations = sorted(d for _, d in cycles)
    scrapes = len(cycles) * len(scraper.pods)
    return {
        "cycles": len(cycles), "due": int(wall / interval_s), "scrapes": scrapes, "wall_s": wall,
        "cpu_us_per_scrape": cpu / scrapes * 1e6 if scrapes else float("nan"), "cores": cpu / wall,
        "cycle_p50_ms": statistics.median(durations) * 1000, "cycle_p99_ms": durations[int(0.99 * (len(durations) - 1))] * 1000,
    }


def run_scrape_scale(args: argparse.Namespace) -> int:
    count, interval_ms, seconds = args.pods, 200, args.seconds
    page = reference_page()
    workdir = scratch_dir("lora-affinity-scrape-scale-")
    redis_port, base = free_port(), free_port_range(count)
    store = redis_server(redis_port, workdir, allow_embedded=True)
    pages = Proc("pages", [sys.executable, "-m", "lora_affinity_lab.bench.pages", "--base-port", str(base),
                           "--count", str(count), "--page", str(page)], workdir)
    variants: list[tuple[str, Callable[[str], PodMetrics]]] = [
        ("lora-affinity parser", parse_metrics), ("prometheus_client full parse", full_parse)]
    results = {}
    try:
        for i in range(count):
            wait_port(base + i)
        pods = [f"http://127.0.0.1:{base + i}" for i in range(count)]
        print(f"scrape-scale: {count} replicas serving {page.name} ({page.stat().st_size / 1024:.0f} KB), "
              f"one scraper every {interval_ms} ms ({count * 1000 // interval_ms} scrapes/s due), {seconds:g} s per variant")
        for n, (name, parse) in enumerate(variants):
            settings = build_settings({"redis_url": f"redis://127.0.0.1:{redis_port}/0", "key_prefix": f"scale{n}",
                                       "scrape_interval_ms": interval_ms, "scrape_timeout_ms": 1000}, environ={})
            results[name] = asyncio.run(_measure(Scraper(settings, pods, parse=parse), seconds, interval_ms / 1000))
    finally:
        pages.stop()
        store.stop()
    kept = {name: r["cycles"] >= 0.95 * r["due"] and r["cycle_p99_ms"] <= interval_ms for name, r in results.items()}
    print(f"{'variant':<30}{'scrapes/s':>10}{'CPU us/scrape':>14}{'cores':>7}{'cycles/due':>12}"
          f"{'cycle p50/p99 ms':>18}  interval kept")
    for name, r in results.items():
        print(f"{name:<30}{r['scrapes'] / r['wall_s']:>10.0f}{r['cpu_us_per_scrape']:>14.0f}{r['cores']:>7.2f}"
              f"{r['cycles']:>6}/{r['due']:<5}{r['cycle_p50_ms']:>9.0f}/{r['cycle_p99_ms']:<8.0f}  {'yes' if kept[name] else 'no'}")
    (ours_name, _), (full_name, _) = variants
    ours, full = results[ours_name], results[full_name]
    goal = "met" if ours["cores"] <= GOAL_CORES and kept[ours_name] else "missed"
    print(f"CPU per scrape, full parse / ours: {full['cpu_us_per_scrape'] / ours['cpu_us_per_scrape']:.1f}x; "
          f"goal (<= {GOAL_CORES:g} core, interval kept): {goal}")
    return 0
