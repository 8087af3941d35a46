"""The predicted time to first token (`ttft.py`): each term moves with what it says, and the `predicted-ttft`
rule set picks the least total, alike on every gateway."""

import math
import random
from dataclasses import replace

from hypothesis import HealthCheck, given, settings as hypothesis_settings
from hypothesis import strategies as st
from lora_affinity_plugin.routing.podstate import PodRates
from lora_affinity_plugin.routing.scheduling import Candidate, RouteRequest, choose_pod
from lora_affinity_plugin.config.settings import build_settings
from lora_affinity_plugin.routing.cost import expected_step_s
from lora_affinity_plugin.routing.ttft import (
    COLD_ADAPTER_S,
    GENERATION_SHARE,
    ROOM_GENERATIONS,
    predict,
    predictions,
    slots_in_use,
)

RATES = PodRates(prefill_factor=1.0, decode_step_s=0.08, queue_s_per_request=0.5, mean_output_tokens=100,
                 learned=True)
GENERATION_S = 0.08 * 100
TPB = 16.0


def pod(key="p", waiting=0, running=4, adapters=("a",), max_lora=2, resident=(), free=None, size=None, rates=RATES,
        usage=0.5):
    return Candidate(key, waiting, running, usage, frozenset(adapters), frozenset(resident), max_lora,
                     reported_waiting=waiting, rates=rates, kv_free_tokens=free, kv_cache_tokens=size)


def traced(decision, name: str):
    """The step of `decision`'s trace that part `name` made."""
    return next(step for step in decision.trace if step[0] == name)


def test_the_adapters_wait_is_nothing_when_running_a_load_with_a_free_slot_and_half_a_generation_without():
    request = RouteRequest("b")
    assert predict(pod(adapters=("b",)), request, TPB, 0).adapter_s == 0
    with_slot = predict(pod(), request, TPB, 0)
    resident = predict(pod(resident=("b",)), request, TPB, 0)
    full = predict(pod(adapters=("a", "c")), request, TPB, 0)
    assert 0 == resident.adapter_s < with_slot.adapter_s < 0.1
    assert full.adapter_s == with_slot.adapter_s + GENERATION_S / 2
    assert with_slot.harm_s > 0  # a second adapter slows the running batch


def test_an_adapter_only_waiting_for_a_slot_waits_like_a_new_one_while_the_fleet_has_slots_for_every_adapter():
    # b's requests wait on p: both slots hold a and c (vLLM passes over b's while they do)
    waiting = replace(pod(adapters=("a", "b", "c")), running_adapters=frozenset({"a", "c"}))
    fits, scarce = RouteRequest("b", served_adapters=4), RouteRequest("b", served_adapters=12)
    in_slot = predict(replace(waiting, running_adapters=frozenset({"a", "b"})), fits, TPB, 0, every_adapter_fits=True)
    new = predict(pod(adapters=("a", "c")), fits, TPB, 0, every_adapter_fits=True)
    waits = predict(waiting, fits, TPB, 0, every_adapter_fits=True)
    assert in_slot.adapter_s == 0 and waits.adapter_s == GENERATION_S / 2
    assert new.adapter_s > waits.adapter_s and waits.harm_s == 0 < new.harm_s  # it takes no slot anew
    # more adapters than slots: waiting is the norm, and a batch of its requests there is worth the wait
    assert predict(waiting, scarce, TPB, 0).adapter_s == 0
    unknown = replace(waiting, running_adapters=None)  # an engine that does not tell them apart
    assert predict(unknown, fits, TPB, 0, every_adapter_fits=True).adapter_s == 0
    # the fleet's slots come from the candidates: 2 pods of 2 slots hold 4 adapters, not 12
    pods = [waiting, replace(pod("q", adapters=()), running_adapters=frozenset())]
    assert predictions(pods, fits, build_settings({}, environ={}))["p"].adapter_s == GENERATION_S / 2
    assert predictions(pods, scarce, build_settings({}, environ={}))["p"].adapter_s == 0


