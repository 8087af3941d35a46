"""The workload-variant generator: each family draws the same workload for the same seed and others for other
seeds, within its stated ranges; a variant is measured at the best reference's knee and a step above, and the
summary reports the ratio's distribution per family."""

import math
import statistics
from dataclasses import replace

import pytest
from procs import run_cli

from lora_affinity_lab.bench import variants
from lora_affinity_lab.bench.scenarios import get_scenario
from lora_affinity_lab.bench.variants import BOUND, DEFAULTS, FAMILIES, RANGES, REFERENCES, draw, measure, summary


def test_every_family_draws_the_same_variant_for_a_seed_and_another_for_another_seed():
    assert set(FAMILIES) == set(RANGES)
    for family in FAMILIES:
        one, again, other = draw(family, 1), draw(family, 1), draw(family, 2)
        assert one == again and one.scenario != other.scenario, family
        assert one.start_rate > 0 and one.scenario.open_loop


def test_draws_stay_in_their_ranges():
    for seed in range(1, 30):
        docs = draw("documents", seed).scenario
        assert 8 <= docs.groups <= 48 and 1000 <= docs.document_tokens <= 4000 and 4 <= len(docs.adapters) <= 16
        assert 0.6 <= docs.zipf_s <= 1.4 and 60 <= docs.mean_output_tokens <= 250
        second = draw("documents-second-client", seed).scenario
        assert second.background_documents and 0.25 <= second.background_rate <= 1.0
        scarce = draw("lora-scarce", seed).scenario
        assert 16 <= len(scarce.adapters) <= 32 and 2 <= scarce.max_loras <= 4 and scarce.chat_share == 0
        uneven = draw("uneven", seed).scenario
        assert uneven.profiles.startswith("speed=1;speed=0.")
        chats = draw("chats", seed).scenario
        assert 3 <= chats.turns <= 8 and chats.kind == "multi-turn"


def test_a_variant_runs_as_a_scenario_by_the_name_the_docs_give_it(tmp_path):
    """`bench --scenario documents#161` runs that draw in any mode (live through real proxies too); a name that is
    not FAMILY#SEED gets an error saying what is allowed."""
    scenario = get_scenario("documents#161")
    assert scenario == draw("documents", 161).scenario and scenario.name == "documents#161"
    assert "documents family" in scenario.description and RANGES["documents"] in scenario.description
    with pytest.raises(SystemExit, match="FAMILY#SEED, the seed a whole number: got 'documents#x'"):
        get_scenario("documents#x")
    with pytest.raises(SystemExit, match="unknown family 'novel'; choose from: documents"):
        get_scenario("novel#3")
    with pytest.raises(SystemExit, match="or a workload variant FAMILY#SEED"):
        get_scenario("nonesuch")
    out = run_cli(["bench", "--scenario", "documents#161", "--mode", "fast", "--rates", "1.2", "--seeds", "1",
                   "--strategies", "llmd-weights,lora-affinity", "--chart", str(tmp_path / "chart.png")])
    assert out.startswith("scenario documents#161: workload variant 161 of the documents family")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["1.2"]]
    assert [r[1] for r in rows] == ["llmd-weights", "lora-affinity"] and all(int(r[2]) > 0 for r in rows)


def test_a_variant_is_measured_at_the_knee_and_a_step_above_against_the_best_reference(monkeypatch):
    variant = draw("documents", 1)
    variant = replace(variant, scenario=replace(variant.scenario, duration_s=20.0))  # short: the knee in 2 steps
    monkeypatch.setattr(variants, "REFERENCES", ("least-busy", "llmd-weights"))
    rows = measure(variant, ["predicted-ttft"], range(1, 2), range(1, 2))
    assert [r.step for r in rows] == ["knee", "above"] and rows[1].rate > rows[0].rate
    for row in rows:
        assert row.best_reference in ("least-busy", "llmd-weights")
        assert row.p90[row.best_reference] == min(row.p90["least-busy"], row.p90["llmd-weights"])
        assert row.ratio == row.p90[DEFAULTS] / row.p90[row.best_reference]
        assert set(row.p90) == {"least-busy", "llmd-weights", DEFAULTS, "predicted-ttft", BOUND}
    lines = summary(rows)
    last = lines[-1].split()
    assert last[0] == "all" and int(last[1]) == 2
    ratios = [row.p90[DEFAULTS] / row.p90[BOUND] for row in rows]
    assert float(last[-1]) == round(max(ratios), 2)  # the worst ratio to the oracle closes the row
    for name in ("lora-affinity-v1", "llmd-affinity", "aibrix-prefix", "dynamo", "llmd-precise"):
        assert name in REFERENCES  # the previous defaults and each peer are references


def test_the_knee_is_bracketed_on_the_ladder_and_narrowed_to_within_a_few_percent(monkeypatch):
    """With every reference's TTFT p90 at rate / 2 s, the knee past 1 s is 2 req/s: the ladder from 1 req/s
    brackets it between 1.69 and 2.197, and the halvings bring it to within 4% above 2."""
    variant = replace(draw("documents", 1), start_rate=1.0)
    monkeypatch.setattr(variants, "_p90s", lambda scenario, strategy, seeds: [scenario.arrival_rate / 2])
    rate, target = variants.knee(variant, ("least-busy", "llmd-weights"), range(1, 2))
    assert target == 1.0 and 2.0 < rate <= 2.0 * 1.04, rate


def test_standings_hold_each_strategy_to_the_best_of_the_other_references(monkeypatch):
    monkeypatch.setattr(variants, "REFERENCES", ("a", "b", "c"))

    def row(**by_seed):
        p90 = {name: statistics.median(v) for name, v in by_seed.items()}
        return variants.Row("v#1", "documents", 1.0, "knee", 1.0, p90, "", 0.0, None, by_seed)

    seeds = lambda x: [x * f for f in (0.9, 1.0, 1.0, 1.1, 1.2)]  # noqa: E731
    rows = [row(a=seeds(2.0), b=seeds(4.0), c=seeds(8.0), **{DEFAULTS: seeds(3.0)}),
            row(a=seeds(6.0), b=seeds(3.0), c=[math.inf] * 5, **{DEFAULTS: seeds(1.5)})]
    lines = variants.standings(rows)
    table = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert list(table) == [DEFAULTS, "a", "b", "c"]
    # The defaults against the best reference of each row (a: 1.5x, then b: 0.5x); `a` against the best of b and c
    # (0.5x, then 2x): the best reference is never the strategy itself.
    assert table[DEFAULTS][:3] == ["1.00", "0.87", "1.50"] and table[DEFAULTS][3] == "1/2"
    assert table["a"][:3] == ["1.25", "1.00", "2.00"] and table["a"][5] == f"{statistics.median([1.5, 0.25]):.2f}"
    assert table["a"][6] == "1" and table["b"][6] == "0"  # the defaults 1.5x `a` on every seed of row 1
    assert table["c"][2] == "inf" and table["c"][4] == "2"  # 4x, then nothing completed: both above 1
    assert table[DEFAULTS][4] == "1" and len(table[DEFAULTS]) == 5  # row 1: 1.5x on every seed; none against itself
