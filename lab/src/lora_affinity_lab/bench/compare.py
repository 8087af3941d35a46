"""`lora-affinity bench --scenario NAME`: every strategy on the same scenario, side by side, in one run.

Fast mode runs the discrete-event model (seconds per scenario, medians over --seeds). Live mode runs
each strategy against a fresh simulated fleet and real LiteLLM proxy processes (see live.py).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from tqdm import tqdm

from .latency import seed_interval
from .policies import STRATEGY_NAMES, bench_overrides, settings_note
from .results import (
    Result,
    format_table,
    machine_warning,
    median_result,
    refusal,
    write_chart,
    write_json,
)
from .scenarios import get_scenario, with_overrides
from .transport import TransportStats, format_transport_table

LIVE_DEFAULT = ["per-connection-random", "simple-shuffle", "least-busy", "latency-based-routing",
                "usage-based-routing-v2", "gie-v0.2", "lora-affinity"]
GATEWAYS_DEFAULT = ["simple-shuffle", "least-busy", "gie-v0.2", "lora-affinity-unshared", "lora-affinity"]
"""With --gateways N: the plugin with and without shared in-flight counts, and the others, all at N."""
GATEWAY_GOAL_LOSS = 0.02


def _strategies(args: argparse.Namespace) -> list[str]:
    if args.strategies:
        return [s.strip() for s in args.strategies.split(",") if s.strip()]
    if args.gateways > 1:
        return GATEWAYS_DEFAULT
    return list(STRATEGY_NAMES) + ["static-partition"] if args.mode == "fast" else LIVE_DEFAULT


def run_compare(args: argparse.Namespace) -> int:
    scenario = with_overrides(get_scenario(args.scenario), requests=args.requests,
                              prompt_shape=getattr(args, "prompt_shape", None),
                              prompt_chars=getattr(args, "prompt_chars", 0) or None)
    if scenario.prompt_shape != "seed" and scenario.open_loop:
        raise SystemExit("--prompt-shape applies to the LoRA scenarios (seed, scarce-slots, zipf, cold, poisson, streaming)")
    strategies = _strategies(args)
    print(f"scenario {scenario.name}: {scenario.description}; {scenario.replicas} replicas, "
          f"max_loras {scenario.max_loras}, {scenario.connections} connections, deadline {scenario.deadline_s:.0f} s "
          f"(simulated); mode {args.mode}; gateways {args.gateways}; prompts {scenario.prompt_shape}"
          + (f" ({scenario.prompt_chars} chars)" if scenario.prompt_shape != "seed" else "")
          + settings_note(args))
    results = _run(scenario, strategies, args, args.gateways)
    if args.gateways > 1 and "lora-affinity" in strategies:
        (one,) = _run(scenario, ["lora-affinity"], args, 1)
        one.strategy = "lora-affinity, 1 gateway"
        results.append(one)
    refused = [reason for r in results if (reason := refusal(r))]
    results = [r for r in results if not refusal(r)]
    print(format_table(results))
    if args.mode == "live":
        print(format_transport_table([(r.strategy, TransportStats.from_dict(r.transport))
                                      for r in results if r.transport]))
    if args.gateways > 1 and "lora-affinity" in strategies:
        print(gateways_summary(results, args.gateways))
    elif against := defaults_against_each(results):
        print(against)
    if args.json_path:
        write_json(results, args.json_path)
        print(f"results written to {args.json_path}")
    chart = write_chart(results, args.chart, f"{scenario.name} ({args.mode} mode)")
    if chart:
        print(f"chart written to {chart}")
    for reason in refused:
        print(f"refused: {reason}", file=sys.stderr)
    for warning in filter(None, map(machine_warning, results)):
        print(f"warning: {warning}", file=sys.stderr)
    return 1 if refused else 0


def gateways_summary(results: list[Result], gateways: int) -> str:
    """Completed requests at N gateways against 1, with and without shared in-flight counts."""
    by_name = {r.strategy: r for r in results}
    one = by_name["lora-affinity, 1 gateway"]
    lines = [f"{gateways} gateways vs 1 (lora-affinity, completed requests; goal: lose <= {GATEWAY_GOAL_LOSS:.0%}):"]
    for name, label in (("lora-affinity", "shared in-flight counts"), ("lora-affinity-unshared", "not shared")):
        r = by_name.get(name)
        if r is None or not one.completed:
            continue
        ratio = r.completed / one.completed
        verdict = "met" if 1 - ratio <= GATEWAY_GOAL_LOSS else "missed"
        lines.append(f"  {label:<24} {r.completed} / {one.completed} = {ratio:.3f} (loss {1 - ratio:.1%}, {verdict}); "
                     f"per-replica served {_cv(r.per_replica):.3f} CV" + _seed_luck(r, one))
    lines.append(f"  1 gateway                {one.completed}; per-replica served {_cv(one.per_replica):.3f} CV")
    return "\n".join(lines)


def defaults_against_each(results: list[Result]) -> str:
    """The defaults' completed requests against each other row's, by the medians over the seeds, with the 95%
    interval seed luck alone gives the ratio (paired by seed); empty under 5 seeds. A table's difference inside the
    interval is not one the run can tell from noise."""
    ours = next((r for r in results if r.strategy == "lora-affinity"), None)
    if ours is None or len(ours.completed_by_seed) < 5:
        return ""
    lines = [f"lora-affinity / each, completed requests over {len(ours.completed_by_seed)} seeds (the seeds' 95% "
             "interval, paired):"]
    for other in results:
        interval = seed_interval(ours.completed_by_seed, other.completed_by_seed) if other is not ours else None
        if interval is not None:
            lines.append(f"  {other.strategy:<24} {ours.completed / other.completed:.3f} "
                         f"({interval[0]:.3f}-{interval[1]:.3f})")
    return "\n".join(lines)


def _seed_luck(gateways: Result, one: Result) -> str:
    """The ratio's 95% interval from seed luck alone (paired by seed), and what it says of the goal: a loss the
    interval puts both within and beyond the goal is not decided by the run."""
    interval = seed_interval(gateways.completed_by_seed, one.completed_by_seed)
    if interval is None:
        return ""
    low, high = interval
    said = ("within the goal" if low >= 1 - GATEWAY_GOAL_LOSS else "beyond the goal" if high < 1 - GATEWAY_GOAL_LOSS
            else "not decided by these seeds")
    return f"; seeds' 95% interval {low:.3f}-{high:.3f}: {said}"


def _cv(counts: list[int]) -> float:
    """Coefficient of variation of per-replica load: 0 is perfectly even."""
    if not counts or not sum(counts):
        return 0.0
    mean = sum(counts) / len(counts)
    return (sum((c - mean) ** 2 for c in counts) / len(counts)) ** 0.5 / mean


def _run(scenario, strategies: list[str], args: argparse.Namespace, gateways: int) -> list[Result]:
    if args.mode == "fast":
        return _run_fast(scenario, strategies, args, gateways)
    from .live import run_live

    return run_live(scenario, strategies, args, gateways)


def _run_fast(scenario, strategies: list[str], args: argparse.Namespace, gateways: int,
              merge: Callable[[list[Result]], Result] = median_result, desc: str = "fast mode",
              overrides: dict | None = None) -> list[Result]:
    """Each strategy over --seeds seeds in fast mode, merged into one row by `merge`; `--set` settings apply to the
    plugin's strategies, as in live mode."""
    from .fast import run_fast

    if overrides is None:
        overrides = bench_overrides(args)
    seeds = range(args.seed, args.seed + max(1, args.seeds))
    results = []
    with tqdm(total=len(strategies) * len(seeds), desc=desc, unit="run", leave=False) as bar:
        for strategy in strategies:
            runs = []
            for seed in seeds:
                runs.append(run_fast(scenario, strategy, seed=seed, gateways=gateways, overrides=overrides))
                bar.update()
            results.append(merge(runs))
    return results
