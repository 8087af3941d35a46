"""The exact index from engines' KV events: keys from token ids, LoRA and salt kept apart, evictions followed;
the subscriber fills a 1,000-batch gap from the replay socket, however slowly it comes, and forgets a restarted
server's blocks; and a
simulated replica's events, with its own tokenizer or a real `tokenizer.json`, give the index exactly the
blocks its cache holds."""

import asyncio
import contextlib
import errno
import json
import subprocess
import sys
import time

import httpx
import pytest
import zmq.asyncio
from procs import free_port, free_port_range, wait_port
from tokenizer_files import train_tokenizer

from lora_affinity_lab.sim.kv_cache import ByteTokenizer
from lora_affinity_lab.sim.kv_publisher import KVEventPublisher, KVEventsConfig
from lora_affinity_plugin.fleet.request_builder import RequestBuilder
from lora_affinity_plugin.kv.exact_index import ExactIndex
from lora_affinity_plugin.kv import kv_subscriber
from lora_affinity_plugin.kv.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, encode_batch,
                                             sequence_bytes)
from lora_affinity_plugin.kv.kv_subscriber import EventEndpoints, KVEventSubscriber
from lora_affinity_plugin.kv.token_blocks import chain_keys, chain_seed

BS = 16


def stored(hashes, parent, tokens, lora=None, salt=None):
    extra = None
    if lora or salt:
        extra = tuple(tuple(k for k in (lora, salt if i == 0 and parent is None else None) if k) or None
                      for i in range(len(hashes)))
    return BlockStored(tuple(hashes), parent, tuple(tokens), BS, None, "GPU", lora, extra)


def grouped(event, group, kind=None, locality=None):
    """`event` as vLLM 0.34+ names its KV-cache group (a store also its kind) and its tier's locality."""
    import dataclasses
    if isinstance(event, BlockStored):
        return dataclasses.replace(event, group_idx=group, kv_cache_spec_kind=kind, locality=locality)
    return dataclasses.replace(event, group_idx=group, locality=locality)


def keys(tokens, lora=None, salt=None):
    return list(chain_keys(chain_seed(lora, salt), tokens, BS))


def test_keys_follow_stores_removals_adapters_salts_and_a_clear():
    index = ExactIndex()
    prompt = list(range(64))  # 4 blocks
    index.apply("p", EventBatch(0.0, (stored([1, 2], None, prompt[:32], "sql"), stored([3, 4], 2, prompt[32:], "sql"))))
    assert index.match("p", keys(prompt, "sql")) == 4
    assert index.match("p", keys(prompt)) == 0 and index.match("p", keys(prompt, "chat")) == 0  # another adapter
    assert index.match("p", keys(prompt, "sql", salt="tenant-a")) == 0
    index.apply("p", EventBatch(1.0, (BlockRemoved((3,)),)))
    assert index.match("p", keys(prompt, "sql")) == 2  # the chain is held up to the evicted block
    index.apply("p", EventBatch(2.0, (stored([9], None, prompt[:16], "sql", salt="tenant-a"),)))
    assert index.match("p", keys(prompt, "sql", salt="tenant-a")) == 1
    index.apply("p", EventBatch(3.0, (stored([7], 999, prompt[:16]),)))  # a parent never seen: no key
    assert index.size("p") == 4  # 1, 2, 4 (unreachable past 3, but held) and the salted block
    index.apply("p", EventBatch(4.0, (AllBlocksCleared(),)))
    assert index.size("p") == 0 and index.match("p", keys(prompt, "sql")) == 0


PAGE = 'vllm:num_requests_running{model_name="m"} 0\nvllm:num_requests_waiting{model_name="m"} 0\n'
"""An idle pod's metrics page (the scraper proves the pod on it)."""


def _vllm_publishers(vllm, ranks: list[int | None], **kwargs) -> tuple[int, int, list]:
    """vLLM's own publishers on free ports, one per data-parallel rank (None: a release that has no ranks), and the
    publish and replay base ports. A port found free can be bound by another test's process before a publisher binds
    it (README's test command runs three workers at once), so a clash starts over on other ports."""
    for _ in range(5):
        pub, replay = free_port_range(2), free_port_range(2)
        made = []
        try:
            for rank in ranks:
                ranked = {} if rank is None else {"data_parallel_rank": rank}
                made.append(vllm.ZmqEventPublisher(endpoint=f"tcp://*:{pub}",
                                                   replay_endpoint=f"tcp://127.0.0.1:{replay}", **ranked, **kwargs))
            return pub, replay, made
        except zmq.ZMQError as error:
            for publisher in made:
                publisher.shutdown()
            if error.errno != errno.EADDRINUSE:
                raise
    raise RuntimeError("five pairs of free ports were each taken before vLLM's publisher could bind them")


