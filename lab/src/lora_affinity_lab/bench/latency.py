"""`bench --scenario shared-prefix|multi-turn|mixed|mixed-hetero`: latency under open-loop load, over rates.

Per rate and strategy: completed, errors, TTFT / ITL / end-to-end percentiles, output tokens per
second and the fleet's prefix-cache hit rate from the replicas' own counters. Fast mode reports the
median over --seeds of each figure; live mode runs real proxies (live.py). The summary checks the
KV-reuse goals at the rate where simple-shuffle's TTFT p90 first exceeds 1 s.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from .policies import PREFIX_STRATEGIES, settings_note
from .results import Result, refusal, write_json
from .scenarios import Scenario, at_rate, get_scenario, with_overrides

TTFT_TARGET_S = 1.0
REFERENCES = ("llmd-prefix", "sglang-cache-aware")


def rates_of(args: argparse.Namespace, scenario: Scenario) -> list[float]:
    if args.rates:
        return [float(r) for r in args.rates.split(",") if r.strip()]
    if args.rate is not None:
        return [args.rate]
    return list(scenario.rates)


def run_latency(args: argparse.Namespace) -> int:
    scenario = with_overrides(get_scenario(args.scenario), tenants=getattr(args, "tenants", None))
    if scenario.tenants and args.mode != "fast":
        raise SystemExit("--tenants applies to fast mode")
    if scenario.events_rejoin_s is not None and args.mode != "fast":
        raise SystemExit(f"--scenario {scenario.name} runs in fast mode only (--mode fast): the live harness does not "
                         "redeploy its scraper mid-run")
    if args.minutes_of_load:
        scenario = _with_duration(scenario, args.minutes_of_load * 60)
    strategies = [s.strip() for s in args.strategies.split(",")] if args.strategies else \
        PREFIX_STRATEGIES + (["prefix-partition"] if args.mode == "fast" else [])
    rates = rates_of(args, scenario)
    print(f"scenario {scenario.name}: {scenario.description}; {scenario.replicas} replicas, {scenario.duration_s:.0f} s "
          f"of arrivals per rate (simulated); mode {args.mode}; gateways {args.gateways}; rates {rates} req/s"
          + (f"; {scenario.tenants} callers in turn" if scenario.tenants else "") + settings_note(args))
    results: list[Result] = []
    for rate in rates:
        at = at_rate(scenario, rate)
        results += _run_fast(at, strategies, args) if args.mode == "fast" else _run_live(at, strategies, args)
        if args.gateways > 1 and "lora-affinity" in strategies:
            one = argparse.Namespace(**{**vars(args), "gateways": 1})
            (single,) = _run_fast(at, ["lora-affinity"], one) if args.mode == "fast" else _run_live(at, ["lora-affinity"], one)
            single.strategy = "lora-affinity, 1 gateway"
            results.append(single)
    refused = [reason for r in results if (reason := refusal(r))]
    results = [r for r in results if not refusal(r)]
    print(format_latency_table(results))
    if args.gateways > 1:
        print(gateways_summary(results, args.gateways))
    elif scenario.kind == "mixed":
        print(mixed_goals_summary(results))
    else:
        print(goals_summary(results))
    if args.json_path:
        write_json(results, args.json_path)
        print(f"results written to {args.json_path}")
    chart = write_latency_chart(results, args.chart, f"{scenario.name} ({args.mode} mode)")
    if chart:
        print(f"chart written to {chart}")
    for reason in refused:
        print(f"refused: {reason}", file=sys.stderr)
    return 1 if refused else 0


def _with_duration(scenario: Scenario, seconds: float) -> Scenario:
    from dataclasses import replace

    return replace(scenario, duration_s=seconds)


def _run_fast(scenario: Scenario, strategies: list[str], args: argparse.Namespace) -> list[Result]:
    from .compare import _run_fast as run_seeds

    return run_seeds(scenario, strategies, args, args.gateways, merge=median_latency,
                     desc=f"rate {scenario.arrival_rate:g}")


def _run_live(scenario: Scenario, strategies: list[str], args: argparse.Namespace) -> list[Result]:
    from .live import run_live

    return run_live(scenario, strategies, args, args.gateways)


def median_latency(runs: list[Result]) -> Result:
    """Each figure's median over seeds (per criticality class too, when the runs have them)."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]

    def med(get) -> float:
        return round(statistics.median(get(r) for r in runs), 4)

    def pct(name: str) -> dict[str, float]:
        keys = getattr(first, name).keys()
        return {k: med(lambda r, k=k: getattr(r, name).get(k, 0.0)) for k in keys}

    classes = {name: median_latency([r.classes[name] for r in runs]) for name in first.classes}
    return Result(
        strategy=first.strategy, scenario=first.scenario, mode=first.mode, completed=int(med(lambda r: r.completed)),
        timeouts=int(med(lambda r: r.timeouts)), errors=int(med(lambda r: r.errors)),
        duration_s=med(lambda r: r.duration_s), output_tokens=int(med(lambda r: r.output_tokens)),
        ttft_s=pct("ttft_s"), e2e_s=pct("e2e_s"), itl_s=pct("itl_s"), per_replica=first.per_replica,
        seeds=len(runs), hit_rate=med(lambda r: r.hit_rate or 0.0), rate=first.rate, shed=int(med(lambda r: r.shed)),
        classes=classes, ttft_p90_by_seed=[round(r.ttft_s.get("p90", 0.0), 4) for r in runs],
        invalid="; ".join(sorted({r.invalid for r in runs if r.invalid})))


