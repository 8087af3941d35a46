"""Strategies side by side on given variant rows, each at a given rate, paired by seed against the last strategy.

`bench --scenario variants` finds each variant's knee before it measures; this measures rows whose rates are known
(docs/benchmarks.md names each row `family#seed (rate)`), so a change is judged on the same rows it was judged on
before. Per row: each strategy's median TTFT p90 over the seeds, how many seeds passed 2 s, and the geometric mean
over seeds of its TTFT p90 against the last strategy's on the same seed ("paired"); then the paired figure per
family. A strategy may carry plugin settings: `name@setting=value;setting=value` (values read as JSON).

    .venv/bin/python bench-tools/variant_rows.py ROWS STRATEGIES SEEDS
    ROWS: family#seed@rate,...  or  docs  (every `family#seed (rate)` row of docs/benchmarks.md)
    e.g.  bench-tools/variant_rows.py docs 'lora-affinity,lora-affinity@learn_chars_per_token=false' 15
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from collections import defaultdict
from multiprocessing import Pool
from pathlib import Path

from lora_affinity_lab.bench.fast import run_fast
from lora_affinity_lab.bench.scenarios import at_rate
from lora_affinity_lab.bench.variants import named

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def parse_rows(spec: str) -> list[str]:
    if spec == "docs":
        found = re.findall(r"^\| ([a-z-]+#[0-9]+) \(([0-9.]+)\)", DOCS.read_text(), re.M)
        return sorted({f"{name}@{rate}" for name, rate in found})
    return spec.split(",")


def parse_strategy(spec: str) -> tuple[str, dict | None]:
    if "@" not in spec:
        return spec, None
    name, settings = spec.split("@", 1)
    overrides = {}
    for assignment in settings.split(";"):
        key, value = assignment.split("=", 1)
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return name, overrides


def _run(job: tuple[str, str, int]) -> tuple[str, str, int, float]:
    row, strategy, seed = job
    variant, rate = row.split("@")
    name, overrides = parse_strategy(strategy)
    result = run_fast(at_rate(named(variant).scenario, float(rate)), name, seed=seed, overrides=overrides)
    return row, strategy, seed, result.ttft_s.get("p90", math.inf) if result.completed else math.inf


def _geo(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def main(rows: list[str], strategies: list[str], seeds: int) -> None:
    jobs = [(row, strategy, seed) for row in rows for strategy in strategies for seed in range(1, seeds + 1)]
    with Pool(2) as pool:
        results = pool.map(_run, jobs, chunksize=1)
    p90: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for row, strategy, seed, value in results:
        p90[row][strategy][seed] = value
    paired_by_family: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    base = strategies[-1]
    print(f"row | {' | '.join(strategies)}   (median TTFT p90 s, (seeds past 2 s), paired against {base})")
    for row in rows:
        cells = []
        for strategy in strategies:
            values = p90[row][strategy]
            ratios = [values[s] / p90[row][base][s] for s in values
                      if math.isfinite(values[s]) and math.isfinite(p90[row][base][s]) and p90[row][base][s] > 0]
            paired = _geo(ratios) if ratios else math.nan
            paired_by_family[row.split("#")[0]][strategy].append(paired)
            cells.append(f"{statistics.median(values.values()):.2f} ({sum(v > 2 for v in values.values())}) "
                         f"paired {paired:.2f}")
        print(f"{row} | {' | '.join(cells)}")
    print("paired, geometric mean over rows (lowest-highest row):")
    everything: dict[str, list[float]] = defaultdict(list)
    for family, by_strategy in paired_by_family.items():
        for strategy, values in by_strategy.items():
            everything[strategy] += values
        print(f"  {family}: " + ", ".join(f"{s} {_geo(v):.2f}x ({min(v):.2f}-{max(v):.2f})"
                                         for s, v in by_strategy.items() if s != base))
    print("  all: " + ", ".join(f"{s} {_geo(v):.2f}x ({min(v):.2f}-{max(v):.2f}), {sum(x < 1 for x in v)} rows faster, "
                               f"{sum(x > 1 for x in v)} slower" for s, v in everything.items() if s != base))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(parse_rows(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3]))
