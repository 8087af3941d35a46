"""The `lora-affinity` subcommands this package adds: `sim`, `bench` and `demo`."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction) -> None:
    from .bench import add_bench_arguments
    from .demo import add_demo_arguments
    from .sim.arguments import add_sim_arguments

    add_bench_arguments(sub.add_parser("bench", help="benchmarks: routing quality and decision latency"))
    add_sim_arguments(sub.add_parser("sim", help="simulated vLLM replicas with LoRA, one port each"))
    add_demo_arguments(sub.add_parser("demo", help="everything on this machine: Redis, fleet, proxies, benchmark"))


def keep_logs() -> None:
    """A run that reports a failure keeps its logs for whoever looks into it."""
    from .processes import keep_scratch

    keep_scratch()
