"""A request's predicted time to first token on each candidate pod: the default rule set's one estimate.

Pure, like the rest of the scheduling core: a candidate and a request in, the terms out, in the engine's
seconds and from each pod's learned rates (`rates.py`; the defaults until enough is seen). A reader can check
each term by hand (docs/routing.md, "The predicted time to first token"):

- ``adapter``: the adapter's wait. 0 when the pod runs it; the load from CPU when a slot is free, and from disk
  (`COLD_ADAPTER_S`) when the pod has not run it lately and the fleet serves more adapters than a pod keeps; when
  every slot holds another adapter, vLLM admits the request only once one of them has no request left: about
  half a generation, the mean time for the running requests to end, and as much again for each `max_lora`
  adapters already waiting there for a slot. The same for an adapter the pod lists only as waiting for a slot,
  while the candidates' slots could hold every served adapter (`every_adapter_fits`): another pod could run it now.
- ``queue``: the work ahead of it. The prompts still being computed there (`RouteRequest.prefilling`: the long
  prompts this gateway sent there), the requests the pod reported waiting (each holds admission for its learned
  seconds per queued request; only its adapter's share of them when its adapter runs and others wait for a
  slot, since vLLM admits it past those), the requests sent since its scrape (each joins the next prefill step),
  and half the decode step in flight when the pod is busy.
- ``room``: the wait for KV-cache room. The uncached tokens it must compute, and the tokens the requests ahead of
  it take (each waiting one at least this request's prompt; the same share of the queue as ``queue`` counts), against the tokens the pod's cache had free; a
  shortfall waits about a generation for the first running request to end, then a generation more for each
  cache's worth of tokens.
- ``prefill``: computing what the pod does not hold, at the pod's learned prefill speed.
- ``generation``: not part of the wait, but what the request then takes to decode there, counted at half: its answer
  (the candidates' mean output) at the pod's decode step with its batch as it stands (the requests running and
  waiting there, their KV cache, and this one; `cost.expected_step_s` times the pod's learned decode factor). The
  requests it joins end, on average, halfway through its answer. Without it a pod whose adapter or prefix a
  request finds drew every such request however large its batch grew (a hot adapter's two pods ran 30 requests
  each while four others ran 4-8), though every request there then decodes slower.
- ``harm``: not part of the wait, but of what the choice costs the fleet, in the same seconds: a load from disk
  holds every request queued there for as long (vLLM loads within a step), and evicts the adapter the pod ran
  least lately from its memory, whose next request there loads from disk in turn; a new adapter in a
  batch slows every running request's decode steps and takes a LoRA slot another adapter's next request may then
  wait for (half a generation, times the share of the pod's slots already taken, squared while the fleet's slots
  are plentiful); a second copy of a prefix another pod
  holds evicts about as much of someone else's cached work (`cost.cost_terms`).

The least total wins, within `cost_band_ms` or `cost_band_ratio` of the least's wait and harm (`band_edge`:
learned rates carry noise); gateways break the remaining tie alike by rendezvous rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import is_

from .cost import ADAPTER_LOAD_S, DECODE_S_PER_KV_TOKEN, batch_harm_s, copy_harm_s, expected_step_s
from .decision import Candidate, DecisionRun, RouteRequest, RuleSettings
from .placement import tokens_per_block
from .podstate import PREFILL_S_PER_TOKEN

SCARCE_SLOTS = 0.75
"""The share of the candidates' LoRA slots in use past which slots count as scarce (`predict`'s slot term)."""
STICKY_MARGIN_S = 1.0
"""How much later than the best other pod the prompt's prefix holders may start it and keep it (`prefix_affinity_ttft`)."""
COLD_ADAPTER_S = 1.0
"""Loading an adapter from disk (vLLM: about a second, 0.2-3 s by size and storage): counted where the pod has not
run it lately while the fleet serves more adapters than a pod keeps at hand (`Settings.residency_memory` times its
slots, as vLLM's CPU cache does by default)."""
ROOM_GENERATIONS = 4.0
"""The room term's bound, in generations: past it the estimate says little but "much later"."""
GENERATION_SHARE = 0.5
"""How much of the request's own generation the estimate counts: the batch it joins lasts about half of it. At
the whole of it the estimate moved requests off their adapters' pods for small batches (docs/tried.md)."""


