"""The thin adapter to LiteLLM: a custom routing strategy, and the callback that installs it.

One request's path: LiteLLM's router calls `LoraAffinityStrategy.async_get_available_deployment`;
it asks the router for the healthy deployments once (so cooldowns still apply), maps each to a pod,
builds candidates from the in-process `FleetView` (no Redis on the request path), and lets
`scheduling.choose_pod` pick. Any plugin failure falls back to a simple-shuffle pick.

Proxy users list one line in `config.yaml` (the callback lives in `proxy_callback.py`):
    litellm_settings:
      callbacks: ["lora_affinity_plugin.strategy.proxy_plugin"]
Python users call `install(router, settings)`.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import random
import time
from collections import OrderedDict
from typing import Any, Mapping

import litellm
from litellm.types.router import CustomRoutingStrategyBase

from .episodes import Episode
from .fleet import FleetView
from .follower import Follower
from .metrics import DECISION_SECONDS, DECISIONS, FALLBACKS, NO_CAPACITY, SHEDS
from .pods import deployment_adapter, deployment_pod, discover_pods, is_wildcard
from .pooling import PooledClients
from .scheduling import NoCapacity, Shed, choose_pod
from .settings import Settings, build_settings

logger = logging.getLogger("lora_affinity")
_TRIED_CALLS = 4096


class LoraAffinityStrategy(CustomRoutingStrategyBase):
    """Routes each request of a managed model group to the pod that should serve it."""

    def __init__(self, router: litellm.Router, settings: Settings, *, rng: random.Random | None = None,
                 fleet: FleetView | None = None, hooks_end_calls: bool = False) -> None:
        self.router = router
        self.base_settings = settings
        """The file and environment; live values from Redis are applied on top."""
        self.settings = settings
        self._per_group: dict[str, Settings] = {}
        self._tried: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        """Pods already chosen per litellm_call_id (the same across LiteLLM's retries of one request)."""
        self.follower: Follower | None = None
        self.fleet = fleet or FleetView(settings)
        self.rng = rng or random.Random()
        self._index = _DeploymentIndex()
        self.pools = PooledClients(settings.upstream_keepalive_ms)
        self._fallback = Episode(logger, "routing by metrics unavailable, picking like simple-shuffle")
        self._refresher: asyncio.Task | None = None
        self.decisions = 0
        self.fallbacks = 0
        self.hooks_end_calls = hooks_end_calls
        """True under `ProxyPlugin`, whose LiteLLM hooks end each call: then decisions count by call id."""

    # --- LiteLLM's interface -------------------------------------------------------------------
    async def async_get_available_deployment(
        self,
        model: str,
        messages: list[dict[str, str]] | None = None,
        input: str | list | None = None,
        specific_deployment: bool | None = False,
        request_kwargs: dict | None = None,
    ) -> dict:
        self.ensure_refresher()
        deployment = await self._route(model, messages, input, specific_deployment,
                                       request_kwargs if request_kwargs is not None else {})
        if self.settings.pooled_clients:
            self.pools.ensure(self.router, deployment)
        return deployment

    async def _route(self, model: str, messages, input, specific_deployment, request_kwargs: dict) -> dict:
        if not self._manages(model):
            return await type(self.router).async_get_available_deployment(
                self.router, model=model, messages=messages, input=input,
                specific_deployment=specific_deployment, request_kwargs=request_kwargs,
            )
        healthy = await self.router.async_get_healthy_deployments(
            model=model, request_kwargs=request_kwargs, messages=messages, input=input,
            specific_deployment=specific_deployment,
        )
        if isinstance(healthy, dict):
            return healthy
        return self.pick(model, healthy, request_kwargs, messages)

    def get_available_deployment(self, model: str, messages=None, input=None, specific_deployment=False,
                                 request_kwargs=None):
        # The sync path (router.completion) has no event loop to keep metrics fresh: LiteLLM routes it.
        return type(self.router).get_available_deployment(
            self.router, model=model, messages=messages, input=input,
            specific_deployment=specific_deployment, request_kwargs=request_kwargs,
        )

    # --- the decision --------------------------------------------------------------------------
    def pick(self, model: str, healthy: list[dict], request_kwargs: Mapping[str, Any], messages: Any = None) -> dict:
        """Choose one of `healthy`; raises litellm's 429/503 errors, falls back on anything else."""
        if not healthy:
            raise litellm.ServiceUnavailableError(
                message=f"lora-affinity: no healthy deployment for model {model!r}", llm_provider="", model=model)
        started = time.perf_counter()
        try:
            deployment = self._choose(model, healthy, request_kwargs, messages)
        except Shed as exc:
            SHEDS.inc()
            raise litellm.RateLimitError(message=f"lora-affinity: {exc}", llm_provider="", model=model) from None
        except NoCapacity as exc:
            NO_CAPACITY.inc()
            raise litellm.ServiceUnavailableError(message=f"lora-affinity: {exc}", llm_provider="", model=model) from None
        except Exception as exc:  # a plugin bug must never fail a request
            logger.exception("lora-affinity decision failed; falling back")
            self._fallback.fail(f"{type(exc).__name__}")
            FALLBACKS.labels("error").inc()
            deployment = None
        DECISION_SECONDS.observe(time.perf_counter() - started)
        if deployment is None:
            self.fallbacks += 1
            return healthy[self.rng.randrange(len(healthy))]
        self._fallback.recover()
        return deployment

    def _choose(self, model: str, healthy: list[dict], request_kwargs: Mapping[str, Any], messages: Any) -> dict | None:
        by_pod: dict[str, dict] = {}
        known = self._index.pods_by_id
        for deployment in healthy:
            info = deployment.get("model_info")
            pod = known.get(info.get("id")) if info else None
            if pod is None:
                pod = self._index.pod(deployment)
            if pod is not None and pod not in by_pod:
                by_pod[pod] = deployment
        now = time.time()
        candidates = self.fleet.candidates(list(by_pod), now)
        call_id = request_kwargs.get("litellm_call_id")
        tried = self._tried.get(call_id) if call_id else None
        if tried:  # a retry: LiteLLM offers the pod that just failed again; go elsewhere if we can
            candidates = [c for c in candidates if c.key not in tried] or candidates
        if not candidates:
            self._fallback.fail("no fresh metrics for the healthy deployments of " + repr(model))
            FALLBACKS.labels("no_metrics").inc()
            return None
        first = by_pod[candidates[0].key]
        adapter: str | None = deployment_adapter(first, model, self.settings.adapter_info_key)
        if adapter in self.fleet.model_names(candidates[0].key):
            adapter = None  # the base model: no LoRA rule applies
        settings = self._group_settings(model)
        request = self.fleet.route_request(adapter, adapter or model, messages, request_kwargs, by_pod, settings,
                                           self._sheddable(model, request_kwargs))
        decision = choose_pod(candidates, request, settings, self.rng)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s -> %s (%s) among %s, prefix %d blocks, matches %s", adapter, decision.pod,
                         decision.branch, [(c.key, c.waiting, c.running, sorted(c.active_adapters)) for c in candidates],
                         request.prefix_blocks, request.prefix_matches)
        self.fleet.note_dispatch(decision.pod, adapter, now, call_id if self.hooks_end_calls else None)
        if request.prefix_hashes:
            self.fleet.note_prefix(decision.pod, request.prefix_hashes, now)
        if call_id:
            tried_pods = self._tried.get(call_id, ())
            if decision.pod not in tried_pods:  # a tuple: most calls are tried once (a set costs 216 bytes)
                self._tried[call_id] = (*tried_pods, decision.pod)
            self._tried.move_to_end(call_id)
            if len(self._tried) > _TRIED_CALLS:
                self._tried.popitem(last=False)
        self.decisions += 1
        DECISIONS.labels(decision.branch).inc()
        return by_pod[decision.pod]

    def pod_of(self, call_kwargs: Mapping[str, Any]) -> str | None:
        """The pod a call's kwargs (as LiteLLM's deployment hooks see them) are sent to."""
        info = call_kwargs.get("model_info") or {}
        pod = self._index.pods_by_id.get(info.get("id")) if isinstance(info, Mapping) else None
        if pod is None:
            params = call_kwargs.get("litellm_params") or {"api_base": call_kwargs.get("api_base")}
            pod = deployment_pod({"litellm_params": params})
        return pod

    def _group_settings(self, model: str) -> Settings:
        if model not in self.settings.model_group_overrides:
            return self.settings
        cached = self._per_group.get(model)
        if cached is None:
            cached = self._per_group[model] = self.settings.for_group(model)
        return cached

    def _sheddable(self, model: str, request_kwargs: Mapping[str, Any]) -> bool:
        if model in self.settings.sheddable_model_groups:
            return True
        for bucket_name in ("metadata", "litellm_metadata"):
            bucket = request_kwargs.get(bucket_name) or {}
            if str(bucket.get("criticality", "")).lower() == "sheddable":
                return True
            headers = bucket.get("headers") or {}
            if str(headers.get("x-criticality", "")).lower() == "sheddable":
                return True
        return False

    def _manages(self, model: str) -> bool:
        """A model group is ours when at least one of its deployments has pod metrics."""
        return self.fleet.knows(self._index.pods_for_model(self.router.model_list, model))

    # --- background: keep the fleet view fresh -------------------------------------------------
    def ensure_refresher(self) -> None:
        if self._refresher is None or self._refresher.done():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._refresher = loop.create_task(self._follow_redis(), name="lora-affinity-refresh")

    async def _follow_redis(self) -> None:
        self.follower = Follower(self.base_settings, self.fleet, lambda: discover_pods(self.router.model_list),
                                 self.apply_settings)
        await self.follower.run()

    def apply_settings(self, settings: Settings) -> None:
        """Live settings take effect for the next decision; the rules read them per call."""
        self.settings = settings
        self._per_group = {}
        self.fleet.settings = settings

    def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()