def test_the_queue_counts_reported_waiting_requests_dispatches_since_the_scrape_and_prompts_still_computing():
    request = RouteRequest(None)
    idle = predict(pod(running=0), request, TPB, 0).queue_s
    queued = predict(pod(waiting=4), request, TPB, 0).queue_s
    assert idle == 0 and queued >= 4 * 0.5
    sent = pod(waiting=0).with_dispatches(3, set())
    assert predict(sent, request, TPB, 0).queue_s > predict(pod(), request, TPB, 0).queue_s
    computing = RouteRequest(None, prefilling={"p": 1.5})
    assert predict(pod(), computing, TPB, 0).queue_s - predict(pod(), request, TPB, 0).queue_s == 1.5


def test_room_is_waited_for_only_when_the_uncached_part_and_the_requests_ahead_do_not_fit():
    request = RouteRequest(None, prefix_blocks=100)  # 1,600 tokens
    assert predict(pod(free=5000, size=10_000), request, TPB, 0).room_s == 0
    short = predict(pod(free=1000, size=10_000), request, TPB, 0).room_s
    shorter = predict(pod(free=100, size=10_000), request, TPB, 0).room_s
    assert 0 < short < shorter <= ROOM_GENERATIONS * GENERATION_S
    held = RouteRequest(None, prefix_blocks=100, prefix_matches={"p": 95})  # only 80 tokens to compute
    assert predict(pod(free=1000, size=10_000), held, TPB, 95).room_s == 0
    behind = predict(pod(waiting=3, free=2000, size=10_000), request, TPB, 0).room_s
    assert behind > 0  # three waiting requests take the room first


def test_a_holder_saves_its_prefill_and_a_second_copy_is_harm():
    request = RouteRequest(None, prefix_blocks=100, prefix_matches={"h": 90})
    holder = predict(pod("h"), request, TPB, 90)
    other = predict(pod("o"), request, TPB, 90)
    assert holder.uncached_tokens == 160 and other.uncached_tokens == 1600
    assert holder.prefill_s < other.prefill_s and holder.harm_s == 0 < other.harm_s
    assert holder.total_s < other.total_s


def test_the_rule_set_picks_the_least_predicted_pod_and_gateways_agree_on_equals():
    settings = build_settings({"rule_set": "predicted-ttft"}, environ={})
    busy, roomy = pod("busy", waiting=6), pod("roomy")
    request = RouteRequest("a", placement_key=12345)
    assert {choose_pod([busy, roomy], request, settings, random.Random(i)).pod for i in range(20)} == {"roomy"}
    equals = [pod(f"p{i}") for i in range(4)]
    picks = {choose_pod(equals, request, settings, random.Random(i)).pod for i in range(20)}
    assert len(picks) == 1  # rendezvous rank on the placement key, not chance
    decision = choose_pod(equals, request, settings, random.Random(0), explain=True)
    assert [step[0] for step in decision.trace][:6] == ["no_slot_queue_joined", "document_weights",
                                                        "next_turn_elsewhere", "prefix_affinity_ttft",
                                                        "new_instructions", "predicted_ttft"]
    assert decision.branch == "predicted_ttft"


def test_prefix_holders_keep_the_prompt_until_they_queue_and_start_it_a_margin_later():
    settings = build_settings({"rule_set": "predicted-ttft"}, environ={})
    request = RouteRequest(None, prefix_blocks=40, prefix_matches={"holder": 40}, placement_key=7)
    idle = [pod(f"p{i}", running=1) for i in range(3)]
    busy_holder = pod("holder", running=8)  # busier, no queue: a second copy of the prefix would cost more
    assert choose_pod([busy_holder, *idle], request, settings, random.Random(1)).pod == "holder"
    queued_holder = pod("holder", waiting=12, running=8)  # 12 x 0.5 s of queue ahead: past the margin
    assert choose_pod([queued_holder, *idle], request, settings, random.Random(1)).pod != "holder"
    slightly = pod("holder", waiting=2, running=8)  # one more queued than the shortest queue: it keeps the prompt
    queued_others = [pod(f"p{i}", waiting=1, running=1) for i in range(3)]
    assert choose_pod([slightly, *queued_others], request, settings, random.Random(1)).pod == "holder"


