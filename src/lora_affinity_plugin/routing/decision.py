"""The parts a decision is made of, and what they share: pods, the request, one decision in progress.

A rule set is a *profile*: a list of parts run in order over the candidate pods (`profiles.py`).

- A `Filter` keeps some pods. It fails open: keeping none (or disabled in `disabled_rules`) passes its
  input on, so a rule can narrow a choice but never empty it.
- A `Scorer` gives each pod a cost in the decision's currency (lower is better: seconds, a load, a
  negated score) and keeps the pods within its band of the least.
- A `Condition` is a question about the pods and the request; a `Branch` runs one list of parts or
  another on its answer (the endpoint picker's decision tree: a filter's success or failure chooses
  the next one).
- A `Picker` ends the decision: one of the pods left, at random or by rendezvous rank so that
  gateways agree without talking.

A part is a class with a `name`; defining it registers it (`PARTS`), and the settings' `profiles` can
then use it by that name. Parts are pure: no I/O, no clock; randomness only from the run's seeded RNG.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Mapping, Protocol, Sequence, Union

from ..kv.prefixes import rendezvous
from .cost import CostParts
from .podstate import DEFAULT_RATES, PodRates


class RuleSettings(Protocol):
    """What the rules read of the settings (`settings.Settings` has it all): named here, so the rules need not
    import the settings, which import the rules to validate a profile."""

    rule_set: str
    disabled_rules: Sequence[str]
    band_width: float
    cost_band_ms: float
    cost_band_ratio: float
    spill_queue_margin: int
    queueing_threshold_lora: int
    lora_affinity_threshold: float
    kv_cache_threshold: float
    queue_threshold_critical: int
    shedding: bool
    prefix_affinity: bool
    prefix_min_blocks: int
    prefix_queue_margin: int
    prefix_queue_ratio: float
    prefix_block_chars: int
    prefix_chars_per_token: float
    residency_memory: int

    def built_profiles(self) -> dict[str, Any]: ...

NO_SOURCES: Mapping[str, str] = MappingProxyType({})
"""No pod's match came from its engine's events (shared: a request builds none)."""


@dataclass(slots=True)
class Candidate:
    """A pod as the rules see it: scraped metrics plus what this gateway sent since the scrape.

    Read-only by convention, not frozen: a frozen dataclass sets each field through `object.__setattr__`, and a
    request builds one or two (`with_dispatches`) on the request path."""

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
    kv_cache_tokens: int | None = None
    """Tokens its KV cache holds in all (None: the page did not say)."""
    running_adapters: frozenset[str] | None = None
    """The adapters in its LoRA slots at the scrape (`active_adapters` less those only waiting for a slot; None:
    not known apart, every active adapter taken as running)."""
    load: int = field(init=False, repr=False, compare=False)
    """waiting + running (a field, not a property: the rules read it for every pod at every step)."""
    terms: Any = field(default=None, init=False, repr=False, compare=False)
    """What the predicted time to first token reads of this view alone (`ttft.pod_terms`): computed at its first
    decision, kept for the next ones."""

    def __post_init__(self) -> None:
        self.load = self.waiting + self.running

    def with_dispatches(self, queued: int, adapters: set[str]) -> Candidate:
        """This pod with `queued` more waiting requests and their `adapters` active (a view of the pod after
        the dispatches no scrape has seen yet). Built directly: `dataclasses.replace` costs several times as
        much, and every request renews the view of the pod it went to."""
        return Candidate(key=self.key, waiting=self.waiting + queued, running=self.running,
                         kv_cache_usage=self.kv_cache_usage,
                         active_adapters=self.active_adapters | adapters if adapters else self.active_adapters,
                         resident_adapters=self.resident_adapters, max_lora=self.max_lora,
                         reported_waiting=self.reported_waiting, rates=self.rates, slowness=self.slowness,
                         kv_free_tokens=self.kv_free_tokens, kv_cache_tokens=self.kv_cache_tokens,
                         running_adapters=self.running_adapters)

    def has_free_slot(self) -> bool:
        # max_lora unknown (None) or 0 (LoRA off, or an old server) never blocks placement.
        return not self.max_lora or len(self.active_adapters) < self.max_lora


@dataclass(slots=True)
class RouteRequest:
    """One request as the rules see it (`request_builder.RequestBuilder`). Read-only by convention, not frozen: one is built
    for every request, and frozen would cost more (see `Candidate`)."""

    adapter: str | None
    """None for a base-model request: the LoRA rules are skipped."""
    sheddable: bool = False
    prefix_blocks: int = 0
    """Full blocks in the prompt's prefix chain (prefixes.prefix_hashes)."""
    prefix_matches: Mapping[str, int] = field(default_factory=dict)
    """Leading blocks of that chain each pod should still hold (absent: none)."""
    placement_key: int | None = None
    """Gateways rank equally good pods by this key (rendezvous hashing), so they agree without talking."""
    match_sources: Mapping[str, str] = field(default_factory=dict)
    """Pods whose match came from their engine's KV events (`exact`; `partial`: the larger of those and the
    inferred index's, for a pod whose events were joined late); the others' from the inferred index."""
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
    served_adapters: int = 0
    """How many adapters the fleet serves (the pods' /v1/models, from discovery; 0: not known)."""
    instructions_blocks: int = 0
    """About how many full blocks the prompt's first message fills when it is the app's instructions (a
    `system` or `developer` message): the part that comes back with every request of the app."""
    later_turn: bool = False
    """The prompt carries an earlier turn of its conversation (an `assistant` message)."""
    chars_per_token: float | None = None
    """Characters a token of the candidates' tokenizer, learned from their engines' counts (None: not learned, the
    settings' `prefix_chars_per_token`)."""
    prefilling: Mapping[str, float] = field(default_factory=dict)
    """Seconds each pod should still spend computing the long prompts this gateway sent it (absent: none)."""


