"""`lora-affinity bench --scenario soak` from the command line, with real processes (its own module: CI runs the
slowest modules first, side by side)."""

import json
import re

from procs import run_cli as run


def test_short_soak_with_faults_reports_no_errors_no_leaks_and_attributes_memory(tmp_path):
    stdout = run(["bench", "--scenario", "soak", "--minutes", "0.2", "--rate", "6", "--trace",
                  "--chart", str(tmp_path / "soak.png"), "--json", str(tmp_path / "soak.json")], timeout=400)
    assert "Redis restarted" in stdout and "killed and restarted" in stdout
    assert re.findall(r"^proxy with plugin: requests \d+, errors 0( \(client-side failures on responses the proxy answered 200: .*\))?$", stdout, re.M)
    assert re.findall(r"^proxy without plugin: requests \d+, errors \d+( \(client-side .*\))?$", stdout, re.M)  # LiteLLM alone: reported
    assert "proxy with the plugin vs without, at the end:" in stdout
    assert "traced growth between the snapshots: plugin" in stdout  # tracemalloc snapshots were taken and compared
    samples = json.loads((tmp_path / "soak.json").read_text())["memory"]
    assert len(samples) >= 10 and {"proxy with plugin", "proxy without plugin", "scraper"} <= set(samples[0])
    assert (tmp_path / "soak.png").stat().st_size > 10_000
    assert "left running or waiting on the replicas after the load: 0" in stdout
    assert "in flight in the proxy after the load (shared in Redis by 2 process): 0" in stdout
