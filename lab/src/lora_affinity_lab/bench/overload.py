"""`bench --scenario overload`: critical traffic under 1x, 2x and 3x the load the fleet sustains.

Two thirds of the requests are sheddable (`metadata: {"criticality": "sheddable"}`), so critical
traffic alone stays within capacity. Side by side: the plugin with shedding on (sheddable requests
get HTTP 429 when every pod is over the sheddable thresholds) and off, and simple-shuffle. Per class:
served, 429s, other failures, TTFT and end-to-end p50/p90/p99.
"""

from __future__ import annotations

import argparse
import sys

from .latency import median_latency, rates_of
from .policies import bench_overrides
from .results import Result, refusal, write_json
from .scenarios import at_rate, get_scenario

STRATEGIES = ["simple-shuffle", "lora-affinity-noshed", "lora-affinity"]
LABELS = {"lora-affinity": "lora-affinity, shedding on", "lora-affinity-noshed": "lora-affinity, shedding off"}


def run_overload(args: argparse.Namespace) -> int:
    scenario = get_scenario("overload")
    strategies = [s.strip() for s in args.strategies.split(",")] if args.strategies else STRATEGIES
    rates = rates_of(args, scenario)
    base = rates[0]
    overrides = bench_overrides(args)
    print(f"scenario overload: {scenario.description}; {scenario.replicas} replicas; {scenario.duration_s:.0f} s of "
          f"arrivals per rate; mode {args.mode}; rates {rates} req/s"
          + (f"; plugin settings {overrides}" if overrides else "; the plugin's default settings"))
    results: list[Result] = []
    for rate in rates:
        at = at_rate(scenario, rate)
        if args.mode == "fast":
            from .compare import _run_fast as run_seeds

            results += run_seeds(at, strategies, args, 1, merge=median_latency, desc=f"{rate / base:g}x",
                                 overrides=overrides)
        else:
            from .live import run_live

            results += run_live(at, strategies, args, 1)
    refused = [reason for r in results if (reason := refusal(r))]
    results = [r for r in results if not refusal(r)]
    print(format_overload_table(results, base))
    print(overload_summary(results, base))
    if args.json_path:
        write_json(results, args.json_path)
        print(f"results written to {args.json_path}")
    for reason in refused:
        print(f"refused: {reason}", file=sys.stderr)
    return 1 if refused else 0


def _triple(p: dict, scale: float = 1.0, fmt: str = ".2f") -> str:
    return "/".join(format(p[k] * scale, fmt) for k in ("p50", "p90", "p99")) if p else "-"


def format_overload_table(results: list[Result], base: float) -> str:
    head = (f"{'load':>5} {'strategy':<30}{'class':<10}{'served':>7}{'429':>6}{'failed':>7}{'TTFT p50/p90/p99 s':>22}"
            f"{'e2e p50/p90/p99 s':>21}")
    lines = [head, "-" * len(head)]
    for r in results:
        for name, c in r.classes.items():
            lines.append(f"{(r.rate or 0) / base:>4.0f}x {LABELS.get(r.strategy, r.strategy):<30}{name:<10}{c.completed:>7}"
                         f"{c.shed:>6}{c.errors + c.timeouts:>7}{_triple(c.ttft_s):>22}{_triple(c.e2e_s, fmt='.1f'):>21}")
    return "\n".join(lines)


def overload_summary(results: list[Result], base: float) -> str:
    """The goal: with shedding on, critical TTFT p90 at 3x within 2x of 1x, and no critical request failed."""
    ours = sorted((r for r in results if r.strategy == "lora-affinity" and "critical" in r.classes),
                  key=lambda r: r.rate or 0)
    if len(ours) < 2:
        return "(the goal needs lora-affinity at the base rate and at least one multiple)"
    first, last = ours[0].classes["critical"], ours[-1].classes["critical"]
    p90_first, p90_last = first.ttft_s.get("p90", float("inf")), last.ttft_s.get("p90", float("inf"))
    failed = sum(r.classes["critical"].errors + r.classes["critical"].timeouts + r.classes["critical"].shed for r in ours)
    ok = p90_last <= 2 * p90_first and failed == 0
    return (f"  {'met   ' if ok else 'missed'} shedding on: critical TTFT p90 {p90_last:.2f} s at "
            f"{(ours[-1].rate or 0) / base:.0f}x vs {p90_first:.2f} s at 1x ({p90_last / p90_first:.2f}x, goal <= 2x); "
            f"critical requests failed or shed: {failed}")
