"""Pooled upstream connections for the text completions the plugin routes, and nothing else.

Why this exists: LiteLLM sends `/v1/completions` for OpenAI-compatible servers (`hosted_vllm/`,
`openai/`, `text-completion-openai/`) through `OpenAITextCompletion`, which builds a new `AsyncOpenAI`
client, and with it a new HTTP client and connection pool, for every call it is not handed one. So
every text completion opens a TCP connection to the pod. Chat completions already share a pool.

How, without changing what LiteLLM would do:
- Only a text completion sent to a pod of a model group the plugin routes gets a client, in LiteLLM's
  `async_pre_call_deployment_hook`, which runs after the router has resolved the call's timeout,
  retries and credentials and before the upstream call. Nothing goes into the router's cache (LiteLLM
  sizes it for its own cooldowns, rpm counters and semaphores), and every other call is untouched.
- The client is the one LiteLLM would build for this call (its own builder where the release has one,
  the same key resolution, timeout and retries); only its HTTP client differs: one per event loop,
  built by LiteLLM's own factory, so TLS (`ssl_verify`, `SSL_CERT_FILE`), proxies (`AIOHTTP_TRUST_ENV`),
  `force_ipv4`, socket keep-alive, DNS caching and idle timeout (`AIOHTTP_KEEPALIVE_TIMEOUT`) are LiteLLM's.
- A call whose settings the plugin cannot reproduce (workload identity, a key LiteLLM could not resolve
  either, a client already given) is left to LiteLLM, and said once per deployment.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections import OrderedDict
from typing import Any, Mapping

import httpx

from ..telemetry.episodes import Episode
from . import compat

logger = logging.getLogger("lora_affinity")

POOLED_PROVIDERS = frozenset({"hosted_vllm", "openai", "text-completion-openai"})
"""Providers whose text completions go through `OpenAITextCompletion` and accept an OpenAI client."""
_MAX_CLIENTS = 1024
"""OpenAI clients kept per loop (one per pod, key, timeout and retries seen); the least recently used go."""
_MAX_NOTED = 4096


class PooledClients:
    """Per call, the OpenAI client LiteLLM would build, over one shared connection pool per event loop."""

    def __init__(self) -> None:
        self._http: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clients: OrderedDict[tuple, Any] = OrderedDict()
        self._left_to_litellm: OrderedDict[str, None] = OrderedDict()
        self._failing = Episode(logger, "lora-affinity could not hand a pooled client; LiteLLM builds its own")

    def client_for(self, kwargs: Mapping[str, Any]) -> Any | None:
        """The pooled client for one text completion's final kwargs, or None to leave it to LiteLLM. Never raises."""
        try:
            client = self._client_for(kwargs)
        except Exception as exc:  # pooling is an optimisation: LiteLLM's own path still serves the call
            self._failing.fail(f"{type(exc).__name__}: {exc}")  # once per episode, not per request
            return None
        self._failing.recover()
        return client

    def _client_for(self, kwargs: Mapping[str, Any]) -> Any | None:
        if kwargs.get("client") is not None:
            return None  # the caller chose one
        params = _ClientParams.of(kwargs)
        if isinstance(params, str):
            self._leave_to_litellm(kwargs, params)
            return None
        self._bind_to_running_loop()
        key = params.cache_key()
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = compat.build_async_openai_client(
                api_key=params.api_key, api_base=params.api_base, timeout=params.timeout,
                max_retries=params.max_retries, http_client=self._shared_http())
            if len(self._clients) > _MAX_CLIENTS:
                self._clients.popitem(last=False)  # the SDK client holds no connections: the pool does
        else:
            self._clients.move_to_end(key)
        return client

    def _leave_to_litellm(self, kwargs: Mapping[str, Any], why: str) -> None:
        model_id = str((kwargs.get("model_info") or {}).get("id") or kwargs.get("api_base"))
        if model_id not in self._left_to_litellm:
            self._left_to_litellm[model_id] = None
            if len(self._left_to_litellm) > _MAX_NOTED:
                self._left_to_litellm.popitem(last=False)
            logger.info("lora-affinity leaves text completions of deployment %s to LiteLLM's own client: %s",
                        model_id, why)

    def _bind_to_running_loop(self) -> None:
        """Clients belong to one event loop: a new loop (a `Router` user's next `asyncio.run`) gets new ones."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            old, self._http = self._http, None
            self._loop, self._clients = loop, OrderedDict()
            if old is not None:
                _close_detached(old)

    def _shared_http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = compat.litellm_async_http_client()
            logger.info("pooled upstream connections for text completions on LiteLLM's transport")
        return self._http

    async def aclose(self) -> None:
        """Close the pool (the proxy offers no shutdown hook; `litellm.Router` users call it)."""
        http, self._http, self._clients = self._http, None, OrderedDict()
        if http is not None:
            await http.aclose()


class _ClientParams:
    """What LiteLLM passes its OpenAI client for one text completion, resolved as LiteLLM resolves it."""

    __slots__ = ("api_base", "api_key", "timeout", "max_retries")

    def __init__(self, api_base: str, api_key: str, timeout: Any, max_retries: int) -> None:
        self.api_base, self.api_key, self.timeout, self.max_retries = api_base, api_key, timeout, max_retries

    @classmethod
    def of(cls, kwargs: Mapping[str, Any]) -> _ClientParams | str:
        """The parameters, or why the plugin cannot reproduce LiteLLM's client for this call."""
        api_base = kwargs.get("api_base")
        if not api_base:
            return "no api_base"
        if compat.uses_workload_identity(kwargs):
            return "workload identity credentials"
        provider, api_key = compat.resolve_text_completion_api_key(kwargs)
        if not api_key:
            return "no API key resolvable (LiteLLM reports the error itself)"
        timeout = compat.resolve_timeout(kwargs, provider)
        if timeout is None:
            return "no timeout resolved by the router"
        if isinstance(timeout, str):
            timeout = float(timeout)
        max_retries = kwargs.get("max_retries")
        return cls(str(api_base), str(api_key), timeout, 2 if max_retries is None else int(max_retries))

    def cache_key(self) -> tuple:
        timeout = self.timeout if isinstance(self.timeout, (int, float)) else repr(self.timeout)
        return (self.api_base, hashlib.sha256(self.api_key.encode()).hexdigest(), timeout, self.max_retries)


