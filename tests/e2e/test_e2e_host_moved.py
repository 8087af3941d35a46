"""A LiteLLM whose router no longer takes a custom strategy where the plugin puts it: one error line, LiteLLM's
own routing serves every request, and the plugin opens no Redis connection again and again.

Real processes: redis-server, simulated vLLM replicas, the scraper and a `litellm --config` proxy whose
first callback (`host_moved.py`, written beside its config) turns the router's strategy registration
into a no-op, as a release that moved that internal would.
"""

from __future__ import annotations

import time

import httpx
import pytest
import redis as redis_lib
from procs import MASTER_KEY
from stacks import Stack

OBSERVED_S = 12.0
"""Long enough for 60 of the watcher's checks (every 0.2 s) and 24 requests: a repeated error, or a connection
opened per check, would show."""

HOST_MOVED = '''
import litellm
from litellm.integrations.custom_logger import CustomLogger


def _ignored(self, strategy):
    """The strategy goes nowhere the plugin can see it."""


for name in ("register_plugin", "set_custom_routing_strategy"):
    if hasattr(litellm.Router, name):
        setattr(litellm.Router, name, _ignored)

callback = CustomLogger()
'''


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with Stack(tmp_path_factory.mktemp("host-moved")) as s:
        redis_port = s.redis()
        pods = s.sim(2, "--speed", "10", "--mean-output-tokens", "10")
        path = s.config(pods, redis_port, edit=lambda c: c["litellm_settings"]["callbacks"].insert(0, "host_moved.callback"))
        (s.tmp / "host_moved.py").write_text(HOST_MOVED)
        s.scraper(path)
        proxy, url = s.proxy(path)
        yield {"url": url, "proxy": proxy, "redis": redis_lib.Redis(port=redis_port)}


def test_one_error_litellms_routing_and_no_growth_in_redis_connections(stack):
    clients = []
    statuses = []
    started = time.monotonic()
    with httpx.Client(timeout=30) as http:
        while time.monotonic() - started < OBSERVED_S:
            for model in ("sql-lora", "tweet-summary"):
                statuses.append(http.post(stack["url"] + "/v1/completions",
                                          headers={"Authorization": f"Bearer {MASTER_KEY}"},
                                          json={"model": model, "prompt": "hi", "max_tokens": 4}).status_code)
            clients.append(stack["redis"].info("clients")["connected_clients"])
            time.sleep(1.0)
    log = stack["proxy"].log()
    assert set(statuses) == {200}, statuses
    assert log.count("cannot route on LiteLLM") == 1, log[-3000:]
    assert "lora-affinity routing installed" not in log and " -> " not in log  # no decision of the plugin's
    settled = clients[5:]  # the scraper's and this test's connections, once the proxy has started
    assert max(settled) <= min(settled) + 1, clients
