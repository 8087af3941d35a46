"""Generated inputs at every boundary the plugin reads: KV-event payloads and frames, Redis records, the shared
exact index's snapshot and change stream, the peers' tables and prefix stream, settings and profiles. Whatever
arrives, the reader keeps going: a bad input costs that pod or that entry, never the follower, the refresh or
another pod. (Pod pages: `test_fuzz_parser.py`.)

`FUZZ_EXAMPLES=5000 .venv/bin/pytest tests/test_fuzz_boundaries.py` runs each property on more inputs than CI's.
"""

import asyncio
import json
import math
import os
import time

import fakeredis
import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_affinity_plugin.kv.exact_index import ExactIndex
from lora_affinity_plugin.fleet.discovery import served_models_key
from lora_affinity_plugin.kv.exact_share import (HeldBlocks, PodChange, apply_entries, changes_key, decode_changes,
                                              encode_changes, snapshot_key)
from lora_affinity_plugin.fleet.view import FleetView
from lora_affinity_plugin.fleet.follower import Follower
from lora_affinity_plugin.fleet.inflight import inflight_key, members_key, prefix_stream_key
from lora_affinity_plugin.kv.kv_events import BlockStored, EventBatch, encode_batch
from lora_affinity_plugin.kv.kv_subscriber import KVEventSubscriber, _replay_reply
from lora_affinity_plugin.routing.podstate import PodMetrics
from lora_affinity_plugin.config.live_settings import settings_key
from lora_affinity_plugin.config.settings import Settings, SettingsError, build_settings
from lora_affinity_plugin.fleet.store import PodRecord, decode_records, pod_key

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))


def fuzz(share: float = 1.0):
    """Hypothesis's settings for one property: `share` of FUZZ_EXAMPLES inputs (the slow ones take fewer, each
    input there being a run of several)."""
    return settings(max_examples=max(10, int(EXAMPLES * share)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


FUZZ = fuzz()

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=8), st.binary(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                      max_leaves=12)
hashes = st.one_of(st.integers(-2**63, 2**64 - 1), st.binary(min_size=1, max_size=32), values)


@st.composite
def events(draw):
    """Events as the releases lay them out (a tagged array, or a map), their fields anything from the right
    shape to nonsense."""
    kind = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"]))
    stored = [draw(st.lists(hashes, max_size=4)), draw(st.one_of(st.none(), hashes)),
              draw(st.one_of(st.lists(st.integers(-2**40, 2**40), max_size=40), values)),
              draw(st.one_of(st.integers(-4, 70_000), values)), draw(st.one_of(st.none(), st.integers(-2**63, 2**63), values)),
              draw(st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "cpu", "disk"]), values)),
              draw(st.one_of(st.none(), st.text(max_size=8), values)), draw(st.one_of(st.none(), values)),
              draw(st.one_of(st.none(), st.integers(-3, 3), values)),  # group_idx and the group's kind (0.34+)
              draw(st.one_of(st.none(), st.sampled_from(["full_attention", "sliding_window", "mamba"]), values)),
              draw(st.one_of(st.none(), st.integers(-4, 4096), values)),
              draw(st.one_of(st.none(), st.sampled_from(["LOCAL", "REMOTE", "remote"]), values))]
    removed = stored[:1] + stored[5:6] + stored[8:9] + stored[11:12]
    fields = {"BlockStored": stored, "BlockRemoved": removed, "AllBlocksCleared": [], "Other": stored[:2]}[kind]
    fields = fields[:draw(st.integers(0, len(fields)))] if draw(st.booleans()) else fields
    if draw(st.booleans()):
        return [kind, *fields]
    names = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
             "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality"]
    removed_names = ["block_hashes", "medium", "group_idx", "locality"]
    return {"type": kind, **dict(zip(names if kind != "BlockRemoved" else removed_names, fields))}