def test_a_large_prompts_holder_without_room_gives_it_to_a_pod_that_starts_it_sooner():
    settings = build_settings({"rule_set": "predicted-ttft"}, environ={})
    request = RouteRequest(None, prefix_blocks=50, prefix_matches={"holder": 15}, placement_key=7)  # 3,200 tokens
    full = pod("holder", running=3, free=500, size=10_000, usage=0.95)  # a third of its cache: large there, no room
    roomy = [pod(f"p{i}", running=1, free=8000, size=10_000, usage=0.2) for i in range(2)]
    assert choose_pod([full, *roomy], request, settings, random.Random(1)).pod != "holder"
    with_room = pod("holder", running=3, free=6000, size=10_000, usage=0.4)
    assert choose_pod([with_room, *roomy], request, settings, random.Random(1)).pod == "holder"


def test_a_conversations_next_turn_leaves_holders_that_all_queue_but_a_first_turn_stays():
    settings = build_settings({"rule_set": "predicted-ttft"}, environ={})
    queued = pod("holder", waiting=6, running=2)
    idle = [pod(f"p{i}", running=1) for i in range(2)]
    first = RouteRequest(None, prefix_blocks=20, prefix_matches={"holder": 20}, placement_key=7)
    later = RouteRequest(None, prefix_blocks=20, prefix_matches={"holder": 20}, placement_key=7, later_turn=True)
    assert choose_pod([queued, *idle], first, settings, random.Random(1)).pod == "holder"
    assert choose_pod([queued, *idle], later, settings, random.Random(1)).pod != "holder"


def test_a_next_turn_leaves_its_historys_queued_full_pods_only_for_a_far_emptier_one():
    settings = build_settings({"rule_set": "predicted-ttft"}, environ={})

    def turn(history_blocks=10, later=True):
        return RouteRequest("a", prefix_blocks=12, prefix_matches={"h": history_blocks}, placement_key=7,
                            later_turn=later)

    full = pod("h", waiting=3, running=28, usage=0.97)  # a queue and a full cache: the turns began here
    emptier = pod("o", running=12, usage=0.5)
    assert choose_pod([full, emptier], turn(), settings, random.Random(1)).pod == "o"
    # A first turn stays: its prefix is an app's system prompt that other requests share.
    assert choose_pod([full, emptier], turn(later=False), settings, random.Random(1)).pod == "h"
    # No longer queue than the shortest: the history stays.
    unqueued = pod("h", running=28, usage=0.97)
    assert choose_pod([unqueued, emptier], turn(), settings, random.Random(1)).pod == "h"
    # No cache 30 points emptier: nowhere has room the history pods lack.
    nearly_as_full = pod("o", running=12, usage=0.75)
    assert choose_pod([full, nearly_as_full], turn(), settings, random.Random(1)).pod == "h"
    # The whole prompt held and a smaller gap: llm-d's weights keep it (3 x 1.0 + 2 x 0.03 against 2 x 0.4 + 2).
    somewhat = pod("o", running=12, usage=0.6)
    assert choose_pod([full, somewhat], turn(history_blocks=12), settings, random.Random(1)).pod == "h"
    assert choose_pod([full, somewhat], turn(history_blocks=6), settings, random.Random(1)).pod == "o"
    # Without prefix affinity nothing is kept for the history, so nothing is left for it either.
    off = build_settings({"rule_set": "predicted-ttft", "prefix_affinity": False}, environ={})
    decision = choose_pod([full, emptier], turn(), off, random.Random(1), explain=True)
    assert traced(decision, "next_turn_elsewhere") == ("next_turn_elsewhere", ("h", "o"), None)


