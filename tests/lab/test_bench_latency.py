"""The latency bench's goal lines: how far seed luck alone moves a ratio of medians."""

import json
import random
import re
import subprocess
import sys

from procs import BENCH_TOOLS, child_env, run_bench_tool

from lora_affinity_lab.bench.latency import mixed_goals_summary, seed_interval
from lora_affinity_lab.bench.results import Result


def test_the_seed_interval_holds_the_ratio_and_narrows_with_a_clear_difference():
    rng = random.Random(7)
    reference = [rng.uniform(0.8, 1.4) for _ in range(30)]
    same = [x * rng.uniform(0.8, 1.25) for x in reference]  # the same fleet, other luck
    lo, hi = seed_interval(same, reference)
    assert lo < 1.0 < hi  # no difference: 1.0 inside
    half = [x * 0.5 for x in reference]
    lo, hi = seed_interval(half, reference)
    assert lo == hi == 0.5  # every seed exactly half: no spread at all
    noisy_half = [x * rng.uniform(0.4, 0.6) for x in reference]
    lo, hi = seed_interval(noisy_half, reference)
    assert 0.35 < lo < 0.5 < hi < 0.65 and hi < 1.0


def test_too_few_or_unpaired_seeds_give_no_interval():
    assert seed_interval([0.5] * 4, [1.0] * 4) is None
    assert seed_interval([0.5] * 6, [1.0] * 5) is None  # not the same seeds


