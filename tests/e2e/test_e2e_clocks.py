"""The scraper's clock 3 s ahead of, then 3 s behind, the proxy's and Redis's: routing holds.

Real processes: redis-server, simulated vLLM replicas, a `litellm --config` proxy, and the scraper run
under Debian's `faketime` (its wall clock shifted; its monotonic clock, which asyncio sleeps by, left
alone). Records are stamped on Redis's clock, so the proxy sees them fresh whichever way the scraper's
clock is off: every request is routed by the rules, none falls back. How much each skew completes beside
an unskewed scraper is a benchmark's question, not a test's: `bench-tools/skewed_clocks.py`.
"""

from __future__ import annotations

import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis as redis_lib
from procs import MASTER_KEY, Proc, child_env
from stacks import Stack

from lora_affinity_plugin.config.settings import build_settings
from lora_affinity_plugin.fleet.store import PodRecord, pod_key

ADAPTERS = ["sql-lora", "tweet-summary", "chat-lora", "code-lora"]
REQUESTS = 60
CLIENTS = 6

if shutil.which("faketime") is None:  # .ci/run installs it; a machine without it cannot run this module
    pytest.fail("faketime is not installed (Debian package faketime; .ci/run installs it)", pytrace=False)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with Stack(tmp_path_factory.mktemp("clocks")) as s:
        redis_port = s.redis()
        pods = s.sim(3, "--speed", "10", "--max-loras", "2", "--mean-output-tokens", "20")
        path = s.config(pods, redis_port, scrape_interval_ms=100)
        proxy, url = s.proxy(path, env=child_env(LORA_AFFINITY_LOG_LEVEL="DEBUG"))
        yield {"config": path, "tmp": s.tmp, "proxy": proxy, "url": url,
               "redis": redis_lib.Redis(port=redis_port), "pods": [f"http://127.0.0.1:{p}" for p in pods]}


def _scraper(stack, skew: str) -> Proc:
    args = [sys.executable, "-m", "lora_affinity_plugin.ops.cli", "scrape", "--config", str(stack["config"])]
    if skew:
        args = ["faketime", "-f", skew, *args]
    return Proc(f"scraper{skew}", args, stack["tmp"], env=child_env(FAKETIME_DONT_FAKE_MONOTONIC="1"))


def _record_offsets(stack) -> list[float]:
    """How far each pod's record's scrape time is from Redis's clock now (seconds)."""
    client = stack["redis"]
    seconds, micros = client.time()
    now = seconds + micros / 1e6
    raws = client.mget([pod_key(build_settings({}), pod) for pod in stack["pods"]])
    return [now - PodRecord.from_json(raw).scraped_at for raw in raws if raw is not None]


def _holders(stack) -> set[str]:
    """Which scraper (`worker#token`) wrote each pod's record now; a set of as many entries as records."""
    raws = stack["redis"].mget([pod_key(build_settings({}), pod) for pod in stack["pods"]])
    return {f"{pod}|{PodRecord.from_json(raw).scraper}" for pod, raw in zip(stack["pods"], raws) if raw is not None}


def _load(url: str) -> list[int]:
    """REQUESTS completions from CLIENTS clients at a time; their statuses."""
    def one(i: int) -> int:
        with httpx.Client(timeout=30) as http:
            return http.post(url + "/v1/completions", headers={"Authorization": f"Bearer {MASTER_KEY}"},
                             json={"model": ADAPTERS[i % len(ADAPTERS)], "prompt": "hi", "max_tokens": 16}).status_code

    with ThreadPoolExecutor(CLIENTS) as pool:
        return list(pool.map(one, range(REQUESTS)))


def _until_the_proxy_decides(stack) -> None:
    """One request at a time until the proxy's rules decide one. A proxy that has read no record yet (the first
    phase: records appear only with the first scraper) leaves a group to LiteLLM until its next refresh, without a
    decision or a fallback line; the load must start after that, or a request or two go uncounted."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        mark = len(stack["proxy"].log())
        with httpx.Client(timeout=30) as http:
            http.post(stack["url"] + "/v1/completions", headers={"Authorization": f"Bearer {MASTER_KEY}"},
                      json={"model": ADAPTERS[0], "prompt": "hi", "max_tokens": 1})
        settle = time.monotonic() + 2
        while time.monotonic() < settle:
            if " -> " in stack["proxy"].log()[mark:]:
                return
            time.sleep(0.05)
    raise AssertionError("the proxy never routed a request by its rules")


def _phase(stack, skew: str) -> dict:
    """The scraper's clock `skew` off (faketime's form, "" for none): records' offsets from Redis's clock, before
    and after a load of REQUESTS, the load's statuses, and the proxy's decisions and fallbacks meanwhile."""
    before = _holders(stack)
    scraper = _scraper(stack, skew)
    try:
        deadline = time.monotonic() + 60  # a safety net: the previous lease (1 s) runs out, this one takes it
        while time.monotonic() < deadline and (len(now := _holders(stack)) < 3 or now & before):
            time.sleep(0.1)
        assert len(now) == 3 and not now & before, f"no record by the new scraper: {now}"
        _until_the_proxy_decides(stack)
        offsets = _record_offsets(stack)
        mark = len(stack["proxy"].log())
        statuses = _load(stack["url"])
        offsets_after = _record_offsets(stack)
        settle = time.monotonic() + 5  # a decision's log line can reach the file just after its response
        while (log := stack["proxy"].log()[mark:]).count(" -> ") < REQUESTS and time.monotonic() < settle:
            time.sleep(0.1)
    finally:
        scraper.stop()
    return {"statuses": statuses, "offsets": offsets + offsets_after, "decisions": log.count(" -> "),
            "fallbacks": log.count("routing by metrics unavailable")}


SKEW_S = 3.0


def test_routing_holds_with_the_scrapers_clock_3_s_ahead_and_3_s_behind(stack):
    unskewed = None
    for skew in ("", f"+{SKEW_S:g}s", f"-{SKEW_S:g}s"):
        phase = _phase(stack, skew)
        ages = [abs(o) for o in phase["offsets"]]
        assert len(ages) == 6, (skew, phase)
        if unskewed is None:  # how old records are when read, with every clock agreeing: the yardstick
            unskewed = max(ages)
        assert max(ages) < unskewed + SKEW_S / 2, (skew, unskewed, phase)  # not off by the skew
        assert phase["statuses"] == [200] * REQUESTS, (skew, phase)
        assert phase["decisions"] == REQUESTS and phase["fallbacks"] == 0, (skew, phase)
