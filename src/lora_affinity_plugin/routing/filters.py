"""Filters: each keeps some pods, failing open (`decision.Filter`): ours, and the endpoint picker's v0.2 ones."""

from __future__ import annotations

from typing import ClassVar

from .conditions import AdapterSurvey
from .decision import Candidate, DecisionRun, Filter
from .placement import (
    LARGE_PROMPT_SHARE,
    admits_now,
    computing_tokens,
    fastest,
    large_there,
    instructions_led,
    least_band_int,
    longest_match_holders,
    not_far_busier,
    slots_scarce,
    soonest_start,
    tokens_per_block,
    warm_pods,
)
from .scorers import LLMD_WEIGHTED, LLMD_WEIGHTED_SLOTS
from .ttft import STICKY_MARGIN_S, adapter_slots_scarce, run_predictions

NEXT_TURN_KV_GAP = 0.3
"""How much emptier (a share of the whole cache) another pod's KV cache must be than the emptiest of a
conversation's history pods before its next turn leaves them (`NextTurnElsewhere`). Without it turns left pods
as full as the others, recomputing their histories where no more fitted (docs/tried.md)."""

DOCUMENTS_FULL_USAGE = 0.5
"""The candidates' mean KV-cache use from which documents are placed by llm-d's weights (`DocumentWeights`). Below
it room is plentiful and the estimate, which knows each pod's speed, keeps an uneven fleet's documents off its slow
pods; the weights there sent them to idle slow pods (docs/tried.md)."""

SECOND_HOLDER_MARGIN_S = 3.0
"""How much sooner (first token plus the generation term) a pod with room for a copy must finish a small prompt than
its holders before it becomes a second holder (`PrefixAffinityTtft`). At 1 s shared system prompts spread and
queued; at 3 s they stay while a hot adapter's instruction gains a second pod (docs/tried.md)."""
SECOND_HOLDER_BATCH_RATIO = 6
"""...and how many times as many requests as it the holders must run: a hot prefix's holders at 30 running while it
runs 5. Where batches differ less, a copy splits the requests sharing one cached prompt, which fit more of them on
one pod than on two (shared instructions queued on the copies' pods; docs/tried.md)."""


class LowQueue(Filter):
    """Pods with fewer waiting requests than `queueing_threshold_lora` (the endpoint picker's): a queue costs
    every request in it."""

    name = "low_queue"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        threshold = run.settings.queueing_threshold_lora
        return [p for p in pods if p.waiting < threshold]


class NotFarBusier(Filter):
    """Pods not far busier than the least busy one (`placement.not_far_busier`)."""

    name = "roomy"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        return not_far_busier(pods, run.settings)


class Fastest(Filter):
    """The fastest pods: a prompt no pod holds is computed whole, so speed comes before cache room."""

    name = "fastest"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        return fastest(pods)


class SoonestStart(Filter):
    """The pods that would start the prompt soonest (`placement.soonest_start`): the fastest, until what a fast pod
    is computing and its queue cost more than a slower pod's prefill. For an app's new instructions, where a
    slower holder gave way (`placement.outpaced`) to the pod that starts them sooner."""

    name = "soonest_start"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        return soonest_start(pods, run.request, run.settings)


class PrefixMatch(Filter):
    """The pods holding the prompt's longest prefix (`placement.warm_pods`, found by `conditions.PrefixHeld`)."""

    name = "prefix_match"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        # In a profile of the settings nothing asked `prefix_held` first: find the holders here.
        return run.warm or warm_pods(pods, run.request, run.settings)


class AdapterActive(Filter):
    """The adapter's holders the adapter rules allow (`conditions.AdapterSurvey`): running it and not far busier
    than the fleet. vLLM's `--max-loras` skip rule makes a wrong placement cost whole generations."""

    name = "adapter_active"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        if not run.fleet and run.request.adapter is not None:  # no `adapter_survey` before it: survey here
            AdapterSurvey()(pods, run)
        return run.adapter_roomy


class _ByAdapter(Filter):
    """The pods whose `adapters` set holds the request's adapter (or, with `holding` False, does not)."""

    adapters: ClassVar[str] = "active_adapters"
    holding: ClassVar[bool] = True

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        adapter, field, holding = run.request.adapter, self.adapters, self.holding
        return [p for p in pods if (adapter in getattr(p, field)) is holding]