def format_latency_table(results: list[Result]) -> str:
    head = (f"{'rate':>5} {'strategy':<24}{'done':>6}{'err':>5}{'TTFT p50/p90/p99 s':>22}{'ITL p50/p90 ms':>16}"
            f"{'e2e p50/p90 s':>15}{'out tok/s':>10}{'hit rate':>9}")
    lines = [head, "-" * len(head)]
    for r in results:
        t, i, e = r.ttft_s or {}, r.itl_s or {}, r.e2e_s or {}
        ttft = "/".join(f"{t[k]:.2f}" for k in ("p50", "p90", "p99")) if t else "-"
        itl = "/".join(f"{i[k] * 1000:.0f}" for k in ("p50", "p90")) if i else "-"
        e2e = "/".join(f"{e[k]:.1f}" for k in ("p50", "p90")) if e else "-"
        hit = f"{r.hit_rate:.1%}" if r.hit_rate is not None else "-"
        lines.append(f"{r.rate or 0:>5g} {r.strategy:<24}{r.completed:>6}{r.errors + r.timeouts:>5}{ttft:>22}{itl:>16}"
                     f"{e2e:>15}{r.output_tokens_per_s:>10.0f}{hit:>9}")
    return "\n".join(lines)


def _p90(r: Result) -> float:
    return (r.ttft_s or {}).get("p90", float("inf"))


