"""The scheduling core: rules over a snapshot of pod metrics.

No I/O and no clocks: given the same candidates, request, settings and seeded RNG, a decision is
always the same. The LiteLLM adapter (`strategy.py`), the fast simulator and `explain` all call
`choose_pod` so that what is benchmarked is what serves traffic.

The default rule set, ``lora-affinity``: the endpoint picker's thresholds and shedding, but adapter
placement that keeps few distinct adapters per replica, remembers resident adapters, and spills a hot
adapter to a new replica only when its holders are clearly busier than the fleet (their load counted at
their speed); the longest cached prompt prefix, among pods not far busier than the least busy one; and,
among the pods these rules allow, the least estimated cost in seconds (`cost.py`, at each pod's learned
rates, `rates.py`). The other rule sets (the picker's v0.2 tree, the previous default, the peers'
prefix-aware policies) are in `other_rule_sets.py`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .cost import DEFAULT_RATES, CostParts, PodRates, cache_wait_s, cost_terms, estimate
from .prefixes import rendezvous
from .rates import PodCounters
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
    counters: PodCounters | None = None
    """Histogram sums and counts, token counters: the scraper learns the pod's rates from their deltas."""


@dataclass(slots=True)
class Candidate:
    """A pod as the rules see it: scraped metrics plus what this gateway sent since the scrape.

    Read-only by convention, not frozen: a frozen dataclass sets each field through `object.__setattr__`, which
    made building one 2 µs slower, and a request builds one or two (`with_dispatches`)."""

    key: str
    waiting: int
    running: int
    kv_cache_usage: float
    active_adapters: frozenset[str]
    resident_adapters: frozenset[str] = frozenset()
    max_lora: int | None = None
    reported_waiting: int = 0
    """The queue the pod itself reported at its last scrape (`waiting` adds the dispatches since)."""
    rates: PodRates = DEFAULT_RATES
    """The pod's learned speeds (`rates.py`), which the cost estimate (`cost.py`) uses."""
    slowness: float = 1.0
    """How much slower than the fleet's median pod it runs (`cost.relative_slowness`); 1.0 within the noise."""
    kv_free_tokens: int | None = None
    """Tokens its KV cache had free at the scrape (None: the page did not say how big the cache is)."""
    load: int = field(init=False, repr=False, compare=False)
    """waiting + running (a field, not a property: the rules read it for every pod at every step)."""

    def __post_init__(self) -> None:
        self.load = self.waiting + self.running

    def with_dispatches(self, queued: int, adapters: set[str]) -> Candidate:
        """This pod with `queued` more waiting requests and their `adapters` active (a view of the pod after
        the dispatches no scrape has seen yet). Built directly: `dataclasses.replace` costs three times as
        much, and every request renews the view of the pod it went to."""
        return Candidate(key=self.key, waiting=self.waiting + queued, running=self.running,
                         kv_cache_usage=self.kv_cache_usage,
                         active_adapters=self.active_adapters | adapters if adapters else self.active_adapters,
                         resident_adapters=self.resident_adapters, max_lora=self.max_lora,
                         reported_waiting=self.reported_waiting, rates=self.rates, slowness=self.slowness,
                         kv_free_tokens=self.kv_free_tokens)

    def has_free_slot(self) -> bool:
        # max_lora unknown (None) or 0 (LoRA off, or an old server) never blocks placement.
        return not self.max_lora or len(self.active_adapters) < self.max_lora


