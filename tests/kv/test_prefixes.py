"""Prompt prefixes: hashing, the per-pod index, and the rules that use them."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from lora_affinity_plugin.fleet.view import FleetView
from lora_affinity_plugin.kv.prefix_index import (
    REFRESH_S,
    PrefixIndex,
    decode_entries,
    encode_entries,
)
from lora_affinity_plugin.kv.prefixes import (
    prefix_hashes,
    prompt_prefix,
    render_prompt,
    request_salt,
)
from lora_affinity_plugin.routing.podstate import PodMetrics
from lora_affinity_plugin.routing.scheduling import Candidate, RouteRequest, choose_pod
from lora_affinity_plugin.config.settings import build_settings
from lora_affinity_plugin.fleet.store import PodRecord

SYSTEM = "You are a careful assistant. " * 40  # ~1,100 characters
S = build_settings({"rule_set": "lora-affinity-tree"}, environ={})  # the tree's rules for prefixes


def chat(*contents: str) -> list[dict]:
    return [{"role": "system", "content": contents[0]}] + [{"role": "user", "content": c} for c in contents[1:]]


def chain(messages, scope="adapter-a", salt=None, settings=S):
    return prompt_prefix(messages, scope, {"cache_salt": salt} if salt else {}, settings)


# --- the chain ---------------------------------------------------------------------------------


def test_same_text_under_another_adapter_or_salt_does_not_match():
    base = chain(chat(SYSTEM, "q1"))
    system_blocks = len(SYSTEM) // S.prefix_block_chars
    assert base[:system_blocks] == chain(chat(SYSTEM, "q2"))[:system_blocks]  # same adapter: shared
    other_adapter = chain(chat(SYSTEM, "q1"), scope="adapter-b")
    salted = chain(chat(SYSTEM, "q1"), salt="tenant-7")
    assert not set(base) & set(other_adapter)
    assert not set(base) & set(salted)
    assert chain(chat(SYSTEM, "q1"), salt="tenant-7") == salted  # stable across calls and processes


def test_a_longer_shared_prefix_matches_longer():
    one, two = "question one " * 50, "a different question entirely " * 50
    short = chain(chat(SYSTEM[:600], one))
    long_ = chain(chat(SYSTEM, one))
    other = chain(chat(SYSTEM, two))
    shared_long = sum(1 for a, b in zip(long_, other) if a == b)
    shared_short = sum(1 for a, b in zip(short, other) if a == b)
    assert shared_long > shared_short >= 1
    # A chain: once it differs, it never matches again.
    first_diff = next(i for i, (a, b) in enumerate(zip(long_, other)) if a != b)
    assert all(a != b for a, b in zip(long_[first_diff:], other[first_diff:]))


def test_short_prompts_have_no_chain_and_only_full_blocks_count():
    assert chain(chat("hi", "Is the Necronomicon in the movie: Army of Darkness?")) == ()
    text = "x" * (S.prefix_block_chars * 3 + 10)
    assert len(prefix_hashes(text, "m", None, S.prefix_block_chars)) == 3


def test_hashing_reads_at_most_prefix_max_chars():
    settings = build_settings({"prefix_max_chars": 4096}, environ={})
    huge = chat("y" * 10_000_000)
    hashes = chain(huge, settings=settings)
    assert len(hashes) == 4096 // settings.prefix_block_chars
    assert render_prompt(huge, 4096) == render_prompt(chat("y" * 5000), 4096)


def test_rendering_covers_multimodal_parts_and_never_raises():
    with_image = [{"role": "user", "content": [{"type": "text", "text": "describe"},
                                               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    other_image = [{"role": "user", "content": [{"type": "text", "text": "describe"},
                                                {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB"}}]}]
    assert render_prompt(with_image, 1000) != render_prompt(other_image, 1000)
    for odd in (None, 5, "text", [None, 3, {"role": 7, "content": {"x": 1}}], [{"content": [1, None, {"type": None}]}],
                [{"role": "user", "content": "\ud800 lone surrogate \U0001F600"}]):
        render_prompt(odd, 1000)
        prompt_prefix(odd, "m", {"cache_salt": 12}, S)


def test_a_salt_that_is_not_a_string_is_ignored():
    assert request_salt({"cache_salt": 42}) is None
    assert request_salt({"extra_body": {"cache_salt": "s"}}) == "s"
    assert request_salt(None) is None


@hyp_settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=300),
                    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
                    max_leaves=20),
       st.one_of(st.none(), st.text(max_size=20), st.integers()))
def test_any_body_renders_and_hashes_without_raising(messages, salt):
    hashes = prompt_prefix(messages, "m", {"cache_salt": salt}, build_settings({"prefix_min_blocks": 1,
                                                                                  "prefix_block_chars": 16}, environ={}))
    assert all(isinstance(h, int) for h in hashes)


# --- the index ---------------------------------------------------------------------------------


def test_index_matches_the_longest_held_prefix_per_pod():
    index = PrefixIndex(ttl_s=60)
    hashes = chain(chat(SYSTEM, "q"))
    index.add("a", hashes, 1.0)
    index.add("b", hashes[:2], 1.0)
    assert index.matches(hashes, ["a", "b", "c"]) == {"a": len(hashes), "b": 2}
    assert index.matches(hashes, ["b", "c"]) == {"b": 2}
    assert index.matches((12345,) + hashes[1:], ["a", "b"]) == {}


def test_chains_sharing_a_head_match_as_far_as_each_pod_holds_them_and_evicted_heads_leave_the_map():
    index = PrefixIndex(ttl_s=60)
    index.set_capacity("a", 6)
    index.add("a", [1, 2, 3, 4], 1.0)
    index.add("a", [1, 2, 5], 2.0)  # the same first blocks, then its own
    index.add("b", [1, 2], 2.0)
    assert index.matches([1, 2, 5, 6], ["a", "b"]) == {"a": 3, "b": 2}
    assert index.matches([1, 2, 3, 9], ["a", "b"]) == {"a": 3, "b": 2}
    index.add("a", [7, 8, 9, 10, 11, 12], 3.0)  # fills "a": every older block goes, heads included
    assert index.matches([1, 2, 3], ["a", "b"]) == {"b": 2}
    assert index.matches([7, 8, 9, 10, 11, 12], ["a"]) == {"a": 6}
    assert len(index) == 8 and set(index._holders) == {1, 7}  # only chains' heads are mapped: "b"'s and "a"'s


def test_index_is_bounded_per_pod_least_recently_used_out():
    index = PrefixIndex(ttl_s=60)
    index.set_capacity("a", 10)
    old, new = list(range(1, 9)), list(range(100, 106))
    index.add("a", old, 1.0)
    index.add("a", old[:2], 2.0)  # touched: recently used
    index.add("a", new, 3.0)
    assert index.sizes() == {"a": 10}
    assert index.matches(new, ["a"]) == {"a": 6}
    assert index.matches(old, ["a"]) == {"a": 4}  # least recently used out first, a chain's tail before its head
    assert len(index) == 10


def test_a_chain_used_again_within_a_second_keeps_its_place_and_later_moves_to_the_recent_end():
    index = PrefixIndex(ttl_s=60)
    index.set_capacity("a", 10)
    hot, other = [1, 2, 3, 4], [50, 51, 52, 53]
    index.add("a", hot, 10.0)
    index.add("a", other, 10.1)
    index.add("a", hot + [5], 10.5)  # within REFRESH_S: only its new block is entered, the rest stay put
    assert index.sizes() == {"a": 9}
    index.add("a", [90, 91], 10.6)  # over capacity by one: the oldest entry goes, the hot chain's tail
    assert index.matches(hot + [5], ["a"]) == {"a": 3}
    index.add("a", hot, 10.0 + REFRESH_S + 0.5)  # later: refreshed, its head now the most recent
    index.add("a", [92, 93, 94], 12.0)
    assert index.matches(hot, ["a"]) == {"a": 4} and index.matches(other, ["a"]) == {}  # the other chain went first


def test_a_peers_blocks_are_all_entered_though_not_one_chain():
    index = PrefixIndex(ttl_s=60)
    index.add("a", [1, 2, 3], 10.0)
    index.add_shared("a", [7, 8, 3, 9], 10.2)  # a peer's newest blocks of several chains, 3 among them
    assert index.sizes() == {"a": 6}
    assert index.matches([7, 8], ["a"]) == {"a": 2} and index.matches([9], ["a"]) == {"a": 1}
    assert index.take_outbox(limit=100) == [("a", 10.0, [1, 2, 3])]  # a peer's blocks are not shared again


def test_index_entries_expire():
    index = PrefixIndex(ttl_s=10)
    index.add("a", [1, 2, 3], 100.0)
    index.add("a", [4], 105.0)
    assert index.expire(111.0) == 3
    assert index.sizes() == {"a": 1} and len(index) == 1


def test_outbox_is_bounded_and_round_trips_through_the_wire_format():
    index = PrefixIndex(ttl_s=60)
    index.add("a", list(range(50)), 1.0)
    index.add("b", list(range(1000, 1010)), 2.0)
    entries = index.take_outbox(limit=20)
    assert sum(len(h) for _, _, h in entries) == 20
    assert {pod for pod, _, _ in entries} == {"a", "b"}  # the newest blocks are kept
    assert decode_entries(encode_entries(entries)) == [(p, round(t, 3), h) for p, t, h in entries]
    assert index.take_outbox(limit=20) == []
    assert decode_entries(b"not json") == [] and decode_entries(b'[["a"]]') == []


def test_fleet_sizes_each_pods_index_from_its_cache():
    fleet = FleetView(S)
    metrics = PodMetrics(num_gpu_blocks=700, block_size=16)
    fleet.update({"a": PodRecord("a", 1.0, metrics)})
    assert fleet.prefixes.capacity("a") == int(700 * 16 * S.prefix_chars_per_token // S.prefix_block_chars)


# --- the rules -----------------------------------------------------------------------------------


def pod(key, waiting=0, running=0, adapters=(), kv=0.1, reported=None):
    return Candidate(key, waiting, running, kv, frozenset(adapters), max_lora=4,
                     reported_waiting=waiting if reported is None else reported)


def request(matches, blocks=8, adapter=None):
    return RouteRequest(adapter, prefix_blocks=blocks, prefix_matches=matches, placement_key=7)


def test_the_longest_match_wins_among_pods_not_far_busier():
    pods = [pod("a", waiting=2), pod("b", waiting=0), pod("c", waiting=1)]
    decision = choose_pod(pods, request({"a": 8, "c": 3}), S, random.Random(1))
    assert (decision.pod, decision.branch) == ("a", "prefix")


def test_a_far_busier_pod_holding_the_prefix_is_passed_over():
    pods = [pod("a", waiting=40, running=60), pod("b", waiting=0, running=10), pod("c", waiting=1, running=10)]
    decision = choose_pod(pods, request({"a": 8, "c": 3}), S, random.Random(1))
    assert decision.pod == "c"  # the shorter match on a roomy pod beats the longer one on a far busier pod
    decision = choose_pod(pods, request({"a": 8}), S, random.Random(1))
    assert decision.pod in ("b", "c") and decision.branch == "new_prefix"


def test_requests_just_sent_are_not_a_queue_that_passes_a_holder_over():
    pods = [pod("a", waiting=30, running=30, reported=0), pod("b", waiting=0, running=2)]
    assert choose_pod(pods, request({"a": 8}), S, random.Random(1)).pod == "a"
    pods = [pod("a", waiting=30, running=30, reported=1), pod("b", waiting=0, running=2)]
    assert choose_pod(pods, request({"a": 8}), S, random.Random(1)).pod == "a"  # one waiting: next step's
    pods = [pod("a", waiting=30, running=30, reported=2), pod("b", waiting=0, running=2)]
    assert choose_pod(pods, request({"a": 8}), S, random.Random(1)).pod == "b"


def test_a_match_shorter_than_prefix_min_blocks_does_not_count():
    pods = [pod("a", waiting=3), pod("b", waiting=0)]
    decision = choose_pod(pods, request({"a": 1}), S, random.Random(1))
    assert decision.branch == "new_prefix"


def test_new_prefixes_go_where_the_cache_holds_least_and_gateways_agree():
    pods = [pod("a"), pod("b"), pod("c")]
    sized = RouteRequest(None, prefix_blocks=8, placement_key=99, prefix_sizes={"a": 100, "b": 5, "c": 90})
    assert choose_pod(pods, sized, S, random.Random(1)).pod == "b"
    picks = {choose_pod(pods, RouteRequest(None, prefix_blocks=8, placement_key=k), S, random.Random(seed)).pod
             for seed in range(20) for k in (123,)}
    assert len(picks) == 1  # the same key: every gateway (any RNG) picks the same pod
    spread = {choose_pod(pods, RouteRequest(None, prefix_blocks=8, placement_key=k), S, random.Random(0)).pod
              for k in range(60)}
    assert spread == {"a", "b", "c"}  # different keys spread over the pods


def test_prefix_affinity_off_ignores_matches():
    off = build_settings({"rule_set": "lora-affinity-tree", "prefix_affinity": False}, environ={})
    pods = [pod("a", waiting=3), pod("b", waiting=0)]
    assert choose_pod(pods, request({"a": 8}), off, random.Random(1)).branch == "base_model"


@pytest.mark.parametrize("rule_set", ["llmd-prefix", "sglang-cache-aware"])
def test_reference_policies_follow_the_prefix(rule_set):
    settings = build_settings({"rule_set": rule_set}, environ={})
    pods = [pod("a", waiting=1), pod("b", waiting=0), pod("c", waiting=0)]
    assert choose_pod(pods, request({"a": 8}), settings, random.Random(1)).pod == "a"


def test_sglang_reference_balances_when_load_is_far_apart_and_fills_the_smallest_tree():
    settings = build_settings({"rule_set": "sglang-cache-aware"}, environ={})
    pods = [pod("a", waiting=100, running=100), pod("b", waiting=0, running=10)]
    assert choose_pod(pods, request({"a": 8}), settings, random.Random(1)).branch == "sglang_balance"
    pods = [pod("a"), pod("b")]
    fresh = RouteRequest(None, prefix_blocks=8, prefix_sizes={"a": 10, "b": 3})
    assert choose_pod(pods, fresh, settings, random.Random(1)).pod == "b"


def test_only_the_first_messages_are_read_and_the_head_cache_agrees():
    from lora_affinity_plugin.kv.prefixes import MAX_MESSAGES
    from lora_affinity_plugin.kv.prefixes import prefix_hashes as plain

    settings = build_settings({"prefix_block_chars": 16, "prefix_min_blocks": 1}, environ={})
    many = [{"role": "system", "content": "s" * 64}] + [{"role": "user", "content": f"m{i}"} for i in range(3000)]
    assert render_prompt(many, 10**6) == render_prompt(many[:MAX_MESSAGES], 10**6)
    assert prompt_prefix(many, "m", {}, settings) == plain(render_prompt(many, settings.prefix_max_chars), "m", None, 16)


@hyp_settings(max_examples=300, deadline=None)
@given(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", 3]),
                                       "content": st.text(max_size=700) | st.none()}), min_size=1, max_size=4),
       st.integers(min_value=16, max_value=64), st.integers(min_value=0, max_value=2000))
def test_the_cached_head_gives_the_same_chain_as_hashing_everything(messages, block, limit):
    from lora_affinity_plugin.kv.prefixes import prefix_hashes as plain

    settings = build_settings({"prefix_block_chars": block, "prefix_max_chars": limit, "prefix_min_blocks": 1},
                              environ={})
    for _ in range(2):  # a miss, then a hit of the head cache
        got = prompt_prefix(messages, "m", {"cache_salt": "s"}, settings)
    assert got == plain(render_prompt(messages, limit), "m", "s", block)


def test_two_system_prompts_that_differ_only_in_the_middle_keep_their_own_chains():
    """A template filled in the middle (same length, same ends) must not be handed the other's chain from the head
    cache, in either order, repeated."""
    from lora_affinity_plugin.kv.prefixes import prefix_hashes as plain

    settings = build_settings({"prefix_block_chars": 64, "prefix_min_blocks": 1}, environ={})
    edge = "You are the support assistant of ACME. " * 4
    filled = [[{"role": "system", "content": edge + name + edge}, {"role": "user", "content": "hi"}]
              for name in ("customer Alice Smith", "customer Bobby Jones")]
    for messages in (*filled, *filled, *filled):
        assert prompt_prefix(messages, "m", {}, settings) == plain(render_prompt(messages, 65_536), "m", None, 64)
    chains = {prompt_prefix(messages, "m", {}, settings) for messages in filled}
    assert len(chains) == 2


# --- one decision: the adapter rules hold for every prompt -----------------------------------------------


def test_a_long_unseen_prompt_for_a_running_adapter_stays_with_its_adapter():
    """The previous default placed it by index size; the adapter's holder wins now, whatever the caches hold."""
    pods = [pod("a", running=6, adapters={"sql"}), pod("b", running=2, adapters={"t1", "t2", "t3", "t4"}),
            pod("c", running=2, adapters={"t5"})]
    unseen = RouteRequest("sql", prefix_blocks=8, placement_key=7, prefix_sizes={"a": 900, "b": 0, "c": 10})
    assert {choose_pod(pods, unseen, S, random.Random(seed)).pod for seed in range(20)} == {"a"}
    v1 = build_settings({"rule_set": "lora-affinity-v1"}, environ={})
    assert choose_pod(pods, unseen, v1, random.Random(1)).pod != "a"  # what it replaced