def _serving_publisher(buffer_steps: int):
    """A simulated pod's KV-event publisher with its replay socket served: (publisher, the serving task, endpoints)."""
    pub_port, replay_port = free_port(), free_port()
    publisher = KVEventPublisher(KVEventsConfig(True, "zmq", f"tcp://127.0.0.1:{pub_port}",
                                                f"tcp://127.0.0.1:{replay_port}", buffer_steps=buffer_steps))
    endpoints = EventEndpoints(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
    return publisher, asyncio.create_task(publisher.serve_replay()), endpoints


@contextlib.asynccontextmanager
async def _following(buffer_steps: int):
    """A simulated pod's publisher (its replay buffer `buffer_steps` long) and a subscriber following it:
    (publisher, subscriber, the pod's stream); everything stopped on the way out."""
    publisher, replay_task, endpoints = _serving_publisher(buffer_steps)
    subscriber = KVEventSubscriber({"p": endpoints})
    stop = asyncio.Event()
    follow = asyncio.create_task(subscriber.run(stop))
    try:
        yield publisher, subscriber, subscriber.streams["p"]
    finally:
        stop.set()
        await follow
        replay_task.cancel()
        publisher.close()


async def _until(check, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _publish_until_live(publisher, stream, prompts, between=None) -> int:
    """Publishes prompts[0], [1], ... (a block each) until one reaches `stream` live, not by replay: a SUB socket
    misses what is sent before it has connected. Returns the last sequence number; `between` runs after each."""
    seq = 0
    publisher.publish([stored([10_000], None, prompts[0])])
    while True:
        await _until(lambda: stream.last_seq == seq)
        if stream.batches > stream.replayed:
            return seq
        seq += 1
        publisher.publish([stored([10_000 + seq], None, prompts[seq])])
        if between is not None:
            await between()
        await asyncio.sleep(0.05)


async def test_a_gap_of_a_thousand_batches_is_replayed_and_a_restart_forgets_the_pods_blocks():
    async with _following(5000) as (publisher, subscriber, stream):
        prompts = [[i * 1000 + t for t in range(BS)] for i in range(1200)]
        seq = await _publish_until_live(publisher, stream, prompts)
        first = seq + 1
        publisher.dropped_next = 1000  # the next 1,000 batches reach only the replay buffer
        for i in range(first, first + 1000):
            publisher.publish([stored([10_000 + i], None, prompts[i])])
        last = first + 1000
        publisher.publish([stored([10_000 + last], None, prompts[last])])  # the gap shows
        await _until(lambda: stream.last_seq == last)
        assert stream.gaps == 1 and stream.replayed >= 1000 and not stream.partial, stream
        assert all(subscriber.index.match("p", keys(prompts[i])) == 1 for i in range(last + 1))
        publisher.restart()  # sequence 0 again, AllBlocksCleared first
        publisher.publish([stored([30_000], None, prompts[1150])])
        await _until(lambda: stream.restarts == 1 and stream.last_seq == 1)
        assert subscriber.index.size("p") == 1 and subscriber.index.match("p", keys(prompts[1150])) == 1


async def test_a_slow_replay_is_followed_to_its_end_and_only_a_silent_one_marks_the_pod_partial(monkeypatch):
    """The replay timeout is a silence, not a total: a busy pod (or a busy subscriber) may take longer than it to
    send a long gap, batch after batch, and the index is still exact. A gap whose last batch has come is filled
    without the end mark (a busy ROUTER socket drops what passes its high-water mark, and the mark comes last).
    An answer cut short is asked again from where it stopped; only a request that brings nothing marks the pod."""
    monkeypatch.setattr(kv_subscriber, "REPLAY_TIMEOUT_S", 0.5)  # 5 pauses: a silence, never a busy loop's delay
    ctx = zmq.asyncio.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    prompts = [[i * 1000 + t for t in range(BS)] for i in range(8)]

    async def serve(answers):
        """Per request, (the batch to stop before, whether the end mark follows); later requests go unanswered."""
        for stop_before, end_mark in answers:
            client, _, start = await router.recv_multipart()
            for seq in range(int.from_bytes(start, "big", signed=True), stop_before):
                await asyncio.sleep(0.1)  # 8 x 0.1 s: longer than the timeout in all, each pause a fifth of it
                payload = encode_batch(EventBatch(time.time(), (stored([100 + seq], None, prompts[seq]),)))
                await router.send_multipart((client, b"", sequence_bytes(seq), payload))
            if end_mark:
                await router.send_multipart((client, b"", sequence_bytes(-1), b""))

    cases = (  # what each request is answered, the gap's last batch, partial after, batches applied
        ([(8, True)], None, False, 8),
        ([(3, False)], None, True, 3),  # stops answering mid-replay: asked again, nothing comes
        ([(8, False)], 7, False, 8),  # the whole gap, then its end mark lost
        ([(3, False)], 7, True, 3),
        ([(3, False), (8, True)], None, False, 8),  # cut short (a ROUTER past its high-water mark), then the rest
    )
    try:
        for answers, until, partial, applied in cases:
            while await router.poll(0):  # the last case's unanswered request
                await router.recv_multipart()
            subscriber = KVEventSubscriber({"p": EventEndpoints(f"tcp://127.0.0.1:{free_port()}",
                                                                f"tcp://127.0.0.1:{port}")})
            stream = subscriber.streams["p"]
            server = asyncio.create_task(serve(answers))
            await subscriber._replay("p", subscriber.endpoints["p"], stream, 0, until=until)
            await server
            assert stream.partial is partial and stream.lost == int(partial), (answers, until, stream)
            assert stream.replayed == applied and stream.last_seq == applied - 1
    finally:
        router.close(linger=0)


@pytest.mark.parametrize("tokenizer", ["bytes3", "file"])
def test_a_simulated_replicas_events_give_exactly_the_blocks_its_cache_holds(tmp_path, tokenizer):
    base, pub, replay = free_port_range(1), free_port_range(1), free_port_range(1)
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                         "replay_endpoint": f"tcp://*:{replay}"})
    args = [sys.executable, "-m", "lora_affinity_plugin.ops.cli", "sim", "--replicas", "1", "--base-port", str(base),
            "--speed", "50", "--kv-blocks", "40", "--kv-events-config", config]
    if tokenizer == "file":
        train_tokenizer(tmp_path / "tokenizer.json")
        from tokenizers import Tokenizer

        encode = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode
        token_ids = lambda text: encode(text, add_special_tokens=False).ids  # noqa: E731
        args += ["--tokenizer", str(tmp_path / "tokenizer.json")]
    else:
        token_ids = lambda text: [t for block in ByteTokenizer().block_tokens(text, 1) for t in block]  # noqa: E731
    sim = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(base)
        asyncio.run(_follow_the_replica(base, pub, replay, token_ids))
    finally:
        sim.terminate()
        sim.wait(10)


