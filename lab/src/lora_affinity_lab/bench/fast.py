"""Fast mode: the replica model as a discrete-event simulation in virtual time.

The client, the connections, the replicas, the scraper's cadence and each gateway's view all
advance on one event heap, so a 300 s scenario takes about a second. Routing runs through the
policies in `policies.py`, which for our rule sets is the plugin's real code.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

from lora_affinity_plugin.kv.exact_index import ExactIndex
from lora_affinity_plugin.fleet.inflight import merge_shares
from lora_affinity_plugin.kv.kv_events import EventBatch
from ..sim.arguments import parse_profiles
from ..sim.engine import EngineConfig, ReplicaEngine, Sequence
from ..sim.kv_cache import block_hashes, count_tokens, prompt_text
from lora_affinity_plugin.routing.podstate import PodMetrics
from .policies import SHED, Policy, make_policy
from .prefix_workloads import BACKGROUND_OUTPUT_TOKENS, PrefixWorkload, background_arrivals
from .prompt_shapes import lora_prompt
from .results import RequestOutcome, Result, summarize_classes
from .scenarios import SEED_PROMPT, Scenario

SCRAPE_INTERVAL_S = 0.2
REFRESH_LAG_S = 0.1
"""A gateway sees a scrape on its next refresh: half an interval later on average."""


SHARE_INTERVAL_S = 0.2
REFRESH_LAG_PEERS_S = 0.1
SHARE_OFFSET_S = 0.05
"""Gateways' refreshes are not aligned with the scraper's cycle."""


@dataclass
class Request:
    index: int
    arrival: float
    adapter: str
    stream: bool


def workload(scenario: Scenario, rng: random.Random) -> list[Request]:
    """Who asks for which adapter when: the same list for every strategy of a run."""
    adapters = list(scenario.adapters)
    if scenario.zipf_s is None:
        weights = None
    else:
        weights = [1 / (rank + 1) ** scenario.zipf_s for rank in range(len(adapters))]
    out, t = [], 0.0
    for i in range(scenario.requests):
        if scenario.arrival_rate:
            t += rng.expovariate(scenario.arrival_rate)
        adapter = rng.choices(adapters, weights)[0] if weights else rng.choice(adapters)
        out.append(Request(i, t, adapter, rng.random() < scenario.stream_share))
    return out


def engine_config(scenario: Scenario, prefix_caching: bool = True) -> EngineConfig:
    return EngineConfig(max_loras=scenario.max_loras, max_cpu_loras=scenario.max_cpu_loras,
                        mean_output_tokens=scenario.mean_output_tokens, prefix_caching=prefix_caching)


def make_engines(scenario: Scenario, seed: int, prefix_caching: bool = True) -> list[ReplicaEngine]:
    """Warm: every adapter in each CPU cache and the GPU slots filled round-robin, as after a warm-up.
    The scenario's replica profiles (speeds, sizes) are dealt to the replicas in turn."""
    base = engine_config(scenario, prefix_caching)
    profiles = parse_profiles(scenario.profiles)
    engines = []
    for r in range(scenario.replicas):
        config = replace(base, **profiles[r % len(profiles)]) if profiles else replace(base)
        adapters = list(scenario.adapters)
        gpu = [adapters[(r * config.max_loras + j) % len(adapters)] for j in range(config.max_loras)]
        engine = ReplicaEngine(config, random.Random(f"{seed}-replica-{r}"),
                               adapters if scenario.warm else [], gpu if scenario.warm else [])
        engines.append(engine)
    return engines


_SEED_MESSAGES = [{"role": "user", "content": SEED_PROMPT}]
"""How LiteLLM hands a text completion's prompt to a routing strategy."""


