"""Live mode: each strategy against a fresh simulated fleet and real LiteLLM proxy processes.

Per strategy: `lora-affinity sim` (fresh replicas), then G `litellm --config` proxies (our plugin, or
a LiteLLM built-in routing_strategy), the scraper when the plugin is used, one Redis shared by all,
then the load generator. Every interval of the plugin is divided by --speed so that metrics age in
simulated time as they would in real time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path
from typing import Callable

import httpx
import redis
import yaml
from tqdm import tqdm

from lora_affinity_plugin.kv.exact_share import decode_changes, snapshot_key
from lora_affinity_plugin.config.settings import Settings

from ..processes import (
    MASTER_KEY,
    Proc,
    child_env,
    free_port,
    free_port_range,
    redis_server,
    scratch_dir,
    start_litellm_proxy,
    wait_port,
    wait_proxy,
)
from .policies import RULE_SETS, bench_overrides
from .loadgen import run_load
from .open_loop import Background, run_open_loop
from .prefix_workloads import PrefixWorkload
from .tokenizer_files import write_tokenizer_files
from .results import Result, summarize_classes
from .scenarios import Scenario
from .transport import TransportProbe

LITELLM_BUILTINS = {"simple-shuffle", "least-busy", "latency-based-routing", "usage-based-routing-v2"}
PLUGIN_RULES = {**{name: rules for name, rules in RULE_SETS.items() if name != "exact-state-oracle"},
                "lora-affinity-unpooled": {"pooled_clients": False}}
"""The oracle reads the simulated engines' caches in-process: fast mode only."""
LIVE_STRATEGIES = LITELLM_BUILTINS | set(PLUGIN_RULES) | {"per-connection-random"}
EXACT_STRATEGY = "lora-affinity-exact"
"""Live, its replicas publish KV events and its scraper follows them (`--kv-events-config`)."""
TOKENIZER_VOCAB = 360
"""The trained tokenizer's vocabulary in a run with the exact strategy: its tokens average 3 bytes of the
benchmarks' text, as the simulator's own tokenizer's do, so every workload keeps its size in tokens (and its
pressure on the caches) as in fast mode."""
DEFAULT_SPEED = 10.0


def plugin_settings(speed: float, overrides: dict) -> dict:
    return {
        "scrape_interval_ms": max(20, round(200 / speed)),
        "stale_after_ms": max(10, round(2000 / speed)),
        "metrics_ttl_ms": max(50, round(10_000 / speed)),
        "dispatch_lag_ms": round(50 / speed),
        "scrape_timeout_ms": max(100, round(1000 / speed)),
        "engine_time_scale": speed,  # the replicas' prefill seconds pass `speed` times faster than the proxies' clock
        **overrides,
    }