async def _follow_the_replica(base, pub, replay, token_ids):
    subscriber = KVEventSubscriber({"r0": EventEndpoints(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")})
    stop = asyncio.Event()
    follow = asyncio.create_task(subscriber.run(stop))
    index, stream = subscriber.index, subscriber.streams["r0"]
    url = f"http://127.0.0.1:{base}/v1/completions"
    billing = "billing rules answer question " * 12
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            for adapter, salt in (("sql-lora", None), ("chat-lora", None), ("sql-lora", "tenant-a")):
                body = {"model": adapter, "prompt": billing, "max_tokens": 2}
                if salt:
                    body["cache_salt"] = salt
                assert (await client.post(url, json=body)).status_code == 200
            full = len(token_ids(billing)) // BS
            await _until(lambda: index.size("r0") >= 3 * full)
            for adapter, salt in (("sql-lora", None), ("chat-lora", None), ("sql-lora", "tenant-a")):
                assert index.match("r0", keys(token_ids(billing), adapter, salt)) == full, (adapter, salt)
            assert index.match("r0", keys(token_ids(billing), "other-lora")) == 0
            assert not stream.partial and stream.gaps == 0
            # Fill the 40-block cache with other prompts: the first ones are evicted, and the index follows.
            for i in range(12):
                text = f"weather travel {i} " + "system user assistant " * 10
                assert (await client.post(url, json={"model": "sql-lora", "prompt": text, "max_tokens": 2})).status_code == 200
            await asyncio.sleep(0.5)
            assert index.match("r0", keys(token_ids(billing), "sql-lora")) < full
            assert index.size("r0") <= 40
            restarted = await client.post(f"http://127.0.0.1:{base}/control", json={"restart": True})
            assert restarted.json() == {"restarted": True}
            await _until(lambda: stream.restarts == 1)
            assert index.size("r0") == 0
    finally:
        stop.set()
        await follow


def test_the_kv_events_benchmark_keeps_up_with_a_small_fleet():
    from procs import run_cli

    out = run_cli(["bench", "--scenario", "kv-events", "--pods", "4", "--seconds", "1"])
    # Whether it keeps up depends on the machine (the benchmark says which); nothing may be lost either way.
    assert "lost 0" in out and ("kept up" in out or "fell behind" in out), out
    assert "a new scraper from the checkpoint" in out and "checkpoints of every pod" in out, out


def test_a_chats_ids_are_the_whole_renders_with_its_head_tokenized_once(tmp_path):
    from lora_affinity_plugin.kv.tokenization import PromptTokenizer

    train_tokenizer(tmp_path / "tokenizer.json")
    from lora_affinity_lab.bench.tokenizer_files import CHAT_TEMPLATE

    (tmp_path / "chat.jinja").write_text(CHAT_TEMPLATE)
    tokenizer = PromptTokenizer(str(tmp_path / "tokenizer.json"), str(tmp_path / "chat.jinja"))
    from tokenizers import Tokenizer

    whole = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    system = "You are the travel assistant. " + "travel rules answer the question. " * 80
    for question in ("where to?", "and the weather there", " a leading space", "user system\n\nnewlines"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        rendered = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
        (ids,) = tokenizer.candidates(messages)
        assert ids == whole.encode(rendered, add_special_tokens=False).ids, question
    assert sum(1 for text, _ in tokenizer._heads if text.endswith(system)) == 1  # the head, tokenized once
    seed = chain_seed("travel-lora", None)
    (keys,) = tokenizer.chains(seed, messages, BS)
    assert keys == list(chain_keys(seed, ids, BS))  # the head's keys kept, the rest chained on from them


def test_a_one_message_prompts_document_is_tokenized_once_and_unrepeated_prompts_stay_bounded(tmp_path, monkeypatch):
    """A text completion or a single user message: the document above its last blank line is the head that is
    kept, the question under it is tokenized per request, and the ids are still the whole prompt's. Prompts that
    never repeat are kept only up to the token bound."""
    from lora_affinity_plugin.kv import tokenization
    from lora_affinity_lab.bench.tokenizer_files import CHAT_TEMPLATE
    from tokenizers import Tokenizer

    train_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "chat.jinja").write_text(CHAT_TEMPLATE)
    monkeypatch.setattr(tokenization, "CACHED_HEAD_TOKENS", 3000)
    tokenizer = tokenization.PromptTokenizer(str(tmp_path / "tokenizer.json"), str(tmp_path / "chat.jinja"))
    whole = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    document = "Report: " + "travel rules answer the question. " * 40
    for question in ("where to?", "and the weather there", " a leading space", "user system\n\nnewlines"):
        content = f"{document}\n\n{question}"
        chat, bare = tokenizer.candidates([{"role": "user", "content": content}])
        assert chat == whole.encode(f"<|user|>\n{content}\n<|assistant|>\n", add_special_tokens=False).ids, question
        assert bare == whole.encode(content).ids, question
    assert sorted(text for text, _ in tokenizer._heads if text.endswith(document)) == [f"<|user|>\n{document}", document]
    seed = chain_seed("travel-lora", None)
    chat_keys, bare_keys = tokenizer.chains(seed, [{"role": "user", "content": content}], BS)
    assert chat_keys == list(chain_keys(seed, chat, BS)) and bare_keys == list(chain_keys(seed, bare, BS))
    for i in range(60):  # long prompts seen once each
        tokenizer.candidates([{"role": "user", "content": f"report {i}: " + "weather billing rules " * 60}])
    assert 0 < tokenizer._heads._held <= 3000 and len(tokenizer._heads) < 60


async def test_the_scraper_follows_the_events_of_proven_pods_only():
    from lora_affinity_plugin.scraping.kv_follow import KVEventSharing, event_endpoints
    from lora_affinity_plugin.config.settings import build_settings

    model_list = [{"model_name": "m", "litellm_params": {"model": "hosted_vllm/m", "api_base": "http://10.0.0.7:8000/v1"}},
                  {"model_name": "gpt", "litellm_params": {"model": "openai/gpt-4o", "api_base": "https://api.example.com/v1"}},
                  {"model_name": "m", "litellm_params": {"model": "hosted_vllm/m", "api_base": "http://10.0.0.8:8000/v1"},
                   "model_info": {"kv_events_endpoint": ""}}]
    pods = ["http://10.0.0.7:8000", "https://api.example.com:443", "http://10.0.0.8:8000"]
    endpoints = event_endpoints(model_list, pods, build_settings({"kv_events": True}, environ={}))
    assert endpoints["http://10.0.0.7:8000"] == EventEndpoints("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558")
    assert "http://10.0.0.8:8000" not in endpoints  # its deployment says it publishes none
    sharing = KVEventSharing(endpoints)
    sharing.start(set())  # nothing proven yet: nothing followed
    assert sharing.subscriber is None
    sharing.start({"http://10.0.0.7:8000"})  # a hosted provider's api_base is never proven, so never followed
    assert set(sharing.subscriber.endpoints) == {"http://10.0.0.7:8000"}
    await sharing.stop()


def test_a_tokenizer_that_cannot_load_leaves_the_group_on_the_inferred_index(tmp_path, caplog):
    from lora_affinity_plugin.kv.exact_share import PodChange
    from lora_affinity_plugin.fleet.view import FleetView
    from lora_affinity_plugin.config.settings import build_settings
    from lora_affinity_plugin.kv.tokenization import tokenizer_for

    missing = {"*": {"tokenizer": str(tmp_path / "nowhere.json")}}
    with caplog.at_level("ERROR", logger="lora_affinity"):
        assert tokenizer_for(missing, "sql-lora") is None
    assert "cannot load the tokenizer" in caplog.text and "keeps the inferred prefix index" in caplog.text
    settings = build_settings({"kv_events": True, "tokenizers": missing}, environ={})
    fleet = FleetView(settings)
    fleet.held.load({"p": PodChange(True, BS, {1, 2, 3})}, 0)
    messages = [{"role": "system", "content": "rules " * 400}, {"role": "user", "content": "hi"}]
    request = RequestBuilder().build(fleet, "sql-lora", "sql-lora", messages, {}, ["p"], settings, model="sql-lora")
    assert request.prefix_blocks and not request.match_sources  # routed, on the inferred index


def test_a_partial_pods_figure_is_at_least_what_the_proxies_sent_there_and_the_flag_travels_in_k1(tmp_path):
    """A pod whose events were joined late (its replay buffer no longer reached back) holds blocks its index never
    saw stored: its exact figure is a floor, raised to the inferred one; a whole pod's figure is the truth, even
    where the inferred index disagrees. The flag rides in the change sets' flags byte, which an older reader
    (cleared bit only) ignores, and a clear resets it."""
    import time

    from lora_affinity_plugin.kv.exact_share import PodChange, decode_changes, encode_changes
    from lora_affinity_plugin.fleet.view import FleetView
    from lora_affinity_plugin.config.settings import build_settings

    changes = {"a": PodChange(False, BS, {1}, set(), partial=True), "b": PodChange(True, BS, {2}, {3}, partial=False),
               "c": PodChange(True, BS, {4})}
    assert decode_changes(encode_changes(changes)) == changes
    assert encode_changes({"c": changes["c"]})[4] == 1  # the flags byte, as an older writer wrote it: cleared only

    train_tokenizer(tmp_path / "tokenizer.json")
    settings = build_settings({"kv_events": True, "tokenizers": {"*": {"tokenizer": str(tmp_path / "tokenizer.json")}}},
                              environ={})
    fleet = FleetView(settings)
    fleet.held.load({"whole": PodChange(True, BS), "late": PodChange(True, BS, partial=True)}, 0)
    messages = [{"role": "system", "content": "billing rules answer the question. " * 40},
                {"role": "user", "content": "where to?"}]
    pods = ["whole", "late"]
    request = RequestBuilder().build(fleet, "sql-lora", "sql-lora", messages, {}, pods, settings, model="sql-lora")
    assert request.prefix_blocks and request.prefix_matches == {}
    assert request.match_sources == {"whole": "exact", "late": "partial"}
    for pod in pods:  # these proxies sent the prompt to both (the exact index has not seen either store it)
        fleet.note_prefix(pod, request.prefix_hashes, time.time())
    request = RequestBuilder().build(fleet, "sql-lora", "sql-lora", messages, {}, pods, settings, model="sql-lora")
    assert request.prefix_matches == {"late": request.prefix_blocks}  # the whole pod's events say it holds none

    fleet.held.apply({"late": PodChange(True, BS)})  # the pod cleared its cache (AllBlocksCleared): whole again
    assert not fleet.held.partial("late")
    request = RequestBuilder().build(fleet, "sql-lora", "sql-lora", messages, {}, pods, settings, model="sql-lora")
    assert request.prefix_matches == {} and request.match_sources == {"whole": "exact", "late": "exact"}


def test_an_unreadable_batch_marks_the_pod_partial_and_keeps_its_index():
    subscriber = KVEventSubscriber({"p": EventEndpoints("tcp://127.0.0.1:1")})
    stream = subscriber.streams["p"]
    good = EventBatch(0.0, (stored([1], None, list(range(BS)), "sql"),))
    from lora_affinity_plugin.kv.kv_events import encode_batch

    subscriber._apply("p", stream, 0, encode_batch(good))
    assert not stream.partial and subscriber.index.size("p") == 1
    subscriber._apply("p", stream, 1, b"\xc1 not msgpack")
    assert stream.partial and stream.bad_payloads == 1 and stream.last_seq == 1
    assert subscriber.index.match("p", keys(list(range(BS)), "sql")) == 1
    # A cache cleared behind a store in the same batch (a prefix-cache reset between steps): whole again.
    cleared = EventBatch(2.0, (stored([2], None, list(range(BS, 2 * BS))), AllBlocksCleared(),
                               stored([3], None, list(range(2 * BS, 3 * BS)))))
    subscriber._apply("p", stream, 2, encode_batch(cleared))
    assert not stream.partial and subscriber.index.size("p") == 1


async def test_a_proxy_reads_the_change_sets_in_its_one_refresh_round_trip_and_reloads_the_snapshot_after_a_gap():
    import fakeredis

    from lora_affinity_plugin.kv.exact_share import PodChange, changes_key, encode_changes, snapshot_key
    from lora_affinity_plugin.fleet.view import FleetView
    from lora_affinity_plugin.fleet.follower import Follower
    from lora_affinity_plugin.config.settings import build_settings

    settings = build_settings({"kv_events": True}, environ={})
    client = fakeredis.aioredis.FakeRedis()
    stream, snapshot = changes_key(settings.key_prefix), snapshot_key(settings.key_prefix)
    follower = Follower(settings, FleetView(settings), lambda: ["a"], lambda s: None)
    held = follower.fleet.held
    commands: list[str] = []
    send = client.execute_command

    async def counted(*args, **options):
        commands.append(str(args[0]))
        return await send(*args, **options)

    client.execute_command = counted

    async def write(epoch, number, change):  # as the scraper's sharing does (kv_follow.py)
        return (await client.xadd(stream, {"e": epoch, "n": number, "c": encode_changes({"a": change})})).decode()

    first = await write("E1", 0, PodChange(True, BS, {1, 2}))
    await client.hset(snapshot, mapping={"e": "E1", "n": 0, "i": first, "c": encode_changes({"a": PodChange(True, BS, {1, 2})})})
    commands.clear()
    await follower.refresh(client)
    assert commands == ["HGETALL", "EVAL"] and held.match("a", [1, 2, 3]) == 2  # the snapshot, then the stream

    await write("E1", 1, PodChange(False, BS, {3}))
    commands.clear()
    await follower.refresh(client)
    assert commands == ["EVAL"] and held.match("a", [1, 2, 3]) == 3  # a change set: read in the refresh itself

    await write("E1", 3, PodChange(False, BS, set(), {1}))  # number 2 never arrived
    await follower.refresh(client)
    assert held.number is None and held.match("a", [1, 2, 3]) == 3  # noticed, nothing half-applied
    last = await write("E1", 4, PodChange(False, BS, {4}))
    await client.hset(snapshot, mapping={"n": 4, "i": last, "c": encode_changes({"a": PodChange(True, BS, {2, 3, 4})})})
    commands.clear()
    await follower.refresh(client)
    assert commands == ["HGETALL", "EVAL"] and held.match("a", [1, 2]) == 0 and held.match("a", [2, 3, 4]) == 3

    await write("E2", 0, PodChange(True, BS, {9}))  # a new scraper's numbering: its snapshot is loaded
    await client.hset(snapshot, mapping={"e": "E2", "n": 0, "i": "0-0", "c": encode_changes({"a": PodChange(True, BS, {9})})})
    await follower.refresh(client)
    await follower.refresh(client)
    assert held.match("a", [9]) == 1 and held.size("a") == 1


async def test_a_large_snapshot_is_written_in_parts_and_read_whole_by_proxies_and_explain(monkeypatch):
    """Past `SNAPSHOT_PART_BYTES` the snapshot is written one part per command, then the hash naming them; a proxy
    and `explain` read it whole. A writer of an earlier release that replaces `c`, `e` and `n` but leaves the parts'
    generation behind is read by its `c`; a reader of an earlier release finds no `c` in a snapshot of parts (it
    stays on the inferred index, never reads a wrong figure)."""
    import fakeredis

    from lora_affinity_plugin.kv import exact_share
    from lora_affinity_plugin.kv.exact_share import PodChange, encode_changes, read_snapshot, snapshot_key
    from lora_affinity_plugin.fleet.view import FleetView
    from lora_affinity_plugin.fleet.follower import Follower
    from lora_affinity_plugin.scraping.kv_follow import KVEventSharing
    from lora_affinity_plugin.fleet.lease import lease_key
    from lora_affinity_plugin.ops.commands import _load_exact_index
    from lora_affinity_plugin.config.settings import build_settings

    settings = build_settings({"kv_events": True}, environ={})
    prefix = settings.key_prefix
    server = fakeredis.FakeServer()
    client = fakeredis.aioredis.FakeRedis(server=server)
    await client.set(lease_key(prefix), "me#1")
    sharing = KVEventSharing({})
    sharing.subscriber = KVEventSubscriber({})
    index = sharing.subscriber.index
    for pod in ("a", "b", "c"):
        index.track(pod)
        index.apply(pod, EventBatch(1.0, tuple(stored([hash((pod, i))], None, [i * 100 + t for t in range(BS)])
                                               for i in range(40))))
    monkeypatch.setattr(exact_share, "SNAPSHOT_PART_BYTES", 400)  # about one pod's 40 keys per part
    commands: list[tuple] = []
    send = client.execute_command

    async def counted(*args, **options):
        commands.append(args)
        return await send(*args, **options)

    client.execute_command = counted
    await sharing.share(client, prefix, "me#1")
    snap = await client.hgetall(snapshot_key(prefix))
    assert b"c" not in snap and int(snap[b"k"]) == 3
    writes = [args for args in commands if args[0] == "EVALSHA" or args[0] == "EVAL"]
    assert len(writes) >= 4  # the first change set, 3 parts, the hash: one command each
    proxy = Follower(settings, FleetView(settings), lambda: ["a", "b", "c"], lambda s: None)
    await proxy.refresh(client)
    assert [proxy.fleet.held.size(pod) for pod in ("a", "b", "c")] == [40, 40, 40]
    fleet = FleetView(settings)
    _load_exact_index(fakeredis.FakeRedis(server=server), fleet, settings)  # explain's reading, a sync client
    assert [fleet.held.size(pod) for pod in ("a", "b", "c")] == [40, 40, 40]
    with pytest.raises(KeyError):  # what an earlier release's reader does with it: KeyError, its inferred index
        snap[b"c"]
    # An earlier release's writer replaces c, e, n and i with HSET; the parts' generation no longer matches
    await client.hset(snapshot_key(prefix), mapping={"e": "OLD", "n": 0, "i": "0-0",
                                                    "c": encode_changes({"a": PodChange(True, BS, {7})})})
    changes, number, epoch, _ = read_snapshot(await client.hgetall(snapshot_key(prefix)))
    assert list(changes) == ["a"] and changes["a"].added == {7} and epoch == b"OLD"


async def test_a_standby_scraper_follows_the_events_too_so_its_index_is_whole_when_it_takes_over(monkeypatch):
    """A pod's replay buffer holds 5 batches and it publishes 20 more while the standby waits: one that joined
    only on taking the lease would know the last 5 (and mark the pod partial); the standby knows all of them.
    One standby follows, not every worker: the next one takes the role when the first takes the lease."""
    import fakeredis
    from page_server import serve_pages

    from lora_affinity_plugin.kv.exact_share import HeldBlocks, decode_changes, snapshot_key
    from lora_affinity_plugin.fleet.view import FleetView
    from lora_affinity_plugin.fleet.follower import Follower
    from lora_affinity_plugin.scraping import worker as scraper_module
    from lora_affinity_plugin.scraping.kv_follow import KVEventSharing
    from lora_affinity_plugin.scraping.worker import Scraper
    from lora_affinity_plugin.config.settings import build_settings

    monkeypatch.setattr(scraper_module, "STANDBY_READ_S", 1.0)  # the role held 3 s, asked for every second
    publisher, replay_task, pod_endpoints = _serving_publisher(5)
    settings = build_settings({"scraper_lease_ms": 1000, "kv_events": True}, environ={})
    redis = fakeredis.aioredis.FakeRedis()
    prompts = [[i * 1000 + t for t in range(BS)] for i in range(100)]
    async with serve_pages({"a": PAGE}) as url:
        pod = url("a")
        endpoints = {pod: pod_endpoints}
        leader = Scraper(settings, [pod], redis, kv_events=KVEventSharing(endpoints))
        standby = Scraper(settings, [pod], redis, kv_events=KVEventSharing(endpoints))
        other = Scraper(settings, [pod], redis, kv_events=KVEventSharing(endpoints))
        try:
            await leader.scrape_once()
            await standby.scrape_once()
            await other.scrape_once()
            assert leader.leader and not standby.leader and not other.leader
            assert standby.kv_events.subscriber is not None  # following the pod the leader proved, sharing nothing
            assert other.kv_events.subscriber is None  # one standby follows
            stream = standby.kv_events.subscriber.streams[pod]
            seq = await _publish_until_live(publisher, stream, prompts, between=leader.scrape_once)
            last = seq + 20
            for i in range(seq + 1, last + 1):
                publisher.publish([stored([10_000 + i], None, prompts[i])])
                await leader.scrape_once()  # renews its lease
                await standby.scrape_once()  # a standby's interval: no lease, changes followed and dropped
            await _until(lambda: stream.last_seq == last)
            assert not standby.leader
            await leader.aclose()  # the leader goes; its lease lapses
            await asyncio.sleep(1.1)
            await standby.scrape_once()
            assert standby.leader and not stream.partial
            snap = await redis.hgetall(snapshot_key(settings.key_prefix))
            held = HeldBlocks()  # what every proxy loads
            held.load(decode_changes(snap[b"c"]), int(snap[b"n"]))
            assert [held.match(pod, keys(prompts[i])) for i in range(last + 1)] == [1] * (last + 1)
            proxy = Follower(settings, FleetView(settings), lambda: [pod], lambda s: None)
            epochs = set()
            for _ in range(3):  # the stream still holds the last term's change sets: read past, never reloaded on
                await standby.scrape_once()  # renewing is not a new term
                await proxy.refresh(redis)
                epochs.add(proxy.kv_epoch)
                assert proxy.fleet.held.number == 0 and proxy.fleet.held.size(pod) == last + 1
            assert len(epochs) == 1
            await asyncio.sleep(0.6)
            await standby.scrape_once()  # renews its lease
            await asyncio.sleep(0.5)
            await standby.scrape_once()
            await other.scrape_once()  # the role was let go on taking the lease: the next standby follows now
            assert not other.leader and other.kv_events.subscriber is not None
        finally:
            await leader.aclose()
            await standby.aclose()
            await other.aclose()
            replay_task.cancel()
            publisher.close()


def removed_by_vllm(vllm, hashes):
    """A BlockRemoved as the release declares it (up to 0.10 without `medium`)."""
    medium = {"medium": "GPU"} if "medium" in vllm.BlockRemoved.__struct_fields__ else {}
    return vllm.BlockRemoved(block_hashes=list(hashes), **medium)


class _Dropping:
    """A publisher's PUB socket that loses the next `n` batches (a subscriber's high-water mark, a reconnect),
    which stay in the publisher's replay buffer."""

    def __init__(self, sock) -> None:
        self.sock, self.n = sock, 0

    def send_multipart(self, frames, *args, **kwargs):
        if self.n > 0:
            self.n -= 1
            return None
        return self.sock.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.sock, name)


@pytest.mark.parametrize("release", __import__("vllm_wheels").releases())
async def test_vllms_own_publisher_is_followed_exactly_through_a_late_join_a_lost_stretch_adapters_and_salts(release):
    """vLLM's released `kv_events.py`, unmodified: batches sent before the subscriber came and batches the
    subscriber lost are recovered from its replay socket (since 0.26 it answers `(b"", topic, seq, payload)`),
    a removal among the lost ones included; an adapter's and a salted prompt's blocks are keyed apart."""
    import vllm_wheels

    vllm = vllm_wheels.publisher_module(release)
    fields = set(vllm.BlockStored.__struct_fields__)

    def stored_by_vllm(hashes, parent, tokens, lora=None, salt=None):
        extra = [tuple(k for k in (lora, salt if i == 0 and parent is None else None) if k) or None
                 for i in range(len(hashes))]
        values = dict(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens), block_size=BS,
                      lora_id=1 if lora else None, medium="GPU", lora_name=lora,
                      extra_keys=extra if (lora or salt) else None)
        return vllm.BlockStored(**{k: v for k, v in values.items() if k in fields})

    def batch(*events):
        return vllm.KVEventBatch(ts=time.time(), events=list(events))

    rank = 0 if hasattr(vllm.ZmqEventPublisher, "offset_endpoint_port") else None  # (0.10+)
    pub_port, replay_port, (publisher,) = _vllm_publishers(vllm, [rank], buffer_steps=100, topic="kv")
    publisher._pub = dropping = _Dropping(publisher._pub)
    prompts = [[i * 1000 + t for t in range(BS)] for i in range(64)]
    for i in range(3):  # before any subscriber: only the replay buffer has them
        publisher.publish(batch(stored_by_vllm([500 + i], None, prompts[i])))
    await _until(lambda: len(publisher._buffer) == 3)  # sent, to nobody yet (the publisher sends from a thread)
    subscriber = KVEventSubscriber({"p": EventEndpoints(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}",
                                                        topic="kv")})
    stream = subscriber.streams["p"]
    stop = asyncio.Event()
    follow = asyncio.create_task(subscriber.run(stop))
    try:
        await _until(lambda: stream.last_seq == 2)
        assert stream.replayed == 3 and not stream.partial, stream
        seq, i = 2, 3
        while stream.batches == stream.replayed:  # until one batch arrives live (a SUB socket joins late)
            publisher.publish(batch(stored_by_vllm([500 + i], None, prompts[i])))
            seq, i = seq + 1, i + 1
            await _until(lambda: stream.last_seq == seq)
        dropping.n = 3
        publisher.publish(batch(stored_by_vllm([900], None, prompts[40], lora="sql-lora")))
        publisher.publish(batch(removed_by_vllm(vllm, [500])))
        publisher.publish(batch(stored_by_vllm([901], None, prompts[41], salt="tenant-a")))
        publisher.publish(batch(stored_by_vllm([902], None, prompts[42])))  # live: the gap shows
        await _until(lambda: stream.last_seq == seq + 4)
        assert (stream.gaps, stream.gaps_replayed, stream.gaps_lost, stream.partial) == (1, 1, 0, False), stream
        index = subscriber.index
        assert index.match("p", keys(prompts[0])) == 0  # removed in a lost batch
        assert all(index.match("p", keys(prompts[k])) == 1 for k in range(1, i)), release
        named = "lora_name" in fields  # up to 0.13 an adapter is a number only: its blocks are claimed by no one
        assert index.match("p", keys(prompts[40], "sql-lora")) == int(named) and index.match("p", keys(prompts[40])) == 0
        if "extra_keys" in fields:  # (up to 0.13 the salt is not sent)
            assert index.match("p", keys(prompts[41], salt="tenant-a")) == 1
            assert index.match("p", keys(prompts[41])) == 0
        assert index.match("p", keys(prompts[42])) == 1 and stream.bad_payloads == 0
    finally:
        stop.set()
        await follow
        publisher.shutdown()


