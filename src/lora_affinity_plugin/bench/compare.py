"""`lora-affinity bench --scenario NAME`: every strategy on the same scenario, side by side, in one run.

Fast mode runs the discrete-event model (seconds per scenario, medians over --seeds). Live mode runs
each strategy against a fresh simulated fleet and real LiteLLM proxy processes (see live.py).
"""

from __future__ import annotations

import argparse

from tqdm import tqdm

from ..sim.policies import STRATEGY_NAMES
from .results import Result, format_table, median_result, write_chart, write_json
from .scenarios import get_scenario, with_overrides

LIVE_DEFAULT = ["per-connection-random", "simple-shuffle", "least-busy", "latency-based-routing",
                "usage-based-routing-v2", "gie-v0.2", "lora-affinity"]


def _strategies(args: argparse.Namespace) -> list[str]:
    if args.strategies:
        return [s.strip() for s in args.strategies.split(",") if s.strip()]
    return list(STRATEGY_NAMES) + ["static-partition"] if args.mode == "fast" else LIVE_DEFAULT


def run_compare(args: argparse.Namespace) -> int:
    scenario = with_overrides(get_scenario(args.scenario), requests=args.requests)
    strategies = _strategies(args)
    print(f"scenario {scenario.name}: {scenario.description}; {scenario.replicas} replicas, "
          f"max_loras {scenario.max_loras}, {scenario.connections} connections, deadline {scenario.deadline_s:.0f} s "
          f"(simulated); mode {args.mode}; gateways {args.gateways}")
    if args.mode == "fast":
        results = _run_fast(scenario, strategies, args)
    else:
        from .live import run_live

        results = run_live(scenario, strategies, args)
    print(format_table(results))
    if args.json_path:
        write_json(results, args.json_path)
        print(f"results written to {args.json_path}")
    chart = write_chart(results, args.chart, f"{scenario.name} ({args.mode} mode)")
    if chart:
        print(f"chart written to {chart}")
    return 0


def _run_fast(scenario, strategies: list[str], args: argparse.Namespace) -> list[Result]:
    from ..sim.fast import run_fast

    seeds = range(args.seed, args.seed + max(1, args.seeds))
    results = []
    with tqdm(total=len(strategies) * len(seeds), desc="fast mode", unit="run", leave=False) as bar:
        for strategy in strategies:
            runs = []
            for seed in seeds:
                runs.append(run_fast(scenario, strategy, seed=seed, gateways=args.gateways))
                bar.update()
            results.append(median_result(runs))
    return results
