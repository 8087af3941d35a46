"""Hostile request bodies through a real proxy with the plugin (KV events on: each prompt also tokenized), side by
side with one without it.

Each body is served or refused exactly as the proxy without the plugin serves or refuses it, the
plugin never falls back on an error of its own, and its decision time stays bounded whatever the
prompt (it reads at most `prefix_max_chars` of it).
"""

from __future__ import annotations

import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from procs import MASTER_KEY, proxy_config
from stacks import Stack

HEADERS = {"Authorization": f"Bearer {MASTER_KEY}", "Content-Type": "application/json"}
IMAGE = "data:image/png;base64," + "iVBORw0KGgo" * 200


@pytest.fixture(scope="module")
def proxies(tmp_path_factory):
    with Stack(tmp_path_factory.mktemp("hostile")) as s:
        tmp = s.tmp
        redis_port = s.redis()
        fleet = s.kv_sim(2, "--speed", "50")
        pods = fleet.pods

        def observed_with_events(config):
            fleet.name_endpoints(config)
            config["litellm_settings"]["callbacks"].insert(0, "prometheus")

        # KV events on: every prompt is also rendered and tokenized on the request path (capped like the index's)
        with_plugin = s.config(pods, redis_port, "with.yaml", edit=observed_with_events, kv_events=True,
                               tokenizers=fleet.tokenizers)
        without_plugin = tmp / "without.yaml"
        alone = proxy_config(pods, redis_port, "simple-shuffle")
        alone["litellm_settings"]["callbacks"] = ["prometheus"]  # the same host callbacks but the plugin
        without_plugin.write_text(yaml.safe_dump(alone))
        s.scraper(with_plugin)
        (_, with_url), (_, without_url) = s.proxies([with_plugin, without_plugin], ["proxy-with", "proxy-without"])
        time.sleep(0.5)
        yield {"with": with_url, "without": without_url}


def post(client: httpx.Client, base: str, body: bytes | dict, path: str = "/v1/chat/completions") -> int:
    content = body if isinstance(body, bytes) else None
    response = client.post(base + path, headers=HEADERS, content=content, json=None if content else body)
    return response.status_code


def metrics_page(base: str) -> str:
    return httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {MASTER_KEY}"}, timeout=10,
                     follow_redirects=True).text


def plugin_counter(base: str, name: str, page: str | None = None) -> float:
    """A series' value summed over its labels, from `page` or a fresh read of the proxy's metrics."""
    page = metrics_page(base) if page is None else page
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)", page, re.M))


def chat(content, **extra) -> dict:
    return {"model": "sql-lora", "max_tokens": 3, "messages": [{"role": "user", "content": content}], **extra}


