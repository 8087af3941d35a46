"""The KV-event wire format, pinned against the types vLLM declares for it (vllm/distributed/kv_events.py):
what a vLLM server publishes decodes here, and what the simulator publishes decodes in vLLM's types, for the
array layout of older releases and the map layout of newer ones."""

import msgspec
import pytest

from lora_affinity_plugin.kv.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventFormatError,
    decode_batch,
    encode_batch,
    sequence_bytes,
    sequence_of,
)


# vLLM's declarations, field for field: the current release's (maps, tagged by class name) ...
class NewBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class NewEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class NewStored(NewEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class NewRemoved(NewEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class NewCleared(NewEvent, tag="AllBlocksCleared"):
    pass


class NewKVBatch(NewBatch):
    events: list[NewStored | NewRemoved | NewCleared]


# ... and an older release's (arrays, the tag first).
class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldKVBatch(OldBatch):
    events: list[OldStored | OldRemoved | OldCleared]


TOKENS = list(range(100, 132))


def test_a_current_vllm_batch_decodes_field_for_field():
    sent = NewKVBatch(ts=12.5, events=[
        NewStored(block_hashes=[b"\x01" * 32, b"\x02" * 32], parent_block_hash=None, token_ids=TOKENS, block_size=16,
                  lora_id=3, medium="GPU", lora_name="sql-lora", extra_keys=[("sql-lora", "salt"), ("sql-lora",)]),
        NewRemoved(block_hashes=[b"\x01" * 32], medium="GPU"),
        NewCleared(),
    ], data_parallel_rank=0)
    batch = decode_batch(msgspec.msgpack.encode(sent))
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert stored == BlockStored((b"\x01" * 32, b"\x02" * 32), None, tuple(TOKENS), 16, 3, "GPU", "sql-lora",
                                 (["sql-lora", "salt"], ["sql-lora"]))
    assert removed == BlockRemoved((b"\x01" * 32,), "GPU") and cleared == AllBlocksCleared()


class ArrayStored(NewStored, array_like=True, tag="BlockStored"):
    pass


class ArrayRemoved(NewRemoved, array_like=True, tag="BlockRemoved"):
    pass


@pytest.mark.parametrize("stored_type, removed_type", [(NewStored, NewRemoved), (ArrayStored, ArrayRemoved)])
def test_a_hybrid_models_group_and_a_tiers_locality_decode_in_either_layout(stored_type, removed_type):
    """vLLM 0.34's store names its KV-cache group, the group's kind and the tier's locality (fields after them,
    `ownership` to `lookahead_token_ids`, hold their places in the array layout); a removal names group and
    locality."""
    sent = NewBatch(ts=1.0, events=[
        stored_type(block_hashes=[5], parent_block_hash=None, token_ids=TOKENS[:16], block_size=16, lora_id=None,
                    medium="GPU", lora_name=None, group_idx=2, kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=4096, locality="LOCAL", ownership="tier-1", session_id="s",
                    lookahead_token_ids=[[1, 2]]),
        removed_type(block_hashes=[5], medium="GPU", group_idx=2, locality="REMOTE", ownership="tier-1")])
    stored, removed = decode_batch(msgspec.msgpack.encode(sent)).events
    assert stored == BlockStored((5,), None, tuple(TOKENS[:16]), 16, None, "GPU", None, None, 2, "sliding_window", 4096,
                                 "LOCAL")
    assert removed == BlockRemoved((5,), "GPU", 2, "REMOTE")
    ours = EventBatch(1.0, (stored, removed))
    assert decode_batch(encode_batch(ours, "map")) == ours == decode_batch(encode_batch(ours, "array"))


def test_an_older_vllm_batch_of_arrays_decodes_too():
    sent = OldKVBatch(ts=3.0, events=[OldStored([11, 12], 10, TOKENS, 16, None, None), OldRemoved([11], None),
                                      OldCleared()])
    payload = msgspec.msgpack.encode(sent)
    assert msgspec.msgpack.decode(payload)[1][0][0] == "BlockStored"  # arrays, the tag first: the layout we read
    stored, removed, cleared = decode_batch(payload).events
    assert stored == BlockStored((11, 12), 10, tuple(TOKENS), 16) and removed == BlockRemoved((11,))
    assert cleared == AllBlocksCleared()


@pytest.mark.parametrize("layout, types, names", [("map", NewKVBatch, ["NewStored", "NewRemoved", "NewCleared"]),
                                                  ("array", OldKVBatch, ["OldStored", "OldRemoved", "OldCleared"])])
def test_what_the_simulator_publishes_decodes_in_vllms_own_types(layout, types, names):
    ours = EventBatch(7.25, (BlockStored((1, 2), None, tuple(TOKENS), 16, None, "GPU", None), BlockRemoved((2,), "GPU"),
                             AllBlocksCleared()), None)
    payload = encode_batch(ours, layout) if layout == "map" else _old(ours)
    theirs = msgspec.msgpack.decode(payload, type=types)
    assert theirs.ts == 7.25 and [type(e).__name__ for e in theirs.events] == names
    assert list(theirs.events[0].token_ids) == TOKENS and theirs.events[0].block_size == 16
    assert decode_batch(encode_batch(ours, layout)) == ours


def _old(batch: EventBatch) -> bytes:
    """An older release had no `lora_name`: its arrays end at `medium`."""
    raw = msgspec.msgpack.decode(encode_batch(batch, "array"))
    raw[1][0] = raw[1][0][:7]
    return msgspec.msgpack.encode(raw)


@pytest.mark.parametrize("payload, fragment", [
    (b"\xc1", "not msgpack"),
    (msgspec.msgpack.encode({"ts": 1.0}), "a list `events`"),
    (msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "BlockMoved"}]}), "unknown event type 'BlockMoved'"),
    (msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "BlockStored", "block_hashes": [1]}]}),
     "BlockStored lacks parent_block_hash, token_ids, block_size"),
    (msgspec.msgpack.encode("hello"), "EventBatch: a map or an array, got str"),
    (msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "BlockRemoved", "block_hashes": [1], "group_idx": [0]}]}),
     r"BlockRemoved.group_idx must be an integer or absent, got \[0\]"),
    (msgspec.msgpack.encode({"ts": 1.0, "events": [["BlockRemoved", [1], "GPU", 0, 7]]}),
     "BlockRemoved.locality must be a string or absent, got 7"),
])
def test_a_bad_payload_is_refused_with_what_is_wrong(payload, fragment):
    with pytest.raises(KVEventFormatError, match=fragment):
        decode_batch(payload)


def test_sequence_numbers_are_eight_signed_big_endian_bytes():
    assert sequence_bytes(1) == b"\x00" * 7 + b"\x01" and sequence_of(sequence_bytes(-1)) == -1
    assert sequence_of((2**40).to_bytes(8, "big")) == 2**40
    with pytest.raises(KVEventFormatError):
        sequence_of(b"\x01")
