"""The simulated replica: vLLM's max_loras skip rule, step times, KV preemption, aborts."""

import random

import pytest

from lora_affinity_plugin.sim.engine import EngineConfig, ReplicaEngine, Sequence


def engine(**kw):
    return ReplicaEngine(EngineConfig(**kw), random.Random(0), warm_adapters=[f"a{i}" for i in range(12)])


def seq(name, adapter, target=100, prompt=17):
    return Sequence(name, adapter, prompt, target, 0.0)


def test_skip_rule_keeps_place_and_lets_later_requests_overtake():
    e = engine(max_loras=2)
    for s in [seq("1", "a1"), seq("2", "a2"), seq("3", "a3"), seq("4", "a1")]:
        e.add(s)
    e.plan_step()
    e.finish_step(0.1)
    assert [s.request_id for s in e.running] == ["1", "2", "4"]  # "4" (a1) overtook "3" (a3)
    assert [s.request_id for s in e.waiting] == ["3"]


def test_a_slot_frees_only_when_every_request_of_an_adapter_is_done():
    e = engine(max_loras=1)
    e.add(seq("1", "a1", target=3))
    e.add(seq("2", "a2", target=3))
    e.plan_step()
    e.finish_step(0.1)  # prefill of "1"; "2" skipped
    e.plan_step()
    e.finish_step(0.2)  # decode: "1" still running, "2" still waiting
    assert [s.request_id for s in e.running] == ["1"] and [s.request_id for s in e.waiting] == ["2"]
    e.plan_step()
    e.finish_step(0.3)  # "1" finishes: its adapter's slot frees
    e.plan_step()
    e.finish_step(0.4)
    assert [s.request_id for s in e.running] == ["2"]


def test_step_times_follow_the_model():
    e = ReplicaEngine(EngineConfig(), random.Random(0), gpu_adapters=["a1"])
    e.add(seq("1", "a1"))
    assert e.plan_step() == pytest.approx((50 + 0.18 * 17) * 1.17)  # prefill; a1 already in a GPU slot
    e.finish_step(0.1)
    decode = e.plan_step()
    assert decode == pytest.approx((48 + 0.35 * 1 + 0.002 * 18) * 1.17 + 0.5)


def test_activation_and_disk_load_costs():
    cold = ReplicaEngine(EngineConfig(), random.Random(0))
    cold.add(seq("1", "x"))
    assert cold.plan_step() == pytest.approx((50 + 0.18 * 17) * 1.17 + 15 + 1000)
    warm = engine()
    warm.add(seq("1", "a1"))
    assert warm.plan_step() == pytest.approx((50 + 0.18 * 17) * 1.17 + 15)


def test_kv_exhaustion_preempts_the_newest_running_request():
    e = engine(kv_blocks=4, block_size=16)
    e.add(seq("old", "a1", target=100, prompt=15))
    e.add(seq("new", "a1", target=100, prompt=15))
    t = 0.0
    for _ in range(40):
        if not e.plan_step():
            break
        t += 0.1
        e.finish_step(t)
    assert e.preemptions >= 1
    assert e.running[0].request_id == "old"


def test_abort_frees_blocks_and_counts_like_vllm():
    e = engine()
    s = seq("1", "a1")
    e.add(s)
    e.plan_step()
    e.finish_step(0.1)
    used = e.config.kv_blocks - e.free_blocks
    assert used > 0
    e.abort(s)
    assert e.free_blocks == e.config.kv_blocks and e.finished_by_reason["abort"] == 1 and e.idle


def test_output_lengths_match_the_model():
    e = engine()
    lengths = [e.output_length(750) for _ in range(20000)]
    assert max(lengths) == 750 and min(lengths) >= 1
    # E[min(750, 1 + Exp(580))] = 1 + 580 (1 - exp(-749/580)) = 421.5; completed requests average ~400
    assert 405 < sum(lengths) / len(lengths) < 440
