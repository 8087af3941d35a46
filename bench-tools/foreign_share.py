"""How the exact index's gain grows with the share of the fleet's cache that other clients write, in fast mode.

`kv-pressure-foreign` at one gateway rate, its other client (a batch job over the same tenants' documents,
straight to the replicas in turn) at several rates. Per strategy, medians over seeds of the gateway's own
prefix-cache hit rate (its requests alone, not the other client's) and of TTFT p90. The inferred index learns
only what the gateway sent; the engines' KV events (and the oracle, which reads the simulated caches) also see
what the other client cached.

    .venv/bin/python bench-tools/foreign_share.py GATEWAY_RATE FOREIGN_RATES SEEDS [MINUTES]
    # e.g. foreign_share.py 0.75 0.25,0.5,1,2 5 10
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from lora_affinity_lab.bench import fast
from lora_affinity_lab.bench.scenarios import at_rate, get_scenario

STRATEGIES = ("lora-affinity", "lora-affinity-exact", "exact-state-oracle")
LABELS = {"lora-affinity": "inferred", "lora-affinity-exact": "exact", "exact-state-oracle": "oracle"}


def _one(args: tuple[float, float, float, str, int]) -> tuple[float, float, int]:
    rate, foreign, minutes, strategy, seed = args
    scenario = replace(get_scenario("kv-pressure-foreign"), duration_s=minutes * 60, background_rate=foreign)
    result = fast.run_fast(at_rate(scenario, rate), strategy, seed)
    hit = result.gateway_hit_rate if result.gateway_hit_rate is not None else result.hit_rate  # no other client
    return hit or 0.0, result.ttft_s.get("p90", float("nan")), result.timeouts + result.errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rate", type=float)
    parser.add_argument("foreign_rates")
    parser.add_argument("seeds", type=int)
    parser.add_argument("minutes", type=float, nargs="?", default=10.0)
    args = parser.parse_args()
    foreign_rates = [float(x) for x in args.foreign_rates.split(",")]
    jobs = [(args.rate, f, args.minutes, s, seed) for f in foreign_rates for s in STRATEGIES
            for seed in range(1, args.seeds + 1)]
    with ProcessPoolExecutor(2) as pool:
        results = dict(zip(jobs, pool.map(_one, jobs)))
    print(f"kv-pressure-foreign, gateway at {args.rate:g} req/s, {args.minutes:g} simulated minutes, medians of "
          f"seeds 1-{args.seeds}; hit rate: the gateway's requests alone")
    print(f"{'other client':>13} | " + " | ".join(f"{LABELS[s]:>8} hit  TTFT p90" for s in STRATEGIES)
          + " | exact/inferred hit | exact vs oracle TTFT | failed")
    for f in foreign_rates:
        row, hits, ttfts, failed = [], {}, {}, 0
        for s in STRATEGIES:
            runs = [results[(args.rate, f, args.minutes, s, seed)] for seed in range(1, args.seeds + 1)]
            hits[s] = statistics.median(r[0] for r in runs)
            ttfts[s] = statistics.median(r[1] for r in runs)
            failed += sum(r[2] for r in runs)
            row.append(f"{hits[s]:>12.1%} {ttfts[s]:>8.2f} s")
        ratio = hits["lora-affinity-exact"] / hits["lora-affinity"] if hits["lora-affinity"] else float("nan")
        versus = ttfts["lora-affinity-exact"] / ttfts["exact-state-oracle"] - 1
        print(f"{f:>9g} r/s | " + " | ".join(row) + f" | {ratio:>17.2f}x | {versus:>+19.0%} | {failed:>6}")


if __name__ == "__main__":
    main()