def goals_summary(results: list[Result]) -> str:
    """The KV-reuse goals, measured: at the rate where simple-shuffle's TTFT p90 first exceeds 1 s."""
    by = {(r.rate, r.strategy): r for r in results}
    rates = sorted({r.rate for r in results if r.rate is not None})
    shuffle_over = [rate for rate in rates if (rate, "simple-shuffle") in by and _p90(by[rate, "simple-shuffle"]) > TTFT_TARGET_S]
    lines = []
    if shuffle_over and (shuffle_over[0], "lora-affinity") in by:
        rate = shuffle_over[0]
        ours = by[rate, "lora-affinity"]
        others = [r for (x, name), r in by.items() if x == rate and name not in ("lora-affinity", "prefix-partition")]
        lines.append(f"at {rate:g} req/s (simple-shuffle's TTFT p90 {_p90(by[rate, 'simple-shuffle']):.2f} s > 1 s):")
        best_other = max(others, key=lambda r: r.hit_rate or 0.0, default=None)
        if best_other is not None:
            lines.append(_check(f"hit rate {ours.hit_rate:.1%} >= every other strategy's (best: {best_other.strategy} "
                                f"{best_other.hit_rate:.1%})", (ours.hit_rate or 0) >= (best_other.hit_rate or 0)))
        partition = by.get((rate, "prefix-partition"))
        if partition is not None and partition.hit_rate:
            lines.append(_check(f"hit rate >= 90% of prefix-partition's ({ours.hit_rate / partition.hit_rate:.1%})",
                                (ours.hit_rate or 0) >= 0.9 * partition.hit_rate))
        noprefix = by.get((rate, "lora-affinity-noprefix"))
        if noprefix is not None:
            lines.append(_check(f"TTFT p90 {_p90(ours):.3f} s <= half of lora-affinity-noprefix's ({_p90(noprefix):.3f} s)",
                                _p90(ours) <= _p90(noprefix) / 2))
        refs = [by[rate, name] for name in REFERENCES if (rate, name) in by]
        if refs:
            best = min(refs, key=_p90)
            lines.append(_check(f"TTFT p90 {_p90(ours):.3f} s <= the best reference's ({best.strategy} "
                                f"{_p90(best):.3f} s)", _p90(ours) <= _p90(best)))
    goodput = {}
    for name in ("simple-shuffle", "lora-affinity"):
        ok = [rate for rate in rates if (rate, name) in by and _p90(by[rate, name]) < TTFT_TARGET_S]
        goodput[name] = max(ok) if ok else 0.0
    if goodput.get("simple-shuffle"):
        ratio = goodput["lora-affinity"] / goodput["simple-shuffle"]
        lines.append(_check(f"highest swept rate with TTFT p90 < 1 s: lora-affinity {goodput['lora-affinity']:g}, "
                            f"simple-shuffle {goodput['simple-shuffle']:g} req/s ({ratio:.2f}x >= 1.5x)", ratio >= 1.5))
    return "\n".join(lines) if lines else "(goals need simple-shuffle and lora-affinity over a sweep that overloads simple-shuffle)"


def _goodput(results: list[Result], name: str) -> float:
    """The highest swept rate with TTFT p90 under 1 s and at least 99% of the requests completed."""
    ok = [r.rate for r in results if r.strategy == name and r.rate is not None and _p90(r) < TTFT_TARGET_S
          and r.completed >= 0.99 * (r.completed + r.timeouts + r.errors)]
    return max(ok) if ok else 0.0


def mixed_goals_summary(results: list[Result]) -> str:
    """mixed: at the rate where the best reference's TTFT p90 first exceeds 1 s, ours at most 0.7x of it;
    goodput at least 1.3x the best reference's. References: every other strategy in the run."""
    refs = sorted({r.strategy for r in results} - {"lora-affinity"})
    by = {(r.rate, r.strategy): r for r in results}
    rates = sorted({r.rate for r in results if r.rate is not None})
    lines = []
    over = [rate for rate in rates if all(_p90(by[rate, n]) > TTFT_TARGET_S for n in refs if (rate, n) in by)]
    if refs and over and (over[0], "lora-affinity") in by:
        rate = over[0]
        best = min((by[rate, n] for n in refs if (rate, n) in by), key=_p90)
        ours = _p90(by[rate, "lora-affinity"])
        interval = seed_interval(by[rate, "lora-affinity"].ttft_p90_by_seed, best.ttft_p90_by_seed)
        spread = f"; seeds' 95% interval {interval[0]:.2f}-{interval[1]:.2f}x" if interval else ""
        lines.append(_check(f"at {rate:g} req/s (the best reference's TTFT p90 first over 1 s): lora-affinity "
                            f"{ours:.3f} s <= 0.7x {best.strategy}'s {_p90(best):.3f} s ({ours / _p90(best):.2f}x{spread})",
                            ours <= 0.7 * _p90(best)))
    goodputs = {name: _goodput(results, name) for name in refs}
    if goodputs:
        best_name = max(goodputs, key=goodputs.get)
        ours = _goodput(results, "lora-affinity")
        top = goodputs[best_name]
        what = f"goodput (highest rate with TTFT p90 < 1 s, >= 99% completed): lora-affinity {ours:g}"
        if not top:  # no reference under 1 s at any swept rate: a ratio to nothing decides nothing
            lines.append(f"  n/a    {what}, no reference under 1 s at any swept rate: sweep lower rates to compare")
        else:
            ratio = ours / top
            lines.append(_check(f"{what}, best reference {best_name} {top:g} req/s ({ratio:.2f}x >= 1.3x)", ratio >= 1.3))
    return "\n".join(lines) if lines else "(goals need lora-affinity and references over a sweep that overloads them)"


