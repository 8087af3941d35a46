"""Routing policies for fast mode: LiteLLM's built-ins as they behave, and our rules as they are.

LiteLLM's strategies are modelled from what they count (in-flight requests, latency per token,
tokens per minute). The plugin's rule sets run the real `FleetView` and `choose_pod` code on
snapshots that age like the scraper's.
"""

from __future__ import annotations

import argparse
import random
from collections import defaultdict, deque

from lora_affinity_plugin.fleet.view import FleetView
from lora_affinity_plugin.fleet.request_builder import RequestBuilder
from lora_affinity_plugin.fleet.inflight import PeerShare
from lora_affinity_plugin.routing.placement import prefill_estimate_s
from lora_affinity_plugin.kv.prefix_index import SHARE_MAX_BLOCKS
from lora_affinity_plugin.routing.rates import RateTracker, decode_load
from lora_affinity_plugin.routing.scheduling import Candidate, Decision, NoCapacity, RouteRequest, Shed, choose_pod
from lora_affinity_plugin.kv.prefixes import request_salt
from lora_affinity_plugin.kv.token_blocks import chain_keys
from lora_affinity_plugin.config.settings import Settings, SettingsError, build_settings
from lora_affinity_plugin.fleet.store import PodRecord

from ..sim.kv_cache import ByteTokenizer, prompt_text
from .oracle import ForwardOracle, LeastTtftOracle
from .policy import SHED, Policy

BASE_MODEL = "meta-llama/Llama-2-7b-hf"
class PerConnectionRandom(Policy):
    """What a Kubernetes Service does: each client connection sticks to one random replica."""

    name = "per-connection-random"
    per_connection = True

    def __init__(self, replicas: int, rng: random.Random) -> None:
        super().__init__(replicas, rng)
        self._pinned: dict[int, int] = {}

    def route(self, adapter: str | None, connection: int, now: float, call_id: str = "",
              messages: list | None = None, group: int = 0, sheddable: bool = False, tenant: str | None = None) -> int:
        if connection not in self._pinned:
            self._pinned[connection] = self.rng.randrange(self.replicas)
        return self._pinned[connection]


class SimpleShuffle(Policy):
    name = "simple-shuffle"

    def route(self, adapter: str | None, connection: int, now: float, call_id: str = "",
              messages: list | None = None, group: int = 0, sheddable: bool = False, tenant: str | None = None) -> int:
        return self.rng.randrange(self.replicas)


class LeastBusy(Policy):
    """LiteLLM's least-busy: fewest requests this gateway has in flight to a deployment."""

    name = "least-busy"

    def __init__(self, replicas: int, rng: random.Random) -> None:
        super().__init__(replicas, rng)
        self.in_flight = [0] * replicas

    def route(self, adapter: str | None, connection: int, now: float, call_id: str = "",
              messages: list | None = None, group: int = 0, sheddable: bool = False, tenant: str | None = None) -> int:
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

    def route(self, adapter: str | None, connection: int, now: float, call_id: str = "",
              messages: list | None = None, group: int = 0, sheddable: bool = False, tenant: str | None = None) -> int:
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

    def route(self, adapter: str | None, connection: int, now: float, call_id: str = "",
              messages: list | None = None, group: int = 0, sheddable: bool = False, tenant: str | None = None) -> int:
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

    def route(self, adapter: str | None, connection: int, now: float, call_id: str = "",
              messages: list | None = None, group: int = 0, sheddable: bool = False, tenant: str | None = None) -> int:
        holders = [i for i, slots in enumerate(self.gpu) if adapter in slots]
        return self.rng.choice(holders) if holders else self.rng.randrange(self.replicas)


class StaticPartition(Policy):
    """A reference, not a product: each adapter pinned to one replica (adapters dealt round-robin)."""

    name = "static-partition"

    def __init__(self, replicas: int, rng: random.Random) -> None:
        super().__init__(replicas, rng)
        self.home: dict[str, int] = {}

    def route(self, adapter: str | None, connection: int, now: float, call_id: str = "",
              messages: list | None = None, group: int = 0, sheddable: bool = False, tenant: str | None = None) -> int:
        if adapter not in self.home:
            self.home[adapter] = len(self.home) % self.replicas
        return self.home[adapter]