class AdapterRunning(_ByAdapter):
    """The pods running the request's adapter."""

    name = "adapter_running"
    rule = "adapter_active"


class AdapterElsewhere(_ByAdapter):
    """Placing an adapter: the pods not running it yet (all of them, when every pod runs it)."""

    name = "adapter_elsewhere"
    holding = False


class AdmitsNow(Filter):
    """The fastest of the pods that admit the whole prompt at the next step (`placement.admits_now`): the load
    band alone weighs a queue of 6 behind a full cache like 6 running requests."""

    name = "admits_now"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        tokens = run.request.prefix_blocks * tokens_per_block(run.request, run.settings)
        return fastest([p for p in pods if admits_now(p, tokens)])


class LeastLoadOrLongestMatch(Filter):
    """The least-load band, plus the pods holding the prompt's longest cached prefix when none in the band holds
    as much (a chat's history is on one pod: a load band must not send its next turn to recompute it elsewhere),
    unless slower than the band's fastest. The prefix rules' own queue margin judges them next."""

    name = "least_load_or_longest_match"
    rule = "least_load"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        edge = least_band_int([p.load for p in pods], run.width)
        banded = [p for p in pods if p.load <= edge]
        settings, matches = run.settings, run.request.prefix_matches
        if not matches or max(matches.values()) < settings.prefix_min_blocks:  # (no match long enough anywhere)
            return banded
        best = max(matches.get(p.key, 0) for p in pods)
        if best < settings.prefix_min_blocks or any(matches.get(p.key, 0) == best for p in banded):
            return banded
        least_slowness = min(p.slowness for p in banded)  # a slower pod recomputes the rest slower: it must win the band
        return banded + [p for p in pods if matches.get(p.key, 0) == best and p.slowness <= least_slowness]


class Dealt(Filter):
    """The pod the served adapters, dealt over the pods in order, give this adapter (found by
    `conditions.DealtWhileSlotsScarce` or `conditions.DealtForPlacement`): peers dealing alike agree without talking."""

    name = "dealt"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        home = run.request.home  # (no condition before it in a profile of the settings: the dealt pod itself)
        return run.dealt or [p for p in pods if p.key == home]


class Resident(_ByAdapter):
    """Pods that still hold the adapter (loading it back costs nothing there)."""

    name = "resident"
    adapters = "resident_adapters"


class FreeSlot(Filter):
    """Pods with a free LoRA slot (another adapter would wait for a batch to drain)."""

    name = "free_slot"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        return [p for p in pods if p.has_free_slot()]


class RoomyForPlacement(Filter):
    """With several gateways: the pods within `spill_queue_margin` of the least load, whose rendezvous rank then
    chooses (peers place at the same moment from the same snapshot: exact balancing on partial views disagrees)."""

    name = "roomy_for_placement"
    rule = "roomy"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        edge = min(p.load for p in pods) + run.settings.spill_queue_margin
        return [p for p in pods if p.load <= edge]


class LoraSoftAffinity(Filter):
    """gie-v0.2: the pods running the adapter with probability `lora_affinity_threshold`, else those with a free
    slot."""

    name = "lora_soft_affinity"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        adapter = run.request.adapter
        affinity = [p for p in pods if adapter in p.active_adapters]
        available = [p for p in pods if adapter not in p.active_adapters and p.has_free_slot()]
        if affinity and available:
            return affinity if run.rng.random() < run.settings.lora_affinity_threshold else available
        return affinity or available


class LowCostLora(Filter):
    """gie-v0.2 over the queue threshold: pods running the adapter or with a free slot."""

    name = "low_cost_lora"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        adapter = run.request.adapter
        return [p for p in pods if adapter in p.active_adapters or p.has_free_slot()]


