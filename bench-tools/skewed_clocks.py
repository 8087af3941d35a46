"""How much the proxy completes with the scraper's clock 3 s ahead and 3 s behind, beside an unskewed scraper.

    .venv/bin/python bench-tools/skewed_clocks.py [ROUNDS] [SECONDS]

Real processes: redis-server, three simulated vLLM replicas (10x), one `litellm --config` proxy with the
plugin, and the scraper, run under Debian's `faketime` for the skewed phases (its wall clock shifted, its
monotonic clock left alone). Each round runs the three phases in turn (no skew, +3 s, -3 s), each a closed
loop of 6 clients for SECONDS (default 6), so a machine whose pace wanders weighs on every phase alike.
Prints each phase's completions and, per skew, the median over ROUNDS (default 3) of its ratio to the
unskewed phase of the same round (after a warm-up phase that counts for none); the goal is at least 0.97x.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import yaml

from lora_affinity_lab.processes import (
    MASTER_KEY,
    Proc,
    child_env,
    free_port,
    free_port_range,
    litellm_proxy,
    proxy_config,
    redis_server,
    scratch_dir,
    wait_port,
)

ADAPTERS = ["sql-lora", "tweet-summary", "chat-lora", "code-lora"]
SKEWS = ("none", "+3s", "-3s")
CLIENTS = 6


def _completions(url: str, seconds: float) -> int:
    deadline = time.monotonic() + seconds

    def client(i: int) -> int:
        done = 0
        with httpx.Client(timeout=30) as http:
            while time.monotonic() < deadline:
                r = http.post(url + "/v1/completions", headers={"Authorization": f"Bearer {MASTER_KEY}"},
                              json={"model": ADAPTERS[(i + done) % len(ADAPTERS)], "prompt": "hi", "max_tokens": 16})
                if r.status_code != 200:
                    raise SystemExit(f"a request failed: HTTP {r.status_code} {r.text[:200]}")
                done += 1
        return done

    with ThreadPoolExecutor(CLIENTS) as pool:
        return sum(pool.map(client, range(CLIENTS)))


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 6.0
    if shutil.which("faketime") is None:
        print("faketime is not installed (Debian package faketime)", file=sys.stderr)
        return 2
    tmp = scratch_dir("lora-affinity-clocks-")
    base = free_port_range(3)
    redis_port, proxy_port = (next(p for p in iter(free_port, None) if not base <= p < base + 3) for _ in range(2))
    store = redis_server(redis_port, tmp)
    procs = [Proc("sim", [sys.executable, "-m", "lora_affinity_plugin.ops.cli", "sim", "--replicas", "3", "--base-port",
                          str(base), "--speed", "10", "--max-loras", "2", "--mean-output-tokens", "20"], tmp)]
    try:
        for port in range(base, base + 3):
            wait_port(port)
        config = tmp / "config.yaml"
        config.write_text(yaml.safe_dump(proxy_config(list(range(base, base + 3)), redis_port, scrape_interval_ms=100)))
        procs.append(litellm_proxy(config, proxy_port, tmp))
        url = f"http://127.0.0.1:{proxy_port}"
        completed: dict[str, list[int]] = {skew: [] for skew in SKEWS}
        warm = Proc("scraper-warm-up", [sys.executable, "-m", "lora_affinity_plugin.ops.cli", "scrape", "--config", str(config)],
                    tmp)
        try:  # first requests build the proxy's clients and the replicas' adapters: not a phase's
            time.sleep(1.0)
            _completions(url, seconds)
        finally:
            warm.stop()
        for r in range(rounds):
            for skew in SKEWS:
                args = [sys.executable, "-m", "lora_affinity_plugin.ops.cli", "scrape", "--config", str(config)]
                if skew != "none":
                    args = ["faketime", "-f", skew, *args]
                scraper = Proc(f"scraper-{r}-{skew}", args, tmp, env=child_env(FAKETIME_DONT_FAKE_MONOTONIC="1"))
                try:
                    time.sleep(2.5)  # the previous scraper's lease runs out; this one takes it
                    completed[skew].append(_completions(url, seconds))
                finally:
                    scraper.stop()
                print(f"round {r + 1}, scraper's clock {skew}: {completed[skew][-1]} completed", flush=True)
        for skew in SKEWS[1:]:
            ratios = [n / base_n for n, base_n in zip(completed[skew], completed["none"])]
            print(f"scraper's clock {skew}: median {statistics.median(ratios):.3f}x the unskewed phase "
                  f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)}); goal >= 0.97x")
    finally:
        for proc in reversed(procs):
            proc.stop()
        store.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
