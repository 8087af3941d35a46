"""Workload variants drawn by seed from wide ranges: a benchmark the rules cannot have been tuned to.

`lora-affinity bench --scenario variants --mode fast --variants N --seeds K`: for each family (documents under KV
pressure, the same with a second client past the gateway, shared system prompts, multi-turn chats, LoRA-heavy
traffic with scarce slots, mixes, uneven fleets) N variants are drawn from `RANGES` by a variant seed; each is
run at the best reference's knee (about the lowest rate, bracketed on a x1.3 ladder and narrowed to within 3%, where
every reference's TTFT p90 is past 1 s, or past twice a nearly idle fleet's where its prompts alone take longer)
and one x1.3 step above, every strategy over the same K seeds. What it reports is the distribution, per family, of
the ratio defaults / best reference (the reference with the lowest TTFT p90 at that rate): median, worst, and
how many variants' seed intervals (a paired bootstrap over the seeds, 95%) lie wholly above 1.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .latency import seed_interval
from .scenarios import Scenario, _adapters, at_rate

TTFT_TARGET_S = 1.0
LADDER = 1.3
"""Each rate step of the knee search and the step above the knee: x1.3."""
BISECTIONS = 3
"""Halvings of the last ladder step that bracket the knee (x1.3 -> about x1.033)."""
REFERENCES = ("simple-shuffle", "least-busy", "llmd-weights", "llmd-prefix", "llmd-precise", "llmd-affinity", "dynamo",
              "sglang-cache-aware", "aibrix-prefix", "lora-affinity-v1", "lora-affinity-tree")
"""What the defaults are measured against (the previous defaults among them)."""
BOUND = "forward-oracle"
"""What no gateway can reach (`oracle.py`): each row reports every strategy's ratio to it as well."""
DEFAULTS = "lora-affinity"

RANGES = {
    "documents": "tenants 8-48, Zipf 0.6-1.4 over them, 4-16 adapters, system prompts 400-2,000 tokens, 2-8 "
                 "documents of 1,000-4,000 tokens each, questions 30-150 tokens, answers 60-250 tokens (mean)",
    "documents-second-client": "the documents ranges, plus another client sending 0.25-1 req/s of questions about the "
                               "same documents straight to the replicas",
    "shared-instructions": "8-40 system prompts of 500-2,000 tokens (a quarter to a half on the base model, the rest "
                           "on 4-12 adapters), questions 30-150 tokens, answers 60-250 tokens",
    "chats": "sessions of 3-8 turns in 3-10 apps (2-8 adapters, 1-3 on the base model), system prompts 200-800 tokens, "
             "turns 40-150 tokens, 2-8 s think time, answers 60-250 tokens",
    "lora-scarce": "16-32 adapters with Zipf 0.8-1.4 popularity, max_loras 2-4, the mixed prompt shapes, no chats",
    "mixes": "8-24 adapters with Zipf 0.8-1.4, the mixed prompt shapes (unique texts of 0.5-8 KB, instructions, short "
             "questions), 10-40% of arrivals starting base-model chats",
    "uneven": "the documents or mixes ranges on a fleet with half the replicas at 0.4-0.7x speed",
}
"""What each family draws from (docs/benchmarks.md quotes these)."""
FAMILIES = tuple(RANGES)


@dataclass(frozen=True)
class Variant:
    family: str
    seed: int
    scenario: Scenario
    start_rate: float
    """Where the knee search starts (req/s): about what the fleet sustains."""

    @property
    def name(self) -> str:
        return f"{self.family}#{self.seed}"


def _output(rng: random.Random) -> dict:
    mean = rng.randint(60, 250)
    return {"mean_output_tokens": float(mean), "max_tokens": max(mean * 3, 100)}


def _documents(rng: random.Random, **extra) -> tuple[Scenario, float]:
    adapters = rng.randint(4, 16)
    documents, document_tokens, system = rng.randint(2, 8), rng.randint(1000, 4000), rng.randint(400, 2000)
    scenario = Scenario("variant", "", kind="kv-pressure", adapters=_adapters(adapters), groups=rng.randint(8, 48),
                        zipf_s=round(rng.uniform(0.6, 1.4), 2), system_tokens=system, documents=documents,
                        document_tokens=document_tokens, question_tokens=rng.randint(30, 150),
                        max_cpu_loras=max(12, adapters), connections=100_000, deadline_s=120.0, duration_s=90.0,
                        **_output(rng), **extra)
    prompt = system + document_tokens
    return scenario, round(max(0.2, 6 * 2500 / prompt * 0.2), 2)


