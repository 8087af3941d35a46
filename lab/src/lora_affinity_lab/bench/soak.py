"""`lora-affinity bench --scenario soak --minutes N`: steady Poisson load with faults on a schedule.

Real processes: redis-server, 3 simulated replicas (one process each, so one can be killed), the
scraper, a proxy with the plugin and, side by side under the same load, a proxy without it (LiteLLM's
simple-shuffle). Requests are chats under 8 long system prompts, so the prefix index is in use. Every
quarter of the run a fault is injected: Redis restarted, a replica killed and brought back; one
request in five is a stream the client hangs up on. The memory of every process is sampled through the
run (table, `--json`, and a chart at `--chart`). With `--trace` a third proxy, with the plugin and
tracemalloc on, takes the same load and is asked for snapshots (SIGUSR1) after the warm-up and at the
end: the growth between them is attributed by file, the plugin's against the rest. At the end: request
errors, work left on the replicas, and the proxy's requests in flight as its peers see them in Redis (a
leak would show in either; both must be back to zero).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import httpx
import redis
import yaml

from lora_affinity_plugin.fleet.inflight import read_shared
from lora_affinity_plugin.telemetry.memtrace import ENV
from ..processes import (
    MASTER_KEY,
    Proc,
    child_env,
    free_port,
    litellm_proxy,
    proxy_config,
    redis_server,
    scratch_dir,
    wait_port,
)


def _rss_mb(proc: Proc) -> float:
    try:
        status = Path(f"/proc/{proc.popen.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024
    except (OSError, AttributeError):
        return float("nan")


def _sim(port: int, workdir: Path) -> Proc:
    return Proc(f"sim-{port}", [sys.executable, "-m", "lora_affinity_plugin.ops.cli", "sim", "--replicas", "1",
                                "--base-port", str(port), "--speed", "20"], workdir)


def _inflight_after(redis_port: int, within_s: float = 5.0) -> tuple[int, int]:
    """(processes sharing, requests in flight) once the load is over (the proxy publishes every refresh)."""
    client = redis.Redis(port=redis_port)
    deadline = time.monotonic() + within_s
    while True:
        processes, counts = read_shared(client, "lora_affinity")
        total = sum(counts.values())
        if (processes and total == 0) or time.monotonic() > deadline:
            return processes, total
        time.sleep(0.1)


def _left_on_replicas(ports: list[int]) -> int:
    total = 0
    for port in ports:
        page = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        total += sum(int(float(v)) for v in re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)", page, re.M))
    return total


SYSTEM_PROMPTS = [f"You are assistant {i}. " + "Answer briefly and cite the manual. " * 60 for i in range(8)]


def _errors(counts: dict, proxy) -> int:
    """Requests that failed at the proxy: a status other than 200, or a client-side failure the proxy's
    access log does not show answered 200 (on a busy machine a client may fail reading a response the
    proxy sent whole; that is the load generator's, counted apart)."""
    answered = proxy.log().count('/v1/chat/completions HTTP/1.1" 200')
    unexplained = max(0, counts["client"] - max(0, answered - counts["ok"]))
    return counts["errors"] + unexplained


def _client_note(counts: dict, explained: bool) -> str:
    kinds = ", ".join(f"{n} x {k}" for k, n in counts.get("client_kinds", {}).items())
    if not kinds:
        return ""
    return (f" (client-side failures on responses the proxy answered 200: {kinds})" if explained
            else f" (client-side failures the proxy's log shows no answer to: {kinds})")


async def _client(url: str, rate: float, until: float, rng: random.Random, counts: dict) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        async def one(i: int, adapter: int, system: int) -> None:
            body = {"model": f"adapter-{adapter}", "max_tokens": 24,
                    "messages": [{"role": "system", "content": SYSTEM_PROMPTS[system]},
                                 {"role": "user", "content": f"question {i}"}]}
            headers = {"Authorization": f"Bearer {MASTER_KEY}"}
            try:
                if i % 5 == 0:  # a streaming client that hangs up after the first chunk
                    async with client.stream("POST", url + "/v1/chat/completions", headers=headers,
                                             json={**body, "stream": True}) as resp:
                        async for _ in resp.aiter_lines():
                            break
                    counts["ok" if resp.status_code == 200 else "errors"] += 1
                else:
                    resp = await client.post(url + "/v1/chat/completions", headers=headers, json=body)
                    counts["ok" if resp.status_code == 200 else "errors"] += 1
            except httpx.HTTPError as exc:  # the client's side: the proxy's log says what it answered
                counts["client"] += 1
                kind = f"{type(exc).__name__} ({exc})" if str(exc) else type(exc).__name__
                counts.setdefault("client_kinds", {}).setdefault(kind, 0)
                counts["client_kinds"][kind] += 1

        tasks, i = set(), 0
        while time.monotonic() < until:
            task = asyncio.create_task(one(i, rng.randrange(8), rng.randrange(len(SYSTEM_PROMPTS))))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)


