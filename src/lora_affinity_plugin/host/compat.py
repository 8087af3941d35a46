"""What differs between the LiteLLM releases this plugin supports (the tested range is in README.md).

One place for it, so the rest of the code reads as if there were one LiteLLM.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping


def aiohttp_transport_enabled() -> bool:
    """Whether LiteLLM sends upstream calls over aiohttp (its default) rather than httpx.

    Renamed from `_should_use_aiohttp_transport` (1.94-1.106) to `should_use_aiohttp_transport` (1.108).
    """
    from litellm.llms.custom_httpx.http_handler import AsyncHTTPHandler

    check = getattr(AsyncHTTPHandler, "should_use_aiohttp_transport", None) or getattr(
        AsyncHTTPHandler, "_should_use_aiohttp_transport")
    return bool(check())


def litellm_async_http_client() -> Any:
    """The HTTP client LiteLLM builds for an OpenAI SDK client: its transport, TLS, proxy and pool settings.

    Kept and reused by the plugin, it pools connections; LiteLLM builds one per text completion.
    """
    from litellm.llms.openai.common_utils import BaseOpenAILLM

    return BaseOpenAILLM._get_async_http_client()


def build_async_openai_client(*, api_key: str, api_base: str, timeout: Any, max_retries: int, http_client: Any) -> Any:
    """An `AsyncOpenAI` client as LiteLLM's text-completion handler builds it.

    1.108+ builds it with `workload_identity.build_async_openai_client`; 1.94-1.107 call `AsyncOpenAI`
    with the same arguments. Neither passes the deployment's `organization` on this path (the SDK reads
    OPENAI_ORG_ID), so neither does the plugin.
    """
    try:
        from litellm.llms.openai.workload_identity import (
            build_async_openai_client as build,
        )
    except ImportError:
        from openai import AsyncOpenAI

        return AsyncOpenAI(api_key=api_key, base_url=api_base, timeout=timeout, max_retries=max_retries,
                           organization=None, http_client=http_client)
    return build(api_key=api_key, api_base=api_base, timeout=timeout, max_retries=max_retries, organization=None,
                 static_key_http_client_factory=lambda: http_client)


def uses_workload_identity(kwargs: Mapping[str, Any]) -> bool:
    """Whether LiteLLM would authenticate this call with workload identity (1.108+) instead of a static key."""
    try:
        from litellm.llms.openai.workload_identity import (
            resolve_openai_workload_identity_config,
        )
    except ImportError:
        return False
    return resolve_openai_workload_identity_config(api_key=kwargs.get("api_key"), api_base=kwargs.get("api_base"),
                                                   litellm_params=kwargs) is not None


def resolve_text_completion_api_key(kwargs: Mapping[str, Any]) -> tuple[str, str | None]:
    """(provider, key) as LiteLLM resolves them for a text completion: the provider's resolution (explicit,
    `HOSTED_VLLM_API_KEY`...), then `litellm.api_key`, `litellm.openai_key`, `OPENAI_API_KEY`."""
    import litellm
    from litellm.secret_managers.main import get_secret_str

    api_key = kwargs.get("api_key")
    _, provider, dynamic_api_key, _ = litellm.get_llm_provider(
        model=str(kwargs.get("model", "")), custom_llm_provider=kwargs.get("custom_llm_provider"),
        api_base=kwargs.get("api_base"), api_key=api_key)
    if dynamic_api_key is not None:
        api_key = dynamic_api_key
    return provider, api_key or litellm.api_key or litellm.openai_key or get_secret_str("OPENAI_API_KEY")


def resolve_timeout(kwargs: Mapping[str, Any], provider: str) -> Any:
    """The timeout LiteLLM gives the call's OpenAI client.

    1.110 resolves it in `completion()` (`CompletionTimeout`: the call's, the request's, `request_timeout`,
    then `stream_timeout` for a live stream); before, the router's value in `kwargs["timeout"]` is final.
    """
    try:
        from litellm.litellm_core_utils.completion_timeout import (
            CompletionTimeout,
            StreamKind,
        )
        from litellm.litellm_core_utils.request_timeout_resolver import (
            get_configured_request_timeout,
        )
        from litellm.utils import supports_httpx_timeout
    except ImportError:
        return kwargs.get("timeout")
    return CompletionTimeout.resolve(
        kwargs.get("timeout"), kwargs, provider, global_timeout=get_configured_request_timeout(),
        supports_httpx_timeout=supports_httpx_timeout,
        stream_kind=StreamKind.LIVE if kwargs.get("stream") is True else StreamKind.NOT_STREAMED)


async def models_a_caller_may_call(scope: dict, names: frozenset[str], router: Any) -> list[str]:
    """Of `names`, those the caller of this HTTP request may call, by LiteLLM's own auth and model checks."""
    from litellm.proxy.auth.user_api_key_auth import user_api_key_auth
    from starlette.requests import Request

    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    try:
        token = await user_api_key_auth(
            request=Request(scope), api_key=headers.get("authorization", ""),
            azure_api_key_header=headers.get("api-key"), anthropic_api_key_header=headers.get("x-api-key"),
            google_ai_studio_api_key_header=headers.get("x-goog-api-key"),
            azure_apim_header=headers.get("ocp-apim-subscription-key"), custom_litellm_key_header=None)
    except Exception:  # LiteLLM refuses the caller: it answers the listing itself
        return []
    return [name for name in sorted(names) if await token_may_call(token, name, router)]


