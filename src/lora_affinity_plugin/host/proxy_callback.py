"""The proxy's callback: installs the routing strategy on LiteLLM's router and keeps requests counted.

Listed once in the proxy's `config.yaml` (`lora_affinity_plugin.strategy.proxy_plugin`, which
resolves to `proxy_plugin` here). The request path itself is in `strategy.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import weakref
from datetime import datetime
from typing import Any, Mapping

import anyio
import httpx
import litellm
from litellm.integrations.custom_logger import CustomLogger

from ..config.settings import Settings, SettingsError, load_config, settings_from_config
from ..fleet.discovery import install_listing
from ..fleet.inflight import Dispatch
from ..fleet.view import FleetView
from ..telemetry.episodes import Episode
from ..telemetry.memtrace import ENV, install_from_env
from ..telemetry.metrics import POD_REFUSED
from .compat import models_a_caller_may_call
from .host_strategy import LoraAffinityStrategy, install, installed_strategy, logger
from .pooling import warn_if_litellm_outlives_server_keepalive


class LogFormatter(logging.Formatter):
    """Plain timestamped lines, or one JSON object per record while LiteLLM logs JSON (`json_logs: true` in
    `litellm_settings`, or `JSON_LOGS`): decided per record, since the proxy applies its settings after the
    callbacks are built."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(name)s %(levelname)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if not (getattr(litellm, "json_logs", False) or os.environ.get("JSON_LOGS", "").lower() in ("1", "true")):
            return super().format(record)
        body = {"message": record.getMessage(), "level": record.levelname, "logger": record.name,
                "timestamp": datetime.fromtimestamp(record.created).isoformat()}
        if record.exc_info:
            body["stacktrace"] = self.formatException(record.exc_info)
        return json.dumps(body, default=str)


def _configure_logging() -> None:
    """Inside the proxy our records get their own handler (the host's filters by level)."""
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(LogFormatter())
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(os.environ.get("LORA_AFFINITY_LOG_LEVEL", "INFO").upper())


