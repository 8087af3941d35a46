"""The scheduling core's entry point: one decision over a snapshot of pod metrics.

No I/O and no clocks: given the same candidates, request, settings and seeded RNG, a decision is always
the same. The LiteLLM adapter (`strategy.py`), the fast simulator and `explain` all call `choose_pod`, so
what is benchmarked is what serves traffic. The rules themselves are profiles of parts (`profiles.py`); what a part is, and the types they share, are in `decision.py`.
"""

from __future__ import annotations

import random
from typing import Sequence

from .decision import (
    Candidate,
    Decision,
    DecisionRun,
    NoCapacity,
    RouteRequest,
    RuleSettings,
    SchedulingError,
    Shed,
)
from .placement import pod_cost
from .profiles import run_profile

__all__ = ["Candidate", "Decision", "NoCapacity", "RouteRequest", "SchedulingError", "Shed", "choose_pod"]


def choose_pod(
    candidates: Sequence[Candidate],
    request: RouteRequest,
    settings: RuleSettings,
    rng: random.Random,
    *,
    explain: bool = False,
) -> Decision:
    """Pick one pod for a request by the settings' rule set, or raise Shed (429) / NoCapacity (503).
    `explain`: the decision carries each part's output and each candidate's estimated cost."""
    pods = list(candidates)
    if not pods:
        raise NoCapacity("no candidate pods for this model")
    run = DecisionRun(rng, request, settings, explain, label=settings.rule_set)
    if explain:
        best_match = max(request.prefix_matches.values(), default=0)
        run.costs = {p.key: pod_cost(p, request, settings, best_match, parts=True)  # type: ignore[misc]
                     for p in pods}
    if request.sheddable and settings.shedding:
        pods = _sheddable_capacity(pods, settings, run)
    return run_profile(pods, run)


def _sheddable_capacity(pods: list[Candidate], settings: RuleSettings, run: DecisionRun) -> list[Candidate]:
    """A sheddable request goes only to pods under both sheddable thresholds; none: 429."""
    kept = [
        p
        for p in pods
        if p.waiting <= settings.queue_threshold_critical and p.kv_cache_usage <= settings.kv_cache_threshold
    ]
    if not kept:
        raise Shed(
            "dropping request due to limited backend resources: every pod is over "
            f"queue_threshold_critical={settings.queue_threshold_critical} waiting requests "
            f"or kv_cache_threshold={settings.kv_cache_threshold} KV-cache use"
        )
    run.note("sheddable_capacity", kept)
    return kept
