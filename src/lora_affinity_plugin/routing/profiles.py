"""Rule sets as profiles: lists of parts (`decision.py`; `filters.py`, `scorers.py`, `conditions.py`), run in order over the candidates.

``lora-affinity`` is the default: one predicted time to first token per candidate (``ttft.py``), after a few
filters for what one request's estimate cannot see (``predicted-ttft`` names the same steps). The others are kept so
that every change is measured against them: ``lora-affinity-tree`` (the previous default, a tree of rules),
``lora-affinity-v1`` (the one before), ``gie-v0.2`` (the Gateway API Inference Extension's endpoint
picker, as published), and the peers' prefix-aware policies (``llmd-prefix``, ``llmd-weights``, ``llmd-precise``,
``llmd-affinity``, ``dynamo``, ``sglang-cache-aware``, ``aibrix-prefix``, as those routers document them). The settings' `profiles` add more, by the same names
(`build_profiles`): a list of part names, other profiles' names (their steps, inlined) and
`{scorer: weight}` maps.
"""

from __future__ import annotations

import importlib
import math
from typing import Mapping, Sequence

from .conditions import (
    AdapterRoomy,
    AdapterRunningSomewhere,
    AdapterSurvey,
    BaseModel,
    DealtForPlacement,
    DealtNewAdapter,
    DealtWhileSlotsScarce,
    HasAdapter,
    HistoryQueued,
    LongPrompt,
    LowQueueAny,
    PickPlacement,
    PrefixHeld,
    PromptUnseen,
    SeveralGateways,
    SglangImbalanced,
    SglangMatches,
    UnseenInstructions,
)
from .decision import (
    PARTS,
    Branch,
    Candidate,
    Decision,
    DecisionRun,
    Part,
    Pick,
    PickAgreed,
    Scorer,
    run_steps,
)
from .filters import (
    AdapterActive,
    AdapterElsewhere,
    AdapterRunning,
    AdmitsNow,
    AibrixPrefixCache,
    Dealt,
    DocumentWeights,
    Fastest,
    FreeSlot,
    LeastLoadOrLongestMatch,
    LlmdPrefixAffinity,
    LoraSoftAffinity,
    LowCostLora,
    LowQueue,
    NewInstructions,
    NextTurnElsewhere,
    NoSlotQueueJoined,
    NotFarBusier,
    PrefixAffinityTtft,
    PrefixMatch,
    Resident,
    RoomyForPlacement,
    SoonestStart,
)
from .scorers import (
    LLMD_WEIGHTED,
    DynamoCost,
    FewestAdapters,
    FewestPrefixes,
    FewestSlotContenders,
    HistoryMatch,
    KvScore,
    LeastCost,
    LeastKv,
    LeastLoad,
    LeastLoadExact,
    LeastQueue,
    LongestMatch,
    LoraScore,
    PredictedTtft,
    PrefixScore,
    QueueScore,
    SmallestTree,
    TokenLoad,
    Weighted,
)

Steps = tuple[Part, ...]


def _cheapest(branch: str, agree: bool = False) -> list[Part]:
    """The last steps of most decisions: least load; the least estimated cost; least KV use; one of the equals."""
    return [LeastCost(), LeastLoad(), LeastKv(), PickAgreed(branch) if agree else Pick(branch)]


UNSEEN_PREFIX = [NotFarBusier(), Fastest(), FewestPrefixes()]
"""A prompt no pod holds: the pods not far busier, the fastest of them (all of it is computed), and of those the
ones whose caches hold least (it stays where it lands)."""

NEW_INSTRUCTIONS = [NotFarBusier(), SoonestStart(), FewestPrefixes()]
"""An app's instructions no pod holds (or only slower pods that a faster one outpaces): the pods not far busier,
those that would start them soonest, the emptiest caches (every later request of the app follows them)."""

PREFIX = Branch(PrefixHeld(), [PrefixMatch()], UNSEEN_PREFIX)
"""The longest cached prefix (not far busier), else the unseen prompt's placement."""


def _by_prefix(unseen: str) -> Branch:
    """A long prompt: the longest match, named `prefix`; else placed as unseen, named `unseen`; gateways agree."""
    return Branch(PrefixHeld(), [PrefixMatch(), *_cheapest("prefix", agree=True)],
                  [*UNSEEN_PREFIX, *_cheapest(unseen, agree=True)])


def _adapter_then_least_load(branch: str) -> list[Part]:
    """A new prefix's last steps: the pods running its adapter, else those with a free slot (a base-model prompt
    skips that), the least-load band, and the rendezvous rank, so every gateway picks alike."""
    return [Branch(HasAdapter(), [Branch(AdapterRunningSomewhere(), [AdapterRunning()], [FreeSlot()])]),
            LeastLoad(), PickAgreed(branch)]


