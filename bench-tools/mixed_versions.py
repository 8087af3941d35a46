"""An older release of the plugin and this one on one Redis, both ways, with real processes: a rolling upgrade.

    .venv/bin/python bench-tools/mixed_versions.py OLD_SRC [REQUESTS]

OLD_SRC is the `src` folder of an older checkout (`git worktree add /tmp/old <commit>`: /tmp/old/src).
Two phases on one Redis and two simulated vLLM replicas: this release's scraper under the older
release's proxy, then the older scraper under this release's proxy (each process imports the release it
is given through PYTHONPATH). Each phase sends REQUESTS (default 200) completions through the proxy and
prints the statuses, the decisions the proxy logged and its fallback lines; a rolling upgrade is safe
when every request succeeds, every one is a decision and no fallback is logged.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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

ADAPTERS = ["sql-lora", "tweet-summary", "chat-lora"]
NEW_SRC = str(Path(__file__).resolve().parents[1] / "src")


def _cli(src: str) -> str:
    """The command line's module in the release at `src` (`ops/cli.py` since the package's folders, `cli.py` before)."""
    return "lora_affinity_plugin.ops.cli" if (Path(src) / "lora_affinity_plugin" / "ops").is_dir() else "lora_affinity_plugin.cli"


def _phase(name: str, tmp: Path, config: Path, port: int, scraper_src: str, proxy_src: str, requests: int) -> dict:
    scraper = Proc(f"scraper-{name}", [sys.executable, "-m", _cli(scraper_src), "scrape", "--config",
                                       str(config)], tmp, env=child_env(PYTHONPATH=scraper_src))
    proxy = litellm_proxy(config, port, tmp, f"proxy-{name}",
                          env=child_env(PYTHONPATH=proxy_src, LORA_AFFINITY_LOG_LEVEL="DEBUG"))
    try:
        time.sleep(1.0)

        def one(i: int) -> int:
            with httpx.Client(timeout=60) as http:
                return http.post(f"http://127.0.0.1:{port}/v1/completions", headers={"Authorization": f"Bearer {MASTER_KEY}"},
                                 json={"model": ADAPTERS[i % 3], "prompt": "hello " * 20, "max_tokens": 12}).status_code

        with ThreadPoolExecutor(4) as pool:
            statuses = Counter(pool.map(one, range(requests)))
        log = proxy.log()
        return {"statuses": dict(statuses), "decisions": log.count(" -> "),
                "fallback lines": log.count("routing by metrics unavailable")}
    finally:
        proxy.stop()
        scraper.stop()


def main() -> int:
    if len(sys.argv) < 2 or not (Path(sys.argv[1]) / "lora_affinity_plugin").is_dir():
        print(__doc__, file=sys.stderr)
        return 2
    old_src, requests = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200
    tmp = scratch_dir("lora-affinity-versions-")
    base = free_port_range(2)
    redis_port, proxy_port = (next(p for p in iter(free_port, None) if p not in (base, base + 1)) for _ in range(2))
    store = redis_server(redis_port, tmp)
    sim = Proc("sim", [sys.executable, "-m", _cli(NEW_SRC), "sim", "--replicas", "2", "--base-port",
                       str(base), "--speed", "10", "--mean-output-tokens", "20", "--warm-adapters", ",".join(ADAPTERS)], tmp)
    try:
        for port in (base, base + 1):
            wait_port(port)
        config = tmp / "config.yaml"
        config.write_text(yaml.safe_dump(proxy_config([base, base + 1], redis_port, scrape_interval_ms=100)))
        for name, scraper_src, proxy_src in (("new scraper, old proxy", NEW_SRC, old_src),
                                             ("old scraper, new proxy", old_src, NEW_SRC)):
            print(f"{name}: {_phase(name.replace(' ', '-').replace(',', ''), tmp, config, proxy_port, scraper_src, proxy_src, requests)}",
                  flush=True)
            time.sleep(1.5)  # the lease of this phase's scraper runs out
    finally:
        sim.stop()
        store.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