def test_a_bad_data_parallel_size_in_model_info_is_named_and_the_settings_value_used(caplog):
    from lora_affinity_plugin.scraping.kv_follow import event_endpoints
    from lora_affinity_plugin.config.settings import build_settings

    settings = build_settings({"kv_events": True, "kv_events_data_parallel_size": 2}, environ={})
    pod = "http://10.0.0.7:8000"
    for bad in ("four", 0, 65, True, 2.5):
        model_list = [{"model_name": "m", "litellm_params": {"model": "hosted_vllm/m", "api_base": pod + "/v1"},
                       "model_info": {"kv_events_data_parallel_size": bad}}]
        with caplog.at_level("WARNING"):
            assert sorted(event_endpoints(model_list, [pod], settings)) == [pod, pod + "#dp1"]
        assert f"kv_events_data_parallel_size {bad!r} is not a whole number from 1 to 64: 2 used" in caplog.text


@pytest.mark.parametrize("release", __import__("vllm_wheels").releases())
async def test_vllms_data_parallel_ranks_are_each_followed_and_a_pod_holds_what_any_rank_holds(release):
    """Two ranks of one pod, each vLLM's own publisher (rank 1 on the endpoints' ports + 1, as vLLM offsets them):
    `kv_events_data_parallel_size: 2` follows both; the shared change set carries each rank's keys, and a proxy
    matches the pod by its best rank; a rank's removal does not take the other rank's copy."""
    import vllm_wheels

    from lora_affinity_plugin.kv.exact_share import HeldBlocks, decode_changes, encode_changes
    from lora_affinity_plugin.scraping.kv_follow import event_endpoints, offset_endpoint
    from lora_affinity_plugin.config.settings import build_settings

    vllm = vllm_wheels.publisher_module(release)
    if not hasattr(vllm.ZmqEventPublisher, "offset_endpoint_port"):
        pytest.skip(f"vLLM {release} publishes no data-parallel ranks (0.10 and newer do)")
    fields = set(vllm.BlockStored.__struct_fields__)
    pub, replay, publishers = _vllm_publishers(vllm, [0, 1], buffer_steps=100)
    for endpoint, rank in ((f"tcp://*:{pub}", 1), ("tcp://127.0.0.1:5557", 3), ("inproc://cache", 2)):
        assert offset_endpoint(endpoint, rank) == vllm.ZmqEventPublisher.offset_endpoint_port(endpoint, rank)
    pod = "http://10.0.0.7:8000"
    settings = build_settings({"kv_events": True, "kv_events_endpoint": f"tcp://127.0.0.1:{pub}",
                               "kv_events_replay_endpoint": f"tcp://127.0.0.1:{replay}"}, environ={})
    model_list = [{"model_name": "m", "litellm_params": {"model": "hosted_vllm/m", "api_base": pod + "/v1"},
                   "model_info": {"kv_events_data_parallel_size": 2}}]
    endpoints = event_endpoints(model_list, [pod], settings)
    assert sorted(endpoints) == [pod, pod + "#dp1"]
    assert endpoints[pod + "#dp1"].publisher == f"tcp://127.0.0.1:{pub + 1}"
    prompts = [[i * 1000 + t for t in range(BS)] for i in range(4)]

    def stored_by(hashes, tokens):
        values = dict(block_hashes=list(hashes), parent_block_hash=None, token_ids=list(tokens), block_size=BS,
                      lora_id=None, medium="GPU", lora_name=None, extra_keys=None)
        return vllm.BlockStored(**{k: v for k, v in values.items() if k in fields})

    subscriber = KVEventSubscriber(endpoints)
    stop = asyncio.Event()
    follow = asyncio.create_task(subscriber.run(stop))
    try:
        publishers[0].publish(vllm.KVEventBatch(ts=time.time(), events=[stored_by([1], prompts[0]),
                                                                        stored_by([2], prompts[2])]))
        publishers[1].publish(vllm.KVEventBatch(ts=time.time(), events=[stored_by([1], prompts[1]),
                                                                        stored_by([2], prompts[2])]))
        publishers[1].publish(vllm.KVEventBatch(ts=time.time(), events=[removed_by_vllm(vllm, [2])]))
        await _until(lambda: subscriber.streams[pod].last_seq == 0 and subscriber.streams[pod + "#dp1"].last_seq == 1)
        held = HeldBlocks()
        held.load(decode_changes(encode_changes(subscriber.index.snapshot())), 0)  # as a proxy reads them
        assert held.has(pod) and held.size(pod) == 3
        assert [held.match(pod, keys(p)) for p in prompts] == [1, 1, 1, 0]  # rank 0's, rank 1's, rank 0's copy
    finally:
        stop.set()
        await follow
        for publisher in publishers:
            publisher.shutdown()


