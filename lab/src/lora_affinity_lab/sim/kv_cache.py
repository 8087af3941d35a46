"""A replica's KV blocks with vLLM's automatic prefix caching (docs/simulator.md).

A prompt's full blocks are named by chained hashes that cover the adapter and the `cache_salt`, so
the same text under another adapter or salt never hits. Running requests share hit blocks by
reference; a request's blocks are freed when it ends but keep their hash until the block is taken
for something else, least recently freed first (a request's tail blocks before its head).

The simulator's default tokenizer is its own (a token is 3 bytes of UTF-8): routers must not depend on it.
Given a `tokenizer.json` (`--tokenizer`), a replica tokenizes as a real server does, so that a gateway holding
the same file finds the same block boundaries; its KV events (`--kv-events-config`) then carry real token ids.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

from lora_affinity_plugin.kv.kv_events import BlockRemoved, BlockStored, KVEvent

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


class ByteTokenizer:
    """The default: a token is 3 bytes of the prompt's UTF-8 (its id those bytes as a number)."""

    name = "bytes3"

    def count(self, text: str, limit: int | None = None) -> int:
        return count_tokens(text)

    def block_hashes(self, text: str, adapter: str | None, salt: str | None, block_size: int) -> tuple[int, ...]:
        return block_hashes(text, adapter, salt, block_size)

    def block_tokens(self, text: str, block_size: int, reply: str = "") -> list[tuple[int, ...]]:
        """The token ids of the full blocks of the prompt (and the reply after it)."""
        data = _encode(text + reply)
        ids = [int.from_bytes(data[i:i + BYTES_PER_TOKEN], "big") for i in range(0, len(data), BYTES_PER_TOKEN)]
        return [tuple(ids[i:i + block_size]) for i in range(0, len(ids) - block_size + 1, block_size)]

    def reply_hashes(self, text: str, reply: str, adapter: str | None, salt: str | None,
                     block_size: int) -> tuple[int, ...]:
        """The chain of the prompt and its reply, every full block (the prompt's first)."""
        return block_hashes(text + reply, adapter, salt, block_size)


class FileTokenizer:
    """A Hugging Face `tokenizer.json`: the same ids a server with that tokenizer computes (no special tokens:
    the chat template writes its own markers as text)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        self.name = path
        self._tokenizer = Tokenizer.from_file(path)
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        # A token covers at most this many bytes of UTF-8 (byte-level BPE): bounds a prompt's count from below.
        self._longest = max(len(_encode(token)) for token in self._tokenizer.get_vocab()) or 1

    def encode(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            ids = self._cache[text] = self._tokenizer.encode(text, add_special_tokens=False).ids
            if len(self._cache) > 256:
                self._cache.popitem(last=False)
        return ids

    def count(self, text: str, limit: int | None = None) -> int:
        """The prompt's tokens; past `limit`, at least that many. A prompt that cannot fit is not tokenized: 10 MB
        of one character took 10 s of CPU, for an answer (HTTP 400) its length alone gives."""
        if limit is not None:
            at_least = -(-len(_encode(text)) // self._longest)
            if at_least > limit:
                return at_least
        return max(1, len(self.encode(text)))

    def block_tokens(self, text: str, block_size: int, reply: str = "") -> list[tuple[int, ...]]:
        # A reply's ids follow the prompt's as generated, not re-tokenized with it (a server caches what it ran).
        ids = self.encode(text) + (self.encode(reply) if reply else [])
        return [tuple(ids[i:i + block_size]) for i in range(0, len(ids) - block_size + 1, block_size)]

    def block_hashes(self, text: str, adapter: str | None, salt: str | None, block_size: int) -> tuple[int, ...]:
        return self._chain(self.block_tokens(text, block_size), adapter, salt)

    def reply_hashes(self, text: str, reply: str, adapter: str | None, salt: str | None,
                     block_size: int) -> tuple[int, ...]:
        return self._chain(self.block_tokens(text, block_size, reply), adapter, salt)

    @staticmethod
    def _chain(blocks: list[tuple[int, ...]], adapter: str | None, salt: str | None) -> tuple[int, ...]:
        parent = hash(("root", adapter, salt))
        out = []
        for block in blocks:
            parent = hash((parent, block))
            out.append(parent)
        return tuple(out)


Tokenizer = ByteTokenizer | FileTokenizer


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
        self.events: list[KVEvent] | None = None
        """KV events since the caller last took them (None: not recorded): a block cached, a cached block
        reused for something else."""
        self.free = blocks
        """Blocks a new allocation may take: never used, freed without a hash, or freed but still cached."""
        self._in_use: dict[int, int] = {}
        """Hash -> running requests referencing the block."""
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        """Free blocks that still hold their prefix, least recently freed first."""

    def fork(self) -> BlockPool:
        """A copy that records no events (the forward oracle's look-ahead)."""
        copy = BlockPool.__new__(BlockPool)
        copy.total, copy.caching, copy.events, copy.free = self.total, self.caching, None, self.free
        copy._in_use = dict(self._in_use)
        copy._free_cached = OrderedDict(self._free_cached)
        return copy

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

    def take(self, hashes: Sequence[int], hits: int, new_blocks: int,
             tokens: Callable[[], list[tuple[int, ...]]] | None = None, lora_name: str | None = None,
             block_size: int = 16, salt: str | None = None) -> list[int]:
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
            stored = []
            for i in range(hits, min(len(hashes), hits + new_blocks)):
                h = hashes[i]
                if h not in self._in_use and h not in self._free_cached:
                    self._in_use[h] = 1
                    held.append(h)
                    stored.append(i)
            if stored and self.events is not None and tokens is not None:
                self._note_stored(hashes, stored, tokens(), lora_name, block_size, salt)
        return held

    def _note_stored(self, hashes: Sequence[int], positions: list[int], tokens: list[tuple[int, ...]],
                     lora_name: str | None, block_size: int, salt: str | None = None) -> None:
        """One BlockStored per run of consecutive new blocks (its parent: the block before the run), with each
        block's extra keys as vLLM lists them: the adapter's name, and the cache salt on a chain's first block."""
        assert self.events is not None
        run: list[int] = []
        for i in positions + [-1]:
            if run and (i != run[-1] + 1):
                first = run[0]
                ids = tuple(t for j in run for t in tokens[j])
                extra = None
                if lora_name or salt:
                    extra = tuple(tuple(k for k in (lora_name, salt if j == 0 else None) if k) or None for j in run)
                self.events.append(BlockStored(tuple(hashes[j] for j in run), hashes[first - 1] if first else None,
                                               ids, block_size, None, "GPU", lora_name, extra))
                run = []
            if i >= 0:
                run.append(i)

    def clear(self) -> None:
        """Forget every cached prefix (a restarted server), keeping the blocks running requests use."""
        self.free += len(self._free_cached)
        self._free_cached.clear()

    def grow(self, blocks: int) -> None:
        self._allocate(blocks)

    def release(self, held: Sequence[int], total: int, reply: Sequence[int] = (),
                chain: tuple[Sequence[int], Callable[[], list[tuple[int, ...]]], str | None, int, str | None] | None = None
                ) -> None:
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
        if named and self.events is not None and chain is not None:
            hashes, tokens, lora_name, block_size, salt = chain  # the whole chain: prompt, then reply
            start = len(hashes) - len(reply)
            self._note_stored(hashes, list(range(start, start + len(named))), tokens(), lora_name, block_size, salt)
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
            gone, _ = self._free_cached.popitem(last=False)  # the block is reused: its prefix is gone
            if self.events is not None:
                self.events.append(BlockRemoved((gone,), "GPU"))
        self.free -= blocks
