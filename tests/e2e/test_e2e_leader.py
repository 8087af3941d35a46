"""One scraper at a time, with real processes: two workers, one lease; failover and fencing."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import redis
from procs import (
    Proc,
    child_env,
)
from stacks import Stack

LEASE_MS = 400


@pytest.fixture
def stack(tmp_path):
    with Stack(tmp_path) as s:
        redis_port = s.redis()
        pods = s.fake_pods(2)
        config = s.config(pods, redis_port, scraper_lease_ms=LEASE_MS)
        workers = [s.scraper(config, name=f"scraper-{i}") for i in range(2)]
        time.sleep(1.0)
        yield {"config": config, "workers": workers, "redis": redis.Redis(port=redis_port)}


def status(stack) -> dict:
    out = subprocess.run([sys.executable, "-m", "lora_affinity_plugin.ops.cli", "status", "--json", "--config",
                          str(stack["config"])], capture_output=True, text=True, env=child_env(), timeout=30)
    return json.loads(out.stdout)


def leader_of(stack) -> tuple[Proc, Proc]:
    holder = status(stack)["leader"]
    pids = [w.popen.pid for w in stack["workers"]]
    leader = next(w for w, pid in zip(stack["workers"], pids) if f":{pid}:" in holder)
    return leader, next(w for w in stack["workers"] if w is not leader)


def test_a_killed_leader_is_replaced_within_two_lease_periods(stack):
    leader, follower = leader_of(stack)
    leader.popen.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    lease = "{lora_affinity}:scraper:lease"  # read directly: a `status` process takes longer than a lease
    while f":{follower.popen.pid}:" not in (stack["redis"].get(lease) or b"").decode() and time.monotonic() - killed < 5:
        time.sleep(0.02)
    assert time.monotonic() - killed < 2 * LEASE_MS / 1000 + 0.3
    time.sleep(0.3)
    assert [p["state"] for p in status(stack)["pods"]] == ["fresh", "fresh"]


def test_a_paused_leader_cannot_overwrite_newer_data(stack):
    leader, follower = leader_of(stack)
    leader.popen.send_signal(signal.SIGSTOP)
    time.sleep(2 * LEASE_MS / 1000 + 0.3)
    new_holder = status(stack)["leader"]
    assert f":{follower.popen.pid}:" in new_holder
    leader.popen.send_signal(signal.SIGCONT)  # it wakes up believing it still leads
    for _ in range(10):
        time.sleep(0.1)
        data = status(stack)
        assert data["leader"] == new_holder
        assert all(p["scraper"] == new_holder for p in data["pods"])  # no record from the paused leader
    assert "lost the scraper lease" in leader.log()


def test_status_exits_3_for_scripts_once_no_scraper_leads_and_no_record_is_fresh(stack):
    def exit_code() -> int:
        return subprocess.run([sys.executable, "-m", "lora_affinity_plugin.ops.cli", "status", "--config",
                               str(stack["config"])], capture_output=True, text=True, env=child_env(),
                              timeout=30).returncode

    assert exit_code() == 0
    for worker in stack["workers"]:
        worker.popen.send_signal(signal.SIGSTOP)
    try:
        time.sleep(LEASE_MS / 1000 + 2.5)  # the lease lapses; records pass stale_after_ms (2 s)
        assert exit_code() == 3
        stack["redis"].flushdb()  # the records expired too: nobody looked at the pods, nobody says they are down
        assert {p["state"] for p in status(stack)["pods"]} == {"unknown"}
    finally:
        for worker in stack["workers"]:
            worker.popen.send_signal(signal.SIGCONT)
