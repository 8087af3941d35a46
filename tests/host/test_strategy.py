"""The LiteLLM adapter on a real litellm.Router: mapping, hand-back, fallback, criticality, install."""

import asyncio
import copy
import logging
import random
import time
import warnings

import httpx
import litellm
import pytest

from lora_affinity_plugin.host import compat
from lora_affinity_plugin.host import host_strategy as strategy_mod
from lora_affinity_plugin.fleet.view import FleetView
from lora_affinity_plugin.host.proxy_callback import ProxyPlugin
from lora_affinity_plugin.routing.podstate import PodMetrics
from lora_affinity_plugin.config.settings import build_settings
from lora_affinity_plugin.fleet.store import PodRecord
from lora_affinity_plugin.strategy import (
    LoraAffinityStrategy,
    install,
    installed_strategy,
)

PODS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]


def wildcard_list(prefixes=("hosted_vllm",) * 3):
    return [{"model_name": "*", "litellm_params": {"model": f"{prefix}/*", "api_base": pod + "/v1/", "api_key": "x"}}
            for prefix, pod in zip(prefixes, PODS)]


def record(pod, running=(), waiting=0, kv=0.1, models=("base-model",)):
    return PodRecord(pod=pod, scraped_at=time.time(), metrics=PodMetrics(
        num_requests_waiting=waiting, num_requests_running=2, kv_cache_usage=kv,
        running_lora_adapters=frozenset(running), max_lora=4, model_names=frozenset(models)))


SLOTS_FULL = frozenset({"a1", "a2", "a3", "a4"})
"""Other adapters in every LoRA slot of a pod (max_lora 4): an adapter not running there would wait for a slot, so
its holder is the clear choice under any rule set."""


def make(model_list=None, **settings):
    router = litellm.Router(model_list=model_list or wildcard_list(), num_retries=0)
    s = build_settings(settings)
    fleet = FleetView(s)
    strat = LoraAffinityStrategy(router, s, rng=random.Random(3), fleet=fleet)
    compat.register_strategy(router, strat)
    return router, strat, fleet


async def route(router, model, **kwargs):
    dep = await compat.router_pick(router, model, kwargs, messages=[{"role": "user", "content": "x"}])
    return dep["litellm_params"]["api_base"].removesuffix("/v1/")


async def test_routes_to_the_pod_running_the_adapter_whatever_the_provider_prefix():
    router, strat, fleet = make(wildcard_list(("hosted_vllm", "openai", "hosted_vllm")))
    fleet.update({p: record(p, running={"sql-lora"} if p == PODS[1] else SLOTS_FULL) for p in PODS})
    assert {await route(router, "sql-lora") for _ in range(5)} == {PODS[1]}
    assert strat.decisions == 5 and strat.fallbacks == 0