@dataclass(slots=True)
class RouteRequest:
    """One request as the rules see it (`FleetView.route_request`). Read-only by convention, not frozen: one is built
    for every request, and frozen would cost 2 µs more (see `Candidate`)."""

    adapter: str | None
    """None for a base-model request: the LoRA rules are skipped."""
    sheddable: bool = False
    prefix_blocks: int = 0
    """Full blocks in the prompt's prefix chain (prefixes.prefix_hashes)."""
    prefix_matches: Mapping[str, int] = field(default_factory=dict)
    """Leading blocks of that chain each pod should still hold (absent: none)."""
    placement_key: int | None = None
    """Gateways rank equally good pods by this key (rendezvous hashing), so they agree without talking."""
    prefix_sizes: Mapping[str, int] = field(default_factory=dict)
    """Blocks each pod's index holds (the sglang-cache-aware reference needs them)."""
    prefix_hashes: tuple[int, ...] = ()
    """The chain itself: the chosen pod will hold it (FleetView.note_prefix)."""
    gateways: int = 1
    """Gateway processes routing for this fleet (this one and the peers sharing through Redis)."""
    home: str | None = None
    """The pod the served adapters, dealt over the candidates in order, give this adapter."""
    dealt_adapters: int = 0
    """How many adapters that deal covers (the fleet serves)."""
    instructions_blocks: int = 0
    """About how many full blocks the prompt's first message fills when it is the app's instructions (a
    `system` or `developer` message): the part that comes back with every request of the app."""
    later_turn: bool = False
    """The prompt carries an earlier turn of its conversation (an `assistant` message)."""


@dataclass(slots=True)
class Decision:
    pod: str
    branch: str
    trace: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    costs: dict[str, CostParts] = field(default_factory=dict)
    """Explaining a `lora-affinity` decision: each candidate's estimated cost, part by part."""


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

    __slots__ = ("rng", "trace", "disabled", "width", "key", "costs", "considered")

    def __init__(self, rng: random.Random, explain: bool, settings: Settings, key: int | None = None) -> None:
        self.rng = rng
        self.trace: list[tuple[str, tuple[str, ...]]] | None = [] if explain else None
        self.disabled = settings.disabled_rules
        self.width = settings.band_width
        self.key = key
        self.costs: dict[str, CostParts] = {}
        self.considered: list[Candidate] = []
        """The candidates the decision started from (explaining only): each one's cost is shown."""

    def apply(self, name: str, pods: list[Candidate], kept: list[Candidate]) -> list[Candidate]:
        """Fail open: a filter that leaves nobody (or is disabled) passes its input on."""
        out = pods if not kept or (self.disabled and name in self.disabled) else kept
        if self.trace is not None:
            self.trace.append((name, tuple(p.key for p in out)))
        return out

    def pick(self, pods: list[Candidate], branch: str, agree: bool = False) -> Decision:
        """One of equals: by rendezvous hash when gateways should agree, else at random."""
        if len(pods) == 1:
            chosen = pods[0]
        elif agree and self.key is not None:
            key = self.key
            chosen = max(pods, key=lambda p: rendezvous(key, p.key))
        else:
            chosen = pods[self.rng.randrange(len(pods))]
        return Decision(chosen.key, branch, self.trace or [], self.costs)


def least_band_int(values: Sequence[int], width: float = 1.0) -> int:
    """Upper edge of the "least" band `[min, min + (max - min) // N]` for integer metrics."""
    lo, hi = min(values), max(values)
    return lo + (hi - lo) // len(values) if width == 1.0 else lo + int((hi - lo) * width / len(values))


def least_band_float(values: Sequence[float], width: float = 1.0) -> float:
    lo, hi = min(values), max(values)
    return lo + (hi - lo) * width / len(values)


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
    run = _Run(rng, explain, settings, request.placement_key)
    if explain:
        run.considered = pods
    if request.sheddable and settings.shedding:
        pods = _sheddable_capacity(pods, settings, run)
    if settings.rule_set == "lora-affinity":
        return _lora_affinity(pods, request, settings, run)
    from .other_rule_sets import OTHER_RULE_SETS  # (imported here: that module builds on this one's filters)

    return OTHER_RULE_SETS[settings.rule_set](pods, request, settings, run)


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


# --- lora-affinity: our default ------------------------------------------------------------


