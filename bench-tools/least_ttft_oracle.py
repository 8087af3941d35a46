"""What routing by the least predicted TTFT could reach, with a perfect prediction.

A reference no gateway can run: for each request it copies every simulated replica as it is at that moment
(its queue, its batch, its KV cache and LoRA slots, the output lengths its running requests will reach), adds
the request to the copy, runs the copy forward until the request's first token, and sends the request where
that comes soonest (ties: the fewest requests there; `lab/.../bench/oracle.py`). It sees no future arrival, and
weighs no harm to the requests already there (`forward-oracle`, a strategy of the bench, does). So it bounds what a better TTFT estimate (what llm-d's predicted-latency profile
learns) could win with greedy placement, not what every policy could.

Prints TTFT p90 and completions per rate (medians over seeds), beside the strategies named, in one run; then,
over all runs of each strategy, where it sent requests: the share to replicas slower than the fleet's fastest, and
the adapter requests by where their adapter was on the replica chosen (running there, in a GPU slot, in CPU
memory, or to be loaded from disk).

    .venv/bin/python bench-tools/least_ttft_oracle.py SCENARIO RATES SEEDS [STRATEGY,...] [--minutes M]
    # e.g. least_ttft_oracle.py mixed 4,4.4,5,5.2 10 lora-affinity,lora-affinity-noprefix
    # --minutes: simulated minutes of arrivals per rate (default: the scenario's 1.5, as the bench's)
"""

from __future__ import annotations

import argparse
import collections
import statistics
from concurrent.futures import ProcessPoolExecutor

from lora_affinity_lab.bench import fast
from lora_affinity_lab.bench.fast import FastObserver
from lora_affinity_lab.bench.oracle import LeastTtftOracle
from lora_affinity_lab.bench.policies import policy_names
from lora_affinity_lab.bench.scenarios import SCENARIOS, at_rate, get_scenario, with_overrides
from lora_affinity_lab.sim.engine import ReplicaEngine

NAME = LeastTtftOracle.name


class _Watch(FastObserver):
    """Where requests went."""

    def __init__(self) -> None:
        self.engines: list[ReplicaEngine] = []
        self.where: collections.Counter = collections.Counter()

    def started(self, engines, policies) -> None:
        self.engines.extend(engines)

    def routed(self, now, request, replica, policy) -> None:
        if 0 <= replica < len(self.engines):
            self.where.update(_where(self.engines, replica, request.adapter))


def _one(args: tuple[str, float, int, str, float | None]) -> tuple[float, int, collections.Counter]:
    """TTFT p90, completions, and where the requests went (`_where`)."""
    name, rate, seed, strategy, minutes = args
    scenario = at_rate(with_overrides(get_scenario(name), duration_s=minutes * 60 if minutes else None), rate)
    watch = _Watch()
    result = fast.run_fast(scenario, strategy, seed, observer=watch)
    return result.ttft_s.get("p90", float("nan")), result.completed, watch.where


def _where(engines: list[ReplicaEngine], replica: int, adapter: str | None) -> list[str]:
    engine = engines[replica]
    labels = ["requests"]
    if engine.config.speed < max(e.config.speed for e in engines):
        labels.append("to a slower replica")
    if adapter is not None:
        labels.append("adapter requests")
        if any(s.adapter == adapter for s in (*engine.running, *engine.waiting)):
            labels.append("adapter running there")
        elif adapter in engine.gpu:
            labels.append("adapter in a GPU slot")
        elif adapter in engine.cpu:
            labels.append("adapter in CPU memory")
        else:
            labels.append("adapter loaded from disk")
    return labels


def _rates(text: str) -> list[float]:
    try:
        rates = [float(word) for word in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"RATES must be requests per second separated by commas, not {text!r}")
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"RATES must be positive, not {text!r}")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=[s.name for s in SCENARIOS.values() if s.open_loop],
                        help="an open-loop scenario")
    parser.add_argument("rates", type=_rates, help="requests per second, e.g. 4,4.4,5")
    parser.add_argument("seeds", type=int, help="seeds 1..SEEDS")
    parser.add_argument("strategies", nargs="?", default="lora-affinity", help="beside the oracle, comma-separated")
    parser.add_argument("--minutes", type=float, default=None, help="simulated minutes of arrivals per rate")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error(f"SEEDS must be at least 1, not {args.seeds}")
    unknown = [n for n in args.strategies.split(",") if n not in policy_names()]
    if unknown:
        parser.error(f"unknown strategy {unknown[0]!r}; choose from: {', '.join(policy_names())}")
    names = [NAME, *args.strategies.split(",")]
    where = {strategy: collections.Counter() for strategy in names}
    print(f"{args.scenario}, TTFT p90 in s (completed), medians over seeds 1-{args.seeds}")
    print("rate  " + "".join(f"{n:>26}" for n in names))
    with ProcessPoolExecutor(2) as pool:
        for rate in args.rates:
            cells = []
            for strategy in names:
                runs = list(pool.map(_one, [(args.scenario, rate, s, strategy, args.minutes) for s in range(1, args.seeds + 1)]))
                cells.append(f"{statistics.median(r[0] for r in runs):.2f} ({statistics.median(r[1] for r in runs):g})")
                for run in runs:
                    where[strategy].update(run[2])
            print(f"{rate:<6g}" + "".join(f"{c:>26}" for c in cells), flush=True)
    print("where the requests went, all runs:")
    for strategy, counts in where.items():
        adapters = counts["adapter requests"] or 1
        parts = [f"{100 * counts['to a slower replica'] / (counts['requests'] or 1):.0f}% to a slower replica"] + [
            f"{label} {100 * counts[label] / adapters:.0f}%" for label in
            ("adapter running there", "adapter in a GPU slot", "adapter in CPU memory", "adapter loaded from disk")]
        print(f"  {strategy:<24}" + "; ".join(parts))


if __name__ == "__main__":
    main()