def _place_adapter(cache_aware: bool, costed: bool) -> list[Part]:
    """Place (or spill) the adapter where it adds the least contention: dealt to it among peers, a pod that still
    holds it, a free slot, the fewest distinct adapters; `cache_aware`: then the prompt's prefix chooses among
    those (the previous default placed without it); `costed`: then the least estimated cost."""
    prefix = [Branch(LongPrompt(), [PREFIX])] if cache_aware else []
    tail = [LeastCost(), LeastLoad(), LeastKv()] if costed else [LeastLoad(), LeastKv()]
    return [AdapterElsewhere(),
            Branch(DealtForPlacement(cache_aware), [Dealt(), PickPlacement()]),
            Resident(), FreeSlot(),
            Branch(SeveralGateways(), [RoomyForPlacement(), *prefix, PickPlacement(agree=True)]),
            FewestAdapters(), *prefix, *tail, PickPlacement(agree=True)]


LORA_AFFINITY_TREE: list[Part] = [
    LowQueue(),
    Branch(BaseModel(), [
        Branch(LongPrompt(), [
            Branch(HistoryQueued(), [NotFarBusier(), LeastCost(), HistoryMatch(), LeastLoad(), PickAgreed("next_turn")]),
            _by_prefix("new_prefix"),
        ], _cheapest("base_model")),
    ], [
        AdapterSurvey(),
        Branch(DealtWhileSlotsScarce(), [Dealt(), Pick("dealt")]),
        Branch(UnseenInstructions(), [*NEW_INSTRUCTIONS, *_adapter_then_least_load("new_prefix")]),
        Branch(AdapterRoomy(), [
            AdapterActive(),
            Branch(LongPrompt(), [Branch(PromptUnseen(), [AdmitsNow()]), LeastLoadOrLongestMatch(), _by_prefix("affinity")],
                   _cheapest("affinity")),
        ], _place_adapter(cache_aware=True, costed=True)),
    ]),
]
"""The previous default, a tree of rules in a defended order:

1. A short queue first (the endpoint picker's `low_queue`): a queue costs every request in it.
2. A base-model prompt: the longest cached prefix among pods not far busier, else placed as unseen; a chat's
   next turn whose history's pods all queue goes by cost.
3. An adapter: where it can run at once (its holders, unless busier than the fleet by more than
   `spill_queue_margin`; a pod holding the prompt's prefix up to `prefix_queue_margin` more), unless another
   pod starts it clearly sooner; else placed where it adds the least contention. An unseen prompt that opens
   with the app's instructions is placed for the cache first. With several gateways and more adapters than
   slots, the dealt pod first.
4. The least estimated cost in seconds, least load, least KV use; gateways agree on new placements by
   rendezvous rank.
"""

LORA_AFFINITY_V1: list[Part] = [
    LowQueue(),
    Branch(LongPrompt(), [
        Branch(PrefixHeld(), [PrefixMatch(), LeastLoad(), LeastKv(), PickAgreed("prefix")],
               [NotFarBusier(), FewestPrefixes(), *_adapter_then_least_load("new_prefix")]),
    ]),
    Branch(BaseModel(), [LeastLoad(), LeastKv(), Pick("base_model")]),
    AdapterSurvey(by_speed=False, with_prefix=False),
    Branch(AdapterRoomy(sooner=False), [AdapterActive(), LeastLoad(), LeastKv(), Pick("affinity")]),
    *_place_adapter(cache_aware=False, costed=False),
]
"""The default before the tree: a long prompt went through the prefix rules before any adapter rule, so an unseen
long prompt was placed by index size, not by its adapter."""

GIE_V02: list[Part] = [
    Branch(LowQueueAny(), [
        LowQueue(), Branch(HasAdapter(), [LoraSoftAffinity()]), LeastQueue(), LeastKv(), Pick("low_queue"),
    ], [
        LeastQueue(), Branch(HasAdapter(), [LowCostLora()]), LeastKv(), Pick("high_queue"),
    ]),
]
"""Under the queue threshold: LoRA soft affinity, the least queue, the least KV use; over it: the least queue, a
pod running the adapter or with a free slot, the least KV use (the Gateway API Inference Extension's v0.2 scheduler)."""

LLMD_PREFIX: list[Part] = [Weighted({PrefixScore(): 2.0, KvScore(): 1.0, QueueScore(): 1.0, LoraScore(): 1.0}),
                           Pick("llmd")]
