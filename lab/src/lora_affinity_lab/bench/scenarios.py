"""Benchmark scenarios: the seed's, and the ones where simple rule sets fail."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

SEED_ADAPTERS = [
    "tweet-summary", "sql-lora", "tweet-summary-0", "sql-lora-0", "tweet-summary-1", "sql-lora-1",
    "tweet-summary-2", "sql-lora-2", "tweet-summary-3", "sql-lora-3", "tweet-summary-4", "sql-lora-4",
]
SEED_PROMPT = "Is the Necronomicon in the movie: Army of Darkness?"


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    requests: int = 1000
    adapters: tuple[str, ...] = tuple(SEED_ADAPTERS)
    zipf_s: float | None = None
    """None: uniform adapter popularity; else Zipf with this exponent."""
    arrival_rate: float | None = None
    """None: every request at t=0 (the seed); else Poisson arrivals per second."""
    max_tokens: int = 750
    prompt_tokens: int = 17
    connections: int = 100
    deadline_s: float = 300.0
    replicas: int = 6
    max_loras: int = 4
    max_cpu_loras: int = 12
    warm: bool = True
    """Adapters already in each replica's CPU cache (a server that has served them before)."""
    stream_share: float = 0.0
    extra: dict = field(default_factory=dict)
    # Prefix workloads (bench/prefix_workloads.py): open-loop arrivals of long prompts.
    kind: str = "lora"
    """lora: the seed's short prompts; shared-prefix or multi-turn: prompts that share long prefixes."""
    mean_output_tokens: float = 580.0
    groups: int = 0
    """shared-prefix: system prompts; the last `base_groups` of them go to the base model."""
    base_groups: int = 0
    system_tokens: int = 0
    question_tokens: int = 0
    sessions_per_adapter: int = 0
    turns: int = 0
    think_s: float = 0.0
    duration_s: float = 0.0
    """Open-loop runs: arrivals for this long (simulated seconds) at the scenario's rate."""
    rates: tuple[float, ...] = ()
    """The default sweep of arrival rates (requests per second)."""
    sheddable_share: float = 0.0
    prompt_shape: str = "seed"
    """LoRA scenarios: seed | unique | instruction | mix (bench/prompt_shapes.py)."""
    prompt_chars: int = 1500
    """Characters of a unique text or an instruction."""
    profiles: str = ""
    """Replicas of different speeds and sizes, as `lora-affinity sim --replica-profiles` takes them."""
    slowdown: tuple[float, int, float] | None = None
    """(at simulated second, replica, new speed): a replica that throttles mid-run."""
    events_rejoin_s: float | None = None
    """Simulated second at which the scraper following the KV events is redeployed with no checkpoint and every
    pod's replay buffer past reach: it joins each pod afresh, partial (fast mode)."""
    chat_share: float = 0.0
    documents: int = 0
    """kv-pressure: documents per tenant, each shared by the requests that ask about it."""
    document_tokens: int = 0
    background_rate: float = 0.0
    """Requests per second another client sends straight to the replicas, round robin, past every gateway: unique
    long prompts that fill and evict caches where no gateway sees it (what only the engines' events tell)."""
    background_tokens: int = 0
    background_documents: bool = False
    """The other client asks about the same tenants' documents (another team's batch job over the same corpus):
    it caches prefixes on pods no gateway sent them to."""
    tenants: int = 0
    """Callers (API keys, two to a team) the requests come from in turn; 0: none named (`prefix_isolation`)."""
    """mixed: the share of arrivals that start a multi-turn chat on the base model."""

    @property
    def open_loop(self) -> bool:
        return self.kind != "lora"


def _adapters(n: int) -> tuple[str, ...]:
    return tuple(f"adapter-{i:02d}" for i in range(n))


_KV_PRESSURE = dict(kind="kv-pressure", adapters=_adapters(8), groups=32, zipf_s=1.0, system_tokens=1200, documents=4,
                    document_tokens=2000, question_tokens=60, max_tokens=300, mean_output_tokens=120,
                    connections=100_000, deadline_s=120.0, duration_s=90.0)
