"""Two proxy processes share their in-flight tables through Redis (fakeredis runs the same Lua)."""

import time

import fakeredis
import pytest

from lora_affinity_plugin.fleet.view import FleetView
from lora_affinity_plugin.fleet.follower import Follower
from lora_affinity_plugin.routing.podstate import PodMetrics
from lora_affinity_plugin.config.settings import build_settings
from lora_affinity_plugin.fleet.store import PodRecord, pod_key

S = build_settings({"scrape_interval_ms": 100})


def follower(settings=S) -> Follower:
    return Follower(settings, FleetView(settings), lambda: ["a", "b"], lambda s: None)


async def publish_records(client, at):
    for pod in ("a", "b"):
        record = PodRecord(pod, at, PodMetrics(num_requests_waiting=0, num_requests_running=0))
        await client.set(pod_key(S, pod), record.to_json())


async def test_a_peers_requests_since_the_scrape_reach_the_other_proxy_and_leave_when_they_end():
    client = fakeredis.aioredis.FakeRedis()
    now = time.time()
    await publish_records(client, now)
    one, two = follower(), follower()
    for f in (one, two):
        await f.refresh(client)
    one.fleet.note_dispatch("a", "x", now + 0.01, call_id="c1")
    one.fleet.note_dispatch("a", "x", now + 0.02, call_id="c2")
    await one.refresh(client)  # publishes
    await two.refresh(client)  # learns its peer (members list) ...
    await two.refresh(client)  # ... and reads its table
    a, b = two.fleet.candidates(["a", "b"], now + 0.05)
    assert (a.waiting, b.waiting) == (2, 0) and "x" in a.active_adapters
    assert two.fleet.peer_counts == {"a": 2}
    one.fleet.end("c1")
    one.fleet.end("c2")
    await one.refresh(client)
    await two.refresh(client)
    assert [c.waiting for c in two.fleet.candidates(["a", "b"], now + 0.05)] == [0, 0]
    assert two.fleet.peer_counts == {}


async def test_a_dead_process_counts_vanish_when_its_key_expires():
    client = fakeredis.aioredis.FakeRedis()
    now = time.time()
    await publish_records(client, now)
    dead, alive = follower(), follower()
    dead.fleet.update({})
    await dead.refresh(client)
    dead.fleet.note_dispatch("a", "x", now + 0.01, call_id="c1")
    await dead.refresh(client)
    await alive.refresh(client)
    await alive.refresh(client)
    assert alive.fleet.peer_counts == {"a": 1}
    await client.delete(f"{{{S.key_prefix}}}:inflight:{dead.process}")  # what PX expiry does
    await alive.refresh(client)
    assert alive.fleet.peer_counts == {}


@pytest.mark.parametrize("share", [True, False])
async def test_sharing_can_be_switched_off(share):
    settings = build_settings({"scrape_interval_ms": 100, "share_inflight": share})
    client = fakeredis.aioredis.FakeRedis()
    now = time.time()
    await publish_records(client, now)
    one, two = follower(settings), follower(settings)
    await one.refresh(client)
    one.fleet.note_dispatch("a", "x", now + 0.01, call_id="c1")
    for _ in range(2):
        await one.refresh(client)
        await two.refresh(client)
    assert two.fleet.candidates(["a"], now + 0.05)[0].waiting == (1 if share else 0)


async def test_the_snapshot_age_grows_while_no_record_can_be_read_whatever_the_cause():
    """Records read: their age. Then Redis down, or the records expired: the age grows from there, never frozen."""
    import asyncio

    from lora_affinity_plugin.telemetry.metrics import REDIS_UP

    client = fakeredis.aioredis.FakeRedis()
    await publish_records(client, time.time() - 0.5)
    proxy = follower()
    await proxy.refresh(client)
    assert 0.5 <= proxy.snapshot_age_s() < 1.5 and REDIS_UP._value.get() == 1
    await client.flushall()  # the scraper stopped and the records expired
    await asyncio.sleep(0.3)
    await proxy.refresh(client)
    assert proxy.snapshot_age_s() >= 0.8

    class Down:
        async def eval(self, *args, **kwargs):
            raise ConnectionError("Redis is down")

    await asyncio.sleep(0.3)
    await proxy.refresh(Down())
    assert proxy.snapshot_age_s() >= 1.1 and REDIS_UP._value.get() == 0
    await publish_records(client, time.time())
    await proxy.refresh(client)  # a fresh record again
    assert proxy.snapshot_age_s() < 0.5 and REDIS_UP._value.get() == 1
    hosted_only = Follower(S, FleetView(S), lambda: [], lambda s: None)  # no model-server pod: nothing is missing
    await asyncio.sleep(0.2)
    assert hosted_only.snapshot_age_s() == 0.0
