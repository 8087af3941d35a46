"""Exact cache state end to end: simulated replicas publish KV events (a real tokenizer.json), the scraper
follows them and shares the index through a real Redis, and a real LiteLLM proxy matches each prompt against
what the engines hold. A restarted replica's blocks are gone from the proxy's view within a refresh, where
the inferred index would still send the prompt there; a pod that publishes no events keeps the inferred index;
a pod a new scraper joins past its replay buffer is partial, its figure at least what the proxy sent there."""

import json
import subprocess
import sys
import time

import httpx
import pytest
from procs import (
    MASTER_KEY,
    Decisions,
    debug_env,
    lora_affinity,
)
from stacks import Stack

SYSTEM = "You are the billing assistant. " + " ".join(f"billing rules {i}: answer the user question." for i in range(60))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with Stack(tmp_path_factory.mktemp("kv-events")) as s:
        tmp = s.tmp
        redis_port = s.redis()
        fleet = s.kv_sim(3, "--speed", "20")
        pods = fleet.pods
        path = s.config(pods, redis_port, edit=lambda c: fleet.name_endpoints(c, publishing=2),  # the third: none
                        kv_events=True, tokenizers=fleet.tokenizers)
        s.scraper(path)
        proxy, url = s.proxy(path, env=debug_env())
        time.sleep(0.5)
        yield {"proxy": url, "pods": [f"http://127.0.0.1:{p}" for p in pods],
               "config": path, "proxy_proc": proxy, "tmp": tmp, "procs": s.procs, "redis_port": redis_port}


def chat(stack, model: str, question: str) -> str:
    body = {"model": model, "max_tokens": 2,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    response = httpx.post(stack["proxy"] + "/v1/chat/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {MASTER_KEY}"})
    assert response.status_code == 200, response.text
    return response.headers["x-litellm-model-api-base"].rstrip("/").removesuffix("/v1")


