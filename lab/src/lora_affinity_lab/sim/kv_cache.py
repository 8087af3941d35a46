"""A replica's KV blocks with vLLM's automatic prefix caching (docs/simulator.md).

A prompt's full blocks are named by chained hashes that cover the adapter and the `cache_salt`, so
the same text under another adapter or salt never hits. Running requests share hit blocks by
reference; a request's blocks are freed when it ends but keep their hash until the block is taken
for something else, least recently freed first (a request's tail blocks before its head).

The simulator's tokenizer is its own (a token is 3 bytes of UTF-8): routers must not depend on it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

BYTES_PER_TOKEN = 3


def count_tokens(text: str) -> int:
    return max(1, -(-len(_encode(text)) // BYTES_PER_TOKEN))


def block_hashes(text: str, adapter: str | None, salt: str | None, block_size: int) -> tuple[int, ...]:
    """Chained hashes of the prompt's full blocks, seeded by adapter and salt (a partial block is not cached)."""
    data = _encode(text)
    step = block_size * BYTES_PER_TOKEN
    parent = hash(("root", adapter, salt))
    out = []
    for start in range(0, len(data) - step + 1, step):
        parent = hash((parent, data[start:start + step]))
        out.append(parent)
    return tuple(out)


def prompt_text(body: dict) -> str:
    """The prompt as the simulated model sees it: a completion's prompt, or the chat rendered by a template."""
    if "messages" in body:
        out = []
        for message in body["messages"] if isinstance(body["messages"], list) else []:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") if isinstance(p, dict) and isinstance(p.get("text"), str)
                                  else f"<{p.get('type')}>" if isinstance(p, dict) else "" for p in content)
            out.append(f"<|{message.get('role')}|>\n{content if isinstance(content, str) else ''}\n")
        return "".join(out) + "<|assistant|>\n"
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else " ".join(map(str, prompt))


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


class BlockPool:
    """Counts blocks; remembers which hold which prefix."""

    def __init__(self, blocks: int, caching: bool = True) -> None:
        self.total = blocks
        self.caching = caching
        self.free = blocks
        """Blocks a new allocation may take: never used, freed without a hash, or freed but still cached."""
        self._in_use: dict[int, int] = {}
        """Hash -> running requests referencing the block."""
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        """Free blocks that still hold their prefix, least recently freed first."""

    def cached_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt this replica holds."""
        if not self.caching:
            return 0
        n = 0
        for h in hashes:
            if h not in self._in_use and h not in self._free_cached:
                break
            n += 1
        return n

    def fits(self, hits: Sequence[int], new_blocks: int) -> bool:
        revived = sum(1 for h in hits if h in self._free_cached)
        return new_blocks + revived <= self.free

    def take(self, hashes: Sequence[int], hits: int, new_blocks: int) -> list[int]:
        """Reference `hits` cached blocks and allocate `new_blocks`; returns the hashes now held.

        The prompt's remaining full blocks are computed into some of the new blocks and cached at once,
        so a request admitted a step later hits them (vLLM caches a block when it is scheduled).
        """
        held = []
        for h in hashes[:hits]:
            if h in self._free_cached:
                del self._free_cached[h]
                self.free -= 1
                self._in_use[h] = 1
            else:
                self._in_use[h] += 1
            held.append(h)
        self._allocate(new_blocks)
        if self.caching:
            for h in hashes[hits:hits + new_blocks]:
                if h not in self._in_use and h not in self._free_cached:
                    self._in_use[h] = 1
                    held.append(h)
        return held

    def grow(self, blocks: int) -> None:
        self._allocate(blocks)

    def release(self, held: Sequence[int], total: int, reply: Sequence[int] = ()) -> None:
        """A request's `total` blocks are freed; the hashed ones stay cached, its tail evicted first.

        `reply` names the blocks its generated tokens filled (a continuation of `held`'s chain): they
        stay cached as well, as far as the request's own blocks go.
        """
        private = total - len(held)
        named = []
        if self.caching:
            for h in reply[:private]:
                if h in self._in_use or h in self._free_cached:
                    break
                named.append(h)
        for h in reversed(named):
            self._free_cached[h] = None
        self.free += len(named)
        total -= len(named)
        for h in reversed(held):
            refs = self._in_use[h] - 1
            if refs:
                self._in_use[h] = refs
                continue
            del self._in_use[h]
            self._free_cached[h] = None
            self.free += 1
        self.free += total - len(held)

    def _allocate(self, blocks: int) -> None:
        uncached = self.free - len(self._free_cached)
        for _ in range(max(0, blocks - uncached)):
            self._free_cached.popitem(last=False)  # the block is reused: its prefix is gone
        self.free -= blocks
