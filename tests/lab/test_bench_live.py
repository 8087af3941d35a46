"""`lora-affinity bench` from the command line, with real processes."""

import json
import os
import re
import subprocess
import time

from procs import CLI, child_env, run_cli as run


def test_live_kv_pressure_with_another_client_runs_the_exact_index_on_the_engines_events(tmp_path):
    """Live kv-pressure-foreign: the other client's requests reach the replicas past the proxy, and
    lora-affinity-exact's scraper fills the shared index from the replicas' events. Beside it a row sent straight
    to the replicas, with no proxy. (The live seed benchmark through proxies is the demo's,
    tests/lab/test_demo.py; the inferred index's live rows are the other scenarios'.)"""
    path = tmp_path / "live.json"
    stdout = run(["bench", "--scenario", "kv-pressure-foreign", "--mode", "live", "--speed", "10", "--rates", "1",
                  "--minutes-of-load", "0.5", "--strategies", "per-connection-random,lora-affinity-exact",
                  "--json", str(path), "--chart", str(tmp_path / "c.png")], timeout=240)
    sent = re.search(r"lora-affinity-exact: the other client sent (\d+) requests straight to the replicas, (\d+) "
                     r"failed", stdout)
    assert sent and int(sent.group(1)) > 0 and sent.group(2) == "0", stdout
    held = re.search(r"lora-affinity-exact: the shared index holds (\d+) blocks of (\d+) pods", stdout)
    assert held and int(held.group(1)) > 0 and held.group(2) == "6", stdout
    direct, row = json.loads(path.read_text())
    assert direct["strategy"] == "per-connection-random" and row["strategy"] == "lora-affinity-exact"
    for r in (direct, row):
        assert r["errors"] == 0 and r["completed"] > 0 and sum(r["per_replica"]) >= r["completed"], r
    assert row["transport"]["proxy_requests_per_s"] > 0 and row["transport"]["proxy_busiest_worker"] > 0
    assert (tmp_path / "c.png").stat().st_size > 1000
    assert "not published" not in stdout, stdout


def test_fast_bench_prints_every_strategy(tmp_path):
    path = tmp_path / "f.json"
    stdout = run(["bench", "--scenario", "zipf", "--mode", "fast", "--requests", "300", "--json", str(path),
                  "--chart", str(tmp_path / "c.png")])
    names = {r["strategy"] for r in json.loads(path.read_text())}
    assert {"simple-shuffle", "least-busy", "latency-based-routing", "usage-based-routing-v2",
            "per-connection-random", "gie-v0.2", "lora-affinity"} <= names
    assert "lora-affinity" in stdout


def test_fast_bench_applies_set_to_the_plugins_rules(tmp_path):
    """`--set` reaches the plugin's rules in fast mode, as it reaches the proxies in live mode (fast mode once
    ignored it), for the LoRA and the open-loop scenarios alike; a bad value stops the run, named."""
    def row(scenario: list[str], *settings: str) -> tuple[str, dict]:
        path = tmp_path / "s.json"
        stdout = run(["bench", *scenario, "--mode", "fast", "--strategies", "lora-affinity", "--json", str(path),
                      "--chart", str(tmp_path / "c.png"), *settings])
        return stdout, json.loads(path.read_text())[0]

    for scenario in (["--scenario", "seed", "--requests", "300"], ["--scenario", "mixed", "--rates", "2"]):
        _, default = row(scenario)
        stdout, other = row(scenario, "--set", "rule_set=gie-v0.2")
        assert "plugin settings {'rule_set': 'gie-v0.2'}" in stdout
        assert (other["ttft_s"], other["per_replica"]) != (default["ttft_s"], default["per_replica"])
    bad = subprocess.run([*CLI, "bench", "--scenario", "seed", "--mode", "fast", "--requests", "10", "--set",
                          "band_width=wide"], capture_output=True, text=True, timeout=120, env=child_env())
    assert bad.returncode != 0 and "band_width" in bad.stderr and "--set" in bad.stderr



def test_gateways_bench_compares_shared_unshared_and_one_gateway(tmp_path):
    path = tmp_path / "g.json"
    stdout = run(["bench", "--scenario", "seed", "--mode", "fast", "--gateways", "3", "--requests", "300",
                  "--json", str(path), "--chart", str(tmp_path / "c.png")])
    names = [r["strategy"] for r in json.loads(path.read_text())]
    assert names[-3:] == ["lora-affinity-unshared", "lora-affinity", "lora-affinity, 1 gateway"]
    assert "3 gateways vs 1" in stdout and "shared in-flight counts" in stdout and "not shared" in stdout


