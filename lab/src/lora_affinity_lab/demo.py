"""`lora-affinity demo`: the whole product on this machine, with embedded defaults.

Redis (redis-server if installed, else fakeredis's TCP server), a simulated fleet of 6 vLLM
replicas, the scraper, 2 LiteLLM proxy replicas with the plugin from config.example.yaml, and the
seed's benchmark run through them, then the same fleet behind LiteLLM's simple-shuffle.
Ctrl-C or the end stops every process it started.

The simulated fleet runs faster than real time; the proxies do not. When a proxy worker was busier
than 85% of a core, the row measured the proxy; when this machine's cores were over 90% busy, or the
simulated replicas lost over 10% of the run to steps run late, it measured the machine (every process
queued for CPU while the simulated clock ran on). Either way the demo says so and runs again at half the
speed (unless `--speed` was given).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .bench.live import run_strategy
from .bench.results import Result, format_table, machine_warning, refusal, write_chart, write_json
from .bench.scenarios import get_scenario, with_overrides
from .processes import free_port, redis_server, scratch_dir

_EXAMPLE = Path(__file__).resolve().parents[3] / "config.example.yaml"  # the repository root, above lab/src


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speed", type=float, default=None,
                        help="simulated time runs K times faster (default: 10, halved while a proxy or this "
                             "machine is saturated)")
    parser.add_argument("--requests", type=int, default=None, help="requests in the seed scenario (default 1000)")
    parser.add_argument("--gateways", type=int, default=2, help="proxy replicas sharing one Redis")
    parser.add_argument("--config", default=str(_EXAMPLE) if _EXAMPLE.exists() else None,
                        help="proxy config whose litellm_settings and lora_affinity sections are used")
    parser.add_argument("--out", default="bench-out", help="where the chart and JSON go")
    parser.add_argument("--seed", type=int, default=1)
    parser.set_defaults(func=run_demo)


AUTO_SPEEDS = (10.0, 5.0, 2.5)


def run_demo(args: argparse.Namespace) -> int:
    scenario = with_overrides(get_scenario("seed"), requests=args.requests)
    workdir = scratch_dir("lora-affinity-demo-")
    config = Path(args.config) if args.config else None
    redis_port = free_port()
    store = redis_server(redis_port, workdir, allow_embedded=True)
    kind = "fakeredis's embedded TCP server (no redis-server on PATH)" if store.embedded else "redis-server"
    print(f"Redis: {kind} on 127.0.0.1:{redis_port}")
    speeds = (args.speed,) if args.speed else AUTO_SPEEDS
    print(f"Fleet: {scenario.replicas} simulated vLLM replicas (max_loras {scenario.max_loras}, "
          f"{len(scenario.adapters)} adapters), {speeds[0]:g}x faster than real time")
    print(f"Gateways: {args.gateways} LiteLLM proxies per strategy"
          f"{' with ' + str(config) if config else ''}; logs in {workdir}")
    print(f"Load: the seed's benchmark, {scenario.requests} requests at t=0 over {scenario.connections} connections, "
          f"{scenario.deadline_s:.0f} s simulated deadline\n")
    try:
        for i, speed in enumerate(speeds):
            results = _run_both(scenario, args, speed, redis_port, workdir, config)
            refused = [reason for r in results if (reason := refusal(r))]
            machine_bound = [warning for r in results if (warning := machine_warning(r))]
            if not (refused or machine_bound) or i == len(speeds) - 1:
                break
            print("\n".join(refused + machine_bound)
                  + f"\nagain at {speeds[i + 1]:g}x, so that the routing, not the proxy or this machine, decides\n")
    except KeyboardInterrupt:
        print("interrupted: every process started by the demo has been stopped")
        return 130
    finally:
        store.stop()
    print(format_table(results))
    shuffle, plugin = results
    if refused:
        print("\n".join(refused) + "\nso the figures below measured the proxies, not the routing: try --gateways 3")
    if machine_bound:
        print("\n".join(machine_bound)
              + "\nso the figures below measured this machine as much as the routing: try --speed 2")
    print(f"\nAt {speed:g}x: lora-affinity completed {plugin.completed} vs {shuffle.completed} requests and "
          f"{plugin.output_tokens_per_s / max(shuffle.output_tokens_per_s, 1e-9):.2f}x the output tokens/s of "
          "simple-shuffle on the same simulated GPUs.")
    print(f"Proxy load ({args.gateways} per strategy, saturated above 85% of a core): "
          + "; ".join(f"{r.strategy} {_load(r)}" for r in results))
    write_json(results, f"{args.out}/demo.json")
    chart = write_chart(results, f"{args.out}/demo.png", "lora-affinity demo: seed scenario, live")
    print(f"results: {args.out}/demo.json" + (f"; chart: {chart}" if chart else ""))
    return 0


def _run_both(scenario, args: argparse.Namespace, speed: float, redis_port: int, workdir: Path,
              config: Path | None) -> list[Result]:
    from tqdm import tqdm

    with tqdm(total=scenario.requests * 2, unit="req", leave=False) as bar:
        return [run_strategy(scenario, strategy, speed, args.gateways, args.seed, redis_port, workdir, bar,
                             config_path=config) for strategy in ("simple-shuffle", "lora-affinity")]


def _load(r: Result) -> str:
    t = r.transport
    return (f"{t['proxy_requests_per_s']:.1f} req/s, busiest worker {t['proxy_busiest_worker']:.0%} of a core, "
            f"{t['proxy_cpu_ms_per_request']:.0f} ms CPU per request")
