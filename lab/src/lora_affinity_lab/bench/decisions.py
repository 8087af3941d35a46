"""Per-decision latency: lora-affinity vs LiteLLM's simple-shuffle, same process, same deployments.

With --prompt-chars N every request carries an N-character chat prompt (one of 16 system prompts
plus its own question), so the plugin's own part includes rendering, hashing and matching it
against a populated prefix index.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import litellm

from lora_affinity_plugin.host.compat import model_list, register_strategy
from lora_affinity_plugin.fleet.view import FleetView
from lora_affinity_plugin.routing.podstate import PodMetrics
from lora_affinity_plugin.config.settings import build_settings
from lora_affinity_plugin.fleet.store import PodRecord
from lora_affinity_plugin.strategy import LoraAffinityStrategy

ADAPTERS = [f"adapter-{i}" for i in range(24)]


def _model_list(n: int) -> list[dict]:
    return [
        {
            "model_name": "*",
            "litellm_params": {"model": "hosted_vllm/*", "api_base": f"http://10.0.{i // 250}.{i % 250}:8000/v1",
                               "api_key": "none"},
        }
        for i in range(n)
    ]


def _records(pods: list[str], rng: random.Random, now: float) -> dict[str, PodRecord]:
    out = {}
    for pod in pods:
        running = frozenset(rng.sample(ADAPTERS, 3))
        metrics = PodMetrics(num_requests_waiting=rng.randrange(20), num_requests_running=rng.randrange(30),
                             kv_cache_usage=rng.random(), running_lora_adapters=running,
                             waiting_lora_adapters=frozenset(rng.sample(ADAPTERS, 1)), max_lora=4,
                             num_gpu_blocks=7000, block_size=16)  # a 7B model on an 80 GB GPU: 112k tokens
        out[pod] = PodRecord(pod=pod, scraped_at=now, metrics=metrics)
    return out


def _percentiles(samples_ns: list[int]) -> tuple[float, float]:
    ordered = sorted(samples_ns)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return statistics.median(ordered) / 1000, p99 / 1000


class Prompts:
    """Chat prompts of about `chars` characters: 16 shared system prompts, each request its own question."""

    def __init__(self, chars: int, rng: random.Random) -> None:
        self.rng = rng
        self.chars = chars
        question = min(512, chars // 4)
        self.systems = ["".join(rng.choice("abcdefghij klmnop") for _ in range(max(0, chars - question)))
                        for _ in range(16)]
        self.question = question
        self.count = 0

    def next(self) -> list[dict]:
        if not self.chars:
            return [{"role": "user", "content": "hi"}]
        self.count += 1
        question = (f"question {self.count} " * (self.question // 10 + 1))[: self.question]
        system = self.rng.choice(self.systems)
        system = system[:1] + system[1:]  # a new string, as a proxy parsing each request's JSON has (no cached hash)
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def pick(router: litellm.Router, model: str, messages: list[dict]) -> object:
    """What the proxy asks the router for a request: `Router.select` on 1.110 (where the older call is a
    deprecated alias that warns on every call, which would be timed too), the older call before."""
    if hasattr(type(router), "register_plugin") and hasattr(router, "select"):
        return await router.select(model, {"metadata": {}}, messages=messages)
    return await router.async_get_available_deployment(model=model, messages=messages, request_kwargs={"metadata": {}})


async def _time_router(router: litellm.Router, iterations: int, rng: random.Random, prompts: Prompts,
                       refresh=None) -> list[int]:
    samples = []
    for i in range(iterations):
        if refresh is not None and i % 200 == 0:
            refresh()
        model = ADAPTERS[rng.randrange(len(ADAPTERS))]
        messages = prompts.next()
        start = time.perf_counter_ns()
        await pick(router, model, messages)
        samples.append(time.perf_counter_ns() - start)
    return samples


async def _measure(n: int, iterations: int, seed: int, prompt_chars: int = 0) -> dict:
    rng = random.Random(seed)
    prompts = Prompts(prompt_chars, random.Random(seed))
    settings = build_settings({})
    shuffle_router = litellm.Router(model_list=_model_list(n), routing_strategy="simple-shuffle")
    plugin_router = litellm.Router(model_list=_model_list(n), routing_strategy="simple-shuffle")
    fleet = FleetView(settings)
    strategy = LoraAffinityStrategy(plugin_router, settings, rng=random.Random(seed), fleet=fleet)
    register_strategy(plugin_router, strategy)  # no refresher: the fleet is fed below, no Redis at all
    from lora_affinity_plugin.fleet.pods import discover_pods

    pods = discover_pods(model_list(plugin_router))
    fleet.update(_records(pods, rng, time.time()))

    def refresh() -> None:  # what the background refresher does every interval
        fleet.update(_records(pods, rng, time.time()))

    # Interleave rounds so both see the same machine state; warm both first.
    await _time_router(shuffle_router, 200, rng, prompts)
    await _time_router(plugin_router, 200, rng, prompts, refresh)
    shuffle, plugin = [], []
    for _ in range(5):
        shuffle += await _time_router(shuffle_router, iterations // 5, rng, prompts)
        plugin += await _time_router(plugin_router, iterations // 5, rng, prompts, refresh)

    # The plugin's own part, without the host's healthy-deployment lookup.
    healthy = model_list(plugin_router)
    own = []
    for i in range(iterations):
        if i % 200 == 0:
            refresh()
        model = ADAPTERS[rng.randrange(len(ADAPTERS))]
        messages = prompts.next()
        start = time.perf_counter_ns()
        strategy.pick(model, healthy, {"metadata": {}}, messages)
        own.append(time.perf_counter_ns() - start)
    return {
        "deployments": n,
        "simple_shuffle": _percentiles(shuffle),
        "lora_affinity": _percentiles(plugin),
        "lora_affinity_own": _percentiles(own),
        "fallbacks": strategy.fallbacks,
        "index_blocks": len(fleet.prefixes),
    }


def run_decisions(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.deployments.split(",")]
    chars = args.prompt_chars
    print("Per-decision latency, microseconds (median / p99); same process, interleaved rounds; "
          + (f"{chars}-character chat prompts (16 system prompts)" if chars else "2-character prompts"))
    print(f"{'deployments':>11}  {'simple-shuffle':>16}  {'lora-affinity':>16}  {'ratio p50':>9}  "
          f"{'plugin own part':>16}  fallbacks  index blocks")
    for n in sizes:
        r = asyncio.run(_measure(n, args.iterations, args.seed, chars))
        s50, s99 = r["simple_shuffle"]
        p50, p99 = r["lora_affinity"]
        o50, o99 = r["lora_affinity_own"]
        print(f"{n:>11}  {s50:7.1f} / {s99:6.1f}  {p50:7.1f} / {p99:6.1f}  {p50 / s50:9.2f}  "
              f"{o50:7.1f} / {o99:6.1f}  {r['fallbacks']:>9}  {r['index_blocks']:>12}")
    print("Redis calls on the request path: 0 (the fleet view is fed in the background; no Redis client exists here)")
    return 0