class FastObserver:
    """What a measuring tool (`bench-tools/`) sees of one fast run, as it goes; every hook does nothing here.

    A hook reads; it must not change the engines or the policies, so a run's figures are the same observed or not.
    """

    def started(self, engines: list[ReplicaEngine], policies: list[Policy]) -> None:
        """Before the first event: the replicas and each gateway's policy, as the run uses them."""

    def routed(self, now: float, request: object, replica: int, policy: Policy) -> None:
        """`policy` (one gateway's) sent `request` to `replica`, or refused it (`SHED`)."""

    def planned(self, now: float, replica: int, queued: list[Sequence], duration_s: float) -> None:
        """`replica` planned its next step (`ReplicaEngine.planned`), lasting `duration_s`, from the queue `queued`
        (in order, before the step admitted any of it)."""

    def scraped(self, at: float, snapshots: list[PodMetrics]) -> None:
        """The gateways have just taken in the scrape made at `at`."""

    def ended(self, index: int, outcome: RequestOutcome) -> None:
        """Request `index` ended: completed, timed out or shed."""


class DispatchLog(FastObserver):
    """(time, replica) for every request a gateway sent to a replica."""

    def __init__(self) -> None:
        self.log: list[tuple[float, int]] = []

    def routed(self, now: float, request: object, replica: int, policy: Policy) -> None:
        if replica != SHED:
            self.log.append((now, replica))