async def test_exactly_one_healthy_deployments_call_per_decision(monkeypatch):
    router, strat, fleet = make()
    fleet.update({p: record(p) for p in PODS})
    calls = []
    # 1.110+: Router.select(kind="healthy") (its deprecated alias warns per call); older: the method itself.
    name = "select" if hasattr(type(router), "register_plugin") else "async_get_healthy_deployments"
    original = getattr(type(router), name)  # on the class: 1.110's router reads it there

    async def spy(self, *args, **kwargs):
        if name != "select" or kwargs.get("kind") == "healthy":  # (the test's own pick is a select too)
            calls.append(args[0] if args else kwargs["model"])
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(type(router), name, spy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        await route(router, "sql-lora")
    assert calls == ["sql-lora"]
    assert not [w for w in caught if "deprecated" in str(w.message) and "healthy" in str(w.message)]


async def test_the_router_hands_out_copies_of_deployments():
    """Regression: a cache keyed by id() of the dicts mixed up pods when copies were recycled."""
    router, strat, fleet = make()
    for _ in range(30):
        strat.fleet = FleetView(strat.settings)  # a fresh view each time: no dispatches pile up
        strat.fleet.update({p: record(p, running={"a"} if p == PODS[2] else ()) for p in PODS})
        healthy = [copy.deepcopy(d) for d in compat.model_list(router)]
        random.shuffle(healthy)
        chosen = strat.pick("a", healthy, {})
        assert chosen["litellm_params"]["api_base"].startswith(PODS[2])


async def test_group_without_metrics_is_handed_back_to_litellm():
    router, strat, fleet = make()
    assert await route(router, "sql-lora") in PODS
    assert strat.decisions == 0 and strat.fallbacks == 0


async def test_named_groups_and_explicit_adapter_field():
    model_list = [
        {"model_name": "sql", "litellm_params": {"model": "hosted_vllm/sql-lora", "api_base": PODS[0]}},
        {"model_name": "sql", "litellm_params": {"model": "openai/sql-lora", "api_base": PODS[1]}},
        {"model_name": "tweets", "litellm_params": {"model": "hosted_vllm/x", "api_base": PODS[0]},
         "model_info": {"lora_adapter": "tweet-summary"}},
        {"model_name": "tweets", "litellm_params": {"model": "hosted_vllm/x", "api_base": PODS[1]},
         "model_info": {"lora_adapter": "tweet-summary"}},
    ]
    router, strat, fleet = make(model_list)
    fleet.update({PODS[0]: record(PODS[0], running={"tweet-summary", "a2", "a3", "a4"}),
                  PODS[1]: record(PODS[1], running={"sql-lora", "b2", "b3", "b4"})})
    assert {await route(router, "sql") for _ in range(4)} == {PODS[1].removesuffix("/v1/")}
    dep = await compat.router_pick(router, "tweets", {})
    assert dep["litellm_params"]["api_base"] == PODS[0]
    assert strat.decisions == 5 and strat.fallbacks == 0  # the rules chose, not LiteLLM's pick


async def test_base_model_request_skips_lora_rules():
    router, strat, fleet = make()
    fleet.update({p: record(p, running={"x"} if p == PODS[0] else ()) for p in PODS})
    seen = {await route(router, "base-model") for _ in range(30)}
    assert len(seen) >= 2  # balanced, not pinned to the pod running an adapter
    assert strat.decisions == 30 and strat.fallbacks == 0


async def test_no_fresh_metrics_falls_back_to_shuffle_and_logs_once(caplog):
    router, strat, fleet = make(stale_after_ms=100, metrics_ttl_ms=1000)
    fleet.update({p: PodRecord(pod=p, scraped_at=time.time() - 5, metrics=PodMetrics()) for p in PODS})
    with caplog.at_level(logging.WARNING, logger="lora_affinity"):
        seen = {await route(router, "sql-lora") for _ in range(40)}
    assert seen == set(PODS)
    assert strat.fallbacks == 40
    assert sum("LiteLLM's own pick decides" in r.message for r in caplog.records) == 1


async def test_a_plugin_bug_never_fails_a_request(monkeypatch):
    router, strat, fleet = make()
    fleet.update({p: record(p) for p in PODS})

    def boom(*a, **k):
        raise ZeroDivisionError("bug")

    monkeypatch.setattr(strategy_mod, "choose_pod", boom)
    assert await route(router, "sql-lora") in PODS
    assert strat.fallbacks == 1


@pytest.mark.parametrize("kwargs", [
    {"metadata": {"criticality": "sheddable"}},
    {"litellm_metadata": {"criticality": "SHEDDABLE"}},
    {"metadata": {"headers": {"x-criticality": "Sheddable"}}},
])
async def test_sheddable_request_gets_rate_limit_error_when_saturated(kwargs):
    router, strat, fleet = make()
    fleet.update({p: record(p, waiting=50) for p in PODS})
    with pytest.raises(litellm.RateLimitError, match="limited backend resources"):
        await route(router, "sql-lora", **kwargs)
    assert await route(router, "sql-lora") in PODS  # critical is still served


async def test_a_shed_request_is_counted_once_however_often_litellm_retries_it():
    from lora_affinity_plugin.telemetry.metrics import SHEDS

    router, strat, fleet = make()
    fleet.update({p: record(p, waiting=50) for p in PODS})
    counter = SHEDS.labels("sheddable", "*")  # (the wildcard deployments' group)
    before = counter._value.get()
    for _ in range(3):  # LiteLLM's retries of one call carry its litellm_call_id
        with pytest.raises(litellm.RateLimitError):
            await route(router, "sql-lora", metadata={"criticality": "sheddable"}, litellm_call_id="call-1")
    with pytest.raises(litellm.RateLimitError):
        await route(router, "sql-lora", metadata={"criticality": "sheddable"}, litellm_call_id="call-2")
    assert counter._value.get() - before == 2


async def test_enabled_false_leaves_every_request_or_one_groups_to_litellm():
    router, strat, fleet = make(enabled=False)
    fleet.update({p: record(p, running={"sql-lora"} if p == PODS[1] else ()) for p in PODS})
    picks = {await route(router, "sql-lora") for _ in range(30)}
    assert strat.decisions == 0 and len(picks) > 1  # LiteLLM's shuffle, not the adapter's pod
    router, strat, fleet = make(model_group_overrides={"sql-lora": {"enabled": False}})
    fleet.update({p: record(p) for p in PODS})
    await route(router, "sql-lora")
    assert strat.decisions == 0
    await route(router, "tweet-summary")  # another group keeps the rules
    assert strat.decisions == 1


async def test_sheddable_model_group_from_settings():
    router, strat, fleet = make(sheddable_model_groups=["batch-lora"])
    fleet.update({p: record(p, kv=0.95) for p in PODS})
    with pytest.raises(litellm.RateLimitError):
        await route(router, "batch-lora")


async def test_no_healthy_deployment_is_503():
    router, strat, fleet = make()
    with pytest.raises(litellm.ServiceUnavailableError):
        strat.pick("sql-lora", [], {})


def _sync_settings(router, **settings) -> None:
    """What the proxy's settings sync does to the router, by the call the release offers (1.110: `apply`)."""
    if hasattr(router, "apply"):
        from litellm.router_api import ChangeSet

        router.apply(ChangeSet(settings=settings))
    else:
        router.update_settings(**settings)


async def test_proxy_plugin_reinstalls_after_the_router_drops_it(monkeypatch):
    from litellm.proxy import proxy_server

    router = litellm.Router(model_list=wildcard_list())
    monkeypatch.setattr(proxy_server, "llm_router", router)
    monkeypatch.setattr(proxy_server, "user_config_file_path", None)
    plugin = ProxyPlugin()
    try:
        first = plugin.ensure_installed()
        assert installed_strategy(router) is first
        _sync_settings(router, routing_strategy="least-busy")  # what a settings sync does: 1.108 drops it,
        router.__dict__.pop("get_available_deployment", None)  # older releases keep it: drop it as 1.108 does
        router.__dict__.pop("async_get_available_deployment", None)
        assert installed_strategy(router) is None
        second = plugin.ensure_installed()
        assert installed_strategy(router) is second and second is not first
        assert second.fleet is first.fleet
    finally:
        plugin._watcher and plugin._watcher.cancel()
        for s in (first, locals().get("second")):
            if s is not None:
                s.stop()


async def test_install_for_python_router_users():
    router = litellm.Router(model_list=wildcard_list())
    strat = install(router, build_settings({"redis_url": "redis://127.0.0.1:1/0"}))
    try:
        assert installed_strategy(router) is strat
        assert await route(router, "x") in PODS  # no metrics (Redis unreachable): LiteLLM routes
    finally:
        strat.stop()


async def test_embedded_scraper_runs_inside_the_proxy_process(monkeypatch, tmp_path):
    from litellm.proxy import proxy_server

    from lora_affinity_plugin.scraping.worker import Scraper

    config = tmp_path / "config.yaml"
    config.write_text("model_list:\n  - model_name: '*'\n    litellm_params: {model: hosted_vllm/*, "
                      "api_base: 'http://10.0.0.9:8000/v1'}\nlora_affinity:\n  embedded_scraper: true\n"
                      "  redis_url: redis://127.0.0.1:1/0\n")
    router = litellm.Router(model_list=wildcard_list())
    monkeypatch.setattr(proxy_server, "llm_router", router)
    monkeypatch.setattr(proxy_server, "user_config_file_path", str(config))
    started = []
    monkeypatch.setattr(Scraper, "run", lambda self, stop=None: _record(started, self))
    plugin = ProxyPlugin()
    try:
        strat = plugin.ensure_installed()
        await asyncio.sleep(0)
        assert started and started[0].pods == ["http://10.0.0.9:8000"]
    finally:
        plugin._watcher and plugin._watcher.cancel()
        strat.stop()


async def _record(started, scraper):
    started.append(scraper)


async def test_model_group_override_changes_only_that_group():
    router, strat, fleet = make(model_group_overrides={"batch-lora": {"queue_threshold_critical": 100}})
    fleet.update({p: record(p, waiting=50) for p in PODS})
    assert await route(router, "batch-lora", metadata={"criticality": "sheddable"}) in PODS
    assert strat.decisions == 1 and strat.fallbacks == 0
    with pytest.raises(litellm.RateLimitError):
        await route(router, "sql-lora", metadata={"criticality": "sheddable"})


async def test_a_retry_of_the_same_call_goes_to_another_pod():
    router, strat, fleet = make()
    fleet.update({p: record(p, running={"x"} if p == PODS[0] else SLOTS_FULL) for p in PODS})
    first = strat.pick("x", compat.model_list(router), {"litellm_call_id": "call-1"})
    retry = strat.pick("x", compat.model_list(router), {"litellm_call_id": "call-1"})
    other = strat.pick("x", compat.model_list(router), {"litellm_call_id": "call-2"})
    assert first["litellm_params"]["api_base"].startswith(PODS[0])
    assert not retry["litellm_params"]["api_base"].startswith(PODS[0])  # the pod that just failed is avoided
    assert other["litellm_params"]["api_base"].startswith(PODS[0])  # a new request still gets affinity
    assert strat.decisions == 3 and strat.fallbacks == 0


BAD_HOOK_INPUTS = [None, {}, {"litellm_call_id": None}, {"litellm_call_id": "c", "model_info": "not a dict"},
                   {"litellm_call_id": "c", "litellm_params": {"api_base": 42}}, {"litellm_call_id": ["unhashable"]}]


@pytest.mark.parametrize("data", BAD_HOOK_INPUTS, ids=range(len(BAD_HOOK_INPUTS)))
async def test_in_flight_hooks_never_raise_on_odd_input(monkeypatch, data):
    from litellm.proxy import proxy_server

    router = litellm.Router(model_list=wildcard_list())
    monkeypatch.setattr(proxy_server, "llm_router", router)
    monkeypatch.setattr(proxy_server, "user_config_file_path", None)
    plugin = ProxyPlugin()
    strategy = plugin.ensure_installed()
    try:
        kwargs = data if isinstance(data, dict) else {}
        assert await plugin.async_pre_call_deployment_hook(kwargs, None) is None
        assert await plugin.async_post_call_success_deployment_hook(kwargs, None, None) is None
        await plugin.async_log_success_event(data, None, None, None)
        await plugin.async_log_failure_event(data, None, None, None)
        assert await plugin.async_post_call_failure_hook(data, RuntimeError("x"), None) is None

        async def chunks():
            yield "a"
            yield "b"

        assert [c async for c in plugin.async_post_call_streaming_iterator_hook(None, chunks(), data)] == ["a", "b"]
        assert len(strategy.fleet.inflight) == 0
    finally:
        plugin._watcher and plugin._watcher.cancel()
        strategy.stop()


class _EngineStream:
    """The engine's stream at the bottom of LiteLLM's chain (a chat wrapper over the HTTP response): closing it
    closes the connection, which is what makes vLLM abort the generation."""

    def __init__(self) -> None:
        self.closed = 0
        self.sent = 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        self.sent += 1
        return f"chunk {self.sent}"

    async def aclose(self) -> None:
        self.closed += 1


class _TextWrapper:
    """LiteLLM's text-completion wrapper: it keeps the stream it wraps and has no `aclose`."""

    def __init__(self, completion_stream) -> None:
        self.completion_stream = completion_stream

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.completion_stream.__anext__()


class _RouterWrapper:
    """LiteLLM 1.110's router wrapper: `aclose` passes on to what it wraps, where that has one."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.inner.__anext__()

    async def aclose(self) -> None:
        aclose = getattr(self.inner, "aclose", None)
        if callable(aclose):
            await aclose()


async def _reported(items):
    """LiteLLM 1.110's router reads the text wrapper's stream through a generator that does not close it."""
    async for item in items:
        yield item


def _text_completion_chain() -> tuple[_RouterWrapper, _EngineStream]:
    engine = _EngineStream()
    return _RouterWrapper(_TextWrapper(_reported(engine))), engine


async def test_a_stream_the_client_left_is_closed_down_to_the_engine():
    """On a hang-up LiteLLM closes the plugin's layer; on 1.110 the chain of a text completion does not pass the
    close on to the engine's stream (the control below), so the plugin closes every stream below it."""
    plugin = ProxyPlugin()
    chain, engine = _text_completion_chain()
    relayed = plugin.async_post_call_streaming_iterator_hook(None, chain, {"litellm_call_id": "left"})
    assert [await relayed.__anext__(), await relayed.__anext__()] == ["chunk 1", "chunk 2"]
    await relayed.aclose()  # what LiteLLM does with each layer when the client hangs up
    assert engine.closed >= 1

    control, control_engine = _text_completion_chain()
    await control.__anext__()
    await control.aclose()
    assert control_engine.closed == 0  # LiteLLM's own close stops short of the engine's stream

    async def short():
        for i in range(2):
            yield i

    done = plugin.async_post_call_streaming_iterator_hook(None, short(), {"litellm_call_id": "done"})
    assert [c async for c in done] == [0, 1]  # a stream that ended is LiteLLM's to close, as before


async def test_closing_a_left_stream_survives_odd_wrappers():
    """A stream whose close raises, a wrapper that wraps itself: the hook raises nothing of its own, and ends the
    call as always."""
    from lora_affinity_plugin.host.proxy_callback import _streams_below

    class Refuses(_EngineStream):
        async def aclose(self) -> None:
            raise RuntimeError("already gone")

    looped = _RouterWrapper(None)
    looped.inner = looped
    assert _streams_below(looped) == [looped]
    plugin = ProxyPlugin()
    for upstream in (Refuses(), _RouterWrapper(Refuses()), _RouterWrapper(_TextWrapper(_reported(Refuses())))):
        relayed = plugin.async_post_call_streaming_iterator_hook(None, upstream, {"litellm_call_id": "odd"})
        assert await relayed.__anext__() == "chunk 1"
        await relayed.aclose()


async def test_in_flight_hooks_count_a_call_once_and_end_it_once(monkeypatch):
    from litellm.proxy import proxy_server

    router = litellm.Router(model_list=wildcard_list())
    monkeypatch.setattr(proxy_server, "llm_router", router)
    monkeypatch.setattr(proxy_server, "user_config_file_path", None)
    plugin = ProxyPlugin()
    strategy = plugin.ensure_installed()
    try:
        call = {"litellm_call_id": "c1", "litellm_params": {"api_base": PODS[1] + "/v1"}}
        await plugin.async_pre_call_deployment_hook(call, None)
        await plugin.async_pre_call_deployment_hook(call, None)  # a second hook for the same call
        assert strategy.fleet.inflight.counts() == {PODS[1]: 1}
        await plugin.async_post_call_success_deployment_hook({**call, "stream": True}, None, None)
        assert strategy.fleet.inflight.counts() == {PODS[1]: 1}  # a stream has only started
        await plugin.async_log_success_event(call, None, None, None)
        await plugin.async_log_failure_event(call, None, None, None)  # a late second ending: no-op
        assert strategy.fleet.inflight.counts() == {}
    finally:
        plugin._watcher and plugin._watcher.cancel()
        strategy.stop()


def test_deployments_map_to_their_pods_first_one_kept_whatever_they_carry():
    index = strategy_mod._DeploymentIndex()

    def deployment(api_base, model_id=None, name="m"):
        return {"model_name": name, "litellm_params": {"model": "hosted_vllm/m", "api_base": api_base},
                "model_info": {"id": model_id} if model_id else None}

    a1, b = deployment("http://a:8000/v1", "1"), deployment("http://b:8000/v1", "2")
    a2 = deployment("http://a:8000/v1", "3", name="other")  # the same pod listed again
    no_id = deployment("http://c:8000/v1")
    nowhere = deployment(None, "4")
    def by_pod(healthy):  # pod -> the first of `healthy` on it, in order
        return {pod: healthy[i] for pod, i in index.pods_of(healthy).positions.items()}

    assert by_pod([a1, b]) == {"http://a:8000": a1, "http://b:8000": b}
    assert list(by_pod([b, a1, a2])) == ["http://b:8000", "http://a:8000"]
    assert by_pod([b, a1, a2])["http://a:8000"] is a1
    assert by_pod([no_id, nowhere, a2]) == {"http://c:8000": no_id, "http://a:8000": a2}
    assert by_pod([]) == {}

    # Kept per list of ids (LiteLLM hands out a new list of copies each time), not for a list with an id-less one;
    # a new model list forgets them all (an id may then name another pod).
    assert index.pods_of([dict(a1), dict(b)]) is index.pods_of([a1, b])
    assert index.pods_of([no_id, b]) is not index.pods_of([no_id, b])
    moved = deployment("http://d:8000/v1", "1")  # id "1" now on another pod
    index.pods_for_model([moved, b], "m")
    assert index.pods_of([moved, b]).keys == ("http://d:8000", "http://b:8000")


def _raised(*chain: BaseException) -> BaseException:
    """`chain[0]` raised while handling `chain[1]`, itself while handling `chain[2]`...: LiteLLM's wrapping."""
    for outer, inner in zip(chain, chain[1:]):
        outer.__context__ = inner
    return chain[0]


def test_only_a_connection_that_was_never_made_takes_a_pod_out():
    from lora_affinity_plugin.host.proxy_callback import _could_not_connect

    refused = _raised(litellm.InternalServerError("Connection error.", "hosted_vllm", "m"),
                      httpx.ConnectError("Cannot connect to host"), ConnectionRefusedError(111, "refused"))
    assert _could_not_connect(refused)
    timed_out = _raised(litellm.Timeout("timed out", "m", "hosted_vllm"), httpx.ReadTimeout("read timed out"))
    assert not _could_not_connect(timed_out)  # a slow pod is the rules' business, not dead
    assert not _could_not_connect(litellm.BadRequestError("bad", "m", "hosted_vllm"))  # the caller's mistake
    assert not _could_not_connect(None)


async def test_routing_reads_no_deprecated_router_member():
    """1.110 made `Router.model_list` (and other members) deprecated aliases that warn and count on every read: a
    plugin reading one per request would flood a proxy's warnings and its deprecation counts. Whatever release is
    installed, routing warns nothing (`compat.model_list`, `compat.healthy_deployments`)."""
    router, strat, fleet = make()
    fleet.update({p: record(p, running={"sql-lora"} if p == PODS[1] else SLOTS_FULL) for p in PODS})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert await route(router, "sql-lora") == PODS[1]
    ours = [f"{w.filename}: {w.message}" for w in caught
            if issubclass(w.category, DeprecationWarning) and "lora_affinity_plugin" in w.filename]
    assert ours == [] and strat.decisions == 3  # (the test's own call, router.async_get_available_deployment, may warn)


def test_the_sync_path_is_left_to_litellm_and_warns_nothing():
    """`router.completion` (sync) has no event loop to keep metrics fresh: LiteLLM picks (simple-shuffle), through
    calls that are not deprecated on the installed release."""
    router, strat, fleet = make()
    fleet.update({p: record(p, running={"sql-lora"} if p == PODS[1] else SLOTS_FULL) for p in PODS})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reply = router.completion(model="sql-lora", messages=[{"role": "user", "content": "x"}], mock_response="hi")
    assert reply.choices[0].message.content == "hi" and strat.decisions == 0
    assert [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)
            and "lora_affinity_plugin" in w.filename] == []


