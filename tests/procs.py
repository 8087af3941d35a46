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


CLI = [sys.executable, "-m", "lora_affinity_plugin.ops.cli", "--log-level", "WARNING"]


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


DECISION_LINE = ") among ["
"""What the strategy logs at DEBUG for every decision of its rules (LiteLLM's own pick logs none)."""


def debug_env() -> dict[str, str]:
    """A proxy's environment with the plugin's DEBUG log, whose decision lines `Decisions` counts."""
    return child_env(LORA_AFFINITY_LOG_LEVEL="DEBUG")


class Decisions:
    """Counts the plugin's decisions in proxies' logs since it was made: a routing test checks that the rules
    decided (no request fell back to LiteLLM's pick), so it cannot pass on a fallback that happened to agree."""

    def __init__(self, *procs: Proc) -> None:
        self.procs = procs
        self.before = [proc.log().count(DECISION_LINE) for proc in procs]

    def count(self) -> int:
        return sum(proc.log().count(DECISION_LINE) - b for proc, b in zip(self.procs, self.before))
