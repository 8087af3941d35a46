"""What each pod's KV cache should hold, as far as the gateways know: an approximate prefix index.

Filled from routing decisions (this process's, and its peers' through Redis): a request sent to a pod
leaves its prompt's blocks there. Bounded per pod by an estimate of its cache
(`num_gpu_blocks x block_size x prefix_chars_per_token / prefix_block_chars` blocks of text), least
recently used out first, and entries older than `prefix_ttl_ms` expire. An inverted map of chain heads
(first block -> pods holding it) finds the pods to search, whatever their number; each pod's own blocks
say how far down the chain it holds.
"""

from __future__ import annotations

import base64
import json
import struct
from itertools import islice, repeat
from typing import Collection, Iterator, Mapping, Sequence

DEFAULT_CAPACITY = 4096
"""Blocks per pod when the pod does not report its cache size."""
REFRESH_S = 1.0
"""A held block used again within this long keeps its place: a hot prefix costs one lookup per request, not a
move per block (the LRU order is then right to within a second or two; the index is a hint)."""
MAX_CAPACITY = 1 << 20
"""Blocks per pod whatever it reports (~190 MB per pod at most; 100,000 GPU blocks need ~25,000)."""


class PrefixIndex:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._pods: dict[str, dict[int, float]] = {}
        """pod -> block hash -> last use (unix s), least recently used first. Plain dicts, kept in that order by
        deleting and re-inserting a block that moves: an `OrderedDict` spends more memory a block, and when a new
        chain replaces an old one it rebuilds its table now and then on the request path (a slow tail)."""
        self._holders: dict[int, str | set[str]] = {}
        """Chain head -> the pod holding it, or a set when several do (one pod is the common case: no set).
        Only heads (and a peer's shared blocks, whose heads are not marked): a match starts at a prompt's
        first block, and the rest of a chain is looked up in the pod's own blocks, so entering or evicting
        a 32-block chain touches this map once, not 32 times."""
        self._capacity: dict[str, int] = {}
        self._outbox: list[tuple[float, str, Sequence[int]]] = []
        """Chains this process placed since it last shared them (deduplicated when taken)."""

    # --- request side -------------------------------------------------------------------------
    def matches(self, hashes: Sequence[int], pods: Collection[str]) -> dict[str, int]:
        """Leading blocks of `hashes` each pod holds (pods holding none are absent).

        A pod is entered with a whole chain and loses its tail first (`add`), so what it holds of a
        chain is a leading run: a binary search in the blocks of each pod holding the first block finds
        its length in log2(blocks) lookups, or two when it ends where the previous pod's did (pods that
        hold a system prompt share its end). (A hole left by another chain's eviction may make it a
        block off: the index is a hint.)
        """
        out: dict[str, int] = {}
        if not hashes:
            return out
        first = self._holders.get(hashes[0])
        if first is None:
            return out
        last = len(hashes)
        guess = 0
        for pod in ((first,) if isinstance(first, str) else first):
            if pod not in pods:
                continue
            held = self._pods[pod]
            if guess and hashes[guess - 1] in held and (guess == last or hashes[guess] not in held):
                out[pod] = guess  # as long a run as the previous pod's (pods share a system prompt, not questions)
                continue
            lo, hi = 1, last  # pod holds hashes[:lo]; find the longest run up to hi
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if hashes[mid - 1] in held:
                    lo = mid
                else:
                    hi = mid - 1
            out[pod] = guess = lo
        return out

    def add(self, pod: str, hashes: Sequence[int], at: float, *, share: bool = True) -> None:
        """`pod` now holds this prompt's chain (a request was sent there)."""
        if not hashes:
            return
        lru = self._lru(pod)
        if hashes[0] not in lru:  # a chain new to this pod (it enters chains whole and frees their tails first)
            lru.update(zip(reversed(hashes), repeat(at)))  # one C call; the head ends most recent (see _refresh)
        else:  # its head is held, so marked already: only the blocks are entered or moved
            self._refresh(lru, hashes, at, chain=True)
        self._enter(pod, lru, hashes[:1])
        if share:
            self._outbox.append((at, pod, hashes))

    def add_shared(self, pod: str, hashes: Sequence[int], at: float) -> None:
        """A peer's blocks for `pod` (the newest blocks of its chains, not one chain): each entered or moved."""
        if hashes:
            lru = self._lru(pod)
            self._enter(pod, lru, self._refresh(lru, hashes, at, chain=False))

    def _lru(self, pod: str) -> dict[int, float]:
        lru = self._pods.get(pod)
        if lru is None:
            lru = self._pods[pod] = {}
        return lru

    @staticmethod
    def _refresh(lru: dict[int, float], hashes: Sequence[int], at: float, chain: bool) -> list[int]:
        """Moves held blocks to the recent end, appends the others; returns those (not yet in `_holders`)."""
        entered = []
        for h in reversed(hashes):  # a chain's head ends most recent: evicted last, as vLLM frees the tail first
            held = lru.get(h)
            if held is None:
                entered.append(h)
            elif chain and at - held < REFRESH_S:
                break  # this block came with its whole chain moments ago: the blocks before it are as recent
            else:
                del lru[h]  # to the recent end
            lru[h] = at
        return entered

    def _enter(self, pod: str, lru: dict[int, float], heads: Sequence[int]) -> None:
        """Marks `heads` as held by `pod` and evicts beyond its capacity."""
        holders = self._holders
        get = holders.get
        for h in heads:
            holding = get(h)
            if holding is None:
                holders[h] = pod
            elif isinstance(holding, str):
                if holding != pod:
                    holders[h] = {holding, pod}
            else:
                holding.add(pod)
        over = len(lru) - self._capacity.get(pod, DEFAULT_CAPACITY)
        if over > 0:
            for h in list(islice(lru, over)):  # the least recently used (one pass from the front, not one per block)
                del lru[h]
                if h in holders:  # a head (most blocks are not)
                    self._drop(pod, h)

    # --- background side ----------------------------------------------------------------------
    def set_capacity(self, pod: str, blocks: int) -> None:
        self._capacity[pod] = min(MAX_CAPACITY, max(1, blocks))

    def expire(self, now: float) -> int:
        """Drop entries unused for `ttl_s`; returns how many went."""
        horizon = now - self.ttl_s
        dropped = 0
        for pod, lru in self._pods.items():
            old = []
            for h, at in lru.items():  # least recently used first: stop at the first one in use
                if at > horizon:
                    break
                old.append(h)
            for h in old:
                del lru[h]
                self._drop(pod, h)
            dropped += len(old)
        return dropped

    def take_outbox(self, limit: int) -> list[tuple[str, float, list[int]]]:
        """This process's new entries for its peers, newest `limit` blocks kept: (pod, time, hashes)."""
        placed, self._outbox = self._outbox, []
        latest: dict[tuple[str, int], float] = {}
        for at, pod, hashes in placed:
            for h in hashes:
                latest[pod, h] = at
        entries = sorted(latest.items(), key=lambda item: item[1])[-limit:]
        by_pod: dict[str, tuple[float, list[int]]] = {}
        for (pod, h), at in entries:
            newest, kept = by_pod.get(pod, (at, []))
            kept.append(h)
            by_pod[pod] = (max(newest, at), kept)
        return [(pod, at, hashes) for pod, (at, hashes) in by_pod.items()]

    def sizes(self) -> dict[str, int]:
        return {pod: len(lru) for pod, lru in self._pods.items()}

    def size_view(self) -> Mapping[str, int]:
        """Blocks per pod, read when asked (no copy on the request path)."""
        return _Sizes(self._pods)

    def capacity(self, pod: str) -> int:
        return self._capacity.get(pod, DEFAULT_CAPACITY)

    def _drop(self, pod: str, h: int) -> None:
        holding = self._holders.get(h)
        if holding is None:  # not a head: most blocks
            return
        if isinstance(holding, str):
            if holding == pod:
                del self._holders[h]
            return
        holding.discard(pod)
        if len(holding) == 1:
            self._holders[h] = next(iter(holding))

    def __len__(self) -> int:
        """Blocks held, over all pods (a block two pods hold counts twice)."""
        return sum(map(len, self._pods.values()))