def test_the_plugins_log_lines_are_json_while_litellms_are(monkeypatch):
    import json
    import logging

    from lora_affinity_plugin.host.proxy_callback import LogFormatter

    record = logging.LogRecord("lora_affinity", logging.WARNING, __file__, 1, "pod %s is down", ("vllm-0",), None)
    monkeypatch.setattr(litellm, "json_logs", False, raising=False)
    monkeypatch.delenv("JSON_LOGS", raising=False)
    assert LogFormatter().format(record).endswith("lora_affinity WARNING pod vllm-0 is down")
    monkeypatch.setattr(litellm, "json_logs", True, raising=False)
    body = json.loads(LogFormatter().format(record))
    assert body["message"] == "pod vllm-0 is down" and body["level"] == "WARNING" and body["logger"] == "lora_affinity"


async def test_shadow_mode_lets_litellm_route_and_counts_where_the_rules_would_have_agreed():
    from lora_affinity_plugin.telemetry.metrics import SHADOW, SHADOW_GAIN

    router, strat, fleet = make(shadow=True)
    fleet.update({p: record(p, running={"sql-lora"} if p == PODS[1] else ()) for p in PODS})
    yes, no = SHADOW.labels("yes", "*"), SHADOW.labels("no", "*")
    before = (yes._value.get(), no._value.get(), SHADOW_GAIN._sum.get())
    picks = [await route(router, "sql-lora") for _ in range(30)]
    assert len(set(picks)) > 1  # LiteLLM's shuffle served them, not the adapter's pod alone
    agreed, disagreed = yes._value.get() - before[0], no._value.get() - before[1]
    assert agreed + disagreed == 30 and agreed and disagreed and strat.decisions == 30
    assert SHADOW_GAIN._sum.get() - before[2] > 0  # where they differ, the rules' pod was predicted sooner
    import time

    waiting = {c.key: c.waiting for c in fleet.candidates(PODS, time.time())}
    assert waiting == {pod: picks.count(pod) for pod in PODS}  # each dispatch counted where LiteLLM sent it
