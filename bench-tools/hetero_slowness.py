"""How soon, and how steadily, the plugin counts the half-speed replicas of an uneven fleet as slow.

Runs the fast bench's `lora-affinity` policy (the plugin's FleetView, rules and rate learning) and reads its
fleet view after every scrape: when each odd (half-speed) replica first counts slow, and after 20 simulated
seconds the share of scrapes where a half-speed replica still reads 1.0, with the prefill and decode factors
(p10 / p50 / p90) of both kinds of replica.

    .venv/bin/python bench-tools/hetero_slowness.py [RATE] [SEEDS] [SCENARIO]
    # defaults: 2.5 req/s, seeds 1-5, mixed-hetero; e.g. hetero_slowness.py 0.5 5 kv-pressure-hetero
"""

from __future__ import annotations

import sys

from lora_affinity_lab.bench.fast import FastObserver, run_fast
from lora_affinity_lab.bench.scenarios import at_rate, get_scenario

SETTLED_S = 20.0


def _spread(values: list[float]) -> str:
    ordered = sorted(values)
    return " / ".join(f"{ordered[int(q * len(ordered))]:.2f}" for q in (0.1, 0.5, 0.9))


class _Watch(FastObserver):
    """Reads the gateway's fleet view after every scrape it takes in."""

    def __init__(self) -> None:
        self.first_slow: dict[str, float] = {}
        self.settled = {kind: {"slowness": [], "prefill": [], "decode": []} for kind in ("full", "half")}
        self.policy = None

    def started(self, engines, policies) -> None:
        self.policy = policies[0]
        self.first_slow.clear()

    def scraped(self, at, snapshots) -> None:
        for i, key in enumerate(self.policy.keys):
            pod = self.policy.fleet.scraped_view(key)
            if pod is None:
                continue
            kind = "half" if i % 2 else "full"  # profiles speed=1;speed=0.5, dealt in turn
            if kind == "half" and pod.slowness > 1 and key not in self.first_slow:
                self.first_slow[key] = at
            if at >= SETTLED_S:
                figures = self.settled[kind]
                figures["slowness"].append(pod.slowness)
                figures["prefill"].append(pod.rates.prefill_factor)
                figures["decode"].append(pod.rates.decode_factor)


def main(rate: float = 2.5, seeds: int = 5, scenario_name: str = "mixed-hetero") -> None:
    watch = _Watch()
    scenario = at_rate(get_scenario(scenario_name), rate)
    for seed in range(1, seeds + 1):
        run_fast(scenario, "lora-affinity", seed, observer=watch)
        print(f"seed {seed}: half-speed replicas first count slow at "
              + ", ".join(f"{key} {at:.1f} s" for key, at in sorted(watch.first_slow.items())))
    for kind, figures in watch.settled.items():
        at_one = sum(1 for s in figures["slowness"] if s == 1.0) / len(figures["slowness"])
        print(f"{kind}-speed replicas after {SETTLED_S:.0f} s: slowness 1.0 in {at_one:.1%} of scrapes; prefill factor "
              f"p10/p50/p90 {_spread(figures['prefill'])}; decode factor {_spread(figures['decode'])}")


if __name__ == "__main__":
    args = sys.argv[1:4]
    main(*(float(a) if i == 0 else int(a) if i == 1 else a for i, a in enumerate(args)))
