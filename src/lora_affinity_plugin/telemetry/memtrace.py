"""Memory attribution inside a running proxy, for long soaks: tracemalloc snapshots on SIGUSR1.

Off unless `LORA_AFFINITY_TRACEMALLOC` names a path prefix: then tracing starts when the plugin is
loaded, and each SIGUSR1 writes `<prefix>.<n>.snap` (tracemalloc's dump format), so a soak can compare
two of them by file and tell the plugin's allocations from LiteLLM's.
"""

from __future__ import annotations

import itertools
import os
import signal
import tracemalloc

ENV = "LORA_AFFINITY_TRACEMALLOC"
_COUNTER = itertools.count(1)


def install_from_env() -> bool:
    prefix = os.environ.get(ENV)
    if not prefix or tracemalloc.is_tracing():
        return False
    try:
        signal.signal(signal.SIGUSR1, lambda *_: tracemalloc.take_snapshot().dump(f"{prefix}.{next(_COUNTER)}.snap"))
    except ValueError:  # not the main thread: no signal handler, no tracing
        return False
    tracemalloc.start(1)  # one frame: attribution by file is all a soak needs, and deeper traces slow the proxy
    return True
