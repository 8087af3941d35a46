"""A client that hangs up mid-stream stops the generation upstream, through the proxy with the plugin.

Real processes: redis-server, simulated vLLM replicas, the scraper and a `litellm --config` proxy.
The OpenAI SDK streams, closes the stream after a few chunks, and the replica must count the abort
(`vllm:request_success_total{finished_reason="abort"}`) within a second, every time.
"""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest
from procs import MASTER_KEY
from stacks import Stack

TRIES = 20


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with Stack(tmp_path_factory.mktemp("disconnect")) as s:
        redis_port = s.redis()
        replicas = s.sim(2, "--warm-adapters", "sql-lora,tweet-summary", "--min-output-tokens", "50")
        config = s.config(replicas, redis_port)
        s.scraper(config)
        _, url = s.proxy(config)
        time.sleep(0.5)
        yield {"proxy": f"{url}/v1", "replicas": [f"http://127.0.0.1:{p}" for p in replicas]}


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