class ProxyPlugin(CustomLogger):
    """Listed in `litellm_settings.callbacks`; installs the strategy on the proxy's router and keeps it.

    The proxy offers no start-up hook that hands a callback the router, and drops a custom strategy
    when its settings change or the router is rebuilt: so a watcher re-installs it, and every
    request's pre-call hook checks once more.

    It also keeps the in-flight counts: up when LiteLLM sends a call to a deployment, down once from
    whichever ending hook fires first (which fire in which case: docs/litellm-integration-notes). The
    proxy only calls hooks defined on the registered class itself, so they are all defined here.
    """

    WATCH_INTERVAL_S = 0.2
    """How often the watcher looks while the proxy starts (its router and routes appear during start-up)."""
    SETTLED_WATCH_INTERVAL_S = 1.0
    """Once installed: a router rebuilt since is caught by the next request's pre-call hook as well, so an idle
    proxy need not wake five times a second for it."""

    def __init__(self) -> None:
        super().__init__()
        _configure_logging()
        if install_from_env():
            logger.info("tracemalloc on: SIGUSR1 writes a snapshot (%s)", ENV)
        self._settings: Settings | None = None
        self._fleet: FleetView | None = None
        self._scraper_task: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._strategy: LoraAffinityStrategy | None = None
        self._listing_installed = False
        self._refused_routers: weakref.WeakSet[Any] = weakref.WeakSet()
        """Routers that did not keep the strategy (a LiteLLM internal moved): left to LiteLLM, not retried."""
        self._bad_config: tuple[str, float] | None = None
        """(path, modification time) of a config whose `lora_affinity:` section was refused: read again on change."""
        self._next_config_check = 0.0
        self._watch_failing = Episode(logger, "lora-affinity could not install its routing strategy")
        self._counting_failing = Episode(logger, "lora-affinity could not keep a request's in-flight count")
        try:
            self._watcher = asyncio.get_running_loop().create_task(self._watch(), name="lora-affinity-install")
        except RuntimeError:
            pass  # imported outside the proxy's loop: the first request installs it

    def settings(self) -> Settings | None:
        """The plugin's settings from the proxy's config file, read once; None while the file's `lora_affinity:`
        section is invalid (said once; the file is read again only when it changes, never per request)."""
        if self._settings is None:
            from litellm.proxy import proxy_server

            path = getattr(proxy_server, "user_config_file_path", None)
            if self._bad_config is not None and time.monotonic() < self._next_config_check:
                return None  # a refused file is looked at (stat, not read) at most once a second
            self._next_config_check = time.monotonic() + 1.0
            changed_at = _modified(path) if path else 0.0
            if self._bad_config is not None and self._bad_config == (path, changed_at):
                return None
            try:
                config = load_config(path) if path else {}
                settings = settings_from_config(config)
            except (SettingsError, OSError, ValueError) as exc:
                self._bad_config = (path, changed_at)
                logger.error("lora-affinity is not routing: %s: %s; LiteLLM routes every request until the file "
                             "changes", path, exc)
                return None
            self._bad_config = None
            self._settings = settings
            self._fleet = FleetView(self._settings)
            if self._settings.embedded_scraper:
                self._start_embedded_scraper(config)
        return self._settings

    def _start_embedded_scraper(self, config: dict) -> None:
        from ..scraping.worker import Scraper

        scraper = Scraper.for_config(self._settings, config.get("model_list") or [])
        self._scraper_task = asyncio.get_running_loop().create_task(scraper.run())

    def ensure_installed(self) -> LoraAffinityStrategy | None:
        from litellm.proxy import proxy_server

        router = getattr(proxy_server, "llm_router", None)
        if router is None or router in self._refused_routers:
            return None
        strategy = installed_strategy(router)
        if strategy is None:
            settings = self.settings()
            if settings is None:
                return None
            previous = self._strategy
            if previous is not None:
                previous.stop()  # the router was rebuilt or reset: one refresher at a time, one pool
            try:
                strategy = install(router, settings, fleet=self._fleet, hooks_end_calls=True,
                                   pools=previous.pools if previous is not None else None)
                kept = installed_strategy(router) is strategy
            except Exception as exc:
                strategy, kept, reason = None, False, f"{type(exc).__name__}: {exc}"
            else:
                reason = "the router does not hold a custom routing strategy where this release's plugin API puts it"
            if not kept:
                return self._refuse(router, strategy, reason)
            self._strategy = strategy
            logger.info("lora-affinity routing installed on the proxy's router (Redis %s)",
                        settings.redacted_redis_url())
            warn_if_litellm_outlives_server_keepalive()
        if not self._listing_installed:  # the proxy adds its routes during start-up: look until they are there
            app = getattr(proxy_server, "app", None)
            if app is not None and install_listing(app, self._served_models, self._callable_by):
                self._listing_installed = True
                logger.info("lora-affinity adds the fleet's models to /v1/models")
        return strategy

    def _refuse(self, router: Any, strategy: LoraAffinityStrategy | None, reason: str) -> None:
        """A LiteLLM internal the plugin needs has moved: say so once, leave the router to LiteLLM, stop trying
        (reinstalling every watch would open a new refresher and Redis connection each time)."""
        if strategy is not None:
            strategy.stop()
        self._refused_routers.add(router)
        logger.error("lora-affinity cannot route on LiteLLM %s (%s); LiteLLM's own routing serves every request. "
                     "Supported releases: docs/using.md, Compatibility", _litellm_release(), reason)
        return None

    def _served_models(self) -> frozenset[str]:
        strategy = self._strategy
        if strategy is None or strategy.follower is None or not strategy.settings.list_served_models:
            return frozenset()
        return strategy.follower.served_models

    async def _callable_by(self, scope: dict, names: frozenset[str]) -> list[str]:
        router = self._strategy.router if self._strategy is not None else None
        return await models_a_caller_may_call(scope, names, router) if router is not None else []

    async def _watch(self) -> None:
        while True:
            self._install_quietly()
            settled = self._strategy is not None and self._listing_installed
            await asyncio.sleep(self.SETTLED_WATCH_INTERVAL_S if settled else self.WATCH_INTERVAL_S)

    def _install_quietly(self) -> None:
        """`ensure_installed`, its failures logged once per episode (it runs every watch and every request)."""
        try:
            self.ensure_installed()
        except Exception as exc:
            self._watch_failing.fail(f"{type(exc).__name__}: {exc}", exc_info=exc)
        else:
            self._watch_failing.recover()

    async def async_pre_call_hook(self, user_api_key_dict, cache, data, call_type):
        self._install_quietly()
        return data

    # --- in-flight accounting: one count per call id, ended exactly once ----------------------------
    async def async_pre_call_deployment_hook(self, kwargs, call_type):
        strategy = self._strategy
        if strategy is None:
            return None
        try:
            call_id = kwargs.get("litellm_call_id")
            if call_id:
                pod = strategy.pod_of(kwargs)
                if pod is not None:
                    strategy.fleet.note_dispatch(pod, None, time.time(), call_id)
        except Exception as exc:
            self._counting_failing.fail(f"counting: {type(exc).__name__}: {exc}", exc_info=exc)
        else:
            self._counting_failing.recover()
        client = strategy.pooled_client(kwargs, call_type)
        if client is None:
            return None
        kwargs["client"] = client
        return kwargs

    async def async_post_call_success_deployment_hook(self, request_data, response, call_type):
        if not request_data.get("stream"):  # a stream has only started here; its iterator ends it
            ended = self._end_call(request_data, "success")
            self._served(ended)
            self._learn_prompt(ended, response)
        return None

    async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):
        self._served(self._end_call(kwargs, "success log"))

    def _served(self, ended: Dispatch | None) -> None:
        """A pod answered: the adapter it was asked for is a real one (`FleetView.confirm`)."""
        if ended is not None and self._fleet is not None:
            self._fleet.confirm(ended)

    async def async_log_failure_event(self, kwargs, response_obj, start_time, end_time):
        ended = self._end_call(kwargs, "failure log")
        try:
            if _could_not_connect(kwargs.get("exception")):
                self._pod_refused(ended.pod if ended is not None else None, kwargs)
        except Exception as exc:
            self._counting_failing.fail(f"a refused connection: {type(exc).__name__}: {exc}", exc_info=exc)

    async def async_post_call_response_headers_hook(self, data, user_api_key_dict, response, request_headers=None,
                                                     litellm_call_info=None):
        """`response_headers`: where the rules sent the call and why, on its response (None: nothing to add)."""
        try:
            reason = self._strategy.take_reason(data.get("litellm_call_id")) if self._strategy and data else None
        except Exception:  # a header is never worth a failed response
            return None
        if reason is None:
            return None
        pod, branch = reason
        return {"x-lora-affinity-pod": pod, "x-lora-affinity-reason": branch}

    async def async_post_call_failure_hook(self, request_data, original_exception, user_api_key_dict,
                                           traceback_str=None):
        self._end_call(request_data, "failure")
        return None

    async def async_post_call_streaming_iterator_hook(self, user_api_key_dict, response, request_data):
        last, finished = None, False
        try:
            async for chunk in response:
                last = chunk
                yield chunk
            finished = True
        finally:  # end of stream, upstream error or the client leaving (CancelledError/GeneratorExit)
            ended = self._end_call(request_data, "stream end")
            if _asked_usage(request_data):  # its last chunk has the engine's `usage` (else none, or LiteLLM's guess)
                self._learn_prompt(ended, last)
            if not finished:
                await _close_upstream(response)

    def _learn_prompt(self, ended: Dispatch | None, response: Any) -> None:
        """The engine's count of the prompt's tokens (`usage.prompt_tokens`), where the answer has one: the pod's
        characters a token learn from it (`FleetView.learn_prompt`)."""
        if ended is None or self._fleet is None or response is None:
            return
        try:
            usage = response.get("usage") if isinstance(response, dict) else getattr(response, "usage", None)
            tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else getattr(usage, "prompt_tokens", None)
            if tokens is not None:
                self._fleet.learn_prompt(ended, tokens)
        except Exception as exc:  # a count is never worth a failed response
            self._counting_failing.fail(f"a prompt's token count: {type(exc).__name__}: {exc}", exc_info=exc)

    def _end_call(self, data: Mapping[str, Any] | None, via: str) -> Dispatch | None:
        try:
            call_id = data.get("litellm_call_id") if data else None
            if call_id and self._fleet is not None:
                ended = self._fleet.end(call_id)
                if ended is not None and logger.isEnabledFor(logging.DEBUG):
                    logger.debug("call %s on %s ended (%s)", call_id, ended.pod, via)
                return ended
        except Exception as exc:
            self._counting_failing.fail(f"ending: {type(exc).__name__}: {exc}", exc_info=exc)
        return None

    def _pod_refused(self, pod: str | None, kwargs: Mapping[str, Any]) -> None:
        """A dead pod is out of routing at its first refused connection (LiteLLM retries that request
        elsewhere), not only once its metrics go stale: the scraper's next page brings it back."""
        if pod is None and self._strategy is not None:
            pod = self._strategy.pod_of(kwargs)
        if pod is None or self._fleet is None:
            return
        POD_REFUSED.labels(pod).inc()
        if self._fleet.refused(pod, time.time()):
            logger.warning("%s refused a connection: no requests go there until a scrape reads it again", pod)
        else:
            logger.debug("%s refused a connection (already out of routing)", pod)