def seed_interval(ours: Sequence[float], reference: Sequence[float], resamples: int = 2000
                  ) -> tuple[float, float] | None:
    """The 95% interval of median(ours) / median(reference) that seed luck alone gives: a paired bootstrap over
    the seeds (both strategies ran the same seeds, in order, so a seed is resampled for both at once). A goal's
    ratio inside it on both sides of the line is not decided by the run. None under 5 seeds."""
    if len(ours) != len(reference) or len(ours) < 5 or min(reference) <= 0:
        return None
    pairs = list(zip(ours, reference))
    rng = random.Random(0)  # the same interval for the same figures
    ratios = []
    for _ in range(resamples):
        drawn = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        ratios.append(statistics.median(a for a, _ in drawn) / statistics.median(b for _, b in drawn))
    ratios.sort()
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def gateways_summary(results: list[Result], gateways: int) -> str:
    """The fleet's hit rate with N gateways against 1, with and without sharing the index (goal: lose <= 2%)."""
    lines = [f"{gateways} gateways vs 1 (prefix hit rate; goal: lose <= 2% of 1 gateway's):"]
    for rate in sorted({r.rate for r in results if r.rate is not None}):
        by = {r.strategy: r for r in results if r.rate == rate}
        one = by.get("lora-affinity, 1 gateway")
        if one is None or not one.hit_rate:
            continue
        for name, label in (("lora-affinity", "index shared"), ("lora-affinity-unshared", "not shared")):
            r = by.get(name)
            if r is not None and r.hit_rate is not None:
                loss = 1 - r.hit_rate / one.hit_rate
                lines.append(_check(f"{rate:g} req/s, {label:<13} {r.hit_rate:.1%} vs {one.hit_rate:.1%} "
                                    f"(loss {loss:.1%}); TTFT p90 {_p90(r):.3f} vs {_p90(one):.3f} s", loss <= 0.02))
    return "\n".join(lines)


def _check(text: str, ok: bool) -> str:
    return f"  {'met   ' if ok else 'missed'} {text}"


def write_latency_chart(results: list[Result], path: str, title: str) -> str | None:
    """TTFT p90 against arrival rate, one line per strategy; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(r.strategy for r in results):
        rows = sorted((r for r in results if r.strategy == name), key=lambda r: r.rate or 0)
        style = {"linewidth": 2.5, "color": "tab:green"} if name == "lora-affinity" else {"linewidth": 1}
        axes[0].plot([r.rate for r in rows], [_p90(r) for r in rows], marker="o", label=name, **style)
        axes[1].plot([r.rate for r in rows], [r.hit_rate or 0 for r in rows], marker="o", label=name, **style)
    axes[0].set_yscale("log")
    axes[0].axhline(TTFT_TARGET_S, color="red", linestyle=":", linewidth=1)
    axes[0].set_xlabel("arrival rate (requests/s)")
    axes[0].set_ylabel("TTFT p90 (s, log scale)")
    axes[1].set_xlabel("arrival rate (requests/s)")
    axes[1].set_ylabel("fleet prefix-cache hit rate")
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
