"""The scheduling core: rules over a snapshot of pod metrics.

No I/O and no clocks: given the same candidates, request, settings and seeded RNG, a decision is
always the same. The LiteLLM adapter (`strategy.py`), the fast simulator and `explain` all call
`choose_pod` so that what is benchmarked is what serves traffic.

Two rule sets:
- ``gie-v0.2``: the Gateway API Inference Extension endpoint picker's v0.2 decision tree.
- ``lora-affinity`` (default): the same thresholds and shedding, but adapter placement that keeps
  few distinct adapters per replica, remembers resident adapters, and spills a hot adapter to a
  new replica only when its holders are clearly busier than the fleet.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

from .settings import Settings


@dataclass(frozen=True, slots=True)
class PodMetrics:
    """One pod's scraped state, named after vLLM's metrics."""

    num_requests_waiting: int = 0
    num_requests_running: int = 0
    kv_cache_usage: float = 0.0
    running_lora_adapters: frozenset[str] = frozenset()
    waiting_lora_adapters: frozenset[str] = frozenset()
    max_lora: int | None = None
    loaded_lora_adapters: frozenset[str] = frozenset()
    """Adapters in GPU slots, from `vllm:lora_adapter_loaded{level="gpu"}` when a server exposes it."""
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    model_names: frozenset[str] = frozenset()
    """Base models the server reports (`model_name` labels): a request for one of them uses no adapter."""
    engine: str = "vllm"
    """The model server whose metric names the page used (`engines.ENGINES`)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A pod as the rules see it: scraped metrics plus what this gateway sent since the scrape."""

    key: str
    waiting: int
    running: int
    kv_cache_usage: float
    active_adapters: frozenset[str]
    resident_adapters: frozenset[str] = frozenset()
    max_lora: int | None = None

    @property
    def load(self) -> int:
        return self.waiting + self.running

    def has_free_slot(self) -> bool:
        # max_lora unknown (None) or 0 (LoRA off, or an old server) never blocks placement.
        return not self.max_lora or len(self.active_adapters) < self.max_lora


@dataclass(frozen=True, slots=True)
class RouteRequest:
    adapter: str | None
    """None for a base-model request: the LoRA rules are skipped."""
    sheddable: bool = False


@dataclass(slots=True)
class Decision:
    pod: str
    branch: str
    trace: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)


class SchedulingError(Exception):
    status_code = 500


class Shed(SchedulingError):
    """Every pod is over the sheddable thresholds: HTTP 429."""

    status_code = 429


class NoCapacity(SchedulingError):
    """No candidate pod at all: HTTP 503."""

    status_code = 503


class _Run:
    """One decision in progress: applies fail-open filters and records them when explaining."""

    __slots__ = ("rng", "trace", "disabled", "width")

    def __init__(self, rng: random.Random, explain: bool, settings: Settings) -> None:
        self.rng = rng
        self.trace: list[tuple[str, tuple[str, ...]]] | None = [] if explain else None
        self.disabled = settings.disabled_rules
        self.width = settings.band_width

    def apply(self, name: str, pods: list[Candidate], kept: list[Candidate]) -> list[Candidate]:
        """Fail open: a filter that leaves nobody (or is disabled) passes its input on."""
        out = pods if not kept or (self.disabled and name in self.disabled) else kept
        if self.trace is not None:
            self.trace.append((name, tuple(p.key for p in out)))
        return out

    def pick(self, pods: list[Candidate], branch: str) -> Decision:
        chosen = pods[0] if len(pods) == 1 else pods[self.rng.randrange(len(pods))]
        return Decision(chosen.key, branch, self.trace or [])


def least_band_int(values: Sequence[int], width: float = 1.0) -> int:
    """Upper edge of the "least" band `[min, min + (max - min) // N]` for integer metrics."""
    lo, hi = min(values), max(values)
    return lo + (hi - lo) // len(values) if width == 1.0 else lo + int((hi - lo) * width / len(values))


def least_band_float(values: Sequence[float], width: float = 1.0) -> float:
    lo, hi = min(values), max(values)
    return lo + (hi - lo) * width / len(values)


def _least_waiting(pods: list[Candidate], width: float) -> list[Candidate]:
    edge = least_band_int([p.waiting for p in pods], width)
    return [p for p in pods if p.waiting <= edge]


def _least_load(pods: list[Candidate], width: float) -> list[Candidate]:
    edge = least_band_int([p.load for p in pods], width)
    return [p for p in pods if p.load <= edge]


def _least_kv(pods: list[Candidate], width: float) -> list[Candidate]:
    edge = least_band_float([p.kv_cache_usage for p in pods], width)
    return [p for p in pods if p.kv_cache_usage <= edge]


def choose_pod(
    candidates: Sequence[Candidate],
    request: RouteRequest,
    settings: Settings,
    rng: random.Random,
    *,
    explain: bool = False,
) -> Decision:
    """Pick one pod for a request, or raise Shed (429) / NoCapacity (503)."""
    pods = list(candidates)
    if not pods:
        raise NoCapacity("no candidate pods for this model")
    run = _Run(rng, explain, settings)
    if request.sheddable and settings.shedding:
        pods = _sheddable_capacity(pods, settings, run)
    if settings.rule_set == "gie-v0.2":
        return _gie_v02(pods, request, settings, run)
    return _lora_affinity(pods, request, settings, run)


def _sheddable_capacity(pods: list[Candidate], settings: Settings, run: _Run) -> list[Candidate]:
    kept = [
        p
        for p in pods
        if p.waiting <= settings.queue_threshold_critical and p.kv_cache_usage <= settings.kv_cache_threshold
    ]
    if not kept:
        raise Shed(
            "dropping request due to limited backend resources: every pod is over "
            f"queue_threshold_critical={settings.queue_threshold_critical} waiting requests "
            f"or kv_cache_threshold={settings.kv_cache_threshold} KV-cache use"
        )
    if run.trace is not None:
        run.trace.append(("sheddable_capacity", tuple(p.key for p in kept)))
    return kept


# --- gie-v0.2: the endpoint picker's tree, as published -------------------------------------


def _gie_v02(pods: list[Candidate], request: RouteRequest, settings: Settings, run: _Run) -> Decision:
    low_queue = [p for p in pods if p.waiting < settings.queueing_threshold_lora]
    if low_queue:
        pods = run.apply("low_queue", pods, low_queue)
        if request.adapter is not None:
            pods = run.apply("lora_soft_affinity", pods, _soft_affinity(pods, request.adapter, settings, run))
        pods = run.apply("least_queue", pods, _least_waiting(pods, run.width))
        pods = run.apply("least_kv", pods, _least_kv(pods, run.width))
        return run.pick(pods, "low_queue")
    pods = run.apply("least_queue", pods, _least_waiting(pods, run.width))
    if request.adapter is not None:
        adapter = request.adapter
        low_cost = [p for p in pods if adapter in p.active_adapters or p.has_free_slot()]
        pods = run.apply("low_cost_lora", pods, low_cost)
    pods = run.apply("least_kv", pods, _least_kv(pods, run.width))
    return run.pick(pods, "high_queue")


def _soft_affinity(pods: list[Candidate], adapter: str, settings: Settings, run: _Run) -> list[Candidate]:
    affinity = [p for p in pods if adapter in p.active_adapters]
    available = [p for p in pods if adapter not in p.active_adapters and p.has_free_slot()]
    if affinity and available:
        return affinity if run.rng.random() < settings.lora_affinity_threshold else available
    return affinity or available


# --- lora-affinity: our default ------------------------------------------------------------


def _lora_affinity(pods: list[Candidate], request: RouteRequest, settings: Settings, run: _Run) -> Decision:
    low_queue = [p for p in pods if p.waiting < settings.queueing_threshold_lora]
    pods = run.apply("low_queue", pods, low_queue)
    if request.adapter is None:
        pods = run.apply("least_load", pods, _least_load(pods, run.width))
        pods = run.apply("least_kv", pods, _least_kv(pods, run.width))
        return run.pick(pods, "base_model")

    adapter = request.adapter
    fleet_min = min(p.load for p in pods)
    holders = [p for p in pods if adapter in p.active_adapters]
    roomy = [p for p in holders if p.load <= fleet_min + settings.spill_queue_margin]
    if roomy:
        pods = run.apply("adapter_active", pods, roomy)
        pods = run.apply("least_load", pods, _least_load(pods, run.width))
        pods = run.apply("least_kv", pods, _least_kv(pods, run.width))
        return run.pick(pods, "affinity")

    # Place (or spill) the adapter where it adds the least contention: a pod with a free slot,
    # one that still holds it, then the fewest distinct adapters, then the least load.
    branch = "spill" if holders else "place"
    others = [p for p in pods if adapter not in p.active_adapters] or pods
    pods = run.apply("resident", others, [p for p in others if adapter in p.resident_adapters])
    pods = run.apply("free_slot", pods, [p for p in pods if p.has_free_slot()])
    fewest = min(len(p.active_adapters) for p in pods)
    pods = run.apply("fewest_adapters", pods, [p for p in pods if len(p.active_adapters) == fewest])
    pods = run.apply("least_load", pods, _least_load(pods, run.width))
    pods = run.apply("least_kv", pods, _least_kv(pods, run.width))
    return run.pick(pods, branch)
