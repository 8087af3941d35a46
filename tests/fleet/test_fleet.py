"""The proxy's fleet view: dispatches since the scrape, staleness, residency of idle pods."""

import pytest

from lora_affinity_plugin.fleet.request_builder import RequestBuilder
from lora_affinity_plugin.fleet.view import FleetView
from lora_affinity_plugin.routing.podstate import PodMetrics
from lora_affinity_plugin.config.settings import SettingsError, build_settings
from lora_affinity_plugin.fleet.store import PodRecord

S = build_settings({"stale_after_ms": 1000, "metrics_ttl_ms": 3000})
DISPATCH_LAG_S = S.dispatch_lag_ms / 1000


def rec(pod, at, running=(), waiting=0, max_lora=4, loaded=()):
    return PodRecord(pod, at, PodMetrics(num_requests_waiting=waiting, num_requests_running=1,
                                         running_lora_adapters=frozenset(running), max_lora=max_lora,
                                         loaded_lora_adapters=frozenset(loaded)))


def test_dispatches_since_the_scrape_count_as_waiting_until_a_newer_scrape():
    fleet = FleetView(S)
    fleet.update({"a": rec("a", 100.0)})
    fleet.note_dispatch("a", "x", 100.2)
    fleet.note_dispatch("a", None, 100.3)
    (c,) = fleet.candidates(["a"], 100.4)
    assert c.waiting == 2 and "x" in c.active_adapters
    fleet.update({"a": rec("a", 100.3 + DISPATCH_LAG_S + 0.01, waiting=2)})  # the server now reports them
    (c,) = fleet.candidates(["a"], 100.5)
    assert c.waiting == 2 and "x" not in c.active_adapters


def test_a_dispatch_just_before_a_scrape_is_not_yet_covered():
    fleet = FleetView(S)
    fleet.update({"a": rec("a", 100.0)})
    fleet.note_dispatch("a", "x", 100.19)
    fleet.update({"a": rec("a", 100.2)})  # within the dispatch lag: the request may not have arrived
    assert fleet.candidates(["a"], 100.25)[0].waiting == 1


def test_stale_and_failing_pods_are_left_out():
    fleet = FleetView(S)
    fleet.update({"a": rec("a", 100.0), "b": rec("b", 98.5), "c": PodRecord("c", 100.0, None, "HTTP 500")})
    assert [c.key for c in fleet.candidates(["a", "b", "c", "unknown"], 100.1)] == ["a"]


def test_a_pod_that_refused_a_connection_is_out_until_a_later_scrape_reads_it():
    fleet = FleetView(S)
    fleet.update({"a": rec("a", 100.0), "b": rec("b", 100.0)})
    assert fleet.refused("a", 100.2) is True
    assert fleet.refused("a", 100.21) is False  # already out
    assert [c.key for c in fleet.candidates(["a", "b"], 100.3)] == ["b"]
    fleet.update({"a": rec("a", 100.15), "b": rec("b", 100.15)})  # scraped before it refused: not evidence
    assert [c.key for c in fleet.candidates(["a", "b"], 100.3)] == ["b"]
    fleet.update({"a": rec("a", 100.4), "b": rec("b", 100.4)})  # read after it refused: back
    assert [c.key for c in fleet.candidates(["a", "b"], 100.5)] == ["a", "b"]
    assert fleet.refused("unknown", 100.5) is False


def test_a_refused_pod_comes_back_after_stale_after_ms_whatever_the_scraper_s_clock_says():
    fleet = FleetView(S)  # stale_after_ms 1000
    fleet.update({"a": rec("a", 100.0), "b": rec("b", 100.0)}, now=100.0)
    fleet.refused("a", 100.2)
    fleet.update({"a": rec("a", 98.0), "b": rec("b", 98.0)}, now=100.5)  # a scraper 2 s behind
    assert [c.key for c in fleet.candidates(["a", "b"], 98.1)] == ["b"]
    fleet.update({"a": rec("a", 98.5), "b": rec("b", 98.5)}, now=101.3)  # past stale_after_ms since it refused
    assert [c.key for c in fleet.candidates(["a", "b"], 98.6)] == ["a", "b"]


