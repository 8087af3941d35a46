"""Routing policies for fast mode: LiteLLM's built-ins as they behave, and our rules as they are.

LiteLLM's strategies are modelled from what they count (in-flight requests, latency per token,
tokens per minute). The plugin's rule sets run the real `FleetView` and `choose_pod` code on
snapshots that age like the scraper's.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque

from ..fleet import FleetView
from ..inflight import PeerShare
from ..scheduling import NoCapacity, PodMetrics, RouteRequest, Shed, choose_pod
from ..settings import Settings, build_settings
from ..store import PodRecord


class Policy:
    """Per-gateway routing state; one instance per gateway replica."""

    name = "policy"
    per_connection = False

    def __init__(self, replicas: int, rng: random.Random) -> None:
        self.replicas = replicas
        self.rng = rng

    def route(self, adapter: str, connection: int, now: float, call_id: str = "") -> int:
        raise NotImplementedError

    def completed(self, replica: int, now: float, latency_s: float, tokens: int) -> None:
        pass

    def ended(self, call_id: str) -> None:
        """A request this gateway routed has ended (finished or timed out)."""

    def share(self) -> PeerShare | None:
        """What this gateway shares with its peers through Redis, if anything."""
        return None

    def peers(self, share: PeerShare) -> None:
        pass

    def scraped(self, snapshots: list[PodMetrics], gpu: list[frozenset[str]], at: float) -> None:
        pass


class PerConnectionRandom(Policy):
    """What a Kubernetes Service does: each client connection sticks to one random replica."""

    name = "per-connection-random"
    per_connection = True

    def __init__(self, replicas: int, rng: random.Random) -> None:
        super().__init__(replicas, rng)
        self._pinned: dict[int, int] = {}

    def route(self, adapter: str, connection: int, now: float, call_id: str = "") -> int:
        if connection not in self._pinned:
            self._pinned[connection] = self.rng.randrange(self.replicas)
        return self._pinned[connection]


class SimpleShuffle(Policy):
    name = "simple-shuffle"

    def route(self, adapter: str, connection: int, now: float, call_id: str = "") -> int:
        return self.rng.randrange(self.replicas)


class LeastBusy(Policy):
    """LiteLLM's least-busy: fewest requests this gateway has in flight to a deployment."""

    name = "least-busy"

    def __init__(self, replicas: int, rng: random.Random) -> None:
        super().__init__(replicas, rng)
        self.in_flight = [0] * replicas

    def route(self, adapter: str, connection: int, now: float, call_id: str = "") -> int:
        low = min(self.in_flight)
        choice = self.rng.choice([i for i, n in enumerate(self.in_flight) if n == low])
        self.in_flight[choice] += 1
        return choice

    def completed(self, replica: int, now: float, latency_s: float, tokens: int) -> None:
        self.in_flight[replica] -= 1


class LatencyBased(Policy):
    """LiteLLM's latency-based-routing: lowest recent latency per output token; untried first."""

    name = "latency-based-routing"

    def __init__(self, replicas: int, rng: random.Random) -> None:
        super().__init__(replicas, rng)
        self.samples = [deque(maxlen=10) for _ in range(replicas)]

    def route(self, adapter: str, connection: int, now: float, call_id: str = "") -> int:
        scores = [sum(s) / len(s) if s else 0.0 for s in self.samples]
        low = min(scores)
        return self.rng.choice([i for i, v in enumerate(scores) if v == low])

    def completed(self, replica: int, now: float, latency_s: float, tokens: int) -> None:
        self.samples[replica].append(latency_s / max(1, tokens))


