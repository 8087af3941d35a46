"""`lora-affinity`: the command line (scraper worker, simulator, benchmarks, demo)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.metadata
import importlib.util
import logging
import os
import signal
import sys

# LiteLLM reaches for the network at import unless told otherwise; this machine class is offline.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS", "True")
os.environ.setdefault("LITELLM_TELEMETRY_DISABLED", "true")

from .settings import SettingsError, load_config, settings_from_config  # noqa: E402


def _settings_and_config(args: argparse.Namespace):
    config = load_config(args.config) if args.config else {}
    environ = dict(os.environ)
    if getattr(args, "redis_url", None):
        environ["LORA_AFFINITY_REDIS_URL"] = args.redis_url
    if getattr(args, "interval_ms", None):
        environ["LORA_AFFINITY_SCRAPE_INTERVAL_MS"] = str(args.interval_ms)
    return settings_from_config(config, environ), config


def _cmd_scrape(args: argparse.Namespace) -> int:
    from .scraper import Scraper

    settings, config = _settings_and_config(args)
    try:
        scraper = Scraper.for_config(settings, config.get("model_list") or [])
    except ValueError as exc:
        print(f"{args.config}: {exc}", file=sys.stderr)
        return 2
    if not scraper.pods:
        print(f"{args.config}: no deployment in model_list has an api_base to scrape", file=sys.stderr)
        return 2

    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await scraper.run(stop)

    asyncio.run(run())
    return 0


def show_defaults(subparsers: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Every subcommand's help shows each option's default."""
    subparsers.add_parser = functools.partial(subparsers.add_parser,  # type: ignore[method-assign]
                                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return subparsers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lora-affinity", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--log-level", default="INFO", help="logging level of this command")
    sub = show_defaults(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))

    scrape = sub.add_parser("scrape", help="scrape every pod's /metrics into Redis")
    scrape.add_argument("--config", required=True, help="the proxy's config.yaml (pods come from model_list)")
    scrape.add_argument("--redis-url", help="overrides lora_affinity.redis_url")
    scrape.add_argument("--interval-ms", type=int, help="overrides lora_affinity.scrape_interval_ms")
    scrape.add_argument("--metrics-port", type=int, help="serve the scraper's Prometheus metrics on this port")
    scrape.set_defaults(func=_cmd_scrape)

    from .bench import add_bench_arguments
    from .demo import add_demo_arguments
    from .ops import add_ops_arguments
    from .sim.arguments import add_sim_arguments

    add_bench_arguments(sub.add_parser("bench", help="benchmarks: routing quality and decision latency"))
    add_sim_arguments(sub.add_parser("sim", help="simulated vLLM replicas with LoRA, one port each"))
    add_demo_arguments(sub.add_parser("demo", help="everything on this machine: Redis, fleet, proxies, benchmark"))
    add_ops_arguments(sub)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("lora-affinity-plugin")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


BENCH_EXTRA = {"bench": ("tqdm", "uvicorn", "starlette"), "demo": ("tqdm", "uvicorn", "starlette"),
               "sim": ("uvicorn", "starlette")}
"""What the simulator, benchmarks and demo need beyond a proxy's install: the `bench` extra."""


def missing_extra(command: str) -> str | None:
    """A message naming the extra to install when `command` needs modules that are not installed."""
    missing = [m for m in BENCH_EXTRA.get(command, ()) if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"lora-affinity {command} needs {', '.join(missing)}, from the bench extra: "
            f"pip install 'lora-affinity-plugin[bench]'")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = missing_extra(args.command)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape would drown everything
    try:
        code = int(args.func(args) or 0)
        if code:
            from .processes import keep_scratch

            keep_scratch()  # a run that reports a failure keeps its logs for whoever looks into it
        return code
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