def _lora_affinity(pods: list[Candidate], request: RouteRequest, settings: Settings, run: _Run) -> Decision:
    """One decision for every prompt, in a defended order.

    1. A short queue first (the picker's `low_queue`): a queue costs every request in it.
    2. For an adapter, where it can run at once: the pods running it, unless busier than the fleet by
       more than `spill_queue_margin`; a pod holding the prompt's longest prefix stays eligible up to
       `prefix_queue_margin` more, or, not running the adapter, with a free slot (`_warm_for_adapter`).
       When none of its holders can admit the request at the next step (a queue, or a cache too full for
       the prompt) and a pod that keeps a free slot after taking the adapter can, at clearly less cost,
       the adapter starts there (`_starts_sooner_elsewhere`). Else a pod that can take the adapter
       without starving a batch (dealt to it among peers, resident, a free slot, fewest adapters). With several
       gateways and more adapters than slots, the dealt pod first, unless far busier (`_dealt_while_slots_scarce`).
       vLLM's `--max-loras` skip rule makes a wrong adapter placement cost whole generations; a prefill costs tens
       to hundreds of ms.
    3. Among those, the longest cached prefix of the prompt; an unseen long prompt goes to one that admits
       it at the next step (no queue at its scrape, room in its cache for all of it) when any does, the
       fastest of those (all of it is computed: a half-speed pod doubles its prefill), since the load band
       alone weighs a queue of 6 behind a full cache like 6 running requests; then to the fastest and
       there where the caches hold least (it will stay where it lands).
       An unseen prompt that opens with the app's own instructions (`instructions_blocks`, at least
       `prefix_min_blocks`) is placed for the cache before the adapter (`_place_instructions`): every
       later request of that app matches it and follows it to its pod, so stacking an adapter's apps on
       the adapter's pods stacks their traffic; a text seen once draws nothing and keeps rule 2.
       A base-model conversation's next turn (an `assistant` message in it) whose history's pods all reported a
       queue goes by the cost among the pods not far busier (`_next_turn_by_cost`): recomputing its history
       elsewhere is one of the cost's parts.
    4. Least load; then least estimated cost in seconds (`cost.py`: the wait for the queue ahead, loading
       the adapter, prefilling what the pod does not hold, at each pod's learned speed, and the harm to
       others), which sends less to a slow pod; least KV use; gateways agree on new placements by
       rendezvous rank.
    """
    if run.trace is not None:  # explaining: every candidate's estimate, whichever rule decides
        best_match = max(request.prefix_matches.values(), default=0)
        run.costs = {p.key: cost_parts(p, request, settings, best_match) for p in run.considered}
    threshold = settings.queueing_threshold_lora  # (read once: a settings attribute costs more than the test)
    low_queue = [p for p in pods if p.waiting < threshold]
    pods = run.apply("low_queue", pods, low_queue)
    long_prompt = settings.prefix_affinity and request.prefix_blocks >= settings.prefix_min_blocks
    if request.adapter is None:
        if long_prompt:
            warm = _warm(pods, request, settings) if request.later_turn else None
            if warm and all(p.reported_waiting for p in warm):
                return _next_turn_by_cost(pods, request, settings, run)
            return _by_prefix(pods, request, settings, run, "base_model", warm)
        return _cheapest(pods, request, settings, run, "base_model")

    fleet_min = min([p.load for p in pods])
    dealt = _dealt_while_slots_scarce(pods, request, settings, fleet_min) if _deals(run) else None
    if dealt:
        return run.pick(run.apply("dealt", pods, dealt), "dealt")
    warm = _warm(pods, request, settings, fleet_min) if long_prompt else []
    if long_prompt and not warm and request.instructions_blocks >= settings.prefix_min_blocks:
        return _place_instructions(pods, request, settings, run)
    holders, roomy = _adapter_holders(pods, request.adapter, settings, fleet_min, by_speed=True)
    if long_prompt:
        roomy += _warm_for_adapter(warm, holders, roomy, fleet_min, settings)
    if roomy and _starts_sooner_elsewhere(pods, roomy, request, settings):
        if run.trace is not None:
            run.trace.append(("starts_sooner_elsewhere", tuple(p.key for p in pods)))
        roomy = []
    if roomy:
        pods = run.apply("adapter_active", pods, roomy)
        if not long_prompt:
            return _cheapest(pods, request, settings, run, "affinity")
        if not warm:  # an unseen prompt: the fastest of the pods running the adapter that admit it at the next step
            tokens = request.prefix_blocks * _tokens_per_block(settings)
            pods = run.apply("admits_now", pods, _fastest([p for p in pods if _admits_now(p, tokens)]))
        # The prefix then chooses within the band; a pod holding a longer match than any in it stays eligible
        # (the prefix rules' own queue margin judges it).
        pods = run.apply("least_load", pods, _with_longest_match(pods, _least_load(pods, run.width), request, settings))
        return _by_prefix(pods, request, settings, run, "affinity")

    return _place_adapter(pods, holders, request, settings, run, by_prefix=long_prompt, costed=True)


