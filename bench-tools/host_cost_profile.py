"""Where the plugin's proxy spends its CPU: the host-cost fleets (LiteLLM alone and with the plugin, 16 KB chats,
the engines' KV events), one request kind sent to each proxy in turn while py-spy samples it. Prints each proxy's
CPU per request and the plugin's own share of its proxy's samples: stacks whose innermost `lora_affinity_plugin`
frame calls no LiteLLM or Starlette code below it (its decision, tokenizing and matching, the refresh). That
share reads the plugin's cost without the pace of the machine, which moves the side-by-side ratio by up to 10%
between turns (see docs/benchmarks.md, "The plugin's cost to its host").

Needs py-spy (`pip install py-spy`) and permission to read another process (root, or ptrace allowed).

    .venv/bin/python bench-tools/host_cost_profile.py chat-stream 300
"""

from __future__ import annotations

import collections
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from lora_affinity_lab.bench.host_cost import KINDS, OUTPUT_TOKENS, REAL_TIME, SPEED, STRATEGIES, _turn
from lora_affinity_lab.bench.live import Fleet
from lora_affinity_lab.bench.scenarios import get_scenario
from lora_affinity_lab.bench.tokenizer_files import write_tokenizer_files
from lora_affinity_lab.processes import free_port, redis_server, scratch_dir
from lora_affinity_plugin.settings import Settings

PROMPT_CHARS = 16384
RATE_HZ = 250
HOST_CODE = ("litellm/", "starlette/")


def own_share(raw: Path) -> tuple[int, int, collections.Counter]:
    """(samples, the plugin's own samples, its own samples by innermost plugin function) of a py-spy raw file.
    Idle worker threads parked in C (`concurrent/futures/thread.py` `_worker` as the leaf) are not CPU."""
    total, own, by_function = 0, 0, collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")[1:]
        if not frames or frames[-1].startswith("_worker (concurrent"):
            continue
        total += int(count)
        plugin = [i for i, frame in enumerate(frames) if "lora_affinity_plugin" in frame]
        if plugin and not any(code in frame for frame in frames[plugin[-1] + 1:] for code in HOST_CODE):
            own += int(count)
            by_function[frames[plugin[-1]].split(" (")[0]] += int(count)
    return total, own, by_function


def main(kind: str, requests: int) -> int:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if kind not in KINDS or not Path(spy).exists():
        raise SystemExit(f"usage: host_cost_profile.py {{{','.join(KINDS)}}} REQUESTS (py-spy installed)")
    scenario = replace(get_scenario("seed"), replicas=2, mean_output_tokens=OUTPUT_TOKENS)
    workdir = scratch_dir("lora-affinity-bench-")
    port = free_port()
    store = redis_server(port, workdir, allow_embedded=True)
    files = write_tokenizer_files(workdir / "tokenizer")
    production = {name: getattr(Settings(), name) for name in REAL_TIME}
    fleets = {}
    try:
        for strategy in STRATEGIES:
            fleets[strategy] = Fleet(scenario, strategy, SPEED, 1, 1, port, workdir, overrides=production,
                                     kv_events=files, tokenizer=files["tokenizer"]).__enter__()
        for fleet in fleets.values():  # warm-up: clients, caches, the shared index
            _turn(fleet, kind, 20, PROMPT_CHARS)
        for strategy, fleet in fleets.items():
            raw = workdir / f"profile-{strategy}.raw"
            sampler = subprocess.Popen([spy, "record", "--pid", str(fleet.proxies[0].popen.pid), "-r", str(RATE_HZ),
                                        "-f", "raw", "-o", str(raw)], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # attached before the first request
            ms, busiest, failed, seconds = _turn(fleet, kind, requests, PROMPT_CHARS)
            sampler.send_signal(2)
            sampler.wait(timeout=30)
            total, own, by_function = own_share(raw)
            print(f"{strategy}: {ms:.1f} ms CPU per {kind}, busiest worker {busiest:.0%}, {failed} failed, "
                  f"{seconds:.0f} s; samples {total}, the plugin's own {own} ({own / max(1, total):.1%})")
            for function, count in by_function.most_common(8):
                print(f"    {count:5d}  {function}")
    finally:
        for fleet in fleets.values():
            fleet.stop()
        store.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "chat-stream", int(sys.argv[2]) if len(sys.argv) > 2 else 300))
