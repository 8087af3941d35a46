"""`lora-affinity bench`: one command per benchmark, ratios measured side by side in one run."""

from __future__ import annotations

import argparse


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", default="seed", help="one of: " + ", ".join(_scenario_names())
                        + ", or a workload variant FAMILY#SEED (documents#161)")
    parser.add_argument("--strategies", help="comma-separated strategy names (fleet scenarios)")
    parser.add_argument("--speed", type=float, default=None, help="simulated time runs K times faster than real time")
    parser.add_argument("--gateways", type=int, default=1, help="proxy replicas behind the client, sharing one Redis")
    parser.add_argument("--proxy-workers", type=int, default=1,
                        help="live: worker processes per proxy (litellm --num_workers; each a gateway with its own view)")
    parser.add_argument("--mode", choices=["live", "fast"], default="live")
    parser.add_argument("--seeds", type=int, default=1, help="fast mode: seeds per strategy (medians reported)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--minutes", type=float, default=2.0, help="soak: how long to run")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
                        help="a plugin setting for the plugin's strategies in this run (repeatable), e.g. "
                             "--set queue_threshold_critical=0")
    parser.add_argument("--trace", action="store_true",
                        help="soak: a third proxy with tracemalloc attributes memory growth (the plugin's vs the rest)")
    parser.add_argument("--rate", type=float, default=None,
                        help="Poisson arrivals per second (soak: default 20; shared-prefix/multi-turn: one rate)")
    parser.add_argument("--rates", help="shared-prefix/multi-turn: comma-separated rates to sweep (default: the scenario's)")
    parser.add_argument("--minutes-of-load", type=float, default=None,
                        help="shared-prefix/multi-turn: minutes of arrivals per rate (simulated; default 1.5)")
    parser.add_argument("--lora-info-style", default="legacy",
                        help="live mode: the simulated vLLM's LoRA metrics, legacy and/or current (comma-separated)")
    parser.add_argument("--repeat", type=int, default=1, help="pooling: runs per strategy (integrity counts)")
    parser.add_argument("--requests", type=int, help="override the scenario's request count (quick runs)")
    parser.add_argument("--tenants", type=int, default=None,
                        help="fast mode: requests come from N callers (API keys, two to a team) in turn, for prefix_isolation")
    parser.add_argument("--json", dest="json_path", help="write the results as a JSON list to this path")
    parser.add_argument("--chart", default="bench-out/bench.png", help="where to write the PNG chart")
    parser.add_argument("--deployments", default="8,64,512", help="decisions scenario: deployment counts")
    parser.add_argument("--iterations", type=int, default=3000, help="decisions scenario: decisions per size")
    parser.add_argument("--prompt-chars", type=int, default=0,
                        help="decisions and host-cost: characters per chat prompt (0: the seed's short prompt); LoRA "
                             "scenarios: characters of a unique text or instruction (default 1500)")
    parser.add_argument("--kv-events", action="store_true",
                        help="host-cost: the replicas publish KV events and the plugin matches prompts against them "
                             "(a tokenizer trained for the run)")
    parser.add_argument("--prompt-shape", choices=["seed", "unique", "instruction", "mix"], default=None,
                        help="LoRA scenarios: the seed's question, a unique text per request, a "
                             "per-adapter instruction plus the question, or the three in turn")
    parser.add_argument("--pods", type=int, default=256, help="scrape-scale and kv-events: simulated replicas")
    parser.add_argument("--pods-blocks", help="index-memory: PODSxGPU_BLOCKS,... (default 6x700,64x100000)")
    parser.add_argument("--seconds", type=float, default=10.0, help="scrape-scale: how long each variant runs; kv-events: how long the publishers send")
    parser.add_argument("--variants", type=int, default=None,
                        help="variants: how many workload variants to draw per family")
    parser.add_argument("--variant-seed", type=int, default=1, help="variants: the first variant seed drawn")
    parser.add_argument("--families", help="variants: comma-separated families (default: all)")
    parser.set_defaults(func=run_bench)


def _scenario_names() -> list[str]:
    from .scenarios import SCENARIOS

    return ["decisions", "variants", "propagation", "parse", "scrape-scale", "soak", "pooling", "host-cost", "index-memory", "kv-events", "slowdown", *SCENARIOS]


def run_bench(args: argparse.Namespace) -> int:
    if args.scenario == "decisions":
        from .decisions import run_decisions

        return run_decisions(args)
    if args.scenario == "variants":
        from .variants import run_variants

        return run_variants(args)
    if args.scenario == "overload":
        from .overload import run_overload

        return run_overload(args)
    if args.scenario == "slowdown":
        from .slowdown import run_slowdown

        return run_slowdown(args)
    if args.scenario == "index-memory":
        from .index_memory import run_index_memory

        return run_index_memory(args)
    if args.scenario == "kv-events":
        from .kv_events_scale import run_kv_events

        return run_kv_events(args)
    if args.scenario == "soak":
        from .soak import run_soak

        return run_soak(args)
    if args.scenario == "pooling":
        from .pooling import run_pooling

        return run_pooling(args)
    if args.scenario == "host-cost":
        from .host_cost import run_host_cost

        return run_host_cost(args)
    if args.scenario == "parse":
        from .parse import run_parse

        return run_parse(args)
    if args.scenario == "scrape-scale":
        from .scrape_scale import run_scrape_scale

        return run_scrape_scale(args)
    if args.scenario == "propagation":
        from .propagation import run_propagation

        return run_propagation(args)
    from .scenarios import get_scenario

    if get_scenario(args.scenario).open_loop:
        from .latency import run_latency

        return run_latency(args)
    from .compare import run_compare

    return run_compare(args)