@dataclass(slots=True)
class Decision:
    pod: str
    branch: str
    trace: list[TraceStep] = field(default_factory=list)
    """Explaining: each part's output in order (`DecisionRun.apply`)."""
    costs: dict[str, CostParts] = field(default_factory=dict)
    """Explaining: each candidate's estimated cost, part by part (`cost.py`)."""


class SchedulingError(Exception):
    status_code = 500


class Shed(SchedulingError):
    """Every pod is over the sheddable thresholds: HTTP 429."""

    status_code = 429


class NoCapacity(SchedulingError):
    """No candidate pod at all: HTTP 503."""

    status_code = 503


TraceStep = tuple[str, tuple[str, ...], "dict[str, float] | None"]
"""One part's output when explaining: its rule name, the pods it passed on, and a scorer's value per pod."""


class DecisionRun:
    """One decision in progress: the request, the settings, the RNG, what the parts learned on the way
    (`fleet_min`, `warm`, `holders`, `adapter_roomy`, `dealt`: computed once, read by later parts), and the
    trace when explaining."""

    __slots__ = ("rng", "request", "settings", "trace", "disabled", "width", "key", "costs", "label",
                 "fleet", "fleet_min", "long_prompt", "warm", "holders", "adapter_roomy", "dealt", "predicted")

    def __init__(self, rng: random.Random, request: RouteRequest, settings: RuleSettings, explain: bool = False,
                 label: str = "") -> None:
        self.rng = rng
        self.request = request
        self.settings = settings
        self.trace: list[TraceStep] | None = [] if explain else None
        self.disabled = settings.disabled_rules
        self.width = settings.band_width
        self.key = request.placement_key
        self.costs: dict[str, CostParts] = {}
        self.label = label
        """The branch a picker without its own label reports (a profile's name)."""
        self.fleet: list[Candidate] = []
        self.fleet_min = 0
        self.long_prompt = settings.prefix_affinity and request.prefix_blocks >= settings.prefix_min_blocks
        self.warm: list[Candidate] = []
        self.holders: list[Candidate] = []
        self.adapter_roomy: list[Candidate] = []
        """The adapter's holders within the spill margin (`adapter_survey`): where `adapter_roomy` holds and
        `adapter_active` keeps. (The `roomy` rule is another question: pods not far busier than the least busy.)"""
        self.dealt: list[Candidate] = []
        self.predicted: tuple[list[Candidate], dict] | None = None
        """The last candidates' predictions (`ttft.run_predictions`): a filter and the scorer after it that see the
        same pods compute them once."""

    def apply(self, rule: str, pods: list[Candidate], kept: list[Candidate],
              values: dict[str, float] | None = None) -> list[Candidate]:
        """Fail open: a rule that keeps nobody (or is disabled) passes its input on."""
        out = pods if not kept or (self.disabled and rule in self.disabled) else kept
        if self.trace is not None:
            self.trace.append((rule, tuple(p.key for p in out), values))
        return out

    def note(self, rule: str, pods: list[Candidate]) -> None:
        """Record a step that is not a filter (a condition that changed the course), when explaining."""
        if self.trace is not None:
            self.trace.append((rule, tuple(p.key for p in pods), None))

    def enabled(self, rule: str) -> bool:
        return not (self.disabled and rule in self.disabled)

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