def _result(strategy: str, rate: float, p90s: list[float]) -> Result:
    p90 = sorted(p90s)[len(p90s) // 2]
    return Result(strategy=strategy, scenario="mixed", mode="fast", completed=100, timeouts=0, errors=0,
                  duration_s=90.0, output_tokens=1000, ttft_s={"p50": 0.1, "p90": p90, "p99": 2 * p90},
                  rate=rate, seeds=len(p90s), ttft_p90_by_seed=p90s)


def test_the_mixed_goal_line_gives_the_seeds_interval():
    rng = random.Random(3)
    ref = [rng.uniform(1.0, 1.6) for _ in range(9)]
    results = [_result("least-busy", 2.0, [0.9] * 9), _result("lora-affinity", 2.0, [0.5] * 9),
               _result("least-busy", 3.0, ref), _result("lora-affinity", 3.0, [x * 0.6 for x in ref])]
    line = mixed_goals_summary(results).splitlines()[0]
    assert line.startswith("  met") and "at 3 req/s" in line and "(0.60x; seeds' 95% interval 0.60-0.60x)" in line


def test_goodput_is_not_judged_when_no_reference_passes_at_any_swept_rate():
    """A sweep that starts above every reference's limit has no goodput to compare with: it says so, and
    neither meets nor misses (it read "infx >= 1.3x: met")."""
    results = [_result("least-busy", 4.0, [1.2] * 5), _result("lora-affinity", 4.0, [0.8] * 5),
               _result("least-busy", 4.5, [3.0] * 5), _result("lora-affinity", 4.5, [1.7] * 5)]
    goodput = mixed_goals_summary(results).splitlines()[-1]
    assert goodput.startswith("  n/a") and "lora-affinity 4," in goodput and "sweep lower rates" in goodput
    results.insert(0, _result("least-busy", 3.5, [0.9] * 5))
    goodput = mixed_goals_summary(results).splitlines()[-1]
    assert goodput.startswith("  missed") and "best reference least-busy 3.5 req/s (1.14x >= 1.3x)" in goodput


def test_seed_intervals_compares_two_runs_row_by_row(tmp_path):
    def run(scale: float) -> list[dict]:
        rows = [_result("lora-affinity", 2.0, [0.5 + 0.01 * i for i in range(8)]),
                _result("least-busy", 2.0, [1.0 + 0.02 * i for i in range(8)])]
        return [{"strategy": r.strategy, "rate": r.rate,
                 "ttft_p90_by_seed": [x * (scale if r.strategy == "lora-affinity" else 1) for x in r.ttft_p90_by_seed]}
                for r in rows]

    (tmp_path / "after.json").write_text(json.dumps(run(0.8)))
    (tmp_path / "before.json").write_text(json.dumps(run(1.0)))
    lines = run_bench_tool("seed_intervals.py", str(tmp_path / "after.json"), str(tmp_path / "before.json")).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("lora-affinity") and "0.80x [0.80-0.80]" in lines[0] and "lower in 8 seeds, higher in 0" in lines[0]
    assert lines[1].startswith("least-busy") and "1.00x [1.00-1.00]" in lines[1] and "lower in 0 seeds, higher in 0" in lines[1]


def test_variant_rows_pairs_each_strategy_against_the_last_by_seed():
    """`bench-tools/variant_rows.py`: a strategy against itself reads 1.00 paired; a setting that changes the routing
    moves it; the docs' rows are read with their rates."""
    out = run_bench_tool("variant_rows.py", "mixes#111@4.447",
                         "lora-affinity@learn_chars_per_token=false;prefix_chars_per_token=4,least-busy,"
                         "lora-affinity@learn_chars_per_token=false",
                         "2").splitlines()
    row = next(line for line in out if line.startswith("mixes#111@4.447"))
    cells = row.split(" | ")[1:]
    assert len(cells) == 3 and cells[0] == cells[2] and cells[0].endswith("paired 1.00")  # (4 is the default)
    assert not cells[1].endswith("paired 1.00")  # least-busy routes otherwise
    assert out[-2].startswith("  mixes: ") and out[-1].startswith("  all: ")
    sys.path.insert(0, str(BENCH_TOOLS))
    try:
        from variant_rows import parse_rows
    finally:
        sys.path.pop(0)
    assert "documents#121@0.656" in parse_rows("docs") and len(parse_rows("docs")) > 40


def test_replica_timeline_prints_a_half_speed_replica_s_rates_as_they_arrive():
    lines = run_bench_tool("replica_timeline.py", "2.5", "1", "r1").splitlines()
    assert lines[0].startswith("  0.0 s") and "learned False" in lines[0]
    last = lines[-1].split()
    assert float(last[last.index("slowness") + 1]) > 1.5  # counted slow within the window it prints


def test_disk_reloads_counts_the_loads_from_disk_and_none_when_every_adapter_fits():
    """`bench-tools/disk_reloads.py`: where mixed's goodput goes. The scenario's replicas keep 12 of its 16 adapters
    in CPU memory, so some requests load theirs from disk, each attributed to the decision that sent it; with room
    for all 16 none does."""
    def loads(output: str) -> float:
        return float(re.search(r"loads from disk per run (\S+)", output).group(1))

    scarce = run_bench_tool("disk_reloads.py", "mixed", "4.2", "2")
    roomy = run_bench_tool("disk_reloads.py", "mixed", "4.2", "2", "16")
    assert "max_cpu_loras 12" in scarce and "max_cpu_loras 16" in roomy
    assert loads(scarce) > 0 and loads(roomy) == 0
    attributed = [int(n) for n in re.findall(r"^ +(\d+)  \w+, ", scarce, re.M)]
    assert attributed and sum(attributed) == round(2 * loads(scarce))  # the two runs' loads (the median of two is their mean)
    assert re.search(r"mean KV-cache use 0\.\d\d, mean queue per replica \d+\.\d\d, TTFT p90 \d+\.\d\d s", roomy)


def test_ttft_causes_charges_each_wait_to_one_cause_and_the_oracle_sees_replicas_now():
    """`bench-tools/ttft_causes.py`: where mixed's TTFT goes. Past the knee, under the tree of rules (the default's
    requests wait for LoRA slots instead, docs/benchmarks.md), the requests over 1 s mostly wait for
    room in a replica's KV cache; the causes add up to most of each request's TTFT, never more; a rule that sends
    nothing to a full replica (`--oracle fit`) cuts that wait, and trades it for waits for a LoRA slot."""
    def causes(output: str, label: str) -> tuple[float, list[float]]:
        row = re.search(rf"^  {label} +\d+ +(\S+) +(\S+) +(\S+) +(\S+) +(\S+)$", output, re.M)
        return float(row.group(1)), [float(x) for x in row.groups()[1:]]

    scraped = run_bench_tool("ttft_causes.py", "mixed", "4.4", "2", "lora-affinity-tree")
    fit = run_bench_tool("ttft_causes.py", "mixed", "4.4", "2", "lora-affinity-tree", "--oracle", "fit")
    assert "oracle fit" in fit and "oracle" not in scraped
    ttft, parts = causes(scraped, "all")
    assert 0.6 * ttft < sum(parts) <= ttft  # the rest: the part of the step in flight when the request arrived
    slow_ttft, slow_parts = causes(scraped, "over 1 s")
    kv_room = slow_parts[2]
    assert slow_ttft > 1 and kv_room == max(slow_parts) and kv_room > 0.5 * slow_ttft
    _, fit_parts = causes(fit, "all")
    assert fit_parts[2] < parts[2] and fit_parts[3] > 1.1 * parts[3]
    refused = subprocess.run([sys.executable, str(BENCH_TOOLS / "ttft_causes.py"), "mixed", "5", "1", "simple-shuffle",
                              "--oracle", "kv"], capture_output=True, text=True, timeout=120,
                             env=child_env(PYTHONPATH=str(BENCH_TOOLS.parent / "src")))
    assert refused.returncode == 2 and "--oracle needs one of the plugin's rule sets" in refused.stderr


def test_the_least_ttft_oracle_sends_each_request_where_its_first_token_comes_soonest():
    """`bench-tools/least_ttft_oracle.py`: a reference that simulates every replica forward for each request. On the
    half-speed fleet it gets a lower TTFT p90 than ours by sending less to the slow replicas; its copies leave the
    real replicas alone (every request completes, as for ours); on equal replicas nothing is slower."""
    hetero = run_bench_tool("least_ttft_oracle.py", "mixed-hetero", "2.8", "2", "lora-affinity")
    row = re.search(r"^2\.8 +(\S+) \((\S+)\) +(\S+) \((\S+)\)$", hetero, re.M)
    oracle_p90, oracle_done, ours_p90, ours_done = (float(x) for x in row.groups())
    assert oracle_p90 < ours_p90 and oracle_done == ours_done > 0

    def to_slower(output: str, strategy: str) -> int:
        return int(re.search(rf"^  {strategy} +(\d+)% to a slower replica", output, re.M).group(1))

    assert to_slower(hetero, "least-ttft-oracle") < to_slower(hetero, "lora-affinity") < 50
    shares = re.search(r"^  least-ttft-oracle .*running there (\d+)%; .* slot (\d+)%; .* memory (\d+)%; .* disk (\d+)%$",
                       hetero, re.M)
    assert 98 <= sum(int(x) for x in shares.groups()) <= 102  # every adapter request in one of the four (rounded)
    equal = run_bench_tool("least_ttft_oracle.py", "mixed", "2", "1", "lora-affinity")
    assert to_slower(equal, "least-ttft-oracle") == to_slower(equal, "lora-affinity") == 0


def test_the_least_ttft_oracle_names_the_argument_a_bad_value_is_for():
    def refused(*args: str) -> str:
        out = subprocess.run([sys.executable, str(BENCH_TOOLS / "least_ttft_oracle.py"), *args], capture_output=True,
                             text=True, timeout=120, env=child_env(PYTHONPATH=str(BENCH_TOOLS.parent / "src")))
        assert out.returncode == 2 and not out.stdout
        return out.stderr

    assert "RATES must be requests per second separated by commas, not '4,x'" in refused("mixed", "4,x", "1")
    assert "invalid choice: 'seed'" in refused("seed", "4", "1")  # closed-loop: no arrival rate to sweep
    assert "unknown strategy 'nosuch'" in refused("mixed", "4", "1", "lora-affinity,nosuch")


def test_ttft_causes_reads_a_closed_loop_table_by_its_own_client():
    """Rate 0: the scenario's own client (scarce-slots' burst of 1000 over 100 connections), with a prompt shape.
    Inside the replicas its requests wait for LoRA slots above all (24 adapters on 2 slots a pod), and the line says
    how many distinct adapters each replica ran."""
    out = run_bench_tool("ttft_causes.py", "scarce-slots", "0", "1", "lora-affinity", "--prompt-shape", "unique")
    head = out.splitlines()[0]
    assert head.startswith("scarce-slots with its own client, prompts unique, lora-affinity, seeds 1-1:"), head
    completed = float(re.search(r"completed ([\d.]+)", head).group(1))
    adapters = float(re.search(r"distinct adapters each replica ran ([\d.]+)", head).group(1))
    assert 0 < completed < 1000 and 2 <= adapters <= 24
    row = re.search(r"^  all +(\d+) +\S+ +(\S+) +(\S+) +(\S+) +(\S+)$", out, re.M)
    assert int(row.group(1)) == 1000
    parts = [float(x) for x in row.groups()[1:]]
    assert parts[3] == max(parts) and parts[3] > 10 * sum(parts[:3])  # the LoRA slot, by far