async def _sample_memory(current: Callable[[], dict[str, Proc]], until: float, every_s: float, rows: list[dict]) -> None:
    """Every process's resident memory every `every_s` (a restarted process is sampled as its new self)."""
    start = time.monotonic()
    while time.monotonic() < until:
        rows.append({"t": round(time.monotonic() - start, 1), **{name: round(_rss_mb(p), 1) for name, p in current().items()}})
        await asyncio.sleep(every_s)


def _attribute(snapshots: list[Path], top: int = 8) -> list[str]:
    """Growth between two tracemalloc snapshots by file; the plugin's files against the rest."""
    import tracemalloc

    if len(snapshots) < 2 or not all(p.exists() for p in snapshots):
        return ["  (no tracemalloc snapshots: the proxy did not write them)"]
    first, last = (tracemalloc.Snapshot.load(str(p)) for p in snapshots[:2])
    stats = last.compare_to(first, "filename")
    ours = sum(s.size_diff for s in stats if "lora_affinity_plugin" in s.traceback[0].filename)
    rest = sum(s.size_diff for s in stats if "lora_affinity_plugin" not in s.traceback[0].filename)
    lines = [f"  traced growth between the snapshots: plugin {ours / 1e6:+.2f} MB, everything else {rest / 1e6:+.2f} MB"]
    lines += [f"    {s.size_diff / 1e6:+8.2f} MB  {s.traceback[0].filename.split('site-packages/')[-1]}"
              for s in sorted(stats, key=lambda s: -abs(s.size_diff))[:top]]
    return lines


