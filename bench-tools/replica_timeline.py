"""One replica's learned rates over the first seconds of a `mixed-hetero` run: when its figures arrive.

Runs the fast bench's `lora-affinity` policy for one seed and prints, at every scrape where they change (up to
`UNTIL_S` simulated seconds), the replica's prefill and decode factors, its slowness against the fleet, whether
any rate was learned, and the requests it was running and queueing. Odd replicas (r1, r3, r5) run at half speed.

    .venv/bin/python bench-tools/replica_timeline.py [RATE] [SEED] [REPLICA]    # defaults: 2.5 req/s, 1, r1
"""

from __future__ import annotations

import sys

from lora_affinity_lab.bench.fast import FastObserver, run_fast
from lora_affinity_lab.bench.scenarios import at_rate, get_scenario

UNTIL_S = 16.0


class _Timeline(FastObserver):
    def __init__(self, replica: str) -> None:
        self.replica = replica
        self.fleet = None
        self.last: tuple | None = None

    def started(self, engines, policies) -> None:
        self.fleet = policies[0].fleet

    def scraped(self, at, snapshots) -> None:
        pod = self.fleet.scraped_view(self.replica)
        if pod is None or at > UNTIL_S:
            return
        rates = pod.rates
        row = (round(rates.prefill_factor, 2), round(rates.decode_factor, 2), round(pod.slowness, 2), rates.learned,
               pod.running, pod.reported_waiting)
        if row != self.last:
            print(f"{at:5.1f} s  prefill factor {row[0]:5.2f}  decode factor {row[1]:5.2f}  slowness {row[2]:.2f}  "
                  f"learned {row[3]!s:<5}  running {row[4]}  waiting {row[5]}")
            self.last = row


def main(rate: float = 2.5, seed: int = 1, replica: str = "r1") -> None:
    run_fast(at_rate(get_scenario("mixed-hetero"), rate), "lora-affinity", seed, observer=_Timeline(replica))


if __name__ == "__main__":
    args = sys.argv[1:4]
    main(*(float(a) if i == 0 else int(a) if i == 1 else a for i, a in enumerate(args)))