def test_a_document_goes_where_llmds_weights_rate_best_once_the_caches_are_half_full():
    settings = build_settings({"rule_set": "predicted-ttft"}, environ={})  # 64 tokens a prefix block

    def choose(batch_usage, small_usage, blocks, chosen_settings=settings):
        batch = pod("batch", running=10, usage=batch_usage, free=int((1 - batch_usage) * 10_000), size=10_000)
        small = pod("small", running=1, usage=small_usage, free=int((1 - small_usage) * 10_000), size=10_000)
        request = RouteRequest("a", prefix_blocks=blocks, placement_key=7)
        return choose_pod([batch, small], request, chosen_settings, random.Random(1), explain=True)

    # A document (40 blocks, 2,560 tokens: over a fifth of a 10,000-token cache), caches 55% full on average: the
    # weights prefer the emptier cache (2 x 0.55 against 2 x 0.35), where the estimate takes the smaller batch.
    decision = choose(0.45, 0.65, 40)
    assert decision.pod == "batch"
    assert traced(decision, "document_weights") == ("document_weights", ("batch",), {"batch": -3.1, "small": -2.7})
    assert choose(0.25, 0.45, 40).pod == "small"  # caches 35% full: room is plentiful, the estimate decides
    assert choose(0.45, 0.65, 8).trace[0][1] == ("batch", "small")  # 512 tokens: not a document, the estimate decides
    off = build_settings({"rule_set": "predicted-ttft", "prefix_affinity": False}, environ={})
    assert choose(0.45, 0.65, 40, off).pod == "small"
    disabled = build_settings({"rule_set": "predicted-ttft", "disabled_rules": ["document_weights"]}, environ={})
    assert choose(0.45, 0.65, 40, disabled).pod == "small"


def test_an_adapter_s_document_is_rated_by_its_slot_too_while_the_fleet_serves_more_adapters_than_slots():
    settings = build_settings({"rule_set": "predicted-ttft"}, environ={})

    def choose(adapter, served, small_in_slots=None):
        # The emptier cache's two slots both hold other adapters; the fuller one runs the request's adapter.
        batch = pod("batch", running=10, usage=0.45, adapters=("c", "d"), free=5_500, size=10_000)
        small = replace(pod("small", running=1, usage=0.65, adapters=("a", "e"), free=3_500, size=10_000),
                        running_adapters=small_in_slots)
        request = RouteRequest(adapter, prefix_blocks=40, placement_key=7, served_adapters=served)
        return choose_pod([batch, small], request, settings, random.Random(1), explain=True)

    # Four slots, five adapters served: the slot counts (2 x 1.0 running it, 0 where every slot holds another).
    decision = choose("a", served=5)
    assert decision.pod == "small"
    assert traced(decision, "document_weights") == ("document_weights", ("small",), {"batch": -3.1, "small": -4.7})
    assert choose("a", served=4).pod == "batch"  # every adapter fits: llm-d's weights alone, as before
    assert choose("a", served=0).pod == "batch"  # served adapters not known: the same
    assert choose(None, served=5).pod == "batch"  # a base-model document takes no slot
    # The page says "a" only waits there for a slot (both slots run others): no better than the emptier cache.
    assert choose("a", served=5, small_in_slots=frozenset({"e", "f"})).pod == "batch"


def test_pages_without_slot_counts_leave_a_document_to_llmds_weights_alone():
    # An engine without LoRA, or one whose page gives no `max_lora`: no slot count, so no slot is scarce.
    settings = build_settings({"rule_set": "predicted-ttft"}, environ={})
    batch = pod("batch", running=10, usage=0.45, adapters=("c", "d"), max_lora=None, free=5_500, size=10_000)
    small = pod("small", running=1, usage=0.65, adapters=("a", "e"), max_lora=None, free=3_500, size=10_000)
    request = RouteRequest("a", prefix_blocks=40, placement_key=7, served_adapters=50)
    decision = choose_pod([batch, small], request, settings, random.Random(1), explain=True)
    assert traced(decision, "document_weights") == ("document_weights", ("batch",), {"batch": -3.1, "small": -2.7})


def test_the_adapter_waits_behind_adapters_queued_for_a_slot_and_its_own_batch_skips_their_queue():
    request = RouteRequest("x")
    full = predict(pod(adapters=("a", "c")), request, TPB, 0)
    crowded = predict(pod(adapters=("a", "c", "d", "e")), request, TPB, 0)  # two more already wait for a slot
    assert crowded.adapter_s - full.adapter_s == GENERATION_S / 2
    mine = RouteRequest("a")
    assert predict(pod(waiting=8, adapters=("a", "c", "d", "e")), mine, TPB, 0).queue_s < \
        predict(pod(waiting=8, adapters=("a", "c")), mine, TPB, 0).queue_s  # the others' requests are skipped