class _Sizes(Mapping[str, int]):
    __slots__ = ("_pods",)

    def __init__(self, pods: dict[str, dict[int, float]]) -> None:
        self._pods = pods

    def __getitem__(self, pod: str) -> int:
        return len(self._pods[pod])

    def get(self, pod: str, default: int = 0) -> int:  # type: ignore[override]
        lru = self._pods.get(pod)
        return default if lru is None else len(lru)

    def __iter__(self) -> Iterator[str]:
        return iter(self._pods)

    def __len__(self) -> int:
        return len(self._pods)


SHARE_MAX_BLOCKS = 4096
"""Blocks one process shares per refresh (newest kept): at most ~22 KB written per refresh."""
SHARE_STREAM_LENGTH = 256
"""Entries the Redis stream keeps at least (approximately); with more processes, SHARE_ENTRIES_PER_PROCESS each."""
SHARE_ENTRIES_PER_PROCESS = 4
"""The stream keeps max(256, 4 x processes) entries and a refresh reads every new one: each process writes at
most one entry per refresh, so a peer's entry is read by every process that refreshes within 4 intervals, at
any replica count (memory: ~22 KB per kept entry at most)."""


def encode_entries(entries: list[tuple[str, float, list[int]]]) -> str:
    """Compact JSON: [[pod, time, base64 of big-endian uint32 hashes], ...]."""
    return json.dumps([[pod, round(at, 3), base64.b64encode(struct.pack(f">{len(hashes)}I", *hashes)).decode()]
                       for pod, at, hashes in entries], separators=(",", ":"))


def decode_entries(raw: bytes | str) -> list[tuple[str, float, list[int]]]:
    """A peer's entries; anything unreadable yields nothing (the index is a hint, never a must)."""
    try:
        out = []
        for pod, at, packed in json.loads(raw):
            data = base64.b64decode(packed)
            out.append((str(pod), float(at), list(struct.unpack(f">{len(data) // 4}I", data[: len(data) // 4 * 4]))))
        return out
    except (ValueError, TypeError, struct.error):
        return []
