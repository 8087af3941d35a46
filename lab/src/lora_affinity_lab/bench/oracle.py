"""The forward-simulating oracles: references no gateway can be, to bound what routing can gain.

For each request they fork every simulated replica (`ReplicaEngine.fork`: the real queue, batch, adapters and cache,
which no gateway sees) and play each fork forward with the request added. `forward-oracle` sends it where it adds
the least time to first token in all: its own, plus the delay it causes the requests already waiting there.
`least-ttft-oracle` weighs its own first token only (ties: the fewest requests it sent there in flight). They know
each waiting request's answer length; the new request's is the mean. Both are greedy (one request at a time, no
future arrivals): they bound what a better estimate of the present could gain, not what foresight could.
"""

from __future__ import annotations

import random

from ..sim.engine import ReplicaEngine, Sequence
from ..sim.kv_cache import block_hashes, count_tokens, prompt_text
from .policy import Policy

HORIZON_S = 120.0
"""How far ahead a look-ahead plays at most (virtual seconds): past it the request counts as not started."""


class ForwardOracle(Policy):
    name = "forward-oracle"
    weighs_harm = True
    """Counts the delay the request causes the requests waiting where it goes."""

    def __init__(self, replicas: int, rng: random.Random) -> None:
        super().__init__(replicas, rng)
        self.engines: list[ReplicaEngine] = []
        self.step_ends: list[float] = [0.0] * replicas
        self.in_flight = [0] * replicas

    def attach(self, engines: list, step_ends: list[float] | None = None) -> None:
        self.engines = engines
        if step_ends is not None:
            self.step_ends = step_ends

    def route(self, adapter: str | None, connection: int, now: float, call_id: str = "",
              messages: list | None = None, group: int = 0, sheddable: bool = False, tenant: str | None = None) -> int:
        text = prompt_text({"messages": messages or []})
        costs = [self.added_s(i, adapter, text, now) for i in range(len(self.engines))]
        least = min(costs)
        choice = min((i for i, c in enumerate(costs) if c <= least + 1e-9),
                     key=lambda i: (self.in_flight[i], self.rng.random()))
        self.in_flight[choice] += 1
        return choice

    def completed(self, replica: int, now: float, latency_s: float, tokens: int) -> None:
        self.in_flight[replica] -= 1

    def added_s(self, replica: int, adapter: str | None, text: str, now: float) -> float:
        """Seconds of first-token time the request adds on `replica`: its own TTFT, plus the waiting requests' delay
        when the oracle weighs harm."""
        engine = self.engines[replica]
        ahead = [s.request_id for s in engine.waiting] if self.weighs_harm else []
        without = _first_tokens(engine, None, self.step_ends[replica], now, ahead) if ahead else {}
        seq = Sequence("oracle", adapter, count_tokens(text), max(1, round(engine.config.mean_output_tokens)), now,
                       block_hashes=block_hashes(text, adapter, None, engine.config.block_size))
        with_it = _first_tokens(engine, seq, self.step_ends[replica], now, [*ahead, "oracle"])
        return (with_it["oracle"] - now) + sum(with_it[r] - without[r] for r in ahead)


def _first_tokens(engine: ReplicaEngine, seq: Sequence | None, step_end: float, now: float,
                  watched: list[str]) -> dict[str, float]:
    """When each watched request gets its first token on a fork of `engine` (with `seq` added at `now`)."""
    fork = engine.fork()
    t = now
    if fork.planned is not None:  # the step in progress ends first: a request arriving now waits for the next one
        t = max(now, step_end)
        fork.finish_step(t)
    if seq is not None:
        fork.add(seq, now)
    by_id = {s.request_id: s for s in (*fork.waiting, *fork.running)}
    pending = [by_id[r] for r in watched if r in by_id and by_id[r].first_token_at is None]
    while pending and t - now < HORIZON_S:
        duration_ms = fork.plan_step()
        if duration_ms <= 0:
            break
        t += duration_ms / 1000
        fork.finish_step(t)
        pending = [s for s in pending if s.first_token_at is None and not s.aborted]
    out = {r: (s.first_token_at if s.first_token_at is not None else now + HORIZON_S)
           for r, s in by_id.items() if r in watched}
    return {r: out.get(r, now) for r in watched}


class LeastTtftOracle(ForwardOracle):
    name = "least-ttft-oracle"
    weighs_harm = False