async def token_may_call(token: Any, model: str, router: Any) -> bool:
    """LiteLLM's checks for a request to `model`: the key's models (access groups, wildcards), then its team's."""
    from litellm.proxy._types import LiteLLM_TeamTable
    from litellm.proxy.auth.auth_checks import can_key_call_model, can_team_access_model

    try:
        await can_key_call_model(model=model, llm_model_list=model_list(router), valid_token=token, llm_router=router)
        if getattr(token, "team_id", None):
            team = LiteLLM_TeamTable(team_id=token.team_id, models=list(getattr(token, "team_models", None) or []))
            await can_team_access_model(model=model, team_object=team, llm_router=router)
    except Exception:
        return False
    return True


def _rust_core(router: Any) -> Any | None:
    """1.110+: the router's Rust core (`Router.register_plugin`), which holds the registered strategy."""
    return getattr(router, "_core", None) if _has_rust_core(type(router)) else None


@functools.lru_cache(maxsize=8)
def _has_rust_core(router_type: type) -> bool:
    """Asked once per class: on 1.110 a class-level lookup goes through the router's metaclass, and this runs on
    every refresh and request."""
    return hasattr(router_type, "register_plugin")


def model_list(router: Any) -> list[dict]:
    """The router's deployments. 1.110+: `Router.registry().all()` (the same list object until the list changes);
    `Router.model_list` became its deprecated alias there, which warns on every read (a `DeprecationWarning`
    and a count: one per request, since the strategy reads it to know whether it routes a model group)."""
    registry = getattr(router, "registry", None) if _rust_core(router) is not None else None
    return registry().all() if callable(registry) else router.model_list


def register_strategy(router: Any, strategy: Any) -> None:
    """`register_plugin` (1.110+; `set_custom_routing_strategy` became its deprecated alias) or the old call."""
    register = getattr(router, "register_plugin", None)
    (register or router.set_custom_routing_strategy)(strategy)


async def router_pick(router: Any, model: str, request_kwargs: dict, messages: Any = None) -> Any:
    """The router's pick as a caller asks for it (the registered strategy's, when one is): `Router.select` on
    1.110+ (`async_get_available_deployment` became its deprecated alias there), the method before."""
    if _rust_core(router) is not None and hasattr(router, "select"):
        return await router.select(model, request_kwargs, messages=messages)
    return await router.async_get_available_deployment(model=model, messages=messages, request_kwargs=request_kwargs)


def registered_strategy(router: Any) -> Any | None:
    """The custom strategy the router uses now, or None (a settings change or a rebuild drops it).

    1.94-1.108 assign the strategy's bound methods on the router instance; 1.110 keeps it on its core.
    """
    core = _rust_core(router)
    if core is not None:
        return getattr(core, "__dict__", {}).get("_custom_strategy")
    bound = getattr(router, "__dict__", {}).get("async_get_available_deployment")
    return getattr(bound, "__self__", None)


async def healthy_deployments(router: Any, model: str, request_kwargs: dict, messages: Any, input: Any,
                              specific_deployment: Any) -> Any:
    """The deployments LiteLLM would pick among (cooldowns and filters applied), or one as a dict.

    1.110+: `Router.select(kind="healthy")`; `async_get_healthy_deployments` became its deprecated alias,
    which warns on every call (a `DeprecationWarning` and a count, per request). Older releases: the method.
    """
    if _rust_core(router) is not None and hasattr(router, "select"):
        return await router.select(model, request_kwargs, kind="healthy", messages=messages, input=input,
                                   specific_deployment=specific_deployment)
    return await router.async_get_healthy_deployments(
        model=model, request_kwargs=request_kwargs, messages=messages, input=input,
        specific_deployment=specific_deployment)


async def host_pick(router: Any, model: str, messages: Any, input: Any, specific_deployment: Any,
                    request_kwargs: dict) -> Any:
    """LiteLLM's own pick for a model group the plugin does not route.

    1.94-1.108: the class's method, which the instance's custom strategy does not replace (the router's
    configured strategy). 1.110: the class's method calls the registered strategy again, so the healthy
    deployments (cooldowns applied) are picked by LiteLLM's `simple_shuffle` (weights, rpm, tpm), its
    default strategy; a `routing_strategy` configured beside the plugin does not apply to those groups.
    """
    core = _rust_core(router)
    if core is None:
        return await type(router).async_get_available_deployment(
            router, model=model, messages=messages, input=input, specific_deployment=specific_deployment,
            request_kwargs=request_kwargs)
    healthy = await healthy_deployments(router, model, request_kwargs, messages, input, specific_deployment)
    if isinstance(healthy, dict) or not healthy:
        return healthy
    from litellm.router_strategy.simple_shuffle import simple_shuffle

    return simple_shuffle(resolve_model_alias=_alias_resolver(core), healthy_deployments=healthy, model=model,
                          request_kwargs=request_kwargs)


def _alias_resolver(core: Any) -> Any:
    """model_group_alias resolution as the 1.110 core does it (for simple_shuffle's scoped weights)."""
    resolve = getattr(getattr(core, "_hosted", None), "_core_get_model_from_alias", None)
    return resolve if callable(resolve) else (lambda name: None)


def host_pick_sync(router: Any, model: str, messages: Any, input: Any, specific_deployment: Any,
                   request_kwargs: Any) -> Any:
    """The sync twin of `host_pick` (`router.completion`); on 1.110 the group's deployments, weighted
    by `simple_shuffle` (no sync health read exists there)."""
    core = _rust_core(router)
    if core is None:
        return type(router).get_available_deployment(
            router, model=model, messages=messages, input=input, specific_deployment=specific_deployment,
            request_kwargs=request_kwargs)
    deployments = list(router.registry().deployments(model) or [])  # `get_model_list` is its deprecated alias there
    if not deployments:
        raise ValueError(f"no deployment for model {model!r}")
    from litellm.router_strategy.simple_shuffle import simple_shuffle

    return simple_shuffle(resolve_model_alias=_alias_resolver(core), healthy_deployments=deployments, model=model,
                          request_kwargs=request_kwargs)

