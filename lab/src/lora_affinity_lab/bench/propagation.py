"""`lora-affinity bench --scenario propagation`: from `thresholds set` to applied in 3 proxy replicas.

Real Redis, real proxies (with LiteLLM's Prometheus callback, so each exposes the settings version it
applied on /metrics), 50 changes; each is timed until every proxy reports the new version.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time

import httpx
import redis
import yaml

from lora_affinity_plugin.config import live_settings
from ..processes import (
    Proc,
    free_port,
    proxy_config,
    redis_server,
    scratch_dir,
    start_litellm_proxy,
    wait_port,
    wait_proxy,
)
from lora_affinity_plugin.config.settings import build_settings

_VERSION = re.compile(r"^lora_affinity_settings_version (\S+)$", re.M)


def _applied(client: httpx.Client, port: int) -> int:
    match = _VERSION.search(client.get(f"http://127.0.0.1:{port}/metrics/").text)
    return int(float(match.group(1))) if match else 0


def run_propagation(args: argparse.Namespace) -> int:
    changes = args.requests or 50
    workdir = scratch_dir("lora-affinity-propagation-")
    redis_port, sim_port = free_port(), free_port()
    procs: list[Proc] = []
    store = redis_server(redis_port, workdir, allow_embedded=True)
    try:
        procs.append(Proc("sim", [sys.executable, "-m", "lora_affinity_plugin.ops.cli", "sim", "--replicas", "1",
                                  "--base-port", str(sim_port)], workdir))
        wait_port(sim_port)
        config = proxy_config([sim_port], redis_port)
        config["litellm_settings"]["callbacks"].insert(0, "prometheus")
        config["litellm_settings"]["require_auth_for_metrics_endpoint"] = False
        path = workdir / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        ports = [free_port() for _ in range(args.gateways if args.gateways > 1 else 3)]
        proxies = [start_litellm_proxy(path, p, workdir, f"proxy-{i}") for i, p in enumerate(ports)]
        procs += proxies
        for proc, port in zip(proxies, ports):
            wait_proxy(proc, port)
        base = build_settings({"redis_url": f"redis://127.0.0.1:{redis_port}/0"}, environ={})
        client, http = redis.Redis(port=redis_port), httpx.Client(timeout=5)
        for port in ports:  # the first /metrics render of a proxy takes about a second: not part of the figure
            _applied(http, port)
        per_proxy: list[list[float]] = [[] for _ in ports]
        for i in range(changes):
            value = 3 + i % 2  # alternate queue_threshold_critical between 3 and 4
            started = time.monotonic()
            _, new = live_settings.write(client, base, {"queue_threshold_critical": value}, "bench")
            pending = set(range(len(ports)))
            while pending and time.monotonic() - started < 10:
                for j in list(pending):
                    if _applied(http, ports[j]) >= new.version:
                        per_proxy[j].append(time.monotonic() - started)
                        pending.discard(j)
            time.sleep(0.05)
        everyone = [max(times) for times in zip(*per_proxy)]
        print(f"settings propagation over {changes} changes, {len(ports)} proxy replicas, one Redis (seconds)")
        print(f"{'':<16}{'median':>8}{'p90':>8}{'p99':>8}{'max':>8}")
        for j, times in enumerate(per_proxy):
            print(f"{'proxy ' + str(j):<16}{_stats(times)}")
        print(f"{'all applied':<16}{_stats(everyone)}")
    finally:
        for proc in reversed(procs):
            proc.stop()
        store.stop()
    return 0


def _stats(values: list[float]) -> str:
    if not values:
        return "   (none applied)"
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"{statistics.median(ordered):8.3f}{p90:8.3f}{p99:8.3f}{ordered[-1]:8.3f}"
