"""Block keys from token ids: how the engine's reported blocks and a request's prompt are named alike.

A model server names each full block of `block_size` tokens by a chained hash (its parent block's, the
block's token ids, and for the first block what else the cache is keyed by: the LoRA adapter and the request's
`cache_salt`). Its own hash is not reproducible outside it (the algorithm and seed are the server's), but its
KV events carry each block's token ids, so the subscriber (`kv_subscriber.py`) and the gateway both compute
this module's keys from tokens: the same prompt under the same adapter and salt gives the same chain. Pure and
stable across processes and hosts (blake2b, not Python's salted `hash`).
"""

from __future__ import annotations

from array import array
from hashlib import blake2b
from typing import Collection, Iterator, Sequence


def chain_seed(adapter: str | None, salt: str | None) -> int:
    """The parent of a chain's first block: the adapter (None: the base model) and the cache salt."""
    text = f"{adapter or ''}\x00{salt or ''}"
    return int.from_bytes(blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def block_key(parent: int, tokens: Sequence[int]) -> int:
    """One block's key: its parent's key and its token ids."""
    data = parent.to_bytes(8, "big") + array("I", tokens).tobytes()
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "big")


def chain_keys(seed: int, tokens: Sequence[int], block_size: int) -> Iterator[int]:
    """The keys of the full blocks of `tokens`, in order (a partial last block is not cached by a server)."""
    parent = seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start:start + block_size])
        yield parent


def leading(held: Collection[int] | None, keys: Sequence[int]) -> int:
    """How many of `keys`, from the first, are in `held`: the blocks of a prompt's chain a cache holds."""
    if not held:
        return 0
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n
