"""Benchmark results: one per strategy, the table, the JSON file and the chart."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .transport import MACHINE_SATURATED, SATURATED, SIM_LAGGED, TransportStats, load_label


@dataclass
class RequestOutcome:
    replica: int | None
    ok: bool
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None
    """Why a request failed (HTTP status and message, or the client error), for the error summary."""
    itl_s: float | None = None
    """Mean inter-token latency of the request (streamed, more than one token)."""
    sheddable: bool = False


@dataclass
class Result:
    strategy: str
    scenario: str
    mode: str
    completed: int
    timeouts: int
    errors: int
    duration_s: float
    output_tokens: int
    ttft_s: dict[str, float] = field(default_factory=dict)
    e2e_s: dict[str, float] = field(default_factory=dict)
    per_replica: list[int] = field(default_factory=list)
    seeds: int = 1
    error_kinds: dict[str, int] = field(default_factory=dict)
    transport: dict = field(default_factory=dict)
    """Live mode: connections per pod, proxy sockets and CPU (see transport.py)."""
    itl_s: dict[str, float] = field(default_factory=dict)
    hit_rate: float | None = None
    """The fleet's prefix-cache hit rate: hit / queried prompt tokens, from the replicas' counters."""
    gateway_hit_rate: float | None = None
    """Fast mode with another client on the fleet: the same for the gateways' requests alone."""
    invalid: str = ""
    """Why the run did not measure what it names, though its requests succeeded (an exact index that stayed
    empty, another client's load that the fleet did not carry); never published."""
    rate: float | None = None
    """Open-loop arrivals per second (None: the closed-loop seed client)."""
    shed: int = 0
    """Requests refused with HTTP 429 (shedding: an answer, not an error)."""
    classes: dict = field(default_factory=dict)
    """Per criticality ("critical", "sheddable"), the same figures, when the run had sheddable requests."""
    ttft_p90_by_seed: list[float] = field(default_factory=list)
    completed_by_seed: list[int] = field(default_factory=list)
    """Merged over seeds: each seed's completed requests, in seed order (a paired interval needs them)."""
    """Fast mode over several seeds: each seed's TTFT p90 (near a fleet's limit the median hides how many
    seeds saturate)."""

    @property
    def req_per_s(self) -> float:
        return self.completed / self.duration_s if self.duration_s else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["req_per_s"] = round(self.req_per_s, 3)
        out["output_tokens_per_s"] = round(self.output_tokens_per_s, 1)
        return out


MAX_ERROR_SHARE = 0.01
"""A live row with more failed requests than this is not a result: the run, not the strategy, went wrong."""


def _transport(result: Result) -> TransportStats | None:
    """A live row's measured load; None for a fast-mode row."""
    return TransportStats.from_dict(result.transport) if result.transport else None


def machine_warning(result: Result) -> str | None:
    """Why this machine, not only the routing, shaped `result`: its cores were saturated, or the simulated
    replicas ran their steps late. Every process then queued for CPU while the simulated clock ran on.

    A warning, not a refusal: both strategies of a run share the machine, and a busy CI machine lags a little."""
    load = _transport(result)
    if load is None:
        return None
    if load.sim_lagged:
        return (f"{result.strategy}: the simulated replicas lost {load.sim_lag_share:.0%} of the run to steps this "
                f"machine ran late (over {SIM_LAGGED:.0%}): the fleet was slower than modelled; run slower (--speed)")
    if load.machine_saturated:
        return (f"{result.strategy}: this machine's cores were {load.machine_busy:.0%} busy over the run (over "
                f"{MACHINE_SATURATED:.0%}): proxies, load generator and fleet queued for CPU while the simulated "
                "clock ran on; run slower (--speed)")
    return None


def refusal(result: Result) -> str | None:
    """Why `result` must not be published, or None when it may: not the run it names, too many errors, or a
    saturated proxy."""
    if result.invalid:
        return f"{result.strategy}: {result.invalid}, so this row is not published"
    load = _transport(result)
    if load is not None and load.saturated:
        return (f"{result.strategy}: its busiest proxy worker used {load.proxy_busiest_worker:.0%} of a core over the "
                f"measured window (over {SATURATED:.0%}), so the proxy's own queue, not the routing, decided this "
                "row; it is not published: run slower (--speed) or with more --proxy-workers")
    sent = result.completed + result.timeouts + result.errors
    if not sent or result.errors / sent <= MAX_ERROR_SHARE:
        return None
    kinds = "; ".join(f"{n} x {kind}" for kind, n in result.error_kinds.items()) or "no kind recorded"
    return (f"{result.strategy}: {result.errors} of {sent} requests failed ({kinds}); more than "
            f"{MAX_ERROR_SHARE:.0%} errors means the run is broken, so this row is not published")


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def summarize(strategy: str, scenario: str, mode: str, outcomes: list[RequestOutcome], duration_s: float,
              replicas: int) -> Result:
    done = [o for o in outcomes if o.ok]
    per_replica = [0] * replicas
    for o in outcomes:
        if o.replica is not None:
            per_replica[o.replica] += 1
    shed = [o for o in outcomes if not o.ok and (o.error or "").startswith("HTTP 429")]
    return Result(
        strategy=strategy, scenario=scenario, mode=mode, completed=len(done),
        timeouts=sum(1 for o in outcomes if not o.ok and o.e2e_s is None),
        errors=sum(1 for o in outcomes if not o.ok and o.e2e_s is not None) - len(shed), shed=len(shed),
        duration_s=round(duration_s, 3), output_tokens=sum(o.output_tokens for o in done),
        ttft_s=percentiles([o.ttft_s for o in done if o.ttft_s is not None]),
        e2e_s=percentiles([o.e2e_s for o in done if o.e2e_s is not None]),
        itl_s=percentiles([o.itl_s for o in done if o.itl_s is not None]),
        per_replica=per_replica,
        error_kinds=dict(Counter(o.error for o in outcomes if o.error and not o.error.startswith("HTTP 429"))
                         .most_common(5)),
    )


