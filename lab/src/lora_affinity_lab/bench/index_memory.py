"""`bench --scenario index-memory`: what the prefix index costs a proxy at a fleet's full capacity.

Fills every pod's index to the capacity its cache size gives (distinct 16 KB prompts, 64 blocks each)
and reports the memory traced by `tracemalloc`, and what one share of new entries costs on the wire.
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc

from lora_affinity_plugin.fleet.view import FleetView
from lora_affinity_plugin.kv.prefix_index import SHARE_MAX_BLOCKS, encode_entries
from lora_affinity_plugin.routing.podstate import PodMetrics
from lora_affinity_plugin.config.settings import build_settings
from lora_affinity_plugin.fleet.store import PodRecord


def run_index_memory(args: argparse.Namespace) -> int:
    settings = build_settings({})
    rows = [(6, 700), (64, 100_000)] if not args.pods_blocks else [tuple(map(int, x.split("x")))
                                                                    for x in args.pods_blocks.split(",")]
    print(f"prefix index at capacity; block {settings.prefix_block_chars} characters, "
          f"{settings.prefix_chars_per_token} characters a token")
    print(f"{'pods':>5} {'GPU blocks/pod':>15} {'index blocks/pod':>17} {'index blocks':>13} {'memory MB':>10} {'B/block':>8}")
    for pods_count, gpu_blocks in rows:
        tracemalloc.start()
        fleet = FleetView(settings)
        pods = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(pods_count)]
        now = time.time()
        fleet.update({p: PodRecord(p, now, PodMetrics(num_gpu_blocks=gpu_blocks, block_size=16)) for p in pods})
        base = tracemalloc.get_traced_memory()[0]
        rng = random.Random(args.seed)
        capacity = fleet.prefixes.capacity(pods[0])
        for pod in pods:
            for _ in range(0, capacity, 64):
                fleet.prefixes.add(pod, [rng.getrandbits(32) for _ in range(64)], now, share=False)
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        blocks = len(fleet.prefixes)
        print(f"{pods_count:>5} {gpu_blocks:>15} {capacity:>17} {blocks:>13} {used / 1e6:>10.1f} {used / blocks:>8.0f}")
    wire = encode_entries([(f"http://10.0.0.{i}:8000", now, [rng.getrandbits(32) for _ in range(SHARE_MAX_BLOCKS // 8)])
                           for i in range(8)])
    print(f"one refresh's share at its bound ({SHARE_MAX_BLOCKS} blocks): {len(wire) / 1000:.1f} KB written")
    return 0