def explain(stack, model: str, question: str = "and now?") -> dict:
    messages = stack["tmp"] / "messages.json"
    messages.write_text(json.dumps([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]))
    out = subprocess.run([sys.executable, "-m", "lora_affinity_plugin.ops.cli", "explain", "--config", str(stack["config"]),
                          "--model", model, "--messages", str(messages), "--json"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def wait_for(check, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_the_proxy_matches_a_prompt_against_what_the_engines_report_and_follows_a_restart(stack):
    decisions = Decisions(stack["proxy_proc"])
    reporting = stack["pods"][:2]
    for adapter in ("sql-lora", "tweet-lora", "chat-lora", "code-lora", "mail-lora", "news-lora"):
        holder = chat(stack, adapter, "first question?")
        if holder in reporting:  # (placement is the rules' to choose: the test needs a pod that reports)
            break
    assert holder in reporting
    explained = {}

    def exact_match_seen():
        explained.update(explain(stack, adapter))
        return explained["match_sources"].get(holder) == "exact" and explained["prefix_matches"][holder] > 0
    wait_for(exact_match_seen)
    assert all(explained["match_sources"][p] == "exact" for p in reporting)
    assert explained["match_sources"][stack["pods"][2]] == "inferred"  # publishes no events
    assert all(explained["prefix_matches"][p] == 0 for p in reporting if p != holder)
    assert explained["pick"] == holder
    assert all(explain(stack, "other-lora")["prefix_matches"][p] == 0 for p in reporting)  # cached per adapter
    assert {chat(stack, adapter, f"question {i}?") for i in range(3)} == {holder}
    # Events lost: the holder's next 1,000 batches reach only its replay buffer. Requests go on as before, and
    # the scraper, hearing nothing more, asks for what followed its last batch: a question cached during the
    # gap is matched exactly, past the system prompt.
    question = "what do the billing rules say about travel weather question answers " * 12
    before = explain(stack, adapter, question)["prefix_matches"][holder]
    assert httpx.post(holder + "/control", json={"drop_events": 1000}).json() == {"drop_events": 1000}
    assert chat(stack, adapter, question) == holder
    wait_for(lambda: explain(stack, adapter, question)["prefix_matches"][holder] > before)
    time.sleep(0.3)  # the replica finishes (a restart wants it idle)
    assert httpx.post(holder + "/control", json={"restart": True}).json() == {"restarted": True}

    def forgotten():
        explained.update(explain(stack, adapter))
        return explained["prefix_matches"][holder] == 0
    wait_for(forgotten)  # the inferred index would still name the holder
    assert explained["match_sources"][holder] == "exact"
    assert decisions.count() >= 4  # every chat a decision of the rules


def test_a_redeployed_scraper_resumes_each_pod_from_the_checkpoint_the_last_one_left(stack):
    """The only scraper stops (SIGTERM, as a redeploy does); another client caches a document on a reporting pod
    while none runs; the next scraper resumes that pod from the checkpoint the last one wrote as it stopped, and
    the proxy matches both what was cached before and the document cached while no scraper ran."""
    procs, pod = stack["procs"], stack["pods"][0]
    scraper = next(p for p in procs if p.name == "scraper")
    before = "what is the refund policy for hotel bookings made abroad " * 10
    body = {"model": "sql-lora", "max_tokens": 2, "messages": [{"role": "system", "content": SYSTEM},
                                                               {"role": "user", "content": before}]}
    assert httpx.post(pod + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    wait_for(lambda: explain(stack, "sql-lora", before)["prefix_matches"][pod] > 0)
    matched = explain(stack, "sql-lora", before)["prefix_matches"][pod]
    scraper.stop()
    assert scraper.popen.returncode == 0  # stopped cleanly, its checkpoints written
    during = "and the same policy for train tickets bought with loyalty points please " * 10
    body["messages"][1]["content"] = during
    assert httpx.post(pod + "/v1/chat/completions", json=body, timeout=30).status_code == 200  # past any gateway
    successor = lora_affinity(["scrape", "--config", str(stack["config"])], stack["tmp"], "scraper-2")
    procs.append(successor)
    wait_for(lambda: f"KV events of {pod} resumed from batch" in successor.log())
    wait_for(lambda: explain(stack, "sql-lora", during)["prefix_matches"][pod] > 0)
    assert explain(stack, "sql-lora", before)["prefix_matches"][pod] == matched  # kept across the redeploy
    assert "joined afresh" not in successor.log()


def test_a_pod_joined_past_its_replay_buffer_is_partial_and_keeps_what_the_proxy_sent_there(stack):
    """No checkpoint and a replay buffer that no longer reaches back: the next scraper joins the pod afresh, with
    none of the blocks it already holds. The proxies are told the pod is partial and match what they sent there
    (the inferred index), not the empty exact figure; once the pod clears its cache (a restart) it is exact again."""
    import redis as redis_client

    from lora_affinity_plugin.config.settings import build_settings
    from lora_affinity_plugin.kv.kv_checkpoint import checkpoints_key

    procs, reporting = stack["procs"], stack["pods"][:2]
    question = "which billing rules apply to invoices sent twice by mistake " * 10
    for adapter in ("sql-lora", "tweet-lora", "chat-lora", "code-lora", "mail-lora", "news-lora"):
        holder = chat(stack, adapter, question)
        if holder in reporting:
            break
    assert holder in reporting
    wait_for(lambda: explain(stack, adapter, question)["match_sources"][holder] == "exact")
    held = explain(stack, adapter, question)["prefix_matches"][holder]
    assert held > 0
    for proc in [p for p in procs if p.name.startswith("scraper") and p.popen.poll() is None]:
        proc.stop()
    prefix = build_settings({}, environ={}).key_prefix
    redis_client.Redis(port=stack["redis_port"]).delete(checkpoints_key(prefix))
    for i in range(2):  # another client's prompts: batches after the question's
        body = {"model": adapter, "prompt": f"weather report {i} " * 40, "max_tokens": 2}
        assert httpx.post(holder + "/v1/completions", json=body, timeout=30).status_code == 200
    # Its buffer now holds only its last batch: the question's are gone from it, as after 10,000 more.
    assert httpx.post(holder + "/control", json={"replay_keep": 1}).json() == {"replay_keep": 1}
    joined = lora_affinity(["scrape", "--config", str(stack["config"])], stack["tmp"], "scraper-3")
    procs.append(joined)
    explained: dict = {}

    def partial_and_inferred():
        explained.update(explain(stack, adapter, question))
        return explained["match_sources"][holder] == "partial"
    wait_for(partial_and_inferred)
    assert explained["prefix_matches"][holder] >= held  # what the proxy sent there, though no event says so
    other = next(p for p in reporting if p != holder)
    assert explained["match_sources"][other] == "exact"  # its buffer still reaches back to its batch 0: whole
    assert chat(stack, adapter, question) == holder
    time.sleep(0.3)  # the replica finishes (a restart wants it idle)
    assert httpx.post(holder + "/control", json={"restart": True}).json() == {"restarted": True}

    def exact_again():
        explained.update(explain(stack, adapter, question))
        return explained["match_sources"][holder] == "exact" and explained["prefix_matches"][holder] == 0
    wait_for(exact_again)


def test_a_corrupted_record_snapshot_and_change_set_cost_only_their_pod(stack):
    """No scraper runs; the two reporting pods' records are kept fresh by hand, while the third pod's record, the
    shared index's snapshot and a change set in its stream are garbage. The proxy refreshes through all of it:
    every request is served, every one decided by the rules (no fallback), and none goes to the unreadable pod
    once its last good record is stale."""
    import threading

    import redis as redis_client

    from lora_affinity_plugin.config.settings import build_settings
    from lora_affinity_plugin.fleet.store import PodRecord, pod_key
    from lora_affinity_plugin.kv.exact_share import changes_key, snapshot_key

    procs, pods = stack["procs"], stack["pods"]
    for proc in [p for p in procs if p.name.startswith("scraper") and p.popen.poll() is None]:
        proc.stop()
    settings = build_settings({}, environ={})
    client = redis_client.Redis(port=stack["redis_port"])
    good = {pod: PodRecord.from_json(client.get(pod_key(settings, pod))) for pod in pods[:2]}
    client.set(pod_key(settings, pods[2]), b'{"pod": "' + pods[2].encode() + b'", "metrics": {"kv_cache_usage": NaN')
    client.hset(snapshot_key(settings.key_prefix), mapping={"c": b"\x00\xff garbage", "n": b"not a number"})
    client.xadd(changes_key(settings.key_prefix), {"c": b"\xff" * 7, "n": b"x", "e": b"?"})
    stop = threading.Event()

    def keep_fresh():
        while not stop.is_set():
            for pod, record in good.items():
                client.set(pod_key(settings, pod), PodRecord(pod, time.time(), record.metrics).to_json())
            stop.wait(0.1)

    feeder = threading.Thread(target=keep_fresh, daemon=True)
    feeder.start()
    try:
        time.sleep(settings.stale_after_ms / 1000 + 0.5)  # refreshes through the garbage, past the last good record
        decisions = Decisions(stack["proxy_proc"])
        served = [chat(stack, "sql-lora", f"corrupted state question {i}?") for i in range(12)]
        assert decisions.count() == len(served)  # each one the rules' decision: the refresh kept going
        assert pods[2] not in served and set(served) <= set(pods[:2])
        assert "snapshot in Redis cannot be read" in stack["proxy_proc"].log()
    finally:
        stop.set()
        feeder.join()
