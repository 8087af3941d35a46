"""Scorers: a cost per pod, lower is better (`decision.Scorer`): the "least" bands, the estimated cost in
seconds, and the peers' scores (negated, so that one rule holds: the least wins)."""

from __future__ import annotations

import math

from .decision import Candidate, DecisionRun, Outcome, Part, Scorer
from .placement import (
    computing_tokens,
    cost_band_edge,
    cost_s,
    least_band_float,
    least_band_int,
    tokens_per_block,
)
from .ttft import adapter_slots_scarce, band_edge, run_predictions


class _CountBand(Scorer):
    """A count per pod (requests), within the endpoint picker's "least" band for counts."""

    def edge(self, costs: list[float], run: DecisionRun) -> float:
        return least_band_int(costs, run.width)  # type: ignore[arg-type]


class LeastLoad(_CountBand):
    """Waiting plus running requests, within the endpoint picker's "least" band."""

    name = "least_load"

    def costs(self, pods: list[Candidate], run: DecisionRun) -> list[float]:
        return [p.load for p in pods]


class LeastQueue(_CountBand):
    """Waiting requests, within the "least" band (the endpoint picker's)."""

    name = "least_queue"

    def costs(self, pods: list[Candidate], run: DecisionRun) -> list[float]:
        return [p.waiting for p in pods]


class LeastKv(Scorer):
    """KV-cache use, within the "least" band."""

    name = "least_kv"

    def costs(self, pods: list[Candidate], run: DecisionRun) -> list[float]:
        return [p.kv_cache_usage for p in pods]

    def edge(self, costs: list[float], run: DecisionRun) -> float:
        return least_band_float(costs, run.width)


class LeastCost(Scorer):
    """The estimated cost in seconds (`cost.py`: the wait for the queue ahead, loading the adapter, prefilling
    what the pod does not hold, at each pod's learned speed, and the harm to others); pods within `cost_band_ms`
    or `cost_band_ratio` of the least are equal (estimates from measured rates carry noise)."""

    name = "least_cost"

    def costs(self, pods: list[Candidate], run: DecisionRun) -> list[float]:
        request, settings = run.request, run.settings
        best_match = max(request.prefix_matches.values(), default=0)
        return [cost_s(p, request, settings, best_match) for p in pods]

    def edge(self, costs: list[float], run: DecisionRun) -> float:
        return cost_band_edge(min(costs), run.settings)


class PredictedTtft(Scorer):
    """The predicted time to first token plus the generation term and the harm to others, in seconds (`ttft.py`);
    pods within the least's band are equal (`ttft.band_edge`: `cost_band_ms`, or `cost_band_ratio` of its wait
    and harm, not of its generation)."""

    name = "predicted_ttft"

    def costs(self, pods: list[Candidate], run: DecisionRun) -> list[float]:
        predicted = run_predictions(pods, run)
        return [predicted[p.key].total_s for p in pods]

    def edge(self, costs: list[float], run: DecisionRun) -> float:
        assert run.predicted is not None  # (`costs` just computed them, for these pods, in their order)
        pods, predicted = run.predicted
        least = predicted[pods[costs.index(min(costs))].key]
        return band_edge(least, run.settings)


class DynamoCost(Scorer):
    """Dynamo's KV router cost (its default weights, temperature 0): the prompt's blocks the pod must prefill plus
    the blocks its running requests hold in the KV cache (decode load), in blocks of the prefix index."""

    name = "dynamo_cost"

    def costs(self, pods: list[Candidate], run: DecisionRun) -> list[float]:
        request = run.request
        per_block = tokens_per_block(request, run.settings)
        out = []
        for p in pods:
            uncached = request.prefix_blocks - request.prefix_matches.get(p.key, 0)
            used = (p.kv_cache_tokens - p.kv_free_tokens) / per_block if p.kv_cache_tokens and p.kv_free_tokens is not None \
                else p.kv_cache_usage * 100  # (no cache size on the page: its use, in hundredths)
            out.append(uncached + used)
        return out


class FewestPrefixes(Scorer):
    """A new prefix goes where it evicts least: the caches known to hold the fewest blocks (the "least" band)."""

    name = "fewest_prefixes"

    def costs(self, pods: list[Candidate], run: DecisionRun) -> list[float]:
        get = run.request.prefix_sizes.get
        return [get(p.key, 0) for p in pods]

    def edge(self, costs: list[float], run: DecisionRun) -> float:
        return least_band_int(costs, run.width)  # type: ignore[arg-type]


class FewestAdapters(Scorer):
    """Placing an adapter where the fewest distinct adapters run: each one more slows every decode step."""

    name = "fewest_adapters"

    def costs(self, pods: list[Candidate], run: DecisionRun) -> list[float]:
        return [len(p.active_adapters) for p in pods]


class FewestSlotContenders(FewestAdapters):
    """While most of the candidates' LoRA slots are taken, an adapter's request, among pods the estimate finds
    equal, goes where the fewest distinct adapters run or wait: each is one more contender for that pod's slots,
    and vLLM runs an adapter only while it holds one. No effect otherwise (every pod scores alike)."""

    name = "fewest_slot_contenders"

    def costs(self, pods: list[Candidate], run: DecisionRun) -> list[float]:
        if not adapter_slots_scarce(pods, run.request):
            return [0.0] * len(pods)
        return super().costs(pods, run)


# --- the peers' scorers, as references ------------------------------------------------------------


class PrefixScore(Scorer):
    """llm-d: the share of the prompt's blocks the pod holds (negated: a cost)."""

    name = "prefix_score"

    def costs(self, pods: list[Candidate], run: DecisionRun) -> list[float]:
        blocks = max(1, run.request.prefix_blocks)
        get = run.request.prefix_matches.get
        return [-(get(p.key, 0) / blocks) for p in pods]


