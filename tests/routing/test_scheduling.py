"""Every branch of both rule trees, the bands and the affinity probability, over hand-made snapshots."""

import random
from collections import Counter

import pytest

from lora_affinity_plugin.routing.placement import least_band_float, least_band_int
from lora_affinity_plugin.routing.scheduling import Candidate, NoCapacity, RouteRequest, Shed, choose_pod
from lora_affinity_plugin.config.settings import build_settings

GIE = build_settings({"rule_set": "gie-v0.2"})
OURS = build_settings({"rule_set": "lora-affinity-tree"})


def pod(key, waiting=0, running=0, kv=0.0, active=(), resident=(), max_lora=4):
    return Candidate(key, waiting, running, kv, frozenset(active), frozenset(resident), max_lora)


def picks(pods, request, settings, n=400, seed=7):
    rng = random.Random(seed)
    return Counter(choose_pod(pods, request, settings, rng).pod for _ in range(n))


def test_bands():
    assert least_band_int([0, 10, 20]) == 6  # min + (max - min) // N
    assert least_band_int([5, 5]) == 5
    assert least_band_float([0.1, 0.5, 0.9]) == pytest.approx(0.1 + 0.8 / 3)


# name, pods, request, settings, allowed picks, branch
GIE_CASES = [
    (
        "affinity: the pod running the adapter wins",
        [pod("a", active={"x"}), pod("b"), pod("c")],
        RouteRequest("x"), GIE, {"a"}, "low_queue",
    ),
    (
        "available: a free slot when nobody runs the adapter",
        [pod("a", active={"p", "q", "r", "s"}), pod("b", active={"p"}), pod("c", active={"p", "q", "r", "s"})],
        RouteRequest("x"), GIE, {"b"}, "low_queue",
    ),
    (
        "neither affinity nor a free slot: fail open to least queue",
        [pod("a", waiting=9, active={"p", "q", "r", "s"}), pod("b", waiting=1, active={"p", "q", "r", "s"})],
        RouteRequest("x"), GIE, {"b"}, "low_queue",
    ),
    (
        "low-queue filter drops a pod over queueing_threshold_lora even with affinity",
        [pod("a", waiting=200, active={"x"}), pod("b", waiting=3)],
        RouteRequest("x"), GIE, {"b"}, "low_queue",
    ),
    (
        "least-queue band after affinity",
        [pod("a", waiting=0, active={"x"}), pod("b", waiting=40, active={"x"}), pod("c", waiting=60)],
        RouteRequest("x"), GIE, {"a"}, "low_queue",
    ),
    (
        "least-KV band among equal queues: the higher-KV pod is avoided",
        [pod("a", kv=0.9, active={"x"}), pod("b", kv=0.1, active={"x"})],
        RouteRequest("x"), GIE, {"b"}, "low_queue",
    ),
    (
        "all over the LoRA queue threshold: least queue then low-cost LoRA",
        [pod("a", waiting=130, active={"p", "q", "r", "s"}), pod("b", waiting=131, active={"x"}),
         pod("c", waiting=300)],
        RouteRequest("x"), GIE, {"b"}, "high_queue",
    ),
    (
        "high-queue branch: least queue band first",
        [pod("a", waiting=130), pod("b", waiting=400)],
        RouteRequest("x"), GIE, {"a"}, "high_queue",
    ),
    (
        "base-model request skips the LoRA rule",
        [pod("a", waiting=5, active={"x"}), pod("b", waiting=0)],
        RouteRequest(None), GIE, {"b"}, "low_queue",
    ),
    (
        "sheddable: only pods under both critical thresholds",
        [pod("a", waiting=6, active={"x"}), pod("b", waiting=2, kv=0.85), pod("c", waiting=5, kv=0.8)],
        RouteRequest("x", sheddable=True), GIE, {"c"}, "low_queue",
    ),
    (
        "lora-affinity-tree: a holder within the spill margin keeps the adapter",
        [pod("a", running=3, active={"x"}), pod("b"), pod("c")],
        RouteRequest("x"), OURS, {"a"}, "affinity",
    ),
    (
        "lora-affinity-tree: a holder clearly busier than the fleet spills to a fresh pod",
        [pod("a", running=20, active={"x"}), pod("b", running=2, active={"y"}), pod("c", running=2, active={"p", "q", "r", "s"})],
        RouteRequest("x"), OURS, {"b"}, "spill",
    ),
    (
        "lora-affinity-tree: placement prefers a pod that still holds the adapter",
        [pod("a", resident={"x"}), pod("b"), pod("c")],
        RouteRequest("x"), OURS, {"a"}, "place",
    ),
    (
        "lora-affinity-tree: placement packs onto the pod running fewer adapters",
        [pod("a", running=2, active={"p", "q"}), pod("b", running=2, active={"p"}), pod("c", running=2, active={"p", "q", "r"})],
        RouteRequest("x"), OURS, {"b"}, "place",
    ),
    (
        "lora-affinity-tree: no free slot anywhere -> fewest adapters, then least load",
        [pod("a", running=9, active={"p", "q", "r", "s"}), pod("b", running=1, active={"p", "q", "r", "s"}),
         pod("c", running=30, active={"p", "q", "r", "s", "t"})],
        RouteRequest("x"), OURS, {"b"}, "place",
    ),
    (
        "lora-affinity-tree: base model balances by load",
        [pod("a", running=8, active={"x"}), pod("b", running=1)],
        RouteRequest(None), OURS, {"b"}, "base_model",
    ),
]


