"""Checkpoints of the pods' KV-event streams: a scraper that starts after every scraper was down resumes each pod
where the last lease holder stood, when the pod's replay proves the same server; else it joins afresh.

Real ZeroMQ sockets (the simulator's publisher) and the real scraper; fakeredis stands in for Redis here (the
end-to-end KV-event tests run on a real server)."""

import asyncio

import pytest

from lora_affinity_plugin.kv.exact_index import ExactIndex
from lora_affinity_plugin.kv.kv_checkpoint import PodCheckpoint, checkpoints_key, decode_checkpoint, encode_checkpoint
from lora_affinity_plugin.kv.kv_events import BlockRemoved, EventBatch
from lora_affinity_plugin.kv.kv_subscriber import KVEventSubscriber
from test_kv_subscriber import BS, PAGE, _publish_until_live, _serving_publisher, _until, grouped, keys, stored

PROMPTS = [[i * 1000 + t for t in range(BS)] for i in range(200)]


def test_a_checkpoint_round_trips_and_the_restored_index_follows_removals():
    index = ExactIndex()
    prompt = list(range(48))
    index.apply("p", EventBatch(0.0, (stored([b"\x01" * 32, b"\x02" * 32], None, prompt[:32], "sql"),
                                      stored([7], 999, prompt[32:]))))  # a parent never seen: no key
    blocks = index.held_by_hash("p")
    data = encode_checkpoint(PodCheckpoint(41, 1733333333.123456, False, blocks.block_size, blocks.unresolved,
                                           blocks.by_hash))
    checkpoint = decode_checkpoint(data)
    assert (checkpoint.seq, checkpoint.ts, checkpoint.partial, checkpoint.block_size) == (41, 1733333333.123456,
                                                                                          False, BS)
    assert checkpoint.blocks == blocks.by_hash and checkpoint.blocks[7] is None and checkpoint.unresolved == 1
    restored = ExactIndex()
    restored.restore("p", checkpoint.blocks, checkpoint.block_size, checkpoint.unresolved)
    assert restored.match("p", keys(prompt[:32], "sql")) == 2 and restored.keys("p") == index.keys("p")
    change = restored.take_changes()["p"]
    assert change.cleared and change.added == index.keys("p")  # shared as the pod's whole set
    restored.apply("p", EventBatch(1.0, (BlockRemoved((b"\x02" * 32,)),)))
    assert restored.match("p", keys(prompt[:32], "sql")) == 1  # the engine's own hash still names the block
    for bad in (b"", b"\x93\x01\x02\x03", encode_checkpoint(PodCheckpoint(1, 0.0, False))[:-1],
                data.replace(b"C2", b"C9")):
        with pytest.raises(ValueError):
            decode_checkpoint(bad)


def test_a_checkpoint_keeps_the_kv_cache_group_it_follows_and_an_earlier_releases_is_read():
    """A hybrid model's index follows its full-attention group: a restored index still tells a sliding-window
    removal from the group's own; a C1 checkpoint (written before groups) restores with no group learned."""
    import msgspec

    index = ExactIndex()
    prompt = list(range(BS))
    index.apply("p", EventBatch(0.0, (grouped(stored([1], None, prompt), 1, "full_attention"),
                                      grouped(stored([1], None, prompt), 0, "sliding_window"))))
    blocks = index.held_by_hash("p")
    checkpoint = decode_checkpoint(encode_checkpoint(PodCheckpoint(3, 1.0, False, blocks.block_size, 0,
                                                                   blocks.by_hash, blocks.group, blocks.group_kind)))
    assert (checkpoint.group, checkpoint.group_kind) == (1, "full_attention")
    restored = ExactIndex()
    restored.restore("p", checkpoint.blocks, checkpoint.block_size, 0, False, checkpoint.group, checkpoint.group_kind)
    restored.apply("p", EventBatch(1.0, (BlockRemoved((1,), "GPU", 0),)))  # the window moved on
    assert restored.match("p", keys(prompt)) == 1
    earlier = msgspec.msgpack.encode(["C1", 3, 1.0, False, BS, 0, [1, keys(prompt)[0]]])
    old = decode_checkpoint(earlier)
    assert (old.seq, old.group, old.blocks) == (3, None, {1: keys(prompt)[0]})
    for group, kind in (("0", None), (1, 7)):  # a group that is no number, a kind that is no text
        damaged = msgspec.msgpack.encode(["C2", 3, 1.0, False, BS, 0, [], group, kind])
        with pytest.raises(ValueError, match="a damaged C2 checkpoint"):
            decode_checkpoint(damaged)


async def _follow_once(endpoints, checkpoint=None):
    """A subscriber started with `checkpoint`, run until its replay is done; returns it, stopped."""
    subscriber = KVEventSubscriber({"p": endpoints}, checkpoints={"p": checkpoint} if checkpoint else None)
    stop = asyncio.Event()
    task = asyncio.create_task(subscriber.run(stop))
    await asyncio.sleep(0)
    return subscriber, stop, task


