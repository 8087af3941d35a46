"""PooledClients: the client handed to a text completion is the one LiteLLM would build, over one pool.

Each case runs a text completion through LiteLLM alone (no plugin) against a closed port, records the
`AsyncOpenAI` client LiteLLM builds and the kwargs its pre-call deployment hook sees, then asks the
plugin for its client from those same kwargs: key, base URL, timeout, retries and organization must match.
"""

from __future__ import annotations

import asyncio

import litellm
import openai
import pytest
from litellm.integrations.custom_logger import CustomLogger

from lora_affinity_plugin.host import compat
from lora_affinity_plugin import strategy as strategy_module
from lora_affinity_plugin.host.pooling import PooledClients
from lora_affinity_plugin.config.settings import build_settings
from procs import free_port


class _Recorder(CustomLogger):
    def __init__(self) -> None:
        super().__init__()
        self.kwargs: list[dict] = []

    async def async_pre_call_deployment_hook(self, kwargs, call_type):
        if str(getattr(call_type, "value", call_type)) == "atext_completion":
            self.kwargs.append(dict(kwargs))
        return None


@pytest.fixture
def built(monkeypatch):
    """Every AsyncOpenAI client constructed during the test, in order."""
    clients: list[openai.AsyncOpenAI] = []
    original = openai.AsyncOpenAI.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        clients.append(self)

    monkeypatch.setattr(openai.AsyncOpenAI, "__init__", record)
    return clients


@pytest.fixture
def recorder():
    hook = _Recorder()
    litellm.callbacks.append(hook)
    yield hook
    litellm.callbacks.remove(hook)


CLOSED = f"http://127.0.0.1:{free_port()}/v1"
CASES = {
    "key from HOSTED_VLLM_API_KEY": ({"model": "hosted_vllm/m", "api_base": CLOSED}, {}, {},
                                     {"HOSTED_VLLM_API_KEY": "hv-env"}),
    "key from os.environ/ reference": ({"model": "openai/m", "api_base": CLOSED, "api_key": "os.environ/POD_KEY"},
                                       {}, {}, {"POD_KEY": "pod-env"}),
    "key from OPENAI_API_KEY": ({"model": "text-completion-openai/m", "api_base": CLOSED}, {}, {},
                                {"OPENAI_API_KEY": "oa-env"}),
    "explicit key, deployment timeout": ({"model": "hosted_vllm/m", "api_base": CLOSED, "api_key": "k",
                                          "timeout": 7, "organization": "org-1"}, {}, {}, {}),
    "request timeout beats router and deployment": ({"model": "hosted_vllm/m", "api_base": CLOSED, "api_key": "k",
                                                     "timeout": 7}, {"timeout": 3}, {"timeout": 0.5}, {}),
    "router timeout": ({"model": "hosted_vllm/m", "api_base": CLOSED, "api_key": "k"}, {"timeout": 3}, {}, {}),
    "stream timeout": ({"model": "hosted_vllm/m", "api_base": CLOSED, "api_key": "k", "stream_timeout": 2,
                        "timeout": 9}, {}, {"stream": True}, {}),
    "router retries": ({"model": "hosted_vllm/m", "api_base": CLOSED, "api_key": "k"}, {"num_retries": 2}, {}, {}),
}


async def _text_completion(router: litellm.Router, request: dict) -> None:
    try:
        response = await router.atext_completion(model="g", prompt="hello", **request)
        if request.get("stream"):
            async for _ in response:
                pass
    except Exception:
        pass  # the port is closed: what matters is the client LiteLLM built first


def _headers(client: openai.AsyncOpenAI) -> dict:
    return {k: (v if isinstance(v, str) else type(v).__name__) for k, v in client.default_headers.items()}


@pytest.mark.parametrize("case", list(CASES))
async def test_the_pooled_client_is_the_one_litellm_builds(case, built, recorder, monkeypatch):
    params, router_settings, request, env = CASES[case]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    router = litellm.Router(model_list=[{"model_name": "g", "litellm_params": params}],
                            **{"num_retries": 0, **router_settings})
    await _text_completion(router, request)
    assert recorder.kwargs and built, "LiteLLM built no client for the call"
    theirs, hook_kwargs = built[-1], recorder.kwargs[-1]

    pools = PooledClients()
    ours = pools.client_for(hook_kwargs)
    assert ours is not None and ours is not theirs
    for attribute in ("api_key", "base_url", "timeout", "max_retries", "organization"):
        assert getattr(ours, attribute) == getattr(theirs, attribute), attribute
    assert _headers(ours) == _headers(theirs)
    await pools.aclose()


async def test_one_http_client_for_every_pod_and_one_openai_client_per_setting():
    pools = PooledClients()
    base = {"model": "hosted_vllm/m", "api_key": "k", "timeout": 5.0, "max_retries": 0}
    a = pools.client_for({**base, "api_base": "http://pod-a:8000/v1"})
    b = pools.client_for({**base, "api_base": "http://pod-b:8000/v1"})
    a_again = pools.client_for({**base, "api_base": "http://pod-a:8000/v1"})
    a_short = pools.client_for({**base, "api_base": "http://pod-a:8000/v1", "timeout": 0.5})
    assert a is a_again and a is not a_short and a_short.timeout == 0.5
    assert a._client is b._client is a_short._client  # one HTTP client: one pool of connections per pod
    assert pools.client_for({**base, "api_base": "http://pod-a:8000/v1", "client": object()}) is None
    await pools.aclose()