@st.composite
def payloads(draw):
    batch = [draw(st.one_of(st.floats(allow_nan=True), st.integers(-2**63, 2**63), values)),
             draw(st.one_of(st.lists(events(), max_size=5), values)), draw(st.one_of(st.none(), st.integers(-2**63, 2**63), values))]
    shape = draw(st.sampled_from(["array", "map", "raw"]))
    if shape == "raw":
        return draw(st.binary(max_size=64))
    body = batch if shape == "array" else dict(zip(["ts", "events", "data_parallel_rank"], batch))
    return msgspec.msgpack.encode(body)


GOOD = EventBatch(1.0, (BlockStored((11, 12), None, tuple(range(32)), 16, None, "GPU", None, None),))


@fuzz(0.5)
@given(st.lists(payloads(), min_size=1, max_size=6))
def test_any_kv_payload_costs_at_most_that_pods_exactness_and_the_next_good_batch_applies(batch_payloads):
    subscriber = KVEventSubscriber({"p": None, "q": None})
    subscriber.index.track("q")
    subscriber._apply("q", subscriber.streams["q"], 0, encode_batch(GOOD))
    for seq, payload in enumerate(batch_payloads):
        subscriber._apply("p", subscriber.streams["p"], seq, payload)  # never raises
    stream = subscriber.streams["p"]
    assert stream.bad_payloads <= len(batch_payloads) and stream.last_seq == len(batch_payloads) - 1
    subscriber._apply("p", stream, len(batch_payloads), encode_batch(GOOD, "array"))
    assert subscriber.index.size("p") >= 2 and stream.last_seq == len(batch_payloads)
    assert subscriber.index.size("q") == 2  # the other pod is untouched


@FUZZ
@given(st.lists(st.binary(max_size=12), max_size=6))
def test_any_replay_reply_is_read_in_one_of_the_two_layouts_or_refused(frames):
    reply = _replay_reply(frames)
    assert reply is None or (isinstance(reply[0], int) and isinstance(reply[1], bytes))


record_fields = st.fixed_dictionaries({}, optional={
    "pod": st.one_of(st.text(max_size=6), values), "scraped_at": st.one_of(st.floats(allow_nan=True), values),
    "error": st.one_of(st.none(), st.text(max_size=6), values),
    "metrics": st.one_of(values, st.fixed_dictionaries({}, optional={
        "num_requests_waiting": st.one_of(st.integers(-10, 10**12), st.floats(allow_nan=True), values),
        "num_requests_running": st.one_of(st.integers(-10, 10**12), st.floats(allow_nan=True), values),
        "kv_cache_usage": st.one_of(st.floats(allow_nan=True), values),
        "running_lora_adapters": values, "waiting_lora_adapters": values,
        "max_lora": st.one_of(st.integers(-5, 2**40), values), "block_size": st.one_of(st.integers(-5, 2**40), values),
        "num_gpu_blocks": st.one_of(st.integers(-5, 2**40), values)})),
    "rates": values, "format": st.one_of(st.integers(-1, 5), values)})


def _raw(fields: dict) -> bytes:
    return json.dumps(fields, default=repr, allow_nan=True).encode()


@FUZZ
@given(st.one_of(record_fields.map(_raw), st.binary(max_size=80)))
def test_any_redis_record_costs_only_its_pod(raw):
    now = time.time()
    good = PodRecord("good", now, PodMetrics(num_requests_waiting=1, num_requests_running=2, kv_cache_usage=0.3))
    records = decode_records(["bad", "good"], [raw, good.to_json()])  # never raises
    fleet = FleetView(build_settings({}, environ={}))
    fleet.update(records, now)  # never raises
    views = {c.key: c for c in fleet.candidates(["bad", "good"], now)}
    assert (views["good"].waiting, views["good"].running) == (1, 2)
    bad = views.get("bad")
    if bad is not None:  # a record read as valid is a sane one
        assert bad.waiting >= 0 and bad.running >= 0 and 0.0 <= bad.kv_cache_usage <= 1.0
        assert math.isfinite(bad.kv_cache_usage)


entry_fields = st.dictionaries(st.sampled_from([b"e", b"n", b"c", b"x"]),
                               st.one_of(st.binary(max_size=40), st.just(b"epoch"), st.integers(-3, 5).map(
                                   lambda n: str(n).encode())), max_size=4)


