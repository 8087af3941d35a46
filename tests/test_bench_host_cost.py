"""`lora-affinity bench --scenario host-cost` from the command line, with real processes (its own module:
CI runs the slowest modules first, side by side)."""

import json
import statistics
import subprocess

from procs import CLI, child_env


def test_host_cost_compares_proxy_cpu_per_request_kind_with_and_without_the_plugin(tmp_path):
    path = tmp_path / "host-cost.json"
    # With KV events and long prompts: the plugin's proxy tokenizes each prompt and matches it against the
    # index the engines' events build (the bench refuses a run whose index stayed empty).
    out = subprocess.run(CLI + ["bench", "--scenario", "host-cost", "--requests", "4", "--repeat", "2", "--json",
                                str(path), "--kv-events", "--prompt-chars", "4000"],
                         capture_output=True, text=True, timeout=300, env=child_env())
    assert out.returncode in (0, 1), out.stderr[-3000:]  # 1: a turn saturated or failed, said on stderr
    rows = json.loads(path.read_text())
    assert set(rows) == {"chat-stream", "chat", "text", "text-stream"}, rows
    printed = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.split() and line.split()[0] in rows}
    for kind, row in rows.items():
        assert len(row["alone_ms"]) == len(row["plugin_ms"]) == 2 and min(row["alone_ms"] + row["plugin_ms"]) > 0
        ratio = statistics.median(row["plugin_ms"]) / statistics.median(row["alone_ms"])
        assert row["ratio"] == ratio and row["met"] == (ratio <= row["goal"])  # the goal judged on the raw ratio
        assert printed[kind][4] == ("met" if row["met"] else "MISSED"), printed[kind]
        per_round = [p / a for p, a in zip(row["plugin_ms"], row["alone_ms"])]
        assert row["round_ratios"] == per_round and row["per_round_ratio"] == statistics.median(per_round)
        assert printed[kind][6] == f"{statistics.median(per_round):.2f}x" and printed[kind][7] == (
            "met" if row["per_round_met"] else "MISSED"), printed[kind]
        idle, requests = row["idle_ms_per_s"], 4  # the request path: each turn less its proxy's idle CPU
        for who, name in (("alone", "alone"), ("plugin", "plugin")):
            assert row[f"{who}_net_ms"] == [ms - idle[name] * s / requests
                                            for ms, s in zip(row[f"{who}_ms"], row[f"{who}_s"])]
        alone_net = statistics.median(row["alone_net_ms"])
        path = statistics.median(row["plugin_net_ms"]) / alone_net if alone_net > 0 else None
        assert row["request_path_ratio"] == path and row["request_path_met"] == (path is not None and path <= 1.10)
        assert printed[kind][8:] == (["n/a", "n/a"] if path is None else
                                     [f"{path:.2f}x", "met" if row["request_path_met"] else "MISSED"]), printed[kind]
        # Idle over a small run's 2 s may read 0: CPU time counts in 10 ms ticks.
        assert min(idle.values()) >= 0 and all(0 < s < 120 for s in row["alone_s"] + row["plugin_s"])
    assert "refused" not in out.stderr or out.returncode == 1
    (held,) = [line for line in out.stdout.splitlines() if "the shared index holds" in line]
    assert int(held.split("holds ")[1].split()[0]) > 0 and held.endswith("of 2 pods"), held
