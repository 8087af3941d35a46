"""vLLM's KV-cache events on the wire: what a model server publishes about the blocks its cache holds.

vLLM (`--kv-events-config`) publishes on a ZeroMQ PUB socket, one multipart message per batch:
`(topic, sequence, payload)`, the sequence an 8-byte big-endian counter from 0, the payload a msgpack
`EventBatch` (`ts`, `events`, `data_parallel_rank`) whose events are `BlockStored` (the blocks' hashes, the
parent block's hash, their token ids, the block size, the LoRA id, the medium, the LoRA name),
`BlockRemoved` (hashes, medium) and `AllBlocksCleared`. Since 0.34 both block events also say which of the
engine's KV-cache groups they are about (`group_idx`; a hybrid model keeps sliding-window or mamba layers in
groups of their own, and a store names its group's kind) and whether the tier is this engine's (`locality`,
LOCAL or REMOTE). A ROUTER socket replays what a subscriber missed:
it sends `(b"", start sequence)` and gets `(b"", sequence, payload)` for every buffered batch from there
on, then `(b"", -1, b"")`.

Releases differ in one thing: older ones encode every struct as an array (the event's type name first,
then its fields in order), newer ones as a map with a `type` key. `decode_batch` reads both and any
fields a newer release adds; `encode_batch` writes either (the simulator publishes as vLLM does).
Pure: no sockets here (`kv_subscriber.py` holds them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Union

import msgspec

BlockHash = Union[int, bytes]
"""vLLM's hash of a block: an int (the builtin and xxhash algorithms) or bytes (sha256)."""

END_SEQ = -1
"""The replay socket's last reply: no more buffered batches."""

Layout = Literal["map", "array"]


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    """The block before the first of these (None: they start a prompt)."""
    token_ids: tuple[int, ...]
    """Every token of these blocks, in order: `block_size` per block."""
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    """Per block, what else its hash covers (the LoRA name, a `cache_salt`, media), when the server says."""
    group_idx: int | None = None
    """The engine's KV-cache group (None: releases and engines with one group)."""
    kv_cache_spec_kind: str | None = None
    """That group's kind: `full_attention`, `sliding_window`, `mamba`, ..."""
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    """LOCAL or REMOTE: whether the tier is the publishing engine's own (None: unspecified)."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


class KVEventFormatError(ValueError):
    """A payload that is not a KV event batch of any known release."""


# Field order of each struct on the wire (array layout), as vLLM declares them; the fields this module does not
# read (`ownership`, `session_id`, `lookahead_token_ids`) hold their places.
_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                    "locality", "ownership", "session_id", "lookahead_token_ids"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}
_BATCH_FIELDS = ("ts", "events", "data_parallel_rank")
_REQUIRED = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}
"""Leading fields every release has (the rest default: older releases lack them)."""

_decoder = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes) -> EventBatch:
    """One published payload as an `EventBatch`; raises KVEventFormatError naming what is wrong."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise KVEventFormatError(f"not msgpack: {exc}") from None
    fields = _fields(raw, _BATCH_FIELDS, "EventBatch")
    events = fields.get("events")
    if not isinstance(fields.get("ts"), (int, float)) or not isinstance(events, list):
        raise KVEventFormatError("an EventBatch needs a number `ts` and a list `events`")
    rank = fields.get("data_parallel_rank")
    return EventBatch(float(fields["ts"]), tuple(_event(e) for e in events), rank if isinstance(rank, int) else None)


def _fields(raw: Any, names: tuple[str, ...], what: str, tagged: bool = False) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, list):
        values = raw[1:] if tagged else raw
        return dict(zip(names, values))
    raise KVEventFormatError(f"{what}: a map or an array, got {type(raw).__name__}")


def _event(raw: Any) -> KVEvent:
    if isinstance(raw, dict):
        kind = raw.get("type")
    elif isinstance(raw, list) and raw:
        kind = raw[0]
    else:
        raise KVEventFormatError(f"an event is a tagged map or array, got {raw!r:.80}")
    if not isinstance(kind, str) or kind not in _FIELDS:
        raise KVEventFormatError(f"unknown event type {kind!r}; known: {', '.join(_FIELDS)}")
    fields = _fields(raw, _FIELDS[kind], kind, tagged=True)
    missing = [name for name in _FIELDS[kind][:_REQUIRED[kind]] if name not in fields]
    if missing:
        raise KVEventFormatError(f"{kind} lacks {', '.join(missing)}")
    try:
        group = _optional(fields, "group_idx", int, kind)
        locality = _optional(fields, "locality", str, kind)
        if kind == "BlockStored":
            extra = fields.get("extra_keys")
            window = fields.get("kv_cache_spec_sliding_window")
            return BlockStored(tuple(fields["block_hashes"]), fields["parent_block_hash"], tuple(fields["token_ids"]),
                               int(fields["block_size"]), fields.get("lora_id"), fields.get("medium"),
                               fields.get("lora_name"), None if extra is None else tuple(extra), group,
                               _optional(fields, "kv_cache_spec_kind", str, kind),
                               window if isinstance(window, int) else None, locality)
        if kind == "BlockRemoved":
            return BlockRemoved(tuple(fields["block_hashes"]), fields.get("medium"), group, locality)
    except (TypeError, ValueError) as exc:
        raise KVEventFormatError(f"{kind}: {exc}") from None
    return AllBlocksCleared()


def _optional(fields: dict[str, Any], name: str, wanted: type, kind: str) -> Any:
    """A field the index acts on, absent or of its type (a bool is no group number)."""
    value = fields.get(name)
    if value is None or (isinstance(value, wanted) and not isinstance(value, bool)):
        return value
    raise KVEventFormatError(f"{kind}.{name} must be {'an integer' if wanted is int else 'a string'} or absent, "
                             f"got {value!r:.40}")


def encode_batch(batch: EventBatch, layout: Layout = "map") -> bytes:
    """`batch` as a server of that layout publishes it (a field with a default that holds it is left out, as
    msgspec's `omit_defaults` does)."""
    if layout == "map":
        raw: Any = {"ts": batch.ts, "events": [_map(e) for e in batch.events]}
        if batch.data_parallel_rank is not None:
            raw["data_parallel_rank"] = batch.data_parallel_rank
    else:
        raw = [batch.ts, [_array(e) for e in batch.events]]
        if batch.data_parallel_rank is not None:
            raw.append(batch.data_parallel_rank)
    return _encoder.encode(raw)


def _values(event: KVEvent) -> tuple[str, list[tuple[str, Any]]]:
    kind = type(event).__name__
    return kind, [(name, getattr(event, name, None)) for name in _FIELDS[kind]]


_OPTIONAL = {"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership",
             "session_id", "lookahead_token_ids"}
"""Fields with a default on the server's side: left out when they hold it (msgspec's `omit_defaults`: in the
array layout only from the end)."""


def _map(event: KVEvent) -> dict[str, Any]:
    kind, values = _values(event)
    out: dict[str, Any] = {"type": kind}
    for name, value in values:
        if value is not None or name not in _OPTIONAL:
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def _array(event: KVEvent) -> list[Any]:
    kind, values = _values(event)
    while values and values[-1][0] in _OPTIONAL and values[-1][1] is None:
        values.pop()
    return [kind] + [list(v) if isinstance(v, tuple) else v for _, v in values]


def sequence_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def sequence_of(frame: bytes) -> int:
    if len(frame) != 8:
        raise KVEventFormatError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