async def test_a_checkpoint_is_resumed_only_on_the_server_it_was_taken_from():
    """The buffer holds 10 batches: the same server, 8 batches on, is resumed whole; a server restarted since, with
    fewer batches than the checkpoint or more, is joined afresh (its old blocks forgotten)."""
    publisher, replay_task, endpoints = _serving_publisher(10)
    try:
        first, stop, task = await _follow_once(endpoints)
        seq = await _publish_until_live(publisher, first.streams["p"], PROMPTS)
        for i in range(seq + 1, 30):
            publisher.publish([stored([10_000 + i], None, PROMPTS[i])])
        await _until(lambda: first.streams["p"].last_seq == 29)
        assert not first.streams["p"].partial
        checkpoint = decode_checkpoint(encode_checkpoint(first.checkpoint("p")))  # as Redis would hand it back
        stop.set()
        await task
        for i in range(30, 38):  # while nobody follows
            publisher.publish([stored([10_000 + i], None, PROMPTS[i])])

        fresh, stop, task = await _follow_once(endpoints)  # no checkpoint: the buffer's last 10 batches only
        await _until(lambda: fresh.streams["p"].last_seq == 37)
        assert fresh.streams["p"].partial and fresh.index.size("p") == 10
        assert fresh.index.snapshot()["p"].partial  # what the proxies are told
        stop.set()
        await task

        resumed, stop, task = await _follow_once(endpoints, checkpoint)
        stream = resumed.streams["p"]
        await _until(lambda: stream.last_seq == 37)
        assert stream.resumed and not stream.partial and stream.lost == 0
        assert [resumed.index.match("p", keys(PROMPTS[i])) for i in range(38)] == [1] * 38
        stop.set()
        await task

        publisher.restart()  # sequence 0 again: 3 batches, fewer than the checkpoint's 29
        for i in range(100, 103):
            publisher.publish([stored([20_000 + i], None, PROMPTS[i])])
        restarted, stop, task = await _follow_once(endpoints, checkpoint)
        stream = restarted.streams["p"]
        await _until(lambda: stream.last_seq == 3)  # AllBlocksCleared, then the three
        assert not stream.resumed and not stream.partial and restarted.index.snapshot()["p"].partial is False
        assert restarted.index.size("p") == 3 and restarted.index.match("p", keys(PROMPTS[0])) == 0
        stop.set()
        await task

        for i in range(103, 135):  # the restarted server passes the checkpoint's number: another batch 29
            publisher.publish([stored([20_000 + i], None, PROMPTS[i])])
        passed, stop, task = await _follow_once(endpoints, checkpoint)
        stream = passed.streams["p"]
        await _until(lambda: stream.last_seq == 35)
        assert not stream.resumed and stream.partial  # joined afresh: batch 0 is no longer buffered
        assert passed.index.match("p", keys(PROMPTS[0])) == 0 and passed.index.match("p", keys(PROMPTS[134])) == 1
        stop.set()
        await task
    finally:
        replay_task.cancel()
        publisher.close()