def _dealt_while_slots_scarce(pods: list[Candidate], request: RouteRequest, settings: Settings,
                              fleet_min: int) -> list[Candidate]:
    """With several gateways and more adapters than LoRA slots: the adapter's dealt pod, whoever else runs it,
    unless it is more than two spill margins busier than the least busy pod.

    Each gateway spills and places from its own partial view (its dispatches since the peers' last share), so
    where slots are scarce they start adapters on the same free slots and scatter them: 3 gateways completed 4.9%
    fewer requests than one on scarce-slots (seed prompts, 20 seeds), twice as many placements. Kept on the deal
    they agree (-1.1%). Not where every adapter fits: there an adapter is placed once and stays (`_place_adapter`)."""
    if request.gateways == 1 or request.home is None or not _slots_scarce(pods, request):
        return []
    edge = fleet_min + 2 * settings.spill_queue_margin
    return [p for p in pods if p.key == request.home and p.load <= edge]


def _next_turn_by_cost(pods: list[Candidate], request: RouteRequest, settings: Settings, run: _Run) -> Decision:
    """A base-model conversation's next turn whose history's pods all reported a queue: the least cost among the
    pods not far busier decides, not the match; among equals, the pod holding the history. Recomputing the
    history elsewhere, and the second copy it makes, are parts of the cost (`_cost_s`), so the turn leaves a queue
    only when waiting there costs more; and it leaves a pod the scrape saw queued, not one with requests just sent.

    Measured over 30 seeds on `mixed` (base-model chats beside adapters' long texts, whose prefills queue on the
    chats' pods): TTFT p90 at 4.5 req/s 2.22 to 1.83 s. On `multi-turn` (chats only, 20 seeds) TTFT p90 is kept
    or lower at every rate and the hit rate the same up to 9 req/s, 1.2 points lower past the fleet's limit
    (12 and 15 req/s). A first turn keeps the prefix rules: its system prompt is what the app's other chats
    match, and moving those (shared-prefix at 10 req/s) took TTFT p90 from 0.34 to 6 s.
    """
    pods = run.apply("roomy", pods, _not_far_busier(pods, settings))
    pods = run.apply("least_cost", pods, _least_cost(pods, request, settings))
    matches = request.prefix_matches
    held = max(matches.get(p.key, 0) for p in pods)  # among equals, where the history is: no second copy of it
    pods = run.apply("prefix_match", pods, [p for p in pods if matches.get(p.key, 0) == held])
    pods = run.apply("least_load", pods, _least_load(pods, run.width))
    return run.pick(pods, "next_turn", agree=True)


