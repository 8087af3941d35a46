"""Child processes for the demo, live benchmarks and end-to-end tests: Redis, LiteLLM proxies, our workers.

Every process runs in its own session and is stopped with its whole group, so Ctrl-C or the end of
a run leaves nothing behind.
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import httpx
import yaml

MASTER_KEY = os.environ.get("LITELLM_MASTER_KEY", "sk-lora-affinity-local")


_HANDED_OUT: deque[int] = deque(maxlen=1024)
"""Ports `free_port` gave out lately in this process."""


def free_port() -> int:
    """A port free now that this process has not given out lately.

    Callers pick several ports before starting what binds them, and the kernel offers a port just
    closed again: the soak once gave Redis and a replica the same one, and the replica never started."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.append(port)
            return port
    raise RuntimeError("no free port that this process has not given out lately")


def free_port_range(count: int) -> int:
    """A base port with `count` free consecutive ports after it.

    Searched below the kernel's ephemeral range (32768+), where client connections in TIME_WAIT would
    scatter conflicts over any long run of ports.
    """
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10_000, 32_768 - count)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on port {port} after {timeout}s")


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
        "LITELLM_TELEMETRY_DISABLED": "true",
        # Offline: LiteLLM would try to fetch a tokenizer for Hugging Face-style names (~46 s per stream).
        "HF_HUB_OFFLINE": "1",
        "LITELLM_MASTER_KEY": MASTER_KEY,
        "PYTHONUNBUFFERED": "1",
        # A crash in native code (a C or Rust extension) leaves every thread's Python stack in the log.
        "PYTHONFAULTHANDLER": "1",
        # LiteLLM's own pool (hosted_vllm chat) keeps idle connections 15 s, the model servers 5 s: a request
        # written on one the server is closing fails (HTTP 500). deploy/Dockerfile sets the same.
        "AIOHTTP_KEEPALIVE_TIMEOUT": os.environ.get("AIOHTTP_KEEPALIVE_TIMEOUT", "4"),
    })
    env.update(extra)
    return env


class Proc:
    """A child process whose output goes to a log file, stopped (with its group) on close."""

    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None):
        self.name = name
        self.embedded = False
        self._stopped = False
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env or child_env(),
                                      start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        code = self.popen.poll()
        if code is not None:
            if code != 0 and not self._stopped:  # it died on its own: what failed after needs its last words
                self._report_early_exit(code)
        else:
            try:
                os.killpg(self.popen.pid, sig)
                self.popen.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self._stopped = True
        self._log.close()

    def _report_early_exit(self, code: int) -> None:
        tail = self.log()[-2000:] if self.log_path.exists() else ""
        print(f"{self.name} had exited (code {code}) before it was stopped; its log ends:\n{tail}", file=sys.stderr)


def redis_server(port: int, log_dir: Path, allow_embedded: bool = False) -> Proc:
    """A real redis-server on `port`; with `allow_embedded`, fakeredis's TCP server when none is installed."""
    binary = shutil.which("redis-server")
    if binary is not None:
        proc = Proc(f"redis-{port}", [binary, "--port", str(port), "--save", "", "--appendonly", "no",
                                      "--bind", "127.0.0.1"], log_dir)
    elif allow_embedded:
        code = f"from fakeredis import TcpFakeServer; TcpFakeServer(('127.0.0.1', {port})).serve_forever()"
        proc = Proc(f"fakeredis-{port}", [sys.executable, "-c", code], log_dir)
        proc.embedded = True
    else:
        raise RuntimeError("redis-server is not installed (bash .ci/run installs it)")
    wait_port(port)
    return proc


