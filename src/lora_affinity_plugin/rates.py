"""Each pod's speeds, learned from what it publishes: the histograms' sums and counts, as deltas.

vLLM exports cumulative histograms (`time_to_first_token_seconds`, `inter_token_latency_seconds`,
formerly `time_per_output_token_seconds`, `request_queue_time_seconds`, `request_prefill_time_seconds`)
and token counters. The difference between two scrapes says what the pod did in between: how long
its prefills took for the tokens it was given, its time per output token at the batch it ran, how
long requests queued for the queue it had. The scraper keeps one `RateTracker` and writes the rates
into each pod's record, so every gateway chooses by the same numbers. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import DEFAULT_RATES, PREFILL_OVERHEAD_S, PREFILL_S_PER_TOKEN, PodRates

SMOOTHING = 0.5
"""Weight of the newest interval in the moving average: a pod that slows is followed within a few scrapes."""
MIN_REQUESTS = 1
"""Requests an interval needs before its prefill and queue figures count."""
MIN_TOKENS = 20
"""Output tokens an interval needs before its time per output token counts."""


@dataclass(frozen=True, slots=True)
class PodCounters:
    """Cumulative sums and counts from one page (`parsing.parse_metrics`); deltas make the rates."""

    prefill_time_sum: float = 0.0
    prefill_time_count: float = 0.0
    queue_time_sum: float = 0.0
    queue_time_count: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    prompt_tokens: float = 0.0
    prefix_hits: float = 0.0
    """Prompt tokens found in the prefix cache (not computed)."""
    generation_tokens: float = 0.0
    requests_finished: float = 0.0


@dataclass(slots=True)
class _PodHistory:
    counters: PodCounters
    at: float
    rates: PodRates
    first: PodCounters
    """The first counters seen: output length is a property of the traffic, averaged since then."""


class RateTracker:
    """Per pod: the last counters seen and the rates smoothed over the intervals since."""

    def __init__(self) -> None:
        self._pods: dict[str, _PodHistory] = {}

    def observe(self, pod: str, counters: PodCounters | None, at: float) -> PodRates:
        """Fold in a scrape of `pod` taken at `at` (seconds); returns its rates (defaults until it did enough)."""
        history = self._pods.get(pod)
        if counters is None:
            return history.rates if history else DEFAULT_RATES
        if history is None:
            self._pods[pod] = _PodHistory(counters, at, DEFAULT_RATES, counters)
            return DEFAULT_RATES
        previous, history.counters = history.counters, counters
        interval, history.at = at - history.at, at
        if counters.prefill_time_count < previous.prefill_time_count:  # the server restarted: start over
            history.rates, history.first = DEFAULT_RATES, counters
            return history.rates
        if interval > 0:
            history.rates = _updated(history.rates, previous, counters, interval, history.first)
        return history.rates

    def forget(self, pods_kept: set[str]) -> None:
        for pod in [p for p in self._pods if p not in pods_kept]:
            del self._pods[pod]


def _updated(rates: PodRates, before: PodCounters, after: PodCounters, interval: float, first: PodCounters
             ) -> PodRates:
    prefill_factor, step, per_queued, output = (rates.prefill_factor, rates.decode_step_s,
                                                rates.queue_s_per_request, rates.mean_output_tokens)
    learned = rates.learned
    prefills = after.prefill_time_count - before.prefill_time_count
    if prefills >= MIN_REQUESTS:
        computed = (after.prompt_tokens - before.prompt_tokens) - (after.prefix_hits - before.prefix_hits)
        expected = prefills * PREFILL_OVERHEAD_S + max(0.0, computed) * PREFILL_S_PER_TOKEN
        measured = after.prefill_time_sum - before.prefill_time_sum
        if expected > 0 and measured > 0:
            prefill_factor = _smooth(prefill_factor, measured / expected, learned)
    tokens = after.itl_count - before.itl_count
    if tokens >= MIN_TOKENS:
        step = _smooth(step, (after.itl_sum - before.itl_sum) / tokens, learned)
    queued = after.queue_time_count - before.queue_time_count
    if queued >= MIN_REQUESTS:
        mean_queue_s = (after.queue_time_sum - before.queue_time_sum) / queued
        # A request ahead holds one back for the time between admissions when the pod is the bottleneck
        # (then admissions come at its service rate); when it is not, no longer than requests queued at all.
        per_queued = _smooth(per_queued, max(min(interval / queued, mean_queue_s), step / 4), learned)
    finished = after.requests_finished - first.requests_finished
    if finished >= MIN_REQUESTS and after.requests_finished > before.requests_finished:
        output = max(1.0, (after.generation_tokens - first.generation_tokens) / finished)
    changed = (prefill_factor, step, per_queued, output) != (rates.prefill_factor, rates.decode_step_s,
                                                             rates.queue_s_per_request, rates.mean_output_tokens)
    if not changed:
        return rates
    return PodRates(max(0.05, min(prefill_factor, 100.0)), max(1e-4, min(step, 10.0)),
                    max(1e-4, min(per_queued, 60.0)), output, learned=True)


def _smooth(old: float, new: float, learned: bool) -> float:
    return new if not learned else old + SMOOTHING * (new - old)
