"""Real multi-node Redis for tests: a Sentinel setup (master, replica, sentinel) and a 3-master Cluster.

Both are plain `redis-server` processes (the Debian package has no separate sentinel binary:
`redis-server conf --sentinel` is the same thing), stopped with their process groups.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import redis
from procs import Proc, free_port, wait_port

SERVICE = "lora-master"


def _server(name: str, port: int, tmp: Path, *extra: str) -> Proc:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (bash .ci/run installs it)")
    proc = Proc(name, [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                       "--dir", str(tmp), *extra], tmp)
    wait_port(port)
    return proc


@contextmanager
def sentinel_setup(tmp: Path) -> Iterator[dict]:
    """Master + replica watched by one sentinel (quorum 1, down after 500 ms): yields ports, procs and the URL."""
    master, replica, sentinel = free_port(), free_port(), free_port()
    procs: dict[str, Proc] = {}
    try:
        procs["master"] = _server("redis-master", master, tmp)
        procs["replica"] = _server("redis-replica", replica, tmp, "--replicaof", "127.0.0.1", str(master))
        conf = tmp / "sentinel.conf"
        conf.write_text(f"port {sentinel}\nbind 127.0.0.1\ndir {tmp}\n"
                        f"sentinel monitor {SERVICE} 127.0.0.1 {master} 1\n"
                        f"sentinel down-after-milliseconds {SERVICE} 500\n"
                        f"sentinel failover-timeout {SERVICE} 2000\n")
        procs["sentinel"] = Proc("redis-sentinel", [shutil.which("redis-server"), str(conf), "--sentinel"], tmp)
        wait_port(sentinel)
        _wait(lambda: redis.Redis(port=replica).info("replication").get("master_link_status") == "up", "replica sync")
        yield {"master": master, "replica": replica, "sentinel": sentinel, "procs": procs,
               "url": f"redis+sentinel://127.0.0.1:{sentinel}/{SERVICE}/0"}
    finally:
        for proc in procs.values():
            proc.stop()


@contextmanager
def cluster_setup(tmp: Path, masters: int = 3) -> Iterator[dict]:
    """`masters` cluster-enabled servers joined by `redis-cli --cluster create`: yields ports, procs and the URL."""
    ports = [free_port() for _ in range(masters)]
    procs: dict[str, Proc] = {}
    try:
        for port in ports:  # the bus port is named: the default (port + 10000) may not exist
            procs[f"node-{port}"] = _server(f"redis-node-{port}", port, tmp, "--cluster-enabled", "yes",
                                            "--cluster-port", str(free_port()), "--cluster-config-file",
                                            f"nodes-{port}.conf", "--cluster-node-timeout", "2000")
        subprocess.run([shutil.which("redis-cli"), "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        _wait(lambda: all(redis.Redis(port=p).cluster("info")["cluster_state"] == "ok" for p in ports), "cluster ok")
        yield {"ports": ports, "procs": procs, "url": "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports[:2])}
    finally:
        for proc in procs.values():
            proc.stop()


def _wait(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{what} not reached in {timeout} s")