def test_an_adapters_unseen_app_instructions_go_where_the_caches_hold_least_a_text_stays_with_the_adapter():
    """Every later request of the app follows its instructions to their pod: they are placed for the cache first
    (then a pod running the adapter, else one with a free slot); the same prompt without a system message is a
    text seen once and stays with the adapter's pod."""
    pods = [pod("a", running=6, adapters={"sql"}), pod("b", running=2, adapters={"t1", "t2", "t3", "t4"}),
            pod("c", running=2, adapters={"t5"})]
    sizes = {"a": 900, "b": 0, "c": 10}
    app = RouteRequest("sql", prefix_blocks=8, placement_key=7, prefix_sizes=sizes, instructions_blocks=6)
    text = RouteRequest("sql", prefix_blocks=8, placement_key=7, prefix_sizes=sizes)
    decisions = {choose_pod(pods, app, S, random.Random(seed)).pod for seed in range(20)}
    assert decisions == {"c"}  # b and c hold least; c has a free slot for the adapter, b has none
    assert {choose_pod(pods, text, S, random.Random(seed)).pod for seed in range(20)} == {"a"}
    short = RouteRequest("sql", prefix_blocks=8, placement_key=7, prefix_sizes=sizes, instructions_blocks=1)
    assert choose_pod(pods, short, S, random.Random(1)).pod == "a"  # instructions under prefix_min_blocks: a text
    held = RouteRequest("sql", prefix_blocks=8, prefix_matches={"a": 8}, placement_key=7, prefix_sizes=sizes,
                        instructions_blocks=6)
    assert choose_pod(pods, held, S, random.Random(1)).pod == "a"  # once placed, the adapter rules and the match