def _caller(tenant: str | None) -> dict | None:
    """What LiteLLM's proxy tells routing about the caller (`prefix_isolation`): its key's hash and its team,
    two keys to a team."""
    if tenant is None:
        return None
    return {"metadata": {"user_api_key_hash": f"key-{tenant}", "user_api_key_team_id": f"team-{int(tenant) // 2}"}}


class Rules(Policy):
    """The plugin's real code path: FleetView (dispatch accounting, residency) + choose_pod."""

    def __init__(self, replicas: int, rng: random.Random, settings: Settings, name: str) -> None:
        super().__init__(replicas, rng)
        self.name = name
        self.settings = settings
        self.fleet = FleetView(settings)
        self.requests = RequestBuilder()
        self.keys = tuple(f"r{i}" for i in range(replicas))  # a tuple: the fleet keeps its candidate list, as for the strategy
        self.fallbacks = 0
        self.rates = RateTracker()
        """Stands in for the scraper's: learns each pod's speeds from its counters' deltas."""
        self.last: tuple[Decision, list[Candidate], RouteRequest] | None = None
        """The last decision, the candidates it chose among and the request (what a measuring tool reads)."""

    def route(self, adapter: str | None, connection: int, now: float, call_id: str = "",
              messages: list | None = None, group: int = 0, sheddable: bool = False, tenant: str | None = None) -> int:
        candidates = self.fleet.candidates(self.keys, now)
        if not candidates:
            self.fallbacks += 1
            return self.rng.randrange(self.replicas)
        request = self.requests.build(self.fleet, adapter, adapter or BASE_MODEL, messages, _caller(tenant), self.keys,
                                      self.settings, sheddable, now=now)
        self.last = None
        try:
            decision = self.decide(candidates, request)
        except Shed:
            return SHED
        except NoCapacity:
            self.fallbacks += 1
            return self.rng.randrange(self.replicas)
        self.last = (decision, candidates, request)
        self.fleet.note_dispatch(decision.pod, adapter, now, call_id, request.prefix_blocks)
        if request.prefix_hashes:
            chosen = next(c for c in candidates if c.key == decision.pod)
            self.fleet.note_prefix(decision.pod, request.prefix_hashes, now,
                                   prefill_estimate_s(chosen, request, self.settings))
        return self.keys.index(decision.pod)

    def decide(self, candidates: list[Candidate], request: RouteRequest) -> Decision:
        """The rules' choice (a measuring tool may hand them other candidates)."""
        return choose_pod(candidates, request, self.settings, self.rng)

    def scraped(self, snapshots, gpu, at) -> None:
        records = {}
        for key, metrics in zip(self.keys, snapshots):
            rates = self.rates.observe(key, metrics.counters, at, *decode_load(metrics))
            records[key] = PodRecord(key, at, metrics, rates=rates if rates.learned else None)
        self.fleet.update(records)
        self.fleet.maintain(at)

    def discovered(self, adapters: list[str]) -> None:
        self.fleet.adapters.serve(adapters)

    def take_prefixes(self) -> list:
        entries = self.fleet.prefixes.take_outbox(SHARE_MAX_BLOCKS)
        return entries if self.settings.share_prefixes else []

    def peer_prefixes(self, entries: list) -> None:
        for pod, at, hashes in entries:
            self.fleet.prefixes.add_shared(pod, hashes, at)

    def ended(self, call_id: str, prompt_tokens: int | None = None) -> None:
        served = self.fleet.end(call_id)
        if served is not None and prompt_tokens:  # what a response's `usage.prompt_tokens` says
            self.fleet.learn_prompt(served, prompt_tokens)

    def share(self) -> PeerShare | None:
        if not self.settings.share_inflight:
            return None
        return PeerShare(self.fleet.inflight.counts(), self.fleet.recent_dispatches())

    def peers(self, share: PeerShare, now: float | None = None) -> None:
        self.fleet.update_peers(share, now)


