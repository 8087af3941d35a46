"""vLLM's own KV-event publisher, from a released wheel, run unmodified on this machine (no GPU needed).

`publisher_module(release)` downloads the wheel once (`pip download --no-deps`, into `.ci-tools/vllm-wheels/`,
which `.ci/run` fills ahead of the tests), takes `vllm/distributed/kv_events.py` out of it and imports that file
with only its unrelated imports stubbed: the config object, the logger, network helpers and a type alias. The
sockets, framing, buffering, replay and msgpack encoding are the release's own code.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

WHEELS = Path(os.environ.get("LORA_AFFINITY_VLLM_WHEELS", Path(__file__).resolve().parents[1] / ".ci-tools" / "vllm-wheels"))
NEWEST = "0.34.0"
"""The newest vLLM release, tested in CI; `LORA_AFFINITY_VLLM_RELEASES=0.13.0,0.25.1,...` adds others."""


def releases() -> list[str]:
    extra = [r.strip() for r in os.environ.get("LORA_AFFINITY_VLLM_RELEASES", "").split(",") if r.strip()]
    return [NEWEST, *[r for r in extra if r != NEWEST]]


def _source(release: str) -> Path:
    target = WHEELS / release / "kv_events.py"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if not list(target.parent.glob("vllm-*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(target.parent),
                        f"vllm=={release}"], check=True)
    wheel = next(target.parent.glob("vllm-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        target.write_bytes(archive.read("vllm/distributed/kv_events.py"))
    wheel.unlink()  # hundreds of MB; the one file is kept
    return target


class _Config:
    """Stands in for vLLM's KVEventsConfig: the publisher only stores what it is given."""

    def __init__(self, *args, **kwargs) -> None:
        self.__dict__.update(kwargs)


class _Stub(types.ModuleType):
    """A vLLM module the publisher imports for something unrelated to its wire format."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        known = {"KVEventsConfig": _Config, "init_logger": logging.getLogger, "ExternalBlockHash": bytes | int,
                 "get_ip": lambda: "127.0.0.1"}
        return known.get(name, lambda *args, **kwargs: None)


def publisher_module(release: str) -> types.ModuleType:
    """vLLM `release`'s `vllm.distributed.kv_events`, imported under its own name."""
    source = _source(release)
    saved = {name: mod for name, mod in sys.modules.items() if name == "vllm" or name.startswith("vllm.")}
    for name in ("vllm", "vllm.config", "vllm.config.kv_events", "vllm.logger", "vllm.utils",
                 "vllm.utils.network_utils", "vllm.v1", "vllm.v1.core", "vllm.v1.core.kv_cache_utils",
                 "vllm.distributed"):
        module = _Stub(name)
        module.__path__ = []  # a package, so its submodules import
        sys.modules[name] = module
    try:
        spec = importlib.util.spec_from_file_location("vllm.distributed.kv_events", source)
        module = importlib.util.module_from_spec(spec)
        sys.modules["vllm.distributed.kv_events"] = module
        spec.loader.exec_module(module)
        return module
    finally:
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]
        sys.modules.update(saved)


if __name__ == "__main__":  # `.ci/run` fetches the files ahead of the tests, beside its other installs
    for release in releases():
        print(f"  vLLM {release}'s kv_events.py: {_source(release)}")