def _with_longest_match(pods: list[Candidate], banded: list[Candidate], request: RouteRequest,
                        settings: Settings) -> list[Candidate]:
    """`banded` plus the pods holding the prompt's longest cached prefix when none in `banded` holds as much
    (a chat's history is on one pod: a load band must not send its next turn to recompute it elsewhere), unless
    slower than the band's fastest."""
    matches = request.prefix_matches
    if not matches or max(matches.values()) < settings.prefix_min_blocks:  # (no match long enough anywhere)
        return banded
    best = max(matches.get(p.key, 0) for p in pods)
    if best < settings.prefix_min_blocks or any(matches.get(p.key, 0) == best for p in banded):
        return banded
    fastest = min(p.slowness for p in banded)  # a slower pod recomputes the rest slower too: it must win the band
    return banded + [p for p in pods if matches.get(p.key, 0) == best and p.slowness <= fastest]


def _starts_sooner_elsewhere(pods: list[Candidate], roomy: list[Candidate], request: RouteRequest,
                             settings: Settings) -> bool:
    """Whether to start the adapter on another pod now: none of its holders can admit the request at the next
    step (a queue, or a cache too full for the prompt) nor holds its prefix, a pod that keeps a free slot
    after taking the adapter can, and it costs clearly less there, the adapter's load and the harm to that
    pod's batch included. In a saturated fleet no pod admits it at once, and the adapter stays with its
    holders; it is the long unseen prompts of an adapter's tail that this moves off a full pod."""
    tokens_per_block = _tokens_per_block(settings)
    matches = request.prefix_matches

    def uncached(p: Candidate) -> float:
        return (request.prefix_blocks - matches.get(p.key, 0)) * tokens_per_block

    if any(matches.get(p.key, 0) >= settings.prefix_min_blocks for p in roomy):
        return False  # a holder holds its prefix: the prefix rules weigh that pod's queue
    admitting = [p.slowness for p in roomy if _admits_now(p, uncached(p))]
    if admitting and min(admitting) <= min(p.slowness for p in pods):
        return False  # a holder admits it at once, and no pod is faster
    adapter = request.adapter
    others = [p for p in pods if adapter not in p.active_adapters
              and (not p.max_lora or len(p.active_adapters) + 2 <= p.max_lora)  # still a free slot after it
              and _admits_now(p, uncached(p))]
    if not others or admitting and min(admitting) <= min(p.slowness for p in others):
        return False  # nobody else admits it now, or no faster pod would
    best_match = max(matches.values(), default=0)
    stay = min(_cost_s(p, request, settings, best_match) + cache_wait_s(p.rates, p.kv_free_tokens, uncached(p))
               for p in roomy)
    move = min(_cost_s(p, request, settings, best_match) for p in others)
    return move < min(stay - settings.cost_band_ms / 1000, stay / (1 + settings.cost_band_ratio))


def _tokens_per_block(settings: Settings) -> float:
    """About how many model tokens one prefix block of text holds (the index counts blocks, the cost tokens)."""
    return settings.prefix_block_chars / settings.prefix_chars_per_token


def _admits_now(p: Candidate, tokens: float) -> bool:
    """No queue at its scrape and room in its cache for the prompt: admitted at the next step (requests sent
    since the scrape join that step too)."""
    return p.reported_waiting == 0 and (p.kv_free_tokens is None or p.kv_free_tokens >= tokens)


def _adapter_holders(pods: list[Candidate], adapter: str, settings: Settings, fleet_min: int, by_speed: bool = False
                     ) -> tuple[list[Candidate], list[Candidate]]:
    """Pods running `adapter`, and those of them within spill_queue_margin of `fleet_min`, the least load of `pods`.

    `by_speed`: a pod's load counts at its `slowness`, so a pod running at half speed, which carries each
    request twice as long, spills its adapters at half the load."""
    holders = [p for p in pods if adapter in p.active_adapters]
    edge = fleet_min + settings.spill_queue_margin
    if by_speed:
        return holders, [p for p in holders if p.load * p.slowness <= edge]
    return holders, [p for p in holders if p.load <= edge]


