"""Seed by seed, the inferred index against the exact one at one rate, in fast mode: how far apart single
seeds' TTFT p90 lie, and in how many seeds the exact rules read higher.

Near the rate where TTFT p90 passes 1 s (the knee) one seed's p90 can be three times another's for the same
rules, so a difference between two medians says little without this spread.

    .venv/bin/python bench-tools/knee_by_seed.py SCENARIO RATE SEEDS [MINUTES]
    # e.g. knee_by_seed.py kv-pressure-rejoin 1 20 10
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from lora_affinity_lab.bench import fast
from lora_affinity_lab.bench.scenarios import at_rate, get_scenario

STRATEGIES = ("lora-affinity", "lora-affinity-exact")


def _one(args: tuple[str, float, float, int]) -> tuple[float, float]:
    """(TTFT p90 in s, hit rate in %) of each strategy on one seed."""
    name, rate, minutes, seed = args
    scenario = at_rate(replace(get_scenario(name), duration_s=minutes * 60), rate)
    out = []
    for strategy in STRATEGIES:
        result = fast.run_fast(scenario, strategy, seed)
        if result.errors:
            raise SystemExit(f"seed {seed}, {strategy}: {result.errors} requests failed; not a result")
        out += [result.ttft_s["p90"], 100 * (result.hit_rate or 0.0)]
    return tuple(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario")
    parser.add_argument("rate", type=float)
    parser.add_argument("seeds", type=int)
    parser.add_argument("minutes", type=float, nargs="?", default=10.0)
    args = parser.parse_args()
    jobs = [(args.scenario, args.rate, args.minutes, seed) for seed in range(1, args.seeds + 1)]
    with ProcessPoolExecutor() as pool:
        rows = list(pool.map(_one, jobs))
    print("seed  inferred: TTFT p90, hit   exact: TTFT p90, hit")
    for seed, (p90_a, hit_a, p90_b, hit_b) in enumerate(rows, start=1):
        print(f"{seed:4d}  {p90_a:8.2f} s, {hit_a:5.1f}%      {p90_b:6.2f} s, {hit_b:5.1f}%")
    spread = [row[0] for row in rows] + [row[2] for row in rows]
    higher = sum(row[2] > row[0] for row in rows)
    print(f"TTFT p90 over the seeds: {min(spread):.2f}-{max(spread):.2f} s; the exact rules higher in {higher} of "
          f"{len(rows)} seeds")


if __name__ == "__main__":
    main()
