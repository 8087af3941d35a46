"""In-flight counts through a real proxy: up while a request runs, back to zero after every ending.

Real processes: redis-server, two fake vLLM pods, the scraper and a `litellm --config` proxy with
retries on. The counts are read where the other proxies read them: the proxy's in-flight table in
Redis (`{prefix}:inflight:<process>`), written every refresh interval.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis
from procs import (
    MASTER_KEY,
    child_env,
)
from stacks import Stack

REFRESH_S = 0.1
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


class Running:
    def __init__(self, redis_port: int, pods: list[int], proxy_port: int, config: Path):
        self.config = config
        self.redis = redis.Redis(port=redis_port)
        self.pods = pods
        self.proxy = f"http://127.0.0.1:{proxy_port}"
        self.http = httpx.Client(timeout=30, headers={"Authorization": f"Bearer {MASTER_KEY}"})

    def behave(self, *behaviours: dict) -> None:
        for port, behaviour in zip(self.pods, behaviours):
            self.http.post(f"http://127.0.0.1:{port}/_control/behaviour", json=behaviour).raise_for_status()
            self.http.post(f"http://127.0.0.1:{port}/_control/reset").raise_for_status()

    def served(self) -> list[int]:
        return [len(self.http.get(f"http://127.0.0.1:{p}/_control/requests").json()) for p in self.pods]

    def inflight(self) -> int:
        """Requests in flight in all proxies' shared tables (what every peer sees)."""
        total = 0
        for member in self.redis.zrange("{lora_affinity}:inflight:members", 0, -1):
            raw = self.redis.get(b"{lora_affinity}:inflight:" + member)
            if raw:
                total += sum(entry["n"] for entry in json.loads(raw)["pods"].values())
        return total

    def wait_inflight(self, want: int, within: float = 3.0) -> float:
        """Seconds until the shared count equals `want`; fails the test if it never does."""
        started = time.monotonic()
        while time.monotonic() - started < within:
            if self.inflight() == want:
                return time.monotonic() - started
            time.sleep(0.02)
        raise AssertionError(f"in-flight count is {self.inflight()}, expected {want} within {within} s")

    def body(self, path: str, stream: bool) -> dict:
        body = {"model": "sql-lora", "max_tokens": 5, "stream": stream}
        if path == CHAT:
            return {**body, "messages": [{"role": "user", "content": "hi"}]}
        return {**body, "prompt": "hi"}

    def post(self, path: str, stream: bool = False) -> httpx.Response:
        return self.http.post(self.proxy + path, json=self.body(path, stream))

    def in_background(self, path: str) -> threading.Thread:
        thread = threading.Thread(target=self.post, args=(path,), daemon=True)
        thread.start()
        return thread


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with Stack(tmp_path_factory.mktemp("inflight")) as s:
        redis_port = s.redis()
        pods = s.fake_pods(2)
        path = s.config(pods, redis_port, edit=lambda c: c.update(router_settings={"num_retries": 2, "retry_after": 0}),
                        scrape_interval_ms=int(REFRESH_S * 1000))
        s.scraper(path)
        _, url = s.proxy(path, env=child_env(LORA_AFFINITY_LOG_LEVEL="DEBUG"))
        stack = Running(redis_port, pods, int(url.rsplit(":", 1)[1]), path)
        stack.behave({}, {})
        assert stack.post(TEXT).status_code == 200  # the plugin is installed and the table exists
        stack.wait_inflight(0)
        yield stack


@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_counted_while_running_and_zero_after_success(stack, path):
    stack.behave({"delay": 1.0}, {"delay": 1.0})
    thread = stack.in_background(path)
    stack.wait_inflight(1)
    thread.join()
    stack.wait_inflight(0)


@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_zero_after_a_stream_ends(stack, path):
    stack.behave({"chunks": 10, "chunk_delay": 0.1}, {"chunks": 10, "chunk_delay": 0.1})
    with stack.http.stream("POST", stack.proxy + path, json=stack.body(path, True)) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        next(lines)
        stack.wait_inflight(1)
        assert sum(1 for line in lines if line.startswith("data:")) >= 9
    stack.wait_inflight(0)


@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_zero_after_the_client_leaves_mid_stream(stack, path):
    stack.behave({"chunks": 50, "chunk_delay": 0.1}, {"chunks": 50, "chunk_delay": 0.1})
    with stack.http.stream("POST", stack.proxy + path, json=stack.body(path, True)) as response:
        lines = response.iter_lines()  # held: a dropped line iterator closes the response
        next(lines)
        stack.wait_inflight(1)
    stack.wait_inflight(0)


@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_zero_after_the_client_leaves_before_the_first_token(stack, path):
    # LiteLLM notices a chat stream abandoned before its first token only when that token arrives.
    stack.behave({"delay": 1.0, "chunks": 50, "chunk_delay": 0.1}, {"delay": 1.0, "chunks": 50, "chunk_delay": 0.1})
    with pytest.raises(httpx.ReadTimeout):
        with stack.http.stream("POST", stack.proxy + path, json=stack.body(path, True), timeout=0.5) as response:
            next(response.iter_lines())
    stack.wait_inflight(0, within=4.0)


@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_zero_after_an_upstream_error(stack, path):
    stack.behave({"fail": 10}, {"fail": 10})
    assert stack.post(path).status_code >= 500
    stack.wait_inflight(0)
    assert sum(stack.served()) == 3  # the first try and two retries


@pytest.mark.parametrize("stream", [False, True])
def test_a_retry_moves_the_count_and_ends_at_zero(stack, stream):
    stack.behave({"fail": 1}, {"fail": 1})  # each pod fails once: the third try succeeds
    response = stack.post(CHAT, stream=stream)
    assert response.status_code == 200, response.text
    stack.wait_inflight(0)


def test_many_concurrent_mixed_endings_end_at_zero(stack):
    stack.behave({"delay": 0.2, "chunks": 5, "chunk_delay": 0.05}, {"delay": 0.2, "chunks": 5, "chunk_delay": 0.05})
    threads = [stack.in_background(CHAT if i % 2 else TEXT) for i in range(20)]
    peak = 0
    while any(t.is_alive() for t in threads):
        peak = max(peak, stack.inflight())
        time.sleep(0.02)
    assert peak >= 2, "concurrent requests were not counted"
    stack.wait_inflight(0)


def test_status_shows_the_requests_in_flight(stack):
    # The requests must outlast `lora-affinity status` starting up and reading Redis, which on a loaded machine
    # (CI runs four suites on two cores) took more than 3 s, and once more than 12: when they ended before status
    # read them, the same check runs again with requests that last longer.
    for delay in (12.0, 45.0):
        stack.behave({"delay": delay}, {"delay": delay})
        threads = [stack.in_background(TEXT) for _ in range(2)]
        stack.wait_inflight(2)
        out = subprocess.run([sys.executable, "-m", "lora_affinity_plugin.ops.cli", "status", "--json", "--config",
                              str(stack.config)], capture_output=True, text=True, timeout=60)
        ended_first = not any(thread.is_alive() for thread in threads)
        status = json.loads(out.stdout)
        assert status["proxies_sharing"] == 1
        shown = sum(row["inflight"] for row in status["pods"])
        stack.behave({"release": True}, {"release": True})  # read: the requests need not wait out their delay
        for thread in threads:
            thread.join()
        stack.wait_inflight(0)
        if shown == 2 or not ended_first:
            break
    assert shown == 2
