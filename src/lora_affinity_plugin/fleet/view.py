"""A proxy process's view of the fleet: the last records from Redis plus the recent dispatches.

Scraped metrics are always a little old. Requests sent after a pod's scrape, by this process or by
its peers (shared through Redis, see `inflight.py`), are not in that pod's numbers yet, so they are
added as waiting requests (with their adapters) until they end or a newer scrape covers them. That
keeps a burst of requests that all see one snapshot from herding onto the same "best" pod.
Residency: an idle pod keeps the adapters it ran most recently (`residency.ResidencyMemory`), unless the
server reports them itself.
Prefixes: `prefixes` is the approximate index of what each pod's KV cache holds (prefix_index.py),
sized from each pod's reported cache.
Adapter names: a name counts as active while its own requests are in flight (vLLM refuses an adapter it
cannot load at once, so a made-up name counts for a round trip), and enters a pod's residency memory only once
it is known (`adapters.AdapterCatalog`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence

from ..config.settings import Settings
from ..kv.exact_share import HeldBlocks
from ..kv.prefix_index import PrefixIndex
from ..routing.cost import relative_slowness
from ..routing.podstate import DEFAULT_RATES
from ..routing.scheduling import Candidate
from .adapters import AdapterCatalog
from .inflight import Dispatch, InFlight, PeerShare
from .prompt_tokens import PromptTokens
from .residency import ResidencyMemory
from .store import PodRecord

logger = logging.getLogger("lora_affinity")

_DEFAULT_SLOTS = 4


@dataclass(slots=True)
class _PodState:
    record: PodRecord
    base: Candidate | None
    pending: dict[str, tuple[float, str | None]] = field(default_factory=dict)
    """This process's dispatches not yet covered by a scrape nor ended, oldest first."""
    peers: list[tuple[float, str | None]] = field(default_factory=list)
    """Peers' unfinished dispatches not covered by a scrape when they shared them."""
    covered_until: float = 0.0
    view: Candidate | None = None
    """`base` plus `pending` and `peers`, cached until any changes."""
    refused_at: float = float("-inf")
    """When a request last found the pod refusing connections: records scraped before that are not used."""

    def drop_covered(self, horizon: float, lag_s: float) -> None:
        self.covered_until = max(horizon, self.record.scraped_at - lag_s)
        while self.pending:
            key = next(iter(self.pending))
            if self.pending[key][0] > self.covered_until:
                break
            del self.pending[key]
        if self.peers:
            self.peers = [entry for entry in self.peers if entry[0] > self.covered_until]
        self.view = None


