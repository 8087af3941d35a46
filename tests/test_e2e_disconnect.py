"""A client that hangs up mid-stream stops the generation upstream, through the proxy with the plugin.

Real processes: redis-server, simulated vLLM replicas, the scraper and a `litellm --config` proxy.
The OpenAI SDK streams, closes the stream after a few chunks, and the replica must count the abort
(`vllm:request_success_total{finished_reason="abort"}`) within a second, every time.
"""

from __future__ import annotations

import re
import sys
import time

import httpx
import openai
import pytest
from procs import (
    MASTER_KEY,
    Proc,
    free_port,
    free_port_range,
    litellm_proxy,
    lora_affinity,
    redis_server,
    wait_port,
    write_config,
)

TRIES = 20


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disconnect")
    base = free_port_range(2)
    redis_port, proxy_port = (next(p for p in iter(free_port, None) if p not in (base, base + 1)) for _ in range(2))
    procs: list[Proc] = []
    store = redis_server(redis_port, tmp)
    try:
        procs.append(Proc("sim", [sys.executable, "-m", "lora_affinity_plugin.cli", "sim", "--replicas", "2",
                                  "--base-port", str(base), "--warm-adapters", "sql-lora,tweet-summary", "--min-output-tokens", "50"], tmp))
        replicas = [base, base + 1]
        for p in replicas:
            wait_port(p)
        config = write_config(tmp / "config.yaml", replicas, redis_port)
        procs.append(lora_affinity(["scrape", "--config", str(config)], tmp, "scraper"))
        procs.append(litellm_proxy(config, proxy_port, tmp))
        time.sleep(0.5)
        yield {"proxy": f"http://127.0.0.1:{proxy_port}/v1", "replicas": [f"http://127.0.0.1:{p}" for p in replicas]}
    finally:
        for proc in reversed(procs):
            proc.stop()
        store.stop()


def counters(stack) -> tuple[int, int]:
    """(aborted, running+waiting) summed over the replicas."""
    aborted = busy = 0
    for url in stack["replicas"]:
        page = httpx.get(url + "/metrics").text
        aborted += int(float(re.search(r'finished_reason="abort"[^}]*\} (\S+)', page).group(1)))
        busy += sum(int(float(v)) for v in re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)", page, re.M))
    return aborted, busy


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_closing_a_stream_aborts_the_request_upstream_every_time(stack, kind):
    client = openai.OpenAI(base_url=stack["proxy"], api_key=MASTER_KEY, max_retries=0)
    delays = []
    for i in range(TRIES):
        before, _ = counters(stack)
        if kind == "chat":
            stream = client.chat.completions.create(model="sql-lora", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=750, stream=True)
        else:
            stream = client.completions.create(model="tweet-summary", prompt="Is the Necronomicon in it?",
                                               max_tokens=750, stream=True)
        for n, _chunk in enumerate(stream):
            if n == 2:
                break
        stream.close()
        closed = time.monotonic()
        while counters(stack)[0] < before + 1 and time.monotonic() - closed < 1.0:
            time.sleep(0.01)
        after, _ = counters(stack)
        assert after == before + 1, f"try {i}: the replica did not abort within 1 s"
        delays.append(time.monotonic() - closed)
    assert counters(stack)[1] == 0  # nothing left running or waiting on the replicas
    print(f"{kind}: {TRIES}/{TRIES} aborted, slowest {max(delays) * 1000:.0f} ms")