@pytest.mark.parametrize("name,pods,request_,settings,allowed,branch", GIE_CASES, ids=[c[0] for c in GIE_CASES])
def test_rule_tree(name, pods, request_, settings, allowed, branch):
    rng = random.Random(1)
    for _ in range(50):
        decision = choose_pod(pods, request_, settings, rng)
        assert decision.pod in allowed
        assert decision.branch == branch


@pytest.mark.parametrize("settings", [GIE, OURS])
def test_sheddable_request_is_shed_when_every_pod_is_saturated(settings):
    pods = [pod("a", waiting=6), pod("b", waiting=1, kv=0.95)]
    with pytest.raises(Shed) as err:
        choose_pod(pods, RouteRequest("x", sheddable=True), settings, random.Random(0))
    assert err.value.status_code == 429
    assert "queue_threshold_critical=5" in str(err.value)
    # The same snapshot serves a critical request.
    assert choose_pod(pods, RouteRequest("x"), settings, random.Random(0)).pod in {"a", "b"}


@pytest.mark.parametrize("settings", [GIE, OURS])
def test_no_candidates_is_no_capacity(settings):
    with pytest.raises(NoCapacity) as err:
        choose_pod([], RouteRequest("x"), settings, random.Random(0))
    assert err.value.status_code == 503


def test_affinity_probability_is_honoured():
    settings = build_settings({"rule_set": "gie-v0.2", "lora_affinity_threshold": 0.7})
    pods = [pod("a", active={"x"}), pod("b")]
    counts = picks(pods, RouteRequest("x"), settings, n=5000)
    assert counts["a"] / 5000 == pytest.approx(0.7, abs=0.03)


def test_affinity_threshold_zero_always_takes_a_free_slot():
    settings = build_settings({"rule_set": "gie-v0.2", "lora_affinity_threshold": 0.0})
    counts = picks([pod("a", active={"x"}), pod("b"), pod("c")], RouteRequest("x"), settings)
    assert counts["a"] == 0 and counts["b"] > 100 and counts["c"] > 100


def test_uniform_pick_among_survivors():
    counts = picks([pod("a"), pod("b"), pod("c")], RouteRequest(None), GIE, n=3000)
    assert all(800 < counts[k] < 1200 for k in "abc")