class SimulatorTokenizer:
    """The simulated engines' tokenization, as a gateway holding their tokenizer would compute it: the chat
    rendered as the simulator renders it, 3 bytes a token."""

    def chains(self, seed: int, messages, block_size: int, max_chars: int | None = None) -> list[list[int]]:
        text = prompt_text({"messages": messages})[:max_chars]
        return [list(chain_keys(seed, [t for b in ByteTokenizer().block_tokens(text, 1) for t in b], block_size))]


class SimulatedTokenizerRequests(RequestBuilder):
    def tokenizer(self, model: str, settings: Settings) -> SimulatorTokenizer:
        return SimulatorTokenizer()


class ExactRules(Rules):
    """The plugin's rules on the exact index its scraper builds from the engines' KV events."""

    wants_kv_events = True

    def __init__(self, replicas: int, rng: random.Random, settings: Settings, name: str) -> None:
        super().__init__(replicas, rng, settings, name)
        self.requests = SimulatedTokenizerRequests()

    def kv_changes(self, changes: dict) -> None:
        if self.fleet.held.number is None:
            self.fleet.held.number = 0
        self.fleet.held.apply(changes)


class OracleRequests(RequestBuilder):
    """Reads every engine's cache at the moment of decision: what no gateway can know (the bound)."""

    engines: list = []

    def exact_matches(self, fleet, model, adapter, messages, request_kwargs, pods, settings) -> dict[str, float]:
        if not messages:
            return {}
        text = prompt_text({"messages": messages})
        salt = request_salt(request_kwargs)
        out = {}
        for i, engine in enumerate(self.engines):
            size = engine.config.block_size
            hashes = engine.tokenizer.block_hashes(text, adapter, salt, size)
            out[f"r{i}"] = engine.pool.cached_prefix(hashes) / len(hashes) if hashes else 0.0
        return out


class OracleRules(Rules):
    def __init__(self, replicas: int, rng: random.Random, settings: Settings, name: str) -> None:
        super().__init__(replicas, rng, settings, name)
        self.requests = OracleRequests()

    def attach(self, engines: list, step_ends: list[float] | None = None) -> None:
        self.requests.engines = engines


class PrefixPartition(Policy):
    """A reference for the hit rate, not a product: each prompt group or session pinned to one pod, round robin."""

    name = "prefix-partition"

    def __init__(self, replicas: int, rng: random.Random) -> None:
        super().__init__(replicas, rng)
        self.home: dict[int, int] = {}

    def route(self, adapter: str | None, connection: int, now: float, call_id: str = "",
              messages: list | None = None, group: int = 0, sheddable: bool = False, tenant: str | None = None) -> int:
        if group not in self.home:
            self.home[group] = len(self.home) % self.replicas
        return self.home[group]


FIXED_TOKENS = {"learn_chars_per_token": False}
"""The peers count a prompt's tokens at a fixed ratio (or by its tokenizer, with KV events)."""
GIE_V02 = {"rule_set": "gie-v0.2", "count_dispatches": False, "remember_residency": False, **FIXED_TOKENS}
STRATEGY_NAMES = [
    "per-connection-random", "simple-shuffle", "least-busy", "latency-based-routing", "usage-based-routing-v2",
    "seed-picker", "gie-v0.2", "lora-affinity-unshared", "lora-affinity",
]
UNSHARED = {"share_inflight": False, "share_prefixes": False}
"""lora-affinity without sharing between gateways (what --gateways N compares against)."""
NO_PREFIX = {"prefix_affinity": False}
NO_SHEDDING = {"shedding": False}
LLMD_PREFIX = {"rule_set": "llmd-prefix", "count_dispatches": False, "remember_residency": False,
               "share_inflight": False, "share_prefixes": False, **FIXED_TOKENS}
"""The llm-d router: scores on scraped metrics; each router replica keeps its own index."""
SGLANG_CACHE_AWARE = {"rule_set": "sglang-cache-aware", "share_inflight": False, "share_prefixes": False,
                      **FIXED_TOKENS}
