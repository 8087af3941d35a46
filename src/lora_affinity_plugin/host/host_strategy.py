"""The thin adapter to LiteLLM: the custom routing strategy (`strategy.py` is the entry point that names it).

One request's path: LiteLLM's router calls `LoraAffinityStrategy.async_get_available_deployment`;
it asks the router for the healthy deployments once (so cooldowns still apply), maps each to a pod,
builds candidates from the in-process `FleetView` (no Redis on the request path), and lets
`scheduling.choose_pod` pick. A model group with no proven pod (`PodRecord.proven`: hosted providers,
deployments the operator marked out) is LiteLLM's, untouched. When the plugin cannot decide for a group
it routes (no fresh metrics, a bug), LiteLLM's own pick decides, and the episode is logged once.

Proxy users name the callback that installs it (`proxy_callback.py`) through `strategy.py`; Python users call
`install(router, settings)`.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import operator
import random
import time
import weakref
from collections import OrderedDict
from typing import Any, Mapping, NamedTuple

import litellm
from litellm.integrations.custom_logger import CustomLogger
from litellm.types.router import CustomRoutingStrategyBase

from ..config.settings import Settings, build_settings
from ..fleet.follower import Follower
from ..fleet.pods import (
    deployment_adapter,
    deployment_pod,
    discover_pods,
    is_wildcard,
    pod_marks,
)
from ..fleet.request_builder import RequestBuilder
from ..fleet.view import FleetView
from ..routing.placement import prefill_estimate_s
from ..routing.scheduling import NoCapacity, Shed, choose_pod
from ..routing.ttft import predictions
from ..telemetry.episodes import Episode
from ..telemetry.metrics import (
    DECISION_SECONDS,
    DECISIONS,
    FALLBACKS,
    NO_CAPACITY,
    SHADOW,
    SHADOW_GAIN,
    SHEDS,
)
from .compat import (
    healthy_deployments,
    host_pick,
    host_pick_sync,
    model_list,
    register_strategy,
    registered_strategy,
)
from .pooling import POOLED_PROVIDERS, PooledClients, provider_of

logger = logging.getLogger("lora_affinity")
_TRIED_CALLS = 4096
_NAMES_CACHED = 4096
"""Requested model names remembered (wildcards let callers send any name): the oldest go first."""


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
        self._reasons: OrderedDict[str, tuple[str, str]] = OrderedDict()
        """Per call, its last decision's (pod, branch) until its response headers are written (`response_headers`)."""
        self._shed_calls: OrderedDict[str, None] = OrderedDict()
        """Calls already counted as shed: LiteLLM retries a 429, and a client sees one."""
        self.follower: Follower | None = None
        self.fleet = fleet or FleetView(settings)
        self.requests = RequestBuilder()
        self.rng = rng or random.Random()
        self._index = _DeploymentIndex()
        self.pools = PooledClients()
        self._fallbacks: OrderedDict[str, Episode] = OrderedDict()
        """One episode per model group: a broken group and a healthy one do not make each other's log flap."""
        self._decision_counters: dict[tuple[str, str], Any] = {}
        self._refresher: asyncio.Task | None = None
        self.decisions = 0
        self.fallbacks = 0
        self.stopped = False
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
        return await self._route(model, messages, input, specific_deployment,
                                 request_kwargs if request_kwargs is not None else {})

    async def _route(self, model: str, messages, input, specific_deployment, request_kwargs: dict) -> dict:
        if self.stopped or not self._manages(model) or not self._group_settings(model).enabled:
            return await host_pick(self.router, model, messages, input, specific_deployment, request_kwargs)
        healthy = await healthy_deployments(self.router, model, request_kwargs, messages, input, specific_deployment)
        if isinstance(healthy, dict):
            return healthy
        if self._group_settings(model).shadow:  # LiteLLM routes; the plugin decides beside it and counts
            served = await host_pick(self.router, model, messages, input, specific_deployment, request_kwargs)
            self.shadow(model, healthy, request_kwargs, messages, served)
            return served
        chosen = self.pick(model, healthy, request_kwargs, messages)
        if chosen is None:  # the plugin could not decide: LiteLLM's own pick, as without the plugin
            return await host_pick(self.router, model, messages, input, specific_deployment, request_kwargs)
        return chosen

    def get_available_deployment(self, model: str, messages=None, input=None, specific_deployment=False,
                                 request_kwargs=None):
        # The sync path (router.completion) has no event loop to keep metrics fresh: LiteLLM routes it.
        return host_pick_sync(self.router, model, messages, input, specific_deployment, request_kwargs)

    # --- the decision --------------------------------------------------------------------------
    def pick(self, model: str, healthy: list[dict], request_kwargs: Mapping[str, Any],
             messages: Any = None) -> dict | None:
        """Choose one of `healthy`; raises litellm's 429/503 errors; None when the plugin cannot decide (no
        fresh metrics, or any failure of its own): the caller hands the request to LiteLLM's pick."""
        if not healthy:
            raise litellm.ServiceUnavailableError(
                message=f"lora-affinity: no healthy deployment for model {model!r}", llm_provider="", model=model)
        started = time.perf_counter()
        try:
            deployment = self._choose(model, healthy, request_kwargs, messages)
        except Shed as exc:
            if self._first_shed(request_kwargs.get("litellm_call_id")):
                SHEDS.labels(self._criticality(model, request_kwargs), _group(model, healthy)).inc()
            raise litellm.RateLimitError(message=f"lora-affinity: {exc}", llm_provider="", model=model) from None
        except NoCapacity as exc:
            NO_CAPACITY.labels(self._criticality(model, request_kwargs), _group(model, healthy)).inc()
            raise litellm.ServiceUnavailableError(message=f"lora-affinity: {exc}", llm_provider="", model=model) from None
        except Exception as exc:  # a plugin bug must never fail a request; its traceback once per episode
            self._fallback(_group(model, healthy)).fail(f"decision failed: {type(exc).__name__}: {exc}", exc_info=exc)
            FALLBACKS.labels("error").inc()
            deployment = None
        DECISION_SECONDS.observe(time.perf_counter() - started)
        if deployment is None:
            self.fallbacks += 1
            return None
        episode = self._fallbacks.get(_group(model, healthy))
        if episode is not None:
            episode.recover()
        return deployment

    def shadow(self, model: str, healthy: list[dict], request_kwargs: Mapping[str, Any], messages: Any,
               served: dict) -> None:
        """Shadow mode: the plugin's decision for a request LiteLLM routed to `served`, counted, never acted on;
        the dispatch is accounted to the pod that serves it. Nothing here can fail the request."""
        group = _group(model, healthy)
        try:
            served_pod = next(iter(self._index.pods_of([served]).positions), None)
            if served_pod is None:  # (LiteLLM chose a deployment that is no pod: nothing to compare)
                return
            decided = self._choose(model, healthy, request_kwargs, messages, serve=served_pod)
        except Shed:
            SHADOW.labels("shed", group).inc()
            return
        except Exception as exc:
            self._fallback(group).fail(f"shadow decision failed: {type(exc).__name__}: {exc}", exc_info=exc)
            return
        if decided is not None:
            pod, gain = decided
            SHADOW.labels("yes" if pod == served_pod else "no", group).inc()
            if gain is not None:
                SHADOW_GAIN.observe(gain)

    def _first_shed(self, call_id: Any) -> bool:
        """Whether this call's 429 is its first (its retries are the same request to the client)."""
        if not isinstance(call_id, str):
            return True
        if call_id in self._shed_calls:
            return False
        self._shed_calls[call_id] = None
        if len(self._shed_calls) > _TRIED_CALLS:
            self._shed_calls.popitem(last=False)
        return True

    def _choose(self, model: str, healthy: list[dict], request_kwargs: Mapping[str, Any], messages: Any,
                serve: str | None = None) -> Any:
        """The rules' pick among `healthy`, its dispatch accounted; None when they cannot decide. `serve` (shadow
        mode): the pod LiteLLM chose serves the request, and its dispatch is accounted instead; returns the
        rules' pod and how much sooner it was predicted to start than `serve` (None: not comparable)."""
        pods = self._index.pods_of(healthy)
        now = time.time()
        candidates = self.fleet.candidates(pods.keys, now)
        call_id = request_kwargs.get("litellm_call_id")
        tried = self._tried.get(call_id) if call_id else None
        if tried:  # a retry: LiteLLM offers the pod that just failed again; go elsewhere if we can
            candidates = [c for c in candidates if c.key not in tried] or candidates
        if not candidates:
            self._fallback(_group(model, healthy)).fail("no fresh metrics for its healthy deployments")
            FALLBACKS.labels("no_metrics").inc()
            return None
        first = healthy[pods.positions[candidates[0].key]]
        adapter: str | None = deployment_adapter(first, model, self.settings.adapter_info_key)
        if adapter in self.fleet.model_names(candidates[0].key):
            adapter = None  # the base model: no LoRA rule applies
        settings = self._group_settings(model)
        request = self.requests.build(self.fleet, adapter, adapter or model, messages, request_kwargs, pods.positions,
                                      settings, self._sheddable(model, request_kwargs), model=model, now=now)
        decision = choose_pod(candidates, request, settings, self.rng)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("call %s: %s -> %s (%s) among %s, prefix %d blocks, matches %s", call_id, adapter,
                         decision.pod, decision.branch,
                         [(c.key, c.waiting, c.running, sorted(c.active_adapters)) for c in candidates],
                         request.prefix_blocks, request.prefix_matches)
        gain = None
        if serve is not None:
            served = next((c for c in candidates if c.key == serve), None)
            chosen = next(c for c in candidates if c.key == decision.pod)
            if served is not None:
                predicted = predictions(candidates, request, settings)
                gain = predicted[served.key].ttft_s - predicted[chosen.key].ttft_s
            rules_pod, decision.pod = decision.pod, serve  # what follows accounts the pod that serves it
        self.fleet.note_dispatch(decision.pod, adapter, now, call_id if self.hooks_end_calls else None,
                                 request.prefix_blocks)
        if request.prefix_hashes and decision.pod in pods.positions:
            chosen = next((c for c in candidates if c.key == decision.pod), None)
            prefill_s = prefill_estimate_s(chosen, request, settings) if chosen is not None else 0.0
            self.fleet.note_prefix(decision.pod, request.prefix_hashes, now, prefill_s)
        if call_id:
            tried_pods = self._tried.get(call_id, ())
            if decision.pod not in tried_pods:  # a tuple: most calls are tried once (a set costs 216 bytes)
                self._tried[call_id] = (*tried_pods, decision.pod)
            self._tried.move_to_end(call_id)
            if len(self._tried) > _TRIED_CALLS:
                self._tried.popitem(last=False)
        self.decisions += 1
        self._decision_counter(decision.branch, _group(model, healthy)).inc()
        if serve is not None:
            return rules_pod, gain
        if call_id and settings.response_headers:
            self._reasons[call_id] = (decision.pod, decision.branch)  # (a retry's decision replaces the first)
            if len(self._reasons) > _TRIED_CALLS:
                self._reasons.popitem(last=False)
        return healthy[pods.positions[decision.pod]]

    def take_reason(self, call_id: str | None) -> tuple[str, str] | None:
        """Where the call went and the decision's branch (`response_headers`), once; None: not routed by the rules."""
        return self._reasons.pop(call_id, None) if call_id else None

    def pooled_client(self, call_kwargs: Mapping[str, Any], call_type: Any) -> Any | None:
        """A pooled client for a text completion to a pod this strategy routes; None leaves the call to LiteLLM.

        Called from LiteLLM's pre-call deployment hook, with the call's final timeout and credentials.
        """
        if not self.settings.pooled_clients or str(getattr(call_type, "value", call_type)) != "atext_completion":
            return None
        info = call_kwargs.get("model_info")
        model_id = info.get("id") if isinstance(info, Mapping) else None
        if not isinstance(model_id, str) or model_id not in self._index.pods_by_id:
            return None  # a deployment the plugin does not route: LiteLLM's, untouched
        if provider_of(call_kwargs) not in POOLED_PROVIDERS:
            return None
        return self.pools.client_for(call_kwargs)  # never raises: LiteLLM's own client on any failure

    def pod_of(self, call_kwargs: Mapping[str, Any]) -> str | None:
        """The pod a call's kwargs (as LiteLLM's deployment hooks see them) are sent to."""
        info = call_kwargs.get("model_info") or {}
        pod = self._index.pods_by_id.get(info.get("id")) if isinstance(info, Mapping) else None
        if pod is None:
            params = call_kwargs.get("litellm_params") or {"api_base": call_kwargs.get("api_base")}
            pod = deployment_pod({"litellm_params": params})
        return pod

    def _decision_counter(self, branch: str, group: str) -> Any:
        """The labelled child of DECISIONS (kept: looking it up costs more than the rest of counting)."""
        counter = self._decision_counters.get((branch, group))
        if counter is None:
            if len(self._decision_counters) >= _NAMES_CACHED:
                self._decision_counters.clear()
            counter = self._decision_counters[branch, group] = DECISIONS.labels(branch, group)
        return counter

    def _fallback(self, model: str) -> Episode:
        episode = self._fallbacks.get(model)
        if episode is None:
            episode = self._fallbacks[model] = Episode(
                logger, f"routing by metrics unavailable for {model!r}, LiteLLM's own pick decides")
            if len(self._fallbacks) > _NAMES_CACHED:
                self._fallbacks.popitem(last=False)
        return episode

    def _group_settings(self, model: str) -> Settings:
        if model not in self.settings.model_group_overrides:
            return self.settings
        cached = self._per_group.get(model)
        if cached is None:
            cached = self._per_group[model] = self.settings.for_group(model)
        return cached

    def _criticality(self, model: str, request_kwargs: Mapping[str, Any]) -> str:
        return "sheddable" if self._sheddable(model, request_kwargs) else "critical"

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
        """A model group is ours when one of its deployments is a proven pod (its page parsed as a model
        server's, or the operator marked it); a group of hosted providers stays LiteLLM's, as without the plugin."""
        pods = self._index.pods_for_model(model_list(self.router), model)
        return self.fleet.manages(pods) or self._index.marked(pods)

    # --- background: keep the fleet view fresh -------------------------------------------------
    def ensure_refresher(self) -> None:
        if self.stopped:
            return
        if self._refresher is None or self._refresher.done():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._refresher = loop.create_task(self._follow_redis(), name="lora-affinity-refresh")

    async def _follow_redis(self) -> None:
        self.follower = Follower(self.base_settings, self.fleet, lambda: discover_pods(model_list(self.router)),
                                 self.apply_settings)
        await self.follower.run()

    def apply_settings(self, settings: Settings) -> None:
        """Live settings take effect for the next decision; the rules read them per call."""
        self.settings = settings
        self._per_group = {}
        self.fleet.settings = settings

    def stop(self) -> None:
        """Stop refreshing, for good; the pool stays open for the calls still using it (the next strategy reuses
        it). A stopped strategy that still gets requests hands them to LiteLLM's own pick."""
        self.stopped = True
        if self._refresher is not None:
            self._refresher.cancel()


