"""The forward-simulating oracles (`bench/oracle.py`): a fork plays a replica ahead without touching it, and the
oracle sends a request where the played-ahead first token comes soonest, weighing the delay to the queue there."""

import random

from lora_affinity_lab.bench import fast
from lora_affinity_lab.bench.oracle import ForwardOracle, LeastTtftOracle
from lora_affinity_lab.bench.scenarios import at_rate, get_scenario
from lora_affinity_lab.sim.engine import EngineConfig, ReplicaEngine, Sequence
from lora_affinity_lab.sim.kv_cache import block_hashes


def engine(**config) -> ReplicaEngine:
    return ReplicaEngine(EngineConfig(**config), random.Random(1), ["a", "b"], ["a"])


def seq(name: str, tokens: int = 600, adapter: str | None = None, text: str | None = None) -> Sequence:
    text = text or name * tokens
    return Sequence(name, adapter, tokens, 50, 0.0, block_hashes=block_hashes(text, adapter, None, 16))


def test_a_fork_plays_ahead_without_changing_the_replica():
    e = engine()
    for i in range(3):
        e.add(seq(f"r{i}"), 0.0)
    e.plan_step()
    before = (len(e.waiting), len(e.running), e.pool.free, dict(e.gpu), e.rng.getstate(), e.planned[0])
    fork = e.fork()
    twins = [*fork.waiting, *fork.planned[1]]
    t = 0.1
    fork.finish_step(t)
    while (d := fork.plan_step()) > 0 and t < 60:
        t += d / 1000
        fork.finish_step(t)
    assert fork.idle and len(twins) == 3 and all(s.finished_at is not None for s in twins)
    assert (len(e.waiting), len(e.running), e.pool.free, dict(e.gpu), e.rng.getstate(), e.planned[0]) == before
    assert all(s.first_token_at is None for s in e.waiting)


def test_the_oracle_sends_a_request_to_the_replica_that_holds_its_prompt_or_where_nothing_waits():
    warm, queued, idle = engine(), engine(), engine()
    text = "document " * 400
    prompt = seq("doc", tokens=len(text) // 3, text=text)
    warm.pool.take(prompt.block_hashes, 0, len(prompt.block_hashes))  # the prompt's blocks, cached and free
    warm.pool.release(list(prompt.block_hashes), len(prompt.block_hashes))
    for i in range(6):
        queued.add(seq(f"q{i}", 2000), 0.0)
    oracle = ForwardOracle(3, random.Random(1))
    oracle.attach([warm, queued, idle], [0.0, 0.0, 0.0])
    messages_text = text
    costs = [oracle.added_s(i, None, messages_text, 0.0) for i in range(3)]
    assert costs[0] < costs[2] < costs[1]  # cached beats computing it; computing it beats waiting behind 6 prompts
    # the least-TTFT oracle ignores the harm: behind the queue it still costs more, but less than with the harm
    least = LeastTtftOracle(3, random.Random(1))
    least.attach([warm, queued, idle], [0.0, 0.0, 0.0])
    assert least.added_s(1, None, messages_text, 0.0) < costs[1]


def test_the_forward_oracle_runs_as_a_bench_strategy_and_leads_the_rules_under_kv_pressure():
    scenario = at_rate(get_scenario("kv-pressure"), 1.25)
    oracle = fast.run_fast(scenario, "forward-oracle", seed=1)
    assert oracle.completed == fast.run_fast(scenario, "least-busy", seed=1).completed > 0
    assert oracle.ttft_s["p90"] < fast.run_fast(scenario, "least-busy", seed=1).ttft_s["p90"]