async def test_a_live_copy_of_batch_zero_after_its_replay_is_no_restart_but_a_new_servers_batch_zero_is():
    """A subscriber that joins while the server sends its first batch gets it twice: by replay, then live."""
    subscriber = KVEventSubscriber({"p": EventEndpoints("tcp://127.0.0.1:1")})
    stream = subscriber.streams["p"]
    ep = subscriber.endpoints["p"]
    prompts = [[i * 1000 + t for t in range(BS)] for i in range(3)]
    first = encode_batch(EventBatch(100.0, (stored([1], None, prompts[0]),)))
    for seq, payload in enumerate([first, *(encode_batch(EventBatch(100.0 + s, (stored([1 + s], None, prompts[s]),)))
                                           for s in (1, 2))]):
        await subscriber._receive("p", ep, stream, seq, payload)
    await subscriber._receive("p", ep, stream, 0, first)
    assert stream.restarts == 0 and subscriber.index.size("p") == 3
    await subscriber._receive("p", ep, stream, 0, encode_batch(EventBatch(200.0, (AllBlocksCleared(),))))
    assert stream.restarts == 1 and subscriber.index.size("p") == 0


def test_a_batch_with_values_no_engine_sends_marks_the_pod_partial_and_the_next_batch_still_applies():
    subscriber = KVEventSubscriber({"p": EventEndpoints("tcp://127.0.0.1:1")})
    stream = subscriber.streams["p"]
    prompt = list(range(BS))
    subscriber._apply("p", stream, 0, encode_batch(EventBatch(1.0, (stored([1], None, prompt),))))
    subscriber._apply("p", stream, 1, encode_batch(EventBatch(2.0, (stored([2], 1, [-1] * BS),))))
    assert stream.bad_payloads == 1 and stream.partial and stream.last_seq == 1
    subscriber._apply("p", stream, 2, encode_batch(EventBatch(3.0, (stored([3], None, [t + 99 for t in prompt]),))))
    assert subscriber.index.match("p", keys([t + 99 for t in prompt])) == 1 and stream.last_seq == 2