def _mixed(rng: random.Random, adapters: int, chat_share: float, **extra) -> Scenario:
    return Scenario("variant", "", kind="mixed", adapters=_adapters(adapters), zipf_s=round(rng.uniform(0.8, 1.4), 2),
                    base_groups=2, system_tokens=400, question_tokens=60, turns=4, think_s=5.0, chat_share=chat_share,
                    max_cpu_loras=max(12, adapters), connections=100_000, deadline_s=120.0, duration_s=90.0,
                    **_output(rng), **extra)


def named(name: str) -> Variant:
    """The variant docs/benchmarks.md names `family#seed`."""
    family, _, seed = name.partition("#")
    if not seed.isdigit():
        raise SystemExit(f"a workload variant is named FAMILY#SEED, the seed a whole number: got {name!r}")
    return draw(family, int(seed))


def draw(family: str, seed: int) -> Variant:
    """The variant `seed` of `family`: the same seed always draws the same workload."""
    rng = random.Random(f"variant-{family}-{seed}")
    if family == "documents":
        scenario, rate = _documents(rng)
    elif family == "documents-second-client":
        scenario, rate = _documents(rng, background_rate=round(rng.uniform(0.25, 1.0), 2), background_documents=True)
    elif family == "shared-instructions":
        groups = rng.randint(8, 40)
        scenario = Scenario("variant", "", kind="shared-prefix", adapters=_adapters(rng.randint(4, 12)), groups=groups,
                            base_groups=max(1, round(groups * rng.uniform(0.25, 0.5))),
                            system_tokens=rng.randint(500, 2000), question_tokens=rng.randint(30, 150),
                            connections=100_000, deadline_s=120.0, duration_s=90.0, **_output(rng))
        rate = 4.0
    elif family == "chats":
        adapters = rng.randint(2, 8)
        scenario = Scenario("variant", "", kind="multi-turn", adapters=_adapters(adapters),
                            base_groups=rng.randint(1, 3), system_tokens=rng.randint(200, 800),
                            question_tokens=rng.randint(40, 150), turns=rng.randint(3, 8),
                            think_s=round(rng.uniform(2, 8), 1), connections=100_000, deadline_s=120.0,
                            duration_s=90.0, **_output(rng))
        rate = 6.0
    elif family == "lora-scarce":
        scenario = _mixed(rng, rng.randint(16, 32), 0.0, max_loras=rng.randint(2, 4))
        rate = 2.0
    elif family == "mixes":
        scenario = _mixed(rng, rng.randint(8, 24), round(rng.uniform(0.1, 0.4), 2))
        rate = 3.0
    elif family == "uneven":
        slow = f"speed=1;speed={rng.uniform(0.4, 0.7):.2f}"
        if rng.random() < 0.5:
            scenario, rate = _documents(rng, profiles=slow)
        else:
            scenario, rate = _mixed(rng, rng.randint(8, 24), round(rng.uniform(0.1, 0.4), 2), profiles=slow), 1.5
    else:
        raise SystemExit(f"unknown family {family!r}; choose from: {', '.join(FAMILIES)}")
    description = f"workload variant {seed} of the {family} family ({RANGES[family]})"
    return Variant(family, seed, replace(scenario, name=f"{family}#{seed}", description=description), rate)


def _p90s(scenario: Scenario, strategy: str, seeds: range) -> list[float]:
    from .fast import run_fast

    out = []
    for seed in seeds:
        result = run_fast(scenario, strategy, seed=seed)
        out.append(result.ttft_s.get("p90", float("inf")) if result.completed else float("inf"))
    return out