"""SGLang's router: counts its own requests in flight; a tree per router replica (no mesh)."""
PREFIX_STRATEGIES = ["simple-shuffle", "least-busy", "gie-v0.2", "llmd-prefix", "sglang-cache-aware",
                     "lora-affinity-noprefix", "lora-affinity-v1", "lora-affinity-tree", "lora-affinity"]
EXACT = {"kv_events": True}
"""The default rules on the exact index (the engines' KV events); the oracle reads the engines' caches instead."""
LLMD_WEIGHTS = {**LLMD_PREFIX, "rule_set": "llmd-weights"}
"""llm-d's current built-in weights (prefix 3 / kv 2 / queue 2)."""
RULE_SETS = {"predicted-ttft": {"rule_set": "predicted-ttft"}, "predicted-ttft-exact": {"rule_set": "predicted-ttft", **EXACT},
             "llmd-weights": LLMD_WEIGHTS,
             "llmd-precise": {**LLMD_PREFIX, "rule_set": "llmd-precise", "kv_events": True},
             "dynamo": {**LLMD_PREFIX, "rule_set": "dynamo", "kv_events": True},
             "gie-v0.2": GIE_V02, "lora-affinity": {}, "lora-affinity-unshared": UNSHARED,
             "lora-affinity-exact": EXACT, "exact-state-oracle": EXACT,
             "lora-affinity-noprefix": NO_PREFIX, "llmd-prefix": LLMD_PREFIX, "sglang-cache-aware": SGLANG_CACHE_AWARE,
             "lora-affinity-noshed": NO_SHEDDING, "lora-affinity-v1": {"rule_set": "lora-affinity-v1", **FIXED_TOKENS},
             "lora-affinity-tree": {"rule_set": "lora-affinity-tree"},
             "llmd-affinity": {**LLMD_PREFIX, "rule_set": "llmd-affinity"}, "aibrix-prefix": {"rule_set": "aibrix-prefix", **FIXED_TOKENS}}
"""Strategies that are the plugin's own code with these settings (in fast mode and live)."""


def make_policy(name: str, replicas: int, rng: random.Random, overrides: dict | None = None) -> Policy:
    simple = {c.name: c for c in (PerConnectionRandom, SimpleShuffle, LeastBusy, LatencyBased, UsageBasedV2, SeedPicker,
                                   StaticPartition, PrefixPartition, ForwardOracle,
                                   LeastTtftOracle)}
    if name in simple:
        return simple[name](replicas, rng)
    if name in RULE_SETS:
        kind = {"lora-affinity-exact": ExactRules, "exact-state-oracle": OracleRules, "llmd-precise": ExactRules,
                "dynamo": ExactRules, "predicted-ttft-exact": ExactRules}.get(name, Rules)  # (the peers that read the engines' KV events)
        return kind(replicas, rng, build_settings({**RULE_SETS[name], **(overrides or {})}, environ={}), name)
    raise SystemExit(f"unknown strategy {name!r}; choose from: {', '.join(policy_names())}")


def policy_names() -> list[str]:
    """Every name `make_policy` takes."""
    return [*STRATEGY_NAMES, *sorted(set(RULE_SETS) - set(STRATEGY_NAMES)), "static-partition", "prefix-partition",
            "forward-oracle", "least-ttft-oracle"]


def bench_overrides(args: argparse.Namespace) -> dict:
    """`--set NAME=VALUE` words, validated as plugin settings (a bad one stops the run with its reason)."""
    from lora_affinity_plugin.config.live_settings import parse_assignments

    values = parse_assignments(getattr(args, "settings", None) or [])
    try:
        build_settings(values, environ={})
    except SettingsError as exc:
        raise SystemExit(f"--set: {exc}") from None
    return values


def settings_note(args: argparse.Namespace) -> str:
    """What a run's header says of its `--set` settings: nothing when there are none."""
    overrides = bench_overrides(args)
    return f"; plugin settings {overrides}" if overrides else ""
