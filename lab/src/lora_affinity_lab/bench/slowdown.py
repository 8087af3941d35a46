"""`bench --scenario slowdown`: a replica drops to half speed mid-run; who notices, and how fast.

Fast mode, open-loop Poisson arrivals of the LoRA `poisson` scenario's traffic (12 adapters, long
unique prompts and the seed's question in turn). At `SLOW_AT_S` replica 0 runs at half speed (what the
live simulator's `/control` endpoint does), no setting changes. Reported per strategy: replica 0's
share of new requests before, in the 30 simulated seconds after, and later; "proportionate" is its
share of the fleet's capacity (0.5 / 5.5 = 9.1% on 6 replicas). Medians over `--seeds`.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from .fast import DispatchLog, run_fast
from .scenarios import get_scenario

SLOW_AT_S = 100.0
WINDOW_S = 30.0
STRATEGIES = ["simple-shuffle", "least-busy", "gie-v0.2", "lora-affinity-v1", "lora-affinity"]


def shares(dispatches: list[tuple[float, int]], replica: int = 0) -> tuple[float, float, float]:
    """The replica's share of requests dispatched before the slowdown, in the window after, and later."""
    def share(lo: float, hi: float) -> float:
        sent = [r for t, r in dispatches if lo <= t < hi]
        return sum(1 for r in sent if r == replica) / len(sent) if sent else 0.0

    return (share(0.0, SLOW_AT_S), share(SLOW_AT_S, SLOW_AT_S + WINDOW_S),
            share(SLOW_AT_S + WINDOW_S, float("inf")))


def run_slowdown(args: argparse.Namespace) -> int:
    rate = args.rate or 2.0
    base = get_scenario("poisson")
    scenario = replace(base, arrival_rate=rate, requests=int(rate * 250), prompt_shape="mix",
                       slowdown=(SLOW_AT_S, 0, 0.5))
    strategies = [s.strip() for s in args.strategies.split(",")] if args.strategies else STRATEGIES
    speeds = [0.5] + [1.0] * (scenario.replicas - 1)
    fair = speeds[0] / sum(speeds)
    print(f"slowdown: {scenario.replicas} replicas, Poisson {rate:g} req/s, prompts mix; replica 0 to half speed at "
          f"{SLOW_AT_S:.0f} s (simulated); medians of {args.seeds} seeds; proportionate share after: {fair:.1%}")
    print(f"{'strategy':<20} {'before':>8} {'first 30 s':>11} {'later':>8} {'completed':>10} {'TTFT p90 s':>11}")
    for strategy in strategies:
        rows = []
        for seed in range(args.seed, args.seed + max(1, args.seeds)):
            dispatched = DispatchLog()
            result = run_fast(scenario, strategy, seed=seed, observer=dispatched)
            rows.append((*shares(dispatched.log), result.completed, result.ttft_s.get("p90", 0.0)))
        med = [statistics.median(col) for col in zip(*rows)]
        print(f"{strategy:<20} {med[0]:>8.1%} {med[1]:>11.1%} {med[2]:>8.1%} {med[3]:>10.0f} {med[4]:>11.2f}")
    return 0
