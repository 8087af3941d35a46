"""Fast mode guards the simulator's calibration and the rules' standing, side by side.

Calibration (docs/simulator.md): a per-connection random balancer lands near the seed's
484 completed / 640 output tok/s, the seed's picker near 846 / 1127, before any tuning of our rules.
"""

import functools
import statistics

import pytest

from lora_affinity_lab.bench.scenarios import SCENARIOS
from lora_affinity_lab.bench.fast import run_fast

SEEDS = (1, 2, 3)


@functools.cache
def _runs(scenario: str, strategy: str) -> tuple:
    """Each (scenario, strategy) run once per seed, for all the tests here: a run is a function of its seed
    (`test_runs_are_repeatable`)."""
    return tuple(run_fast(SCENARIOS[scenario], strategy, seed=s) for s in SEEDS)


def median(scenario: str, strategy: str, metric: str = "completed") -> float:
    return statistics.median(getattr(r, metric) for r in _runs(scenario, strategy))


def test_random_balancer_matches_the_seed_load_balancer():
    assert median("seed", "per-connection-random") == pytest.approx(484, rel=0.15)
    assert median("seed", "per-connection-random", "output_tokens_per_s") == pytest.approx(640, rel=0.15)


def test_seed_picker_matches_the_seed_benchmark():
    assert median("seed", "seed-picker") == pytest.approx(846, rel=0.15)
    assert median("seed", "seed-picker", "output_tokens_per_s") == pytest.approx(1127, rel=0.15)


def test_a_load_aware_lora_blind_balancer_does_no_better_than_random():
    assert median("seed", "least-busy") == pytest.approx(median("seed", "per-connection-random"), rel=0.1)


@pytest.mark.parametrize("scenario", ["seed", "scarce-slots", "zipf", "cold"])
def test_lora_affinity_beats_every_other_rule_set(scenario):
    ours = median(scenario, "lora-affinity")
    others = {s: median(scenario, s) for s in
              ("simple-shuffle", "least-busy", "usage-based-routing-v2", "seed-picker", "gie-v0.2")}
    assert all(ours > v for v in others.values()), (ours, others)


def test_runs_are_repeatable():
    a = run_fast(SCENARIOS["seed"], "lora-affinity", seed=4)
    b = run_fast(SCENARIOS["seed"], "lora-affinity", seed=4)
    assert (a.completed, a.output_tokens, a.per_replica) == (b.completed, b.output_tokens, b.per_replica)


def test_a_sweep_over_seeds_keeps_each_seeds_ttft_p90_beside_the_medians():
    from lora_affinity_lab.bench.latency import median_latency
    from lora_affinity_lab.bench.scenarios import at_rate

    runs = [run_fast(at_rate(SCENARIOS["multi-turn"], 3.0), "lora-affinity", seed=s) for s in SEEDS]
    merged = median_latency(runs)
    assert merged.ttft_p90_by_seed == [round(r.ttft_s["p90"], 4) for r in runs]
    assert merged.ttft_s["p90"] == round(statistics.median(r.ttft_s["p90"] for r in runs), 4)
    assert merged.to_dict()["ttft_p90_by_seed"] == merged.ttft_p90_by_seed