class UsageBasedV2(Policy):
    """LiteLLM's usage-based-routing-v2: the deployment with the fewest tokens this minute."""

    name = "usage-based-routing-v2"

    def __init__(self, replicas: int, rng: random.Random) -> None:
        super().__init__(replicas, rng)
        self.tpm: dict[tuple[int, int], int] = defaultdict(int)

    def route(self, adapter: str, connection: int, now: float, call_id: str = "") -> int:
        minute = int(now // 60)
        usage = [self.tpm[(minute, i)] for i in range(self.replicas)]
        low = min(usage)
        choice = self.rng.choice([i for i, v in enumerate(usage) if v == low])
        self.tpm[(minute, choice)] += 1  # RPM-style pre-call increment
        return choice

    def completed(self, replica: int, now: float, latency_s: float, tokens: int) -> None:
        self.tpm[(int(now // 60), replica)] += tokens


class SeedPicker(Policy):
    """The seed's PoC picker: random among replicas holding the adapter in a GPU slot."""

    name = "seed-picker"

    def __init__(self, replicas: int, rng: random.Random) -> None:
        super().__init__(replicas, rng)
        self.gpu: list[frozenset[str]] = [frozenset()] * replicas

    def scraped(self, snapshots, gpu, at) -> None:
        self.gpu = gpu

    def route(self, adapter: str, connection: int, now: float, call_id: str = "") -> int:
        holders = [i for i, slots in enumerate(self.gpu) if adapter in slots]
        return self.rng.choice(holders) if holders else self.rng.randrange(self.replicas)


class StaticPartition(Policy):
    """A reference, not a product: each adapter pinned to one replica (adapters dealt round-robin)."""

    name = "static-partition"

    def __init__(self, replicas: int, rng: random.Random) -> None:
        super().__init__(replicas, rng)
        self.home: dict[str, int] = {}

    def route(self, adapter: str, connection: int, now: float, call_id: str = "") -> int:
        if adapter not in self.home:
            self.home[adapter] = len(self.home) % self.replicas
        return self.home[adapter]


class Rules(Policy):
    """The plugin's real code path: FleetView (dispatch accounting, residency) + choose_pod."""

    def __init__(self, replicas: int, rng: random.Random, settings: Settings, name: str) -> None:
        super().__init__(replicas, rng)
        self.name = name
        self.settings = settings
        self.fleet = FleetView(settings)
        self.keys = [f"r{i}" for i in range(replicas)]
        self.fallbacks = 0

    def scraped(self, snapshots, gpu, at) -> None:
        self.fleet.update({k: PodRecord(k, at, m) for k, m in zip(self.keys, snapshots)})

    def route(self, adapter: str, connection: int, now: float, call_id: str = "") -> int:
        candidates = self.fleet.candidates(self.keys, now)
        if not candidates:
            self.fallbacks += 1
            return self.rng.randrange(self.replicas)
        try:
            decision = choose_pod(candidates, RouteRequest(adapter), self.settings, self.rng)
        except (Shed, NoCapacity):
            self.fallbacks += 1
            return self.rng.randrange(self.replicas)
        self.fleet.note_dispatch(decision.pod, adapter, now, call_id)
        return self.keys.index(decision.pod)

    def ended(self, call_id: str) -> None:
        self.fleet.end(call_id)

    def share(self) -> PeerShare | None:
        if not self.settings.share_inflight:
            return None
        return PeerShare(self.fleet.inflight.counts(), self.fleet.recent_dispatches())

    def peers(self, share: PeerShare) -> None:
        self.fleet.update_peers(share)


GIE_V02 = {"rule_set": "gie-v0.2", "count_dispatches": False, "remember_residency": False}
STRATEGY_NAMES = [
    "per-connection-random", "simple-shuffle", "least-busy", "latency-based-routing", "usage-based-routing-v2",
    "seed-picker", "gie-v0.2", "lora-affinity-unshared", "lora-affinity",
]
UNSHARED = {"share_inflight": False}
"""lora-affinity without in-flight sharing between gateways (what --gateways N compares against)."""


def make_policy(name: str, replicas: int, rng: random.Random, overrides: dict | None = None) -> Policy:
    simple = {c.name: c for c in (PerConnectionRandom, SimpleShuffle, LeastBusy, LatencyBased, UsageBasedV2, SeedPicker,
                                   StaticPartition)}
    if name in simple:
        return simple[name](replicas, rng)
    if name == "gie-v0.2":
        return Rules(replicas, rng, build_settings({**GIE_V02, **(overrides or {})}, environ={}), name)
    if name == "lora-affinity":
        return Rules(replicas, rng, build_settings(overrides or {}, environ={}), name)
    if name == "lora-affinity-unshared":
        return Rules(replicas, rng, build_settings({**UNSHARED, **(overrides or {})}, environ={}), name)
    raise SystemExit(f"unknown strategy {name!r}; choose from: {', '.join(STRATEGY_NAMES)}")