def test_a_slot_taken_costs_more_once_most_slots_are_in_use():
    request = RouteRequest("x")
    half = pod(adapters=("a",), max_lora=2)
    assert predict(half, request, TPB, 0, slots_scarce=True).harm_s > predict(half, request, TPB, 0).harm_s
    assert slots_in_use([pod(adapters=("a", "b")), pod(adapters=())]) == 0.5


def test_an_adapter_not_run_lately_loads_from_disk_only_when_the_fleet_serves_more_than_a_pod_keeps():
    few, many = RouteRequest("b", served_adapters=4), RouteRequest("b", served_adapters=12)  # a pod keeps 2 x 2 slots
    busy = pod(waiting=3)
    assert predict(busy, many, TPB, 0, residency_memory=2).adapter_s == (
        predict(busy, few, TPB, 0, residency_memory=2).adapter_s + COLD_ADAPTER_S)
    # ... its queue waits through the load too (vLLM loads within a step), and the adapter it evicts from the pod's
    # memory loads from disk in turn
    assert predict(busy, many, TPB, 0).harm_s == predict(busy, few, TPB, 0).harm_s + (3 + 1) * COLD_ADAPTER_S
    # a pod that ran it lately still holds it, however many the fleet serves
    assert predict(pod(waiting=3, resident=("b",)), many, TPB, 0).adapter_s == 0


def test_room_counts_only_the_queue_ahead_of_the_request_when_its_adapter_runs_past_others_waiting_for_a_slot():
    crowded = pod(waiting=6, running=2, adapters=("a", "b", "c", "d"), free=1_000, size=8_000)
    mine, other = RouteRequest("a", prefix_blocks=10), RouteRequest("e", prefix_blocks=10)
    assert predict(crowded, mine, TPB, 0).room_s < predict(crowded, other, TPB, 0).room_s


def test_half_the_requests_own_generation_counts_at_the_pods_batch_as_it_stands():
    request = RouteRequest("a", prefix_blocks=10)  # 160 tokens
    small, large = pod("small", running=2, free=9_000, size=10_000), pod("large", running=30, free=1_000, size=10_000)
    expected = GENERATION_SHARE * expected_step_s(2 + 1, 1_000 + 160 + 50) * 100
    assert abs(predict(small, request, TPB, 0).generation_s - expected) < 1e-9
    assert predict(large, request, TPB, 0).generation_s > predict(small, request, TPB, 0).generation_s
    # a holder whose batch grew large gives the request to a pod that decodes it sooner, though it adds an adapter
    settings = build_settings({"rule_set": "predicted-ttft"}, environ={})
    crowded, idle = pod("crowded", running=40, free=500, size=40_000, max_lora=4), pod(
        "idle", running=2, adapters=("b",), free=38_000, size=40_000, max_lora=4)
    assert choose_pod([crowded, idle], request, settings, random.Random(0)).pod == "idle"
    holder = pod("holder", running=2, free=38_000, size=40_000, max_lora=4)  # with a batch like the other's, it keeps it
    alike = predictions([holder, idle], request, settings)
    assert alike["holder"].generation_s == alike["idle"].generation_s and alike["holder"].total_s < alike["idle"].total_s
    # the answer's length is the candidates' mean, so one pod's rate does not tip it
    slow_rate = PodRates(prefill_factor=1.0, decode_step_s=0.08, queue_s_per_request=0.5, mean_output_tokens=300,
                         learned=True)
    both = predictions([small, pod("other", running=2, free=9_000, size=10_000, rates=slow_rate)], request, settings)
    assert both["small"].generation_s == both["other"].generation_s