def test_deterministic_given_a_seed():
    pods = [pod(k, waiting=i % 3, active={"x"} if i % 2 else ()) for i, k in enumerate("abcdef")]
    seq = lambda: [choose_pod(pods, RouteRequest("x"), GIE, rng).pod for rng in [random.Random(42)] for _ in range(100)]
    assert seq() == seq()


def test_max_lora_unknown_never_blocks_placement():
    pods = [pod("a", active={"p", "q", "r", "s", "t"}, max_lora=None), pod("b", active={"p", "q", "r", "s"})]
    decision = choose_pod(pods, RouteRequest("x"), GIE, random.Random(0), explain=True)
    assert decision.pod == "a"
    assert ("lora_soft_affinity", ("a",)) in [(rule, out) for rule, out, _ in decision.trace]


def test_explain_records_every_rule():
    decision = choose_pod([pod("a", active={"x"}), pod("b")], RouteRequest("x"), GIE, random.Random(0), explain=True)
    names = [name for name, _, _ in decision.trace]
    assert names == ["low_queue", "lora_soft_affinity", "least_queue", "least_kv"]
    assert decision.trace[1][1] == ("a",)


def test_band_width_zero_keeps_only_the_minimum_and_wider_bands_keep_more():
    pods = [pod("a", waiting=0), pod("b", waiting=3), pod("c", waiting=9)]
    narrow = build_settings({"rule_set": "gie-v0.2", "band_width": 0})
    wide = build_settings({"rule_set": "gie-v0.2", "band_width": 3})
    assert set(picks(pods, RouteRequest(None), narrow)) == {"a"}
    assert set(picks(pods, RouteRequest(None), wide)) == {"a", "b", "c"}


def test_a_disabled_rule_passes_its_input_on():
    pods = [pod("a", kv=0.9), pod("b", kv=0.1)]
    settings = build_settings({"rule_set": "gie-v0.2", "disabled_rules": ["least_kv"]})
    assert set(picks(pods, RouteRequest(None), settings)) == {"a", "b"}
    assert set(picks(pods, RouteRequest(None), GIE)) == {"b"}


def test_a_view_with_dispatches_keeps_every_other_field_of_the_pod():
    """`Candidate.with_dispatches` is built field by field (for speed): a field added later must not be dropped."""
    from dataclasses import fields

    from lora_affinity_plugin.routing.podstate import PodRates

    base = Candidate("a", 2, 3, 0.4, frozenset({"x"}), frozenset({"x", "y"}), max_lora=4, reported_waiting=2,
                     rates=PodRates(prefill_factor=2.0), slowness=2.0, kv_free_tokens=1000, running_adapters=frozenset({"x"}))
    view = base.with_dispatches(3, {"z"})
    assert view.waiting == 5 and view.load == 8 and view.active_adapters == {"x", "z"}
    for f in fields(Candidate):
        if f.name not in ("waiting", "load", "active_adapters"):
            assert getattr(view, f.name) == getattr(base, f.name), f.name
    assert base.with_dispatches(1, set()).active_adapters is base.active_adapters


def test_every_rule_a_part_applies_can_be_disabled_by_name():
    """`disabled_rules` takes every filter's and scorer's rule name, and refuses a name no part has."""
    from lora_affinity_plugin.routing.decision import PARTS
    from lora_affinity_plugin.routing.profiles import rule_names
    from lora_affinity_plugin.config.settings import SettingsError

    rules = {cls.rule for cls in PARTS.values() if cls.kind in ("filter", "scorer")}
    assert {"low_queue", "least_load", "least_cost", "prefix_match", "dealt"} <= rules <= rule_names()
    for rule in rules:
        assert build_settings({"disabled_rules": [rule]}, environ={}).disabled_rules == [rule]
    with pytest.raises(SettingsError, match=r"disabled_rules: 'lowest_queue' is not a rule; rules: .*low_queue"):
        build_settings({"disabled_rules": ["lowest_queue"]}, environ={})