def test_instructions_are_a_system_or_developer_message_with_text():
    from lora_affinity_plugin.kv.prefixes import instructions_blocks

    system = [{"role": "system", "content": "x" * 1022}, {"role": "user", "content": "q" * 5000}]
    assert instructions_blocks(system, 256) == 4  # role, separators and content: 1030 characters
    assert instructions_blocks([{"role": "developer", "content": "x" * 600}], 256) == 2
    assert instructions_blocks([{"role": "user", "content": "x" * 5000}], 256) == 0  # a text, not instructions
    assert instructions_blocks([{"role": "system", "content": [{"type": "text", "text": "x"}]}], 256) == 0
    assert instructions_blocks("a completion prompt", 256) == instructions_blocks([], 256) == instructions_blocks(None, 256) == 0


def test_a_new_adapter_with_a_long_prompt_is_placed_by_the_adapter_rules_then_the_emptiest_cache():
    pods = [pod("a", adapters={"x1", "x2", "x3"}), pod("b", adapters={"y1"}), pod("c", adapters={"z1"})]
    unseen = RouteRequest("new", prefix_blocks=8, placement_key=7, prefix_sizes={"a": 0, "b": 500, "c": 20})
    assert choose_pod(pods, unseen, S, random.Random(1)).pod == "c"  # fewest adapters (b, c), then the emptier cache