HOSTILE = {
    "1 KB prompt": chat("a" * 1_000),
    "100 KB prompt": chat("b " * 50_000),
    "1 MB prompt": chat("c " * 500_000),
    "10 MB prompt": chat("d" * 10_000_000),
    "image parts": chat([{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": IMAGE}}]),
    "odd parts": chat([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, {"type": None}, 7]),
    "integer content": chat(12345),
    "object content": chat({"nested": ["x"]}),
    "null content": chat(None),
    "missing content": {"model": "sql-lora", "max_tokens": 3, "messages": [{"role": "user"}]},
    "no messages": {"model": "sql-lora", "max_tokens": 3},
    "messages not a list": {"model": "sql-lora", "max_tokens": 3, "messages": "hello"},
    "exotic unicode": chat("\u202eRTL \u200b zero-width \U0001F600 emoji \u0000 NUL \ufeff BOM " * 200),
    "lone surrogate": b'{"model": "sql-lora", "max_tokens": 3, "messages": [{"role": "user", "content": "x \\ud800 y"}]}',
    "10,000 messages": {"model": "sql-lora", "max_tokens": 3,
                        "messages": [{"role": "user" if i % 2 else "assistant", "content": f"m{i}"} for i in range(10_000)]},
    "cache_salt integer": chat("salted " * 300, cache_salt=42),
    "cache_salt list": chat("salted " * 300, cache_salt=["a"]),
    "metadata string": chat("meta " * 300, metadata="sheddable"),
    "metadata list": chat("meta " * 300, metadata=["criticality"]),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_body_gets_what_the_proxy_without_the_plugin_gives(proxies, name):
    with httpx.Client(timeout=120) as client:
        assert post(client, proxies["with"], HOSTILE[name]) == post(client, proxies["without"], HOSTILE[name])


def test_the_plugin_never_failed_and_every_decision_stayed_bounded(proxies):
    before = plugin_counter(proxies["with"], "lora_affinity_decisions_total")
    # The biggest bodies once more, so this test stands alone, against the same proxy's decisions for small chats
    # in the same round (the plugin's own time: `lora_affinity_decision_seconds`' sum over its count). Capped work
    # took about 11 times a small chat's decision (1.5 against 0.14 ms); rendering and hashing all of a 10 MB prompt
    # would take 25-45 ms, a hundred and fifty times or more. A proxy's first such bodies also pay for what it warms
    # once (38 ms in a fresh proxy's first round). The histogram is wall time, so a round in which the proxy was
    # descheduled on a busy machine is sent again, up to three rounds: unbounded work fails every round.
    rounds = []
    with httpx.Client(timeout=120) as client:
        for _ in range(3):
            start = _decision_time(proxies["with"])
            for i in range(5):
                post(client, proxies["with"], chat(f"a small question {i}"))
            small = _decision_time(proxies["with"])
            for name in ("10 MB prompt", "10,000 messages", "lone surrogate"):
                post(client, proxies["with"], HOSTILE[name])
            end = _decision_time(proxies["with"])
            rounds.append((_mean(small, end), _mean(start, small)))  # (hostile, small) seconds per decision
            if rounds[-1][0] <= BOUNDED_TIMES * rounds[-1][1]:
                break
    assert plugin_counter(proxies["with"], "lora_affinity_decisions_total") >= before + 1  # the 10 MB one was routed
    assert plugin_counter(proxies["with"], 'lora_affinity_fallbacks_total') == 0  # no plugin error, ever
    assert rounds[-1][0] <= BOUNDED_TIMES * rounds[-1][1], rounds


BOUNDED_TIMES = 40
"""How many times a small chat's decision time a hostile body's may take: capped work about 11 times, all of a
10 MB prompt 150 times or more."""


def _decision_time(base: str) -> tuple[float, float]:
    """The plugin's decision-time histogram's sum (seconds) and count, from one read of the metrics."""
    page = metrics_page(base)
    return (plugin_counter(base, "lora_affinity_decision_seconds_sum", page),
            plugin_counter(base, "lora_affinity_decision_seconds_count", page))


def _mean(before: tuple[float, float], after: tuple[float, float]) -> float:
    assert after[1] > before[1], (before, after)  # each step made decisions
    return (after[0] - before[0]) / (after[1] - before[1])


def test_a_10mb_prompt_does_not_delay_concurrent_small_requests(proxies):
    small = chat("hi")
    big = HOSTILE["10 MB prompt"]

    def small_latencies(base: str, with_big: bool) -> list[float]:
        with httpx.Client(timeout=120) as client, ThreadPoolExecutor(3) as pool:
            bigs = [pool.submit(post, client, base, big) for _ in range(3)] if with_big else []
            out = []
            for _ in range(20):
                started = time.perf_counter()
                assert post(client, base, small) == 200
                out.append(time.perf_counter() - started)
            for f in bigs:
                f.result()
        return out

    # The two proxies in turn, three rounds, the order alternating: what else runs on the machine then
    # weighs on both alike. Each proxy's median has the uncertainty of its rounds' spread, so their
    # difference is noise up to the two spreads together (on a loaded CI machine, 20-30 ms each), twice over:
    # the range of three rounds understates a spread (a loaded fresh clone read 35 ms against ranges of 28 and
    # 5 ms). A gross regression (a prompt tokenized whole: seconds) still shows.
    delays: dict[str, list[float]] = {"with": [], "without": []}
    for round_ in range(3):
        for name in (("with", "without") if round_ % 2 == 0 else ("without", "with")):
            alone = statistics.median(small_latencies(proxies[name], False))
            beside = statistics.median(small_latencies(proxies[name], True))
            delays[name].append(beside - alone)
    noise = sum(max(v) - min(v) for v in delays.values())
    # The proxy itself parses the 10 MB bodies (both pay that); the plugin adds no more than a few ms to it.
    # (A gross regression shows here; the plugin's own time per decision is bounded in the test above.)
    assert statistics.median(delays["with"]) <= statistics.median(delays["without"]) + max(0.020, 2 * noise), delays


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=50),
                    lambda children: st.lists(children, max_size=3) | st.dictionaries(
                        st.sampled_from(["role", "content", "type", "text", "image_url", "url"]), children, max_size=3),
                    max_leaves=12),
       st.one_of(st.none(), st.text(max_size=10), st.integers()))
def test_any_messages_body_gets_what_the_proxy_without_the_plugin_gives(proxies, messages, salt):
    body = {"model": "sql-lora", "max_tokens": 2, "messages": messages}
    if salt is not None:
        body["cache_salt"] = salt
    with httpx.Client(timeout=60) as client:
        assert post(client, proxies["with"], body) == post(client, proxies["without"], body)
