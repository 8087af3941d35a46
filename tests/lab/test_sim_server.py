"""The simulated vLLM replicas over real HTTP: OpenAI endpoints, /metrics, and aborts on disconnect."""

import re
import sys
import time

import httpx
import openai
import pytest
from procs import Proc, free_port_range, wait_port

from lora_affinity_plugin.scraping.worker import parse_metrics


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    base = free_port_range(2)
    proc = Proc("sim", [sys.executable, "-m", "lora_affinity_plugin.ops.cli", "sim", "--replicas", "2", "--base-port",
                        str(base), "--speed", "20", "--kv-metric-name", "gpu_cache_usage_perc",
                        "--adapters", "sql-lora,tweet-summary", "--residency-metric"],
                tmp_path_factory.mktemp("sim"))
    try:
        wait_port(base)
        wait_port(base + 1)
        yield f"http://127.0.0.1:{base}"
    finally:
        proc.stop()


def aborts(url):
    page = httpx.get(url + "/metrics").text
    return float(re.search(r'vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)', page).group(1))


def test_text_and_chat_completions_with_usage(sim):
    client = openai.OpenAI(base_url=sim + "/v1", api_key="none")
    text = client.completions.create(model="sql-lora", prompt="Is the Necronomicon in the movie?", max_tokens=20)
    assert 1 <= text.usage.completion_tokens <= 20 and text.usage.prompt_tokens > 0
    chat = client.chat.completions.create(model="tweet-summary", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=10)
    assert chat.choices[0].message.content and chat.usage.total_tokens > 0


def test_streaming_sse_ends_with_usage(sim):
    client = openai.OpenAI(base_url=sim + "/v1", api_key="none")
    chunks = list(client.completions.create(model="sql-lora", prompt="hi", max_tokens=30, stream=True))
    assert len(chunks) >= 1 and chunks[-1].usage.completion_tokens >= 1


