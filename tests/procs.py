"""Test helpers: the package's own process helpers, plus the fake vLLM pods."""

import subprocess
import sys
from pathlib import Path

from lora_affinity_lab.processes import (  # noqa: F401
    MASTER_KEY,
    Proc,
    child_env,
    free_port,
    free_port_range,
    litellm_proxy,
    lora_affinity,
    proxy_config,
    redis_server,
    wait_port,
    write_config,
)


def fake_pods(ports: list[int], log_dir: Path) -> Proc:
    """`tests/fake_pods.py` serving one pod per port, started and listening."""
    proc = Proc("pods", [sys.executable, str(Path(__file__).with_name("fake_pods.py")), *map(str, ports)], log_dir)
    for port in ports:
        wait_port(port)
    return proc


CLI = [sys.executable, "-m", "lora_affinity_plugin.cli", "--log-level", "WARNING"]


BENCH_TOOLS = Path(__file__).resolve().parents[1] / "bench-tools"


def run_bench_tool(name: str, *args: str, timeout: float = 300) -> str:
    """`bench-tools/NAME ARGS` on this checkout's source, which must succeed; its stdout."""
    out = subprocess.run([sys.executable, str(BENCH_TOOLS / name), *args], capture_output=True, text=True,
                         timeout=timeout, env=child_env(PYTHONPATH=str(BENCH_TOOLS.parent / "src")))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def run_cli(args: list[str], timeout: float = 300) -> str:
    """`lora-affinity ARGS`, which must succeed; its stdout."""
    out = subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout, env=child_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout
