"""`lora-affinity bench --scenario pooling`: upstream connections with and without the pooled clients.

Side by side in one run, each on a fresh simulated fleet behind a real proxy: LiteLLM alone
(simple-shuffle), the plugin with `pooled_clients: false` (LiteLLM's own clients), and the plugin.
Per strategy: the seed workload (connections per pod against its peak of requests in flight, the
proxy's sockets, "Unclosed client session" warnings, CPU per request), then the proxy's overhead:
short requests sent straight to a replica and through the proxy, latency p50/p99 compared.
`--repeat N` runs it N times and counts the runs that lost requests to connection errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from ..processes import MASTER_KEY, free_port, redis_server, scratch_dir
from .live import DEFAULT_SPEED, Fleet, run_strategy
from .results import Result, format_table, percentiles, refusal
from .scenarios import get_scenario, with_overrides
from .transport import TransportStats, cpu_seconds, format_transport_table

STRATEGIES = ["simple-shuffle", "lora-affinity-unpooled", "lora-affinity"]
PROBE_REQUESTS = 600
PROBE_CONCURRENCY = 10
CONNECTION_ERRORS = ("ClientConnectorError", "ServerDisconnected", "ClientOSError", "onnection", "disconnected")


@dataclass
class Overhead:
    direct_ms: dict[str, float]
    proxy_ms: dict[str, float]
    proxy_cpu_ms_per_request: float


async def _timed_requests(url: str, model: str, headers: dict) -> list[float]:
    """Latencies (ms) of PROBE_REQUESTS one-token completions, PROBE_CONCURRENCY at a time; raises on any error."""
    latencies: list[float] = []
    body = {"model": model, "prompt": "ping", "max_tokens": 1}
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=PROBE_CONCURRENCY)) as client:
        async def worker(n: int) -> None:
            for _ in range(n):
                started = time.perf_counter()
                response = await client.post(url + "/v1/completions", json=body, headers=headers)
                response.raise_for_status()
                latencies.append((time.perf_counter() - started) * 1000)

        share = PROBE_REQUESTS // PROBE_CONCURRENCY
        await asyncio.gather(*(worker(share) for _ in range(PROBE_CONCURRENCY)))
    return latencies


def measure_overhead(fleet: Fleet) -> Overhead:
    """The same short requests straight to one replica, then through the proxy (the base model: no LoRA)."""
    model = "meta-llama/Llama-2-7b-hf"
    direct = asyncio.run(_timed_requests(fleet.replica_urls[0], model, {}))
    pids = [p.popen.pid for p in fleet.proxies]
    cpu_before = sum(map(cpu_seconds, pids))
    proxied = asyncio.run(_timed_requests(fleet.targets[0], model, {"Authorization": f"Bearer {MASTER_KEY}"}))
    cpu = sum(map(cpu_seconds, pids)) - cpu_before
    return Overhead(percentiles(direct), percentiles(proxied), round(1000 * cpu / len(proxied), 2))


def _lost_to_connections(result: Result) -> int:
    return sum(n for kind, n in result.error_kinds.items() if any(k in kind for k in CONNECTION_ERRORS))


def run_pooling(args: argparse.Namespace) -> int:
    scenario = with_overrides(get_scenario("seed"), requests=args.requests)
    strategies = [s.strip() for s in args.strategies.split(",")] if args.strategies else STRATEGIES
    speed = args.speed or DEFAULT_SPEED
    repeat = max(1, args.repeat)
    workdir = scratch_dir("lora-affinity-bench-")
    redis_port = free_port()
    store = redis_server(redis_port, workdir, allow_embedded=True)
    print(f"pooling: the seed workload ({scenario.requests} requests, {scenario.connections} connections) at "
          f"{speed:g}x, then {PROBE_REQUESTS} one-token requests direct vs through the proxy; x{repeat}; logs in {workdir}")
    runs: dict[str, list[tuple[Result, Overhead]]] = {s: [] for s in strategies}
    try:
        with tqdm(total=scenario.requests * len(strategies) * repeat, unit="req", leave=False) as bar:
            for i in range(repeat):
                for strategy in strategies:
                    overheads: list[Overhead] = []
                    result = run_strategy(scenario, strategy, speed, 1, args.seed + i, redis_port, workdir, bar,
                                          after_load=lambda fleet, _: overheads.append(measure_overhead(fleet)))
                    runs[strategy].append((result, overheads[0]))
    finally:
        store.stop()
    refused = [reason for s in strategies for r, _ in runs[s] if (reason := refusal(r))]
    if refused:  # a broken run is not a result: say why, publish nothing
        for reason in refused:
            print(f"refused: {reason}", file=sys.stderr)
        return 1
    last = [runs[s][-1][0] for s in strategies]
    print(format_table(last))
    print(format_transport_table([(s, TransportStats.from_dict(runs[s][-1][0].transport)) for s in strategies]))
    print(_overhead_table(strategies, runs))
    if repeat > 1:
        print(_integrity_table(strategies, runs))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(
            {s: [{"result": r.to_dict(), "overhead": asdict(o)} for r, o in runs[s]] for s in strategies}, indent=1))
        print(f"every run written to {args.json_path}")
    return 0


def _overhead_table(strategies: list[str], runs: dict[str, list[tuple[Result, Overhead]]]) -> str:
    head = (f"{'strategy':<26}{'direct p50/p99 ms':>19}{'proxy p50/p99 ms':>18}{'overhead p50/p99 ms':>21}"
            f"{'proxy CPU ms/req':>18}")
    lines = [f"proxy overhead ({PROBE_REQUESTS} one-token requests, {PROBE_CONCURRENCY} at a time; medians over runs):", head, "-" * len(head)]
    for s in strategies:
        def med(pick) -> float:
            return statistics.median(pick(o) for _, o in runs[s])

        d50, d99 = med(lambda o: o.direct_ms["p50"]), med(lambda o: o.direct_ms["p99"])
        p50, p99 = med(lambda o: o.proxy_ms["p50"]), med(lambda o: o.proxy_ms["p99"])
        cpu = med(lambda o: o.proxy_cpu_ms_per_request)
        lines.append(f"{s:<26}{f'{d50:.1f}/{d99:.1f}':>19}{f'{p50:.1f}/{p99:.1f}':>18}"
                     f"{f'{p50 - d50:.1f}/{p99 - d99:.1f}':>21}{cpu:>18.2f}")
    return "\n".join(lines)


def _integrity_table(strategies: list[str], runs: dict[str, list[tuple[Result, Overhead]]]) -> str:
    lines = ["runs that lost requests to connection errors, and medians over the runs:"]
    for s in strategies:
        results = [r for r, _ in runs[s]]
        lost = [_lost_to_connections(r) for r in results]
        hit = sum(1 for n in lost if n)
        conns = statistics.median(TransportStats.from_dict(r.transport).connections_per_1k for r in results)
        unclosed = statistics.median(r.transport.get("unclosed_sessions", 0) for r in results)
        pooled = sum(1 for r in results if TransportStats.from_dict(r.transport).pooled)
        errors = sum(1 for r in results if r.errors)
        lines.append(f"  {s:<26} {hit}/{len(results)} runs lost requests to connection errors (most in one run: "
                     f"{max(lost)}), {errors}/{len(results)} runs had any error; "
                     f"completed median {statistics.median(r.completed for r in results):.0f}; "
                     f"connections/1k req median {conns:.0f}; unclosed median {unclosed:.0f}; "
                     f"pooled in {pooled}/{len(results)} runs")
    return "\n".join(lines)
