"""`lora-affinity bench` and `lora-affinity demo` from the command line, with real processes."""

import json
import re
import subprocess
import sys

from procs import child_env

CLI = [sys.executable, "-m", "lora_affinity_plugin.cli", "--log-level", "WARNING"]


def run(args, timeout=300):
    out = subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout, env=child_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_live_bench_writes_one_result_per_strategy(tmp_path):
    path = tmp_path / "r.json"
    stdout = run(["bench", "--scenario", "seed", "--mode", "live", "--speed", "20", "--requests", "150",
                  "--strategies", "per-connection-random,simple-shuffle,lora-affinity", "--json", str(path),
                  "--chart", str(tmp_path / "c.png")])
    results = json.loads(path.read_text())
    assert [r["strategy"] for r in results] == ["per-connection-random", "simple-shuffle", "lora-affinity"]
    for r in results:
        assert r["completed"] + r["timeouts"] + r["errors"] == 150
        assert r["completed"] > 100 and r["output_tokens_per_s"] > 0 and r["errors"] == 0
        assert sum(r["per_replica"]) >= r["completed"]
    assert "vs shuffle" in stdout and (tmp_path / "c.png").stat().st_size > 1000


def test_fast_bench_prints_every_strategy(tmp_path):
    path = tmp_path / "f.json"
    stdout = run(["bench", "--scenario", "zipf", "--mode", "fast", "--json", str(path), "--chart", str(tmp_path / "c.png")])
    names = {r["strategy"] for r in json.loads(path.read_text())}
    assert {"simple-shuffle", "least-busy", "latency-based-routing", "usage-based-routing-v2",
            "per-connection-random", "gie-v0.2", "lora-affinity"} <= names
    assert "lora-affinity" in stdout


def test_demo_runs_end_to_end(tmp_path):
    stdout = run(["demo", "--requests", "120", "--speed", "20", "--out", str(tmp_path)], timeout=400)
    assert "Redis: redis-server" in stdout
    assert "simple-shuffle" in stdout and "lora-affinity completed" in stdout
    assert len(json.loads((tmp_path / "demo.json").read_text())) == 2


def test_short_soak_with_faults_reports_no_errors_no_leaks_and_attributes_memory(tmp_path):
    stdout = run(["bench", "--scenario", "soak", "--minutes", "0.5", "--rate", "6", "--trace",
                  "--chart", str(tmp_path / "soak.png"), "--json", str(tmp_path / "soak.json")], timeout=400)
    assert "Redis restarted" in stdout and "killed and restarted" in stdout
    assert re.findall(r"^proxy with plugin: requests \d+, errors 0$", stdout, re.M)
    assert re.findall(r"^proxy without plugin: requests \d+, errors \d+$", stdout, re.M)  # LiteLLM alone: reported
    assert "proxy with the plugin vs without, at the end:" in stdout
    assert "traced growth between the snapshots: plugin" in stdout  # tracemalloc snapshots were taken and compared
    samples = json.loads((tmp_path / "soak.json").read_text())["memory"]
    assert len(samples) >= 10 and {"proxy with plugin", "proxy without plugin", "scraper"} <= set(samples[0])
    assert (tmp_path / "soak.png").stat().st_size > 10_000
    assert "left running or waiting on the replicas after the load: 0" in stdout
    assert "in flight in the proxy after the load (shared in Redis by 2 process): 0" in stdout


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


def test_a_live_row_with_more_than_one_percent_errors_is_refused(monkeypatch, capsys):
    import argparse

    from lora_affinity_plugin.bench import compare
    from lora_affinity_plugin.bench.results import Result, refusal

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
