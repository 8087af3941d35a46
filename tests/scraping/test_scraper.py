"""The scraper: one record per pod per cycle, bad pods marked alone, one pooled client, Redis down survived."""

import asyncio
import time
import json

import fakeredis
import pytest
from page_server import REFUSED, serve_pages

from lora_affinity_plugin.scraping.worker import Scraper
from lora_affinity_plugin.config.settings import build_settings
from lora_affinity_plugin.fleet.store import PodRecord, pod_key
from records import read_records

GOOD = 'vllm:num_requests_running{model_name="m"} 3\nvllm:num_requests_waiting{model_name="m"} 1\n'


@pytest.fixture
def redis():
    return fakeredis.aioredis.FakeRedis()


@pytest.fixture
async def PODS():
    """Three pods serving a good page."""
    async with serve_pages({name: GOOD for name in "abc"}) as url:
        yield [url(name) for name in "abc"]


async def test_writes_one_record_per_pod_with_a_ttl(redis, PODS):
    settings = build_settings({"metrics_ttl_ms": 5000})
    scraper = Scraper(settings, PODS, redis)
    await scraper.scrape_once()
    records = await read_records(redis, settings, PODS)
    assert {p: r.metrics.num_requests_running for p, r in records.items()} == {p: 3 for p in PODS}
    assert 0 < await redis.pttl(pod_key(settings, PODS[0])) <= 5000
    assert json.loads(await redis.get(pod_key(settings, PODS[0])))["error"] is None


async def test_a_bad_pod_is_marked_with_its_reason_and_the_others_are_untouched(redis):
    # A 1 s timeout: at 200 ms a busy 2-core machine (the suite beside it) once timed the good page out too.
    settings = build_settings({"scrape_timeout_ms": 1000, "max_page_bytes": 4096})
    pages = {"a": GOOD, "b": "garbage \x00\xff", "c": 500, "d": "hang", "f": GOOD + "#" * 10_000}
    async with serve_pages(pages) as url:
        pods = {name: url(name) for name in pages} | {"e": REFUSED}
        scraper = Scraper(settings, list(pods.values()), redis)
        await asyncio.wait_for(scraper.scrape_once(), 5)
        await scraper.aclose()
    records = {name: r for name, r in zip(pods, (await read_records(redis, settings, list(pods.values()))).values())}
    assert records["a"].ok
    assert "not a vLLM metrics page" in records["b"].error
    assert records["c"].error == "HTTP 500 from /c/metrics"
    assert records["d"].error == "timed out"
    assert "ClientConnectorError" in records["e"].error
    assert "max_page_bytes" in records["f"].error


async def test_one_pooled_session_across_cycles_recreated_when_closed(redis, PODS):
    scraper = Scraper(build_settings({}), PODS, redis)
    await scraper.scrape_once()
    first = scraper._http.get()
    await scraper.scrape_once()
    assert scraper._http.get() is first
    await first.close()
    assert all(r.ok for r in await scraper.scrape_once())
    assert scraper._http.get() is not first
    await scraper.aclose()
    assert scraper._http._session is None


async def test_redis_down_is_survived_and_logged_once(caplog, PODS):
    class Down:
        async def eval(self, *args):
            raise ConnectionError("redis is down")

        async def aclose(self):
            pass

    # (a lease long enough for three scrapes on a loaded CI machine: one second was not, once)
    scraper = Scraper(build_settings({"scraper_lease_ms": 10_000}), PODS, Down())
    assert await scraper.scrape_once() == []  # no lease can be taken: nothing to scrape for
    # A leader that loses Redis keeps scraping and trying to write while its lease could still be held...
    scraper.leader, scraper.redis_ok_at = True, time.monotonic()
    for _ in range(3):
        records = await scraper.scrape_once()
    assert all(r.ok for r in records) and scraper.cycles == 3
    assert sum("cannot write to Redis" in r.message for r in caplog.records) == 1
    scraper.redis_ok_at -= scraper.settings.scraper_lease_ms / 1000 + 0.1  # ...and leads no more past it
    await scraper.scrape_once()  # its write fails once more, past the lease period: it steps down
    assert not scraper.leader and await scraper.scrape_once() == [] and scraper.cycles == 4


async def test_only_the_lease_holder_scrapes_and_a_stale_leader_is_fenced(redis, PODS):
    settings = build_settings({"scraper_lease_ms": 1000})  # (long enough for a loaded CI machine's two scrapes)
    first = Scraper(settings, PODS, redis)
    second = Scraper(settings, PODS, redis)
    assert len(await first.scrape_once()) == 3 and first.leader
    assert await second.scrape_once() == [] and not second.leader and second.holder == first.holder
    await asyncio.sleep(1.1)  # the first worker pauses past its lease
    assert len(await second.scrape_once()) == 3 and second.leader
    assert second.holder.endswith("#2")  # a new fencing token
    await first.scrape_once()  # wakes up, still believes it leads: its write is refused
    assert not first.leader
    records = await read_records(redis, settings, PODS)
    assert all(r.scraper == second.holder for r in records.values())


async def test_run_keeps_the_interval_and_stops(redis, PODS):
    settings = build_settings({"scrape_interval_ms": 20})
    scraper = Scraper(settings, PODS, redis)
    stop = asyncio.Event()
    task = asyncio.create_task(scraper.run(stop))
    await asyncio.sleep(0.25)
    stop.set()
    await asyncio.wait_for(task, 1)
    assert 6 <= scraper.cycles <= 14


def test_record_round_trip():
    from lora_affinity_plugin.scraping.parsing import parse_metrics

    record = PodRecord("http://a:8000", 12.5, parse_metrics(GOOD))
    assert PodRecord.from_json(record.to_json()) == record


async def test_a_standby_with_kv_events_survives_redis_down_and_follows_nothing(caplog, PODS):
    from lora_affinity_plugin.scraping.kv_follow import KVEventSharing
    from lora_affinity_plugin.kv.kv_subscriber import EventEndpoints

    class Down:
        async def eval(self, *args):
            raise ConnectionError("redis is down")

        async def mget(self, *args):
            raise ConnectionError("redis is down")

        async def aclose(self):
            pass

    sharing = KVEventSharing({PODS[0]: EventEndpoints("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")})
    scraper = Scraper(build_settings({"kv_events": True}, environ={}), PODS, Down(), kv_events=sharing)
    for _ in range(3):
        assert await scraper.scrape_once() == []  # no lease, no standby role: nothing raised, nothing followed
    assert sharing.subscriber is None
    assert sum("cannot write to Redis" in r.message for r in caplog.records) == 1
    await scraper.aclose()