async def test_a_scraper_starting_after_every_scraper_was_down_resumes_from_the_last_holders_checkpoint():
    import fakeredis
    from page_server import serve_pages

    from lora_affinity_plugin.fleet.view import FleetView
    from lora_affinity_plugin.fleet.follower import Follower
    from lora_affinity_plugin.scraping.kv_follow import KVEventSharing
    from lora_affinity_plugin.scraping.worker import Scraper
    from lora_affinity_plugin.config.settings import build_settings

    publisher, replay_task, pod_endpoints = _serving_publisher(10)
    settings = build_settings({"scraper_lease_ms": 1000, "kv_events": True}, environ={})
    redis = fakeredis.aioredis.FakeRedis()
    async with serve_pages({"a": PAGE}) as url:
        pod = url("a")
        endpoints = {pod: pod_endpoints}
        scrapers = []

        def scraper():
            scrapers.append(Scraper(settings, [pod], redis, kv_events=KVEventSharing(endpoints)))
            return scrapers[-1]

        try:
            leader = scraper()
            await leader.scrape_once()
            stream = leader.kv_events.subscriber.streams[pod]
            seq = await _publish_until_live(publisher, stream, PROMPTS, between=leader.scrape_once)
            await leader.scrape_once()  # the term's first checkpoint is written by now, at batch `seq` or before
            for i in range(seq + 1, 30):
                publisher.publish([stored([10_000 + i], None, PROMPTS[i])])
            await _until(lambda: stream.last_seq == 29)
            left = decode_checkpoint((await redis.hgetall(checkpoints_key(settings.key_prefix)))[pod.encode()])
            assert left.seq <= seq  # an earlier scrape may have written it; the next is due in 10 s
            await leader.aclose()  # stopping, it writes where it stands
            left = decode_checkpoint((await redis.hgetall(checkpoints_key(settings.key_prefix)))[pod.encode()])
            assert left.seq == 29 and not left.partial
            for i in range(30, 38):  # every scraper is down
                publisher.publish([stored([10_000 + i], None, PROMPTS[i])])
            await asyncio.sleep(1.1)  # the lease lapses

            successor = scraper()
            await successor.scrape_once()
            assert successor.leader
            stream = successor.kv_events.subscriber.streams[pod]
            await _until(lambda: stream.last_seq == 37)
            assert stream.resumed and not stream.partial
            await successor.scrape_once()  # shares what it resumed
            proxy = Follower(settings, FleetView(settings), lambda: [pod], lambda s: None)
            await proxy.refresh(redis)  # the snapshot, then the change sets after it
            assert [proxy.fleet.held.match(pod, keys(PROMPTS[i])) for i in range(38)] == [1] * 38
            assert not proxy.fleet.held.partial(pod)  # resumed whole: its figures are exact
            written = decode_checkpoint((await redis.hgetall(checkpoints_key(settings.key_prefix)))[pod.encode()])
            assert written.seq == 37 and not written.partial  # its own term's first write
            await successor.aclose()

            await redis.delete(checkpoints_key(settings.key_prefix))
            await asyncio.sleep(1.1)
            without = scraper()  # no checkpoint: what the replay buffer holds, the pod partial
            await without.scrape_once()
            stream = without.kv_events.subscriber.streams[pod]
            await _until(lambda: stream.last_seq == 37)
            assert not stream.resumed and stream.partial and without.kv_events.subscriber.index.size(pod) == 10
            await without.scrape_once()  # shares it: the proxies learn the pod's figures are a floor
            proxy = Follower(settings, FleetView(settings), lambda: [pod], lambda s: None)
            await proxy.refresh(redis)
            assert proxy.fleet.held.partial(pod) and proxy.fleet.held.size(pod) == 10
            from prometheus_client import REGISTRY

            assert REGISTRY.get_sample_value("lora_affinity_kv_index_partial", {"pod": pod}) == 1  # on the dashboard
        finally:
            for s in scrapers:
                await s.aclose()
            replay_task.cancel()
            publisher.close()


async def test_a_damaged_checkpoint_or_redis_down_joins_the_pod_afresh(caplog):
    """What a scraper reads before following can be bad: a damaged entry (or another version's) is said and
    skipped, and Redis down leaves nothing to read; either way the pod is followed from its replay buffer."""
    import fakeredis
    import redis.exceptions

    from lora_affinity_plugin.scraping.kv_follow import KVEventSharing

    publisher, replay_task, endpoints = _serving_publisher(100)
    store = fakeredis.aioredis.FakeRedis()
    await store.hset(checkpoints_key("lora_affinity"), mapping={"p": b"not a checkpoint", "elsewhere": b"x"})

    class RedisDown:
        async def hgetall(self, key):
            raise redis.exceptions.ConnectionError("down")

    caplog.set_level("INFO", logger="lora_affinity.kv_events")
    try:
        for client in (store, RedisDown()):
            sharing = KVEventSharing({"p": endpoints})
            await sharing.begin(client, "lora_affinity", {"p"})
            stream = sharing.subscriber.streams["p"]
            publisher.publish([stored([10_000], None, PROMPTS[0])])
            await _until(lambda: stream.last_seq is not None)
            assert not stream.resumed and sharing.subscriber.index.match("p", keys(PROMPTS[0])) == 1
            await sharing.stop()
            publisher.restart()
        assert "KV-event checkpoint of p not used (unreadable checkpoint" in caplog.text
        assert "could not read the KV-event checkpoints (ConnectionError)" in caplog.text
    finally:
        replay_task.cancel()
        publisher.close()


async def test_kv_change_sets_and_snapshots_are_written_only_by_the_lease_holder():
    import fakeredis

    from lora_affinity_plugin.fleet.lease import fenced_write, lease_key

    client = fakeredis.aioredis.FakeRedis()
    await client.set(lease_key("lora_affinity"), "new-worker#7")
    stale = await fenced_write(client, "lora_affinity", "old-worker#6", "xadd", "{lora_affinity}:kv:changes",
                               {"e": "x", "n": 1, "c": b"\x00\x01"}, maxlen=100)
    assert stale is None and await client.xlen("{lora_affinity}:kv:changes") == 0
    written = await fenced_write(client, "lora_affinity", "new-worker#7", "xadd", "{lora_affinity}:kv:changes",
                                 {"e": "x", "n": 1, "c": b"\x00\x01"}, maxlen=100)
    assert written and await client.xlen("{lora_affinity}:kv:changes") == 1
    assert await fenced_write(client, "lora_affinity", "old-worker#6", "hset", "{lora_affinity}:kv:snapshot",
                              {"n": 1}) is None
    assert await fenced_write(client, "lora_affinity", "new-worker#7", "hset", "{lora_affinity}:kv:snapshot",
                              {"n": 1, "c": b"\xff"}) is not None
    assert await client.hget("{lora_affinity}:kv:snapshot", "c") == b"\xff"