def test_stale_pods_are_backups_until_their_ttl():
    fleet = FleetView(S)
    fleet.update({"a": rec("a", 100.0), "b": rec("b", 99.0)})
    assert [c.key for c in fleet.candidates(["a", "b"], 101.5)] == ["a", "b"]  # none fresh: both as backups
    assert fleet.candidates(["a", "b"], 103.5) == []  # past metrics_ttl_ms: nothing to route by


def test_an_idle_pod_keeps_its_adapters_resident():
    fleet = FleetView(build_settings({"residency_memory": 1}))  # remember exactly max_lora adapters
    fleet.update({"a": rec("a", 100.0, running={"x", "y"}, max_lora=2)})
    fleet.update({"a": rec("a", 100.2)})  # idle now: lora_requests_info lists nothing
    (c,) = fleet.candidates(["a"], 100.3)
    assert c.active_adapters == frozenset() and c.resident_adapters == {"x", "y"}
    fleet.update({"a": rec("a", 100.4, running={"z"}, max_lora=2)})  # a third adapter evicts the oldest
    assert len(fleet.candidates(["a"], 100.5)[0].resident_adapters) == 2


def test_a_pod_s_adapters_in_slots_are_told_apart_from_those_waiting_for_one():
    from dataclasses import replace

    fleet = FleetView(S)
    record = rec("a", 100.0, running={"x", "y"}, max_lora=2)
    fleet.update({"a": replace(record, metrics=replace(record.metrics, waiting_lora_adapters=frozenset({"y", "z"})))})
    (c,) = fleet.candidates(["a"], 100.1)
    assert c.active_adapters == {"x", "y", "z"} and c.running_adapters == {"x", "y"}
    fleet.note_dispatch("a", "w", 100.2, "call-1")  # sent since the scrape: active, not known to hold a slot
    (c,) = fleet.candidates(["a"], 100.3)
    assert "w" in c.active_adapters and c.running_adapters == {"x", "y"}


def test_server_reported_residency_wins():
    fleet = FleetView(S)
    fleet.update({"a": rec("a", 100.0, running={"x"}, loaded={"p", "q"})})
    assert fleet.candidates(["a"], 100.1)[0].resident_adapters == {"p", "q"}


# --- in-flight requests: counted by call id, ended once, shared with peers -------------------------
def test_an_ended_request_leaves_the_queue_before_the_next_scrape():
    fleet = FleetView(S)
    fleet.update({"a": rec("a", 100.0)})
    fleet.note_dispatch("a", "x", 100.1, call_id="c1")
    fleet.note_dispatch("a", None, 100.1, call_id="c1")  # LiteLLM's deployment hook: the same call
    assert fleet.candidates(["a"], 100.2)[0].waiting == 1 and fleet.inflight.counts() == {"a": 1}
    assert fleet.end("c1") is not None and fleet.end("c1") is None  # ended exactly once
    assert fleet.candidates(["a"], 100.2)[0].waiting == 0 and fleet.inflight.counts() == {}


def test_a_retry_moves_the_count_to_the_new_pod():
    fleet = FleetView(S)
    fleet.update({"a": rec("a", 100.0), "b": rec("b", 100.0)})
    fleet.note_dispatch("a", "x", 100.1, call_id="c1")
    fleet.note_dispatch("b", "x", 100.2, call_id="c1")
    assert fleet.inflight.counts() == {"b": 1}
    assert [c.waiting for c in fleet.candidates(["a", "b"], 100.3)] == [0, 1]
    fleet.end("c1")
    assert fleet.inflight.counts() == {} and len(fleet.inflight) == 0