def test_models_health_and_unknown_adapter(sim):
    ids = [m["id"] for m in httpx.get(sim + "/v1/models").json()["data"]]
    assert "sql-lora" in ids and "meta-llama/Llama-2-7b-hf" in ids
    assert httpx.get(sim + "/health").status_code == 200
    r = httpx.post(sim + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404


def test_metrics_page_uses_vllm_names(sim):
    page = httpx.get(sim + "/metrics").text
    assert "vllm:gpu_cache_usage_perc" in page and "vllm:kv_cache_usage_perc" not in page
    assert len(page) > 15_000  # histograms give it a realistic size
    m = parse_metrics(page)
    assert m.max_lora == 4 and m.block_size == 16 and m.num_gpu_blocks == 700
    assert m.loaded_lora_adapters  # --residency-metric: vllm:lora_adapter_loaded{level="gpu"}


def test_client_disconnect_mid_stream_aborts_the_request(sim):
    before = aborts(sim)
    with httpx.stream("POST", sim + "/v1/completions",
                      json={"model": "sql-lora", "prompt": "x", "max_tokens": 750, "stream": True}) as resp:
        for _ in resp.iter_lines():
            break  # first token seen: hang up
    deadline = time.monotonic() + 1
    while aborts(sim) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborts(sim) == before + 1


def test_non_streaming_client_that_times_out_aborts_too(sim):
    before = aborts(sim)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(sim + "/v1/completions", json={"model": "tweet-summary", "prompt": "x", "max_tokens": 750},
                   timeout=0.3)
    deadline = time.monotonic() + 1
    while aborts(sim) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborts(sim) == before + 1


def test_the_current_vllm_lora_form_lists_every_active_adapter_in_both_lists():
    import random

    from lora_affinity_lab.sim.engine import EngineConfig, ReplicaEngine, Sequence
    from lora_affinity_lab.sim.metrics_page import render_metrics
    from lora_affinity_lab.sim.server import LiveReplica

    config = EngineConfig(max_loras=2)
    pages = {}
    for style in ("legacy", "current"):
        engine = ReplicaEngine(config, random.Random(1), [], [])
        replica = LiveReplica(engine, 1.0, None, "kv_cache_usage_perc", True, style)
        for i, adapter in enumerate(["a", "b", "c"]):  # two fit the GPU slots, the third waits
            engine.add(Sequence(f"r{i}", adapter, 10, 50, 0.0))
        engine.finish_step(engine.plan_step() / 1000)
        replica._note_lora_state()
        pages[style] = parse_metrics(render_metrics(replica, config.base_model))
    legacy, current = pages["legacy"], pages["current"]
    assert current.running_lora_adapters == current.waiting_lora_adapters
    assert current.running_lora_adapters == legacy.running_lora_adapters | legacy.waiting_lora_adapters
    assert legacy.running_lora_adapters != legacy.waiting_lora_adapters
    assert current.max_lora == legacy.max_lora == 2


def prefix_counters(url):
    page = httpx.get(url + "/metrics").text
    get = lambda name: float(re.search(rf"^vllm:{name}\{{[^}}]*\}} (\S+)", page, re.M).group(1))  # noqa: E731
    return get("prefix_cache_queries_total"), get("prefix_cache_hits_total"), page


def test_prefix_cache_counters_move_when_a_long_prompt_repeats(sim):
    other = sim.rsplit(":", 1)[0] + ":" + str(int(sim.rsplit(":", 1)[1]) + 1)
    queries0, hits0, page = prefix_counters(other)
    assert 'enable_prefix_caching="True"' in page
    system = "You answer questions about films. " * 60
    body = {"model": "sql-lora", "max_tokens": 2,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "first"}]}
    assert httpx.post(other + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    queries1, hits1, _ = prefix_counters(other)
    body["messages"][1]["content"] = "second question"
    assert httpx.post(other + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    queries2, hits2, _ = prefix_counters(other)
    assert queries1 > queries0 and hits1 == hits0  # the first time: nothing cached
    assert hits2 - hits1 >= 0.9 * len(system) / 3  # the system prompt's blocks hit (3 bytes a token)
    body["cache_salt"] = "tenant-b"  # another salt: no hit
    assert httpx.post(other + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    assert prefix_counters(other)[1] == hits2


def test_a_prompt_longer_than_the_context_is_refused_at_once(sim):
    started = time.monotonic()
    r = httpx.post(sim + "/v1/completions", json={"model": "sql-lora", "prompt": "word " * 20_000, "max_tokens": 10},
                   timeout=30)
    assert r.status_code == 400 and "maximum context length is 4096 tokens" in r.json()["error"]["message"]
    assert time.monotonic() - started < 2
    r = httpx.post(sim + "/v1/completions", json={"model": "sql-lora", "prompt": "hi", "cache_salt": 5}, timeout=30)
    assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"]


def test_a_tokenizer_file_counts_exactly_what_fits_and_bounds_what_cannot(tmp_path):
    """A prompt that cannot fit is refused on its length (10 MB of one letter took 10 s to tokenize)."""
    from lora_affinity_lab.sim.kv_cache import FileTokenizer
    from tokenizer_files import train_tokenizer

    train_tokenizer(tmp_path / "tokenizer.json")
    tokenizer = FileTokenizer(str(tmp_path / "tokenizer.json"))
    text = "a question about the weather " * 20
    assert tokenizer.count(text, 4096) == tokenizer.count(text) == len(tokenizer.encode(text))
    assert tokenizer.count("d" * 10_000_000, 4096) > 4096
    assert "d" * 10_000_000 not in tokenizer._cache  # refused on its length, never tokenized
    assert tokenizer.count("\ud800" * 20_000, 4096) > 4096  # a lone surrogate, as JSON may carry, is bounded too


def test_timing_histograms_and_a_speed_change_through_the_control_endpoint(sim):
    client = openai.OpenAI(base_url=sim + "/v1", api_key="none")
    client.completions.create(model="sql-lora", prompt="Is the Necronomicon in the movie?", max_tokens=5)
    counters = parse_metrics(httpx.get(sim + "/metrics").text).counters
    assert counters.ttft_count >= 1 and counters.prefill_time_count >= 1 and counters.queue_time_count >= 1
    assert httpx.post(sim + "/control", json={"speed": 0.5}).json() == {"speed": 0.5}
    refused = httpx.post(sim + "/control", json={"speed": "fast"})
    assert refused.status_code == 400 and "speed" in refused.json()["error"]
    httpx.post(sim + "/control", json={"speed": 1.0})


def test_replica_profiles_are_checked():
    from lora_affinity_lab.sim.arguments import parse_profiles

    assert parse_profiles("speed=1;speed=0.5,kv_blocks=350") == [{"speed": 1.0}, {"speed": 0.5, "kv_blocks": 350}]
    with pytest.raises(SystemExit, match="KEY one of speed"):
        parse_profiles("sped=1")
    with pytest.raises(SystemExit, match="speed must be positive"):
        parse_profiles("speed=0")


async def test_a_replica_counts_the_time_its_steps_ran_late():
    """A machine too slow for `--speed` runs steps late; the lag is counted, so a benchmark can say so."""
    import asyncio
    import random

    from lora_affinity_lab.sim.engine import EngineConfig, ReplicaEngine, Sequence
    from lora_affinity_lab.sim.metrics_page import render_metrics
    from lora_affinity_lab.sim.server import LiveReplica

    config = EngineConfig()
    engine = ReplicaEngine(config, random.Random(1), [], [])
    replica = LiveReplica(engine, 10.0, None, "kv_cache_usage_perc", True)
    engine.add(Sequence("r0", None, 10, 100_000, 0.0))  # decoding all along: a step every few ms
    runner = asyncio.create_task(replica.run())
    try:
        await asyncio.sleep(0.5)
        on_time = replica.lag_s  # steps on time (a loaded machine may stall briefly)
        time.sleep(0.5)  # the process is busy elsewhere: the simulated GPU loses this time
        await asyncio.sleep(0.05)
    finally:
        runner.cancel()
    assert on_time < 0.2
    assert 0.4 < replica.lag_s - on_time < 1.5  # 0.5 s, less the 50 ms a late step may catch up
    lag = float(re.search(r"^sim_lag_seconds_total (\S+)", render_metrics(replica, config.base_model), re.M).group(1))
    assert lag == pytest.approx(replica.lag_s, abs=0.001)


def test_the_live_bench_starts_a_scenarios_replica_profiles(tmp_path):
    """The live bench once started every scenario's replicas alike: `mixed-hetero` ran on equal replicas live
    while fast mode slowed half of them. Its sim, started with the bench's own arguments, runs them as profiled."""
    from lora_affinity_lab.bench.live import sim_arguments
    from lora_affinity_lab.bench.scenarios import get_scenario

    scenario = get_scenario("mixed-hetero")
    base = free_port_range(scenario.replicas)
    args = sim_arguments(scenario, base, 20.0, 1, "legacy")
    proc = Proc("sim", [sys.executable, "-m", "lora_affinity_plugin.ops.cli", *args], tmp_path)
    try:
        steps = []
        for port in (base, base + 1):  # profiles speed=1;speed=0.5, dealt in turn
            wait_port(port)
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none").completions.create(
                model="adapter-00", prompt="Is the Necronomicon in the movie?", max_tokens=20)
            counters = parse_metrics(httpx.get(f"http://127.0.0.1:{port}/metrics").text).counters
            steps.append(counters.itl_sum / counters.itl_count)
        assert 1.6 < steps[1] / steps[0] < 2.5, steps  # the second replica's decode steps take twice as long
    finally:
        proc.stop()


def _hangups_tool():
    """`bench-tools/hangups.py`, loaded as a module (bench tools are scripts, not a package)."""
    import importlib.util

    from procs import BENCH_TOOLS

    spec = importlib.util.spec_from_file_location("hangups", BENCH_TOOLS / "hangups.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_the_hangups_tool_counts_every_hang_up_a_replica_aborts(sim):
    """`bench-tools/hangups.py` against a replica itself, no proxy between: each of its hang-ups is one abort
    there, and its other streams end normally (what it then reads through proxies is the proxies' doing)."""
    import asyncio

    tool = _hangups_tool()
    port = int(sim.rsplit(":", 1)[1])
    before = tool.aborted([port, port + 1])
    assert asyncio.run(tool.one_round(sim, streams=6, hang_up=3)) == 0  # no stream failed
    deadline = time.monotonic() + 10
    while tool.aborted([port, port + 1]) - before < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tool.aborted([port, port + 1]) - before == 3


def test_the_hangups_tool_hangs_up_before_the_first_token_and_the_replica_aborts(tmp_path):
    """`hangups.py --before-first-token` against a replica itself, at the tool's 0.1x speed: its long prompt's first
    token is seconds away when it hangs up, and the replica counts the abort at once."""
    import asyncio

    tool = _hangups_tool()
    port = free_port_range(1)
    proc = Proc("slow-sim", [sys.executable, "-m", "lora_affinity_plugin.ops.cli", "sim", "--replicas", "1",
                             "--base-port", str(port), "--speed", "0.1", "--warm-adapters", ",".join(tool.ADAPTERS)],
                tmp_path)
    try:
        wait_port(port)
        for chat in (False, True):
            before = tool.aborted([port])
            assert asyncio.run(tool.hang_up_before_first_token(f"http://127.0.0.1:{port}", chat, after_s=0.5))
            deadline = time.monotonic() + 5
            while tool.aborted([port]) == before and time.monotonic() < deadline:
                time.sleep(0.05)
            assert tool.aborted([port]) - before == 1, chat
    finally:
        proc.stop()
