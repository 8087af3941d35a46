"""Each pod's speeds, learned from what it publishes: the histograms' sums and counts, as deltas.

vLLM exports cumulative histograms (`time_to_first_token_seconds`, `inter_token_latency_seconds`,
formerly `time_per_output_token_seconds`, `request_queue_time_seconds`, `request_prefill_time_seconds`)
and token counters. The difference between two scrapes says what the pod did in between: how long
its prefills took for the tokens it was given, its time per output token at the batch it ran, how
long requests queued for the queue it had. The scraper keeps one `RateTracker` and writes the rates
into each pod's record, so every gateway chooses by the same numbers. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cost import expected_step_s
from .podstate import (
    DEFAULT_RATES,
    PREFILL_OVERHEAD_S,
    PREFILL_S_PER_TOKEN,
    PodCounters,
    PodMetrics,
    PodRates,
)

SMOOTHING = 0.5
"""Weight of the newest interval in the moving average: a pod that slows is followed within a few scrapes."""
MIN_REQUESTS = 1
"""Requests an interval needs before its prefill and queue figures count."""
MIN_TOKENS = 20
"""Output tokens the decode figures need: a lightly loaded pod's intervals are pooled until they add up."""


@dataclass(slots=True)
class _Decode:
    """Decode intervals pooled until they hold MIN_TOKENS tokens (one scrape of an idle pod holds few)."""

    seconds: float = 0.0
    tokens: float = 0.0
    expected_s: float = 0.0
    """What the defaults predict for those tokens at the batch and KV each interval ran."""


@dataclass(slots=True)
class _PodHistory:
    counters: PodCounters
    at: float
    rates: PodRates
    first: PodCounters
    """The first counters seen: output length is a property of the traffic, averaged since then."""
    load: tuple[float, float] = (0.0, 0.0)
    """Running requests and KV tokens at the last scrape."""
    decode: _Decode = field(default_factory=_Decode)
    measured: set[str] = field(default_factory=set)
    """The rates measured at least once: each one's first measurement replaces its default, not averages with it."""
    lookups: tuple[float, float] = (0.0, 0.0)
    """Cache hits and queries counted since the last interval in which a prefill ended (`_computed_tokens`)."""
    hit_share: float | None = None
    """The share of queried tokens the cache held, over the lookups the last prefills consumed."""


class RateTracker:
    """Per pod: the last counters seen and the rates smoothed over the intervals since."""

    def __init__(self) -> None:
        self._pods: dict[str, _PodHistory] = {}
        self._seeds: dict[str, PodRates] = {}
        """Rates another scraper learned (read back from Redis on taking the lease): the start, not the defaults."""

    def seed(self, pod: str, rates: PodRates) -> None:
        """Start `pod` from `rates` (a previous scraper's, from its record) unless this tracker learned its own."""
        if rates.learned and pod not in self._pods:
            self._seeds[pod] = rates

    def observe(self, pod: str, counters: PodCounters | None, at: float, running: float = 0.0,
                kv_tokens: float = 0.0) -> PodRates:
        """Fold in a scrape of `pod` taken at `at` (seconds), with the requests it was running and the
        tokens its KV cache held then; returns its rates (defaults until it did enough)."""
        history = self._pods.get(pod)
        if counters is None:
            return history.rates if history else self._seeds.get(pod, DEFAULT_RATES)
        load = (running, kv_tokens)
        if history is None:
            seeded = self._seeds.pop(pod, None)
            history = self._pods[pod] = _PodHistory(counters, at, seeded or DEFAULT_RATES, counters, load)
            if seeded is not None:  # a measurement averages with what the previous scraper learned
                history.measured.update(("prefill_factor", "decode_step_s", "decode_factor", "queue_s_per_request"))
            return history.rates
        previous, history.counters = history.counters, counters
        interval, history.at = at - history.at, at
        previous_load, history.load = history.load, load
        if counters.prefill_time_count < previous.prefill_time_count:  # the server restarted: start over
            history.rates, history.first, history.decode, history.measured = DEFAULT_RATES, counters, _Decode(), set()
            history.lookups, history.hit_share = (0.0, 0.0), None
            return history.rates
        if interval > 0:
            mean_load = ((previous_load[0] + running) / 2, (previous_load[1] + kv_tokens) / 2)
            history.rates = _updated(history, previous, counters, interval, mean_load)
        return history.rates

    def forget(self, pods_kept: set[str]) -> None:
        for pod in [p for p in self._pods if p not in pods_kept]:
            del self._pods[pod]
        for pod in [p for p in self._seeds if p not in pods_kept]:
            del self._seeds[pod]


