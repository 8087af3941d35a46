"""Pooled upstream connections: one connection pool per worker process, reused for every pod.

Why this exists: LiteLLM 1.108 sends `/v1/completions` for OpenAI-compatible servers (`hosted_vllm/`,
`openai/`) through `OpenAITextCompletion`, which builds a new `AsyncOpenAI` client, and with it a new
HTTP client and connection pool, for every call unless it is handed one. The router hands one over
only when its cache holds `{model_id}_async_client` (or `_stream_async_client`), and nothing in the
proxy fills that slot. So every text completion opens a TCP connection to the pod and leaves an
aiohttp session to the garbage collector ("Unclosed client session"). Chat completions of
`hosted_vllm/` already share a pool (`get_async_httpx_client`); they ignore an OpenAI client.

`PooledClients` fills the router's slot for the deployments it routes: per deployment an `AsyncOpenAI`
client, all over one HTTP client that LiteLLM itself builds (its aiohttp transport on the proxy's
shared session, or httpx when `DISABLE_AIOHTTP_TRANSPORT` is set), so the proxy keeps one pool of
connections per pod. A stream the client abandons is closed by LiteLLM's stream wrapper, which
closes its upstream response: an unfinished connection is dropped, never returned to the pool.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sys
from typing import Any, Mapping

import httpx
import litellm

from .pods import _resolve_env

logger = logging.getLogger("lora_affinity")

POOLED_PROVIDERS = frozenset({"hosted_vllm", "openai", "text-completion-openai"})
"""Providers whose text completions go through `OpenAITextCompletion` and accept an OpenAI client."""
_CLIENT_TTL_S = 24 * 3600
"""The router's cache expires entries; every decision puts a missing one back."""


class PooledClients:
    """Per deployment, an OpenAI client over one shared pool; placed in the router's client slot."""

    def __init__(self) -> None:
        self._http: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clients: dict[tuple, Any] = {}
        self.installed = 0
        """How many times a client was put into the router's cache (first use and after expiry)."""

    def ensure(self, router: Any, deployment: Mapping[str, Any]) -> None:
        """Make sure the router will hand `deployment`'s calls the pooled client. Never raises."""
        try:
            self._ensure(router, deployment)
        except Exception:  # pooling is an optimisation: LiteLLM's own path still serves the call
            logger.exception("lora-affinity could not install a pooled client; LiteLLM builds its own")

    def _ensure(self, router: Any, deployment: Mapping[str, Any]) -> None:
        model_id = (deployment.get("model_info") or {}).get("id")
        params = deployment.get("litellm_params") or {}
        if model_id is None or _provider(params) not in POOLED_PROVIDERS:
            return
        cache = getattr(getattr(router, "cache", None), "in_memory_cache", None)
        if cache is None:
            return
        self._bind_to_running_loop()
        for stream, suffix in ((False, "_async_client"), (True, "_stream_async_client")):
            key = f"{model_id}{suffix}"
            if cache.get_cache(key) is None:
                cache.set_cache(key, self._client(params, stream), ttl=_CLIENT_TTL_S)
                self.installed += 1

    def _bind_to_running_loop(self) -> None:
        """Clients belong to one event loop: a new loop (a `Router` user's `asyncio.run`) gets new ones."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop, self._http, self._clients = loop, None, {}

    def _client(self, params: Mapping[str, Any], stream: bool) -> Any:
        from openai import AsyncOpenAI

        api_base = str(_resolve_env(params.get("api_base")) or "")
        api_key = str(_resolve_env(params.get("api_key")) or "none")
        timeout = _timeout(params, stream)
        key = (api_base, hashlib.sha256(api_key.encode()).hexdigest(), timeout)
        client = self._clients.get(key)
        if client is None:
            # max_retries=0: the router retries (and the strategy then avoids the pod that failed).
            client = self._clients[key] = AsyncOpenAI(api_key=api_key, base_url=api_base, timeout=timeout,
                                                      max_retries=0, http_client=self._shared_http())
        return client

    def _shared_http(self) -> httpx.AsyncClient:
        if self._http is None:
            from litellm.llms.openai.common_utils import BaseOpenAILLM

            session = _proxy_session()
            self._http = BaseOpenAILLM._get_async_http_client(shared_session=session)
            logger.info("pooled upstream client on %s", "the proxy's shared aiohttp session" if session is not None
                        else type(getattr(self._http, "_transport", None)).__name__)
        return self._http

    async def aclose(self) -> None:
        """For `litellm.Router` users at shutdown; the proxy closes its shared session itself."""
        http, self._http, self._clients = self._http, None, {}
        if http is not None and http is not litellm.aclient_session:
            await http.aclose()


def _provider(params: Mapping[str, Any]) -> str:
    explicit = params.get("custom_llm_provider")
    return str(explicit) if explicit else str(params.get("model", "")).partition("/")[0]


def _timeout(params: Mapping[str, Any], stream: bool) -> float | None:
    """What LiteLLM would pass per call: the deployment's (stream_)timeout, else the proxy's request_timeout."""
    for name in (("stream_timeout", "timeout") if stream else ("timeout",)):
        value = _resolve_env(params.get(name))
        if value is not None:
            return float(value)
    value = getattr(litellm, "request_timeout", None)
    return float(value) if value else None


def _proxy_session() -> Any:
    """The proxy's shared aiohttp session when there is one (not for `litellm.Router` users)."""
    proxy_server = sys.modules.get("litellm.proxy.proxy_server")  # never import the proxy into a Router user
    session = getattr(proxy_server, "shared_aiohttp_session", None)
    return session if session is not None and not getattr(session, "closed", True) else None
