"""`lora-affinity bench --scenario kv-events`: one subscriber against many pods' KV events.

A separate process runs `--pods` publishers (the simulator's, over TCP on this machine), each sending as fast as
it can batches like a busy engine's: a few blocks of 16 tokens stored, as many of its older blocks removed. The
subscriber (the scraper's, in this process) follows them all for `--seconds`. Printed: the events it applied
per second against the rate the simulated fleet publishes at its highest prefill rate, the batches it lost, the
exact index's memory with every pod's cache full, the Redis bytes the proxies read per interval (change
sets) and on a reload (the snapshot), and the checkpoints a scraper writes for the next one (`kv_checkpoint.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time
import tracemalloc

from lora_affinity_plugin.kv.exact_index import ExactIndex
from lora_affinity_plugin.kv.exact_share import encode_changes
from lora_affinity_plugin.kv.kv_checkpoint import PodCheckpoint, decode_checkpoint, encode_checkpoint
from lora_affinity_plugin.kv.kv_events import BlockRemoved, BlockStored, EventBatch
from lora_affinity_plugin.scraping.kv_follow import CHECKPOINT_EVERY_S
from lora_affinity_plugin.kv.kv_subscriber import EventEndpoints, KVEventSubscriber
from lora_affinity_plugin.routing.podstate import PREFILL_OVERHEAD_S, PREFILL_S_PER_TOKEN

BLOCK = 16
BLOCKS_PER_BATCH = 8
CACHE_BLOCKS = 7_000
"""A 7B model's KV cache on an 80 GB GPU, in blocks of 16 tokens (what `index-memory` assumes too)."""


def _blocks(pod: int, n: int) -> list[int]:
    return [pod * 10_000_000 + i for i in range(n)]


def _publish(ports: list[tuple[int, int]], seconds: float, ready) -> None:
    """Each publisher stores BLOCKS_PER_BATCH new blocks per batch and removes as many old ones, in turn."""
    from lora_affinity_lab.sim.kv_publisher import KVEventPublisher, KVEventsConfig

    async def main() -> None:
        publishers = [KVEventPublisher(KVEventsConfig(True, "zmq", f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}",
                                                      buffer_steps=1_000)) for p, r in ports]
        replays = [asyncio.create_task(p.serve_replay()) for p in publishers]
        ready.set()
        await asyncio.sleep(1.0)  # the subscriber connects
        tokens = tuple(range(BLOCK * BLOCKS_PER_BATCH))
        step = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for i, publisher in enumerate(publishers):
                first = step * BLOCKS_PER_BATCH
                hashes = tuple(i * 10_000_000 + first + j for j in range(BLOCKS_PER_BATCH))
                events = [BlockStored(hashes, None, tokens, BLOCK, None, "GPU", f"adapter-{step % 8}")]
                if first >= CACHE_BLOCKS:
                    events.append(BlockRemoved(tuple(h - CACHE_BLOCKS for h in hashes), "GPU"))
                publisher.publish(events)
            step += 1
            if step % 16 == 0:
                await asyncio.sleep(0)  # the replay sockets get a turn
        await asyncio.sleep(2.0)
        for task in replays:
            task.cancel()
        for publisher in publishers:
            publisher.close()

    asyncio.run(main())


def fleet_event_rate(pods: int) -> float:
    """Block events per second a fleet of `pods` publishes at the simulator's highest prefill rate: every step a
    prefill of max_num_batched_tokens (4,096) tokens, each full block stored and, with the cache full, as many
    removed."""
    tokens = 4_096
    step_s = PREFILL_OVERHEAD_S + PREFILL_S_PER_TOKEN * tokens
    return pods * 2 * (tokens / BLOCK) / step_s


async def _follow(ports: list[tuple[int, int]], seconds: float) -> KVEventSubscriber:
    endpoints = {f"pod-{i}": EventEndpoints(f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}")
                 for i, (p, r) in enumerate(ports)}
    subscriber = KVEventSubscriber(endpoints, ExactIndex())
    stop = asyncio.Event()
    task = asyncio.create_task(subscriber.run(stop))
    await asyncio.sleep(seconds)
    stop.set()
    await task
    return subscriber