class KvScore(Scorer):
    """llm-d: the free share of the KV cache (negated)."""

    name = "kv_score"

    def costs(self, pods: list[Candidate], run: DecisionRun) -> list[float]:
        return [-(1 - p.kv_cache_usage) for p in pods]


class QueueScore(Scorer):
    """llm-d: the queue scaled between the longest (0) and the shortest (1) (negated)."""

    name = "queue_score"

    def costs(self, pods: list[Candidate], run: DecisionRun) -> list[float]:
        queues = [p.waiting for p in pods]
        lo, hi = min(queues), max(queues)
        return [-(1.0 if hi == lo else (hi - p.waiting) / (hi - lo)) for p in pods]


class LoraScore(Scorer):
    """llm-d: 1 running the adapter, 0.8 with a free slot, else 0 (negated)."""

    name = "lora_score"

    def costs(self, pods: list[Candidate], run: DecisionRun) -> list[float]:
        adapter = run.request.adapter
        if adapter is None:
            return [-0.0] * len(pods)
        return [-(1.0 if adapter in self._running(p) else 0.8 if p.has_free_slot() else 0.0) for p in pods]

    @staticmethod
    def _running(p: Candidate) -> frozenset[str]:
        """The adapters that count as running on `p`: every active one, as llm-d reads them."""
        return p.active_adapters


class LoraSlotScore(LoraScore):
    """llm-d's LoRA scorer reading the pods' slots: 1 where the adapter runs in a slot (the page's running adapters;
    every active one where the engine does not tell them apart), 0.8 with a free slot, else 0 (negated). An adapter
    that only waits for a slot on a pod waits there as long as a new one would."""

    name = "lora_slot_score"

    @staticmethod
    def _running(p: Candidate) -> frozenset[str]:
        return p.active_adapters if p.running_adapters is None else p.running_adapters


class LeastLoadExact(LeastLoad):
    """sglang-cache-aware: the least load, exactly (no band)."""

    name = "least_load_exact"
    edge = Scorer.edge


class LongestMatch(Scorer):
    """sglang-cache-aware: the longest cached prefix, exactly."""

    name = "longest_match"

    def costs(self, pods: list[Candidate], run: DecisionRun) -> list[float]:
        get = run.request.prefix_matches.get
        return [-get(p.key, 0) for p in pods]


class HistoryMatch(LongestMatch):
    """Among equals, where the conversation's history is: no second copy of it (the longest match, as one of our
    rules: disabled with `prefix_match`)."""

    name = "history_match"
    rule = "prefix_match"


class SmallestTree(Scorer):
    """sglang-cache-aware: the smallest prefix index, exactly."""

    name = "smallest_tree"

    def costs(self, pods: list[Candidate], run: DecisionRun) -> list[float]:
        get = run.request.prefix_sizes.get
        return [get(p.key, 0) for p in pods]


LLMD_TOKEN_LOAD_SCALE = 4 * 1024 * 1024
"""llm-d's token-load scorer: in-flight uncached prompt tokens at which a pod scores 0."""


class TokenLoad(Scorer):
    """llm-d: 1 - min(1, in-flight uncached prompt tokens / 4 Mi) (negated)."""

    name = "token_load"

    def costs(self, pods: list[Candidate], run: DecisionRun) -> list[float]:
        request = run.request
        return [-(1 - min(1.0, computing_tokens(p, request) / LLMD_TOKEN_LOAD_SCALE)) for p in pods]


class Weighted(Part):
    """Scorers summed with weights (the llm-d router's profile shape); the least total wins, ties (within 1e-9)
    pass on. Built from a profile's `{scorer: weight, ...}` step."""

    kind = "scorer"
    rule = "scores"

    def __init__(self, weights: dict[Scorer, float]) -> None:
        self.weights = tuple(weights.items())

    def totals(self, pods: list[Candidate], run: DecisionRun) -> list[float]:
        """Each pod's weighted sum, in `pods`' order (lower is better)."""
        totals = [0.0] * len(pods)
        for scorer, weight in self.weights:
            for i, cost in enumerate(scorer.costs(pods, run)):
                totals[i] += weight * cost
        return totals

    def best(self, pods: list[Candidate], run: DecisionRun) -> tuple[list[Candidate], dict[str, float] | None]:
        """The pods with the least total (within 1e-9), and every pod's total when the run is explained."""
        totals = self.totals(pods, run)
        best: list[Candidate] = []
        least = math.inf
        for p, total in zip(pods, totals):
            if total < least - 1e-9:
                best, least = [p], total
            elif abs(total - least) <= 1e-9:
                best.append(p)
        return best, None if run.trace is None else {p.key: round(t, 6) for p, t in zip(pods, totals)}

    def __call__(self, pods: list[Candidate], run: DecisionRun) -> Outcome:
        return run.apply(self.rule, pods, *self.best(pods, run))

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{s.name}: {w:g}" for s, w in self.weights) + "}"


LLMD_WEIGHTED = Weighted({PrefixScore(): 3.0, KvScore(): 2.0, QueueScore(): 2.0})
"""llm-d's current built-in weights: the prompt's share a pod holds 3, its free KV share 2, its queue 2."""

LLMD_WEIGHTED_SLOTS = Weighted({PrefixScore(): 3.0, KvScore(): 2.0, QueueScore(): 2.0, LoraSlotScore(): 2.0})
"""llm-d's weights and its LoRA scorer at 2, reading the pods' slots: what `filters.DocumentWeights` rates an
adapter's document by while the fleet serves more adapters than it has slots."""