"""The llm-d router's published sample profile: prefix 2, KV use 1, queue 1, plus its LoRA scorer at 1; the
highest total wins."""

SGLANG_CACHE_AWARE: list[Part] = [
    Branch(SglangImbalanced(), [LeastLoadExact(), Pick("sglang_balance")]),
    Branch(SglangMatches(), [LongestMatch(), Pick("sglang_match")]),
    SmallestTree(), Pick("sglang_smallest_tree"),
]
"""Least loaded when imbalanced; else the longest match above 30% of the prompt; else the smallest tree."""

PREDICTED_TTFT: list[Part] = [Branch(DealtWhileSlotsScarce(), [Dealt(), Pick("dealt")]),
                              Branch(DealtNewAdapter(), [Dealt(), Pick("dealt")]),
                              NoSlotQueueJoined(), DocumentWeights(), NextTurnElsewhere(), PrefixAffinityTtft(),
                              NewInstructions(), PredictedTtft(), FewestSlotContenders(), FewestPrefixes(), LeastLoad(),
                              PickAgreed("predicted_ttft")]
"""One estimate for every request: the least predicted time to first token (`ttft.py`), harm to others included,
after an adapter's request stays off pods where other adapters queue for a slot while adapters outnumber slots, a
document goes where llm-d's weights rate best once the caches are half full, a conversation's next turn
leaves its history's queued, full pods for roomier ones, the prompt's holders keep it and an app's new
instructions are placed for the cache;
among equals, while LoRA slots are scarce the pods with the fewest adapters contending for them, then the caches
holding least, the least load band, then rendezvous rank, so gateways agree without talking."""

LLMD_WEIGHTS: list[Part] = [LLMD_WEIGHTED, Pick("llmd_weights")]
"""llm-d's current built-in weights: prefix 3, KV use 2, queue 2."""

LLMD_PRECISE: list[Part] = [Weighted({PrefixScore(): 2.0, KvScore(): 1.0, QueueScore(): 1.0}), Pick("llmd_precise")]
"""llm-d's precise-prefix-cache guide: prefix 2, KV use 1, queue 1 (its prefix scorer fed by the engines' events)."""

DYNAMO: list[Part] = [DynamoCost(), Pick("dynamo")]
"""Dynamo's KV router: the least prefill plus decode blocks."""

LLMD_AFFINITY: list[Part] = [LlmdPrefixAffinity(), TokenLoad(), Pick("llmd_affinity")]
"""llm-d's newest defaults: its prefix-cache-affinity filter, then the token-load scorer."""

AIBRIX_PREFIX: list[Part] = [AibrixPrefixCache(), Pick("aibrix_prefix")]
"""AIBrix's prefix-cache policy."""

BUILT_IN: dict[str, Steps] = {
    "lora-affinity": tuple(PREDICTED_TTFT),
    "lora-affinity-tree": tuple(LORA_AFFINITY_TREE),
    "lora-affinity-v1": tuple(LORA_AFFINITY_V1),
    "gie-v0.2": tuple(GIE_V02),
    "llmd-prefix": tuple(LLMD_PREFIX),
    "sglang-cache-aware": tuple(SGLANG_CACHE_AWARE),
    "predicted-ttft": tuple(PREDICTED_TTFT),
    "llmd-weights": tuple(LLMD_WEIGHTS),
    "llmd-precise": tuple(LLMD_PRECISE),
    "dynamo": tuple(DYNAMO),
    "llmd-affinity": tuple(LLMD_AFFINITY),
    "aibrix-prefix": tuple(AIBRIX_PREFIX),
}

ProfileSpec = Sequence["str | Mapping[str, float]"]


class ProfileError(ValueError):
    """A profile in the settings names a part or profile that does not exist, or is malformed."""


def import_rule_modules(modules: Sequence[str]) -> None:
    """Import the modules that define the settings' own parts (defining a part registers it)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # any failure is the operator's to see, by name
            raise ProfileError(f"rule_modules: cannot import {module!r}: {exc.__class__.__name__}: {exc}") from exc


def build_profiles(specs: Mapping[str, ProfileSpec]) -> dict[str, Steps]:
    """The settings' profiles as parts; raises ProfileError naming the profile and the step at fault."""
    built: dict[str, Steps] = {}
    for name in specs:
        if name in BUILT_IN:
            raise ProfileError(f"profiles.{name}: {name!r} is a built-in rule set; give yours another name")
        _build(name, specs, built, ())
    return built