def _group(model: str, healthy: list[dict]) -> str:
    """The model group a request falls in: its deployments' `model_name` (a wildcard's is its pattern)."""
    return str(healthy[0].get("model_name") or model) if healthy else model


_MODEL_INFO = operator.itemgetter("model_info")
_ID = operator.itemgetter("id")


class _Pods(NamedTuple):
    keys: tuple[str, ...]
    """Each pod once, in the order of its first deployment."""
    positions: dict[str, int]
    """pod -> where its first deployment is in the list."""


class _DeploymentIndex:
    """Caches deployment -> pod and model name -> pods; rebuilt when the router's model list changes."""

    def __init__(self) -> None:
        self.pods_by_id: dict[str, str] = {}
        """model_info.id -> pod (the router hands out copies of its deployment dicts)."""
        self._pods_by_model: OrderedDict[str, list[str]] = OrderedDict()
        self._pods_by_ids: dict[tuple[str, ...], _Pods] = {}
        """Deployment ids of a healthy list -> its pods (`pods_of`)."""
        self._list_id: tuple[int, int] = (0, 0)
        self._marks: dict[str, bool] = {}
        """pod -> the operator's `model_info.lora_affinity_pod`, for the current model list."""

    def pod(self, deployment: Mapping[str, Any]) -> str | None:
        pod = deployment_pod(deployment)
        dep_id = (deployment.get("model_info") or {}).get("id")
        if pod is not None and dep_id is not None:
            self.pods_by_id[dep_id] = pod
        return pod

    def pods_of(self, healthy: list[dict]) -> _Pods:
        """The pods of `healthy`, in order, and where each one's first deployment is in it. Runs for every
        request: kept per list of deployment ids (LiteLLM hands out a new list of the same deployments each
        time), so the common case reads the ids in C and looks them up once."""
        try:
            ids = tuple(map(_ID, map(_MODEL_INFO, healthy)))
            found = self._pods_by_ids.get(ids)
        except (KeyError, TypeError):  # a deployment without model_info.id, or an odd one
            return self._map(healthy)
        if found is None:
            found = self._map(healthy)
            if None not in ids:
                if len(self._pods_by_ids) >= _NAMES_CACHED:
                    self._pods_by_ids.clear()
                self._pods_by_ids[ids] = found
        return found

    def marked(self, pods: list[str]) -> bool:
        """Whether the operator marked one of `pods` a pod (`model_info.lora_affinity_pod: true`)."""
        return any(self._marks.get(pod) for pod in pods)

    def _map(self, healthy: list[dict]) -> _Pods:
        positions: dict[str, int] = {}
        for i, deployment in enumerate(healthy):
            pod = self.pod(deployment)
            if pod is not None and pod not in positions:
                positions[pod] = i
        return _Pods(tuple(positions), positions)

    def pods_for_model(self, model_list: list[dict], model: str) -> list[str]:
        list_id = (id(model_list), len(model_list))
        if list_id != self._list_id:
            self._pods_by_model.clear()
            self.pods_by_id.clear()
            self._pods_by_ids.clear()
            self._marks = pod_marks(model_list)
            self._list_id = list_id
        pods = self._pods_by_model.get(model)
        if pods is None:
            exact = [d for d in model_list if d.get("model_name") == model]
            matching = exact or [d for d in model_list if is_wildcard(d) and fnmatch.fnmatchcase(model, d["model_name"])]
            pods = self._pods_by_model[model] = [p for p in map(deployment_pod, matching)
                                                 if p and self._marks.get(p, True)]
            if len(self._pods_by_model) > _NAMES_CACHED:
                self._pods_by_model.popitem(last=False)
        return pods