def test_a_request_covered_by_a_scrape_stays_in_flight_until_it_ends():
    fleet = FleetView(S)
    fleet.update({"a": rec("a", 100.0)})
    fleet.note_dispatch("a", "x", 100.1, call_id="c1")
    fleet.update({"a": rec("a", 101.0, waiting=1)})
    assert fleet.candidates(["a"], 101.1)[0].waiting == 1  # the scrape's count, not twice
    assert fleet.inflight.counts() == {"a": 1}
    fleet.note_dispatch("a", None, 101.2, call_id="c1")  # a late hook must not count it again
    assert fleet.candidates(["a"], 101.2)[0].waiting == 1


def test_the_sweeper_releases_requests_no_hook_ended():
    fleet = FleetView(S)
    fleet.update({"a": rec("a", 100.0)})
    fleet.note_dispatch("a", "x", 100.1, call_id="old")
    fleet.note_dispatch("a", "x", 200.0, call_id="new")
    assert fleet.sweep(started_before=150.0) == 1
    assert fleet.inflight.counts() == {"a": 1} and fleet.inflight.swept == 1


def test_peers_dispatches_since_the_scrape_count_as_waiting():
    from lora_affinity_plugin.fleet.inflight import decode_shares, encode_share

    fleet = FleetView(S)
    fleet.update({"a": rec("a", 100.0), "b": rec("b", 100.0)})
    share = encode_share({"a": 3}, {"a": [(99.0, "x"), (100.1, "y"), (100.2, None)]})
    fleet.update_peers(decode_shares([share.encode(), None, b"not json"]))
    a, b = fleet.candidates(["a", "b"], 100.3)
    assert a.waiting == 2 and "y" in a.active_adapters and "x" not in a.active_adapters  # 99.0 was scraped
    assert b.waiting == 0 and fleet.peer_counts == {"a": 3}
    fleet.update({"a": rec("a", 101.0, waiting=2)})  # a newer scrape covers the peers' dispatches too
    assert fleet.candidates(["a"], 101.1)[0].waiting == 2


def test_own_dispatches_since_the_peers_were_read_stand_for_theirs_too():
    from lora_affinity_plugin.fleet.inflight import decode_shares, encode_share

    fleet = FleetView(S)
    fleet.update({"a": rec("a", 100.0)})
    fleet.note_dispatch("a", "x", 100.1, call_id="before")
    two_peers = decode_shares([encode_share({}, {}).encode(), encode_share({}, {}).encode()])
    fleet.update_peers(two_peers, now=100.2)
    assert fleet.candidates(["a"], 100.25)[0].waiting == 1  # shared already: the peers' own count as their own
    fleet.note_dispatch("a", "x", 100.3, call_id="after")
    # Sent after the peers were read: the two peers, routing alike, likely sent one each meanwhile.
    assert fleet.candidates(["a"], 100.35)[0].waiting == 2 + 2
    fleet.update_peers(two_peers, now=100.4)
    assert fleet.candidates(["a"], 100.45)[0].waiting == 2


def test_a_kept_candidate_list_reads_like_a_fresh_one_after_every_change():
    """The strategy asks for a tuple of pods and gets a list the fleet keeps between requests, renewing only the
    views a change touched (a scrape renews every kept list): after any sequence of dispatches, ends, retries, sweeps,
    peers' shares, refusals and scrapes (pods failing and coming back) it must equal what a fresh read (a list of pods: nothing kept) gives."""
    import random

    from lora_affinity_plugin.fleet.inflight import PeerShare

    rng = random.Random(7)
    fleet = FleetView(S)
    pods = ("a", "b", "c", "d")
    now = 100.0
    fleet.update({p: rec(p, now, running={f"x{i}"}) for i, p in enumerate(pods)}, now)
    calls = []
    for step in range(600):
        now += 0.01
        op = rng.random()
        if op < 0.45:
            call = f"call-{step}"
            fleet.note_dispatch(rng.choice(pods), rng.choice(["x0", "x9", None]), now, call if rng.random() < 0.8 else None)
            calls.append(call)
        elif op < 0.7 and calls:
            fleet.end(calls.pop(rng.randrange(len(calls))))
        elif op < 0.75 and calls:
            fleet.note_dispatch(rng.choice(pods), "x1", now, rng.choice(calls))  # a retry moves the call
        elif op < 0.8:
            fleet.sweep(now - 0.5)
        elif op < 0.85:
            fleet.update_peers(PeerShare({}, {rng.choice(pods): [(now, "x2")]}, 1), now)
        elif op < 0.9:
            fleet.refused(rng.choice(pods), now)
        else:
            fleet.update({p: rec(p, now - 0.1, waiting=rng.randrange(3)) if rng.random() < 0.8
                          else PodRecord(p, now - 0.1, None, "HTTP 500") for p in pods}, now)  # pods fail and come back
        kept = fleet.candidates(pods, now)
        assert kept == fleet.candidates(list(pods), now), step
        kept.clear()  # the caller's copy: clearing it must not empty the kept one
        assert fleet.candidates(pods, now) == fleet.candidates(list(pods), now)


