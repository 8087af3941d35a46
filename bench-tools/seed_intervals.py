"""Two runs of the same `bench --seeds N --json PATH` command, row by row: how far each row moved, and whether
seed luck alone could have moved it that far.

For every (strategy, rate) in both files: the ratio of the median TTFT p90 over seeds (after against before),
its paired-bootstrap 95% interval (`latency.seed_interval`), and in how many seeds it went down or up.

    .venv/bin/python bench-tools/seed_intervals.py AFTER.json BEFORE.json
"""

from __future__ import annotations

import json
import statistics
import sys

from lora_affinity_lab.bench.latency import seed_interval


def main(after_path: str, before_path: str) -> None:
    with open(after_path) as after_file, open(before_path) as before_file:
        after, before = json.load(after_file), json.load(before_file)
    earlier = {(r["strategy"], r["rate"]): r for r in before}
    for row in after:
        other = earlier.get((row["strategy"], row["rate"]))
        if other is None:
            continue
        new, old = row["ttft_p90_by_seed"], other["ttft_p90_by_seed"]
        interval = seed_interval(new, old)
        spread = f"[{interval[0]:.2f}-{interval[1]:.2f}]" if interval else "[too few seeds]"
        down = sum(1 for a, b in zip(new, old) if a < b)
        up = sum(1 for a, b in zip(new, old) if a > b)
        print(f"{row['strategy']:<24} {row['rate']:>5g} req/s  after / before {statistics.median(new) / statistics.median(old):.2f}x "
              f"{spread}  lower in {down} seeds, higher in {up}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