def test_a_pod_whose_figures_do_not_fit_the_change_format_costs_that_pod_and_a_truncated_set_is_refused(caplog):
    from lora_affinity_plugin.kv.exact_share import PodChange, decode_changes, encode_changes

    changes = {"good": PodChange(False, 16, {1, 2}, set()), "huge": PodChange(False, 70_000, {3}, set())}
    with caplog.at_level("WARNING"):
        data = encode_changes(changes)
        encode_changes(changes)
    decoded = decode_changes(data)
    assert set(decoded) == {"good"} and decoded["good"].added == {1, 2}
    assert sum("does not fit" in r.message for r in caplog.records) == 1
    for cut in (len(data) - 3, 5):
        with pytest.raises(ValueError):
            decode_changes(data[:cut])


def test_tokenizing_on_the_request_path_stops_at_prefix_max_chars(tmp_path, monkeypatch):
    """A 1 MB prompt is tokenized only as far as the inferred index hashes: what is encoded is bounded."""
    from lora_affinity_plugin.kv.tokenization import PromptTokenizer

    path = tmp_path / "tokenizer.json"
    train_tokenizer(path)
    tokenizer = PromptTokenizer(str(path))
    encoded: list[int] = []
    real = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, special: encoded.append(len(text)) or real(text, special))
    huge = "lorem ipsum dolor sit amet " * 40_000  # about 1 MB, one user message
    (chat,) = tokenizer.chains(7, [{"role": "user", "content": huge}], BS, max_chars=65_536)
    assert sum(encoded) <= 65_536 and chat
    (whole,) = tokenizer.chains(7, [{"role": "user", "content": huge[:65_536]}], BS)
    assert chat[:-1] == whole[:len(chat) - 1]  # the same blocks, but for the one a token cut may straddle