def test_a_long_match_for_the_adapter_holds_a_little_beyond_the_spill_margin_but_no_further():
    margin = S.spill_queue_margin + S.prefix_queue_margin
    holder = pod("a", waiting=0, running=margin, adapters={"sql"}, reported=0)
    spare = pod("b", waiting=0, running=0, adapters=set(), reported=0)
    matched = RouteRequest("sql", prefix_blocks=8, prefix_matches={"a": 8}, placement_key=7)
    assert choose_pod([holder, spare], matched, S, random.Random(1)).pod == "a"  # the prefill saved is worth it
    busier = pod("a", waiting=0, running=margin + 1, adapters={"sql"}, reported=0)
    assert choose_pod([busier, spare], matched, S, random.Random(1)).pod == "b"  # a hot adapter still spreads


def test_a_pod_holding_the_prefix_with_a_free_slot_beats_a_holder_of_the_adapter_without_it():
    holder = pod("a", running=4, adapters={"sql"})
    warm = pod("b", running=4, adapters={"t1"})  # ran this adapter's prompt before; the adapter left, a slot is free
    matched = RouteRequest("sql", prefix_blocks=8, prefix_matches={"b": 8}, placement_key=7)
    decision = choose_pod([holder, warm], matched, S, random.Random(1))
    assert (decision.pod, decision.branch) == ("b", "prefix")


