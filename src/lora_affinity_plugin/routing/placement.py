"""What the rules compute about pods: the bands, who holds a prompt's prefix, who is far busier, who runs an
adapter, what a request costs where. Pure functions over candidates; the parts (`filters.py`, `scorers.py`,
`conditions.py`) are built on them, and so can a new part be.
"""

from __future__ import annotations

from typing import Sequence

from .cost import CostParts, cache_wait_s, cost_terms, estimate
from .decision import Candidate, RouteRequest, RuleSettings
from .podstate import PREFILL_S_PER_TOKEN


def least_band_int(values: Sequence[int], width: float = 1.0) -> int:
    """Upper edge of the "least" band `[min, min + (max - min) // N]` for integer metrics (the endpoint picker's)."""
    lo, hi = min(values), max(values)
    return lo + (hi - lo) // len(values) if width == 1.0 else lo + int((hi - lo) * width / len(values))


def least_band_float(values: Sequence[float], width: float = 1.0) -> float:
    lo, hi = min(values), max(values)
    return lo + (hi - lo) * width / len(values)


def cost_band_edge(least: float, settings: RuleSettings) -> float:
    """The most a cost in seconds may be and count as equal to `least`: within `cost_band_ms` or `cost_band_ratio`
    of it (learned rates carry noise)."""
    return max(least + settings.cost_band_ms / 1000, least * (1 + settings.cost_band_ratio))


def tokens_per_block(request: RouteRequest, settings: RuleSettings) -> float:
    """About how many model tokens one prefix block of text holds (the index counts blocks, the cost tokens): at
    the ratio learned from the candidates' engines, else the settings' `prefix_chars_per_token`."""
    return settings.prefix_block_chars / (request.chars_per_token or settings.prefix_chars_per_token)


def admits_now(p: Candidate, tokens: float) -> bool:
    """No queue at its scrape and room in its cache for the prompt: admitted at the next step (requests sent
    since the scrape join that step too)."""
    return p.reported_waiting == 0 and (p.kv_free_tokens is None or p.kv_free_tokens >= tokens)


LARGE_PROMPT_SHARE = 0.2
"""A prompt this share of a pod's KV cache or more is large there: when the cache is full, room for it frees only as
whole running requests end."""


def large_there(p: Candidate, prompt_tokens: float) -> bool:
    """The prompt is large on `p` (`LARGE_PROMPT_SHARE` of its cache or more); never where the pod reports no size."""
    return bool(p.kv_cache_tokens) and prompt_tokens >= LARGE_PROMPT_SHARE * p.kv_cache_tokens


def waits_for_room(p: Candidate, prompt_tokens: float, uncached_tokens: float) -> bool:
    """The pod's cache (at its scrape) has no room for the `uncached_tokens` it must compute, and the prompt is large
    there (`LARGE_PROMPT_SHARE`): it waits for running requests to end, seconds, not one step. A small prompt finds
    room as soon as any request ends."""
    free, size = p.kv_free_tokens, p.kv_cache_tokens
    return (free is not None and size is not None and uncached_tokens > free
            and prompt_tokens >= LARGE_PROMPT_SHARE * size)


def pod_cost(p: Candidate, request: RouteRequest, settings: RuleSettings, best_match: int, *,
             parts: bool = False) -> tuple[float, float, float, float] | CostParts:
    """The request's estimated cost on `p` (`cost.py`): the four terms, or with `parts` what `explain` prints.
    `best_match`: the longest prefix any pod holds (a shorter one here copies the rest a second time)."""
    per_block = tokens_per_block(request, settings)
    held = request.prefix_matches.get(p.key, 0)
    return (estimate if parts else cost_terms)(
        waiting=p.waiting, queued=min(p.reported_waiting, p.waiting), running=p.running, rates=p.rates,
        uncached_tokens=(request.prefix_blocks - held) * per_block,
        duplicated_tokens=max(0, best_match - held) * per_block, adapter=request.adapter,
        active=p.active_adapters, resident=p.resident_adapters)


def cost_s(p: Candidate, request: RouteRequest, settings: RuleSettings, best_match: int) -> float:
    return sum(pod_cost(p, request, settings, best_match))  # type: ignore[arg-type]


def fewest_prefixes(pods: list[Candidate], request: RouteRequest, width: float) -> list[Candidate]:
    """A new prefix goes where it evicts least: the pods whose caches are known to hold the least."""
    get = request.prefix_sizes.get
    sizes = [get(p.key, 0) for p in pods]
    edge = least_band_int(sizes, width)
    return [p for p, size in zip(pods, sizes) if size <= edge]


def longest_match_holders(pods: list[Candidate], request: RouteRequest, settings: RuleSettings) -> list[Candidate]:
    """The pods holding the prompt's longest cached prefix, when it is at least `prefix_min_blocks` long (every
    chat shares its first few characters); none otherwise."""
    matches = request.prefix_matches
    if not matches:
        return []
    get = matches.get
    best, holders = settings.prefix_min_blocks, []
    for p in pods:  # one pass: it runs for every candidate, two or three times a decision
        blocks = get(p.key, 0)
        if blocks >= best:
            if blocks > best:
                best, holders = blocks, []
            holders.append(p)
    return holders