def test_a_chat_is_rendered_only_as_far_as_its_first_prefix_max_chars_and_reads_the_same(tmp_path):
    """A 10 MB message, or 10,000 messages, through the chat template: each text cut at the cap and no message after
    the texts fill it is rendered (what the template would render of the rest lies past the cap anyway)."""
    from lora_affinity_lab.bench.tokenizer_files import CHAT_TEMPLATE
    from lora_affinity_plugin.kv.tokenization import PromptTokenizer

    train_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "chat.jinja").write_text(CHAT_TEMPLATE)
    tokenizer = PromptTokenizer(str(tmp_path / "tokenizer.json"), str(tmp_path / "chat.jinja"))
    rendered: list[int] = []
    real = tokenizer._template.render
    tokenizer._template.render = lambda **kw: rendered.append(len(kw["messages"])) or real(**kw)
    cap = 4_096
    system = {"role": "system", "content": "billing rules weather " * 100}
    many = [system] + [{"role": "user" if i % 2 else "assistant", "content": f"question {i} " * 5} for i in range(10_000)]
    chats = tokenizer.chains(7, many, BS, max_chars=cap)
    assert rendered[-1] < 200  # the messages that fill the cap, not 10,000
    uncut = PromptTokenizer(str(tmp_path / "tokenizer.json"), str(tmp_path / "chat.jinja"))
    (whole,) = uncut.chains(7, many[:300], BS, max_chars=cap)  # (the full rendering's head, cut alike)
    assert chats == [whole]
    huge = [{"role": "user", "content": "weather answer " * 700_000}]  # about 10 MB
    cut = tokenizer.chains(7, huge, BS, max_chars=cap)
    assert cut == uncut.chains(7, [{"role": "user", "content": huge[0]["content"][:cap]}], BS, max_chars=cap)


async def test_a_restart_whose_first_batches_were_missed_is_seen_by_a_newer_batch_with_a_lower_number():
    subscriber = KVEventSubscriber({"p": EventEndpoints("tcp://127.0.0.1:1")})
    stream, ep = subscriber.streams["p"], subscriber.endpoints["p"]
    prompts = [[i * 1000 + t for t in range(BS)] for i in range(4)]
    for seq in range(3):
        await subscriber._receive("p", ep, stream, seq, encode_batch(EventBatch(100.0 + seq, (stored([seq], None, prompts[seq]),))))
    await subscriber._receive("p", ep, stream, 1, encode_batch(EventBatch(101.0, (stored([1], None, prompts[1]),))))
    assert stream.restarts == 0 and subscriber.index.size("p") == 3  # a replayed copy: nothing new
    # The server restarted; its batch 0 (the clear) never arrived; batch 1 of the new server is newer than 102.
    await subscriber._receive("p", ep, stream, 1, encode_batch(EventBatch(200.0, (stored([9], None, prompts[3]),))))
    assert stream.restarts == 1 and stream.partial and subscriber.index.size("p") == 1
    assert subscriber.index.match("p", keys(prompts[3])) == 1 and subscriber.index.match("p", keys(prompts[0])) == 0


async def test_a_follower_that_dies_of_an_error_is_started_again_counted_and_its_pod_marked_partial(monkeypatch):
    monkeypatch.setattr(kv_subscriber, "FOLLOWER_RESTART_S", 0.05)
    subscriber = KVEventSubscriber({"p": EventEndpoints("tcp://127.0.0.1:1")})
    calls = []

    async def failing(pod, endpoints, stop):
        calls.append(pod)
        if len(calls) < 3:
            raise RuntimeError("a bug in following")
        await stop.wait()

    monkeypatch.setattr(subscriber, "_follow", failing)
    stop = asyncio.Event()
    task = asyncio.create_task(subscriber.run(stop))
    await _until(lambda: len(calls) == 3)
    stream = subscriber.streams["p"]
    assert stream.follower_restarts == 2 and stream.partial
    stop.set()
    await task


async def test_a_gap_lost_past_the_replay_buffer_forgets_what_it_can_no_longer_vouch_for():
    """Removals among the lost batches would leave blocks the engine dropped: the index forgets its old blocks,
    keeps what came after the gap, and is partial (proxies count their inferred index too)."""
    async with _following(5) as (publisher, subscriber, stream):
        prompts = [[i * 1000 + t for t in range(BS)] for i in range(60)]
        seq = await _publish_until_live(publisher, stream, prompts)
        publisher.dropped_next = 20  # more than its replay buffer keeps
        for i in range(seq + 1, seq + 21):
            publisher.publish([stored([10_000 + i], None, prompts[i])])
        last = seq + 21
        publisher.publish([stored([10_000 + last], None, prompts[last])])
        await _until(lambda: stream.last_seq == last)
        assert (stream.gaps_lost, stream.partial) == (1, True), stream
        assert subscriber.index.match("p", keys(prompts[0])) == 0  # from before the gap: forgotten
        assert all(subscriber.index.match("p", keys(prompts[i])) == 1 for i in range(last - 4, last + 1))


