"""Per pod, the blocks its engine says it holds: built from its KV events (`kv_events.py`), keyed by token ids
(`token_blocks.py`), so that a request's prompt is matched exactly, not inferred from where it was sent.

Pure: the subscriber feeds it batches in sequence order; the rules read `match`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

from .exact_share import PodChange
from .kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from .token_blocks import block_key, chain_seed, leading


@dataclass(slots=True)
class PodBlocks:
    keys: dict[int, int] = field(default_factory=dict)
    """Block key -> how many of the engine's blocks carry it (one, but for a block stored twice)."""
    by_hash: dict[BlockHash, int | None] = field(default_factory=dict)
    """The engine's block hash -> our key (None: a block whose chain we could not follow)."""
    block_size: int | None = None
    unresolved: int = 0
    """Blocks stored after a parent this index never saw (a stream joined late): their keys are unknown."""
    partial: bool = False
    """The engine may hold blocks this index never saw stored (the subscriber's `PodStream.partial`)."""
    group: int | None = None
    """The engine's KV-cache group these blocks are from (None: its events name no group)."""
    group_kind: str | None = None


class ExactIndex:
    def __init__(self) -> None:
        self._pods: dict[str, PodBlocks] = {}
        self._changes: dict[str, PodChange] = {}
        """What changed since `take_changes` (the scraper shares it with the proxies, `exact_share.py`)."""

    def track(self, pod: str) -> None:
        """`pod`'s stream is followed: it reports its cache from now on, even while it holds nothing."""
        if pod not in self._pods:
            self._pods[pod] = PodBlocks()
            self._change(pod).cleared = True

    def set_partial(self, pod: str, partial: bool) -> None:
        """Whether a followed pod's keys may lack some its engine holds; the proxies are told when it changes, and
        then count what they routed there as well (`FleetView`)."""
        blocks = self._pods.get(pod)
        if blocks is not None and blocks.partial != partial:
            blocks.partial = partial
            self._change(pod).partial = partial

    def take_changes(self) -> dict[str, PodChange]:
        changes, self._changes = self._changes, {}
        return changes

    def snapshot(self) -> dict[str, PodChange]:
        """Every pod's keys, as a change set that replaces whatever a reader held."""
        return {pod: PodChange(True, blocks.block_size or 0, set(blocks.keys), partial=blocks.partial)
                for pod, blocks in self._pods.items()}

    def _change(self, pod: str) -> PodChange:
        change = self._changes.get(pod)
        if change is None:
            change = self._changes[pod] = PodChange()
        return change

    def _added(self, pod: str, key: int, block_size: int) -> None:
        change = self._change(pod)
        change.block_size = block_size
        change.removed.discard(key)
        change.added.add(key)

    def _gone(self, pod: str, key: int) -> None:
        change = self._change(pod)
        if key in change.added:
            change.added.discard(key)
        else:
            change.removed.add(key)

    def apply(self, pod: str, batch: EventBatch) -> None:
        blocks = self._pods.setdefault(pod, PodBlocks())
        for event in batch.events:
            if isinstance(event, (BlockStored, BlockRemoved)) and not (
                    _on_gpu(event.medium, event.locality) and self._in_group(pod, blocks, event)):
                continue
            if isinstance(event, BlockStored):
                self._stored(pod, blocks, event)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._drop(pod, blocks, blocks.by_hash.pop(h, None))
            elif isinstance(event, AllBlocksCleared):
                self.clear(pod)
                blocks = self._pods.setdefault(pod, PodBlocks())

    def _in_group(self, pod: str, blocks: PodBlocks, event: BlockStored | BlockRemoved) -> bool:
        """Whether an event is about the group that bounds a prompt's cache hit. A hybrid model keeps its
        sliding-window or mamba layers in groups of their own, under the same block hashes, and drops their
        blocks as the window moves on while the full-attention group still holds them: the index follows one
        full-attention group (the first it sees; the first group of any kind where the model has none)."""
        group = event.group_idx
        if group is None or group == blocks.group:
            return True
        if isinstance(event, BlockRemoved):
            return blocks.group is None  # (a group not yet learned: the removal is applied, never over-claimed)
        if blocks.group is not None and (_bounds_prefix(blocks.group_kind)
                                         or not _bounds_prefix(event.kv_cache_spec_kind)):
            return False
        if blocks.group is not None:  # a full-attention group after another kind's: start over on it
            for h in list(blocks.by_hash):
                self._drop(pod, blocks, blocks.by_hash.pop(h))
            blocks.unresolved = 0
        blocks.group, blocks.group_kind = group, event.kv_cache_spec_kind
        return True

    def _drop(self, pod: str, blocks: PodBlocks, key: int | None) -> None:
        if key is None:
            return
        left = blocks.keys.get(key, 0) - 1
        if left > 0:
            blocks.keys[key] = left
        else:
            blocks.keys.pop(key, None)
            self._gone(pod, key)

    def _stored(self, pod: str, blocks: PodBlocks, event: BlockStored) -> None:
        size = event.block_size
        blocks.block_size = size
        if event.parent_block_hash is None:
            # An adapter named only by number (vLLM up to 0.13 sends `lora_id` without `lora_name`): its blocks
            # cannot be keyed to the name a request carries, so they stay unresolved rather than claimed as the
            # base model's.
            anonymous = event.lora_id is not None and event.lora_name is None
            parent: int | None = None if anonymous else chain_seed(event.lora_name, _salt(event))
        else:
            parent = blocks.by_hash.get(event.parent_block_hash)
        tokens = event.token_ids
        for i, h in enumerate(event.block_hashes):
            old = blocks.by_hash.get(h)
            if parent is not None:
                parent = block_key(parent, tokens[i * size:(i + 1) * size])
                count = blocks.keys.get(parent, 0)
                blocks.keys[parent] = count + 1
                if not count:
                    self._added(pod, parent, size)
            else:
                blocks.unresolved += 1
            if old is not None:  # the engine reused a hash without removing it first: drop the old key
                self._drop(pod, blocks, old)
            blocks.by_hash[h] = parent

    def clear(self, pod: str) -> None:
        self._pods.pop(pod, None)
        self._changes[pod] = PodChange(cleared=True)

    def held_by_hash(self, pod: str) -> PodBlocks | None:
        """The pod's blocks as its engine names them (a checkpoint's content, `kv_checkpoint.py`); not a copy."""
        return self._pods.get(pod)

    def restore(self, pod: str, by_hash: dict[BlockHash, int | None], block_size: int | None,
                unresolved: int = 0, partial: bool = False, group: int | None = None,
                group_kind: str | None = None) -> None:
        """The pod's blocks from a checkpoint, replacing what was held: shared as a whole new set of keys."""
        blocks = PodBlocks(by_hash=dict(by_hash), block_size=block_size, unresolved=unresolved, partial=partial,
                           group=group, group_kind=group_kind)
        for key in blocks.by_hash.values():
            if key is not None:
                blocks.keys[key] = blocks.keys.get(key, 0) + 1
        self._pods[pod] = blocks
        self._changes[pod] = PodChange(True, block_size or 0, set(blocks.keys), partial=partial)

    def match(self, pod: str, keys: Sequence[int]) -> int:
        """How many leading blocks of a prompt's chain `pod` holds."""
        blocks = self._pods.get(pod)
        return 0 if blocks is None else leading(blocks.keys, keys)

    def bound(self, pod: str, engine_blocks: int) -> int:
        """Hold at most the `engine_blocks` blocks the pod's engine has (from its page): past that the index
        claims blocks the engine must have dropped (removals lost for good), so the ones stored longest ago are
        forgotten first. Returns how many were forgotten."""
        blocks = self._pods.get(pod)
        if blocks is None or engine_blocks <= 0 or len(blocks.by_hash) <= engine_blocks:
            return 0
        excess = len(blocks.by_hash) - engine_blocks
        for h in list(itertools.islice(blocks.by_hash, excess)):  # (a dict keeps insertion order: oldest first)
            self._drop(pod, blocks, blocks.by_hash.pop(h))
        return excess

    def size(self, pod: str) -> int:
        blocks = self._pods.get(pod)
        return len(blocks.keys) if blocks else 0

    def keys(self, pod: str) -> set[int]:
        blocks = self._pods.get(pod)
        return set(blocks.keys) if blocks else set()

    def block_size(self, pod: str) -> int | None:
        blocks = self._pods.get(pod)
        return blocks.block_size if blocks else None


def _salt(event: BlockStored) -> str | None:
    """The cache salt a chain's first block was stored under: the first block's extra keys other than the
    LoRA name (vLLM lists the adapter's name, then the salt)."""
    if not event.extra_keys:
        return None
    first = event.extra_keys[0]
    if not first:
        return None
    rest = [k for k in first if isinstance(k, str) and k != event.lora_name]
    return rest[-1] if rest else None


def _on_gpu(medium: object, locality: object) -> bool:
    """Whether an event is about this engine's GPU KV cache, the one a request is admitted from: another tier (CPU
    offload, storage) or a REMOTE one names the same hashes, and its changes are not the GPU's (None: releases
    and engines that name no tier)."""
    return ((medium is None or (isinstance(medium, str) and medium.upper() == "GPU"))
            and not (isinstance(locality, str) and locality.upper() == "REMOTE"))


def _bounds_prefix(kind: str | None) -> bool:
    """Whether a group's blocks bound a prompt's cache hit: full attention needs every block before the hit (a
    group of unnamed kind is taken as one)."""
    return kind is None or kind == "full_attention"