def test_a_chats_next_turn_stays_with_the_holder_of_its_history_beyond_the_load_band():
    """Both pods run the adapter; the idle one is the load band's only member. The turn's history is on the
    busier one, within the prefix rules' margin: recomputing it elsewhere costs more than the queue."""
    history = pod("a", running=S.prefix_queue_margin, adapters={"sql"})
    idle = pod("b", running=0, adapters={"sql"})
    turn = RouteRequest("sql", prefix_blocks=8, prefix_matches={"a": 8}, placement_key=7)
    decision = choose_pod([history, idle], turn, S, random.Random(1))
    assert (decision.pod, decision.branch) == ("a", "prefix")
    trace = choose_pod([history, idle], turn, S, random.Random(1), explain=True).trace
    assert ("least_load", ("b", "a")) in [(rule, out) for rule, out, _ in trace]  # the band alone would have kept only the idle pod
    slow = replace(history, slowness=2.0)  # a slower pod recomputes nothing faster: the band stands
    assert choose_pod([slow, idle], turn, S, random.Random(1)).pod == "b"
    far = pod("a", waiting=3, running=S.prefix_queue_margin, adapters={"sql"})  # a queue beyond the margin
    assert choose_pod([far, idle], turn, S, random.Random(1)).pod == "b"



def test_a_conversations_next_turn_leaves_a_queued_pod_only_when_recomputing_its_history_costs_less():
    """The cost decides for a base-model chat's next turn when every pod holding its history reported a queue:
    a short history is recomputed on an idle pod rather than wait; a long one waits; a pod with requests just
    sent (no queue at its scrape) and a first turn (the app's system prompt, which other chats match) keep the
    prefix rules."""
    queued = pod("a", waiting=3, running=4)  # not far busier than b (load 7 against 2), but a queue at its scrape
    idle = pod("b", running=2)

    def turn(held, later=True):
        return RouteRequest(None, prefix_blocks=8, prefix_matches={"a": held}, placement_key=7, later_turn=later)

    decision = choose_pod([queued, idle], turn(2), S, random.Random(1))
    assert (decision.pod, decision.branch) == ("b", "next_turn")
    decision = choose_pod([queued, idle], turn(8), S, random.Random(1))
    assert decision.pod == "a"  # all of it held: as cheap as recomputing it (within the band), and no second copy
    just_sent = pod("a", waiting=3, running=4, reported=0)
    assert choose_pod([just_sent, idle], turn(2), S, random.Random(1)).pod == "a"
    decision = choose_pod([queued, idle], turn(2, later=False), S, random.Random(1))
    assert (decision.pod, decision.branch) == ("a", "prefix")
    explained = choose_pod([queued, idle], turn(2), S, random.Random(1), explain=True)
    assert explained.costs["b"].total_s < explained.costs["a"].total_s  # the parts `explain` prints say why