@FUZZ
@given(st.lists(st.tuples(st.one_of(st.binary(max_size=8), st.text(max_size=8)), entry_fields), max_size=5),
       st.binary(max_size=120))
def test_any_change_stream_entry_or_snapshot_bytes_leave_the_copy_loaded_or_marked_for_a_reload(entries, snapshot):
    held = HeldBlocks()
    held.load({"a": PodChange(cleared=True, block_size=16, added={1, 2}, partial=False)}, 0)
    apply_entries(held, b"epoch", entries)  # never raises
    assert held.number is None or held.number >= 0
    try:
        decode_changes(snapshot)
    except ValueError:  # the follower keeps those pods on the inferred index until a good snapshot
        pass
    good = encode_changes({"a": PodChange(block_size=16, added={3})})
    cut = good[:len(snapshot) % (len(good) + 1)]
    try:
        decode_changes(cut)
    except ValueError:
        pass


@fuzz(0.25)
@given(st.data())
def test_a_refresh_reads_every_good_pod_whatever_else_redis_holds(data):
    """A proxy's whole refresh against a Redis whose other keys hold garbage: the pod record beside it, a peer's
    table, the prefix stream, the served-models list, the KV snapshot and change stream, the live settings."""
    base = build_settings({"kv_events": True, "scrape_interval_ms": 100}, environ={})
    garbage = data.draw(st.dictionaries(st.sampled_from(["record", "peer", "served", "snapshot", "changes",
                                                         "prefixes", "settings"]),
                                        st.one_of(st.binary(max_size=60), record_fields.map(_raw)), min_size=1))

    async def run():
        client = fakeredis.aioredis.FakeRedis()
        prefix = base.key_prefix
        now = time.time()
        good = PodRecord("good", now, PodMetrics(num_requests_waiting=3, num_requests_running=1))
        await client.set(pod_key(base, "good"), good.to_json())
        if "record" in garbage:
            await client.set(pod_key(base, "bad"), garbage["record"])
        if "peer" in garbage:
            await client.zadd(members_key(prefix), {"peer": now * 1000 + 60_000})
            await client.set(inflight_key(prefix, "peer"), garbage["peer"])
        if "served" in garbage:
            await client.set(served_models_key(prefix), garbage["served"])
        if "settings" in garbage:
            await client.set(settings_key(prefix), garbage["settings"])
        if "snapshot" in garbage:
            await client.hset(snapshot_key(prefix), mapping={"c": garbage["snapshot"], "n": b"x", "e": b"e",
                                                             "i": b"\xff"})
        if "changes" in garbage:
            await client.hset(snapshot_key(prefix), mapping={"c": encode_changes({}), "n": b"0", "e": b"e",
                                                             "i": b"0-0"})
            await client.xadd(changes_key(prefix), {"c": garbage["changes"], "n": b"1", "e": b"e"})
        if "prefixes" in garbage:
            await client.xadd(prefix_stream_key(prefix), {"p": b"peer", "e": garbage["prefixes"]})
        follower = Follower(base, FleetView(base), lambda: ["good", "bad"], lambda s: None)
        for _ in range(2):
            await follower.refresh(client)  # never raises
        views = {c.key: c for c in follower.fleet.candidates(["good", "bad"], time.time())}
        assert (views["good"].waiting, views["good"].running) == (3, 1)
        assert not follower._redis_down.active  # the refresh itself went through

    asyncio.run(run())


setting_values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=5), scalars,
                                                                                    max_size=3))


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(Settings.model_fields)), setting_values, min_size=1, max_size=3))
def test_any_settings_are_taken_or_refused_naming_the_field(values_by_name):
    try:
        build_settings(values_by_name, environ={})
    except SettingsError as exc:
        assert any(name in str(exc) for name in values_by_name), str(exc)


@FUZZ
@given(st.lists(st.one_of(st.sampled_from(["pick", "least_load", "prefix_match", "low_queue", "predicted_ttft",
                                           "lora-affinity", "nope", "mine"]),
                          st.dictionaries(st.sampled_from(["least_load", "kv_score", "nope"]),
                                          st.one_of(st.floats(allow_nan=True), st.integers(-3, 3), st.text(max_size=3)),
                                          max_size=3), scalars), max_size=6))