"""What the kv-pressure scenarios share: the tenants, their prompts and documents."""

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario("seed", "the seed's benchmark: 1000 requests at t=0, 12 adapters uniform, max_loras 4"),
        Scenario("scarce-slots", "24 adapters, max_loras 2", adapters=_adapters(24), max_loras=2, max_cpu_loras=24),
        Scenario("zipf", "12 adapters with Zipf(1.2) popularity", zipf_s=1.2),
        Scenario("cold", "cold start: no adapter loaded anywhere yet", warm=False),
        Scenario("poisson", "Poisson arrivals at 3 req/s for 300 s, 12 adapters", arrival_rate=3.0, requests=900),
        Scenario("streaming", "the seed scenario with half the requests streamed", stream_share=0.5),
        Scenario("shared-prefix", "24 system prompts of ~1,000 tokens (16 on 8 adapters, 8 on the base model), "
                 "each request its own ~60-token question; Poisson arrivals",
                 kind="shared-prefix", adapters=_adapters(8), groups=24, base_groups=8, system_tokens=1000,
                 question_tokens=60, max_tokens=300, mean_output_tokens=120, connections=100_000,
                 deadline_s=120.0, duration_s=90.0, arrival_rate=8.0, rates=(2.0, 4.0, 6.0, 8.0, 10.0, 12.0)),
        Scenario("multi-turn", "chat sessions of 6 turns in 6 apps (4 adapters, 2 on the base model), each turn "
                 "resending the growing history (a ~400-token system prompt per app, ~80-token user turns), "
                 "5 s think time; Poisson session starts",
                 kind="multi-turn", adapters=_adapters(4), base_groups=2, system_tokens=400, question_tokens=80, turns=6,
                 think_s=5.0, max_tokens=300, mean_output_tokens=120, connections=100_000, deadline_s=120.0,
                 duration_s=90.0, arrival_rate=6.0, rates=(3.0, 6.0, 9.0, 12.0, 15.0)),
        Scenario("mixed", "what a shared LoRA fleet gets: Zipf(1.1) popularity over 16 adapters, each request a "
                 "unique text of 0.5-8 KB, a per-adapter instruction plus a question, or a short question; a fifth "
                 "of arrivals start a 4-turn chat on the base model (2 apps); ~120-token answers; Poisson arrivals",
                 kind="mixed", adapters=_adapters(16), zipf_s=1.1, base_groups=2, system_tokens=400, question_tokens=60,
                 turns=4, think_s=5.0, chat_share=0.2, max_tokens=300, mean_output_tokens=120, connections=100_000,
                 deadline_s=120.0, duration_s=90.0, arrival_rate=4.0, rates=(1.0, 2.0, 3.0, 4.0, 5.0, 6.0)),
        Scenario("mixed-hetero", "the mixed traffic on a fleet with half the replicas at half speed "
                 "(profiles speed=1;speed=0.5)",
                 kind="mixed", adapters=_adapters(16), zipf_s=1.1, base_groups=2, system_tokens=400, question_tokens=60,
                 turns=4, think_s=5.0, chat_share=0.2, max_tokens=300, mean_output_tokens=120, connections=100_000,
                 deadline_s=120.0, duration_s=90.0, arrival_rate=2.0, rates=(0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0),
                 profiles="speed=1;speed=0.5"),
        Scenario("kv-pressure", "32 tenants (Zipf(1.0) popularity, 4 adapters' worth each of 8 adapters), each with a "
                 "~1,200-token system prompt and 4 documents of ~2,000 tokens; a request asks about one of its "
                 "tenant's documents; the distinct prefixes are about 4 times what the fleet's KV caches hold",
                 **_KV_PRESSURE, arrival_rate=2.0,
                 rates=(0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0)),
        Scenario("kv-pressure-shared", "the kv-pressure traffic on a fleet another client also uses: 0.5 req/s of "
                 "unique ~2,500-token prompts sent straight to the replicas in turn, past the gateways",
                 **_KV_PRESSURE, arrival_rate=1.0,
                 rates=(0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0), background_rate=0.5, background_tokens=2500),
        Scenario("kv-pressure-foreign", "the kv-pressure traffic on a fleet another client also uses: 0.5 req/s of "
                 "questions about the same tenants' documents (a batch job over the same corpus) sent straight to "
                 "the replicas in turn, past the gateways",
                 **_KV_PRESSURE, arrival_rate=1.0,
                 rates=(0.5, 0.75, 1.0, 1.25, 1.5), background_rate=0.5, background_documents=True),
        Scenario("kv-pressure-rejoin", "the kv-pressure traffic; after 60 s the scraper following the KV events is "
                 "redeployed with no checkpoint and every replay buffer past reach, so it joins each pod afresh: "
                 "the blocks the engines already hold are never announced again",
                 **_KV_PRESSURE, arrival_rate=1.0, rates=(0.5, 0.75, 1.0, 1.25, 1.5), events_rejoin_s=60.0),
        Scenario("kv-pressure-hetero", "the kv-pressure traffic on a fleet with half the replicas at half speed "
                 "(profiles speed=1;speed=0.5)",
                 **_KV_PRESSURE, arrival_rate=1.0,
                 rates=(0.5, 0.75, 1.0, 1.25, 1.5), profiles="speed=1;speed=0.5"),
        Scenario("overload", "unique ~1,200-token prompts on 12 adapters, ~40-token answers, two thirds sheddable; "
                 "Poisson arrivals at 1x, 2x and 3x the rate the fleet sustains (1.5 req/s)",
                 kind="overload", question_tokens=1200, max_tokens=100, mean_output_tokens=40, replicas=2,
                 connections=100_000, deadline_s=120.0, duration_s=120.0, arrival_rate=1.5, rates=(1.5, 3.0, 4.5),
                 sheddable_share=2 / 3),
    ]
}


def get_scenario(name: str) -> Scenario:
    """A named scenario, or a workload variant as docs/benchmarks.md names it (`documents#161`: the variant
    benchmark's draw of that family and seed), so one variant runs in any mode, live through real proxies too."""
    if "#" in name:
        from .variants import named  # (variants builds on this module)

        return named(name).scenario
    try:
        return SCENARIOS[name]
    except KeyError:
        raise SystemExit(f"unknown scenario {name!r}; choose one of: decisions, {', '.join(SCENARIOS)}, "
                         "or a workload variant FAMILY#SEED") from None


def at_rate(scenario: Scenario, rate: float) -> Scenario:
    """An open-loop scenario at `rate` requests per second (its duration fixed, its request count follows)."""
    return replace(scenario, arrival_rate=rate, requests=max(1, round(rate * scenario.duration_s)))


def with_overrides(scenario: Scenario, **changes) -> Scenario:
    return replace(scenario, **{k: v for k, v in changes.items() if v is not None})
