"""Where each pod's KV-event stream stood, kept in Redis so that a scraper starting after every scraper was down
resumes it, instead of knowing only what the pods' replay buffers still hold.

A checkpoint is one pod's index as the engine's own hashes name it (each block hash with our key for it), the
sequence number it covers and that batch's timestamp. A scraper that restores it asks the pod's replay socket for
everything from that number on: the same batch coming back with the same timestamp proves the same server
instance, unbroken, and the batches after it bring the index up to date. Anything else (nothing that old or
newer buffered, another timestamp, no answer) is a server that restarted or a history that cannot be proven:
the checkpoint is dropped and the pod joined afresh. The timestamp is the engine's, compared for equality only:
no clock is read.

Pure: `scraping/kv_follow.py` writes and reads them, `kv_subscriber.py` verifies them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from .kv_events import BlockHash

FORMAT = "C2"
"""Names this layout and the block keys' scheme (`token_blocks.py`): a checkpoint written under another is not
restored, so a scraper of another version starts the pod afresh rather than on keys it would compute otherwise.
C2 adds the KV-cache group the blocks are from; a C1 checkpoint (the same keys, no group) is still read."""
_READ = {"C1": 7, "C2": 9}
"""Each format read, with its field count."""


def checkpoints_key(prefix: str) -> str:
    return f"{{{prefix}}}:kv:checkpoints"


@dataclass(slots=True)
class PodCheckpoint:
    seq: int
    """The last batch applied."""
    ts: float
    """That batch's timestamp, as the engine wrote it."""
    partial: bool
    block_size: int | None = None
    unresolved: int = 0
    blocks: dict[BlockHash, int | None] = field(default_factory=dict)
    """The engine's block hash -> our key (None: a block whose chain the index could not follow)."""
    group: int | None = None
    """The engine's KV-cache group the blocks are from (`ExactIndex`), and its kind."""
    group_kind: str | None = None


def encode_checkpoint(checkpoint: PodCheckpoint) -> bytes:
    flat: list = []
    for block_hash, key in checkpoint.blocks.items():
        flat.append(block_hash)
        flat.append(key)
    return msgspec.msgpack.encode([FORMAT, checkpoint.seq, checkpoint.ts, checkpoint.partial, checkpoint.block_size,
                                   checkpoint.unresolved, flat, checkpoint.group, checkpoint.group_kind])


def decode_checkpoint(data: bytes) -> PodCheckpoint:
    """ValueError on another format or a damaged entry (the pod is then joined afresh)."""
    try:
        fields = msgspec.msgpack.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"unreadable checkpoint: {exc}") from None
    if not (isinstance(fields, list) and fields and isinstance(fields[0], str)
            and _READ.get(fields[0]) == len(fields)):
        raise ValueError(f"not a {' or '.join(_READ)} checkpoint")
    _, seq, ts, partial, block_size, unresolved, flat, group, group_kind = (fields + [None, None])[:9]
    if not (isinstance(seq, int) and seq >= 0 and isinstance(ts, (int, float)) and isinstance(flat, list)
            and len(flat) % 2 == 0 and (block_size is None or isinstance(block_size, int))
            and isinstance(unresolved, int) and (group is None or isinstance(group, int))
            and (group_kind is None or isinstance(group_kind, str))):
        raise ValueError(f"a damaged {fields[0]} checkpoint")
    blocks: dict[BlockHash, int | None] = {}
    for block_hash, key in zip(flat[::2], flat[1::2]):
        if not isinstance(block_hash, (int, bytes)) or not (key is None or isinstance(key, int)):
            raise ValueError(f"a damaged {fields[0]} checkpoint")
        blocks[block_hash] = key
    return PodCheckpoint(seq, float(ts), bool(partial), block_size, unresolved, blocks, group, group_kind)