def _place_adapter(pods: list[Candidate], holders: list[Candidate], request: RouteRequest, settings: Settings,
                   run: _Run, by_prefix: bool, costed: bool = False) -> Decision:
    """Place (or spill) the adapter where it adds the least contention: dealt to it among peers, a pod that
    still holds it, a free slot, the fewest distinct adapters; `by_prefix` then lets the prompt's prefix
    choose among those (the `lora-affinity-v1` reference places without it)."""
    adapter = request.adapter
    branch = "spill" if holders else "place"
    others = [p for p in pods if adapter not in p.active_adapters] or pods
    if request.gateways > 1 and request.home is not None and _deals(run):
        least = min(p.load for p in others)
        dealt = [p for p in others if p.key == request.home and p.load <= least + settings.spill_queue_margin]
        if dealt and by_prefix and not _slots_scarce(pods, request):
            # Every adapter fits: it is placed once and stays, with the sessions it draws, so the first
            # placement also looks at the caches (a dealt pod already holding other apps' prompts is
            # passed over for the rendezvous among the emptiest below). When slots are scarce adapters come
            # and go all the time, and the gateways' agreement is worth more.
            emptiest = {p.key for p in _fewest_prefixes(others, request, run.width)}
            dealt = [p for p in dealt if p.key in emptiest]
        if dealt:
            pods = run.apply("dealt", others, dealt)
            return run.pick(pods, branch)
    pods = run.apply("resident", others, [p for p in others if adapter in p.resident_adapters])
    pods = run.apply("free_slot", pods, [p for p in pods if p.has_free_slot()])
    if request.gateways > 1:
        # Peers place at the same moment from the same snapshot, each counting only its own dispatches:
        # exact balancing on that partial view disagrees. So every gateway deals the served adapters
        # over the pods the same way and starts an adapter on its dealt pod, if that one has a free
        # slot and is not far busier; else the adapter's rendezvous ranking chooses: all agree.
        least = min(p.load for p in pods)
        pods = run.apply("roomy", pods, [p for p in pods if p.load <= least + settings.spill_queue_margin])
        if by_prefix:
            pods, _ = _prefix_filters(pods, request, settings, run)
        return run.pick(pods, branch, agree=True)
    fewest = min(len(p.active_adapters) for p in pods)
    pods = run.apply("fewest_adapters", pods, [p for p in pods if len(p.active_adapters) == fewest])
    if by_prefix:
        pods, _ = _prefix_filters(pods, request, settings, run)
    if costed:
        return _cheapest(pods, request, settings, run, branch, agree=True)
    pods = run.apply("least_load", pods, _least_load(pods, run.width))
    pods = run.apply("least_kv", pods, _least_kv(pods, run.width))
    return run.pick(pods, branch, agree=True)


def _deals(run: _Run) -> bool:
    """`dealt` is a choice, not a filter: disabled, the adapter is placed by the other rules (passing its
    input on, as a disabled filter does, would pick among every pod at random)."""
    return not (run.disabled and "dealt" in run.disabled)


def _slots_scarce(pods: list[Candidate], request: RouteRequest) -> bool:
    """More adapters served than the pods have LoRA slots (unknown slot counts: not scarce)."""
    return request.dealt_adapters > sum(p.max_lora or request.dealt_adapters for p in pods)


def _warm_for_adapter(warm: list[Candidate], holders: list[Candidate], roomy: list[Candidate], fleet_min: int,
                      settings: Settings) -> list[Candidate]:
    """Of the `warm` pods (`_warm`), those the adapter rules would pass over, kept eligible:
    a holder up to `prefix_queue_margin` beyond the spill margin (the saved prefill is worth that much
    queue, no more: a hot adapter must still spread), and a pod not running the adapter that has a free
    slot (loading an adapter takes milliseconds, a prefill of the prefix hundreds)."""
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