def _build(name: str, specs: Mapping[str, ProfileSpec], built: dict[str, Steps], seen: tuple[str, ...]) -> Steps:
    if name in built:
        return built[name]
    if name in seen:
        raise ProfileError(f"profiles.{name}: includes itself ({' -> '.join((*seen, name))})")
    spec = specs[name]
    if isinstance(spec, (str, bytes)) or not isinstance(spec, Sequence) or not spec:
        raise ProfileError(f"profiles.{name}: a non-empty list of steps, got {spec!r}")
    steps: list[Part] = []
    for i, step in enumerate(spec):
        where = f"profiles.{name}[{i}]"
        if isinstance(step, str):
            if step in BUILT_IN:
                steps.extend(BUILT_IN[step])
            elif step in specs:
                steps.extend(_build(step, specs, built, (*seen, name)))
            elif step in PARTS:
                part = _part(step, where)
                if part.kind == "condition":
                    raise ProfileError(f"{where}: {step!r} is a condition (a question a built-in rule set's branch "
                                       f"asks), not a step; steps: {', '.join(part_names(STEP_KINDS))}")
                steps.append(part)
            else:
                raise ProfileError(f"{where}: unknown part or profile {step!r}; parts: "
                                   f"{', '.join(part_names(STEP_KINDS))}; "
                                   f"profiles: {', '.join(sorted({*BUILT_IN, *specs}))}")
        elif isinstance(step, Mapping) and step:
            weights: dict[Scorer, float] = {}
            for scorer, weight in step.items():
                part = _part(scorer, where)
                if not isinstance(part, Scorer):
                    raise ProfileError(f"{where}: {scorer!r} is a {part.kind}; a weighted step takes scorers: "
                                       f"{', '.join(part_names('scorer'))}")
                if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < math.inf:
                    raise ProfileError(f"{where}.{scorer}: a finite number at least 0 (the scorer's weight), "
                                       f"got {weight!r}")
                weights[part] = float(weight)
            steps.append(Weighted(weights))
        else:
            raise ProfileError(f"{where}: a part's name or a {{scorer: weight}} map, got {step!r}")
        if _ends(steps) and i < len(spec) - 1:
            raise ProfileError(f"profiles.{name}[{i + 1}]: unreachable: the steps before it always decide (a picker, or "
                               f"a rule set that ends with one, comes last)")
    built[name] = tuple(steps)
    return built[name]


def _ends(steps: Sequence[Part]) -> bool:
    """Whether steps always decide: the last one is a picker (a built-in rule set ends with one)."""
    return bool(steps) and steps[-1].kind == "picker"


def _part(name: str, where: str) -> Part:
    cls = PARTS.get(name)
    if cls is None:
        raise ProfileError(f"{where}: unknown part {name!r}; parts: {', '.join(part_names(STEP_KINDS))}")
    try:
        return cls()
    except TypeError as exc:
        raise ProfileError(f"{where}: part {name!r} cannot be built without arguments: {exc}") from exc


STEP_KINDS = ("filter", "scorer", "picker", "survey")
"""The kinds of part a profile in the settings may list (conditions live in built-in branches)."""


def part_names(kinds: str | Sequence[str] | None = None) -> list[str]:
    if isinstance(kinds, str):
        kinds = (kinds,)
    return sorted(n for n, cls in PARTS.items() if kinds is None or cls.kind in kinds)


def rule_names() -> set[str]:
    """What `disabled_rules` may name: every filter's and scorer's rule."""
    return {cls.rule for cls in PARTS.values() if cls.kind in ("filter", "scorer")} | {"dealt", Weighted.rule}


def describe(steps: Sequence[Part], indent: str = "") -> list[str]:
    """A profile as lines, for `lora-affinity profiles`: each part by name, branches indented."""
    lines = []
    for step in steps:
        if isinstance(step, Branch):
            lines.append(f"{indent}if {step.when.name}:")
            lines += describe(step.then, indent + "  ")
            if step.otherwise is not None:
                lines.append(f"{indent}else:")
                lines += describe(step.otherwise, indent + "  ")
        else:
            label = getattr(step, "branch", "")
            lines.append(f"{indent}{step!r}" + (f" ({label})" if label else "") + f"  [{step.kind}]")
    return lines


def run_profile(pods: list[Candidate], run: DecisionRun) -> Decision:
    """The settings' rule set over `pods`; a profile that ends without a picker picks at random among what is left."""
    settings = run.settings
    steps = BUILT_IN.get(settings.rule_set) or settings.built_profiles()[settings.rule_set]
    out = run_steps(steps, pods, run)
    if out.__class__ is Decision:
        return out  # type: ignore[return-value]
    return run.pick(out, run.label)  # type: ignore[arg-type]
