"""Conditions (the questions a rule set's branches ask), the adapter survey, and the placement picker."""

from __future__ import annotations

from .decision import Candidate, Condition, DecisionRun, Outcome, Part, Picker
from .placement import (
    adapter_holders,
    fewest_prefixes,
    instructions_led,
    longest_match_holders,
    outpaced,
    slots_scarce,
    starts_sooner_elsewhere,
    warm_for_adapter,
    warm_pods,
)


class BaseModel(Condition):
    """The request names the base model: the LoRA rules have nothing to say."""

    name = "base_model"

    def test(self, pods: list[Candidate], run: DecisionRun) -> bool:
        return run.request.adapter is None


class HasAdapter(Condition):
    name = "has_adapter"

    def test(self, pods: list[Candidate], run: DecisionRun) -> bool:
        return run.request.adapter is not None


class LongPrompt(Condition):
    """Prefix rules on, and the prompt fills at least `prefix_min_blocks` blocks."""

    name = "long_prompt"

    def test(self, pods: list[Candidate], run: DecisionRun) -> bool:
        return run.long_prompt


class PrefixHeld(Condition):
    """Some pod not far busier than the least busy holds a long enough prefix of the prompt (`warm_pods`)."""

    name = "prefix_held"

    def test(self, pods: list[Candidate], run: DecisionRun) -> bool:
        run.warm = warm_pods(pods, run.request, run.settings)
        return bool(run.warm)


class HistoryQueued(Condition):
    """A base-model conversation's next turn (an `assistant` message in it) whose history's pods all reported a
    queue: then the least cost among the pods not far busier decides, not the match. Recomputing the history
    elsewhere, and the second copy it makes, are parts of the cost, so the turn leaves a queue only when waiting
    there costs more. A first turn keeps the prefix rules: its system prompt is what the app's other chats match."""

    name = "history_queued"

    def test(self, pods: list[Candidate], run: DecisionRun) -> bool:
        if run.request.adapter is not None or not run.request.later_turn:
            return False
        warm = warm_pods(pods, run.request, run.settings)
        return bool(warm) and all(p.reported_waiting for p in warm)


class AdapterSurvey(Part):
    """Not a rule: reads, once, what the adapter rules ask of the pods (the least load; the pods holding the
    prompt's prefix, none when only slower pods hold it and a faster one starts it sooner (`placement.outpaced`);
    the adapter's holders and those of them not far busier, counted at their speed, with the warm ones
    `warm_for_adapter` keeps), so that the conditions and filters after it read them."""

    name = "adapter_survey"
    kind = "survey"

    def __init__(self, by_speed: bool = True, with_prefix: bool = True) -> None:
        self.by_speed, self.with_prefix = by_speed, with_prefix

    def __call__(self, pods: list[Candidate], run: DecisionRun) -> Outcome:
        request, settings = run.request, run.settings
        if request.adapter is None:
            return pods
        run.fleet = pods
        run.fleet_min = fleet_min = min([p.load for p in pods])
        cache_aware = self.with_prefix and run.long_prompt
        run.warm = warm_pods(pods, request, settings, fleet_min) if cache_aware else []
        if run.warm and outpaced(run.warm, pods, request, settings):
            run.warm = []  # its prefix held only where a faster idle pod starts the whole prompt sooner: as unseen
        run.holders, run.adapter_roomy = adapter_holders(pods, request.adapter, settings, fleet_min, self.by_speed)
        if cache_aware:
            run.adapter_roomy += warm_for_adapter(run.warm, run.holders, run.adapter_roomy, fleet_min, settings)
        return pods


class DealtWhileSlotsScarce(Condition):
    """With several gateways and more adapters than LoRA slots: the adapter's dealt pod, whoever else runs it,
    unless more than two spill margins busier than the least busy pod. Each gateway spills and places from its
    own partial view, so where slots are scarce they would start adapters on the same free slots and scatter
    them; kept on the deal they agree. Not where every adapter fits: there an adapter is placed once and stays.
    Disabling the `dealt` rule turns dealing off (it is a choice, not a filter)."""

    name = "dealt_while_slots_scarce"

    def test(self, pods: list[Candidate], run: DecisionRun) -> bool:
        request = run.request
        if not run.enabled("dealt") or request.gateways == 1 or request.home is None \
                or not slots_scarce(pods, request.dealt_adapters):
            return False
        return _dealt_within(pods, run, margins=2)


class DealtNewAdapter(Condition):
    """With several gateways, an adapter no candidate runs yet, for a prompt that places no prefix: its dealt pod,
    unless more than `spill_queue_margin` busier than the least busy pod. Peers place a new adapter at the same
    moment from views that have not yet heard of each other's dispatches (a burst's first requests): each one's
    least predicted time to first token then starts the adapter on a different pod, and each copy takes a LoRA slot.
    Dealt alike, they start it once. A prompt some pod holds, or one mostly of an app's instructions, is placed for
    the cache instead (`PrefixAffinityTtft`, `NewInstructions`): the app's later requests follow it there, and a deal
    blind to where other apps' prefixes live stacked a chat app on the pod of another's, whose conversations then
    moved between pods (docs/routing.md). Disabling the `dealt` rule turns dealing off."""

    name = "dealt_new_adapter"

    def test(self, pods: list[Candidate], run: DecisionRun) -> bool:
        request, settings = run.request, run.settings
        adapter = request.adapter
        if (adapter is None or request.gateways == 1 or request.home is None or not run.enabled("dealt")
                or any(adapter in p.active_adapters for p in pods) or instructions_led(request, settings)
                or longest_match_holders(pods, request, settings)):
            return False
        return _dealt_within(pods, run, margins=1)