def _place_instructions(pods: list[Candidate], request: RouteRequest, settings: Settings, run: _Run) -> Decision:
    """An adapter's prompt no pod holds that opens with the app's instructions: where the caches hold least
    among the fastest pods not far busier (`_prefix_filters`), then those running the adapter, else those
    with a free slot, the least-load band, and the rendezvous rank, so every gateway picks alike.

    Measured on shared-prefix (two system prompts per adapter), placing them on the adapter's pods
    saturated the fleet at 10 req/s in 26 of 60 seeds, this in 11 (the previous default's placement, 9).
    """
    return _adapter_then_least_load(_unseen_prefix_filters(pods, request, settings, run), request, run)


def _adapter_then_least_load(pods: list[Candidate], request: RouteRequest, run: _Run) -> Decision:
    """A new prefix's last steps: the pods running its adapter, else those with a free slot (a base-model
    prompt skips that), the least-load band, and the rendezvous rank, so every gateway picks alike."""
    adapter = request.adapter
    if adapter is not None:
        running = [p for p in pods if adapter in p.active_adapters]
        pods = run.apply("adapter_active", pods, running) if running else \
            run.apply("free_slot", pods, [p for p in pods if p.has_free_slot()])
    pods = run.apply("least_load", pods, _least_load(pods, run.width))
    return run.pick(pods, "new_prefix", agree=True)


def _cheapest(pods: list[Candidate], request: RouteRequest, settings: Settings, run: _Run, branch: str,
              agree: bool = False) -> Decision:
    """Step 4: least load; the least estimated cost (pods within `cost_band_ms` or `cost_band_ratio` of it are
    equal); least KV use; one of the equals."""
    if len(pods) > 1:
        pods = run.apply("least_cost", pods, _least_cost(pods, request, settings))
    pods = run.apply("least_load", pods, _least_load(pods, run.width))
    pods = run.apply("least_kv", pods, _least_kv(pods, run.width))
    return run.pick(pods, branch, agree)


def _least_cost(pods: list[Candidate], request: RouteRequest, settings: Settings) -> list[Candidate]:
    """The pods within `cost_band_ms` or `cost_band_ratio` of the least estimated cost (`_cost_s`)."""
    best_match = max(request.prefix_matches.values(), default=0)
    totals = [_cost_s(p, request, settings, best_match) for p in pods]
    least = min(totals)
    edge = max(least + settings.cost_band_ms / 1000, least * (1 + settings.cost_band_ratio))
    return [p for p, total in zip(pods, totals) if total <= edge]


def _cost_s(p: Candidate, request: RouteRequest, settings: Settings, best_match: int) -> float:
    tokens_per_block = _tokens_per_block(settings)
    held = request.prefix_matches.get(p.key, 0)
    return sum(cost_terms(waiting=p.waiting, queued=min(p.reported_waiting, p.waiting), running=p.running,
                          rates=p.rates, uncached_tokens=(request.prefix_blocks - held) * tokens_per_block,
                          duplicated_tokens=max(0, best_match - held) * tokens_per_block, adapter=request.adapter,
                          active=p.active_adapters, resident=p.resident_adapters))


def cost_parts(p: Candidate, request: RouteRequest, settings: Settings, best_match: int) -> CostParts:
    """The estimate for one candidate, part by part (for `explain`): the same terms `_cost_s` sums."""
    tokens_per_block = _tokens_per_block(settings)
    held = request.prefix_matches.get(p.key, 0)
    return estimate(waiting=p.waiting, queued=min(p.reported_waiting, p.waiting), running=p.running,
                    rates=p.rates, uncached_tokens=(request.prefix_blocks - held) * tokens_per_block,
                    duplicated_tokens=max(0, best_match - held) * tokens_per_block, adapter=request.adapter,
                    active=p.active_adapters, resident=p.resident_adapters)


def _prefix_filters(pods: list[Candidate], request: RouteRequest, settings: Settings, run: _Run,
                    warm: list[Candidate] | None = None) -> tuple[list[Candidate], bool]:
    """Among pods the adapter rules allow: the longest match (not far busier; `warm`, when the caller has it),
    else the fastest pods' emptiest caches. Returns the pods and whether a match chose them."""
    if warm is None:
        warm = _warm(pods, request, settings)
    if warm:
        return run.apply("prefix_match", pods, warm), True
    return _unseen_prefix_filters(pods, request, settings, run), False


