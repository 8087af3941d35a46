"""The scraper's port: /healthz answers while the process lives, /readyz only while it reaches Redis (and, leading,
writes its records), 404 elsewhere; a worker that cannot reach Redis past its lease period stops leading."""

import asyncio
import json

import httpx
from procs import free_port

from lora_affinity_plugin.scraping.worker import Scraper
from lora_affinity_plugin.scraping.scraper_http import readiness, serve
from lora_affinity_plugin.config.settings import build_settings

SETTINGS = build_settings({"scrape_interval_ms": 100, "scraper_lease_ms": 1000}, environ={})


def test_readiness_follows_redis_and_the_leaders_writes():
    scraper = Scraper(SETTINGS, ["http://127.0.0.1:1"])
    assert readiness(scraper, now=100.0)[0] is False  # never reached Redis
    scraper.redis_ok_at = 99.5
    assert readiness(scraper, now=100.0) == (True, {"ready": True, "role": "standby", "redis_reached_s_ago": 0.5,
                                                    "records_written_s_ago": None, "window_s": 1.0})
    scraper.leader = True
    assert readiness(scraper, now=100.0)[0] is False  # leading but never wrote
    scraper.written_at = 99.8
    assert readiness(scraper, now=100.0)[0] is True
    assert readiness(scraper, now=101.0)[0] is False  # Redis not reached for longer than the window


def test_the_port_serves_metrics_health_and_readiness_and_nothing_else():
    scraper = Scraper(SETTINGS, ["http://127.0.0.1:1"])
    port = free_port()
    server = serve(scraper, port, "127.0.0.1")
    try:
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/healthz").status_code == 200
        assert "lora_affinity_" in httpx.get(base + "/metrics").text
        not_ready = httpx.get(base + "/readyz")
        assert not_ready.status_code == 503 and json.loads(not_ready.text)["ready"] is False
        for path in ("/", "/ready", "/health", "/metricsx"):
            assert httpx.get(base + path).status_code == 404, path
    finally:
        server.shutdown()
        server.server_close()


async def test_a_leader_that_cannot_reach_redis_past_its_lease_stops_leading(monkeypatch):
    import lora_affinity_plugin.scraping.worker as scraper_module

    scraper = Scraper(SETTINGS, ["http://127.0.0.1:1"], redis_client=object())
    scraper.leader, scraper.redis_ok_at = True, asyncio.get_running_loop().time()

    async def unreachable(*args, **kwargs):
        raise ConnectionError("Redis is down")

    monkeypatch.setattr(scraper_module, "lease_and_write", unreachable)
    assert await scraper._lease() is True  # within its lease period it still holds it
    scraper.redis_ok_at -= 1.5
    assert await scraper._lease() is False and scraper.leader is False
    assert scraper_module.SCRAPER_LEADER._value.get() == 0
