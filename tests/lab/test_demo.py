"""`lora-affinity demo` from the command line, with real processes (its own module: CI runs the
slowest modules first, side by side)."""

import json

from procs import run_cli as run


def test_demo_runs_end_to_end(tmp_path):
    stdout = run(["demo", "--requests", "60", "--speed", "20", "--gateways", "1", "--out", str(tmp_path)], timeout=400)
    assert "Redis: redis-server" in stdout
    assert "simple-shuffle" in stdout and "lora-affinity completed" in stdout
    rows = json.loads((tmp_path / "demo.json").read_text())
    assert [r["strategy"] for r in rows] == ["simple-shuffle", "lora-affinity"]
    # The proxies' load is measured and reported: what each sustained, its busiest worker, CPU per request.
    assert "Proxy load (1 per strategy" in stdout
    for r in rows:
        t = r["transport"]
        assert t["proxy_requests_per_s"] > 0 and 0 < t["proxy_busiest_worker"] and t["proxy_cpu_ms_per_request"] > 0
        # The live seed benchmark the demo runs (`bench --mode live`'s own loop): every request accounted for
        assert r["completed"] + r["timeouts"] + r["errors"] == 60 and r["errors"] == 0, r
        assert r["completed"] > 45 and r["output_tokens_per_s"] > 0 and sum(r["per_replica"]) >= r["completed"]
    assert "vs shuffle" in stdout and (tmp_path / "demo.png").stat().st_size > 1000