def test_while_slots_are_scarce_equals_go_where_fewest_adapters_contend_for_them():
    settings = build_settings({"rule_set": "predicted-ttft"}, environ={})
    # every slot taken; both pods run the request's adapter, so the estimate finds them equal, but three other
    # adapters contend for one pod's slots and two for the other's
    crowded = pod("crowded", running=2, adapters=("x", "a", "b", "c"))
    fewer = pod("fewer", running=2, adapters=("x", "e", "f"))
    predicted = predictions([crowded, fewer], RouteRequest("x"), settings)
    assert predicted["crowded"].total_s == predicted["fewer"].total_s
    picks = {choose_pod([crowded, fewer], RouteRequest("x", placement_key=k), settings, random.Random(0)).pod
             for k in range(40)}
    assert picks == {"fewer"}
    decision = choose_pod([crowded, fewer], RouteRequest("x", placement_key=1), settings, random.Random(0), explain=True)
    assert [step[0] for step in decision.trace][3:7] == ["prefix_affinity_ttft", "new_instructions", "predicted_ttft",
                                                         "fewest_slot_contenders"]
    # with slots free it has no say: rendezvous rank decides between the same pods
    roomy = [pod("crowded", running=2, adapters=("x", "a"), max_lora=8), pod("fewer", running=2, adapters=("x",), max_lora=8)]
    picks = {choose_pod(roomy, RouteRequest("x", placement_key=k), settings, random.Random(0)).pod for k in range(40)}
    assert picks == {"crowded", "fewer"}


def test_a_hot_prefix_gains_a_second_holder_with_room_that_finishes_it_much_sooner():
    settings = build_settings({"rule_set": "predicted-ttft"}, environ={})
    request = RouteRequest(None, prefix_blocks=20, prefix_matches={"holder": 20}, placement_key=7)  # 320 tokens
    # no queue, so never far busier by the count rule, but 40 running requests: each decode step there is long
    crowded = pod("holder", running=40, free=2_000, size=40_000)
    roomy = pod("other", running=2, free=38_000, size=40_000)
    assert choose_pod([crowded, roomy], request, settings, random.Random(1)).pod == "other"
    # ... not where the copy would evict prefixes known cached there (37,900 of its free tokens)
    known = RouteRequest(None, prefix_blocks=20, prefix_matches={"holder": 20}, prefix_sizes={"other": 2_370},
                         placement_key=7)
    assert choose_pod([crowded, roomy], known, settings, random.Random(1)).pod == "holder"
    # ... nor while the holder finishes it about as soon
    alike = pod("holder", running=6, free=34_000, size=40_000)
    assert choose_pod([alike, roomy], request, settings, random.Random(1)).pod == "holder"
    # ... nor while its batch is under six times the other's: its full cache slows each step as much, but the
    # requests sharing one copy of a prompt fit more of them on one pod than on two
    fuller = pod("holder", running=11, free=2_000, size=40_000)
    assert choose_pod([fuller, roomy], request, settings, random.Random(1)).pod == "holder"
    assert choose_pod([pod("holder", running=12, free=2_000, size=40_000), roomy], request, settings,
                      random.Random(1)).pod == "other"
    # ... nor for an adapter's request while most LoRA slots are taken
    scarce = RouteRequest("a", prefix_blocks=20, prefix_matches={"holder": 20}, placement_key=7)
    busy_slots = [pod("holder", running=40, free=2_000, size=40_000, adapters=("a", "b")),
                  pod("other", running=2, free=38_000, size=40_000, adapters=("c", "d"))]
    assert choose_pod(busy_slots, scarce, settings, random.Random(1)).pod == "holder"


