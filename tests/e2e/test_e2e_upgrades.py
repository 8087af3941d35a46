"""Rolling upgrades and failover, with real processes: format 1 and format 2 share one Redis both ways, a
new scraper starts from the rates the last one learned, and a page read in part keeps its pod routed.

Real processes: redis-server, simulated vLLM replicas, two scraper workers (one lease), a `litellm
--config` proxy logging its decisions. Format 1 is the record format before records carried `v`
(tests/record_format1.py): its reader is run on what the scrapers write, its writer feeds the proxy.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import record_format1
import redis as redis_lib
from procs import MASTER_KEY, child_env
from stacks import Stack

from lora_affinity_plugin.config.settings import build_settings
from lora_affinity_plugin.fleet.store import PodRecord, pod_key
from lora_affinity_plugin.scraping.parsing import parse_metrics

ADAPTERS = ["sql-lora", "tweet-summary", "chat-lora"]
SETTINGS = build_settings({})


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with Stack(tmp_path_factory.mktemp("upgrades")) as s:
        redis_port = s.redis()
        pods = s.sim(2, "--speed", "10", "--mean-output-tokens", "20", "--warm-adapters", ",".join(ADAPTERS))
        path = s.config(pods, redis_port, scrape_interval_ms=100, scraper_lease_ms=400)
        workers = [s.scraper(path, name=f"scraper-{i}") for i in range(2)]
        proxy, url = s.proxy(path, env=child_env(LORA_AFFINITY_LOG_LEVEL="DEBUG"))
        yield {"url": url, "proxy": proxy, "workers": workers,
               "redis": redis_lib.Redis(port=redis_port), "pods": [f"http://127.0.0.1:{p}" for p in pods]}


def _send(url: str, count: int, clients: int = 4) -> Counter:
    """`count` completions through the proxy; the status codes."""
    def one(i: int) -> int:
        with httpx.Client(timeout=30) as http:
            return http.post(url + "/v1/completions", headers={"Authorization": f"Bearer {MASTER_KEY}"},
                             json={"model": ADAPTERS[i % 3], "prompt": "hello " * 20, "max_tokens": 12}).status_code

    with ThreadPoolExecutor(clients) as pool:
        return Counter(pool.map(one, range(count)))


def _raw_records(stack) -> list[bytes]:
    return [raw for raw in stack["redis"].mget([pod_key(SETTINGS, p) for p in stack["pods"]]) if raw is not None]


def test_a_format_1_proxy_reads_what_the_new_scraper_writes(stack):
    assert _send(stack["url"], 30) == {200: 30}
    for _ in range(20):
        for raw in _raw_records(stack):
            old = record_format1.read(raw)  # raises where a format 1 proxy would have dropped the record
            new = PodRecord.from_json(raw)
            assert old["metrics"] == new.metrics and old["scraped_at"] == new.scraped_at and new.metrics is not None
        time.sleep(0.1)


def test_a_new_scraper_starts_from_the_rates_the_last_one_learned(stack):
    assert _send(stack["url"], 60) == {200: 60}  # traffic, so the histograms teach the holder each pod's rates
    before = [PodRecord.from_json(raw) for raw in _raw_records(stack)]
    assert len(before) == 2 and all(r.rates is not None and r.rates.learned for r in before), before
    holder = before[0].scraper
    leader = next(w for w in stack["workers"] if f":{w.popen.pid}:" in holder)
    leader.stop(signal.SIGKILL)
    first: dict[str, PodRecord] = {}
    deadline = time.monotonic() + 5
    while len(first) < 2 and time.monotonic() < deadline:  # each pod's first record by the new holder
        for record in map(PodRecord.from_json, _raw_records(stack)):
            if record.scraper != holder:
                first.setdefault(record.pod, record)
        time.sleep(0.01)
    assert len(first) == 2, "no other worker took the lease"
    for record in first.values():
        assert record.rates is not None and record.rates.learned, record


def test_a_page_with_one_malformed_family_keeps_its_pod_routed(stack):
    garbled = stack["pods"][0]
    httpx.post(garbled + "/control", json={"garble": "vllm:kv_cache_usage_perc"}).raise_for_status()
    try:
        deadline = time.monotonic() + 30  # a safety net: the scraper reads the page every 100 ms
        while time.monotonic() < deadline:
            record = PodRecord.from_json(stack["redis"].get(pod_key(SETTINGS, garbled)))
            if record.degraded:
                break
            time.sleep(0.05)
        assert record.metrics is not None and any("kv_cache_usage_perc" in d for d in record.degraded), record
        mark = len(stack["proxy"].log())
        assert _send(stack["url"], 60) == {200: 60}
        decisions = [line for line in stack["proxy"].log()[mark:].splitlines() if " -> " in line]
        assert sum(garbled in line.split(" -> ", 1)[1].split(" ", 1)[0] for line in decisions) > 0, decisions[-5:]
    finally:
        httpx.post(garbled + "/control", json={"garble": ""})


def test_the_new_proxy_routes_on_records_a_format_1_scraper_writes(stack):
    for worker in stack["workers"]:
        worker.stop()
    stop = threading.Event()

    def format_1_scraper() -> None:  # what the scraper before format 2 wrote, every 100 ms
        client = redis_lib.Redis(port=stack["redis"].connection_pool.connection_kwargs["port"])
        while not stop.is_set():
            for pod in stack["pods"]:
                page = httpx.get(pod + "/metrics").text
                client.set(pod_key(SETTINGS, pod), record_format1.write(pod, time.time(), parse_metrics(page)), px=10_000)
            stop.wait(0.1)

    writer = threading.Thread(target=format_1_scraper, daemon=True)
    writer.start()
    try:
        time.sleep(0.5)
        mark = len(stack["proxy"].log())
        assert _send(stack["url"], 60) == {200: 60}
        log = stack["proxy"].log()[mark:]
        assert log.count(" -> ") >= 60 and "routing by metrics unavailable" not in log
    finally:
        stop.set()
        writer.join()
