"""`lora-affinity bench --scenario host-cost` from the command line, with real processes (its own module:
CI runs the slowest modules first, side by side)."""

import subprocess

from procs import CLI, child_env


def test_host_cost_compares_proxy_cpu_per_request_kind_with_and_without_the_plugin():
    out = subprocess.run(CLI + ["bench", "--scenario", "host-cost", "--requests", "4", "--repeat", "2"],
                         capture_output=True, text=True, timeout=300, env=child_env())
    assert out.returncode in (0, 1), out.stderr[-3000:]  # 1: a turn saturated or failed, said on stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
            if line.split() and line.split()[0] in ("chat-stream", "chat", "text", "text-stream")}
    assert set(rows) == {"chat-stream", "chat", "text", "text-stream"}, out.stdout
    for cells in rows.values():
        alone, plugin, ratio = float(cells[1]), float(cells[2]), float(cells[3].rstrip("x"))
        assert alone > 0 and plugin > 0 and abs(ratio - plugin / alone) < 0.01
    assert "refused" not in out.stderr or out.returncode == 1