async def test_the_pool_is_litellms_own_transport_with_its_keepalive():
    from litellm.constants import AIOHTTP_KEEPALIVE_TIMEOUT

    from lora_affinity_plugin.host.compat import aiohttp_transport_enabled

    pools = PooledClients()
    client = pools.client_for({"model": "hosted_vllm/m", "api_key": "k", "timeout": 5.0,
                               "api_base": "http://pod-a:8000/v1"})
    transport = client._client._transport
    assert type(transport).__module__.startswith("litellm." if aiohttp_transport_enabled() else "httpx")
    if aiohttp_transport_enabled():
        session = transport._get_valid_client_session() if hasattr(transport, "_get_valid_client_session") \
            else transport.client
        session = session() if callable(session) else session
        assert session.connector._keepalive_timeout == AIOHTTP_KEEPALIVE_TIMEOUT
        assert session.trust_env == litellm.aiohttp_trust_env
    await pools.aclose()


def test_calls_it_cannot_reproduce_are_left_to_litellm(caplog):
    caplog.set_level("INFO", "lora_affinity")
    pools = PooledClients()
    assert pools.client_for({"model": "hosted_vllm/m", "api_key": "k", "timeout": 5.0,
                             "model_info": {"id": "no-base"}}) is None
    assert pools.client_for({"model": "hosted_vllm/m", "api_key": "k", "timeout": 5.0,
                             "model_info": {"id": "no-base"}}) is None
    assert caplog.text.count("leaves text completions of deployment no-base to LiteLLM") == 1  # said once


async def test_a_new_event_loop_gets_a_new_pool():
    pools = PooledClients()
    kwargs = {"model": "hosted_vllm/m", "api_key": "k", "timeout": 5.0, "api_base": "http://pod-a:8000/v1"}

    async def client():
        return pools.client_for(kwargs)

    first = await client()
    second = await asyncio.get_running_loop().run_in_executor(None, lambda: asyncio.run(client()))
    assert first is not second and first._client is not second._client


def _routed_router(model_list: list[dict]) -> tuple[litellm.Router, strategy_module.LoraAffinityStrategy]:
    router = litellm.Router(model_list=model_list, num_retries=0)
    strategy = strategy_module.install(router, build_settings({}))
    strategy.stop()
    return router, strategy


async def test_only_text_completions_to_routed_pods_get_a_pooled_client():
    router, strategy = _routed_router([
        {"model_name": "pods", "litellm_params": {"model": "hosted_vllm/m", "api_base": "http://pod-a:8000/v1"}},
        {"model_name": "gpt", "litellm_params": {"model": "openai/gpt-4o"}},
    ])
    pod, gpt = compat.model_list(router)
    strategy._index.pod(pod)  # what a decision for the pods' group records
    call = {**pod["litellm_params"], "api_key": "k", "timeout": 5.0, "model_info": pod["model_info"]}
    assert strategy.pooled_client(call, "atext_completion") is not None
    assert strategy.pooled_client(call, "acompletion") is None  # chats: LiteLLM pools them itself
    assert strategy.pooled_client({**gpt["litellm_params"], "api_key": "k", "timeout": 5.0,
                                   "model_info": gpt["model_info"]}, "atext_completion") is None
    strategy.settings = build_settings({"pooled_clients": False})
    assert strategy.pooled_client(call, "atext_completion") is None
    await strategy.pools.aclose()


async def test_the_plugin_puts_nothing_in_the_routers_cache():
    router, strategy = _routed_router([{"model_name": "pods", "litellm_params": {
        "model": "hosted_vllm/m", "api_base": "http://pod-a:8000/v1"}}])
    cache = router.health().store if hasattr(router, "health") else router.cache  # (1.110 renamed it)
    before = dict(cache.in_memory_cache.cache_dict)
    strategy._index.pod(compat.model_list(router)[0])
    strategy.pooled_client({**compat.model_list(router)[0]["litellm_params"], "api_key": "k", "timeout": 5.0,
                            "model_info": compat.model_list(router)[0]["model_info"]}, "atext_completion")
    assert cache.in_memory_cache.cache_dict == before
    await strategy.pools.aclose()


async def test_reinstalling_keeps_one_pool():
    router, first = _routed_router([{"model_name": "pods", "litellm_params": {
        "model": "hosted_vllm/m", "api_base": "http://pod-a:8000/v1"}}])
    second = strategy_module.install(router, build_settings({}))
    second.stop()
    assert second.pools is first.pools


def test_a_failure_while_building_a_client_leaves_the_call_to_litellm_and_is_logged_once(monkeypatch, caplog):

    def broken(kwargs):
        raise RuntimeError("a release without this helper")

    monkeypatch.setattr(compat, "resolve_text_completion_api_key", broken)
    pools = PooledClients()
    call = {"model": "hosted_vllm/m", "api_key": "k", "timeout": 5.0, "api_base": "http://pod-a:8000/v1"}
    assert pools.client_for(call) is None and pools.client_for(call) is None
    assert caplog.text.count("could not hand a pooled client") == 1


@pytest.mark.parametrize("model_info", [None, "x", {"id": ["unhashable"]}, {"id": None}])
def test_odd_model_info_in_a_call_is_left_to_litellm(model_info):
    strategy = strategy_module.LoraAffinityStrategy(litellm.Router(model_list=[]), build_settings({}))
    assert strategy.pooled_client({"model": "hosted_vllm/m", "model_info": model_info}, "atext_completion") is None