def instructions_led(request: RouteRequest, settings: RuleSettings) -> bool:
    """The prompt is mostly an app's instructions: its `system` or `developer` first message is at least
    `prefix_min_blocks` long and fills at least half of its prefix blocks. Where it first lands, the app's later
    requests follow it."""
    instructions = request.instructions_blocks
    return instructions >= settings.prefix_min_blocks and 2 * instructions >= request.prefix_blocks


def not_far_busier(pods: list[Candidate], settings: RuleSettings, among: list[Candidate] | None = None,
                   least: int | None = None) -> list[Candidate]:
    """Pods (of `among`, default all) not far busier than `pods`' least busy: a pod is far busier when it reported
    a queue longer than the shortest by more than one request (a request just sent, or one waiting for the next
    step, is not a queue) and its load (waiting + running) is beyond both `prefix_queue_margin` above the least
    and `prefix_queue_ratio` times it. `least`: `pods`' least load, when the caller has it."""
    if least is None:
        least = min([p.load for p in pods])
    edge = max(least + settings.prefix_queue_margin, least * settings.prefix_queue_ratio)
    queue_edge = min([p.reported_waiting for p in pods]) + 1  # one waiting request is the next step's admission
    return [p for p in (pods if among is None else among) if p.load <= edge or p.reported_waiting <= queue_edge]


def warm_pods(pods: list[Candidate], request: RouteRequest, settings: RuleSettings, least: int | None = None
              ) -> list[Candidate]:
    """Pods holding the longest prefix among those not far busier than the least busy one (`not_far_busier`).

    Reuse saves the matched tokens' prefill and keeps one copy of the prefix in the fleet; a queue costs every
    request in it. So a match wins only on a pod not far busier than the least loaded, and a busier pod with a
    longer match loses to a roomier one with a shorter match (or none: then the prompt is placed as new).
    """
    matches = request.prefix_matches
    if not matches or max(matches.values()) < settings.prefix_min_blocks:  # (no match long enough anywhere)
        return []
    holders = [p for p in pods if p.key in matches]
    if not holders:
        return []
    held = [(matches[p.key], p) for p in not_far_busier(pods, settings, among=holders, least=least)]
    best = max((n for n, _ in held), default=0)
    if best < settings.prefix_min_blocks:
        return []
    return [p for n, p in held if n == best]


def computing_tokens(p: Candidate, request: RouteRequest) -> float:
    """The prompt tokens `p` should still be computing for this gateway (`RouteRequest.prefilling`'s seconds at the
    pod's prefill speed): the in-flight uncached tokens as far as one gateway knows them (llm-d's token load)."""
    return request.prefilling.get(p.key, 0.0) / max(p.rates.prefill_factor * PREFILL_S_PER_TOKEN, 1e-12)


def prefill_estimate_s(p: Candidate, request: RouteRequest, settings: RuleSettings) -> float:
    """The request's prefill on `p`: the tokens of its prompt `p` does not hold, at `p`'s learned speed."""
    held = request.prefix_matches.get(p.key, 0)
    return p.rates.prefill_s((request.prefix_blocks - held) * tokens_per_block(request, settings))


def _first_token_s(p: Candidate, request: RouteRequest, settings: RuleSettings) -> float:
    """When `p` would start the request: the prompts it is still computing, its wait, the adapter's load, the
    prefill of what it does not hold."""
    wait, adapter_s, prefill, _ = pod_cost(p, request, settings, 0)  # type: ignore[misc]
    return request.prefilling.get(p.key, 0.0) + wait + adapter_s + prefill


def outpaced(warm: list[Candidate], pods: list[Candidate], request: RouteRequest, settings: RuleSettings) -> bool:
    """Every holder of the longest prefix is slower than a pod that holds none of it, admits the whole prompt now
    and would start it sooner than the holders start the rest, by more than the work it adds: that pod's prefill of
    the whole prompt, times the share of the faster pods that are busy (running, queued, or computing prompts this
    gateway sent). An app's instructions held on one half-speed pod would otherwise draw the app's every new
    prompt there, while a full-speed pod sits idle; under load the fast pods' time is worth more than the seconds
    saved. In a fleet of equals no pod is faster, and the holders keep their prompts."""
    least_slowness = min(p.slowness for p in warm)
    faster = [p for p in pods if p.slowness < least_slowness and p.key not in request.prefix_matches]
    if not faster:
        return False
    whole = request.prefix_blocks * tokens_per_block(request, settings)
    starts = [(_first_token_s(p, request, settings), p) for p in faster if admits_now(p, whole)]
    if not starts:
        return False
    start, target = min(starts, key=lambda pair: pair[0])
    gain = min(_first_token_s(p, request, settings) for p in warm) - start
    busy = sum(1 for p in faster if p.load > 0 or p.key in request.prefilling) / len(faster)
    return gain > busy * target.rates.prefill_s(whole)