def test_the_long_prompts_sent_to_a_pod_count_as_computing_there_until_their_prefill_should_be_done():
    """A scrape shows a prompt running, not how much of its prefill is left: the gateway counts its own estimate,
    each prompt behind the ones sent before it."""
    fleet = FleetView(S)
    fleet.update({"a": rec("a", 100.0), "b": rec("b", 100.0)})
    messages = [{"role": "user", "content": "a long question " * 200}]
    assert RequestBuilder().build(fleet, "x", "x", messages, {}, ["a", "b"], S, now=100.0).prefilling == {}
    fleet.note_prefix("a", (1, 2, 3), 100.0, prefill_s=0.8)
    fleet.note_prefix("a", (4, 5, 6), 100.2, prefill_s=0.5)  # queued behind the first: done at 101.3
    fleet.note_prefix("unknown", (7,), 100.2, prefill_s=5.0)  # a pod with no record is not tracked
    prefilling = RequestBuilder().build(fleet, "x", "x", messages, {}, ["a", "b"], S, now=100.3).prefilling
    assert prefilling.keys() == {"a"} and abs(prefilling["a"] - 1.0) < 1e-9
    assert RequestBuilder().build(fleet, "x", "x", messages, {}, ["a", "b"], S, now=101.4).prefilling == {}
    assert RequestBuilder().build(fleet, "x", "x", messages, {}, ["a", "b"], S).prefilling == {}  # no clock given: none


def test_a_conversations_next_turn_is_marked_for_an_adapter_as_for_the_base_model():
    fleet = FleetView(S)
    fleet.update({"a": rec("a", 100.0)})
    first = [{"role": "system", "content": "You are terse. " * 40}, {"role": "user", "content": "hello " * 40}]
    later = first + [{"role": "assistant", "content": "hi " * 40}, {"role": "user", "content": "and then? " * 20}]
    for adapter in (None, "tenant-a"):
        assert not RequestBuilder().build(fleet, adapter, "x", first, {}, ["a"], S).later_turn
        assert RequestBuilder().build(fleet, adapter, "x", later, {}, ["a"], S).later_turn


def test_a_fleet_simulated_faster_than_real_time_ends_its_prompts_sooner_on_the_gateway_s_clock():
    """Prefill is estimated in engine seconds; a fleet at 5x speed computes 5 of them in one second of the proxy's."""
    fast = S.model_copy(update={"engine_time_scale": 5.0})
    fleet = FleetView(fast)
    fleet.update({"a": rec("a", 100.0)})
    messages = [{"role": "user", "content": "a long question " * 200}]
    fleet.note_prefix("a", (1, 2, 3), 100.0, prefill_s=1.0)  # done at 100.2 on the proxy's clock
    prefilling = RequestBuilder().build(fleet, "x", "x", messages, {}, ["a"], fast, now=100.1).prefilling
    assert abs(prefilling["a"] - 0.5) < 1e-9  # still half a second of the engine's
    assert RequestBuilder().build(fleet, "x", "x", messages, {}, ["a"], fast, now=100.25).prefilling == {}
    with pytest.raises(SettingsError, match="engine_time_scale: 0 is not allowed"):  # never divides by zero
        build_settings({"engine_time_scale": 0}, {})