@dataclass(slots=True, init=False)
class Prediction:
    """One candidate's predicted time to first token, term by term (what `explain` prints), and its sums. Read-only
    by convention, not frozen: a decision builds one per candidate, and frozen costs five times as much to build.
    The sums are kept, not properties: a decision reads them for every candidate, one to three times."""

    adapter_s: float
    queue_s: float
    room_s: float
    prefill_s: float
    harm_s: float
    uncached_tokens: int
    generation_s: float
    """The share of its own generation there that the estimate counts (`GENERATION_SHARE`)."""
    ttft_s: float
    """The predicted first token: adapter, queue, room and prefill."""
    total_s: float
    """What the default compares: the first token, the generation term and the harm to others."""

    def __init__(self, adapter_s: float, queue_s: float, room_s: float, prefill_s: float, harm_s: float,
                 uncached_tokens: int, generation_s: float = 0.0) -> None:
        self.adapter_s, self.queue_s, self.room_s, self.prefill_s = adapter_s, queue_s, room_s, prefill_s
        self.harm_s, self.uncached_tokens, self.generation_s = harm_s, uncached_tokens, generation_s
        self.ttft_s = ttft = adapter_s + queue_s + room_s + prefill_s
        self.total_s = ttft + generation_s + harm_s

    def describe(self) -> str:
        return (f"{self.total_s:.3f} s = adapter {self.adapter_s:.3f} + queue {self.queue_s:.3f} + room "
                f"{self.room_s:.3f} + prefill {self.prefill_s:.3f} ({self.uncached_tokens} uncached tokens) "
                f"+ generation {self.generation_s:.3f}" + (f" + harm {self.harm_s:.3f}" if self.harm_s else ""))


def band_edge(least: Prediction, settings: RuleSettings) -> float:
    """The highest total kept as equal to the `least` pod's: within `cost_band_ms`, or `cost_band_ratio` of its
    wait and harm. Not of its generation term: that is about alike on every pod (the same answer, each pod's decode
    step), and a band a quarter of several seconds of generation made every pod equal to the adapter's holder
    whenever the fleet was lightly loaded, so rendezvous rank, not the prediction, placed the request."""
    return least.total_s + max(settings.cost_band_ms / 1000, settings.cost_band_ratio * (least.total_s - least.generation_s))


def adapter_slots_scarce(pods: list[Candidate], request: RouteRequest) -> bool:
    """An adapter's request while `SCARCE_SLOTS` of the pods' LoRA slots are in use: each slot it takes is one another
    adapter is likely to wait for."""
    return _slots_scarce(request, *slot_counts(pods))


def _slots_scarce(request: RouteRequest, taken: int, slots: int) -> bool:
    """`adapter_slots_scarce` from counts already taken (0 slots: no pod says how many it has, never scarce)."""
    return request.adapter is not None and slots > 0 and taken / slots >= SCARCE_SLOTS


def slots_in_use(pods: list[Candidate]) -> float:
    """The share of the pods' LoRA slots their active adapters take (0 when no pod says how many it has)."""
    taken, slots = slot_counts(pods)
    return taken / slots if slots else 0.0


def slot_counts(pods: list[Candidate]) -> tuple[int, int]:
    """The pods' LoRA slots their active adapters take, and their slots in all."""
    slots = taken = 0
    for p in pods:  # a loop, not two sums of generators: it runs two or three times a decision over every candidate
        max_lora = p.max_lora
        if max_lora:
            active = len(p.active_adapters)
            slots += max_lora
            taken += active if active < max_lora else max_lora
    return taken, slots


def predictions(pods: list[Candidate], request: RouteRequest, settings: RuleSettings) -> dict[str, Prediction]:
    """Each candidate's prediction, as the rule set decides and `explain` prints: one call, so they agree."""
    taken, slots = slot_counts(pods)
    output = sum([p.rates.mean_output_tokens for p in pods]) / len(pods) if pods else None
    return _predict_each(pods, request, tokens_per_block(request, settings),
                         max(request.prefix_matches.values(), default=0), _slots_scarce(request, taken, slots),
                         settings.residency_memory, output, 0 < request.served_adapters <= slots)


