"""The plugin in somebody else's proxy: what it does not route behaves as in LiteLLM alone.

Real processes: redis-server, simulated vLLM pods that want an API key (vLLM's `--api-key`, the key
only in the proxy's environment as HOSTED_VLLM_API_KEY) and a metrics token, a hosted OpenAI-compatible
API that is not a pod (`openai/` deployments, with an api_base, which the scraper reads and finds no
model server behind, or reached through OPENAI_BASE_URL; one with a 1 s timeout, a weighted group of two,
a group that fails), the scraper, and two `litellm --config` proxies on the same config and environment,
one with the plugin and one without. LiteLLM's default retries and timeouts: nothing set.
"""

from __future__ import annotations

import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml
from paths import TESTS
from procs import MASTER_KEY, child_env, wait_port
from stacks import Stack

POD_KEY, HOSTED_KEY, METRICS_TOKEN = "pod-s3cret", "sk-hosted-s3cret", "metr1cs-t0ken"
ADAPTERS = ["sql-lora", "tweet-summary"]
WEIGHTS = {"eu": 3, "us": 1}


def config(pods: list[int], redis_port: int, plugin: bool, hosted_port: int) -> dict:
    hosted = f"http://127.0.0.1:{hosted_port}"
    model_list = [{"model_name": "*", "litellm_params": {"model": "hosted_vllm/*", "api_base": f"http://127.0.0.1:{p}/v1"}}
                  for p in pods]
    model_list += [{"model_name": "gpt-4o", "litellm_params": {"model": "openai/gpt-4o", "api_base": hosted + "/v1"}},
                   {"model_name": "slow-4o", "litellm_params": {"model": "openai/slow-4o", "timeout": 1}}]
    for group in ("mix-4o", "fail-4o"):  # two deployments of one hosted provider, weighted
        model_list += [{"model_name": group, "litellm_params": {"model": f"openai/{group}", "api_base": f"{hosted}/{region}/v1",
                                                                "weight": weight}} for region, weight in WEIGHTS.items()]
    cfg: dict = {"model_list": model_list, "general_settings": {"master_key": "os.environ/LITELLM_MASTER_KEY"}}
    if plugin:
        cfg["litellm_settings"] = {"callbacks": ["prometheus", "lora_affinity_plugin.strategy.proxy_plugin"],
                                   "require_auth_for_metrics_endpoint": False}
        cfg["lora_affinity"] = {"redis_url": f"redis://127.0.0.1:{redis_port}/0", "scrape_interval_ms": 100,
                                "metrics_bearer_token": METRICS_TOKEN,
                                "metrics_token_pods": [f"127.0.0.1:{p}" for p in pods]}
    return cfg


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with Stack(tmp_path_factory.mktemp("host")) as s:
        redis_port, hosted_port = s.redis(), s.port()
        env = child_env(HOSTED_VLLM_API_KEY=POD_KEY, OPENAI_API_KEY=HOSTED_KEY,
                        OPENAI_BASE_URL=f"http://127.0.0.1:{hosted_port}/v1")
        pods = s.sim(2, "--speed", "1", "--warm-adapters", ",".join(ADAPTERS), "--api-key", POD_KEY,
                     "--metrics-token", METRICS_TOKEN)
        s.start("hosted_api", [sys.executable, str(TESTS / "hosted_api.py"), str(hosted_port), HOSTED_KEY])
        wait_port(hosted_port)
        paths = {}
        for name, plugin in (("with", True), ("without", False)):
            paths[name] = s.tmp / f"{name}.yaml"
            paths[name].write_text(yaml.safe_dump(config(pods, redis_port, plugin, hosted_port)))
        s.scraper(paths["with"], env=env)
        (with_proc, with_url), (without_proc, without_url) = (
            s.proxy(paths[name], env=env, name=f"proxy-{name}") for name in ("with", "without"))
        time.sleep(0.5)
        yield {"urls": {"with": with_url, "without": without_url},
               "proxies": {"with": with_proc, "without": without_proc}, "hosted": f"http://127.0.0.1:{hosted_port}"}


def _call(url: str, kind: str, model: str, **extra) -> tuple[int, object]:
    """One request; returns the status and the body's shape (keys, or the streamed events' count and end)."""
    chat = kind.startswith("chat")
    body = {"model": model, "max_tokens": 8, "stream": kind.endswith("stream"), **extra}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", url + path, json=body, headers={"Authorization": f"Bearer {MASTER_KEY}"}) as r:
            if not body["stream"] or r.status_code != 200:
                r.read()
                payload = r.json()
                shape = sorted(payload) if r.status_code == 200 else sorted(payload.get("error", {}))
                return r.status_code, shape
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
            return r.status_code, ("stream", events[-1] if events else None, len(events) > 1)


KINDS = ["chat", "chat-stream", "text", "text-stream"]


