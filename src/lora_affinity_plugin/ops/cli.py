"""`lora-affinity`: the command line: the scraper worker and the operator commands; with lora-affinity-lab
installed, also the simulator, the benchmarks and the demo (`sim`, `bench`, `demo`), which a proxy never imports."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import os
import signal
import sys

import yaml

# LiteLLM reaches for the network at import unless told otherwise; this machine class is offline.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS", "True")
os.environ.setdefault("LITELLM_TELEMETRY_DISABLED", "true")

from ..config.settings import SettingsError, load_config, settings_from_config
from .commands import add_ops_arguments, show_defaults


def _settings_and_config(args: argparse.Namespace):
    config = load_config(args.config) if args.config else {}
    environ = dict(os.environ)
    if getattr(args, "redis_url", None):
        environ["LORA_AFFINITY_REDIS_URL"] = args.redis_url
    if getattr(args, "interval_ms", None):
        environ["LORA_AFFINITY_SCRAPE_INTERVAL_MS"] = str(args.interval_ms)
    return settings_from_config(config, environ), config


def _cmd_scrape(args: argparse.Namespace) -> int:
    from ..scraping.worker import Scraper

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
        from ..scraping.scraper_http import serve

        serve(scraper, args.metrics_port)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await scraper.run(stop)

    asyncio.run(run())
    return 0


LAB_COMMANDS = {"bench": "benchmarks: routing quality and decision latency",
                "sim": "simulated vLLM replicas with LoRA, one port each",
                "demo": "everything on this machine: Redis, fleet, proxies, benchmark"}
"""Commands of the lora-affinity-lab package (the repository's `lab/`)."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; the lab's commands are built (and the lab imported) only when `command` is one of them."""
    parser = argparse.ArgumentParser(prog="lora-affinity", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--log-level", default="INFO", help="logging level of this command")
    sub = show_defaults(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))

    scrape = sub.add_parser("scrape", help="scrape every pod's /metrics into Redis")
    scrape.add_argument("--config", required=True, help="the proxy's config.yaml (pods come from model_list)")
    scrape.add_argument("--redis-url", help="overrides lora_affinity.redis_url")
    scrape.add_argument("--interval-ms", type=int, help="overrides lora_affinity.scrape_interval_ms")
    scrape.add_argument("--metrics-port", type=int, help="serve the scraper's /metrics, /healthz and /readyz on this port")
    scrape.set_defaults(func=_cmd_scrape)

    add_ops_arguments(sub)
    lab = _lab() if command in LAB_COMMANDS else None
    if lab is not None:
        lab.add_commands(sub)
    else:  # named, so `--help` lists them; they say how to install the lab
        for name, text in LAB_COMMANDS.items():
            sub.add_parser(name, help=f"{text} (lora-affinity-lab)", add_help=False)
    return parser


def _lab():
    try:
        import lora_affinity_lab.cli as lab
    except ImportError:
        return None
    return lab


def lab_missing(command: str) -> str:
    return (f"lora-affinity {command} is in lora-affinity-lab, the simulator and benchmarks, which is not installed "
            f"(a proxy does not need it): pip install ./lab, from this repository")


def _version() -> str:
    try:
        return importlib.metadata.version("lora-affinity-plugin")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


def _command(argv: list[str]) -> str | None:
    """The subcommand named in `argv` (the first word that is not an option or an option's value)."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = _command(argv)
    if command in LAB_COMMANDS and _lab() is None:
        print(f"error: {lab_missing(command)}", file=sys.stderr)
        return 2
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape would drown everything
    try:
        code = int(args.func(args) or 0)
        if code and args.command in LAB_COMMANDS and (lab := _lab()) is not None:
            lab.keep_logs()  # a run that reports a failure keeps its logs for whoever looks into it
        return code
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, PermissionError, IsADirectoryError) as exc:  # a file named on the command line
        print(f"error: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except yaml.YAMLError as exc:
        print(f"error: not valid YAML: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
