"""Pooled upstream connections: one connection pool per worker process, reused for every pod.

Why this exists: LiteLLM 1.108 sends `/v1/completions` for OpenAI-compatible servers (`hosted_vllm/`,
`openai/`) through `OpenAITextCompletion`, which builds a new `AsyncOpenAI` client, and with it a new
HTTP client and connection pool, for every call unless it is handed one. The router hands one over
only when its cache holds `{model_id}_async_client` (or `_stream_async_client`), and nothing in the
proxy fills that slot. So every text completion opens a TCP connection to the pod and leaves an
aiohttp session to the garbage collector ("Unclosed client session"). Chat completions of
`hosted_vllm/` already share a pool (`get_async_httpx_client`); they ignore an OpenAI client.

`PooledClients` fills the router's slot for the deployments it routes: per deployment an `AsyncOpenAI`
client, all over one HTTP client on LiteLLM's own transport (aiohttp, or httpx when
`DISABLE_AIOHTTP_TRANSPORT` is set), so each worker process keeps one pool of connections per pod.
Its idle connections close before the model server would close them (see `_shared_http`). A stream the client abandons is closed by LiteLLM's stream wrapper, which
closes its upstream response: an unfinished connection is dropped, never returned to the pool.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from typing import Any, Mapping

import httpx
import litellm

from .compat import aiohttp_transport_enabled
from .episodes import Episode
from .pods import _resolve_env

logger = logging.getLogger("lora_affinity")

POOLED_PROVIDERS = frozenset({"hosted_vllm", "openai", "text-completion-openai"})
"""Providers whose text completions go through `OpenAITextCompletion` and accept an OpenAI client."""
_CLIENT_TTL_S = 24 * 3600
"""The router's cache expires entries; every decision puts a missing one back."""


class PooledClients:
    """Per deployment, an OpenAI client over one shared pool; placed in the router's client slot."""

    def __init__(self, keepalive_ms: int = 4_000) -> None:
        self.keepalive_ms = keepalive_ms
        self._http: httpx.AsyncClient | None = None
        self._session: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clients: dict[tuple, Any] = {}
        self.installed = 0
        """How many times a client was put into the router's cache (first use and after expiry)."""
        self._failing = Episode(logger, "lora-affinity could not install a pooled client; LiteLLM builds its own")

    def ensure(self, router: Any, deployment: Mapping[str, Any]) -> None:
        """Make sure the router will hand `deployment`'s calls the pooled client. Never raises."""
        try:
            self._ensure(router, deployment)
        except Exception as exc:  # pooling is an optimisation: LiteLLM's own path still serves the call
            self._failing.fail(f"{type(exc).__name__}: {exc}")  # logged once per episode, not per request
        else:
            self._failing.recover()

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
            self._loop, self._http, self._session, self._clients = loop, None, None, {}

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
        """One HTTP client for every pod, on LiteLLM's transport, closing idle connections before the server does.

        Model servers close a connection idle for 5 s (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, uvicorn's
        default); a pool that keeps it longer (LiteLLM's shared session: 15 s) sometimes sends a request
        on a connection the server is closing, and that request fails ("Cannot write to closing transport").
        """
        if self._http is None:
            from litellm.llms.openai.common_utils import BaseOpenAILLM

            keepalive_s = self.keepalive_ms / 1000
            if aiohttp_transport_enabled():
                import aiohttp

                self._session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive_s),
                    cookie_jar=aiohttp.DummyCookieJar())
                self._http = BaseOpenAILLM._get_async_http_client(shared_session=self._session)
            else:  # DISABLE_AIOHTTP_TRANSPORT: httpx, as LiteLLM would build it, with the shorter keep-alive
                self._http = httpx.AsyncClient(
                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=None,
                                        keepalive_expiry=keepalive_s), follow_redirects=True)
            logger.info("pooled upstream connections: %s, idle ones closed after %.1f s",
                        "aiohttp" if self._session is not None else "httpx", keepalive_s)
        return self._http

    async def aclose(self) -> None:
        """At shutdown (the proxy offers no hook for it; `litellm.Router` users call it)."""
        http, session = self._http, self._session
        self._http, self._session, self._clients = None, None, {}
        if http is not None and http is not litellm.aclient_session:  # never close the user's own client
            await http.aclose()
        if session is not None:
            await session.close()


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


@functools.lru_cache(maxsize=None)  # once per process
def warn_if_litellm_outlives_server_keepalive(keepalive_ms: int) -> None:
    """LiteLLM's own pool (chat completions of `hosted_vllm/`) keeps idle connections AIOHTTP_KEEPALIVE_TIMEOUT."""
    try:
        from litellm.constants import AIOHTTP_KEEPALIVE_TIMEOUT

        if aiohttp_transport_enabled() and AIOHTTP_KEEPALIVE_TIMEOUT * 1000 > keepalive_ms:
            logger.warning("LiteLLM keeps idle upstream connections %s s (AIOHTTP_KEEPALIVE_TIMEOUT), longer than "
                           "vLLM's 5 s keep-alive: a chat request may meet a connection the server is closing. "
                           "Set AIOHTTP_KEEPALIVE_TIMEOUT=%d in the proxy's environment.",
                           AIOHTTP_KEEPALIVE_TIMEOUT, keepalive_ms // 1000)
    except Exception:  # a release without these names: nothing to say
        pass