def _dealt_within(pods: list[Candidate], run: DecisionRun, margins: int) -> bool:
    """Whether the request's dealt pod is among `pods` and at most `margins` spill margins busier than the least busy
    of them; it is kept in `run.dealt` for the `dealt` filter."""
    edge = min([p.load for p in pods]) + margins * run.settings.spill_queue_margin
    run.dealt = [p for p in pods if p.key == run.request.home and p.load <= edge]
    return bool(run.dealt)


class UnseenInstructions(Condition):
    """An adapter's prompt no pod holds that opens with the app's instructions (a `system` or `developer`
    message of at least `prefix_min_blocks`): it is placed for the cache before the adapter, since every later
    request of that app matches it and follows it; stacking an adapter's apps on its pods stacks their traffic."""

    name = "unseen_instructions"

    def test(self, pods: list[Candidate], run: DecisionRun) -> bool:
        return run.long_prompt and not run.warm and run.request.instructions_blocks >= run.settings.prefix_min_blocks


class AdapterRoomy(Condition):
    """Some pod runs the adapter and is not far busier than the fleet (`AdapterSurvey`) and, with `sooner`, no
    other pod would start it clearly sooner (`placement.starts_sooner_elsewhere`)."""

    name = "adapter_roomy"

    def __init__(self, sooner: bool = True) -> None:
        self.sooner = sooner

    def test(self, pods: list[Candidate], run: DecisionRun) -> bool:
        if not run.adapter_roomy:
            return False
        if self.sooner and starts_sooner_elsewhere(pods, run.adapter_roomy, run.request, run.settings):
            run.note("starts_sooner_elsewhere", pods)
            return False
        return True


class PromptUnseen(Condition):
    """No pod holds the prompt's prefix (`AdapterSurvey`)."""

    name = "prompt_unseen"

    def test(self, pods: list[Candidate], run: DecisionRun) -> bool:
        return not run.warm


class AdapterRunningSomewhere(Condition):
    name = "adapter_running_somewhere"

    def test(self, pods: list[Candidate], run: DecisionRun) -> bool:
        adapter = run.request.adapter
        return any(adapter in p.active_adapters for p in pods)


class SeveralGateways(Condition):
    """Other gateways route for this fleet too (through Redis)."""

    name = "several_gateways"

    def test(self, pods: list[Candidate], run: DecisionRun) -> bool:
        return run.request.gateways > 1


class DealtForPlacement(Condition):
    """Placing an adapter with several gateways: its dealt pod if not far busier. With `cache_aware` and every
    adapter fitting, it is placed once and stays with the sessions it draws, so the first placement also looks
    at the caches (a dealt pod already holding other apps' prompts is passed over); when slots are scarce adapters
    come and go all the time, and the gateways' agreement is worth more."""

    name = "dealt_for_placement"

    def __init__(self, cache_aware: bool = True) -> None:
        self.cache_aware = cache_aware

    def test(self, pods: list[Candidate], run: DecisionRun) -> bool:
        request = run.request
        if request.gateways == 1 or request.home is None or not run.enabled("dealt"):
            return False
        if _dealt_within(pods, run, margins=1) and self.cache_aware and run.long_prompt \
                and not slots_scarce(run.fleet, request.dealt_adapters):
            emptiest = {p.key for p in fewest_prefixes(pods, request, run.width)}
            run.dealt = [p for p in run.dealt if p.key in emptiest]
        return bool(run.dealt)


class PickPlacement(Picker):
    """Names the decision `spill` when the adapter runs elsewhere already, else `place`."""

    name = "pick_placement"

    def __init__(self, agree: bool = False) -> None:
        super().__init__()
        self.agree_on_it = agree

    def __call__(self, pods: list[Candidate], run: DecisionRun) -> Outcome:
        return run.pick(pods, "spill" if run.holders else "place", self.agree_on_it)


# --- the endpoint picker's v0.2 and sglang's questions, as references -------------------------------

SGLANG_BALANCE_ABS = 64
SGLANG_BALANCE_REL = 1.5
SGLANG_MATCH_RATIO = 0.3


class LowQueueAny(Condition):
    """gie-v0.2: some pod is under `queueing_threshold_lora`."""

    name = "low_queue_any"

    def test(self, pods: list[Candidate], run: DecisionRun) -> bool:
        threshold = run.settings.queueing_threshold_lora
        return any(p.waiting < threshold for p in pods)


class SglangImbalanced(Condition):
    """sglang-cache-aware: the loads differ by more than 64 requests and 1.5 times."""

    name = "sglang_imbalanced"

    def test(self, pods: list[Candidate], run: DecisionRun) -> bool:
        loads = [p.load for p in pods]
        return max(loads) - min(loads) > SGLANG_BALANCE_ABS and max(loads) > SGLANG_BALANCE_REL * min(loads)


class SglangMatches(Condition):
    """sglang-cache-aware: some pod holds more than 30% of the prompt."""

    name = "sglang_matches"

    def test(self, pods: list[Candidate], run: DecisionRun) -> bool:
        request = run.request
        best = max((request.prefix_matches.get(p.key, 0) for p in pods), default=0)
        return bool(request.prefix_blocks) and best / request.prefix_blocks > SGLANG_MATCH_RATIO
