"""Where `mixed-hetero`'s TTFT misses are: each request's kind and the speed of the replica it went to.

Runs the fast bench's `lora-affinity` policy and labels every request: an adapter's unique text by size (1.5k,
4k, 8k), a short question, a base-model chat's first turn (chat0) or later turn (chat1); and whether its replica
is a full- or half-speed one. Prints, per kind and speed, the requests, those over 1 s, and TTFT p50 / p90; then
the 8 KB texts sent to half-speed replicas by whether the plugin counted that replica slow yet (before or after
the first 20 simulated seconds).

    .venv/bin/python bench-tools/hetero_misses.py [RATE] [SEEDS]    # defaults: 2.25 req/s, seeds 1-10
"""

from __future__ import annotations

import collections
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor

from lora_affinity_lab.bench import fast
from lora_affinity_lab.bench.fast import FastObserver
from lora_affinity_lab.bench.latency import TTFT_TARGET_S
from lora_affinity_lab.bench.scenarios import at_rate, get_scenario


def _kind(adapter: str | None, messages: list | None) -> str:
    messages = messages or []
    if adapter is None:
        return "chat1" if any(m.get("role") == "assistant" for m in messages) else "chat0"
    chars = sum(len(m.get("content") or "") for m in messages)
    return "8k" if chars > 7000 else "4k" if chars > 3500 else "1.5k" if chars > 1200 else "short"


class _Labels(FastObserver):
    def __init__(self) -> None:
        self.sent: dict[int, tuple[str, bool, bool, bool]] = {}
        self.ttft: dict[int, float] = {}

    def routed(self, now, request, replica, policy) -> None:
        pod = policy.fleet.scraped_view(policy.keys[replica])
        slow = bool(pod and pod.slowness > 1)
        self.sent[request.index] = (_kind(request.adapter, request.messages), replica % 2 == 1, slow, now < 20)

    def ended(self, index, outcome) -> None:
        self.ttft[index] = outcome.ttft_s if outcome.ttft_s is not None else float("inf")


def _one_seed(args: tuple[float, int]) -> list[tuple[str, bool, float, bool, bool]]:
    """(kind, half-speed replica, TTFT, replica counted slow, sent in the first 20 s) per request."""
    rate, seed = args
    labels = _Labels()
    fast.run_fast(at_rate(get_scenario("mixed-hetero"), rate), "lora-affinity", seed, observer=labels)
    return [(kind, half, labels.ttft[i], slow, early) for i, (kind, half, slow, early) in sorted(labels.sent.items())]


def main(rate: float = 2.25, seeds: int = 10) -> None:
    with ProcessPoolExecutor(2) as pool:
        rows = [row for rows in pool.map(_one_seed, [(rate, s) for s in range(1, seeds + 1)]) for row in rows]
    ttfts: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for kind, half, ttft, _, _ in rows:
        ttfts[kind, "half" if half else "full"].append(ttft)
    print(f"mixed-hetero at {rate:g} req/s, seeds 1-{seeds}: kind, replica speed, requests, over 1 s, TTFT p50 / p90")
    for (kind, speed), values in sorted(ttfts.items()):
        values.sort()
        over = sum(1 for v in values if v > TTFT_TARGET_S)
        print(f"  {kind:<6}{speed:<5}{len(values):>7}{over:>7}   {statistics.median(values):.2f} / "
              f"{values[int(0.9 * len(values))]:.2f}")
    texts = collections.Counter(("counted slow" if slow else "at 1.0", "first 20 s" if early else "later")
                                for kind, half, _, slow, early in rows if kind == "8k" and half)
    print("8 KB texts on half-speed replicas, by how the plugin counted the replica when it sent them: "
          + ", ".join(f"{n} {slow} ({when})" for (slow, when), n in sorted(texts.items())))


if __name__ == "__main__":
    main(*(float(a) if i == 0 else int(a) for i, a in enumerate(sys.argv[1:3])))
