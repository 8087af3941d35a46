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

from lora_affinity_plugin.bench import fast, policies
from lora_affinity_plugin.bench.scenarios import at_rate, get_scenario
from lora_affinity_plugin.sim.engine import ReplicaEngine


def _one_seed(args: tuple[str, float, int, int | None, str]) -> tuple[dict, collections.Counter]:
    name, rate, seed, cpu_loras, strategy = args
    scenario = at_rate(get_scenario(name), rate)
    if cpu_loras:
        scenario = replace(scenario, max_cpu_loras=cpu_loras)
    sent: dict[tuple[int, str], tuple] = {}  # (replica, adapter) -> the decision that last sent it there
    decision: dict = {}
    by_decision: collections.Counter = collections.Counter()
    disk_loads = 0
    scrapes: list[tuple[float, float]] = []
    replicas: dict[int, int] = {}  # id(engine) -> its index (engines are made in order)

    choose, route, scraped = policies.choose_pod, policies.Rules.route, policies.Rules.scraped
    made, load = ReplicaEngine.__init__, ReplicaEngine._adapter_cost_ms

    def choosing(candidates, request, settings, rng, **kwargs):
        chosen = choose(candidates, request, settings, rng, **kwargs)
        pod = next(c for c in candidates if c.key == chosen.pod)
        decision.update(branch=chosen.branch, running=request.adapter in pod.active_adapters,
                        resident=request.adapter in pod.resident_adapters)
        return chosen

    def routing(self, adapter, connection, now, call_id="", messages=None, group=0, sheddable=False):
        decision.clear()
        replica = route(self, adapter, connection, now, call_id, messages=messages, group=group, sheddable=sheddable)
        if adapter is not None and decision:
            sent[replica, adapter] = (decision["branch"], decision["running"], decision["resident"])
        return replica

    def scraping(self, snapshots, gpu, at):
        if 10 < at < 90:
            scrapes.append((statistics.mean(s.kv_cache_usage for s in snapshots),
                            statistics.mean(s.num_requests_waiting for s in snapshots)))
        return scraped(self, snapshots, gpu, at)

    def making(self, *a, **k):
        made(self, *a, **k)
        replicas[id(self)] = len(replicas)

    def loading(self, adapter, protected):
        nonlocal disk_loads
        cost = load(self, adapter, protected)
        if cost >= self.config.disk_load_ms:
            disk_loads += 1
            branch, running, resident = sent.get((replicas[id(self)], adapter), ("not routed by the rules", False, False))
            by_decision[f"{branch}, {'running' if running else 'not running'} there, "
                        f"{'remembered' if resident else 'not remembered'} as resident"] += 1
        return cost

    policies.choose_pod, policies.Rules.route, policies.Rules.scraped = choosing, routing, scraping
    ReplicaEngine.__init__, ReplicaEngine._adapter_cost_ms = making, loading
    try:
        result = fast.run_fast(scenario, strategy, seed)
    finally:  # a pool's worker runs several seeds: the next one hooks the originals, not these
        policies.choose_pod, policies.Rules.route, policies.Rules.scraped = choose, route, scraped
        ReplicaEngine.__init__, ReplicaEngine._adapter_cost_ms = made, load
    return {"kv": statistics.mean(k for k, _ in scrapes), "queue": statistics.mean(q for _, q in scrapes),
            "disk": disk_loads, "p90": result.ttft_s["p90"]}, by_decision


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
