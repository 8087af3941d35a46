"""The simulated replica: vLLM's max_loras skip rule, step times, KV preemption, aborts."""

import random

import pytest

from lora_affinity_lab.sim.engine import EngineConfig, ReplicaEngine, Sequence


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


# --- prefix caching ----------------------------------------------------------------------------

from lora_affinity_lab.sim.kv_cache import BlockPool, block_hashes, count_tokens  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. " * 70  # ~3,150 bytes: ~1,050 tokens


def long_seq(name, adapter, text=PROMPT, salt=None, target=2, blocks=16):
    return Sequence(name, adapter, count_tokens(text), target, 0.0, block_hashes=block_hashes(text, adapter, salt, blocks))


def run_until_idle(e, now=0.0):
    times = []
    while not e.idle:
        times.append(e.plan_step())
        now += 1
        e.finish_step(now)
    return times


def test_a_cached_prefix_skips_its_prefill_and_is_counted():
    e = engine()
    e.add(long_seq("1", None))
    cold = run_until_idle(e)[0]
    e.add(long_seq("2", None))
    warm = run_until_idle(e)[0]
    tokens = count_tokens(PROMPT)
    assert cold == pytest.approx((50 + 0.18 * tokens) * 1.17, rel=0.01)  # ~270 ms for ~1,000 tokens
    assert warm < 0.3 * cold  # only the tokens after the cached blocks are computed
    assert e.prefix_queries_total == 2 * tokens
    assert e.prefix_hits_total == (tokens // 16) * 16  # whole blocks only


def test_the_same_text_under_another_adapter_or_salt_misses():
    e = engine()
    e.add(long_seq("1", "a1"))
    run_until_idle(e)
    for s in (long_seq("2", "a2"), long_seq("3", "a1", salt="tenant"), long_seq("4", None)):
        e.add(s)
        run_until_idle(e)
    assert e.prefix_hits_total == 0


def test_a_fully_cached_prompt_still_computes_its_last_block():
    text = "z" * (16 * 3 * 10)  # exactly 10 blocks of the simulator's tokens
    e = engine()
    e.add(long_seq("1", "a1", text=text))
    run_until_idle(e)
    e.add(long_seq("2", "a1", text=text))
    run_until_idle(e)
    assert e.prefix_hits_total == 9 * 16


def test_running_requests_share_cached_blocks():
    e = engine(kv_blocks=200)
    e.add(long_seq("1", "a1", target=50))
    e.plan_step()
    e.finish_step(1.0)
    used_by_one = 200 - e.free_blocks
    e.add(long_seq("2", "a1", target=50))
    e.plan_step()
    e.finish_step(2.0)
    assert len(e.running) == 2
    assert 200 - e.free_blocks < 1.2 * used_by_one  # the second one adds a block or two, not a copy


def test_freed_blocks_are_reused_least_recently_freed_first():
    pool = BlockPool(10)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    pool.release(pool.take(a, 0, 4), 4)  # a freed first: evicted first
    pool.release(pool.take(b, 0, 4), 4)
    assert pool.cached_prefix(a) == 4 and pool.cached_prefix(b) == 4
    pool.take([9, 10, 11, 12], 0, 4)  # 2 never-used blocks, then a's tail blocks first
    assert pool.cached_prefix(a) == 2 and pool.cached_prefix(b) == 4


def test_prefix_caching_off():
    e = ReplicaEngine(EngineConfig(prefix_caching=False), random.Random(0))
    for name in ("1", "2"):
        e.add(long_seq(name, None))
        run_until_idle(e)
    assert e.prefix_hits_total == 0 and e.prefix_queries_total == 2 * count_tokens(PROMPT)


def test_a_chats_next_turn_hits_the_blocks_of_the_reply_it_resends():
    from lora_affinity_lab.sim.kv_cache import prompt_text

    e = engine()
    history = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "first question"}]
    text = prompt_text({"messages": history})
    first = Sequence("1", "a1", count_tokens(text), 200, 0.0, block_hashes=block_hashes(text, "a1", None, 16),
                     prompt_text=text)
    e.add(first)
    run_until_idle(e)
    history += [{"role": "assistant", "content": "x " * first.generated}, {"role": "user", "content": "and then?"}]
    text2 = prompt_text({"messages": history})
    hits_before = e.prefix_hits_total
    e.add(Sequence("2", "a1", count_tokens(text2), 2, 0.0, block_hashes=block_hashes(text2, "a1", None, 16)))
    run_until_idle(e)
    reply_tokens = len(("x " * first.generated).encode()) // 3
    assert e.prefix_hits_total - hits_before >= (count_tokens(text) + reply_tokens - 2 * 16) // 16 * 16


def test_a_workloads_texts_are_the_words_rng_choice_draws():
    """Published figures stay reproducible: `text` draws as `rng.choice` would, and leaves the generator alike."""
    from lora_affinity_lab.bench import prefix_workloads

    for seed in range(50):
        for tokens in (1, 40, 3000):
            ours, theirs = random.Random(seed), random.Random(seed)
            words, size = [], 0
            while size < tokens * prefix_workloads.CHARS_PER_TOKEN:
                words.append(theirs.choice(prefix_workloads._WORDS))
                size += len(words[-1]) + 1
            assert prefix_workloads.text(ours, tokens) == " ".join(words)
            assert ours.random() == theirs.random()