class NoSlotQueueJoined(Filter):
    """While the fleet serves more adapters than the candidates have LoRA slots, an adapter's request that some pod
    already runs or queues does not go to a pod where other adapters already wait for a slot (more distinct
    adapters active there than it has slots), unless the adapter is active there too. vLLM runs an adapter only while
    it holds a slot; on such a pod the request would wait behind those adapters' turns, and as one more contender it
    makes every one of them wait longer, while on its adapter's pods it joins a batch that runs or will. The
    estimate prices the request's own wait, not the turns it adds for the others: in a closed burst with every pod
    queueing it spread each adapter over more pods (scarce slots with unique texts: 6.75 distinct adapters a replica
    against the tree's 4.83, and 0.935x its completed requests; docs/benchmarks.md). A pod with a free slot, or
    whose slots hold no waiting adapters, stays eligible: starting there costs no one a turn."""

    name = "no_slot_queue_joined"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        adapter = run.request.adapter
        if adapter is None or not slots_scarce(pods, run.request.served_adapters):
            return pods
        if not any(adapter in p.active_adapters for p in pods):
            return pods  # a new adapter: the estimate places it
        return [p for p in pods if adapter in p.active_adapters or not p.max_lora
                or len(p.active_adapters) <= p.max_lora]


class DocumentWeights(Filter):
    """A document (a prompt at least `LARGE_PROMPT_SHARE` of the smallest candidate KV cache), while the candidates'
    caches are on average at least `DOCUMENTS_FULL_USAGE` full, goes where llm-d's weighted scores rate best
    (`LLMD_WEIGHTED`: the share of the prompt a pod holds 3, its free KV share 2, its queue 2); ties go on to the
    estimate's rules. Other prompts, and documents while the caches have room, pass untouched. While the fleet
    serves more adapters than the candidates have LoRA slots, an adapter's document is rated by its slot too
    (`LLMD_WEIGHTED_SLOTS`: llm-d's LoRA scorer at 2, 1 where the adapter runs in a slot, 0.8 with a free one): not
    every adapter can run at once then, and blind to slots the weights sent documents to pods whose slots all held
    other adapters, where they waited generations for one.

    Few documents fit a cache at once, so under KV pressure where each one lives decides how many requests the
    fleet can run: the weights keep a document where it is cached while its pod has room and send new ones to the
    emptiest caches. The estimate prices one request's first token from rates learned in generations; with every
    cache full its room and generation terms were guesses of many seconds apart, and it spread documents over
    more pods, each of them queueing (docs/routing.md). Without prefix affinity it leaves every document to the
    estimate."""

    name = "document_weights"

    def __call__(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        if (not run.settings.prefix_affinity or not _is_document(pods, run)
                or sum(p.kv_cache_usage for p in pods) < DOCUMENTS_FULL_USAGE * len(pods)):
            return run.apply(self.rule, pods, pods)
        request = run.request
        slotted = request.adapter is not None and slots_scarce(pods, request.served_adapters)
        return run.apply(self.rule, pods, *(LLMD_WEIGHTED_SLOTS if slotted else LLMD_WEIGHTED).best(pods, run))


def _is_document(pods: list[Candidate], run: DecisionRun) -> bool:
    """The prompt is large (`LARGE_PROMPT_SHARE`) on some pod: on the smallest cache among those that report theirs."""
    sizes = [p.kv_cache_tokens for p in pods if p.kv_cache_tokens]
    prompt = run.request.prefix_blocks * tokens_per_block(run.request, run.settings)
    return bool(sizes) and prompt >= LARGE_PROMPT_SHARE * min(sizes)  # `large_there` on the smallest


class NextTurnElsewhere(Filter):
    """A conversation's next turn (its prompt carries an `assistant` message) leaves its history's pods, those
    holding the longest prefix of it, for the others when they are queued and full while another pod has room:
    every one of them reported a longer queue than the fleet's shortest, another pod's KV cache is at least
    `NEXT_TURN_KV_GAP` emptier than the emptiest of them, and llm-d's weighted scores (`LLMD_WEIGHTED`: the share
    of the prompt a pod holds 3, its free KV share 2, its queue 2) rate another pod above every one of them, so
    the history left behind is short against that gap. The estimate then chooses among the others.

    A history is the conversation's own: moving it copies nothing that other requests share, and the copy left
    behind ages out of the cache. Kept on its pods, each conversation stayed where it began, and a fleet came to
    run 30 requests on four pods, full and queueing, while a fifth ran 12 at half its cache (docs/routing.md)."""

    name = "next_turn_elsewhere"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        request, settings = run.request, run.settings
        if not request.later_turn or not settings.prefix_affinity:
            return pods
        history = longest_match_holders(pods, request, settings)
        held = {p.key for p in history}  # (keys: comparing candidates compares every field)
        others = [p for p in pods if p.key not in held]
        shortest = min(p.reported_waiting for p in pods)
        if not history or not others or any(p.reported_waiting <= shortest for p in history):
            return pods
        roomier = min(p.kv_cache_usage for p in history) - NEXT_TURN_KV_GAP
        if not any(p.kv_cache_usage <= roomier for p in others):
            return pods
        totals = dict(zip((p.key for p in pods), LLMD_WEIGHTED.totals(pods, run)))
        if min(totals[p.key] for p in others) >= min(totals[p.key] for p in history) - 1e-9:
            return pods
        return others


class PrefixAffinityTtft(Filter):
    """The pods holding the prompt's longest cached prefix keep it. A prompt under `LARGE_PROMPT_SHARE` of a
    holder's cache stays while they are not far busier than the least busy pod (`not_far_busier`), unless it is a
    base-model conversation's next turn and each of them reported a queue; a larger one (a document), while the
    best of them would start it at most `STICKY_MARGIN_S` later than the best other pod (llm-d's prefix-affinity
    filter, on the predicted time to first token). A second copy of a prefix costs the fleet KV room that no single request's
    estimate sees; a document's copy is worth it sooner, since few of them fit a cache at once. A small prompt's
    prefix gains a second holder when one has room for it and would finish it much sooner (`_second_holder`)."""

    name = "prefix_affinity_ttft"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        request, settings = run.request, run.settings
        if not settings.prefix_affinity:
            return pods
        holders = longest_match_holders(pods, request, settings)
        if not holders or len(holders) == len(pods):
            return pods
        per_block = tokens_per_block(request, settings)
        prompt = request.prefix_blocks * per_block
        small = [p for p in holders if not large_there(p, prompt)]
        if small:  # a small prompt: its holders keep it while not far busier (a copy costs more than a queue)...
            kept = not_far_busier(pods, settings, among=small)
            if kept:
                kept += _second_holder(pods, holders, kept, run, prompt, per_block)
            if kept and not (request.later_turn and request.adapter is None
                             and all(p.reported_waiting for p in kept)):
                return kept  # ...unless it is a base-model conversation's next turn and every one of them queues
        predicted = run_predictions(pods, run)
        holding = {p.key for p in holders}
        best_holder = min(predicted[key].ttft_s for key in holding)
        if best_holder <= min(t.ttft_s for key, t in predicted.items() if key not in holding) + STICKY_MARGIN_S:
            return holders
        return pods


class NewInstructions(Filter):
    """A prompt that is mostly an app's instructions no pod holds (its `system` or `developer` first message fills at
    least half of its prefix blocks) goes where the caches are known to hold the fewest blocks, among the pods not
    far busier that would start it soonest: the default's placement of an app's new instructions. Every later
    request of the app matches them and follows them there, so this one choice places the app's traffic for as long
    as its prefix stays cached. The estimate alone placed each new app by the pods' state of the moment (the
    adapter running, the smallest batch), and a pod came to hold four apps' instructions and queue while others had
    room. A prompt mostly of other text (a document after the instructions) is left to the estimate."""

    name = "new_instructions"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        request, settings = run.request, run.settings
        if not instructions_led(request, settings) or longest_match_holders(pods, request, settings):
            return pods  # held somewhere: the holders' rule (`PrefixAffinityTtft`) decides
        roomy = soonest_start(not_far_busier(pods, settings), request, settings)
        known = [request.prefix_sizes.get(p.key, 0) for p in roomy]
        edge = least_band_int(known, run.width)
        return [p for p, blocks in zip(roomy, known) if blocks <= edge]


def _second_holder(pods: list[Candidate], holders: list[Candidate], kept: list[Candidate], run: DecisionRun,
                   prompt: float, per_block: float) -> list[Candidate]:
    """The pod that becomes a small prompt's second holder, if any: one that has room for a copy without evicting a
    prefix known cached there, and would finish the request (first token plus the generation term) more than
    `SECOND_HOLDER_MARGIN_S` sooner than the best holder kept, while every holder kept runs
    `SECOND_HOLDER_BATCH_RATIO` times its requests. A hot prefix's holders draw every request that carries it while
    they report no queue, however large their batches grow (a hot adapter's instruction: two pods at 30 running
    requests, another at 5). Not an adapter's request while LoRA slots are scarce: a second holder there is one more
    contender for a pod's slots. `prompt`: its tokens; `per_block`: tokens per prefix block."""
    request = run.request
    if adapter_slots_scarce(pods, request):
        return []
    holding = {p.key for p in holders}
    known = request.prefix_sizes
    roomy = [p for p in pods if p.key not in holding and p.kv_free_tokens is not None
             and p.kv_free_tokens - known.get(p.key, 0) * per_block >= prompt]
    least_kept = min(p.running for p in kept)
    if not roomy or least_kept < SECOND_HOLDER_BATCH_RATIO * min(p.running for p in roomy):
        return []  # (no roomy pod runs few enough requests: known before predicting all the pods)
    predicted = run_predictions(pods, run)

    def finish(p: Candidate) -> float:
        t = predicted[p.key]
        return t.ttft_s + t.generation_s

    best = min(map(finish, roomy))
    if min(map(finish, kept)) <= best + SECOND_HOLDER_MARGIN_S:
        return []
    chosen = [p for p in roomy if finish(p) == best]
    if least_kept < SECOND_HOLDER_BATCH_RATIO * min(p.running for p in chosen):
        return []
    return chosen


# --- the peers' filters, as references ------------------------------------------------------------

LLMD_STICKY_SCORE = 0.8
"""llm-d's prefix-cache-affinity filter: the prefix score (matched share of the prompt) that makes a pod sticky."""
LLMD_TTFT_PENALTY_S = 18.0
"""...and how much later than the best other pod a sticky pod may start the prompt and keep it (its default)."""
LLMD_PEAK_PREFILL_TOKENS_S = 15_928.0
"""...estimating a start as in-flight tokens over this peak prefill throughput (its default)."""


class LlmdPrefixAffinity(Filter):
    """llm-d's newest default filter: the pods holding at least 80% of the prompt keep it, unless the best of them
    would start it more than 18 s after the best other pod (each start estimated as its in-flight plus the prompt's
    uncached tokens over 15,928 tokens/s, llm-d's defaults)."""

    name = "llmd_prefix_affinity"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        request = run.request
        if not request.prefix_blocks:
            return pods
        matches = request.prefix_matches
        sticky = [p for p in pods if matches.get(p.key, 0) / request.prefix_blocks >= LLMD_STICKY_SCORE]
        if not sticky or len(sticky) == len(pods):
            return pods
        per_block = tokens_per_block(run.request, run.settings)

        def start_s(p: Candidate) -> float:
            uncached = (request.prefix_blocks - matches.get(p.key, 0)) * per_block
            return (computing_tokens(p, request) + uncached) / LLMD_PEAK_PREFILL_TOKENS_S

        best_other = min(start_s(p) for p in pods if p not in sticky)
        return sticky if min(start_s(p) for p in sticky) <= best_other + LLMD_TTFT_PENALTY_S else pods


AIBRIX_IMBALANCE = 16
"""AIBrix's prefix-cache policy: requests by which the busiest pod may exceed the least busy before it balances."""


class AibrixPrefixCache(Filter):
    """AIBrix's prefix-cache policy: the least loaded pods when loads differ by more than 16 requests; else the
    longest match, then the least load, among pods loaded at most the mean plus two standard deviations."""

    name = "aibrix_prefix_cache"

    def keep(self, pods: list[Candidate], run: DecisionRun) -> list[Candidate]:
        loads = [p.load for p in pods]
        least = min(loads)
        if max(loads) - least > AIBRIX_IMBALANCE:
            return [p for p in pods if p.load == least]
        mean = sum(loads) / len(loads)
        bound = mean + 2 * (sum((x - mean) ** 2 for x in loads) / len(loads)) ** 0.5
        get = run.request.prefix_matches.get
        within = [p for p in pods if p.load <= bound]
        best = min((-get(p.key, 0), p.load) for p in within)
        return [p for p in within if (-get(p.key, 0), p.load) == best]
