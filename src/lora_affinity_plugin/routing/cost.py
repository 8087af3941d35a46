"""What a request costs on a pod, in seconds: the estimate the default rule set chooses by.

Pure, like the rules beside it (`scheduling.py`): a candidate pod and a request in, the parts out.
A request's cost on a pod is the time until its first token there plus the time it takes from the
requests already on that pod:

- ``wait``: the queue ahead of it (each request the pod reported waiting holds admission for the
  pod's learned seconds per queued request; each one sent since its scrape joins the next prefill
  step, adding its fixed cost), plus half the step in flight when the pod is busy;
- ``adapter``: bringing its adapter into a GPU slot (0 when running or resident there);
- ``prefill``: its prompt tokens the pod does not already hold (the prefix index's match), at the
  pod's learned prefill speed;
- ``harm``: a new adapter in a batch slows every running request's decode steps (the multi-LoRA
  kernels work per distinct adapter) for the rest of their generations; and a second copy of a
  prefix another pod already holds evicts about as much of someone else's cached work.

The rates are each pod's own, learned from its histograms (`rates.py`); until enough is seen they
are the defaults (`podstate.py`), so an unknown pod is neither favoured nor shunned.
"""

from __future__ import annotations

from dataclasses import dataclass

from .podstate import DECODE_STEP_S, PREFILL_S_PER_TOKEN, PodRates

DECODE_S_PER_SEQ = 0.0004
"""What each running sequence adds to a decode step at speed 1 (sampling, scheduling)."""
DECODE_S_PER_KV_TOKEN = 2.3e-6
"""What each token in the running requests' KV cache adds to a decode step at speed 1: a step reads the
weights once and every running request's KV once (memory bound; a 7B model's 14 GB of weights weigh
about as much as 25k tokens of KV)."""
ADAPTER_LOAD_S = 0.02
"""Moving an adapter from CPU memory into a GPU slot (vLLM: milliseconds)."""
ADAPTER_STEP_SHARE = 0.005
"""What one more distinct adapter adds to a decode step, as a share of it (punica/SGMV kernels)."""


def expected_step_s(running: float, kv_tokens: float) -> float:
    """A decode step at speed 1 for a batch of `running` requests holding `kv_tokens` of KV cache. (Conditionals, not
    `max`: it runs for every candidate of a decision.)"""
    return (DECODE_STEP_S + DECODE_S_PER_SEQ * (running if running > 0.0 else 0.0)
            + DECODE_S_PER_KV_TOKEN * (kv_tokens if kv_tokens > 0.0 else 0.0))


@dataclass(frozen=True, slots=True)
class CostParts:
    """One candidate's estimate, part by part (what `explain` prints)."""

    wait_s: float
    adapter_s: float
    prefill_s: float
    uncached_tokens: int
    harm_s: float
    adds_adapter: bool
    others: int
    """Requests already running there (whom a new adapter would slow)."""
    duplicated_tokens: int = 0
    """Tokens another pod holds that this one would cache a second time."""

    @property
    def total_s(self) -> float:
        return self.wait_s + self.adapter_s + self.prefill_s + self.harm_s

    def describe(self) -> str:
        text = (f"{self.total_s:.3f} s = wait {self.wait_s:.3f} s, adapter load {self.adapter_s:.3f} s, "
                f"prefill {self.prefill_s:.3f} s for {self.uncached_tokens} uncached tokens")
        if self.adds_adapter:
            text += f", adds an adapter to a batch of {self.others}"
        if self.duplicated_tokens:
            text += f", copies {self.duplicated_tokens} tokens another pod holds"
        if self.harm_s:
            text += f": harm to others +{self.harm_s:.3f} s"
        return text


def cost_terms(*, waiting: int, queued: int, running: int, rates: PodRates, uncached_tokens: float,
               duplicated_tokens: float, adapter: str | None, active: frozenset[str], resident: frozenset[str]
               ) -> tuple[float, float, float, float]:
    """The request's cost on one pod as (wait, adapter load, prefill, harm) seconds: the module's docstring
    says why each part. `queued` of the `waiting` requests the pod itself reported; the rest were sent since
    its scrape and join the next prefill step. Runs for every candidate of a decision: plain floats."""
    wait = adapter_s = harm = 0.0
    if waiting or running:
        wait = queued * rates.queue_s_per_request + (waiting - queued) * rates.prefill_s(0) + rates.decode_step_s / 2
    if adapter is not None and adapter not in active:
        if adapter not in resident:
            adapter_s = ADAPTER_LOAD_S
        if active:
            harm = batch_harm_s(running, rates)
    if duplicated_tokens > 0:
        harm += copy_harm_s(rates, duplicated_tokens)
    return wait, adapter_s, rates.prefill_s(uncached_tokens), harm


def batch_harm_s(running: int, rates: PodRates) -> float:
    """A new adapter in a running batch: each running request pays the extra share on every remaining step, about
    half its generation."""
    return running * ADAPTER_STEP_SHARE * rates.decode_step_s * rates.mean_output_tokens / 2


def copy_harm_s(rates: PodRates, tokens: float) -> float:
    """A second copy of `tokens` another pod holds evicts about as much of someone else's cached work."""
    return rates.prefill_factor * PREFILL_S_PER_TOKEN * tokens


def estimate(*, waiting: int, queued: int, running: int, rates: PodRates, uncached_tokens: float,
             duplicated_tokens: float, adapter: str | None, active: frozenset[str], resident: frozenset[str]
             ) -> CostParts:
    """`cost_terms`, part by part and with what they were for (what `explain` prints)."""
    wait, adapter_s, prefill, harm = cost_terms(
        waiting=waiting, queued=queued, running=running, rates=rates, uncached_tokens=uncached_tokens,
        duplicated_tokens=duplicated_tokens, adapter=adapter, active=active, resident=resident)
    adds = adapter is not None and adapter not in active
    return CostParts(wait, adapter_s, prefill, int(max(0.0, uncached_tokens)), harm, adds, running,
                     int(duplicated_tokens))


def cache_wait_s(rates: PodRates, kv_free_tokens: int | None, tokens: float) -> float:
    """A prompt the pod's KV cache cannot hold waits for running requests to end: about half a generation."""
    if kv_free_tokens is None or tokens <= kv_free_tokens:
        return 0.0
    return rates.decode_step_s * rates.mean_output_tokens / 2


SLOW_RATIO = 1.5
"""A pod counts as slower (or faster) than the fleet only beyond this ratio: learned rates carry noise."""


def relative_slowness(rates: PodRates, median_prefill_factor: float, median_decode_factor: float) -> float:
    """How much slower than the fleet's median pod this one runs: its decode factor's ratio, once beyond
    SLOW_RATIO, when its prefill factor leans the same way.

    The decode factor is measured against the batch and KV the pod ran, so load does not move it; the
    prefill factor does move with load (prompts batched with other work) and only confirms the direction:
    a pod that is really slower is slower at both. Bounded to 0.25..4; 1.0 within the noise."""
    if median_prefill_factor <= 0 or median_decode_factor <= 0:
        return 1.0
    prefill = rates.prefill_factor / median_prefill_factor
    decode = rates.decode_factor / median_decode_factor
    if decode >= SLOW_RATIO and prefill > 1:
        return min(4.0, decode)
    if decode <= 1 / SLOW_RATIO and prefill < 1:
        return max(0.25, decode)
    return 1.0
