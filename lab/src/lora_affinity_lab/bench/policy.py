"""What every fast-mode routing policy answers to (`policies.py` holds them, `oracle.py` the forward oracle)."""

from __future__ import annotations

import random

from lora_affinity_plugin.fleet.inflight import PeerShare
from lora_affinity_plugin.routing.podstate import PodMetrics

SHED = -1
"""`route`'s answer for a sheddable request the rules refuse: HTTP 429."""


class Policy:
    """Per-gateway routing state; one instance per gateway replica."""

    name = "policy"
    per_connection = False

    def __init__(self, replicas: int, rng: random.Random) -> None:
        self.replicas = replicas
        self.rng = rng

    def route(self, adapter: str | None, connection: int, now: float, call_id: str = "",
              messages: list | None = None, group: int = 0, sheddable: bool = False, tenant: str | None = None) -> int:
        raise NotImplementedError

    def completed(self, replica: int, now: float, latency_s: float, tokens: int) -> None:
        pass

    def ended(self, call_id: str, prompt_tokens: int | None = None) -> None:
        """A request this gateway routed has ended (finished or timed out); `prompt_tokens`: its prompt's tokens,
        as the engine's answer reports them (None: it gave no answer)."""

    def share(self) -> PeerShare | None:
        """What this gateway shares with its peers through Redis, if anything."""
        return None

    def peers(self, share: PeerShare, now: float | None = None) -> None:
        pass

    def take_prefixes(self) -> list:
        """Index entries this gateway shares with its peers this refresh."""
        return []

    wants_kv_events = False
    """Routes on the engines' KV events (`kv_changes`): the run records them."""

    def kv_changes(self, changes: dict) -> None:
        """The scraper's changes to the exact index (`exact_share.PodChange` per pod), as a refresh reads them."""

    def attach(self, engines: list, step_ends: list[float] | None = None) -> None:
        """The simulated engines themselves, and when each one's step in progress ends (only a reference that reads
        their state may use them)."""

    def peer_prefixes(self, entries: list) -> None:
        pass

    def scraped(self, snapshots: list[PodMetrics], gpu: list[frozenset[str]], at: float) -> None:
        pass

    def discovered(self, adapters: list[str]) -> None:
        """What the pods' /v1/models list (the plugin learns it through the scraper's discovery)."""