def fastest(pods: list[Candidate]) -> list[Candidate]:
    """The pods of the least `slowness` (all of them in a fleet of equals: slowness is 1.0 within the noise)."""
    if not pods:
        return pods
    least = min(p.slowness for p in pods)
    return [p for p in pods if p.slowness == least]


def soonest_start(pods: list[Candidate], request: RouteRequest, settings: RuleSettings) -> list[Candidate]:
    """The pods that would start the prompt soonest (`_first_token_s`, within the cost band), where speeds differ:
    the fastest pod is the best place for an unseen prompt until what it is computing and its queue cost more
    than a slower pod's whole prefill. Pods of one speed are all kept: load and cost decide after."""
    if len(pods) < 2 or min(p.slowness for p in pods) == max(p.slowness for p in pods):
        return pods
    starts = [_first_token_s(p, request, settings) for p in pods]
    edge = cost_band_edge(min(starts), settings)
    return [p for p, start in zip(pods, starts) if start <= edge]


def adapter_holders(pods: list[Candidate], adapter: str, settings: RuleSettings, fleet_min: int, by_speed: bool = False
                    ) -> tuple[list[Candidate], list[Candidate]]:
    """Pods running `adapter`, and those of them within `spill_queue_margin` of `fleet_min`, the least load.

    `by_speed`: a pod's load counts at its `slowness`, so a pod running at half speed, which carries each
    request twice as long, spills its adapters at half the load."""
    holders = [p for p in pods if adapter in p.active_adapters]
    edge = fleet_min + settings.spill_queue_margin
    if by_speed:
        return holders, [p for p in holders if p.load * p.slowness <= edge]
    return holders, [p for p in holders if p.load <= edge]


def slots_scarce(pods: list[Candidate], adapters: int) -> bool:
    """More `adapters` than the pods have LoRA slots (a pod that does not say how many it has could hold them all:
    not scarce). It asks for every adapter's request, so it stops counting once the slots counted hold them all."""
    slots = 0
    for p in pods:
        if slots >= adapters:
            return False
        slots += p.max_lora or adapters
    return adapters > slots


def warm_for_adapter(warm: list[Candidate], holders: list[Candidate], roomy: list[Candidate], fleet_min: int,
                     settings: RuleSettings) -> list[Candidate]:
    """Of the `warm` pods, those the adapter rules would pass over, kept eligible: a holder up to
    `prefix_queue_margin` beyond the spill margin (the saved prefill is worth that much queue, no more: a hot
    adapter must still spread), and a pod not running the adapter that has a free slot (loading an adapter
    takes milliseconds, a prefill of the prefix hundreds)."""
    if not warm:
        return []
    edge = fleet_min + settings.spill_queue_margin + settings.prefix_queue_margin
    roomy_keys, holder_keys = {p.key for p in roomy}, {p.key for p in holders}  # (keys: comparing candidates is slow)
    extra = []
    for p in warm:
        if p.key in roomy_keys:
            continue
        if p.key in holder_keys and p.load <= edge or p.key not in holder_keys and p.has_free_slot():
            extra.append(p)
    return extra


def starts_sooner_elsewhere(pods: list[Candidate], roomy: list[Candidate], request: RouteRequest,
                            settings: RuleSettings) -> bool:
    """Whether to start the adapter on another pod now: none of its holders can admit the request at the next
    step (a queue, or a cache too full for the prompt), a pod that keeps a free slot after taking the adapter
    can, and it costs clearly less there, the adapter's load and the harm to that pod's batch included. A holder
    of the prompt's prefix keeps it unless that holder waits for cache room for a large prompt
    (`waits_for_room`): then the saved prefill is worth less than the wait. In a saturated fleet no pod admits
    it at once and the adapter stays with its holders; it is the long prompts of an adapter's tail that this
    moves off a full pod."""
    per_block = tokens_per_block(request, settings)
    matches = request.prefix_matches
    prompt = request.prefix_blocks * per_block

    def uncached(p: Candidate) -> float:
        return (request.prefix_blocks - matches.get(p.key, 0)) * per_block

    if any(matches.get(p.key, 0) >= settings.prefix_min_blocks and not waits_for_room(p, prompt, uncached(p))
           for p in roomy):
        return False  # a holder holds its prefix: the prefix rules weigh that pod's queue
    admitting = [p.slowness for p in roomy if admits_now(p, uncached(p))]
    if admitting and min(admitting) <= min(p.slowness for p in pods):
        return False  # a holder admits it at once, and no pod is faster
    adapter = request.adapter
    others = [p for p in pods if adapter not in p.active_adapters
              and (not p.max_lora or len(p.active_adapters) + 2 <= p.max_lora)  # still a free slot after it
              and admits_now(p, uncached(p))]
    if not others or admitting and min(admitting) <= min(p.slowness for p in others):
        return False  # nobody else admits it now, or no faster pod would
    best_match = max(matches.values(), default=0)
    stay = min(cost_s(p, request, settings, best_match) + cache_wait_s(p.rates, p.kv_free_tokens, uncached(p))
               for p in roomy)
    move = min(cost_s(p, request, settings, best_match) for p in others)
    return cost_band_edge(move, settings) < stay  # (sooner by more than the band)
