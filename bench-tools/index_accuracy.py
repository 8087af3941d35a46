"""How closely the inferred prefix index tracks the engines' caches, in fast mode.

At every decision of the default rules (on the inferred index), compares each pod's inferred match with what
its simulated engine holds at that moment (the `exact-state-oracle`'s reading, in the same unit: the prompt's
blocks), and prints how often they agree: on the chosen pod, on every pod, and on which pod holds the longest
match. Where they agree, an exact index (the engines' KV events) cannot route differently.

    .venv/bin/python bench-tools/index_accuracy.py SCENARIO RATE SEEDS
    # e.g. index_accuracy.py kv-pressure-shared 1.25 5
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ProcessPoolExecutor

from lora_affinity_lab.bench import fast
from lora_affinity_lab.bench.fast import FastObserver
from lora_affinity_lab.bench.policies import OracleRequests
from lora_affinity_lab.bench.scenarios import at_rate, get_scenario


class _Compare(FastObserver):
    def __init__(self) -> None:
        self.oracle: OracleRequests | None = None
        self.rows: list[tuple[bool, bool, bool, int]] = []

    def started(self, engines, policies) -> None:
        self.oracle = OracleRequests()
        self.oracle.engines = engines

    def routed(self, now, request, replica, policy) -> None:
        last = getattr(policy, "last", None)
        if last is None or not request.messages:
            return
        decision, candidates, route = last
        blocks = route.prefix_blocks
        shares = self.oracle.exact_matches(policy.fleet, request.model, request.adapter, request.messages, None,
                                           policy.keys, policy.settings)
        truth = {pod: min(blocks, int(blocks * share)) for pod, share in shares.items()}
        inferred = {pod: route.prefix_matches.get(pod, 0) for pod in truth}
        best_truth = max(truth.values())
        best_inferred = max(inferred.values())
        chosen = decision.pod
        self.rows.append((truth[chosen] == inferred[chosen], truth == inferred,
                          {p for p, n in truth.items() if n == best_truth} == {p for p, n in inferred.items()
                                                                               if n == best_inferred},
                          inferred[chosen] - truth[chosen]))


def _one(args: tuple[str, float, int]) -> list[tuple[bool, bool, bool, int]]:
    name, rate, seed = args
    compare = _Compare()
    fast.run_fast(at_rate(get_scenario(name), rate), "lora-affinity", seed, observer=compare)
    return compare.rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario")
    parser.add_argument("rate", type=float)
    parser.add_argument("seeds", type=int)
    args = parser.parse_args()
    with ProcessPoolExecutor(2) as pool:
        runs = list(pool.map(_one, [(args.scenario, args.rate, s) for s in range(1, args.seeds + 1)]))
    rows = [r for run in runs for r in run]
    over = [d for *_, d in rows if d > 0]
    under = [d for *_, d in rows if d < 0]
    print(f"{args.scenario} at {args.rate:g} req/s, lora-affinity (inferred index), seeds 1-{args.seeds}: "
          f"{len(rows)} decisions")
    print(f"  the chosen pod's match right: {sum(r[0] for r in rows) / len(rows):.1%}; every pod's: "
          f"{sum(r[1] for r in rows) / len(rows):.1%}; the same pods hold the longest: {sum(r[2] for r in rows) / len(rows):.1%}")
    print(f"  the chosen pod's match over-counted in {len(over) / len(rows):.1%} (median {statistics.median(over) if over else 0} "
          f"blocks), under-counted in {len(under) / len(rows):.1%} (median {-statistics.median(under) if under else 0})")


if __name__ == "__main__":
    main()