def _index_memory(pods: int) -> tuple[float, int, int, int, int, float]:
    """MB the exact index takes with every pod's cache full, the snapshot's bytes, one interval's change set at the
    fleet's highest prefill rate, and every pod's checkpoint: bytes with 64-bit block hashes (vLLM's builtin and
    xxhash algorithms), bytes with 32-byte ones (sha256), and the seconds encoding them took."""
    tracemalloc.start()
    index = ExactIndex()
    tokens = tuple(range(BLOCK * BLOCKS_PER_BATCH))
    for pod in range(pods):
        for first in range(0, CACHE_BLOCKS, BLOCKS_PER_BATCH):
            hashes = tuple(pod * 10_000_000 + first + j for j in range(BLOCKS_PER_BATCH))
            index.apply(f"pod-{pod}", EventBatch(0.0, (BlockStored(hashes, None, tokens, BLOCK, None, "GPU",
                                                                   f"adapter-{first}"),)))
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    index.take_changes()
    snapshot = len(encode_changes(index.snapshot()))
    started = time.perf_counter()
    checkpoints = [encode_checkpoint(_checkpoint_of(index, f"pod-{pod}", lambda h: h + (1 << 62)))
                   for pod in range(pods)]
    encoding_s = time.perf_counter() - started
    sha256 = len(encode_checkpoint(_checkpoint_of(index, "pod-0", lambda h: h.to_bytes(32, "big")))) * pods
    per_interval = int(fleet_event_rate(pods) * 0.2 / 2)  # stored in 200 ms; as many removed
    for pod in range(pods):
        for first in range(CACHE_BLOCKS, CACHE_BLOCKS + per_interval // pods, BLOCKS_PER_BATCH):
            hashes = tuple(pod * 10_000_000 + first + j for j in range(BLOCKS_PER_BATCH))
            index.apply(f"pod-{pod}", EventBatch(0.0, (
                BlockStored(hashes, None, tokens, BLOCK, None, "GPU", f"adapter-{first}"),
                BlockRemoved(tuple(h - CACHE_BLOCKS for h in hashes), "GPU"))))
    return (size / 1e6, snapshot, len(encode_changes(index.take_changes())), sum(map(len, checkpoints)), sha256,
            encoding_s)


def _checkpoint_of(index: ExactIndex, pod: str, hashed) -> PodCheckpoint:
    """The pod's checkpoint, its block hashes widened by `hashed` to a real engine's (the benchmark's are small)."""
    blocks = index.held_by_hash(pod)
    return PodCheckpoint(0, 0.0, False, blocks.block_size, blocks.unresolved,
                         {hashed(h): key for h, key in blocks.by_hash.items()})


GAP = 1_000
ROUNDS = 5


async def _until(check, timeout_s: float = 30.0) -> float:
    """Seconds until `check()` holds (polled every millisecond); inf past the timeout."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout_s:
            return float("inf")
        await asyncio.sleep(0.001)
    return time.monotonic() - started


async def _recovery(ports: tuple[int, int]) -> dict[str, list[float]]:
    """Seconds until one pod's index is exact again, per round: after a gap of GAP batches that a later batch
    reveals; after GAP lost batches that nothing follows (the quiet-pod catch-up finds them); for a new subscriber
    started from the checkpoint of a pod that published GAP batches since; after a restart."""
    from lora_affinity_lab.sim.kv_publisher import KVEventPublisher, KVEventsConfig

    pub, replay = ports
    publisher = KVEventPublisher(KVEventsConfig(True, "zmq", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}",
                                                buffer_steps=4 * GAP))
    serving = asyncio.create_task(publisher.serve_replay())
    subscriber = KVEventSubscriber({"pod": EventEndpoints(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")},
                                   ExactIndex())
    stop = asyncio.Event()
    following = asyncio.create_task(subscriber.run(stop))
    stored = 0

    def publish(count: int) -> None:
        nonlocal stored
        for _ in range(count):
            hashes = tuple(range(stored, stored + BLOCKS_PER_BATCH))
            tokens = tuple(range(stored * BLOCK, (stored + BLOCKS_PER_BATCH) * BLOCK))  # the index keys by tokens
            publisher.publish([BlockStored(hashes, None, tokens, BLOCK, None, "GPU", None)])
            stored += BLOCKS_PER_BATCH

    def exact() -> bool:
        return subscriber.index.size("pod") == stored and not subscriber.streams["pod"].partial

    times: dict[str, list[float]] = {"gap": [], "quiet": [], "resume": [], "restart": []}
    try:
        for _ in range(ROUNDS):
            stream = subscriber.streams["pod"]
            while not exact():  # connected and caught up: a fresh start, or after the last round's restart
                publish(1)
                await asyncio.sleep(0.05)
            publisher.dropped_next = GAP
            publish(GAP + 1)  # the last one arrives and reveals the gap
            times["gap"].append(await _until(exact))
            publisher.dropped_next = GAP
            publish(GAP)  # lost, and nothing after them
            times["quiet"].append(await _until(exact))
            checkpoint = decode_checkpoint(encode_checkpoint(subscriber.checkpoint("pod")))  # what Redis keeps
            publish(GAP)  # while every scraper is down
            successor = KVEventSubscriber(dict(subscriber.endpoints), ExactIndex(), checkpoints={"pod": checkpoint})
            stopping = asyncio.Event()
            resuming = asyncio.create_task(successor.run(stopping))
            times["resume"].append(await _until(lambda: successor.streams["pod"].resumed and not
                                                successor.streams["pod"].partial and successor.index.size("pod") == stored))
            stopping.set()
            await resuming
            restarts = stream.restarts
            publisher.restart()
            stored = 0
            times["restart"].append(await _until(lambda: stream.restarts > restarts and subscriber.index.size("pod") == 0))
    finally:
        stop.set()
        await following
        serving.cancel()
        publisher.close()
    return times


def run_kv_events(args: argparse.Namespace) -> int:
    from lora_affinity_lab.processes import free_port_range

    pods, seconds = args.pods, args.seconds
    base, replay = free_port_range(pods), free_port_range(pods)
    ports = [(base + i, replay + i) for i in range(pods)]
    ready = multiprocessing.Event()
    publisher = multiprocessing.Process(target=_publish, args=(ports, seconds, ready), daemon=True)
    publisher.start()
    ready.wait(30)
    started = time.monotonic()
    subscriber = asyncio.run(_follow(ports, seconds + 1.5))
    elapsed = time.monotonic() - started
    publisher.join(10)
    streams = subscriber.streams.values()
    events = sum(s.events for s in streams)
    applied = sum(s.batches for s in streams)
    lost = sum(s.lost for s in streams)
    print(f"kv-events: {pods} publishers in another process for {seconds:g} s, one subscriber in this one")
    print(f"  batches applied {applied}, block events {events * BLOCKS_PER_BATCH:,} "
          f"({events * BLOCKS_PER_BATCH / elapsed:,.0f}/s); gaps {sum(s.gaps for s in streams)}, "
          f"replayed {sum(s.replayed for s in streams)}, lost {lost}")
    need = fleet_event_rate(pods)
    rate = events * BLOCKS_PER_BATCH / elapsed
    print(f"  the simulated fleet's highest prefill rate publishes {need:,.0f} block events/s: "
          f"{'kept up' if rate >= need else 'fell behind'} ({rate / need:.2f}x)")
    memory, snapshot, interval, checkpoints, sha256, encoding_s = _index_memory(pods)
    print(f"  exact index with {pods} pods x {CACHE_BLOCKS:,} blocks: {memory:.0f} MB in the scraper; a proxy's "
          f"snapshot read {snapshot / 1e6:.1f} MB; one 200 ms interval's change set at that rate {interval / 1e3:.0f} KB "
          f"({interval * 5 / 1e6:.1f} MB/s per proxy)")
    print(f"  checkpoints of every pod, kept in Redis for the next scraper: {checkpoints / 1e6:.1f} MB with 64-bit "
          f"block hashes, {sha256 / 1e6:.1f} MB with sha256 ones; encoded in {encoding_s * 1000:.0f} ms, written every "
          f"{CHECKPOINT_EVERY_S:g} s ({checkpoints / CHECKPOINT_EVERY_S / 1e6:.2f}-{sha256 / CHECKPOINT_EVERY_S / 1e6:.2f} "
          f"MB/s when every pod's cache changes)")
    recovery = asyncio.run(_recovery((free_port_range(1), free_port_range(1))))
    print(f"  recovery, one pod, medians of {ROUNDS} rounds (until its index holds exactly what it published):")
    for label, what in (("gap", f"{GAP:,} batches lost, the next one arrives"),
                        ("quiet", f"{GAP:,} batches lost, nothing after them"),
                        ("resume", f"a new scraper from the checkpoint, {GAP:,} batches published since"),
                        ("restart", "the server restarts (sequence 0, AllBlocksCleared)")):
        print(f"    {what}: {statistics.median(recovery[label]) * 1000:.0f} ms "
              f"(max {max(recovery[label]) * 1000:.0f} ms)")
    unrecovered = sum(t == float("inf") for times in recovery.values() for t in times)
    return 0 if lost == 0 and not unrecovered else 1