def test_a_later_turn_carries_an_assistant_message():
    from lora_affinity_plugin.kv.prefixes import is_later_turn

    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert not is_later_turn(first)
    assert is_later_turn(first + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}])
    assert not is_later_turn("a completion prompt") and not is_later_turn(None) and not is_later_turn([None, 3])

# --- several gateways place an adapter alike ---------------------------------------------------------


def test_gateways_start_a_new_adapter_on_the_pod_the_deal_gives_it():
    pods = [pod("a"), pod("b"), pod("c")]
    new = RouteRequest("sql", placement_key=7, gateways=3, home="c", dealt_adapters=24)
    decisions = [choose_pod(pods, new, S, random.Random(seed), explain=True) for seed in range(10)]
    assert {d.pod for d in decisions} == {"c"} and all(d.trace[-1][0] == "dealt" for d in decisions)


def test_when_every_adapter_fits_a_dealt_pod_holding_other_apps_prompts_is_passed_over():
    """An adapter that fits stays where it starts, and so do the sessions it draws: its first long prompt
    goes to the emptiest caches (every gateway to the same one), not to a dealt pod that holds other apps'
    prompts. With more adapters than slots placements recur, and the deal stands."""
    pods = [pod("a"), pod("b"), pod("c")]  # 4 slots each: 12
    sizes = {"a": 500, "b": 0, "c": 0}
    fits = RouteRequest("sql", prefix_blocks=8, placement_key=7, prefix_sizes=sizes, gateways=3, home="a",
                        dealt_adapters=4)
    chosen = {choose_pod(pods, fits, S, random.Random(seed)).pod for seed in range(10)}
    assert len(chosen) == 1 and chosen <= {"b", "c"}  # the gateways agree, on an empty cache
    scarce = replace(fits, dealt_adapters=24)
    assert choose_pod(pods, scarce, S, random.Random(1)).pod == "a"
    short = replace(fits, prefix_blocks=0)  # a short prompt leaves no cache to weigh: the deal stands
    assert choose_pod(pods, short, S, random.Random(1)).pod == "a"


def test_with_scarce_slots_gateways_keep_each_adapter_on_its_dealt_pod_until_it_is_far_busier():
    """More adapters than slots: every spill from one gateway's partial view starts an adapter on a pod whose slots
    the others are filling too, and the gateways scatter adapters (3 gateways lost 4.9% of one gateway's
    completions on scarce-slots over 20 seeds). So each adapter stays on its dealt pod, whoever else runs it,
    until it is more than two spill margins busier than the least busy pod."""
    margin = S.spill_queue_margin
    holder = pod("a", running=2, adapters={"sql"})
    dealt = pod("c", running=2 + 2 * margin, adapters={"ner"})
    scarce = RouteRequest("sql", prefix_blocks=8, placement_key=7, gateways=3, home="c", dealt_adapters=24)
    decision = choose_pod([holder, pod("b", running=2), dealt], scarce, S, random.Random(1))
    assert (decision.pod, decision.branch) == ("c", "dealt")
    far_busier = replace(dealt, running=dealt.running + 1)
    assert choose_pod([holder, pod("b", running=2), far_busier], scarce, S, random.Random(1)).pod == "a"
    # Slots for every adapter, or one gateway: the adapter stays with the pod running it.
    assert choose_pod([holder, pod("b", running=2), dealt], replace(scarce, dealt_adapters=4), S,
                      random.Random(1)).pod == "a"
    assert choose_pod([holder, pod("b", running=2), dealt], replace(scarce, gateways=1, home=None), S,
                      random.Random(1)).pod == "a"


