"""PooledClients: which deployments get a pooled client in the router's slot, and that it is shared."""

from __future__ import annotations

import litellm
import pytest
from openai import AsyncOpenAI

from lora_affinity_plugin.pooling import PooledClients

MODEL_LIST = [
    {"model_name": "*", "litellm_params": {"model": "hosted_vllm/*", "api_base": "http://pod-a:8000/v1", "api_key": "k1"}},
    {"model_name": "*", "litellm_params": {"model": "hosted_vllm/*", "api_base": "http://pod-b:8000/v1", "api_key": "k1",
                                           "timeout": 30}},
    {"model_name": "sql", "litellm_params": {"model": "openai/sql-lora", "api_base": "http://pod-a:8000/v1"}},
    {"model_name": "claude", "litellm_params": {"model": "anthropic/claude-3", "api_key": "x"}},
]


def slot(router: litellm.Router, deployment: dict, stream: bool = False):
    suffix = "_stream_async_client" if stream else "_async_client"
    return router.cache.in_memory_cache.get_cache(f"{deployment['model_info']['id']}{suffix}")


async def test_openai_compatible_deployments_get_one_client_each_over_one_pool():
    router = litellm.Router(model_list=MODEL_LIST)
    pools = PooledClients()
    pod_a, pod_b, sql, claude = router.model_list
    for deployment in router.model_list:
        pools.ensure(router, deployment)

    a, b, s = slot(router, pod_a), slot(router, pod_b), slot(router, sql)
    assert all(isinstance(c, AsyncOpenAI) for c in (a, b, s))
    assert str(a.base_url).startswith("http://pod-a:8000/v1") and str(b.base_url).startswith("http://pod-b:8000/v1")
    assert a.api_key == "k1" and b.timeout == 30.0 and a.max_retries == 0
    assert a._client is b._client is s._client  # one HTTP client, so one pool per pod
    assert isinstance(slot(router, pod_a, stream=True), AsyncOpenAI)
    assert slot(router, claude) is None  # not an OpenAI-compatible text path: LiteLLM's own client
    await pools.aclose()


async def test_an_expired_or_evicted_slot_is_filled_again_with_the_same_client():
    router = litellm.Router(model_list=MODEL_LIST)
    pools = PooledClients()
    deployment = router.model_list[0]
    pools.ensure(router, deployment)
    first = slot(router, deployment)
    router.cache.in_memory_cache.delete_cache(f"{deployment['model_info']['id']}_async_client")
    pools.ensure(router, deployment)
    assert slot(router, deployment) is first
    assert pools.installed == 3  # two slots, then one refilled


async def test_the_router_hands_the_pooled_client_to_text_completions():
    router = litellm.Router(model_list=MODEL_LIST[:1])
    pools = PooledClients()
    pools.ensure(router, router.model_list[0])
    assert router._get_async_openai_model_client(router.model_list[0], {}) is slot(router, router.model_list[0])
    await pools.aclose()


async def test_a_broken_router_never_fails_the_request(caplog):
    class NoCache:
        cache = None

    PooledClients().ensure(NoCache(), {"model_info": {"id": "x"}, "litellm_params": {"model": "hosted_vllm/a"}})

    class BadCache:
        class cache:  # noqa: N801 - shaped like the router's DualCache
            class in_memory_cache:  # noqa: N801
                @staticmethod
                def get_cache(key):
                    raise RuntimeError("boom")

    PooledClients().ensure(BadCache(), {"model_info": {"id": "x"}, "litellm_params": {"model": "hosted_vllm/a"}})
    assert "could not install a pooled client" in caplog.text


def test_outside_an_event_loop_nothing_is_installed(caplog):
    router = litellm.Router(model_list=MODEL_LIST[:1])
    PooledClients().ensure(router, router.model_list[0])
    assert slot(router, router.model_list[0]) is None


@pytest.mark.parametrize("params,expected", [({"timeout": 5}, 5.0), ({"stream_timeout": 2, "timeout": 5}, 5.0)])
def test_timeouts_follow_the_deployment(params, expected):
    from lora_affinity_plugin.pooling import _timeout

    assert _timeout(params, stream=False) == expected
    assert _timeout({"stream_timeout": 2, "timeout": 5}, stream=True) == 2.0


async def test_the_pool_drops_connections_idle_longer_than_upstream_keepalive():
    router = litellm.Router(model_list=MODEL_LIST[:1])
    pools = PooledClients(keepalive_ms=1500)
    pools.ensure(router, router.model_list[0])
    assert pools._session is not None  # LiteLLM's default transport: aiohttp, on the pool's own session
    assert pools._session.connector._keepalive_timeout == 1.5  # below vLLM's 5 s by default (4 s)
    await pools.aclose()