def proxy_config(pod_ports: list[int], redis_port: int, routing_strategy: str | None = None,
                 **plugin: object) -> dict:
    """A proxy config over wildcard deployments, one per pod: with the plugin, or a LiteLLM built-in."""
    config: dict = {
        "model_list": [
            {"model_name": "*", "litellm_params": {"model": "hosted_vllm/*", "api_base": f"http://127.0.0.1:{p}/v1",
                                                   "api_key": "none"}}
            for p in pod_ports
        ],
        "litellm_settings": {"request_timeout": 3600},
        "router_settings": {"num_retries": 0},
        "general_settings": {"master_key": "os.environ/LITELLM_MASTER_KEY"},
    }
    if routing_strategy is None:
        config["litellm_settings"]["callbacks"] = ["lora_affinity_plugin.strategy.proxy_plugin"]
        config["lora_affinity"] = {"redis_url": f"redis://127.0.0.1:{redis_port}/0", "scrape_interval_ms": 100,
                                   **plugin}
    else:
        config["router_settings"]["routing_strategy"] = routing_strategy
    return config


def write_config(path: Path, pod_ports: list[int], redis_port: int, **plugin: object) -> Path:
    path.write_text(yaml.safe_dump(proxy_config(pod_ports, redis_port, **plugin)))
    return path


def start_litellm_proxy(config: Path, port: int, log_dir: Path, name: str = "proxy", env: dict | None = None,
                        workers: int = 1) -> Proc:
    """`litellm --config`; with `workers` > 1, uvicorn's worker processes (each a gateway with its own view)."""
    litellm_bin = str(Path(sys.executable).with_name("litellm"))
    return Proc(name, [litellm_bin, "--config", str(config), "--port", str(port), "--host", "127.0.0.1",
                       "--num_workers", str(workers)], log_dir, env=env)


def wait_proxy(proc: Proc, port: int, timeout: float = 120.0) -> Proc:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"proxy exited: {proc.log()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/liveliness", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.stop()
    raise TimeoutError(f"proxy did not start: {proc.log()[-3000:]}")


def litellm_proxy(config: Path, port: int, log_dir: Path, name: str = "proxy", env: dict | None = None) -> Proc:
    """A started proxy. One that never answered within `wait_proxy`'s timeout is started once more (said on
    stderr): in one of twelve CI runs a proxy's start stalled right after LiteLLM's start-up,
    on a busy 2-core machine, and alone the same stack starts in seconds. A proxy that exits is an error at
    once."""
    try:
        return wait_proxy(start_litellm_proxy(config, port, log_dir, name, env), port)
    except TimeoutError as stalled:
        print(f"{name} did not start within its timeout; starting it once more. Its log's end:\n"
              f"{str(stalled)[-1500:]}", file=sys.stderr)
        return wait_proxy(start_litellm_proxy(config, port, log_dir, f"{name}-again", env), port)


def lora_affinity(args: list[str], log_dir: Path, name: str, env: dict | None = None) -> Proc:
    return Proc(name, [sys.executable, "-m", "lora_affinity_plugin.ops.cli", *args], log_dir, env=env)


_SCRATCH: list[Path] = []
_KEEP_SCRATCH = False


def scratch_dir(prefix: str) -> Path:
    """A temporary folder for a run's logs and configs, removed when the process exits normally.

    Kept (and named on stderr) when the run dies of an exception, or with LORA_AFFINITY_KEEP_LOGS=1.
    """
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if not _SCRATCH:
        atexit.register(_remove_scratch)
        previous = sys.excepthook

        def keep_on_crash(*exc_info) -> None:
            global _KEEP_SCRATCH
            _KEEP_SCRATCH = True
            previous(*exc_info)

        sys.excepthook = keep_on_crash
    _SCRATCH.append(path)
    return path


def keep_scratch() -> None:
    """Keep this run's scratch folders at exit (and name them on stderr)."""
    global _KEEP_SCRATCH
    _KEEP_SCRATCH = True


def _remove_scratch() -> None:
    keep = _KEEP_SCRATCH or os.environ.get("LORA_AFFINITY_KEEP_LOGS") == "1"
    for path in _SCRATCH:
        if keep:
            print(f"logs kept in {path}", file=sys.stderr)
        else:
            shutil.rmtree(path, ignore_errors=True)