def _memory_chart(rows: list[dict], path: str, faults: list[tuple[float, str]]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for name in [k for k in rows[0] if k != "t"]:
        ax.plot([r["t"] / 60 for r in rows], [r[name] for r in rows], label=name,
                linewidth=2 if name.startswith("proxy") else 1)
    for at, what in faults:
        ax.axvline(at / 60, color="gray", linestyle=":", linewidth=1)
        ax.text(at / 60, ax.get_ylim()[1] * 0.98, what, rotation=90, va="top", fontsize=7)
    ax.set_xlabel("minutes")
    ax.set_ylabel("resident memory (MB)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_soak(args: argparse.Namespace) -> int:
    minutes = args.minutes
    rate = args.rate or 20.0
    workdir = scratch_dir("lora-affinity-soak-")
    redis_port = free_port()
    ports = [free_port() for _ in range(3)]
    sims = {p: _sim(p, workdir) for p in ports}
    store = {"redis": redis_server(redis_port, workdir, allow_embedded=True)}
    procs: dict[str, Proc] = {}
    try:
        for p in ports:
            wait_port(p)
        config = proxy_config(ports, redis_port, scrape_interval_ms=100, stale_after_ms=500, metrics_ttl_ms=2000)
        config["router_settings"]["num_retries"] = 2
        path = workdir / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        plain = proxy_config(ports, redis_port, "simple-shuffle")
        plain["router_settings"]["num_retries"] = 2
        plain_path = workdir / "config-without.yaml"
        plain_path.write_text(yaml.safe_dump(plain))
        procs["scraper"] = Proc("scraper", [sys.executable, "-m", "lora_affinity_plugin.ops.cli", "scrape", "--config",
                                            str(path)], workdir)
        proxy_ports = {"proxy with plugin": free_port(), "proxy without plugin": free_port()}
        snap_prefix = workdir / "trace"
        if args.trace:
            proxy_ports["proxy with plugin, tracemalloc"] = free_port()
        for name, port in proxy_ports.items():
            env = child_env(**{ENV: str(snap_prefix)}) if name.endswith("tracemalloc") else None
            procs[name] = litellm_proxy(plain_path if name == "proxy without plugin" else path, port, workdir,
                                        name.replace(" ", "-").replace(",", ""), env=env)
        procs["redis"] = store["redis"]
        time.sleep(1)
        duration = minutes * 60
        counts = {name: {"ok": 0, "errors": 0, "client": 0} for name in proxy_ports}
        faults: list[tuple[float, str]] = []
        rows: list[dict] = []

        async def schedule(start: float) -> None:
            quarter = duration / 4
            await asyncio.sleep(quarter)
            store["redis"].stop()
            await asyncio.sleep(min(3.0, quarter / 3))
            store["redis"] = procs["redis"] = redis_server(redis_port, workdir, allow_embedded=True)
            faults.append((time.monotonic() - start, "Redis restarted"))
            await asyncio.sleep(quarter)
            victim = ports[0]
            sims[victim].stop()
            await asyncio.sleep(min(3.0, quarter / 3))
            sims[victim] = _sim(victim, workdir)
            faults.append((time.monotonic() - start, f"replica {victim} killed and restarted"))

        async def snapshots(start: float) -> None:
            if not args.trace:
                return
            tracer = procs["proxy with plugin, tracemalloc"].popen
            await asyncio.sleep(duration / 6)  # after the warm-up: caches filled, the index at its size
            tracer.send_signal(signal.SIGUSR1)
            await asyncio.sleep(max(0.0, duration - (time.monotonic() - start) - 2))
            tracer.send_signal(signal.SIGUSR1)

        async def main() -> None:
            start = time.monotonic()
            clients = [_client(f"http://127.0.0.1:{port}", rate, start + duration, random.Random(args.seed), counts[name])
                       for name, port in proxy_ports.items()]
            await asyncio.gather(*clients, schedule(start), snapshots(start),
                                 _sample_memory(lambda: {**procs, **{f"replica {i}": sims[p] for i, p in enumerate(ports)}},
                                                start + duration, max(1.0, duration / 300), rows))

        print(f"soak: {minutes:g} min of Poisson load at {rate:g} req/s to each of {len(proxy_ports)} proxies "
              f"with faults; logs in {workdir}")
        asyncio.run(main())
        time.sleep(3)
        left = _left_on_replicas(ports)
        sharing, inflight = _inflight_after(redis_port)
        for at, what in faults:
            print(f"  fault at {at:6.1f}s {what}")
        for name, c in counts.items():
            errors = _errors(c, procs[name])
            print(f"{name}: requests {c['ok'] + c['errors'] + c['client']}, errors {errors}"
                  + _client_note(c, explained=errors < c["errors"] + c["client"]))
        warm = next((r for r in rows if r["t"] >= duration / 6), rows[0])
        last = rows[-1]
        print(f"{'process':<32}{'start MB':>9}{'after warm-up MB':>17}{'end MB':>8}{'growth after warm-up':>22}")
        for name in [k for k in rows[0] if k != "t"]:
            print(f"{name:<32}{rows[0][name]:>9.0f}{warm[name]:>17.0f}{last[name]:>8.0f}{last[name] - warm[name]:>+20.0f} MB")
        with_end, without_end = last["proxy with plugin"], last["proxy without plugin"]
        print(f"proxy with the plugin vs without, at the end: {with_end:.0f} vs {without_end:.0f} MB "
              f"({with_end / without_end - 1:+.1%}; goal within 5%)")
        if args.trace:
            print("\n".join(_attribute([Path(f"{snap_prefix}.1.snap"), Path(f"{snap_prefix}.2.snap")])))
        chart = _memory_chart(rows, args.chart, faults)
        if chart:
            print(f"memory chart written to {chart}")
        if args.json_path:
            Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_path).write_text(json.dumps({"faults": faults, "counts": counts, "memory": rows}, indent=1))
            print(f"samples written to {args.json_path}")
        print(f"left running or waiting on the replicas after the load: {left}")
        print(f"in flight in the proxy after the load (shared in Redis by {sharing} process): {inflight}")
        errors = _errors(counts["proxy with plugin"], procs["proxy with plugin"])  # the others: reported, not judged
        return 0 if errors == 0 and left == 0 and sharing and inflight == 0 else 1
    finally:
        for proc in reversed(list(procs.values())):
            proc.stop()
        for proc in sims.values():
            proc.stop()
        store["redis"].stop()