def target_s(variant: Variant, seeds: range) -> float:
    """The TTFT p90 that marks the knee: 1 s, or twice what a nearly idle fleet gives (least-busy at a quarter of
    the start rate) when its prompts alone take longer than half a second to compute."""
    idle = statistics.median(_p90s(at_rate(variant.scenario, variant.start_rate / 4), "least-busy", seeds))
    return max(TTFT_TARGET_S, 2 * idle)


def knee(variant: Variant, references: tuple[str, ...], seeds: range, limit: int = 12) -> tuple[float, float]:
    """(rate, target): about the lowest rate at which every reference's median TTFT p90 is past the target
    (`target_s`): bracketed on the x1.3 ladder from `start_rate` (searched down first when the start is already
    past it), then narrowed by `BISECTIONS` geometric halvings (to within about 3%: under KV pressure one x1.3 step
    can take the best reference from under 1 s to several)."""
    target = target_s(variant, seeds)

    def past(rate: float) -> bool:
        scenario = at_rate(variant.scenario, rate)
        return all(statistics.median(_p90s(scenario, ref, seeds)) > target for ref in references)

    rate = variant.start_rate
    if past(rate):
        for _ in range(limit):
            lower = round(rate / LADDER, 3)
            if not past(lower):
                return _narrowed(lower, rate, past), target
            rate = lower
        return rate, target
    for _ in range(limit):
        below, rate = rate, round(rate * LADDER, 3)
        if past(rate):
            return _narrowed(below, rate, past), target
    return rate, target


def _narrowed(below: float, past_at: float, past) -> float:
    """The lowest rate found past the target between `below` (not past) and `past_at` (past)."""
    for _ in range(BISECTIONS):
        middle = round((below * past_at) ** 0.5, 3)
        if middle in (below, past_at):
            break
        if past(middle):
            past_at = middle
        else:
            below = middle
    return past_at


@dataclass
class Row:
    variant: str
    family: str
    rate: float
    step: str
    target_s: float
    """The knee's TTFT p90 mark (`target_s`)."""
    p90: dict[str, float]
    best_reference: str
    ratio: float
    interval: tuple[float, float] | None
    by_seed: dict[str, list[float]]


def measure(variant: Variant, strategies: list[str], seeds: range, knee_seeds: range) -> list[Row]:
    knee_rate, target = knee(variant, REFERENCES, knee_seeds)
    rows = []
    for step, rate in (("knee", knee_rate), ("above", round(knee_rate * LADDER, 3))):
        scenario = at_rate(variant.scenario, rate)
        by_seed = {name: _p90s(scenario, name, seeds)
                   for name in dict.fromkeys([*REFERENCES, DEFAULTS, *strategies, BOUND])}
        p90 = {name: statistics.median(v) for name, v in by_seed.items()}
        best = min(REFERENCES, key=lambda name: p90[name])
        rows.append(Row(variant.name, variant.family, rate, step, target, p90, best, p90[DEFAULTS] / p90[best],
                        seed_interval(by_seed[DEFAULTS], by_seed[best]), by_seed))
    return rows


def summary(rows: list[Row], strategy: str = DEFAULTS) -> list[str]:
    lines = [f"{strategy} / best reference, TTFT p90, per family (knee and one step above); and / {BOUND}:",
             f"{'family':<26}{'rows':>5}{'median':>8}{'worst':>8}{'interval > 1':>14}{'oracle median':>15}"
             f"{'oracle worst':>14}"]
    for family in [*FAMILIES, "all"]:
        mine = [r for r in rows if family in ("all", r.family)]
        if not mine:
            continue
        ratios = [_ratio(r, strategy) for r in mine]
        above = sum(_above(r.by_seed[strategy], r.by_seed[r.best_reference]) for r in mine)
        bound = [r.p90[strategy] / r.p90[BOUND] for r in mine if BOUND in r.p90]
        lines.append(f"{family:<26}{len(mine):>5}{statistics.median(ratios):>8.2f}{max(ratios):>8.2f}{above:>14}"
                     + (f"{statistics.median(bound):>15.2f}{max(bound):>14.2f}" if bound else ""))
    return lines


