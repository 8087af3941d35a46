"""The benchmarks that would have caught issue 17, small: fast mode, seeded, a few seconds.

Mixed LoRA traffic (long unseen prompts, instructions, questions, base-model chats) and a replica that
slows to half speed mid-run: what the one decision is for, measured against the previous default.
"""

import re
from dataclasses import replace

from procs import run_bench_tool, run_cli

from lora_affinity_plugin.bench.fast import run_fast
from lora_affinity_plugin.bench.scenarios import at_rate, get_scenario
from lora_affinity_plugin.bench.slowdown import SLOW_AT_S, shares


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
        logs[name] = []
        run_fast(scenario, name, seed=1, dispatches=logs[name])
    before, first_30_s, _ = shares(logs["lora-affinity"])
    assert first_30_s < 0.12 and first_30_s < 0.6 * before, (before, first_30_s)  # proportionate: 0.5 / 5.5
    assert shares(logs["lora-affinity-v1"])[1] > first_30_s


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