def _close_detached(http: httpx.AsyncClient) -> None:
    """A client of a previous loop: close it there if that loop still runs, else let LiteLLM's transport dispose of it."""
    try:
        asyncio.get_running_loop().create_task(http.aclose())
    except Exception:  # a transport bound to a closed loop: nothing left to flush
        pass


def provider_of(params: Mapping[str, Any]) -> str:
    explicit = params.get("custom_llm_provider")
    return str(explicit) if explicit else str(params.get("model", "")).partition("/")[0]


@functools.lru_cache(maxsize=None)  # once per process
def warn_if_litellm_outlives_server_keepalive(server_keepalive_s: float = 5.0) -> None:
    """LiteLLM keeps idle upstream connections AIOHTTP_KEEPALIVE_TIMEOUT (15 s); vLLM closes them after 5 s."""
    try:
        from litellm.constants import AIOHTTP_KEEPALIVE_TIMEOUT

        if compat.aiohttp_transport_enabled() and AIOHTTP_KEEPALIVE_TIMEOUT >= server_keepalive_s:
            logger.warning("LiteLLM keeps idle upstream connections %s s (AIOHTTP_KEEPALIVE_TIMEOUT), not less than "
                           "vLLM's 5 s keep-alive: a request may meet a connection the server is closing. "
                           "Set AIOHTTP_KEEPALIVE_TIMEOUT=4 in the proxy's environment.", AIOHTTP_KEEPALIVE_TIMEOUT)
    except Exception:  # a release without these names: nothing to say
        pass