def run_predictions(pods: list[Candidate], run: DecisionRun) -> dict[str, Prediction]:
    """`predictions` for the parts of one decision: computed once for the same candidates (a prediction depends
    on the others through the slots in use, the best match and the mean answer, so another set is computed anew)."""
    if run.predicted is not None:
        seen, predicted = run.predicted  # the same views (a filter passes its input list on as it is)
        if seen is pods or (len(seen) == len(pods) and all(map(is_, seen, pods))):
            return predicted
    predicted = predictions(pods, run.request, run.settings)
    run.predicted = (pods, predicted)
    return predicted


@dataclass(slots=True)
class PodTerms:
    """What a prediction on a pod needs that no request changes (`pod_terms`). Computed once per view of the pod:
    a view lasts until the pod's next scrape or dispatch, so most decisions find it computed for most candidates."""

    generation_s: float
    """The pod's mean generation: its decode step times its mean answer."""
    queued: int
    """The requests it reported waiting that are still queued."""
    sent: int
    """The requests sent since its scrape: they join the next prefill step."""
    queue_s: float
    """The sent ones' prefill steps, and half the decode step in flight when the pod is busy."""
    kv_used: float
    """Tokens its KV cache holds (0 when the page did not say how big the cache is, or said more free than in all)."""
    held: float
    """`kv_used`, at least 1: what the room term divides by."""
    per_running: float
    """Tokens each running request holds there, on average (`held` over the running requests; 0 when none runs)."""
    step_s: float
    """Its decode step with one more request in the batch (`cost.expected_step_s` times its decode factor)..."""
    step_s_per_token: float
    """...and what each token that request brings adds to it."""
    prefill_s_per_token: float
    """The seconds a token of prefill takes there (what the prompts still being computed free per second)."""
    batch_harm_s: float
    """What a new adapter in its running batch costs the running requests (`cost.batch_harm_s`)."""
    queue_s_per_request: float
    """How long each request it reported waiting holds admission there (`PodRates.queue_s_per_request`)."""
    kv_free: int | None
    """Tokens its KV cache had free, where the page said how big the cache is (None: the room term is left out)."""


def pod_terms(p: Candidate) -> PodTerms:
    """`p`'s `PodTerms`, kept on the view (`Candidate.terms`)."""
    terms = p.terms
    if terms is None:
        rates = p.rates
        queued = p.reported_waiting if p.reported_waiting < p.waiting else p.waiting
        sent = p.waiting - queued
        queue_s = sent * rates.prefill_s(0) if sent else 0.0
        if p.waiting or p.running:
            queue_s += rates.decode_step_s / 2
        free, size = p.kv_free_tokens, p.kv_cache_tokens
        kv_used = size - free if free is not None and size and size > free else 0.0
        held = kv_used if kv_used > 1.0 else 1.0
        factor = rates.decode_factor
        terms = p.terms = PodTerms(rates.decode_step_s * rates.mean_output_tokens, queued, sent, queue_s, kv_used,
                                   held, held / p.running if p.running else 0.0,
                                   factor * expected_step_s(p.running + p.waiting + 1, kv_used),
                                   factor * DECODE_S_PER_KV_TOKEN, rates.prefill_factor * PREFILL_S_PER_TOKEN,
                                   batch_harm_s(p.running, rates),
                                   rates.queue_s_per_request, free if size else None)
    return terms


def predict(p: Candidate, request: RouteRequest, tokens_per_block: float, best_match: int,
            slots_scarce: bool = False, residency_memory: int = 2, output_tokens: float | None = None,
            every_adapter_fits: bool = False) -> Prediction:
    """The request's predicted first token on `p` (the module's docstring says why each term). `slots_scarce`:
    most of the fleet's LoRA slots are taken, so every slot taken is one another adapter is likely to wait for
    (the slot term then grows with the pod's share of slots in use, not its square). `residency_memory`: how many
    times its slots the pod's remembered adapters may number (`Settings.residency_memory`). `output_tokens`: the
    answer's expected length, alike on every candidate (the candidates' mean; the pod's own when None), so one
    pod's noisier rate does not move the generation term. `every_adapter_fits`: the candidates' LoRA slots number at
    least the served adapters, so an adapter waiting for a slot on a pod is one another pod could run now."""
    return _predict_each([p], request, tokens_per_block, best_match, slots_scarce, residency_memory, output_tokens,
                         every_adapter_fits)[p.key]


