"""Where time to first token goes in fast mode, and what pod data no scrape gives would buy.

Runs the fast bench for seeds 1-N and charges every engine step a request spends before its first token to
one cause:
- ``own prefill``: the prefill step that computes it (an adapter load from disk in that step included);
- ``behind prefill``: another prefill step, that did not take it (behind the requests it took, or over the
  step's token budget);
- ``KV room``: a decode step, while it waited: the replica could not admit it, because its KV cache had no
  room for it or for a request ahead of it in the queue (vLLM's scheduler admits first come, first served);
- ``LoRA slot``: a step while it waited because its adapter would be a (max_loras + 1)-th in the batch.
The rest of TTFT is what no step charges: the part of the step in flight when the request arrived. Prints the mean seconds per request
of each cause, for all requests and for those over 1 s, the replicas' preemptions per run and TTFT p90.

`--oracle` hands the rules what no scrape gives, at the moment of each decision (the strategy must be one of
the plugin's rule sets): ``kv``, each replica's free KV cache now; ``state``, its free KV, KV use and queue
now; ``fit``, only the replicas with no queue and room for the prompt now, when there are any. It bounds
what fresher metrics, or a rule that sends nothing to a full replica, could win.

    .venv/bin/python bench-tools/ttft_causes.py SCENARIO RATE SEEDS [STRATEGY] [--oracle kv|state|fit]
        [--prompt-shape SHAPE]
    # e.g. ttft_causes.py mixed 4.4 10;  ttft_causes.py 'shared-instructions#132' 11.056 5 (a workload variant)
    # RATE 0: the scenario's own client (a closed loop such as scarce-slots'), e.g.
    #   ttft_causes.py scarce-slots 0 10 lora-affinity-tree --prompt-shape unique
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
from concurrent.futures import ProcessPoolExecutor

from lora_affinity_lab.bench import fast, policies
from lora_affinity_lab.bench.fast import FastObserver
from lora_affinity_lab.bench.latency import TTFT_TARGET_S
from lora_affinity_lab.bench.scenarios import at_rate, get_scenario, with_overrides
from lora_affinity_lab.sim.engine import ReplicaEngine

CAUSES = ("own prefill", "behind prefill", "KV room", "LoRA slot")
ORACLES = ("kv", "state", "fit")


class _Causes(FastObserver):
    """Charges each step a request waits through before its first token to one cause."""

    def __init__(self) -> None:
        self.waited: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.engines: list[ReplicaEngine] = []
        self.outcomes: dict[int, object] = {}
        self.adapters_run: dict[int, set[str]] = collections.defaultdict(set)

    def started(self, engines, policies) -> None:
        self.engines = engines

    def planned(self, now, replica, queued, duration_s) -> None:
        engine = self.engines[replica]
        self.adapters_run[replica].update(s.adapter for s in engine.running if s.adapter)
        kind, seqs = engine.planned or (None, [])
        admitted = seqs if kind == "prefill" else []
        taken = set(map(id, admitted))
        batch = {s.adapter for s in engine.running if s.adapter} | {s.adapter for s in admitted if s.adapter}
        full = len(batch) >= engine.config.max_loras
        for seq in queued:
            if id(seq) in taken or seq.first_token_at is not None:
                continue
            if seq.adapter and full and seq.adapter not in batch:
                cause = "LoRA slot"
            else:
                cause = "behind prefill" if kind == "prefill" else "KV room"
            self.waited[seq.request_id][cause] += duration_s
        for seq in admitted:
            if seq.first_token_at is None:
                self.waited[seq.request_id]["own prefill"] += duration_s

    def ended(self, index, outcome) -> None:
        self.outcomes[index] = outcome


class _OracleRules:
    """Hands a rule set's decision the replicas' state now (`_as_oracle_sees`) instead of at their last scrape."""

    def __init__(self, oracle: str, causes: _Causes) -> None:
        self.oracle, self.causes = oracle, causes

    def __call__(self, strategy, replicas, rng, overrides=None) -> policies.Policy:
        policy = policies.make_policy(strategy, replicas, rng, overrides)
        decide = policy.decide

        def deciding(candidates, request):
            engines = {key: self.causes.engines[i] for i, key in enumerate(policy.keys)}
            return decide(_as_oracle_sees(candidates, request, policy.settings, engines, self.oracle), request)

        policy.decide = deciding
        return policy


def _one_seed(args: tuple[str, float, int, str, str | None, str | None]) -> tuple[list[tuple[float, dict]], int, float,
                                                                               int, float]:
    """Per request (TTFT, seconds by cause), the run's preemptions, its TTFT p90, its completed requests, and the
    distinct adapters each replica ran (their mean)."""
    name, rate, seed, strategy, oracle, shape = args
    causes = _Causes()
    factory = _OracleRules(oracle, causes) if oracle else policies.make_policy
    scenario = with_overrides(get_scenario(name), prompt_shape=shape)
    result = fast.run_fast(at_rate(scenario, rate) if rate else scenario, strategy, seed, observer=causes,
                           policy_factory=factory)
    rows = [(o.ttft_s if o.ttft_s is not None else float("inf"), dict(causes.waited.get(str(i), {})))
            for i, o in sorted(causes.outcomes.items())]  # (fast mode names each request's sequence by its index)
    adapters = statistics.fmean(len(causes.adapters_run[i]) for i in range(len(causes.engines)))
    return (rows, sum(e.preemptions for e in causes.engines), result.ttft_s.get("p90", float("nan")),
            result.completed, adapters)


def _as_oracle_sees(candidates, request, settings, engines: dict[str, ReplicaEngine], oracle: str):
    """The candidates with the replicas' state now (`oracle`), instead of at their last scrape (`engines`: by pod)."""
    now = []
    for candidate in candidates:
        engine = engines[candidate.key]
        fresh = {"kv_free_tokens": engine.free_blocks * engine.config.block_size}
        if oracle == "state":
            fresh.update(kv_cache_usage=1 - engine.free_blocks / engine.config.kv_blocks,
                         reported_waiting=len(engine.waiting))
        now.append(dataclasses.replace(candidate, **fresh))
    if oracle == "fit":
        tokens = request.prefix_blocks * settings.prefix_block_chars / settings.prefix_chars_per_token
        fits = [c for c in now if not engines[c.key].waiting and c.kv_free_tokens >= tokens]
        return fits or now
    return now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario")
    parser.add_argument("rate", type=float)
    parser.add_argument("seeds", type=int)
    parser.add_argument("strategy", nargs="?", default="lora-affinity")
    parser.add_argument("--oracle", choices=ORACLES)
    parser.add_argument("--prompt-shape", help="the LoRA scenarios' prompt shape (bench's --prompt-shape)")
    args = parser.parse_args()
    if args.oracle and args.strategy not in policies.RULE_SETS:
        parser.error(f"--oracle needs one of the plugin's rule sets ({', '.join(policies.RULE_SETS)}), "
                     f"not {args.strategy!r}")
    jobs = [(args.scenario, args.rate, seed, args.strategy, args.oracle, args.prompt_shape)
            for seed in range(1, args.seeds + 1)]
    with ProcessPoolExecutor(2) as pool:
        runs = list(pool.map(_one_seed, jobs))
    rows = [row for seed_rows, *_ in runs for row in seed_rows]
    load = f"at {args.rate:g} req/s" if args.rate else "with its own client"
    print(f"{args.scenario} {load}{f', prompts {args.prompt_shape}' if args.prompt_shape else ''}, {args.strategy}, "
          f"seeds 1-{args.seeds}{f', oracle {args.oracle}' if args.oracle else ''}: TTFT p90 "
          f"{statistics.median(r[2] for r in runs):.2f} s, completed {statistics.median(r[3] for r in runs):g}, "
          f"preemptions {statistics.median(r[1] for r in runs):g} per run, distinct adapters each replica ran "
          f"{statistics.median(r[4] for r in runs):.2f} (medians over the seeds)")
    print(f"  {'requests':<10}{'count':>7}{'TTFT':>8}" + "".join(f"{c:>16}" for c in CAUSES) + "   (mean s per request)")
    for label, chosen in (("all", rows), ("over 1 s", [r for r in rows if r[0] > TTFT_TARGET_S])):
        if not chosen:
            continue
        finite = [t for t, _ in chosen if t != float("inf")]
        totals: collections.Counter = collections.Counter()
        for _, causes in chosen:
            totals.update(causes)
        print(f"  {label:<10}{len(chosen):>7}{statistics.fmean(finite) if finite else float('nan'):>8.3f}"
              + "".join(f"{totals[c] / len(chosen):>16.3f}" for c in CAUSES))


if __name__ == "__main__":
    main()