def test_a_record_with_numbers_no_server_reports_costs_that_pod_only(caplog):
    """NaN or out-of-range figures read from Redis leave that pod out; the pods after it are still updated."""
    import json

    good = {"pod": "p", "scraped_at": 100.0, "metrics": {"num_requests_waiting": 1, "kv_cache_usage": 0.5}}
    assert PodRecord.from_json(json.dumps(good)).metrics.kv_cache_usage == 0.5
    for field, value in (("kv_cache_usage", float("nan")), ("kv_cache_usage", 3.0), ("num_requests_waiting", -1),
                         ("kv_cache_usage", float("inf")), ("num_gpu_blocks", -5)):
        bad = {**good, "metrics": {**good["metrics"], field: value}}
        assert PodRecord.from_json(json.dumps(bad)).metrics is None, (field, value)
    fleet = FleetView(S)
    fleet.update({"a": rec("a", 100.0), "b": rec("b", 100.0), "c": rec("c", 100.0)})
    broken = PodRecord("b", 101.0, PodMetrics(kv_cache_usage=float("nan"), num_gpu_blocks=1000, block_size=16))
    with caplog.at_level("WARNING"):
        fleet.update({"a": rec("a", 101.0), "b": broken, "c": rec("c", 101.0, waiting=3)})
        fleet.update({"a": rec("a", 101.1), "b": broken, "c": rec("c", 101.1, waiting=3)})
    assert sorted(c.key for c in fleet.candidates(["a", "b", "c"], 101.2)) == ["a", "c"]
    assert next(c for c in fleet.candidates(["c"], 101.2)).waiting == 3  # the pod after the bad one was updated
    assert sum("pod b: its record cannot be used" in r.message for r in caplog.records) == 1


def test_the_residency_memory_keeps_each_pods_most_recent_adapters_up_to_its_slots():
    from lora_affinity_plugin.fleet.residency import ResidencyMemory

    memory = ResidencyMemory()
    assert memory.remember("a", frozenset({"x", "y"}), slots=3) == {"x", "y"}
    memory.touch("a", "z", slots=3)
    memory.touch("a", "x", slots=3)  # x is the most recent again: y is now the oldest
    memory.touch("a", "w", slots=3)
    assert memory.remember("a", frozenset(), slots=3) == {"z", "x", "w"}
    assert memory.remember("b", frozenset(), slots=3) == frozenset()  # another pod's memory is its own


def test_the_adapter_catalog_knows_listed_reported_and_served_names_and_deals_alike_everywhere():
    from lora_affinity_plugin.fleet import adapters
    from lora_affinity_plugin.fleet.adapters import AdapterCatalog

    catalog, other = AdapterCatalog(), AdapterCatalog()
    for c in (catalog, other):
        c.serve(["sql-lora", "chat-lora", "code-lora"])
    assert catalog.served == 3 and catalog.known("chat-lora") and not catalog.known("made-up")
    pods = ["p2", "p0", "p1"]
    assert [catalog.dealt_pod(a, pods) for a in ("chat-lora", "code-lora", "sql-lora")] == ["p0", "p1", "p2"]
    assert all(catalog.dealt_pod(a, reversed(pods)) == other.dealt_pod(a, pods) for a in ("chat-lora", "sql-lora"))
    assert catalog.dealt_pod("made-up", pods) is None and catalog.dealt_pod("sql-lora", []) is None
    catalog.report(frozenset({"reported"}))
    assert catalog.known("reported") and not catalog.confirm("reported")  # known already
    assert catalog.confirm("served-once") and catalog.known("served-once")
    for i in range(adapters.CONFIRMED_KEPT):
        catalog.confirm(f"n{i}")
    assert not catalog.known("served-once") and catalog.known(f"n{adapters.CONFIRMED_KEPT - 1}")  # bounded