Outcome = Union[list[Candidate], Decision]
"""What a part returns: the pods it passes on, or the decision."""

PARTS: dict[str, type[Part]] = {}
"""Every part by name: what a profile in the settings can list."""


class Part:
    """One step of a decision. Subclasses set `name` (and `rule`, the name `disabled_rules` and `explain`
    use, when several parts implement one rule) and are registered by being defined."""

    name: ClassVar[str]
    rule: ClassVar[str] = ""
    kind: ClassVar[str] = "part"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            if not cls.__dict__.get("rule"):
                cls.rule = cls.name
            PARTS[cls.name] = cls

    def __call__(self, pods: list[Candidate], run: DecisionRun) -> Outcome:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class Filter(Part):
    kind = "filter"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        raise NotImplementedError

    def __call__(self, pods: list[Candidate], run: DecisionRun) -> Outcome:
        return run.apply(self.rule, pods, self.keep(pods, run))


class Scorer(Part):
    """A cost per pod (lower is better); as a step, keeps the pods whose cost is within `edge` of the least.
    One pod needs no scoring: it passes on untouched."""

    kind = "scorer"

    def costs(self, pods: list[Candidate], run: DecisionRun) -> list[float]:
        raise NotImplementedError

    def edge(self, costs: list[float], run: DecisionRun) -> float:
        """The highest cost kept (default: only the least)."""
        return min(costs)

    def __call__(self, pods: list[Candidate], run: DecisionRun) -> Outcome:
        if len(pods) < 2:  # nothing to choose between (shown when explaining, not scored)
            return pods if run.trace is None else run.apply(self.rule, pods, pods)
        costs = self.costs(pods, run)
        edge = self.edge(costs, run)
        kept = [p for p, cost in zip(pods, costs) if cost <= edge]
        values = None if run.trace is None else {p.key: round(c, 6) for p, c in zip(pods, costs)}
        return run.apply(self.rule, pods, kept, values)


class Condition(Part):
    kind = "condition"

    def test(self, pods: list[Candidate], run: DecisionRun) -> bool:
        raise NotImplementedError


class Picker(Part):
    kind = "picker"
    agree: ClassVar[bool] = False

    def __init__(self, branch: str = "") -> None:
        self.branch = branch

    def __call__(self, pods: list[Candidate], run: DecisionRun) -> Outcome:
        return run.pick(pods, self.branch or run.label, self.agree)


class Pick(Picker):
    """One of the pods left, at random."""

    name = "pick"


class PickAgreed(Picker):
    """One of the pods left by rendezvous rank on the request's placement key: every gateway picks alike."""

    name = "pick_agreed"
    agree = True


class Branch(Part):
    """Runs `then` when `when` holds, else `otherwise` (None: go on with the steps after the branch)."""

    kind = "branch"

    def __init__(self, when: Condition, then: Sequence[Part], otherwise: Sequence[Part] | None = None) -> None:
        self.when, self.then, self.otherwise = when, tuple(then), None if otherwise is None else tuple(otherwise)

    def __call__(self, pods: list[Candidate], run: DecisionRun) -> Outcome:
        if self.when.test(pods, run):
            return run_steps(self.then, pods, run)
        if self.otherwise is None:
            return pods
        return run_steps(self.otherwise, pods, run)

    def __repr__(self) -> str:
        return f"Branch({self.when!r}, {list(self.then)!r}, {None if self.otherwise is None else list(self.otherwise)!r})"


def run_steps(steps: Sequence[Part], pods: list[Candidate], run: DecisionRun) -> Outcome:
    """The parts in order, each on the pods the one before passed on, until one decides."""
    for step in steps:
        out = step(pods, run)
        if out.__class__ is Decision:
            return out
        pods = out  # type: ignore[assignment]
    return pods
