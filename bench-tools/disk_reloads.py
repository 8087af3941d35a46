"""Where `mixed`'s goodput goes: how busy the fleet is, and the adapters its replicas load from disk.

Runs the fast bench's policy for seeds 1-N and prints, as medians over the seeds: the fleet's mean KV-cache use
and queue per replica (scrapes from 10 to 90 simulated seconds), the loads from disk per run and TTFT p90; then,
over all seeds, the loads from disk by the decision that sent the request (branch, and whether the adapter was
running there or remembered as resident). The fleet starts warm, every replica's CPU memory filled with the
adapters it has room for (`max_cpu_loras`), so a load from disk is an adapter the replica dropped from it or
never had room for. With MAX_CPU_LORAS the replicas keep that many adapters in CPU memory instead of
the scenario's (16, the adapters `mixed` serves: nothing is dropped).

    .venv/bin/python bench-tools/disk_reloads.py [SCENARIO] [RATE] [SEEDS] [MAX_CPU_LORAS] [STRATEGY]
    # defaults: mixed, 4.2 req/s, 10 seeds, the scenario's, lora-affinity
"""

from __future__ import annotations

import collections
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from lora_affinity_lab.bench import fast
from lora_affinity_lab.bench.fast import FastObserver
from lora_affinity_lab.bench.scenarios import at_rate, get_scenario


class _Loads(FastObserver):
    """Each load from disk, by the decision that last sent its adapter to that replica; the scraped KV use and queue."""

    def __init__(self) -> None:
        self.sent: dict[tuple[int, str], tuple] = {}  # (replica, adapter) -> the decision that last sent it there
        self.by_decision: collections.Counter = collections.Counter()
        self.disk_loads = 0
        self.scrapes: list[tuple[float, float]] = []
        self.engines: list = []

    def started(self, engines, policies) -> None:
        self.engines = engines

    def routed(self, now, request, replica, policy) -> None:
        last = getattr(policy, "last", None)
        if request.adapter is None or last is None:
            return
        decision, candidates, _ = last
        pod = next(c for c in candidates if c.key == decision.pod)
        self.sent[replica, request.adapter] = (decision.branch, request.adapter in pod.active_adapters,
                                               request.adapter in pod.resident_adapters)

    def planned(self, now, replica, queued, duration_s) -> None:
        for adapter in self.engines[replica].step_disk_loads:
            self.disk_loads += 1
            branch, running, resident = self.sent.get((replica, adapter), ("not routed by the rules", False, False))
            self.by_decision[f"{branch}, {'running' if running else 'not running'} there, "
                             f"{'remembered' if resident else 'not remembered'} as resident"] += 1

    def scraped(self, at, snapshots) -> None:
        if 10 < at < 90:
            self.scrapes.append((statistics.mean(s.kv_cache_usage for s in snapshots),
                                 statistics.mean(s.num_requests_waiting for s in snapshots)))


def _one_seed(args: tuple[str, float, int, int | None, str]) -> tuple[dict, collections.Counter]:
    name, rate, seed, cpu_loras, strategy = args
    scenario = at_rate(get_scenario(name), rate)
    if cpu_loras:
        scenario = replace(scenario, max_cpu_loras=cpu_loras)
    loads = _Loads()
    result = fast.run_fast(scenario, strategy, seed, observer=loads)
    return {"kv": statistics.mean(k for k, _ in loads.scrapes), "queue": statistics.mean(q for _, q in loads.scrapes),
            "disk": loads.disk_loads, "p90": result.ttft_s["p90"]}, loads.by_decision


def main(name: str = "mixed", rate: float = 4.2, seeds: int = 10, cpu_loras: int = 0,
         strategy: str = "lora-affinity") -> None:
    with ProcessPoolExecutor(2) as pool:
        runs = list(pool.map(_one_seed, [(name, rate, s, cpu_loras or None, strategy) for s in range(1, seeds + 1)]))
    cpu = cpu_loras or get_scenario(name).max_cpu_loras

    def med(key: str) -> float:
        return statistics.median(run[key] for run, _ in runs)

    print(f"{name} at {rate:g} req/s, {strategy}, seeds 1-{seeds}, max_cpu_loras {cpu} (medians over seeds):")
    print(f"  mean KV-cache use {med('kv'):.2f}, mean queue per replica {med('queue'):.2f}, TTFT p90 {med('p90'):.2f} s")
    print(f"  loads from disk per run {med('disk'):.1f}")
    total = sum((by for _, by in runs), collections.Counter())
    print(f"loads from disk over the {seeds} runs, by the decision that sent the request:")
    for what, n in total.most_common():
        print(f"  {n:5}  {what}")


if __name__ == "__main__":
    kinds = (str, float, int, int, str)
    main(*(kind(a) for kind, a in zip(kinds, sys.argv[1:6])))