class FleetView:
    """Holds what the rules need; updated in the background, read on the request path."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._pods: dict[str, _PodState] = {}
        self._unusable: set[str] = set()
        """Pods whose last record could not be used (warned once per episode)."""
        self.inflight = InFlight()
        self.peer_counts: dict[str, int] = {}
        self.peer_processes = 0
        """Other gateway processes sharing in-flight requests, as of the last refresh."""
        self._peers_read_at = float("inf")
        self._anonymous = 0
        self._computing_until: dict[str, float] = {}
        """Per pod, when the prompts this process sent it should be computed by (its estimate at dispatch, this
        process's clock): a scrape shows such a prompt running, not how much of its prefill is left."""
        self.prefixes = PrefixIndex(settings.prefix_ttl_ms / 1000)
        self.held = HeldBlocks()
        """What each pod's engine reports its cache holds (its KV events, through the scraper and Redis)."""
        self.adapters = AdapterCatalog()
        self.residency = ResidencyMemory()
        self.prompt_tokens = PromptTokens()
        """Each pod's characters a token, learned from its engine's prompt token counts (`learn_prompt`)."""
        self._stalest_scrape = float("-inf")
        """The oldest scrape among pods with metrics: when it is fresh, so is every pod (no per-pod check)."""
        self._lists: OrderedDict[tuple[str, ...], _CandidateList] = OrderedDict()
        """The candidates of the last few sets of pods asked for (`candidates`), patched as views change."""

    # --- background side -------------------------------------------------------------------
    def update(self, records: Mapping[str, PodRecord], now: float | None = None) -> None:
        """Take a fresh set of records; pods absent from it keep their last record and age. `now` (this
        process's clock) bounds how long a refused connection keeps a pod out (see `refused`)."""
        refusal_s = self.settings.stale_after_ms / 1000
        for pod, record in records.items():
            state = self._pods.get(pod)
            if state is None:
                state = self._pods[pod] = _PodState(record=record, base=None)
            state.record = record
            try:
                usable = record.metrics is not None and (
                    record.scraped_at > state.refused_at or now is not None and now - state.refused_at > refusal_s)
                state.base = self._base_candidate(state) if usable else None
                if record.metrics is not None:
                    self._size_index(pod, record.metrics.num_gpu_blocks, record.metrics.block_size)
                state.drop_covered(horizon=record.scraped_at - self.settings.metrics_ttl_ms / 1000,
                                   lag_s=self.settings.dispatch_lag_ms / 1000)
            except (ArithmeticError, ValueError, TypeError) as exc:  # a record no scraper of ours writes
                state.base = None  # costs this pod, never the pods after it or the refresh
                if pod not in self._unusable:
                    logger.warning("pod %s: its record cannot be used (%s: %s); left out until a good one",
                                   pod, exc.__class__.__name__, exc)
                self._unusable.add(pod)
            else:
                self._unusable.discard(pod)
        self._stalest_scrape = min((state.record.scraped_at for state in self._pods.values() if state.base is not None),
                                   default=float("-inf"))
        self.adapters.report(frozenset().union(*(
            names for m in (state.record.metrics for state in self._pods.values()) if m is not None
            for names in (m.running_lora_adapters, m.waiting_lora_adapters, m.loaded_lora_adapters))))
        self._compare_speeds()
        self._build_views()

    def _compare_speeds(self) -> None:
        """Each pod's slowness against the fleet's median pod (a pod at half speed: 2.0)."""
        bases = [state for state in self._pods.values() if state.base is not None]
        if not bases:
            return
        factors = sorted(state.base.rates.prefill_factor for state in bases)
        decode = sorted(state.base.rates.decode_factor for state in bases)
        middle = (len(bases) - 1) // 2  # the lower median: in a fleet half slow, the fast half is the norm
        median_prefill, median_decode = factors[middle], decode[middle]
        for state in bases:
            slowness = relative_slowness(state.base.rates, median_prefill, median_decode)
            if slowness != state.base.slowness:
                state.base = replace(state.base, slowness=slowness)
                state.view = None

    def _size_index(self, pod: str, num_gpu_blocks: int | None, block_size: int | None) -> None:
        if num_gpu_blocks and block_size:  # records from Redis may come from any scraper: bounded here too
            tokens = min(int(num_gpu_blocks), 1 << 31) * min(int(block_size), 1 << 16)
            self.prefixes.set_capacity(pod, int(tokens * self.chars_per_token(pod) // self.settings.prefix_block_chars))

    def chars_per_token(self, pod: str) -> float:
        """`pod`'s characters a token: learned (`learn_chars_per_token`), else the settings'."""
        learned = self.prompt_tokens.chars_per_token(pod) if self.settings.learn_chars_per_token else None
        return learned or self.settings.prefix_chars_per_token

    def learn_prompt(self, served: Dispatch, prompt_tokens: object) -> bool:
        """`served`'s engine counted `prompt_tokens` in its prompt (a response's `usage.prompt_tokens`): the pod's
        characters a token learn from it (`prompt_tokens.PromptTokens`). False: nothing learned."""
        if not self.settings.learn_chars_per_token:
            return False
        learning = self.prompt_tokens.chars_per_token(served.pod) is None
        if not self.prompt_tokens.observe(served.pod, served.blocks, prompt_tokens, self.settings.prefix_block_chars,
                                          self.settings.prefix_max_chars):
            return False
        if learning and (learned := self.prompt_tokens.chars_per_token(served.pod)) is not None:
            logger.debug("pod %s: %.2f characters a token, learned from its engine's prompt token counts (until now "
                        "prefix_chars_per_token, %s)", served.pod, learned, self.settings.prefix_chars_per_token)
        return True

    def maintain(self, now: float) -> None:
        """Once per refresh: settings may have changed the TTL; unused entries expire."""
        self.prefixes.ttl_s = self.settings.prefix_ttl_ms / 1000
        self.prefixes.expire(now)

    def note_prefix(self, pod: str, hashes: Sequence[int], now: float, prefill_s: float = 0.0) -> None:
        """The request's prompt is now (being) computed on `pod`: it will hold these blocks, after about `prefill_s`
        seconds of prefill there, behind the prompts sent before it."""
        self.prefixes.add(pod, hashes, now, share=self.settings.share_prefixes)
        if prefill_s > 0 and pod in self._pods:  # kept on this process's clock, estimated in engine seconds
            scale = self.settings.engine_time_scale
            self._computing_until[pod] = max(self._computing_until.get(pod, now), now) + prefill_s / scale

    def prefilling(self, now: float) -> dict[str, float]:
        """Engine seconds each pod should still spend on the prompts this process sent it (none listed: done). Read
        from the few pods tracked, not the request's deployments: the rules look up only their candidates."""
        if not self._computing_until:
            return {}
        scale = self.settings.engine_time_scale
        return {pod: (until - now) * scale for pod, until in self._computing_until.items() if until > now}

    def confirm(self, served: Dispatch) -> None:
        """`served.pod` answered a request for `served.adapter`: a real adapter, which that pod now holds."""
        adapter = served.adapter
        if adapter is None or not self.adapters.confirm(adapter):
            return  # known when it was sent: its dispatch already left it in the pod's memory
        state = self._pods.get(served.pod)
        if state is not None:
            self.residency.touch(served.pod, adapter, self._memory(state.base.max_lora if state.base else None))

    def update_peers(self, share: PeerShare, now: float | None = None) -> None:
        """Replace what the peers sent; only their dispatches newer than a pod's scrape count.

        `now`: when this refresh read the peers. What they sent since their own last refresh is not in
        `share` yet; assuming they route alike, each of this process's dispatches since `now` stands for
        one from each peer too (`_view`)."""
        estimated = bool(self.peer_processes or share.processes)  # a lone gateway estimates nothing: views stand
        self.peer_counts = share.counts
        self.peer_processes = share.processes
        if now is not None:
            self._peers_read_at = now
        for pod, state in self._pods.items():
            recent = share.recent.get(pod, ())
            if estimated:
                state.view = None  # own dispatches since the peers were read count again for them
            if recent or state.peers:
                state.peers = [entry for entry in recent if entry[0] > state.covered_until]
                state.view = None
                slots = self._memory(state.base.max_lora if state.base else None)
                for _, adapter in state.peers:  # a peer's dispatch leaves its adapter resident too
                    if adapter is not None and self.adapters.known(adapter):
                        self.residency.touch(pod, adapter, slots)
        self._build_views()

    def _build_views(self) -> None:
        """Here, in the refresh, not on the next request: a refresh renews every view at once, and the candidate
        lists kept for the model groups asked for lately (a pod may have become usable or unusable)."""
        for state in self._pods.values():
            if state.view is None and state.base is not None:
                self._view(state)
        for pods in list(self._lists):
            self._lists[pods] = self._candidate_list(pods)

    def _candidate_list(self, pods: tuple[str, ...]) -> _CandidateList:
        get = self._pods.get
        usable = [(pod, state) for pod, state in zip(pods, map(get, pods)) if state is not None and state.base is not None]
        return _CandidateList(usable, [state.view or self._view(state) for _, state in usable])

    def _renew(self, pod: str, state: _PodState) -> None:
        """`pod`'s view changed (a dispatch came or went): the candidate lists holding it renew it when next read."""
        state.view = None
        for candidates in self._lists.values():
            position = candidates.positions.get(pod)
            if position is not None:
                candidates.renew.append(position)

    def recent_dispatches(self) -> dict[str, list[tuple[float, str | None]]]:
        """This process's share for its peers: unfinished dispatches no scrape has covered yet."""
        return {pod: list(state.pending.values()) for pod, state in self._pods.items() if state.pending}

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
            resident = self.residency.remember(state.record.pod, active, slots)
        size = metrics.num_gpu_blocks * metrics.block_size if metrics.num_gpu_blocks and metrics.block_size else None
        return Candidate(
            key=state.record.pod,
            waiting=metrics.num_requests_waiting,
            running=metrics.num_requests_running,
            kv_cache_usage=metrics.kv_cache_usage,
            active_adapters=active,
            resident_adapters=resident,
            max_lora=metrics.max_lora,
            reported_waiting=metrics.num_requests_waiting,
            rates=state.record.rates or DEFAULT_RATES,
            kv_free_tokens=None if size is None else int((1 - metrics.kv_cache_usage) * size),
            kv_cache_tokens=size,
            running_adapters=metrics.running_lora_adapters,
        )

    def _memory(self, max_lora: int | None) -> int:
        return (max_lora or _DEFAULT_SLOTS) * self.settings.residency_memory

    # --- request side ------------------------------------------------------------------------
    def manages(self, pods: Iterable[str]) -> bool:
        """Whether any of `pods` is proven a model server (`PodRecord.proven`): then their group is routed here."""
        get = self._pods.get
        for pod in pods:
            state = get(pod)
            if state is not None and state.record.proven:  # a record with metrics is proven (PodRecord)
                return True
        return False

    def record(self, pod: str) -> PodRecord | None:
        state = self._pods.get(pod)
        return state.record if state else None

    def model_names(self, pod: str) -> frozenset[str]:
        state = self._pods.get(pod)
        metrics = state.record.metrics if state else None
        return metrics.model_names if metrics else frozenset()

    def note_dispatch(self, pod: str, adapter: str | None, now: float, call_id: str | None = None,
                      blocks: int = 0) -> None:
        """A request goes to `pod`. With a call id it stays counted until `end(call_id)` (or a sweep);
        a second note for the same call (LiteLLM's deployment hook, or a retry) moves or keeps it. `blocks`: the
        prefix blocks its prompt was counted in (`learn_prompt`)."""
        if call_id is not None:
            current = self.inflight.get(call_id)
            if current is not None and current.pod == pod:
                return
            moved_from = self.inflight.begin(call_id, pod, adapter, now, blocks or (current.blocks if current else 0))
            if moved_from is not None:
                self._forget(moved_from, call_id)
        else:
            self._anonymous += 1
            call_id = f"#{self._anonymous}"
        state = self._pods.get(pod)
        if state is None or not self.settings.count_dispatches:
            return
        state.pending[call_id] = (now, adapter)
        self._renew(pod, state)
        if adapter is not None and self.adapters.known(adapter):
            self.residency.touch(pod, adapter, self._memory(state.base.max_lora if state.base else None))

    def refused(self, pod: str, now: float) -> bool:
        """A request could not connect to `pod`: it leaves the candidates now, not after its metrics go
        stale, and comes back with the first record scraped after `now` (a pod that is back answers
        its next scrape), or, whatever the records say, `stale_after_ms` later (a format 1 scraper on a
        clock behind this process's would otherwise keep it out; a pod still down has failing records by then).
        True when the pod was a candidate until now."""
        state = self._pods.get(pod)
        if state is None:
            return False
        was_candidate = state.base is not None
        state.refused_at = max(state.refused_at, now)
        state.base = state.view = None
        self._lists.clear()
        return was_candidate

    def end(self, call_id: str) -> Dispatch | None:
        """The request ended (any way); it leaves the pod's queue now rather than at the next scrape."""
        dispatch = self.inflight.end(call_id)
        if dispatch is not None:
            self._forget(dispatch, call_id)
        return dispatch

    def sweep(self, started_before: float) -> int:
        swept = self.inflight.sweep(started_before)
        for call_id, dispatch in swept:
            self._forget(dispatch, call_id)
        return len(swept)

    def _forget(self, dispatch: Dispatch, call_id: str) -> None:
        state = self._pods.get(dispatch.pod)
        if state is not None and state.pending.pop(call_id, None) is not None:
            self._renew(dispatch.pod, state)

    def scraped_view(self, pod: str) -> Candidate | None:
        """`pod` as its last scrape showed it, its learned rates and slowness included (no dispatches added)."""
        state = self._pods.get(pod)
        return state.base if state is not None else None

    def candidates(self, pods: Sequence[str], now: float) -> list[Candidate]:
        """Pods with metrics, their not-yet-scraped dispatches added.

        Fresh pods (scraped within `stale_after_ms`) only; when none is fresh, the stale ones serve as
        backups until their records are `metrics_ttl_ms` old (Redis down, or the proxy too busy to
        refresh): the dispatches counted since keep such a view usable. Failing pods never appear.
        """
        fresh_s = self.settings.stale_after_ms / 1000
        get = self._pods.get
        if now - self._stalest_scrape <= fresh_s:  # the common case: every pod with metrics is fresh
            if pods.__class__ is not tuple:
                return [state.view or self._view(state) for state in map(get, pods)
                        if state is not None and state.base is not None]
            return self._fresh_list(pods)
        backup_s = self.settings.metrics_ttl_ms / 1000
        fresh = []
        backup: list[Candidate] = []
        for pod in pods:
            state = get(pod)
            if state is None or state.base is None:
                continue
            age = now - state.record.scraped_at
            if age <= fresh_s:
                fresh.append(state.view or self._view(state))
            elif age <= backup_s and not fresh:
                backup.append(state.view or self._view(state))
        return fresh or backup

    def _fresh_list(self, pods: tuple[str, ...]) -> list[Candidate]:
        """`candidates` when every pod is fresh, for a tuple of pods (the strategy asks for the same few sets
        again and again): kept between requests, only the views a dispatch changed since are renewed (a
        request renews one or two of 64, instead of reading all 64)."""
        kept = self._lists.get(pods)
        if kept is None:
            kept = self._lists[pods] = self._candidate_list(pods)
            if len(self._lists) > _LISTS_KEPT:
                self._lists.popitem(last=False)
        elif kept.renew:
            states, views = kept.states, kept.views
            for position in kept.renew:
                state = states[position]
                views[position] = state.view or self._view(state)
            kept.renew.clear()
        return list(kept.views)

    def _view(self, state: _PodState) -> Candidate:
        base = state.base
        assert base is not None
        if state.pending or state.peers:
            sent = [*state.pending.values(), *state.peers]
            adapters = {a for _, a in sent if a is not None}
            unseen = 0  # the peers' dispatches since they last shared, estimated from this process's own
            if self.peer_processes:
                unseen = self.peer_processes * sum(1 for at, _ in state.pending.values() if at > self._peers_read_at)
            state.view = base.with_dispatches(len(sent) + unseen, adapters)
        else:
            state.view = base
        return state.view


_LISTS_KEPT = 16
"""Candidate lists kept (`_fresh_list`): one per set of healthy deployments a model group has."""


class _CandidateList:
    __slots__ = ("states", "views", "positions", "renew")

    def __init__(self, usable: list[tuple[str, _PodState]], views: list[Candidate]) -> None:
        self.states = [state for _, state in usable]
        self.views = views
        self.positions = {pod: i for i, (pod, _) in enumerate(usable)}
        self.renew: list[int] = []
        """Positions whose view changed since the list was last read."""

