"""The benchmarks that catch a decision which serves one prompt shape at the others' cost, small: fast mode, seeded, a few seconds.

Mixed LoRA traffic (long unseen prompts, instructions, questions, base-model chats) and a replica that
slows to half speed mid-run: what the one decision is for, measured against the previous default.
"""

import re
from dataclasses import replace

from procs import run_bench_tool, run_cli

from lora_affinity_lab.bench.fast import DispatchLog, FastObserver, run_fast
from lora_affinity_lab.bench.scenarios import at_rate, get_scenario
from lora_affinity_lab.bench.slowdown import SLOW_AT_S, shares


def test_mixed_traffic_starts_sooner_than_with_the_previous_rules():
    scenario = at_rate(get_scenario("mixed"), 4.0)
    ours, previous = (run_fast(scenario, name, seed=1) for name in ("lora-affinity", "lora-affinity-v1"))
    assert ours.timeouts == 0 and ours.errors == 0 and ours.completed >= previous.completed
    assert ours.ttft_s["p90"] < 1.0 and ours.ttft_s["p90"] < 0.8 * previous.ttft_s["p90"], \
        (ours.ttft_s, previous.ttft_s)


def test_a_replica_at_half_speed_gets_less_within_30_seconds():
    scenario = replace(get_scenario("poisson"), arrival_rate=2.0, requests=500, prompt_shape="mix",
                       slowdown=(SLOW_AT_S, 0, 0.5))
    logs = {}
    for name in ("lora-affinity", "lora-affinity-v1"):
        dispatched = DispatchLog()
        run_fast(scenario, name, seed=1, observer=dispatched)
        logs[name] = dispatched.log
    before, first_30_s, _ = shares(logs["lora-affinity"])
    assert first_30_s < 0.12 and first_30_s < 0.6 * before, (before, first_30_s)  # proportionate: 0.5 / 5.5
    assert shares(logs["lora-affinity-v1"])[1] > first_30_s


class _Recorder(FastObserver):
    def __init__(self) -> None:
        self.engines, self.routed_to, self.steps, self.scrapes, self.outcomes = [], [], [], [], {}

    def started(self, engines, policies) -> None:
        self.engines = engines

    def routed(self, now, request, replica, policy) -> None:
        decision = policy.last[0].pod if policy.last else None
        self.routed_to.append((request.index, replica, decision))

    def planned(self, now, replica, queued, duration_s) -> None:
        planned = self.engines[replica].planned
        if planned and planned[0] == "prefill":
            self.steps.append(all(seq in queued for seq in planned[1]) and duration_s > 0)

    def scraped(self, at, snapshots) -> None:
        self.scrapes.append(len(snapshots))

    def ended(self, index, outcome) -> None:
        self.outcomes[index] = outcome.ok


def test_an_observer_sees_each_request_step_and_scrape_and_changes_no_figure():
    """What bench-tools/ measure with: every request routed once and ended once, each prefill admitting from the queue
    it was planned from, every scrape; and the run's result the same as unobserved."""
    scenario = replace(at_rate(get_scenario("mixed"), 4.0), duration_s=30.0)
    plain = run_fast(scenario, "lora-affinity", seed=3)
    seen = _Recorder()
    observed = run_fast(scenario, "lora-affinity", seed=3, observer=seen)
    assert observed == plain and plain.completed > 100
    assert sorted(i for i, _, _ in seen.routed_to) == sorted(seen.outcomes) == list(range(len(seen.outcomes)))
    assert all(decision == f"r{replica}" for _, replica, decision in seen.routed_to)  # the rules' pod, as sent
    assert sum(seen.outcomes.values()) == plain.completed
    assert seen.steps and all(seen.steps)
    assert len(seen.scrapes) > 100 and set(seen.scrapes) == {scenario.replicas}


def test_the_decisions_benchmark_times_both_strategies_with_no_fallback():
    stdout = run_cli(["bench", "--scenario", "decisions", "--deployments", "8", "--iterations", "200",
                      "--prompt-chars", "2048"])
    row = next(line.split() for line in stdout.splitlines() if line.strip().startswith("8 "))
    # deployments, shuffle median / p99, plugin median / p99, ratio, own median / p99, fallbacks, index blocks
    assert row[0] == "8" and float(row[1]) > 0 and float(row[4]) > 0 and float(row[8]) > 0
    assert row[-2] == "0" and int(row[-1]) > 0  # every decision the plugin's; the prompts filled the index
    assert "Redis calls on the request path: 0" in stdout


def test_the_side_by_side_loop_runs_on_this_checkout():
    stdout = run_bench_tool("decision_own_part.py", "300")
    assert re.fullmatch(r"\d+\.\d / \d+  \(fallbacks 0\)\n", stdout), stdout


