"""What each pod's KV cache should hold, as far as the gateways know: an approximate prefix index.

Filled from routing decisions (this process's, and its peers' through Redis): a request sent to a pod
leaves its prompt's blocks there. Bounded per pod by an estimate of its cache
(`num_gpu_blocks x block_size x prefix_chars_per_token / prefix_block_chars` blocks of text), least
recently used out first, and entries older than `prefix_ttl_ms` expire. An inverted map (block ->
pods holding it) makes matching one walk down the prompt's chain, whatever the number of pods.
"""

from __future__ import annotations

import base64
import json
import struct
from collections import OrderedDict
from typing import Iterable, Sequence

DEFAULT_CAPACITY = 4096
"""Blocks per pod when the pod does not report its cache size."""


class PrefixIndex:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._pods: dict[str, OrderedDict[int, float]] = {}
        """pod -> block hash -> last use (unix s), least recently used first."""
        self._holders: dict[int, str | set[str]] = {}
        """Block -> the pod holding it, or a set when several do (one pod is the common case: no set)."""
        self._capacity: dict[str, int] = {}
        self._outbox: dict[str, dict[int, float]] = {}
        """Blocks this process placed since it last shared them (pod -> hash -> time)."""

    # --- request side -------------------------------------------------------------------------
    def matches(self, hashes: Sequence[int], pods: Iterable[str]) -> dict[str, int]:
        """Leading blocks of `hashes` each pod holds (pods holding none are absent)."""
        out: dict[str, int] = {}
        if not hashes:
            return out
        get = self._holders.get
        holders = get(hashes[0])
        if holders is None:
            return out
        alive = ({holders} if isinstance(holders, str) else holders).intersection(pods)
        for depth in range(1, len(hashes)):
            if not alive:
                return out
            holders = get(hashes[depth])
            if holders is None:
                keep: set[str] = set()
            elif isinstance(holders, str):
                keep = {holders} if holders in alive else set()
            else:
                keep = alive & holders
            if len(keep) != len(alive):
                for pod in alive - keep:
                    out[pod] = depth
            alive = keep
        for pod in alive:
            out[pod] = len(hashes)
        return out

    def add(self, pod: str, hashes: Sequence[int], at: float, *, share: bool = True) -> None:
        """`pod` now holds these blocks (a request was sent there, by us or by a peer)."""
        if not hashes:
            return
        lru = self._pods.get(pod)
        if lru is None:
            lru = self._pods[pod] = OrderedDict()
        holders = self._holders
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                holding = holders.get(h)
                if holding is None:
                    holders[h] = pod
                elif isinstance(holding, str):
                    if holding != pod:
                        holders[h] = {holding, pod}
                else:
                    holding.add(pod)
            lru[h] = at
        capacity = self._capacity.get(pod, DEFAULT_CAPACITY)
        while len(lru) > capacity:
            self._drop(pod, lru.popitem(last=False)[0])
        if share:
            outbox = self._outbox.setdefault(pod, {})
            for h in hashes:
                outbox[h] = at

    # --- background side ----------------------------------------------------------------------
    def set_capacity(self, pod: str, blocks: int) -> None:
        self._capacity[pod] = max(1, blocks)

    def expire(self, now: float) -> int:
        """Drop entries unused for `ttl_s`; returns how many went."""
        horizon = now - self.ttl_s
        dropped = 0
        for pod, lru in self._pods.items():
            while lru:
                h, at = next(iter(lru.items()))
                if at > horizon:
                    break
                del lru[h]
                self._drop(pod, h)
                dropped += 1
        return dropped

    def take_outbox(self, limit: int) -> list[tuple[str, float, list[int]]]:
        """This process's new entries for its peers, newest `limit` blocks kept: (pod, time, hashes)."""
        entries = [(at, pod, h) for pod, blocks in self._outbox.items() for h, at in blocks.items()]
        self._outbox = {}
        if len(entries) > limit:
            entries.sort()
            entries = entries[-limit:]
        by_pod: dict[str, tuple[float, list[int]]] = {}
        for at, pod, h in entries:
            latest, hashes = by_pod.setdefault(pod, (at, []))
            hashes.append(h)
            if at > latest:
                by_pod[pod] = (at, hashes)
        return [(pod, at, hashes) for pod, (at, hashes) in by_pod.items()]

    def sizes(self) -> dict[str, int]:
        return {pod: len(lru) for pod, lru in self._pods.items()}

    def capacity(self, pod: str) -> int:
        return self._capacity.get(pod, DEFAULT_CAPACITY)

    def _drop(self, pod: str, h: int) -> None:
        holding = self._holders.get(h)
        if holding is None:
            return
        if isinstance(holding, str):
            if holding == pod:
                del self._holders[h]
            return
        holding.discard(pod)
        if len(holding) == 1:
            self._holders[h] = next(iter(holding))

    def __len__(self) -> int:
        return len(self._holders)


SHARE_MAX_BLOCKS = 4096
"""Blocks one process shares per refresh (newest kept): at most ~22 KB written per refresh."""
SHARE_STREAM_LENGTH = 256
"""Entries the Redis stream keeps (approximately): bounds its memory at ~256 x 22 KB = 5.6 MB."""
SHARE_READ_COUNT = 32
"""Entries a process reads per refresh; a newcomer catches up on the stream's history in a few refreshes."""


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