def test_pods_whose_pages_give_no_lora_slot_count_never_count_as_scarce():
    """A page without `max_lora` (an older server, LoRA off): the slot count is unknown, so the dealt-pod rule
    stays off and the usual adapter rules decide."""
    holder = replace(pod("a", running=2, adapters={"sql"}), max_lora=None)
    dealt = replace(pod("c", running=2, adapters={"ner"}), max_lora=None)
    scarce = RouteRequest("sql", placement_key=7, gateways=3, home="c", dealt_adapters=24)
    decision = choose_pod([holder, dealt], scarce, S, random.Random(1))
    assert (decision.pod, decision.branch) == ("a", "affinity")


def test_of_the_holders_that_admit_an_unseen_long_prompt_at_once_the_fastest_takes_it():
    """All of an unseen prompt is computed, and a half-speed pod doubles that prefill: an 8 KB text on one missed
    1 s every time (mixed-hetero). The load band alone chose the less loaded half-speed holder."""
    slow = replace(pod("slow", running=2, adapters={"sql"}), kv_free_tokens=5000, slowness=2.0)
    fast = replace(pod("fast", running=9, adapters={"sql"}), kv_free_tokens=5000)
    unseen = RouteRequest("sql", prefix_blocks=31, placement_key=7)
    assert choose_pod([slow, fast], unseen, S, random.Random(1)).pod == "fast"
    # The fast holder has a queue: of the pods that admit it at once, the slow one is the fastest.
    assert choose_pod([slow, replace(fast, waiting=3, reported_waiting=3)], unseen, S, random.Random(1)).pod == "slow"
    # A short prompt keeps the load band: its prefill is a step either way.
    assert choose_pod([slow, fast], RouteRequest("sql", placement_key=7), S, random.Random(1)).pod == "slow"


def test_an_unseen_long_prompt_goes_to_a_holder_of_its_adapter_that_admits_it_at_once():
    """The load band alone counts a queue of 6 behind a full cache like 6 running requests: it chose `a`
    (load 12) over `b` (load 13, no queue, room in its cache), and the prompt waited behind that queue
    (mixed-hetero: 30-40 s on a half-speed pod whose cache a hot adapter's 8 KB texts had filled)."""
    queued = replace(pod("a", waiting=6, running=6, adapters={"sql"}), kv_free_tokens=400)
    roomy = replace(pod("b", running=13, adapters={"sql"}), kv_free_tokens=5000)
    full = pod("c", adapters={"t1", "t2", "t3", "t4"})  # no slot for the adapter
    unseen = RouteRequest("sql", prefix_blocks=31, placement_key=7)
    decision = choose_pod([queued, roomy, full], unseen, S, random.Random(1))
    assert (decision.pod, decision.branch) == ("b", "affinity")
    off = build_settings({"rule_set": "lora-affinity-tree", "disabled_rules": ["admits_now"]}, environ={})
    assert choose_pod([queued, roomy, full], unseen, off, random.Random(1)).pod == "a"  # the band alone
    # Its prefix held on the queued pod, not far busier than the least loaded: the prefix rules judge that
    # queue (the prefill saved), not this rule. (Beside the idle `c`, `a` is far busier: the prompt is new.)
    held = RouteRequest("sql", prefix_blocks=31, prefix_matches={"a": 31}, placement_key=7)
    assert choose_pod([queued, roomy], held, S, random.Random(1)).pod == "a"
    assert choose_pod([queued, roomy, full], held, S, random.Random(1)).pod == "b"
    # Nobody admits it at once (both queued): the rule passes its input on, and the load band decides.
    both = [queued, replace(roomy, waiting=2, reported_waiting=2), full]
    assert choose_pod(both, unseen, S, random.Random(1)).pod == "a"