def run_fast(scenario: Scenario, strategy: str, seed: int = 1, gateways: int = 1,
             overrides: dict | None = None, prefix_caching: bool = True, observer: FastObserver | None = None,
             policy_factory: Callable[..., Policy] = make_policy) -> Result:
    """One strategy on one scenario in virtual time. `policy_factory` makes each gateway's policy (with
    `make_policy`'s arguments): a measuring tool may route with its own."""
    watch = observer or FastObserver()
    prefix_load = PrefixWorkload(scenario, seed) if scenario.open_loop else None
    requests: list = prefix_load.initial() if prefix_load else workload(scenario, random.Random(f"{seed}-workload"))
    expected = prefix_load.expected(requests) if prefix_load else len(requests)
    engines = make_engines(scenario, seed, prefix_caching)
    policies = [policy_factory(strategy, scenario.replicas, random.Random(f"{seed}-{strategy}-{g}"), overrides)
                for g in range(gateways)]
    step_ends = [0.0] * scenario.replicas  # when each replica's step in progress ends (the forward oracle reads it)
    for policy in policies:
        policy.discovered(list(scenario.adapters))
        policy.attach(engines, step_ends)
    kv_index = None
    if any(policy.wants_kv_events for policy in policies):  # the scraper follows the engines' KV events
        kv_index = ExactIndex()
        for i, engine in enumerate(engines):
            engine.pool.events = []
            kv_index.track(f"r{i}")
    counter = itertools.count()
    heap: list[tuple[float, int, str, object]] = []

    def push(at: float, kind: str, data: object = None) -> None:
        heapq.heappush(heap, (at, next(counter), kind, data))

    outcomes: dict[int, RequestOutcome] = {}
    seqs: dict[int, tuple[Sequence, int, int, Request]] = {}  # index -> (seq, replica, connection, request)
    by_seq: dict[int, int] = {}
    busy = [False] * scenario.replicas
    free_connections = deque(range(scenario.connections))
    pending: deque[Request] = deque()
    last_event = 0.0

    def kick(replica: int, now: float) -> None:
        if busy[replica]:
            return
        queued = list(engines[replica].waiting) if observer else []
        duration_ms = engines[replica].plan_step()
        watch.planned(now, replica, queued, duration_ms / 1000)
        if duration_ms > 0:
            busy[replica] = True
            step_ends[replica] = now + duration_ms / 1000
            push(step_ends[replica], "step", replica)

    def dispatch(now: float) -> None:
        while free_connections and pending:
            req = pending.popleft()
            if req.index in outcomes:
                continue  # timed out while waiting for a connection
            connection = free_connections.popleft()
            gateway = policies[(req.index if prefix_load else connection) % gateways]
            shaped = not prefix_load and scenario.prompt_shape != "seed"
            if shaped:
                text = lora_prompt(scenario.prompt_shape, scenario.prompt_chars, seed, req.index, req.adapter,
                                   SEED_PROMPT)
                messages = [{"role": "user", "content": text}]
            else:
                messages = req.messages if prefix_load else _SEED_MESSAGES
            sheddable = getattr(req, "sheddable", False)
            tenant = str(req.index % scenario.tenants) if scenario.tenants else None
            replica = gateway.route(req.adapter, connection, now, str(req.index), messages=messages,
                                    group=getattr(req, "group", 0), sheddable=sheddable, tenant=tenant)
            watch.routed(now, req, replica, gateway)
            if replica == SHED:  # HTTP 429 at once
                free_connections.append(connection)
                release(req.index, now, RequestOutcome(None, False, e2e_s=0.0, error="HTTP 429: shed",
                                                       sheddable=True))
                continue
            engine = engines[replica]
            if prefix_load or shaped:
                text = prompt_text({"messages": messages})
                tokens = count_tokens(text)
            else:
                text, tokens = SEED_PROMPT, scenario.prompt_tokens
            seq = Sequence(str(req.index), req.adapter, tokens, engine.output_length(scenario.max_tokens),
                           arrival=req.arrival, block_hashes=block_hashes(text, req.adapter, None, engine.config.block_size),
                           prompt_text=text if prefix_load or shaped else None)
            engine.add(seq, now)
            seqs[req.index] = (seq, replica, connection, req)
            by_seq[id(seq)] = req.index
            kick(replica, now)

    def release(index: int, now: float, outcome: RequestOutcome) -> None:
        outcomes[index] = outcome
        watch.ended(index, outcome)
        entry = seqs.pop(index, None)
        if entry is not None:
            free_connections.append(entry[2])
            policies[(index if prefix_load else entry[2]) % gateways].ended(
                str(index), entry[0].prompt_tokens if outcome.ok else None)
        if prefix_load is not None:
            req = requested[index]
            nxt = prefix_load.follow_up(req, "x " * outcome.output_tokens, now)
            if nxt is not None:
                requested[nxt.index] = nxt
                push(nxt.arrival, "arrive", nxt)
                push(nxt.arrival + scenario.deadline_s, "timeout", nxt.index)

    own_queries = own_hits = 0  # the gateways' requests alone (the fleet's counters include other clients')
    requested: dict[int, object] = {r.index: r for r in requests}
    watch.started(engines, policies)
    # The gateways have been running before the load starts: they already see one scrape.
    push(0.0, "visible", ([e.snapshot() for e in engines], [frozenset(e.gpu) for e in engines], 0.0))
    for req in requests:
        push(req.arrival, "arrive", req)
        push(req.arrival + scenario.deadline_s, "timeout", req.index)
    push(0.0, "scrape")
    if scenario.slowdown is not None:
        push(scenario.slowdown[0], "slowdown", scenario.slowdown[1:])
    if scenario.events_rejoin_s is not None and kv_index is not None:
        push(scenario.events_rejoin_s, "rejoin")
    for at, replica, turn in background_arrivals(scenario, seed):
        push(at, "background", (replica, turn))
    if gateways > 1:  # the gateways have been sharing before the load starts: they know their peers
        for g, policy in enumerate(policies):
            shares = [share for i, p in enumerate(policies) if i != g and (share := p.share()) is not None]
            if shares:
                policy.peers(merge_shares(shares))
        push(SHARE_OFFSET_S, "share")

    while heap and len(outcomes) < expected:
        now, _, kind, data = heapq.heappop(heap)
        if kind == "arrive":
            pending.append(data)
            dispatch(now)
        elif kind == "step":
            replica = data
            busy[replica] = False
            result = engines[replica].finish_step(now)
            for seq in result.finished:
                index = by_seq.pop(id(seq), None)
                if index is None:
                    continue  # another client's request, past the gateways
                _, _, _, req = seqs[index]
                own_queries += seq.queried_tokens
                own_hits += seq.hit_tokens
                latency = now - req.arrival
                for policy in policies:
                    policy.completed(replica, now, latency, seq.generated)
                itl = (now - seq.first_token_at) / (seq.generated - 1) if seq.generated > 1 else None
                release(index, now, RequestOutcome(replica, True, seq.generated, seq.first_token_at - req.arrival,
                                                   latency, itl_s=itl, sheddable=getattr(req, "sheddable", False)))
                last_event = now
            kick(replica, now)
            dispatch(now)
        elif kind == "timeout":
            index = data
            if index in outcomes:
                continue
            entry = seqs.get(index)
            if entry is not None:
                engines[entry[1]].abort(entry[0])  # the client hangs up: vLLM aborts the request
                by_seq.pop(id(entry[0]), None)
            release(index, now, RequestOutcome(entry[1] if entry else None, False,
                                               sheddable=getattr(requested[index], "sheddable", False)))
            last_event = now
            dispatch(now)
        elif kind == "scrape":
            if kv_index is not None:  # events stream as they happen; the index reaches proxies per interval
                for i, engine in enumerate(engines):
                    if engine.pool.events:
                        kv_index.apply(f"r{i}", EventBatch(now, tuple(engine.pool.events)))
                        engine.pool.events.clear()
                push(now + REFRESH_LAG_S, "kv", kv_index.take_changes())
            snapshots = [e.snapshot() for e in engines]
            gpu = [frozenset(e.gpu) for e in engines]
            push(now + REFRESH_LAG_S, "visible", (snapshots, gpu, now))
            push(now + SCRAPE_INTERVAL_S, "scrape")
        elif kind == "share":  # each gateway's refresh writes its in-flight table and reads its peers'
            tables = [policy.share() for policy in policies]
            prefixes = [policy.take_prefixes() for policy in policies]
            push(now + REFRESH_LAG_PEERS_S, "peers", (tables, prefixes))
            push(now + SHARE_INTERVAL_S, "share")
        elif kind == "peers":
            tables, prefixes = data
            for g, policy in enumerate(policies):
                others = [t for i, t in enumerate(tables) if i != g and t is not None]
                if others:
                    policy.peers(merge_shares(others), now)
                for i, entries in enumerate(prefixes):
                    if i != g and entries:
                        policy.peer_prefixes(entries)
        elif kind == "rejoin":
            # A scraper redeployed with no checkpoint, every pod's replay buffer past reach: it starts from
            # nothing, each pod partial (what the engines already hold is never announced again).
            kv_index = ExactIndex()
            for i, engine in enumerate(engines):
                engine.pool.events.clear()
                kv_index.track(f"r{i}")
                kv_index.set_partial(f"r{i}", True)
            push(now + REFRESH_LAG_S, "kv", kv_index.take_changes())
        elif kind == "slowdown":  # what the live simulator's /control endpoint does
            replica, speed = data
            engines[replica].config.speed = speed
        elif kind == "background":  # another client's request, straight to a replica
            replica, turn = data
            engine = engines[replica]
            adapter, messages, body = prefix_load.background(turn)
            if messages is not None:
                body = prompt_text({"messages": messages})
            engine.add(Sequence(f"background-{turn}", adapter, count_tokens(body), BACKGROUND_OUTPUT_TOKENS, arrival=now,
                                block_hashes=block_hashes(body, adapter, None, engine.config.block_size),
                                prompt_text=body), now)
            kick(replica, now)
        elif kind == "kv":
            for policy in policies:
                policy.kv_changes(data)
        elif kind == "visible":
            snapshots, gpu, scraped_at = data
            for policy in policies:
                policy.scraped(snapshots, gpu, scraped_at)
            watch.scraped(scraped_at, snapshots)

    ordered = [outcomes[i] for i in sorted(outcomes)]
    result = summarize_classes(strategy, scenario.name, "fast", ordered, last_event, scenario.replicas)
    queries = sum(e.prefix_queries_total for e in engines)
    result.hit_rate = round(sum(e.prefix_hits_total for e in engines) / queries, 4) if queries else None
    if scenario.background_rate and own_queries:
        result.gateway_hit_rate = round(own_hits / own_queries, 4)
    result.rate = scenario.arrival_rate
    return result

