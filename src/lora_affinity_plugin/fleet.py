"""A proxy process's view of the fleet: the last records from Redis plus its own recent dispatches.

Scraped metrics are always a little old. Requests this process sent after a pod's scrape are not in
that pod's numbers yet, so they are added as waiting requests (with their adapters) until a newer
scrape covers them. That keeps a burst of requests that all see one snapshot from herding onto the
same "best" pod. Residency: an idle pod keeps the adapters it ran most recently (an LRU of
`max_lora` slots, like vLLM's GPU slots), unless the server reports them itself.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence

from .scheduling import Candidate
from .settings import Settings
from .store import PodRecord

_DEFAULT_SLOTS = 4


@dataclass(slots=True)
class _PodState:
    record: PodRecord
    base: Candidate | None
    resident: OrderedDict[str, None] = field(default_factory=OrderedDict)
    pending: deque[tuple[float, str | None]] = field(default_factory=deque)
    """Dispatches not yet covered by a scrape, oldest first."""
    view: Candidate | None = None
    """`base` plus `pending`, cached until either changes."""

    def drop_covered(self, horizon: float, lag_s: float) -> None:
        covered_until = max(horizon, self.record.scraped_at - lag_s)
        while self.pending and self.pending[0][0] <= covered_until:
            self.pending.popleft()
        self.view = None


class FleetView:
    """Holds what the rules need; updated in the background, read on the request path."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._pods: dict[str, _PodState] = {}

    # --- background side -------------------------------------------------------------------
    def update(self, records: Mapping[str, PodRecord]) -> None:
        """Take a fresh set of records; pods absent from it keep their last record and age."""
        for pod, record in records.items():
            state = self._pods.get(pod)
            if state is None:
                state = self._pods[pod] = _PodState(record=record, base=None)
            state.record = record
            state.base = self._base_candidate(state) if record.metrics is not None else None
            state.drop_covered(horizon=record.scraped_at - self.settings.metrics_ttl_ms / 1000,
                               lag_s=self.settings.dispatch_lag_ms / 1000)

    def _base_candidate(self, state: _PodState) -> Candidate:
        metrics = state.record.metrics
        assert metrics is not None
        active = metrics.running_lora_adapters | metrics.waiting_lora_adapters
        slots = self._memory(metrics.max_lora)
        if metrics.loaded_lora_adapters:
            resident = metrics.loaded_lora_adapters
        elif not self.settings.remember_residency:
            resident = active
        else:
            for adapter in sorted(active):
                _touch(state.resident, adapter, slots)
            resident = frozenset(state.resident)
        return Candidate(
            key=state.record.pod,
            waiting=metrics.num_requests_waiting,
            running=metrics.num_requests_running,
            kv_cache_usage=metrics.kv_cache_usage,
            active_adapters=active,
            resident_adapters=resident,
            max_lora=metrics.max_lora,
        )

    def _memory(self, max_lora: int | None) -> int:
        return (max_lora or _DEFAULT_SLOTS) * self.settings.residency_memory

    # --- request side ------------------------------------------------------------------------
    def knows(self, pods: Iterable[str]) -> bool:
        return any(pod in self._pods for pod in pods)

    def record(self, pod: str) -> PodRecord | None:
        state = self._pods.get(pod)
        return state.record if state else None

    def model_names(self, pod: str) -> frozenset[str]:
        state = self._pods.get(pod)
        metrics = state.record.metrics if state else None
        return metrics.model_names if metrics else frozenset()

    def note_dispatch(self, pod: str, adapter: str | None, now: float) -> None:
        state = self._pods.get(pod)
        if state is None or not self.settings.count_dispatches:
            return
        state.pending.append((now, adapter))
        state.view = None
        if adapter is not None:
            _touch(state.resident, adapter, self._memory(state.base.max_lora if state.base else None))

    def candidates(self, pods: Sequence[str], now: float) -> list[Candidate]:
        """Pods with metrics, their not-yet-scraped dispatches added.

        Fresh pods (scraped within `stale_after_ms`) only; when none is fresh, the stale ones serve as
        backups until their records are `metrics_ttl_ms` old (Redis down, or the proxy too busy to
        refresh): the dispatches counted since keep such a view usable. Failing pods never appear.
        """
        fresh_s = self.settings.stale_after_ms / 1000
        backup_s = self.settings.metrics_ttl_ms / 1000
        fresh: list[Candidate] = []
        backup: list[Candidate] = []
        for pod in pods:
            state = self._pods.get(pod)
            if state is None or state.base is None:
                continue
            age = now - state.record.scraped_at
            if age <= fresh_s:
                fresh.append(state.view or self._with_pending(state))
            elif age <= backup_s and not fresh:
                backup.append(state.view or self._with_pending(state))
        return fresh or backup

    @staticmethod
    def _with_pending(state: _PodState) -> Candidate:
        base = state.base
        assert base is not None
        if state.pending:
            adapters = {a for _, a in state.pending if a is not None}
            state.view = replace(
                base,
                waiting=base.waiting + len(state.pending),
                active_adapters=base.active_adapters | adapters if adapters else base.active_adapters,
            )
        else:
            state.view = base
        return state.view


def _touch(lru: OrderedDict[str, None], adapter: str, slots: int) -> None:
    lru[adapter] = None
    lru.move_to_end(adapter)
    while len(lru) > slots:
        lru.popitem(last=False)