def decode_load(metrics: PodMetrics) -> tuple[float, float]:
    """The running requests and the tokens in the KV cache a page reports (`observe`'s load)."""
    kv_tokens = 0.0
    if metrics.num_gpu_blocks and metrics.block_size:
        kv_tokens = metrics.kv_cache_usage * metrics.num_gpu_blocks * metrics.block_size
    return float(metrics.num_requests_running), kv_tokens


def _updated(history: _PodHistory, before: PodCounters, after: PodCounters, interval: float,
             load: tuple[float, float]) -> PodRates:
    rates, first, decode, measured = history.rates, history.first, history.decode, history.measured
    prefill_factor, step, per_queued, output, decode_factor = (
        rates.prefill_factor, rates.decode_step_s, rates.queue_s_per_request, rates.mean_output_tokens,
        rates.decode_factor)
    prefills = after.prefill_time_count - before.prefill_time_count
    computed = _computed_tokens(history, before, after, prefills)
    if prefills >= MIN_REQUESTS:
        expected = prefills * PREFILL_OVERHEAD_S + max(0.0, computed) * PREFILL_S_PER_TOKEN
        taken = after.prefill_time_sum - before.prefill_time_sum
        if expected > 0 and taken > 0:
            prefill_factor = _smooth(prefill_factor, taken / expected, measured, "prefill_factor")
    tokens = after.itl_count - before.itl_count
    if tokens > 0:
        decode.seconds += after.itl_sum - before.itl_sum
        decode.tokens += tokens
        decode.expected_s += tokens * expected_step_s(*load)
    if decode.tokens >= MIN_TOKENS:
        if decode.seconds > 0:
            step = _smooth(step, decode.seconds / decode.tokens, measured, "decode_step_s")
            decode_factor = _smooth(decode_factor, decode.seconds / decode.expected_s, measured, "decode_factor")
        history.decode = _Decode()
    queued = after.queue_time_count - before.queue_time_count
    if queued >= MIN_REQUESTS:
        mean_queue_s = (after.queue_time_sum - before.queue_time_sum) / queued
        # A request ahead holds one back for the time between admissions when the pod is the bottleneck
        # (then admissions come at its service rate); when it is not, no longer than requests queued at all.
        per_queued = _smooth(per_queued, max(min(interval / queued, mean_queue_s), step / 4), measured,
                             "queue_s_per_request")
    finished = after.requests_finished - first.requests_finished
    if finished >= MIN_REQUESTS and after.requests_finished > before.requests_finished:
        output = max(1.0, (after.generation_tokens - first.generation_tokens) / finished)
    changed = (prefill_factor, step, per_queued, output, decode_factor) != (
        rates.prefill_factor, rates.decode_step_s, rates.queue_s_per_request, rates.mean_output_tokens,
        rates.decode_factor)
    if not changed:
        return rates
    return PodRates.bounded(True, prefill_factor=prefill_factor, decode_step_s=step, queue_s_per_request=per_queued,
                            mean_output_tokens=output, decode_factor=decode_factor)


def _computed_tokens(history: _PodHistory, before: PodCounters, after: PodCounters, prefills: float) -> float:
    """The prompt tokens the prefills that ended in the interval computed (not found in the cache).

    vLLM counts a request's cache hits (and queries) when it is scheduled, its prompt tokens when its prefill
    ends: a prefill that spans a scrape has its hits in one interval and its tokens in the next, and
    subtracting that interval's hits read a half-speed pod serving cached prefixes as faster than the fleet.
    So the hits and queries are pooled until prefills end, and their share applied to those prompt tokens.
    A server that counts no queries keeps the plain difference."""
    prompt = after.prompt_tokens - before.prompt_tokens
    hits = after.prefix_hits - before.prefix_hits
    queries = after.prefix_queries - before.prefix_queries
    if after.prefix_queries <= 0 or hits < 0 or queries < 0:
        return prompt - hits
    pooled_hits, pooled_queries = history.lookups
    pooled_hits, pooled_queries = pooled_hits + hits, pooled_queries + queries
    if prefills <= 0:
        history.lookups = (pooled_hits, pooled_queries)
        return prompt - hits
    history.lookups = (0.0, 0.0)
    if pooled_queries > 0:
        history.hit_share = min(1.0, pooled_hits / pooled_queries)
    if history.hit_share is None:
        return prompt - hits
    return prompt * (1.0 - history.hit_share)


def _smooth(old: float, new: float, measured: set[str], rate: str) -> float:
    """The moving average of `rate`; its first measurement stands alone: averaged with the default, a half-speed
    pod's first figure would read under the ratio that marks a pod slow, and it would keep its full share until
    the next one."""
    if rate not in measured:
        measured.add(rate)
        return new
    return old + SMOOTHING * (new - old)