def _predict_each(pods: list[Candidate], request: RouteRequest, tokens_per_block: float, best_match: int,
                  slots_scarce: bool, residency_memory: int, output_tokens: float | None,
                  every_adapter_fits: bool) -> dict[str, Prediction]:
    """`predict` for each of `pods`. It runs for every candidate of a decision (64 pods: most of a decision's time),
    so it is one loop: what no pod changes is read once, what no request changes once per view of the pod
    (`pod_terms`), and it compares with `<` rather than calling `min` and `max`."""
    blocks = request.prefix_blocks
    prompt = blocks * tokens_per_block
    matched = request.prefix_matches.get if request.prefix_matches else None
    computing = request.prefilling.get if request.prefilling else None
    adapter = request.adapter
    served = request.served_adapters
    out: dict[str, Prediction] = {}
    for p in pods:
        pod = p.terms
        if pod is None:
            pod = pod_terms(p)
        active, max_lora = p.active_adapters, p.max_lora
        held = matched(p.key, 0) if matched is not None else 0
        uncached = (blocks - held) * tokens_per_block if held < blocks else 0.0
        generation_s = pod.generation_s
        queued = pod.queued

        adapter_s = harm_s = 0.0
        if adapter is not None and adapter not in active:
            if adapter not in p.resident_adapters:
                adapter_s = ADAPTER_LOAD_S
                if max_lora and served > residency_memory * max_lora:
                    # The fleet serves more adapters than a pod keeps at hand: one it has not run lately is on
                    # disk. vLLM loads it within a step, so the queue there waits for it too; and it evicts the
                    # adapter the pod ran least lately, whose next request there loads from disk in turn.
                    adapter_s += COLD_ADAPTER_S
                    harm_s = (queued + 1) * COLD_ADAPTER_S
            if max_lora and len(active) >= max_lora:  # no free slot: after the adapters already waiting for one
                adapter_s += (1 + (len(active) - max_lora) / max_lora) * generation_s / 2
            if active:
                harm_s += pod.batch_harm_s
                if max_lora:  # and it takes a slot: another adapter's next request may find none (half a generation)
                    share = len(active) / max_lora if len(active) < max_lora else 1.0
                    harm_s += (share if slots_scarce else share * share) * generation_s / 2
        elif adapter is not None and max_lora:
            in_slots = p.running_adapters
            if every_adapter_fits and in_slots is not None and adapter not in in_slots and len(in_slots) >= max_lora:
                # Its requests there wait for a slot (vLLM passes over them while every slot holds another adapter):
                # as long as a new adapter would, behind the other adapters waiting there, but it takes no slot anew.
                waiting_adapters = len(active) - len(in_slots) - 1
                adapter_s = (1 + (waiting_adapters if waiting_adapters > 0 else 0) / max_lora) * generation_s / 2
            elif len(active) > max_lora:
                # vLLM admits a request whose adapter runs past those waiting for a slot: only its share of the
                # queue is ahead of it (about one adapter's in every distinct adapter there)
                queued = queued / len(active)

        computing_s = computing(p.key, 0.0) if computing is not None else 0.0
        queue_s = computing_s + queued * pod.queue_s_per_request + pod.queue_s

        room_s = 0.0
        free = pod.kv_free
        if free is not None:
            # The requests ahead take room first: those still computing (at the pod's prefill speed), and each one
            # waiting what a running request holds, or at least this prompt; then its own uncached tokens.
            per_request = pod.per_running if pod.per_running > prompt else prompt
            ahead = (queued + pod.sent) * per_request
            if computing_s:
                per_token = pod.prefill_s_per_token
                ahead += computing_s / (per_token if per_token > 1e-12 else 1e-12)
            shortfall = uncached + ahead - free
            if shortfall > 0:  # the first request to end comes after about a whole generation, then one per share
                generations = 1.0 + shortfall / pod.held
                room_s = (generations if generations < ROOM_GENERATIONS else ROOM_GENERATIONS) * generation_s

        output = output_tokens if output_tokens is not None else p.rates.mean_output_tokens
        generation = GENERATION_SHARE * output * (pod.step_s + pod.step_s_per_token * (prompt + output / 2))

        if best_match > held:
            harm_s += copy_harm_s(p.rates, (best_match - held) * tokens_per_block)
        out[p.key] = Prediction(adapter_s, queue_s, room_s,
                                p.rates.prefill_s(uncached),
                                harm_s, int(uncached), generation)
    return out
