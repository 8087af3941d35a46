"""What the plugin reads from pods, peers and callers is bounded, and one bad refresh stops nothing."""

from __future__ import annotations

import asyncio
import logging
import time

import fakeredis
import litellm

from lora_affinity_plugin.host import compat
from lora_affinity_plugin.fleet import follower as follower_module
from lora_affinity_plugin.fleet.view import FleetView
from lora_affinity_plugin.fleet.follower import Follower, check_redis_version
from lora_affinity_plugin.routing.podstate import PodMetrics
from lora_affinity_plugin.config.settings import build_settings
from lora_affinity_plugin.fleet.store import PodRecord, pod_key
from lora_affinity_plugin.host.host_strategy import _NAMES_CACHED, LoraAffinityStrategy

S = build_settings({"scrape_interval_ms": 100}, environ={})


def follower() -> Follower:
    return Follower(S, FleetView(S), lambda: ["a", "b"], lambda s: None)


async def test_every_peers_prefix_entries_are_read_with_many_writing_processes():
    client = fakeredis.aioredis.FakeRedis()
    now = time.time()
    for pod in ("a", "b"):
        await client.set(pod_key(S, pod), PodRecord(pod, now, PodMetrics()).to_json())
    reader, writers = follower(), [follower() for _ in range(48)]  # more than one refresh used to read (32)
    await reader.refresh(client)
    for i, writer in enumerate(writers):
        await writer.refresh(client)  # joins the members
        writer.fleet.note_prefix("a", [1000 + i], now)
        await writer.refresh(client)  # writes its entry
    await reader.refresh(client)
    assert reader.fleet.prefixes.sizes().get("a") == 48


async def test_a_refresh_that_raises_is_logged_once_and_the_next_one_runs(monkeypatch, caplog):
    server = fakeredis.FakeServer()
    monkeypatch.setattr(follower_module, "connect", lambda settings: fakeredis.aioredis.FakeRedis(server=server))
    f = follower()
    calls = []

    def update(records, now=None):
        calls.append(len(calls))
        if len(calls) <= 3:
            raise OverflowError("a pod said 1e200")

    f.fleet.update = update
    task = asyncio.create_task(f.run())
    deadline = time.monotonic() + 5
    while len(calls) < 5 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    task.cancel()
    assert len(calls) >= 5  # it went on refreshing
    assert caplog.text.count("the last view stays: OverflowError") == 1 and "recovered" in caplog.text


async def test_the_redis_version_is_checked_and_an_old_one_named(caplog):
    caplog.set_level(logging.INFO, "lora_affinity")

    class Redis:
        def __init__(self, version):
            self.version = version

        async def info(self, section):
            return {"redis_version": self.version}

    assert await check_redis_version(Redis("4.0.14"), S) == (4, 0)
    assert "is 4.0.14; lora-affinity needs 5.0 or newer" in caplog.text
    assert await check_redis_version(Redis("7.0.15"), S) == (7, 0)
    assert "is version 7.0.15" in caplog.text


def test_per_name_caches_are_bounded():
    router = litellm.Router(model_list=[{"model_name": "*", "litellm_params": {
        "model": "hosted_vllm/*", "api_base": "http://pod-a:8000/v1"}}])
    strategy = LoraAffinityStrategy(router, S)
    for i in range(_NAMES_CACHED + 100):
        strategy._index.pods_for_model(compat.model_list(router), f"name-{i}")
        strategy._fallback(f"name-{i}")
    assert len(strategy._index._pods_by_model) == _NAMES_CACHED and len(strategy._fallbacks) == _NAMES_CACHED


def test_each_model_groups_fallback_is_its_own_episode(caplog):
    router = litellm.Router(model_list=[{"model_name": "*", "litellm_params": {
        "model": "hosted_vllm/*", "api_base": "http://pod-a:8000/v1"}}])
    strategy = LoraAffinityStrategy(router, S)
    for _ in range(5):  # traffic alternating between a broken group and a healthy one
        strategy._fallback("broken").fail("no fresh metrics")
        episode = strategy._fallbacks.get("healthy")
        if episode is not None:
            episode.recover()
    assert caplog.text.count("unavailable for 'broken'") == 1 and "recovered" not in caplog.text



async def test_every_release_registers_the_strategy_and_hands_unrouted_groups_back():
    """1.94-1.108 assign the strategy on the router; 1.110 registers it on its Rust core (`register_plugin`),
    where the class's pick would call the strategy again: a group without pods goes to LiteLLM's simple_shuffle."""
    from lora_affinity_plugin.strategy import install, installed_strategy

    router = litellm.Router(model_list=[
        {"model_name": "*", "litellm_params": {"model": "hosted_vllm/*", "api_base": "http://pod-a:8000/v1"}},
        {"model_name": "gpt-4o", "litellm_params": {"model": "openai/gpt-4o", "api_key": "x"}},
        {"model_name": "gpt-4o", "litellm_params": {"model": "openai/gpt-4o-mini", "api_key": "x"}}])
    strategy = install(router, S)
    try:
        assert installed_strategy(router) is strategy
        picked = {(await compat.router_pick(router, "gpt-4o", {}))
                  ["litellm_params"]["model"] for _ in range(40)}
        assert picked == {"openai/gpt-4o", "openai/gpt-4o-mini"}  # LiteLLM's own pick, both deployments
    finally:
        strategy.stop()