def _modified(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return -1.0


def _asked_usage(request_data: Any) -> bool:
    options = request_data.get("stream_options") if isinstance(request_data, dict) else None
    return isinstance(options, dict) and options.get("include_usage") is True


_INNER_STREAM = ("inner", "completion_stream")
"""Where LiteLLM's stream wrappers keep the stream they wrap (the router's hidden-params wrapper; the text-completion
and chat wrappers)."""


def _streams_below(stream: Any, most: int = 8) -> list[Any]:
    """`stream` and the streams it reads from, outer first: what its wrappers keep (`_INNER_STREAM`) and, for an
    async generator, the async iterators its suspended frame is reading (a generator closed early does not close
    the iterator of its `async for`)."""
    found: list[Any] = []
    queue, seen = [stream], set()
    while queue and len(seen) < most:
        current = queue.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        found.append(current)
        queue.extend(getattr(current, name, None) for name in _INNER_STREAM)
        frame = getattr(current, "ag_frame", None)
        if frame is not None:
            queue.extend(value for value in frame.f_locals.values() if hasattr(value, "__anext__"))
    return found


async def _close_upstream(stream: Any) -> None:
    """Close the engine's stream of a response the client left, so the engine aborts its generation now.

    On a hang-up LiteLLM closes what it relays through the outer stream's `aclose`, and expects each wrapper to
    close what it wraps. On 1.110 a text completion's chain breaks twice: the text-completion wrapper has no
    `aclose`, and the router replaces the stream it wraps with an async generator reading it, which does not close
    it. The engine's stream stayed open until the objects holding it were freed, at times a minute or more later,
    and the engine generated on for no one (`bench-tools/hangups.py`). So every stream below is closed, outer first.
    Closing is idempotent: what LiteLLM closes again afterwards (a chat's wrapper) finds it closed."""
    try:
        closers = [aclose for s in _streams_below(stream) if callable(aclose := getattr(s, "aclose", None))]
    except Exception as exc:  # a wrapper that refuses to be looked into: LiteLLM's own close still runs
        logger.debug("reading a stream the client left raised %s", type(exc).__name__)
        return
    for aclose in closers:
        try:
            with anyio.CancelScope(shield=True):  # a cancelled task's await would be cancelled too, and leave it open
                await aclose()
        except Exception as exc:  # a stream that fails to close is LiteLLM's to log; never the plugin's error
            logger.debug("closing a stream the client left raised %s", type(exc).__name__)


def _litellm_release() -> str:
    try:
        from importlib.metadata import version

        return version("litellm")
    except Exception:
        return "(release unknown)"


def _could_not_connect(exc: BaseException | None) -> bool:
    """LiteLLM wraps transport errors (as InternalServerError, APIConnectionError...): look down the chain
    for the one that says no connection was made, so a pod's HTTP errors or timeouts do not count."""
    for _ in range(12):
        if exc is None:
            return False
        if isinstance(exc, (httpx.ConnectError, ConnectionRefusedError)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


proxy_plugin = ProxyPlugin()