def test_scrape_scale_reports_cpu_per_scrape_and_the_interval():
    stdout = run(["bench", "--scenario", "scrape-scale", "--pods", "16", "--seconds", "1.5"])
    ours = next(line for line in stdout.splitlines() if line.startswith("lora-affinity parser"))
    assert ours.rstrip().endswith("yes")  # 16 pods: the interval is kept with room to spare
    assert "CPU per scrape, full parse / ours" in stdout


def test_a_row_that_did_not_measure_what_it_names_is_refused_whatever_its_errors():
    """An exact index that stayed empty, or another client's failed requests, make a run without errors another
    run than the one its row names; a median over seeds keeps the reason."""
    from lora_affinity_lab.bench.latency import median_latency
    from lora_affinity_lab.bench.results import Result, refusal

    clean = Result("lora-affinity-exact", "kv-pressure-foreign", "live", 450, 0, 0, 600.0, 1000)
    empty = Result("lora-affinity-exact", "kv-pressure-foreign", "live", 450, 0, 0, 600.0, 1000,
                   invalid="the exact index stayed empty")
    assert refusal(clean) is None
    assert refusal(empty) == "lora-affinity-exact: the exact index stayed empty, so this row is not published"
    assert "the exact index stayed empty" in refusal(median_latency([clean, empty, clean]))


def test_a_live_row_with_more_than_one_percent_errors_is_refused(monkeypatch, capsys):
    import argparse

    from lora_affinity_lab.bench import compare
    from lora_affinity_lab.bench.results import Result, refusal

    good = Result("lora-affinity", "seed", "live", 990, 5, 5, 100.0, 1000, error_kinds={"HTTP 500: x": 5})
    broken = Result("simple-shuffle", "seed", "live", 235, 0, 765, 100.0, 500,
                    error_kinds={"ClientOSError: reset": 765})
    assert refusal(good) is None and "765 of 1000 requests failed" in refusal(broken)
    monkeypatch.setattr(compare, "_run", lambda *a: [broken, good])
    args = argparse.Namespace(scenario="seed", requests=None, strategies="simple-shuffle,lora-affinity", gateways=1,
                              mode="live", json_path=None, chart="unused.png")
    monkeypatch.setattr(compare, "write_chart", lambda *a: None)
    assert compare.run_compare(args) == 1
    out, err = capsys.readouterr()
    assert "lora-affinity" in out and "simple-shuffle" not in out  # the broken row is not printed
    assert "refused: simple-shuffle: 765 of 1000 requests failed (765 x ClientOSError: reset)" in err


def test_a_live_row_whose_proxy_was_saturated_is_refused():
    from lora_affinity_lab.bench.results import Result, format_table, refusal

    def row(busiest: float) -> Result:
        return Result("lora-affinity", "seed", "live", 1000, 0, 0, 100.0, 1000,
                      transport={"proxy_busiest_worker": busiest, "proxy_requests_per_s": 12.5,
                                 "proxy_cpu_ms_per_request": 70.0})

    assert refusal(row(0.84)) is None
    reason = refusal(row(0.93))
    assert "busiest proxy worker used 93% of a core" in reason and "not the routing" in reason
    assert "12.5, 93% SATURATED" in format_table([row(0.93)])