def summarize_classes(strategy: str, scenario: str, mode: str, outcomes: list[RequestOutcome], duration_s: float,
                      replicas: int) -> Result:
    """`summarize`, plus the same per criticality when some requests were sheddable."""
    result = summarize(strategy, scenario, mode, outcomes, duration_s, replicas)
    if any(o.sheddable for o in outcomes):
        result.classes = {name: summarize(strategy, scenario, mode, [o for o in outcomes if o.sheddable is flag],
                                          duration_s, replicas)
                          for name, flag in (("critical", False), ("sheddable", True))}
    return result


def median_result(results: list[Result]) -> Result:
    """The per-strategy median over seeds (completed, tokens, latencies), reported as one row."""
    if len(results) == 1:
        return results[0]
    ordered = sorted(results, key=lambda r: r.completed)
    mid = ordered[len(ordered) // 2]
    return Result(
        strategy=mid.strategy, scenario=mid.scenario, mode=mid.mode,
        completed=int(statistics.median(r.completed for r in results)),
        timeouts=int(statistics.median(r.timeouts for r in results)),
        errors=int(statistics.median(r.errors for r in results)),
        duration_s=statistics.median(r.duration_s for r in results),
        output_tokens=int(statistics.median(r.output_tokens for r in results)),
        ttft_s=mid.ttft_s, e2e_s=mid.e2e_s, per_replica=mid.per_replica, seeds=len(results),
        completed_by_seed=[r.completed for r in results],
    )


def _triple(p: dict[str, float], fmt: str) -> str:
    """p50/p90/p99, or "-" when nothing was measured (TTFT exists only for streamed requests)."""
    return "/".join(format(p[k], fmt) for k in ("p50", "p90", "p99")) if p else "-"


def _spread(counts: list[int]) -> str:
    return f"{min(counts)}-{max(counts)}" if counts else "-"


def format_table(results: list[Result]) -> str:
    base = next((r for r in results if r.strategy == "simple-shuffle"), None)
    head = (f"{'strategy':<24}{'completed':>10}{'timeouts':>9}{'errors':>7}{'req/s':>7}{'out tok/s':>10}"
            f"{'TTFT p50/p90/p99 s':>21}{'e2e p50/p90/p99 s':>22}{'per-replica':>13}{'vs shuffle':>11}"
            f"{'proxy req/s, busiest':>22}")
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = f"{r.output_tokens_per_s / base.output_tokens_per_s:.2f}x" if base and base.output_tokens_per_s else "-"
        t = r.ttft_s or {}
        e = r.e2e_s or {}
        lines.append(
            f"{r.strategy:<24}{r.completed:>10}{r.timeouts:>9}{r.errors:>7}{r.req_per_s:>7.2f}"
            f"{r.output_tokens_per_s:>10.0f}"
            f"{_triple(t, '.1f'):>21}{_triple(e, '.0f'):>22}"
            f"{_spread(r.per_replica):>13}{ratio:>11}{_proxy_load(r):>22}"
        )
    for r in results:
        if r.error_kinds:
            kinds = "; ".join(f"{n} x {kind}" for kind, n in r.error_kinds.items())
            lines.append(f"errors of {r.strategy}: {kinds}")
    return "\n".join(lines)


def _proxy_load(r: Result) -> str:
    """What the proxies sustained and their busiest worker's share of a core (live rows)."""
    if not r.transport or not r.transport.get("proxy_requests_per_s"):
        return "-"
    load = TransportStats.from_dict(r.transport)
    return f"{load.proxy_requests_per_s:.1f}, {load_label(load)}"


def write_json(results: list[Result], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps([r.to_dict() for r in results], indent=2))


def write_chart(results: list[Result], path: str, title: str) -> str | None:
    """A bar chart of completed requests and output tok/s; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    names = [r.strategy for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, values, label in (
        (axes[0], [r.completed for r in results], "completed requests"),
        (axes[1], [r.output_tokens_per_s for r in results], "output tokens/s (simulated time)"),
    ):
        colors = ["tab:green" if n == "lora-affinity" else "tab:gray" for n in names]
        ax.barh(names, values, color=colors)
        ax.set_xlabel(label)
        ax.invert_yaxis()
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.0f}", va="center")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