def test_an_index_is_held_to_its_engines_block_count_oldest_first_on_every_pod():
    """Removals lost for good leave blocks the engine dropped: past the engine's block count (its page's
    num_gpu_blocks) the blocks stored longest ago are forgotten, on each of 64 pods."""
    from lora_affinity_plugin.scraping.kv_follow import KVEventSharing
    from lora_affinity_plugin.routing.podstate import PodMetrics
    from lora_affinity_plugin.fleet.store import PodRecord

    sharing = KVEventSharing({f"p{i}": EventEndpoints(f"tcp://127.0.0.1:{i + 1}") for i in range(64)})
    sharing.subscriber = KVEventSubscriber(sharing.endpoints)
    index = sharing.subscriber.index
    prompts = [[i * 1000 + t for t in range(BS)] for i in range(150)]
    for i in range(64):
        for n in range(150):  # 150 stored, none removed; the engine has 100 blocks
            index.apply(f"p{i}", EventBatch(float(n), (stored([n], None, prompts[n]),)))
    sharing.bound([PodRecord(f"p{i}", 0.0, PodMetrics(num_gpu_blocks=100, block_size=BS)) for i in range(64)])
    assert all(index.size(f"p{i}") == 100 for i in range(64))
    assert index.match("p7", keys(prompts[10])) == 0 and index.match("p7", keys(prompts[149])) == 1


def test_a_removal_from_another_tier_leaves_the_gpus_block_and_its_stores_are_not_the_gpus():
    """vLLM's KV offloading names the CPU copy of a block by the same hash: dropping that copy is not the GPU's."""
    index = ExactIndex()
    prompt = list(range(BS))
    gpu = BlockStored((1,), None, tuple(prompt), BS, None, "GPU")
    cpu_only = BlockStored((2,), None, tuple(t + 500 for t in prompt), BS, None, "CPU")
    index.apply("p", EventBatch(0.0, (gpu, BlockStored((1,), None, tuple(prompt), BS, None, "CPU"), cpu_only)))
    index.apply("p", EventBatch(1.0, (BlockRemoved((1,), "CPU"),)))
    assert index.match("p", keys(prompt)) == 1 and index.match("p", keys([t + 500 for t in prompt])) == 0
    index.apply("p", EventBatch(2.0, (BlockRemoved((1,), "GPU"),)))
    assert index.match("p", keys(prompt)) == 0


def test_a_hybrid_models_sliding_window_group_and_a_remote_tier_leave_the_full_attention_blocks():
    """vLLM 0.34 names each event's KV-cache group: a hybrid model's sliding-window (or mamba) group holds the same
    hashes as its full-attention group and drops them as the window moves on, which must not drop the
    full-attention block a prompt's hit is bounded by. A REMOTE tier's events are not this engine's."""
    index = ExactIndex()
    a, b, c = list(range(BS)), [t + 100 for t in range(BS)], [t + 200 for t in range(BS)]
    index.apply("p", EventBatch(0.0, (grouped(stored([1], None, a), 0, "sliding_window"),
                                      grouped(stored([1], None, a), 1, "full_attention"))))
    assert index.held_by_hash("p").group == 1 and index.match("p", keys(a)) == 1
    index.apply("p", EventBatch(1.0, (grouped(stored([2], 1, b), 0, "sliding_window"),
                                      grouped(stored([2], 1, b), 1, "full_attention"),
                                      grouped(BlockRemoved((1,), "GPU"), 0))))  # out of the window
    assert index.match("p", keys(a + b)) == 2
    index.apply("p", EventBatch(2.0, (grouped(stored([3], None, c), 1, "full_attention", "REMOTE"),
                                      grouped(BlockRemoved((2,), "GPU"), 1, locality="REMOTE"))))
    assert index.match("p", keys(c)) == 0 and index.match("p", keys(a + b)) == 2
    index.apply("p", EventBatch(3.0, (grouped(BlockRemoved((2,), "GPU"), 1, locality="LOCAL"),)))
    assert index.match("p", keys(a + b)) == 1  # the full-attention group's own removal
    # A model with no full-attention group is followed on the first group it names; a full-attention group
    # named later (a mid-batch start) takes over from a clean slate.
    index.apply("q", EventBatch(0.0, (grouped(stored([5], None, a), 0, "mamba"),)))
    assert index.match("q", keys(a)) == 1
    index.apply("q", EventBatch(1.0, (grouped(stored([6], None, b), 2, "full_attention"),
                                      grouped(stored([7], None, c), 0, "mamba"))))
    assert (index.match("q", keys(a)), index.match("q", keys(b)), index.match("q", keys(c))) == (0, 1, 0)
    assert index.held_by_hash("q").group == 2


async def test_vllms_own_hybrid_model_events_are_followed_on_the_full_attention_group():
    """vLLM 0.34's own publisher and structs, a hybrid model's events as it sends them: every block stored in a
    sliding-window and a full-attention group, the window's removals, and a REMOTE tier's store."""
    import vllm_wheels

    vllm = vllm_wheels.publisher_module(vllm_wheels.NEWEST)
    pub_port, replay_port, (publisher,) = _vllm_publishers(vllm, [0], buffer_steps=100, topic="kv")
    prompts = [[i * 1000 + t for t in range(BS)] for i in range(4)]

    def store(h, parent, tokens, group, kind, locality=None):
        return vllm.BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=tokens, block_size=BS,
                                lora_id=None, medium="GPU", lora_name=None, group_idx=group, kv_cache_spec_kind=kind,
                                kv_cache_spec_sliding_window=BS if kind == "sliding_window" else None,
                                locality=locality)

    def batch(*events):
        return vllm.KVEventBatch(ts=time.time(), events=list(events))

    subscriber = KVEventSubscriber({"p": EventEndpoints(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}",
                                                        topic="kv")})
    stop = asyncio.Event()
    follow = asyncio.create_task(subscriber.run(stop))
    try:
        publisher.publish(batch(store(1, None, prompts[0], 0, "sliding_window"),
                                store(1, None, prompts[0], 1, "full_attention")))
        publisher.publish(batch(store(2, 1, prompts[1], 0, "sliding_window"), store(2, 1, prompts[1], 1, "full_attention"),
                                vllm.BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0)))
        publisher.publish(batch(store(3, None, prompts[2], 1, "full_attention", locality="REMOTE")))
        await _until(lambda: subscriber.streams["p"].last_seq == 2)
        index = subscriber.index
        assert index.match("p", keys(prompts[0] + prompts[1])) == 2 and index.match("p", keys(prompts[2])) == 0
        publisher.publish(batch(vllm.BlockRemoved(block_hashes=[2], medium="GPU", group_idx=1)))
        await _until(lambda: subscriber.streams["p"].last_seq == 3)
        assert index.match("p", keys(prompts[0] + prompts[1])) == 1 and subscriber.streams["p"].bad_payloads == 0
    finally:
        stop.set()
        await follow
        publisher.shutdown()