def test_a_live_row_measured_on_a_saturated_machine_is_flagged_and_the_demo_slows_down(monkeypatch, capsys, tmp_path):
    import argparse

    from lora_affinity_lab import demo
    from lora_affinity_lab.bench.results import Result, format_table, machine_warning, refusal

    def row(strategy: str, lag: float = 0.0, busy: float = 0.5) -> Result:
        return Result(strategy, "seed", "live", 100, 0, 0, 100.0, 1000,
                      transport={"proxy_busiest_worker": 0.3, "proxy_requests_per_s": 5.0,
                                 "proxy_cpu_ms_per_request": 50.0, "sim_lag_share": lag, "machine_busy": busy})

    assert machine_warning(row("simple-shuffle", lag=0.08, busy=0.85)) is None
    lagged = machine_warning(row("lora-affinity", lag=0.31))
    assert "lost 31% of the run" in lagged and "--speed" in lagged
    busy = machine_warning(row("lora-affinity", busy=0.96))
    assert "cores were 96% busy" in busy and "--speed" in busy
    assert refusal(row("lora-affinity", busy=0.96)) is None  # a warning: both strategies share the machine
    assert format_table([row("lora-affinity", lag=0.31)])

    speeds = []

    def run_both(scenario, args, speed, *rest):
        speeds.append(speed)
        return [row("simple-shuffle", busy=0.7), row("lora-affinity", busy=0.97 if speed > 5 else 0.8)]

    monkeypatch.setattr(demo, "_run_both", run_both)
    monkeypatch.setattr(demo, "redis_server", lambda *a, **k: argparse.Namespace(embedded=False, stop=lambda: None))
    monkeypatch.setattr(demo, "scratch_dir", lambda prefix: tmp_path)
    monkeypatch.setattr(demo, "write_chart", lambda *a: None)
    monkeypatch.setattr(demo, "write_json", lambda *a: None)
    args = argparse.Namespace(speed=None, requests=100, gateways=1, config=None, out="unused", seed=1)
    assert demo.run_demo(args) == 0
    out = capsys.readouterr().out
    assert speeds == [10.0, 5.0]
    assert "cores were 97% busy" in out and "again at 5x" in out and "At 5x:" in out


def test_the_probe_reads_this_machines_cpu():
    from lora_affinity_lab.bench.transport import machine_cpu

    busy, total = machine_cpu()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:  # this process keeps one core busy
        pass
    busy_after, total_after = machine_cpu()
    assert 0 < busy_after - busy <= total_after - total
    assert (busy_after - busy) / (total_after - total) > 0.5 / os.cpu_count()  # at least half of one core


def test_the_gateways_loss_comes_with_the_interval_seed_luck_gives_it():
    from lora_affinity_lab.bench.compare import gateways_summary
    from lora_affinity_lab.bench.results import Result, median_result

    def merged(name: str, completed: list[int]) -> Result:
        return median_result([Result(name, "scarce-slots", "fast", c, 1000 - c, 0, 1.0, c) for c in completed])

    one = merged("lora-affinity, 1 gateway", [400, 410, 420, 430, 440, 450])
    steady = merged("lora-affinity", [396, 406, 416, 426, 436, 446])  # 1% fewer on every seed
    shaky = merged("lora-affinity-unshared", [360, 451, 378, 473, 396, 495])  # -10% and +10% in turn
    assert one.completed_by_seed == [400, 410, 420, 430, 440, 450]
    lines = gateways_summary([shaky, steady, one], 3).splitlines()
    assert lines[1].startswith("  shared in-flight counts") and lines[1].endswith(": within the goal"), lines
    assert lines[2].startswith("  not shared") and lines[2].endswith(": not decided by these seeds"), lines
    assert "1 gateway" in lines[3] and "interval" not in lines[3]
    worse = merged("lora-affinity", [c * 9 // 10 for c in one.completed_by_seed])
    assert gateways_summary([worse, one], 3).splitlines()[1].endswith(": beyond the goal")


def test_a_seeded_table_gives_the_defaults_against_each_row_with_the_seeds_interval():
    from lora_affinity_lab.bench.compare import defaults_against_each
    from lora_affinity_lab.bench.results import Result, median_result

    def merged(name: str, completed: list[int]) -> Result:
        return median_result([Result(name, "scarce-slots", "fast", c, 1000 - c, 0, 1.0, c) for c in completed])

    ours = merged("lora-affinity", [360, 380, 400, 420, 440])
    tree = merged("lora-affinity-tree", [400, 380, 440, 420, 480])  # ahead on three seeds, level on two
    none = merged("simple-shuffle", [0, 0, 0, 0, 0])  # nothing completed: no ratio to give
    lines = defaults_against_each([ours, tree, none]).splitlines()
    assert lines[0].startswith("lora-affinity / each, completed requests over 5 seeds")
    name, ratio, interval = lines[1].split()
    assert name == "lora-affinity-tree" and ratio == f"{400 / 420:.3f}", lines
    low, high = map(float, interval.strip("()").split("-"))
    assert low <= 400 / 420 <= high and high <= 1.0  # never ahead on any seed: the interval stays at or below 1
    assert len(lines) == 2
    assert defaults_against_each([merged("lora-affinity", [1, 2, 3, 4]), tree]) == ""  # under 5 seeds