class Fleet:
    """A simulated fleet plus the gateways for one strategy; stops everything on exit."""

    def __init__(self, scenario: Scenario, strategy: str, speed: float, gateways: int, seed: int, redis_port: int,
                 workdir: Path, config_path: Path | None = None, lora_info_style: str = "legacy",
                 overrides: dict | None = None, proxy_workers: int = 1, kv_events: dict | None = None,
                 tokenizer: str | None = None) -> None:
        self.proxy_workers = proxy_workers
        self.kv_events = kv_events
        """The plugin's `tokenizers` entry for every model: the replicas then publish KV events (tokenized by that
        file) and the plugin follows them; None: no events."""
        self.tokenizer = tokenizer or (kv_events or {}).get("tokenizer")
        """The replicas' tokenizer.json (None: the simulator's 3 bytes a token)."""
        self.events_ports = (0, 0)
        self.scenario, self.strategy, self.speed, self.gateways = scenario, strategy, speed, gateways
        self.seed, self.redis_port, self.workdir = seed, redis_port, workdir
        self.config_path = config_path
        self.lora_info_style = lora_info_style
        self.overrides = overrides or {}
        self.procs: list[Proc] = []
        self.base_port = 0
        self.proxy_ports: list[int] = []
        self.proxies: list[Proc] = []

    def __enter__(self) -> Fleet:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.base_port + i}" for i in range(self.scenario.replicas)]

    @property
    def targets(self) -> list[str]:
        if self.strategy == "per-connection-random":
            return self.replica_urls
        return [f"http://127.0.0.1:{p}" for p in self.proxy_ports]

    def _start(self) -> None:
        s = self.scenario
        self.base_port = free_port_range(s.replicas)
        sim_args = sim_arguments(s, self.base_port, self.speed, self.seed, self.lora_info_style)
        if self.tokenizer is not None:
            sim_args += ["--tokenizer", self.tokenizer]
        if self.kv_events is not None:
            self.events_ports = (free_port_range(s.replicas), free_port_range(s.replicas))
            pub, replay = self.events_ports
            sim_args += ["--kv-events-config", json.dumps(
                {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                 "replay_endpoint": f"tcp://*:{replay}"})]
        self.procs.append(Proc(f"sim-{self.strategy}", [sys.executable, "-m", "lora_affinity_plugin.ops.cli", *sim_args],
                               self.workdir))
        for i in range(s.replicas):
            wait_port(self.base_port + i)
        if self.strategy == "per-connection-random":
            return
        redis.Redis(port=self.redis_port).flushall()
        config = self._config()
        config_path = self.workdir / f"config-{self.strategy}.yaml"
        config_path.write_text(yaml.safe_dump(config))
        env = child_env(LITELLM_MASTER_KEY=MASTER_KEY, LORA_AFFINITY_REDIS_URL=f"redis://127.0.0.1:{self.redis_port}/0")
        if self.strategy in PLUGIN_RULES:
            self.procs.append(Proc(f"scraper-{self.strategy}", [sys.executable, "-m", "lora_affinity_plugin.ops.cli",
                                                                "scrape", "--config", str(config_path)],
                                   self.workdir, env=env))
        self.proxy_ports = [free_port() for _ in range(self.gateways)]
        proxies = [start_litellm_proxy(config_path, port, self.workdir, f"proxy-{self.strategy}-{g}", env=env,
                                       workers=self.proxy_workers)
                   for g, port in enumerate(self.proxy_ports)]
        self.procs += proxies
        self.proxies = proxies
        for proc, port in zip(proxies, self.proxy_ports):
            wait_proxy(proc, port)
        time.sleep(max(0.5, 1.0 / self.speed * 5))  # a few scrapes reach every proxy's view

    def _config(self) -> dict:
        model_list = [
            {"model_name": "*", "litellm_params": {"model": "hosted_vllm/*", "api_base": f"{url}/v1", "api_key": "none"}}
            for url in self.replica_urls
        ]
        if self.config_path is not None:  # the demo: the user's config, pointed at this fleet
            config = yaml.safe_load(self.config_path.read_text())
            config["model_list"] = model_list
        else:
            config = {"model_list": model_list, "general_settings": {"master_key": "os.environ/LITELLM_MASTER_KEY"}}
        config.setdefault("litellm_settings", {})["request_timeout"] = 3600
        config.setdefault("router_settings", {})["num_retries"] = 0
        if self.strategy in PLUGIN_RULES:
            config["litellm_settings"]["callbacks"] = ["lora_affinity_plugin.strategy.proxy_plugin"]
            section = config.setdefault("lora_affinity", {})
            section.pop("redis_url", None)  # LORA_AFFINITY_REDIS_URL points at this run's Redis
            section.update(plugin_settings(self.speed, {**PLUGIN_RULES[self.strategy], **self.overrides}))
            if self.kv_events is not None:
                section.update({"kv_events": True, "tokenizers": {"*": dict(self.kv_events)}})
                pub, replay = self.events_ports
                for i, deployment in enumerate(model_list):
                    deployment["model_info"] = {"kv_events_endpoint": f"tcp://127.0.0.1:{pub + i}",
                                                "kv_events_replay_endpoint": f"tcp://127.0.0.1:{replay + i}"}
        else:
            config["litellm_settings"].pop("callbacks", None)
            config.pop("lora_affinity", None)
            config["router_settings"]["routing_strategy"] = self.strategy
            if self.gateways > 1:  # LiteLLM's own way to share routing state between replicas
                config["router_settings"].update({"redis_host": "127.0.0.1", "redis_port": self.redis_port})
        return config

    def transport_probe(self) -> TransportProbe:
        return TransportProbe(self.replica_urls, [p.popen.pid for p in self.proxies], [p.log_path for p in self.proxies])

    def prefix_hit_rate(self) -> float | None:
        """Hit / queried prompt tokens over the run, from the replicas' own counters."""
        hits = queries = 0.0
        for url in self.replica_urls:
            page = httpx.get(url + "/metrics", timeout=5).text
            hits += sum(float(v) for v in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)", page, re.M))
            queries += sum(float(v) for v in re.findall(r"^vllm:prefix_cache_queries_total\{[^}]*\} (\S+)", page, re.M))
        return round(hits / queries, 4) if queries else None

    def served_per_replica(self) -> list[int]:
        counts = []
        for url in self.replica_urls:
            page = httpx.get(url + "/metrics", timeout=5).text
            counts.append(int(sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)", page, re.M))))
        return counts

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()


def sim_arguments(s: Scenario, base_port: int, speed: float, seed: int, lora_info_style: str) -> list[str]:
    """`lora-affinity sim` for a scenario's fleet: its replicas, LoRA slots and replica profiles (speeds, sizes),
    dealt to the replicas in turn, as fast mode deals them (`fast.make_engines`)."""
    args = ["sim", "--replicas", str(s.replicas), "--base-port", str(base_port), "--speed", str(speed),
            "--seed", str(seed), "--max-loras", str(s.max_loras), "--max-cpu-loras", str(s.max_cpu_loras)]
    if s.warm:
        args += ["--warm-adapters", ",".join(s.adapters)]
    if s.profiles:
        args += ["--replica-profiles", s.profiles]
    return args + ["--lora-info-style", lora_info_style, "--mean-output-tokens", str(s.mean_output_tokens)]


def shared_exact_index(redis_port: int) -> tuple[int, int]:
    """(pods, blocks) in the exact index the scraper shares through Redis (`exact_share.py`)."""
    snapshot = redis.Redis(port=redis_port).hgetall(snapshot_key(Settings().key_prefix))
    if b"c" not in snapshot:
        return 0, 0
    changes = decode_changes(snapshot[b"c"])
    return len(changes), sum(len(change.added) for change in changes.values())


def run_strategy(scenario: Scenario, strategy: str, speed: float, gateways: int, seed: int, redis_port: int,
                 workdir: Path, bar: tqdm | None = None, config_path: Path | None = None,
                 after_load: Callable[[Fleet, Result], None] | None = None, lora_info_style: str = "legacy",
                 overrides: dict | None = None, proxy_workers: int = 1, tokenizer: dict | None = None) -> Result:
    """`tokenizer`: the files every strategy's replicas tokenize with (the same prompts for all); the exact
    strategy's replicas also publish KV events, and its plugin matches prompts with them."""
    if strategy not in LIVE_STRATEGIES:
        raise SystemExit(f"strategy {strategy!r} runs in fast mode only; live: {', '.join(sorted(LIVE_STRATEGIES))}")
    if strategy == EXACT_STRATEGY and tokenizer is None:
        raise SystemExit(f"{EXACT_STRATEGY} needs a tokenizer for its replicas and its plugin")
    kv_events = tokenizer if strategy == EXACT_STRATEGY else None
    with Fleet(scenario, strategy, speed, gateways, seed, redis_port, workdir, config_path, lora_info_style,
               overrides, proxy_workers, kv_events=kv_events, tokenizer=tokenizer and tokenizer["tokenizer"]) as fleet:
        if bar is not None:
            bar.set_description(strategy)
        probe = fleet.transport_probe()
        background = Background(fleet.replica_urls) if scenario.background_rate else None
        if scenario.open_loop:
            outcomes, duration = asyncio.run(run_open_loop(
                PrefixWorkload(scenario, seed), fleet.targets, speed, scenario.deadline_s, api_key=MASTER_KEY,
                on_done=bar.update if bar else None, background=background))
        else:
            outcomes, duration = asyncio.run(run_load(
                scenario, fleet.targets, speed, seed, api_key=MASTER_KEY,
                per_connection=strategy == "per-connection-random", on_done=bar.update if bar else None))
        result = summarize_classes(strategy, scenario.name, "live", outcomes, duration, scenario.replicas)
        result.transport = probe.stop(len(outcomes)).to_dict()
        result.per_replica = fleet.served_per_replica()
        result.hit_rate = fleet.prefix_hit_rate()
        result.rate = scenario.arrival_rate if scenario.open_loop else None
        if kv_events is not None:
            pods, blocks = shared_exact_index(redis_port)
            print(f"{strategy}: the shared index holds {blocks} blocks of {pods} pods")
            if not blocks:  # the plugin matched nothing exactly: this was the inferred index under another name
                result.invalid = "the exact index stayed empty"
        if background is not None:
            print(f"{strategy}: the other client sent {background.sent} requests straight to the replicas, "
                  f"{background.failed} failed")
            if background.failed:  # the fleet did not carry the other client's load: another workload
                result.invalid = f"{background.failed} of the other client's {background.sent} requests failed"
        if after_load is not None:
            after_load(fleet, result)
    return result


def run_live(scenario: Scenario, strategies: list[str], args: argparse.Namespace, gateways: int) -> list[Result]:
    speed = args.speed or DEFAULT_SPEED
    workdir = scratch_dir("lora-affinity-bench-")
    redis_port = free_port()
    store = redis_server(redis_port, workdir, allow_embedded=True)
    if store.embedded:
        print("redis-server not found: using fakeredis's embedded TCP server")
    print(f"live mode at {speed:g}x speed; logs in {workdir}")
    results = []
    tokenizer = write_tokenizer_files(workdir / "tokenizer", TOKENIZER_VOCAB) if EXACT_STRATEGY in strategies else None
    if tokenizer is not None:
        print(f"every strategy's replicas tokenize with {tokenizer['tokenizer']} (trained here); "
              f"{EXACT_STRATEGY}'s publish KV events")
    try:
        styles = [x.strip() for x in getattr(args, "lora_info_style", "legacy").split(",")]
        with tqdm(total=scenario.requests * len(strategies) * len(styles), unit="req", leave=False) as bar:
            for style in styles:
                for strategy in strategies:
                    result = run_strategy(scenario, strategy, speed, gateways, args.seed, redis_port, workdir, bar,
                                          lora_info_style=style, overrides=bench_overrides(args),
                                          proxy_workers=args.proxy_workers, tokenizer=tokenizer)
                    if len(styles) > 1:
                        result.strategy += f" [{style}]"
                    results.append(result)
    finally:
        store.stop()
    return results