class _DeploymentIndex:
    """Caches deployment -> pod and model name -> pods; rebuilt when the router's model list changes."""

    def __init__(self) -> None:
        self.pods_by_id: dict[str, str] = {}
        """model_info.id -> pod (the router hands out copies of its deployment dicts)."""
        self._pods_by_model: dict[str, list[str]] = {}
        self._list_id: tuple[int, int] = (0, 0)

    def pod(self, deployment: Mapping[str, Any]) -> str | None:
        pod = deployment_pod(deployment)
        dep_id = (deployment.get("model_info") or {}).get("id")
        if pod is not None and dep_id is not None:
            self.pods_by_id[dep_id] = pod
        return pod

    def pods_for_model(self, model_list: list[dict], model: str) -> list[str]:
        list_id = (id(model_list), len(model_list))
        if list_id != self._list_id:
            self._pods_by_model.clear()
            self.pods_by_id.clear()
            self._list_id = list_id
        pods = self._pods_by_model.get(model)
        if pods is None:
            exact = [d for d in model_list if d.get("model_name") == model]
            matching = exact or [d for d in model_list if is_wildcard(d) and fnmatch.fnmatchcase(model, d["model_name"])]
            pods = self._pods_by_model[model] = [p for p in map(deployment_pod, matching) if p]
        return pods


def install(router: litellm.Router, settings: Settings | None = None, *, rng: random.Random | None = None,
            fleet: FleetView | None = None, hooks_end_calls: bool = False) -> LoraAffinityStrategy:
    """Install the strategy on a `litellm.Router`; returns it. Call again after a router is rebuilt."""
    strategy = LoraAffinityStrategy(router, settings or build_settings({}), rng=rng, fleet=fleet,
                                    hooks_end_calls=hooks_end_calls)
    router.set_custom_routing_strategy(strategy)
    strategy.ensure_refresher()
    return strategy


def installed_strategy(router: Any) -> LoraAffinityStrategy | None:
    bound = getattr(router, "__dict__", {}).get("async_get_available_deployment")
    owner = getattr(bound, "__self__", None)
    return owner if isinstance(owner, LoraAffinityStrategy) else None


def __getattr__(name: str) -> Any:
    """`lora_affinity_plugin.strategy.proxy_plugin`, the callback line users already have, still resolves."""
    if name in ("proxy_plugin", "ProxyPlugin"):
        from . import proxy_callback

        return getattr(proxy_callback, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