def test_an_apps_new_instructions_go_where_the_caches_hold_least_and_a_document_goes_by_the_estimate():
    settings = build_settings({"rule_set": "predicted-ttft"}, environ={})
    # "hot" runs the adapter and the smallest batch: the estimate's pick, but its cache holds four apps already
    pods = [pod("hot", running=1, adapters=("a",)), pod("p1", running=3, adapters=("b",)),
            pod("p2", running=3, adapters=("c",))]
    known = {"hot": 3_000, "p1": 40, "p2": 2_500}
    new_app = RouteRequest("a", prefix_blocks=20, instructions_blocks=16, prefix_sizes=known, placement_key=7)
    decision = choose_pod(pods, new_app, settings, random.Random(1), explain=True)
    assert decision.pod == "p1"
    assert [step[1] for step in decision.trace if step[0] == "new_instructions"] == [("p1",)]
    # a prompt mostly of other text (a document after the instructions) is the estimate's to place
    document = RouteRequest("a", prefix_blocks=60, instructions_blocks=16, prefix_sizes=known, placement_key=7)
    assert choose_pod(pods, document, settings, random.Random(1)).pod == "hot"
    # instructions a pod holds already stay with it (the holders' rule)
    held = RouteRequest("a", prefix_blocks=20, instructions_blocks=16, prefix_matches={"hot": 16},
                        prefix_sizes=known, placement_key=7)
    assert choose_pod(pods, held, settings, random.Random(1)).pod == "hot"
    # a pod far busier than the rest is no place for a new app, however little its cache holds
    queued = [pods[0], pod("p1", waiting=30, running=12, adapters=("b",)), pods[2]]
    assert choose_pod(queued, new_app, settings, random.Random(1)).pod == "p2"


_ADAPTERS = st.sampled_from(["a", "b", "c", "d", "e"])
_RATES = st.builds(lambda *v: PodRates.bounded(True, prefill_factor=v[0], decode_step_s=v[1], queue_s_per_request=v[2],
                                                mean_output_tokens=v[3], decode_factor=v[4]),
                   *[st.one_of(st.just(math.nan), st.floats(min_value=-1e9, max_value=1e9))] * 5)


@st.composite
def _candidates(draw):
    keys = draw(st.lists(st.sampled_from([f"p{i}" for i in range(8)]), min_size=1, max_size=8, unique=True))
    pods = []
    for key in keys:
        size = draw(st.one_of(st.none(), st.integers(1, 2_000_000)))
        free = None if size is None else draw(st.one_of(st.none(), st.integers(0, 2 * size)))
        waiting = draw(st.integers(0, 500))
        active, resident = (frozenset(draw(st.lists(_ADAPTERS, max_size=5))) for _ in range(2))
        pods.append(Candidate(key, waiting, draw(st.integers(0, 500)), draw(st.floats(0, 1)), active, resident,
                              draw(st.one_of(st.none(), st.integers(1, 8))),
                              reported_waiting=draw(st.integers(0, waiting)), rates=draw(_RATES),
                              kv_free_tokens=free, kv_cache_tokens=size,
                              running_adapters=draw(st.one_of(st.none(), st.frozensets(_ADAPTERS, max_size=5)))))
    return pods


@hypothesis_settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_candidates(), st.one_of(st.none(), _ADAPTERS), st.integers(0, 5_000), st.data())
def test_any_fleet_and_request_get_a_finite_prediction_and_a_pick_among_the_candidates(pods, adapter, blocks, data):
    """What the new terms read (batch sizes, KV free and size, learned rates at their bounds, prefixes known cached
    anywhere, an app's instructions unseen or held, a conversation's next turn, a document under KV pressure, peers
    dealing adapters to a pod that may not be a candidate, adapters in slots told apart or not, even more of them than
    slots or some no longer active) cannot make the estimate raise or leave the candidates."""
    keys = [p.key for p in pods]
    matches = data.draw(st.dictionaries(st.sampled_from(keys), st.integers(0, blocks)))
    sizes = data.draw(st.dictionaries(st.sampled_from(keys), st.integers(0, 10**7)))
    request = RouteRequest(adapter, prefix_blocks=blocks, prefix_matches=matches, prefix_sizes=sizes,
                           served_adapters=data.draw(st.integers(0, 64)), placement_key=data.draw(st.integers(0, 2**32)),
                           instructions_blocks=data.draw(st.integers(0, blocks)), later_turn=data.draw(st.booleans()),
                           gateways=data.draw(st.integers(1, 4)), dealt_adapters=data.draw(st.integers(0, 64)),
                           home=data.draw(st.one_of(st.none(), st.sampled_from([*keys, "a-pod-not-among-them"]))))
    rule_settings = build_settings({"rule_set": "predicted-ttft"}, environ={})
    for t in predictions(pods, request, rule_settings).values():
        assert math.isfinite(t.total_s) and t.total_s >= 0 and t.generation_s > 0
    assert choose_pod(pods, request, rule_settings, random.Random(0)).pod in keys