def _unseen_prefix_filters(pods: list[Candidate], request: RouteRequest, settings: Settings,
                           run: _Run) -> list[Candidate]:
    """A prompt no pod holds: the pods not far busier, the fastest of them (all of it is computed), and of
    those the ones whose caches hold least (it stays where it lands)."""
    pods = run.apply("roomy", pods, _not_far_busier(pods, settings))
    pods = run.apply("fastest", pods, _fastest(pods))  # the whole prompt is computed: speed before cache room
    return run.apply("fewest_prefixes", pods, _fewest_prefixes(pods, request, run.width))


def _fastest(pods: list[Candidate]) -> list[Candidate]:
    """The pods of the least `slowness` (all of them in a fleet of equals: slowness is 1.0 within the noise)."""
    if not pods:
        return pods
    fastest = min(p.slowness for p in pods)
    return [p for p in pods if p.slowness == fastest]


def _by_prefix(pods: list[Candidate], request: RouteRequest, settings: Settings, run: _Run, branch: str,
               warm: list[Candidate] | None = None) -> Decision:
    """Steps 3-4 for a long prompt: a match is named `prefix`, an unseen base-model prompt `new_prefix`."""
    pods, matched = _prefix_filters(pods, request, settings, run, warm)
    if matched:
        branch = "prefix"
    elif branch == "base_model":  # a new prefix: gateways agree where it lands
        branch = "new_prefix"
    return _cheapest(pods, request, settings, run, branch, agree=True)


def _not_far_busier(pods: list[Candidate], settings: Settings, among: list[Candidate] | None = None,
                    least: int | None = None) -> list[Candidate]:
    """Pods (of `among`, default all) not far busier than `pods`' least busy: a pod is far busier when it reported
    a queue longer than the shortest by more than one request (a request just sent, or one waiting for the next
    step, is not a queue) and its load is beyond both `prefix_queue_margin` above the least and
    `prefix_queue_ratio` times it. `least`: `pods`' least load, when the caller has it."""
    if least is None:
        least = min([p.load for p in pods])
    edge = max(least + settings.prefix_queue_margin, least * settings.prefix_queue_ratio)
    queue_edge = min([p.reported_waiting for p in pods]) + 1  # one waiting request is the next step's admission
    return [p for p in (pods if among is None else among) if p.load <= edge or p.reported_waiting <= queue_edge]


def _fewest_prefixes(pods: list[Candidate], request: RouteRequest, width: float) -> list[Candidate]:
    """A new prefix goes where it evicts least: the pods whose caches are known to hold the least."""
    get = request.prefix_sizes.get
    sizes = [get(p.key, 0) for p in pods]
    edge = least_band_int(sizes, width)
    return [p for p, size in zip(pods, sizes) if size <= edge]


def _warm(pods: list[Candidate], request: RouteRequest, settings: Settings, least: int | None = None
          ) -> list[Candidate]:
    """Pods holding the longest prefix among those not far busier than the least busy one (`_not_far_busier`).

    Reuse saves the matched tokens' prefill and keeps one copy of the prefix in the fleet; a queue
    costs every request in it. So a match wins only on a pod not far busier than the least loaded,
    and a busier pod with a longer match loses to a roomier one with a shorter match (or none: then
    the prompt is placed as new). (The holders are few: the load test runs on them alone.)
    """
    matches = request.prefix_matches
    if not matches or max(matches.values()) < settings.prefix_min_blocks:  # (no match long enough anywhere)
        return []
    holders = [p for p in pods if p.key in matches]
    if not holders:
        return []
    held = [(matches[p.key], p) for p in _not_far_busier(pods, settings, among=holders, least=least)]
    best = max((n for n, _ in held), default=0)
    if best < settings.prefix_min_blocks:
        return []
    return [p for n, p in held if n == best]