def test_requests_the_plugin_does_not_route_behave_as_without_it(stack):
    """Each non-pod request twice, so a first failure's cooldown would show as a 429 on the second."""
    def in_order(url: str) -> list:
        return ([_call(url, kind, "gpt-4o") for kind in KINDS for _ in range(2)]
                + [_call(url, kind, "slow-4o") for kind in ("chat", "text")]
                + [_call(url, "chat", "fail-4o") for _ in range(4)])  # errors, retries, cooldowns: LiteLLM's

    with ThreadPoolExecutor(2) as pool:  # the two proxies side by side, each its requests in order
        results = dict(zip(stack["urls"], pool.map(in_order, stack["urls"].values())))
    assert results["with"] == results["without"], results
    assert [status for status, _ in results["with"]][:10] == [200] * 8 + [408, 408]
    assert all(status >= 400 for status, _ in results["with"][10:])
    seen = httpx.get(stack["hosted"] + "/_control/requests").json()
    assert seen and all(authorized for _, _, authorized in seen)  # the environment's key, every time


def test_pods_with_a_key_from_the_environment_are_served_pooled(stack):
    for kind in KINDS:
        for adapter in ADAPTERS:
            results = {name: _call(url, kind, adapter) for name, url in stack["urls"].items()}
            assert results["with"] == results["without"] and results["with"][0] == 200, (kind, results)
    log = stack["proxies"]["with"].log()
    assert "leaves text completions" not in log and "could not hand a pooled client" not in log


GENERATION_TOKENS = 400
GENERATION_S = GENERATION_TOKENS * 48 * 1.17 / 1000
"""The least a 400-token generation takes at simulated speed 1: each decode step is at least 48 x 1.17 ms
(the simulator's step model, sim/engine.py)."""


def test_a_request_timeout_holds_on_a_routed_text_completion(stack):
    """0.5 s asked for against a generation of at least GENERATION_S (~22 s): 408 from both, long before the
    generation could have ended (a timeout ignored would wait for all of it)."""
    for name, url in stack["urls"].items():
        started = time.monotonic()
        status, _ = _call(url, "text", "sql-lora", max_tokens=GENERATION_TOKENS, ignore_eos=True, timeout=0.5)
        elapsed = time.monotonic() - started
        assert status == 408 and elapsed < GENERATION_S / 2, (name, status, elapsed)


def _shares(url: str, hosted: str, count: int) -> dict[str, int]:
    """Where `count` chats to the weighted group went, as the hosted API saw them."""
    before = len(httpx.get(hosted + "/_control/requests").json())
    with ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda _: _call(url, "chat", "mix-4o")[0], range(count)))
    assert statuses == [200] * count
    seen = httpx.get(hosted + "/_control/requests").json()[before:]
    return {region: sum(path.startswith(f"/{region}/") for path, _, _ in seen) for region in WEIGHTS}


@pytest.mark.parametrize("round_", range(int(os.environ.get("LORA_AFFINITY_STATISTICAL_ROUNDS", "1"))))
def test_a_hosted_group_with_an_api_base_keeps_litellms_weights_and_never_sees_the_metrics_token(stack, round_):
    """The scraper reads the hosted API's /metrics (it has an api_base) and finds no model server: the group
    stays LiteLLM's (its weights, 3 to 1), the token goes to the pods only, and no fallback is counted."""
    count = 160
    share = _shares(stack["urls"]["with"], stack["hosted"], count)
    print(f"{count} chats to the 3:1 group through the proxy with the plugin, where they went: {share}")
    expected = WEIGHTS["eu"] / sum(WEIGHTS.values())
    # The share against the weights' own (not against a sample of LiteLLM alone, whose difference spreads sqrt(2)
    # times wider): 3.89 standard deviations of a binomial of `count`, so the check fails by chance less than once
    # in 10,000 runs; uniform routing (0.5) is 7 deviations away.
    bound = 3.89 * math.sqrt(expected * (1 - expected) / count)
    assert sum(share.values()) == count
    assert abs(share["eu"] / count - expected) < bound, (share, bound)
    other = httpx.get(stack["hosted"] + "/_control/other").json()
    scraped = [auth for path, auth in other if path.endswith("/metrics")]
    assert scraped, other  # the scraper did read the hosted API's /metrics ...
    assert not any(METRICS_TOKEN in (auth or "") for _, auth in other)  # ... never with the pods' token
    page = httpx.get(stack["urls"]["with"] + "/metrics/").text
    fallbacks = [line for line in page.splitlines() if line.startswith("lora_affinity_fallbacks_total{")]
    assert fallbacks and all(float(line.rsplit(" ", 1)[1]) == 0 for line in fallbacks), fallbacks
    decisions = [line for line in page.splitlines() if line.startswith("lora_affinity_decisions_total{")]
    assert not any("mix-4o" in line or "gpt-4o" in line for line in decisions), decisions
