"""Where the plugin's proxy spends its CPU: the host-cost fleets (LiteLLM alone and with the plugin, 16 KB chats,
the engines' KV events), one request kind sent to each proxy in turn while py-spy samples it. Prints each proxy's
CPU per request and the plugin's own share of its proxy's samples: stacks whose innermost `lora_affinity_plugin`
frame calls no LiteLLM or Starlette code below it (its decision, tokenizing and matching, the refresh); then
both proxies' samples by the package of the innermost frame, to show host code the plugin makes run. The own
share reads the plugin's cost without the pace of the machine, which moves the side-by-side ratio (and the
sample totals) by up to 10% between turns (see docs/benchmarks.md, "The plugin's cost to its host").

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
from lora_affinity_plugin.config.settings import Settings

PROMPT_CHARS = 16384
RATE_HZ = 250
HOST_CODE = ("litellm/", "starlette/")
IDLE_LEAVES = {("_worker", "concurrent/futures/thread.py"), ("Condition.wait", "threading.py"),
               ("wait", "threading.py")}


def own_share(raw: Path) -> tuple[int, int, collections.Counter]:
    """(samples, the plugin's own samples, its own samples by innermost plugin function) of a py-spy raw file."""
    total, own, by_function = 0, 0, collections.Counter()
    for frames, count in _busy_stacks(raw):
        total += count
        plugin = [i for i, frame in enumerate(frames) if "lora_affinity_plugin" in frame]
        if plugin and not any(code in frame for frame in frames[plugin[-1] + 1:] for code in HOST_CODE):
            own += count
            by_function[frames[plugin[-1]].split(" (")[0]] += count
    return total, own, by_function


def _busy_stacks(raw: Path):
    """(frames, samples) of each stack py-spy saw running: threads parked in a wait (a pool's idle workers, which
    py-spy may still report) are not CPU."""
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")[1:]
        if frames and not _parked(frames[-1]):
            yield frames, int(count)


def _parked(frame: str) -> bool:
    """A frame (`function (file:line)`, the file shortened or full) where a thread waits for work."""
    function, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    return any(function == name and path.endswith(file) for name, file in IDLE_LEAVES)


def by_leaf_package(raw: Path) -> collections.Counter:
    """Samples by the package of the innermost Python frame: where the CPU was spent, whoever called it."""
    counts = collections.Counter()
    for frames, count in _busy_stacks(raw):
        path = frames[-1].partition(" (")[2]
        if "site-packages/" in path:
            package = path.split("site-packages/")[1].split("/")[0].removesuffix(".py")
        elif "lora_affinity_plugin/" in path:
            package = "lora_affinity_plugin"
        else:  # the standard library, asyncio apart
            package = "asyncio" if "/asyncio/" in path else "the standard library"
        counts[package] += count
    return counts


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
    fleets, totals = {}, {}
    try:
        for strategy in STRATEGIES:
            fleets[strategy] = Fleet(scenario, strategy, SPEED, 1, 1, port, workdir, overrides=production,
                                     kv_events=files, tokenizer=files["tokenizer"]).__enter__()
        for fleet in fleets.values():  # warm-up: clients, caches, the shared index
            _turn(fleet, kind, 20, PROMPT_CHARS)
        for strategy, fleet in fleets.items():
            raw = workdir / f"profile-{strategy}.raw"
            sampler = subprocess.Popen([spy, "record", "--pid", str(fleet.proxies[0].popen.pid), "-r", str(RATE_HZ),
                                        "-f", "raw", "--full-filenames", "-o", str(raw)], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # attached before the first request
            ms, busiest, failed, seconds = _turn(fleet, kind, requests, PROMPT_CHARS)
            sampler.send_signal(2)
            sampler.wait(timeout=30)
            total, own, by_function = own_share(raw)
            totals[strategy] = total
            print(f"{strategy}: {ms:.1f} ms CPU per {kind}, busiest worker {busiest:.0%}, {failed} failed, "
                  f"{seconds:.0f} s; samples {total}, the plugin's own {own} ({own / max(1, total):.1%})")
            for function, count in by_function.most_common(8):
                print(f"    {count:5d}  {function}")
        # Where the samples land, by the package of the innermost frame: the same requests at the same sampling
        # rate, so host code the plugin's hooks make LiteLLM run shows as a package that gained.
        alone, plugin = (by_leaf_package(workdir / f"profile-{strategy}.raw") for strategy in STRATEGIES)
        print(f"samples by the innermost frame's package, LiteLLM alone -> with the plugin "
              f"({totals['lora-affinity'] - totals['simple-shuffle']:+d} in all):")
        for package in sorted(set(alone) | set(plugin), key=lambda p: -abs(plugin[p] - alone[p]))[:12]:
            print(f"    {alone[package]:6d} -> {plugin[package]:6d}  {plugin[package] - alone[package]:+6d}  {package}")
    finally:
        for fleet in fleets.values():
            fleet.stop()
        store.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "chat-stream", int(sys.argv[2]) if len(sys.argv) > 2 else 300))
