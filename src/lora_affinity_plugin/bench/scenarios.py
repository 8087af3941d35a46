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


def _adapters(n: int) -> tuple[str, ...]:
    return tuple(f"adapter-{i:02d}" for i in range(n))


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario("seed", "the seed's benchmark: 1000 requests at t=0, 12 adapters uniform, max_loras 4"),
        Scenario("scarce-slots", "24 adapters, max_loras 2", adapters=_adapters(24), max_loras=2, max_cpu_loras=24),
        Scenario("zipf", "12 adapters with Zipf(1.2) popularity", zipf_s=1.2),
        Scenario("cold", "cold start: no adapter loaded anywhere yet", warm=False),
        Scenario("poisson", "Poisson arrivals at 3 req/s for 300 s, 12 adapters", arrival_rate=3.0, requests=900),
        Scenario("streaming", "the seed scenario with half the requests streamed", stream_share=0.5),
    ]
}


def get_scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise SystemExit(f"unknown scenario {name!r}; choose one of: decisions, {', '.join(SCENARIOS)}") from None


def with_overrides(scenario: Scenario, **changes) -> Scenario:
    return replace(scenario, **{k: v for k, v in changes.items() if v is not None})