def test_the_engines_events_show_the_documents_another_client_cached():
    """kv-pressure-foreign: a batch job asks about the same tenants' documents straight at the replicas. Only the
    engines' events tell the gateway where it left them; the inferred index knows only its own dispatches."""
    from dataclasses import replace

    from lora_affinity_lab.bench.scenarios import at_rate, get_scenario

    scenario = at_rate(replace(get_scenario("kv-pressure-foreign"), duration_s=600.0), 0.5)
    for seed in (1, 2):
        inferred, exact = (run_fast(scenario, name, seed=seed) for name in ("lora-affinity", "lora-affinity-exact"))
        assert inferred.errors == exact.errors == 0
        assert exact.hit_rate > inferred.hit_rate + 0.02, (seed, exact.hit_rate, inferred.hit_rate)
        # The gateway's own requests gain too (the fleet's rate counts the batch job's as well).
        assert exact.gateway_hit_rate > inferred.gateway_hit_rate + 0.02, (seed, exact.gateway_hit_rate,
                                                                             inferred.gateway_hit_rate)
        assert exact.gateway_hit_rate != exact.hit_rate


def test_a_scraper_that_joins_every_pod_afresh_leaves_the_exact_rules_level_with_the_inferred_ones(monkeypatch):
    """kv-pressure-rejoin: 60 s in, the scraper starts over with no checkpoint and no replay, each pod partial. The
    hot tenants' system prompts stay cached and are never announced again, so their documents' blocks chain to
    parents the index never saw. Taken as exact, those empty figures lose hits; taken as a floor under the
    inferred index, the rules keep the inferred index's hits."""
    from lora_affinity_plugin.kv.exact_share import HeldBlocks

    scenario = at_rate(replace(get_scenario("kv-pressure-rejoin"), duration_s=300.0), 0.75)
    tree = {"rule_set": "lora-affinity-tree"}  # its prefix rules follow every match; the prediction weighs them
    for seed in (1, 2):
        inferred, floor = (run_fast(scenario, name, seed=seed, overrides=tree)
                           for name in ("lora-affinity", "lora-affinity-exact"))
        with monkeypatch.context() as patch:
            patch.setattr(HeldBlocks, "partial", lambda self, pod: False)  # the figures taken as exact
            as_exact = run_fast(scenario, "lora-affinity-exact", seed=seed, overrides=tree)
        assert inferred.errors == floor.errors == as_exact.errors == 0
        assert floor.hit_rate >= inferred.hit_rate - 0.01, (seed, floor.hit_rate, inferred.hit_rate)
        assert as_exact.hit_rate <= floor.hit_rate - 0.01, (seed, as_exact.hit_rate, floor.hit_rate)


def test_the_seed_by_seed_tool_compares_both_indexes_on_every_seed():
    stdout = run_bench_tool("knee_by_seed.py", "kv-pressure-rejoin", "1", "2", "2")
    rows = [line.split() for line in stdout.splitlines()[1:3]]
    assert [row[0] for row in rows] == ["1", "2"] and all(float(row[1]) > 0 and float(row[4]) > 0 for row in rows)
    assert re.search(r"the exact rules higher in [0-2] of 2 seeds\n$", stdout), stdout


def test_half_speed_pods_serving_cached_prefixes_read_slow_by_both_factors():
    """kv-pressure-hetero: the half-speed replicas serve their tenants' cached system prompts, so each prefill's cache
    hits (counted when it is scheduled) and its prompt tokens (counted when it ends) fall in different scrapes."""
    stdout = run_bench_tool("hetero_slowness.py", "0.5", "1", "kv-pressure-hetero")
    half = re.search(r"half-speed replicas after 20 s: slowness 1.0 in ([\d.]+)% of scrapes; prefill factor "
                     r"p10/p50/p90 ([\d.]+) / ([\d.]+)", stdout)
    full = re.search(r"full-speed replicas after 20 s: slowness 1.0 in ([\d.]+)% of scrapes; prefill factor "
                     r"p10/p50/p90 ([\d.]+) /", stdout)
    assert half and full, stdout
    assert float(half[1]) < 10 and float(half[2]) > 1.6, stdout  # slow in 9 scrapes of 10, prefill read at ~2x
    assert float(full[1]) == 100 and float(full[2]) > 0.9, stdout  # never slow, never read faster than they are


def test_three_gateways_place_adapters_alike_where_lora_slots_are_scarce():
    # 24 adapters on 12 slots, a burst of 1000 at t=0: gateways that cannot hear each other yet would start each
    # adapter on a different pod (15.7% fewer completed over 6 seeds before the default dealt them)
    scenario = get_scenario("scarce-slots")
    one, three = (run_fast(scenario, "lora-affinity", seed=1, gateways=g) for g in (1, 3))
    assert three.completed >= 0.95 * one.completed, (three.completed, one.completed)
    undealt = run_fast(scenario, "lora-affinity", seed=1, gateways=3, overrides={"disabled_rules": ["dealt"]})
    assert undealt.completed < three.completed, (undealt.completed, three.completed)
