"""The rule sets other than the default, which `Settings.rule_set` selects (per model group too).

- ``gie-v0.2``: the Gateway API Inference Extension endpoint picker's v0.2 decision tree, as published.
- ``lora-affinity-v1``: the previous default, kept so that every change is measured against it.
- ``llmd-prefix`` and ``sglang-cache-aware``: the peers' prefix-aware policies as published
  (shared/docs/scheduling-reference.md section 7), kept as references to measure against.

They are built from the scheduling core's own filters (`scheduling.py`), so the benchmarks compare rules,
not implementations; `scheduling.choose_pod` dispatches here for any rule set but the default.
"""

from __future__ import annotations

from collections.abc import Callable

from .scheduling import (
    Candidate,
    Decision,
    RouteRequest,
    _adapter_holders,
    _adapter_then_least_load,
    _fewest_prefixes,
    _least_kv,
    _least_load,
    _not_far_busier,
    _place_adapter,
    _Run,
    _warm,
    least_band_int,
)
from .settings import Settings


def _least_waiting(pods: list[Candidate], width: float) -> list[Candidate]:
    edge = least_band_int([p.waiting for p in pods], width)
    return [p for p in pods if p.waiting <= edge]


def _least(pods: list[Candidate], run: _Run, branch: str) -> Decision:
    pods = run.apply("least_load", pods, _least_load(pods, run.width))
    pods = run.apply("least_kv", pods, _least_kv(pods, run.width))
    return run.pick(pods, branch)


# --- gie-v0.2: the endpoint picker's tree, as published -------------------------------------


def gie_v02(pods: list[Candidate], request: RouteRequest, settings: Settings, run: _Run) -> Decision:
    """Under the queue threshold: LoRA soft affinity, the least queue, the least KV use; over it: the least
    queue, a pod running the adapter or with a free slot, the least KV use (scheduling-reference.md)."""
    threshold = settings.queueing_threshold_lora  # (read once: a settings attribute costs more than the test)
    low_queue = [p for p in pods if p.waiting < threshold]
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
    """The pods running the adapter with probability `lora_affinity_threshold`, else those with a free slot."""
    affinity = [p for p in pods if adapter in p.active_adapters]
    available = [p for p in pods if adapter not in p.active_adapters and p.has_free_slot()]
    if affinity and available:
        return affinity if run.rng.random() < settings.lora_affinity_threshold else available
    return affinity or available


# --- lora-affinity-v1: the previous default -----------------------------------------------


def lora_affinity_v1(pods: list[Candidate], request: RouteRequest, settings: Settings, run: _Run) -> Decision:
    """The previous default (kept as the `lora-affinity-v1` reference): a long prompt went through the prefix
    rules before any adapter rule, so an unseen long prompt was placed by index size, not by its adapter."""
    threshold = settings.queueing_threshold_lora  # (read once: a settings attribute costs more than the test)
    low_queue = [p for p in pods if p.waiting < threshold]
    pods = run.apply("low_queue", pods, low_queue)
    long_prompt = settings.prefix_affinity and request.prefix_blocks >= settings.prefix_min_blocks
    if long_prompt:
        warm = _warm(pods, request, settings)
        if warm:
            pods = run.apply("prefix_match", pods, warm)
            pods = run.apply("least_load", pods, _least_load(pods, run.width))
            pods = run.apply("least_kv", pods, _least_kv(pods, run.width))
            return run.pick(pods, "prefix", agree=True)
        return _new_prefix_v1(pods, _not_far_busier(pods, settings), request, run)
    if request.adapter is None:
        return _least(pods, run, "base_model")

    holders, roomy = _adapter_holders(pods, request.adapter, settings, min([p.load for p in pods]))
    if roomy:
        return _least(run.apply("adapter_active", pods, roomy), run, "affinity")

    return _place_adapter(pods, holders, request, settings, run, by_prefix=False)


def _new_prefix_v1(pods: list[Candidate], roomy: list[Candidate], request: RouteRequest, run: _Run) -> Decision:
    """A prompt no pod holds: it will stay where it lands, so place it for the cache, not the moment.

    Among pods not far busier than the least busy, and (for an adapter) that can run it without
    evicting another, the one whose cache is known to hold least; gateways agree by rendezvous.
    """
    pods = run.apply("roomy", pods, roomy)
    pods = run.apply("fewest_prefixes", pods, _fewest_prefixes(pods, request, run.width))
    return _adapter_then_least_load(pods, request, run)


# --- the peers' prefix-aware policies, as references -----------------------------------------


LLMD_WEIGHTS = {"prefix": 2.0, "kv": 1.0, "queue": 1.0, "lora": 1.0}
"""The llm-d router's published sample profile: prefix 2, KV use 1, queue 1, plus its LoRA scorer at 1."""


def llmd_prefix(pods: list[Candidate], request: RouteRequest, settings: Settings, run: _Run) -> Decision:
    """Weighted scorers, highest total wins (ties at random)."""
    blocks = max(1, request.prefix_blocks)
    queues = [p.waiting for p in pods]
    lo, hi = min(queues), max(queues)
    best: list[Candidate] = []
    top = -1.0
    for p in pods:
        prefix = request.prefix_matches.get(p.key, 0) / blocks
        queue = 1.0 if hi == lo else (hi - p.waiting) / (hi - lo)
        if request.adapter is None:
            lora = 0.0
        elif request.adapter in p.active_adapters:
            lora = 1.0
        else:
            lora = 0.8 if p.has_free_slot() else 0.0
        score = (LLMD_WEIGHTS["prefix"] * prefix + LLMD_WEIGHTS["kv"] * (1 - p.kv_cache_usage)
                 + LLMD_WEIGHTS["queue"] * queue + LLMD_WEIGHTS["lora"] * lora)
        if score > top + 1e-9:
            best, top = [p], score
        elif abs(score - top) <= 1e-9:
            best.append(p)
    if run.trace is not None:
        run.trace.append(("llmd_scores", tuple(p.key for p in best)))
    return run.pick(best, "llmd")


SGLANG_BALANCE_ABS = 64
SGLANG_BALANCE_REL = 1.5
SGLANG_MATCH_RATIO = 0.3


def sglang_cache_aware(pods: list[Candidate], request: RouteRequest, settings: Settings, run: _Run) -> Decision:
    """Least loaded when imbalanced; else the longest match above 30% of the prompt; else the smallest tree."""
    loads = [p.load for p in pods]
    if max(loads) - min(loads) > SGLANG_BALANCE_ABS and max(loads) > SGLANG_BALANCE_REL * min(loads):
        low = min(loads)
        return run.pick([p for p in pods if p.load == low], "sglang_balance")
    matches = request.prefix_matches
    best = max((matches.get(p.key, 0) for p in pods), default=0)
    if request.prefix_blocks and best / request.prefix_blocks > SGLANG_MATCH_RATIO:
        return run.pick([p for p in pods if matches.get(p.key, 0) == best], "sglang_match")
    sizes = request.prefix_sizes
    smallest = min(sizes.get(p.key, 0) for p in pods)
    return run.pick([p for p in pods if sizes.get(p.key, 0) == smallest], "sglang_smallest_tree")


Rules = Callable[[list[Candidate], RouteRequest, Settings, _Run], Decision]

OTHER_RULE_SETS: dict[str, Rules] = {
    "gie-v0.2": gie_v02,
    "lora-affinity-v1": lora_affinity_v1,
    "llmd-prefix": llmd_prefix,
    "sglang-cache-aware": sglang_cache_aware,
}