def install(router: litellm.Router, settings: Settings | None = None, *, rng: random.Random | None = None,
            fleet: FleetView | None = None, hooks_end_calls: bool = False,
            pools: PooledClients | None = None) -> LoraAffinityStrategy:
    """Install the strategy on a `litellm.Router`; returns it. Call again after a router is rebuilt."""
    strategy = LoraAffinityStrategy(router, settings or build_settings({}), rng=rng, fleet=fleet,
                                    hooks_end_calls=hooks_end_calls)
    previous = installed_strategy(router)
    if previous is not None:
        previous.stop()
        pools = pools or previous.pools
    if pools is not None:
        strategy.pools = pools  # one pool per process: calls in flight keep their connections
    register_strategy(router, strategy)
    if not hooks_end_calls:  # a `litellm.Router` user: our hook hands routed text completions a pooled client
        _ROUTER_USER_HOOK.strategies[router] = strategy
        if _ROUTER_USER_HOOK not in litellm.callbacks:
            litellm.callbacks.append(_ROUTER_USER_HOOK)
    strategy.ensure_refresher()
    return strategy


class _RouterUserHook(CustomLogger):
    """For `install()` outside the proxy (whose callback does this itself): pooled clients per call."""

    def __init__(self) -> None:
        super().__init__()
        self.strategies: weakref.WeakKeyDictionary[Any, LoraAffinityStrategy] = weakref.WeakKeyDictionary()

    async def async_pre_call_deployment_hook(self, kwargs, call_type):
        for strategy in list(self.strategies.values()):
            client = strategy.pooled_client(kwargs, call_type)
            if client is not None:
                kwargs["client"] = client
                return kwargs
        return None


_ROUTER_USER_HOOK = _RouterUserHook()


def installed_strategy(router: Any) -> LoraAffinityStrategy | None:
    owner = registered_strategy(router)
    return owner if isinstance(owner, LoraAffinityStrategy) else None