def test_among_gateways_the_default_deals_a_new_adapter_and_keeps_adapters_dealt_while_slots_are_scarce():
    settings = build_settings({}, environ={})
    # the dealt pod p0 runs a larger batch: alone, the least predicted time to first token is p1's free slot
    pods = [pod("p0", running=6, adapters=()), pod("p1", running=1, adapters=()), pod("p2", running=1, adapters=("x",))]
    new = RouteRequest("a", home="p0", gateways=3, dealt_adapters=3)
    assert choose_pod(pods, new, settings, random.Random(0)).pod == "p0"
    assert choose_pod(pods, RouteRequest("a", home="p0", gateways=1, dealt_adapters=3), settings,
                      random.Random(0)).pod == "p1"  # one gateway: nothing to agree with
    far_busier = [pod("p0", running=6, waiting=settings.spill_queue_margin + 1, adapters=()), *pods[1:]]
    assert choose_pod(far_busier, new, settings, random.Random(0)).pod == "p1"
    running = [pods[0], pod("p1", running=1, adapters=("a",)), pods[2]]
    assert choose_pod(running, new, settings, random.Random(0)).pod == "p1"  # runs somewhere: the prediction
    # a prompt that places a prefix is placed for the cache, not dealt: one p2 holds, or an app's new instructions
    held = RouteRequest("a", home="p0", gateways=3, dealt_adapters=3, prefix_blocks=10, prefix_matches={"p2": 8})
    assert choose_pod(pods, held, settings, random.Random(0)).pod == "p2"
    instructions = RouteRequest("a", home="p0", gateways=3, dealt_adapters=3, prefix_blocks=10, instructions_blocks=8)
    assert choose_pod(pods, instructions, settings, random.Random(0)).pod != "p0"
    assert choose_pod(pods, replace(instructions, instructions_blocks=4), settings, random.Random(0)).pod == "p0"
    # more adapters than slots (3 pods x 2): every request of an adapter to its dealt pod, up to two margins busier
    scarce = RouteRequest("a", home="p0", gateways=3, dealt_adapters=12)
    assert choose_pod(running, scarce, settings, random.Random(0)).pod == "p0"
    settings_off = build_settings({"disabled_rules": ["dealt"]}, environ={})
    assert choose_pod(running, scarce, settings_off, random.Random(0)).pod == "p1"


def test_while_adapters_outnumber_slots_a_request_does_not_join_another_pods_queue_for_a_slot():
    settings = build_settings({"rule_set": "predicted-ttft"}, environ={})
    unheard = build_settings({"rule_set": "predicted-ttft", "disabled_rules": ["no_slot_queue_joined"]}, environ={})
    # Two slots a pod. x runs on a busy pod; on "crowded" three other adapters take turns in its two slots (one waits);
    # "open" has a slot free.
    home = pod("home", waiting=40, running=8, adapters=("x", "a"), resident=("x",))
    crowded = pod("crowded", waiting=0, running=2, adapters=("c", "d", "e"), resident=("x",))
    open_slot = pod("open", waiting=60, running=8, adapters=("f",))
    pods = [home, crowded, open_slot]
    request = RouteRequest("x", placement_key=3, served_adapters=7)  # 7 adapters on 6 slots: not all can run at once
    assert choose_pod(pods, request, unheard, random.Random(0)).pod == "crowded"  # the estimate: its own wait alone
    decision = choose_pod(pods, request, settings, random.Random(0), explain=True)
    assert traced(decision, "no_slot_queue_joined")[1] == ("home", "open") and decision.pod == "home"
    # Slots for every adapter, a new adapter, or a base-model request: it has no say.
    for other in (RouteRequest("x", placement_key=3, served_adapters=6), RouteRequest("y", placement_key=3,
                  served_adapters=7), RouteRequest(None, placement_key=3, served_adapters=7)):
        kept = traced(choose_pod(pods, other, settings, random.Random(0), explain=True), "no_slot_queue_joined")[1]
        assert kept == ("home", "crowded", "open"), other