def standings(rows: list[Row], extra: list[str] = ()) -> list[str]:
    """Every strategy against the best of the *other* references, row by row, and the defaults against each one.

    A row's best reference is the least of eleven medians, each with its own seed luck, so a router as good as the
    strongest reference still reads above 1 against it on many rows. The same yardstick held to each reference
    shows what it asks of any one router, and where the defaults stand among them."""
    lines = ["each strategy / the best of the other references, TTFT p90, every row; the defaults / it (median), and "
             "the rows where the defaults' seed interval against it lies above 1:",
             f"{'strategy':<22}{'median':>8}{'geomean':>9}{'worst':>8}{'at most 1':>11}{'interval > 1':>14}"
             f"{'defaults / it':>15}{'defaults behind':>17}"]
    for name in dict.fromkeys([DEFAULTS, *extra, *REFERENCES]):
        ratios, above = [], 0
        for row in rows:
            best = min((r for r in REFERENCES if r != name), key=lambda r: row.p90[r])
            ratios.append(_over(row.p90[name], row.p90[best]))
            above += _above(row.by_seed[name], row.by_seed[best])
        versus = "" if name == DEFAULTS else (
            f"{statistics.median(_over(r.p90[DEFAULTS], r.p90[name]) for r in rows):>15.2f}"
            f"{sum(_above(r.by_seed[DEFAULTS], r.by_seed[name]) for r in rows):>17}")
        geomean = math.exp(statistics.fmean(math.log(r) for r in ratios))
        lines.append(f"{name:<22}{statistics.median(ratios):>8.2f}{geomean:>9.2f}{max(ratios):>8.2f}"
                     f"{f'{sum(r <= 1 for r in ratios)}/{len(ratios)}':>11}{above:>14}{versus}")
    return lines


def _above(ours: list[float], reference: list[float]) -> bool:
    """The seeds' 95% interval of median(ours) / median(reference) lies wholly above 1."""
    interval = seed_interval(ours, reference)
    return interval is not None and interval[0] > 1


def _over(a: float, b: float) -> float:
    """a / b, where a run that completed nothing reads infinite (two such runs: level)."""
    return 1.0 if math.isinf(a) and math.isinf(b) else a / b


def _ratio(row: Row, strategy: str) -> float:
    return row.p90[strategy] / row.p90[row.best_reference]


def run_variants(args: argparse.Namespace) -> int:
    count = max(1, getattr(args, "variants", None) or 1)
    families = args.families.split(",") if getattr(args, "families", None) else list(FAMILIES)
    extra = [s for s in (args.strategies or "").split(",") if s and s not in (*REFERENCES, DEFAULTS)]
    seeds = range(args.seed, args.seed + max(1, args.seeds))
    knee_seeds = range(args.seed, args.seed + min(3, max(1, args.seeds)))
    first = getattr(args, "variant_seed", None) or 1
    print(f"variants: {count} per family ({', '.join(families)}), variant seeds {first}-{first + count - 1}; "
          f"{len(seeds)} seeds per strategy; knee: the lowest rate (x{LADDER} ladder, {BISECTIONS} halvings) where "
          f"every reference's TTFT "
          f"p90 is past {TTFT_TARGET_S:g} s (medians of {len(knee_seeds)} seeds); references: {', '.join(REFERENCES)}; "
          f"bound: {BOUND}")
    rows: list[Row] = []
    for family in families:
        for seed in range(first, first + count):
            variant = draw(family, seed)
            for row in measure(variant, extra, seeds, knee_seeds):
                rows.append(row)
                shown = " ".join(f"{name} {value:.2f}" for name, value in row.p90.items())
                iv = f" [{row.interval[0]:.2f}-{row.interval[1]:.2f}]" if row.interval else ""
                print(f"{row.variant:<28}{row.step:<6}{row.rate:>7g} req/s (mark {row.target_s:.2f} s)  {DEFAULTS} / {row.best_reference} "
                      f"{row.ratio:.2f}x{iv}  |  {shown}", flush=True)
    print("\n".join(summary(rows)))
    for name in extra:
        print("\n".join(summary(rows, name)))
    print("\n".join(standings(rows, extra)))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(
            {"ranges": RANGES, "references": REFERENCES, "bound": BOUND, "rows": [asdict(r) for r in rows]}, indent=1))
    return 0