def test_a_large_prompt_leaves_its_prefix_holder_when_that_cache_has_no_room_for_it():
    """kv-pressure: a tenant's ~3,300-token document on a replica whose 11,200-token cache its running requests
    fill waits for whole requests to end (seconds), where recomputing the prefix elsewhere takes a fraction of a
    second. The holder keeps it while it has room, and a small prompt keeps its holder: room for it frees as soon
    as any request ends."""
    full = replace(pod("a", running=6, adapters={"sql"}), kv_free_tokens=100, kv_cache_tokens=11_200)
    idle = replace(pod("b", running=1, adapters={"ner"}), kv_free_tokens=9_000, kv_cache_tokens=11_200)
    large = RouteRequest("sql", prefix_blocks=40, prefix_matches={"a": 38}, placement_key=7)  # 2,560 tokens: 23%
    assert choose_pod([full, idle], large, S, random.Random(1)).pod == "b"
    roomy_holder = replace(full, kv_free_tokens=3_000)
    assert choose_pod([roomy_holder, idle], large, S, random.Random(1)).pod == "a"
    small = RouteRequest("sql", prefix_blocks=12, prefix_matches={"a": 11}, placement_key=7)  # 768 tokens: 7%
    assert choose_pod([full, idle], small, S, random.Random(1)).pod == "a"
    unknown_size = replace(full, kv_cache_tokens=None)  # a page that does not say how big the cache is
    assert choose_pod([unknown_size, idle], large, S, random.Random(1)).pod == "a"


def _speeds(slowness: float) -> dict:
    from lora_affinity_plugin.routing.podstate import PodRates

    return {"slowness": slowness, "rates": PodRates(prefill_factor=slowness, decode_factor=slowness)}


def test_instructions_held_only_on_a_slower_pod_give_way_to_an_idle_faster_pod():
    """An app's instructions (10 of 31 blocks) held on one half-speed pod, its adapter running nowhere: computing
    the other 21 blocks there at half speed takes longer than the whole prompt on an idle full-speed pod
    (kv-pressure-hetero: 0.99 s against 0.77 s), and while the holder kept them the app's every new prompt went
    slow. Under load the fast pod's time is worth more than the seconds saved, and the holder keeps them."""
    slow = replace(pod("slow"), kv_free_tokens=50_000, **_speeds(2.0))
    fast = replace(pod("fast"), kv_free_tokens=50_000)
    app = RouteRequest("sql", prefix_blocks=31, prefix_matches={"slow": 10}, placement_key=7, instructions_blocks=10)
    assert choose_pod([slow, fast], app, S, random.Random(1)).pod == "fast"
    # Most of the prompt held there: the rest is quicker on the slow pod than all of it on the fast one.
    assert choose_pod([slow, fast], replace(app, prefix_matches={"slow": 29}), S, random.Random(1)).pod == "slow"
    # The fast pod is computing a prompt this gateway sent it a moment ago: it would start this one later.
    assert choose_pod([slow, fast], replace(app, prefilling={"fast": 1.0}), S, random.Random(1)).pod == "slow"
    # The fast pods are all busy: the time saved is less than the fast-pod time the move costs.
    busy = replace(fast, running=2)
    assert choose_pod([slow, busy], app, S, random.Random(1)).pod == "slow"
    # Pods of one speed: the holder keeps them, as before.
    assert choose_pod([replace(slow, **_speeds(1.0)), fast], app, S, random.Random(1)).pod == "slow"


def test_an_app_s_new_instructions_go_where_they_start_soonest_not_only_to_the_fastest_pod():
    """The fastest pods first, until what one is computing costs more than a slower pod's whole prefill."""
    slow = replace(pod("slow"), kv_free_tokens=50_000, **_speeds(2.0))
    fast = replace(pod("fast"), kv_free_tokens=50_000)
    unseen = RouteRequest("sql", prefix_blocks=31, placement_key=7, instructions_blocks=10)
    assert choose_pod([slow, fast], unseen, S, random.Random(1)).pod == "fast"
    assert choose_pod([slow, fast], replace(unseen, prefilling={"fast": 3.0}), S, random.Random(1)).pod == "slow"
    # Equal pods: the prompts in flight do not decide here (load and cost do, after).
    twins = [replace(slow, key="a", **_speeds(1.0)), replace(fast, key="b")]
    chosen = choose_pod(twins, unseen, S, random.Random(1)).pod
    assert choose_pod(twins, replace(unseen, prefilling={chosen: 3.0}), S, random.Random(1)).pod == chosen


def test_the_head_cache_keeps_no_caller_chosen_string_past_256_characters():
    from lora_affinity_plugin.kv.prefixes import _HeadCache

    cache = _HeadCache(size=4)
    huge_salt = "s" * 1_000_000
    first = cache.chain("system", "You are a helpful assistant. " * 20, "model", huge_salt, 64)
    assert cache.chain("system", "You are a helpful assistant. " * 20, "model", huge_salt, 64) is first  # a hit
    assert cache.chain("system", "You are a helpful assistant. " * 20, "model", huge_salt + "x", 64) != first
    kept = [part for key in cache._entries for part in key if isinstance(part, str)]
    assert all(len(part) <= 256 for part in kept)