def test_any_profile_is_built_or_refused_naming_its_step(steps):
    try:
        build_settings({"rule_set": "mine", "profiles": {"mine": steps}}, environ={})
    except SettingsError as exc:
        assert "mine" in str(exc) or "profiles" in str(exc), str(exc)


def test_the_good_batch_used_above_applies_alone():
    index = ExactIndex()
    index.track("p")
    index.apply("p", GOOD)
    assert index.size("p") == 2


def test_what_a_proxy_cannot_use_is_counted_by_kind():
    from lora_affinity_plugin.telemetry.metrics import INPUTS_DROPPED

    base = build_settings({"kv_events": True}, environ={})

    async def run():
        client = fakeredis.aioredis.FakeRedis()
        now = time.time()
        await client.set(pod_key(base, "good"), PodRecord("good", now, PodMetrics()).to_json())
        await client.set(pod_key(base, "bad"), b"\x00 not a record")
        await client.hset(snapshot_key(base.key_prefix), mapping={"c": b"garbage", "n": b"0", "e": b"e", "i": b"0-0"})
        before = {kind: INPUTS_DROPPED.labels(kind)._value.get() for kind in ("record", "snapshot")}
        await Follower(base, FleetView(base), lambda: ["good", "bad"], lambda s: None).refresh(client)
        return {kind: INPUTS_DROPPED.labels(kind)._value.get() - before[kind] for kind in before}

    assert asyncio.run(run()) == {"record": 1, "snapshot": 1}


def test_refreshing_over_garbage_keeps_memory_flat():
    """300 refreshes, each over fresh garbage in a pod's record, a peer's table, the prefix stream and the change
    stream: what the plugin's own code holds after the first 100 does not grow with the rest (Redis's client and
    the fake server keep their own caches, which level off)."""
    import random
    import tracemalloc

    base = build_settings({"kv_events": True, "scrape_interval_ms": 100}, environ={})
    rng = random.Random(7)
    ours = tracemalloc.Filter(True, "*lora_affinity_plugin*")

    async def run() -> list[int]:
        client = fakeredis.aioredis.FakeRedis()
        prefix = base.key_prefix
        follower = Follower(base, FleetView(base), lambda: ["good", "bad"], lambda s: None)
        sizes = []
        tracemalloc.start()
        try:
            for i in range(300):
                now = time.time()
                junk = rng.randbytes(rng.randint(0, 200))
                await client.set(pod_key(base, "good"), PodRecord("good", now, PodMetrics()).to_json())
                await client.set(pod_key(base, "bad"), junk)
                await client.zadd(members_key(prefix), {f"peer-{i % 5}": now * 1000 + 60_000})
                await client.set(inflight_key(prefix, f"peer-{i % 5}"), junk)
                await client.xadd(prefix_stream_key(prefix), {"p": b"peer", "e": junk}, maxlen=100)
                await client.xadd(changes_key(prefix), {"c": junk, "n": str(i).encode(), "e": b"e"}, maxlen=100)
                await follower.refresh(client)
                if i in (99, 299):
                    snapshot = tracemalloc.take_snapshot().filter_traces([ours])
                    sizes.append(sum(stat.size for stat in snapshot.statistics("filename")))
        finally:
            tracemalloc.stop()
        return sizes

    after_100, after_300 = asyncio.run(run())
    print(f"the plugin's own memory after 100 refreshes {after_100} B, after 300 {after_300} B")
    assert after_300 - after_100 < 16 * 1024, (after_100, after_300)


def test_what_proxies_apply_is_read_whatever_the_keys_hold():
    from lora_affinity_plugin.fleet.inflight import applied_key, read_applied

    client = fakeredis.FakeRedis()
    client.set(applied_key("p", "host:1:a"), b"e1:4")
    client.set(applied_key("p", "host:2:b"), b"\xff\xfe not text")
    applied = read_applied(client, "p")
    assert applied["host:1:a"] == "e1:4" and set(applied) == {"host:1:a", "host:2:b"}
