"""Offline LiteLLM for every test, and the test helpers (procs.py, fake_pods.py) importable."""

import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS", "True")
os.environ.setdefault("LITELLM_TELEMETRY_DISABLED", "true")
sys.path.insert(0, os.path.dirname(__file__))


# --- the suite cleans up after itself -------------------------------------------------------------
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

_OURS = ("redis-server", "litellm", "lora_affinity_plugin", "lora-affinity", "page_server", "fake_pods", "hosted_api")


def _is_a_test_runner(argv: list[str]) -> bool:
    """pytest itself (`pytest ...`, `python -m pytest ...`), not the processes it starts with pytest's tmp paths."""
    head = [Path(arg).name for arg in argv[:3]]
    return any(name.startswith("pytest") or name == "py.test" for name in head[:2]) or head[1:3] == ["-m", "pytest"]


def _our_processes() -> dict[int, str]:
    """Processes this suite may start (redis-server, litellm proxies, simulators, scrapers), by pid."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        cmdline = " ".join(argv).strip()
        if any(name in cmdline for name in _OURS) and not _is_a_test_runner(argv):
            found[int(entry.name)] = cmdline[:160]
    return found


def _our_folders() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("lora-affinity-*")}


def pytest_sessionstart(session):
    session.config._before_suite = (_our_processes(), _our_folders())


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if a process it started or a temporary folder it made is still there."""
    before_procs, before_folders = session.config._before_suite
    deadline = time.monotonic() + 10
    while True:
        left = {pid: cmd for pid, cmd in _our_processes().items() if pid not in before_procs}
        folders = _our_folders() - before_folders
        if not left and not folders or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if left or folders:
        lines = [f"  process {pid}: {cmd}" for pid, cmd in left.items()] + [f"  folder {tempfile.gettempdir()}/{f}"
                                                                             for f in sorted(folders)]
        session.config.pluginmanager.get_plugin("terminalreporter").write_line(
            "the test run left behind what it started:\n" + "\n".join(lines), red=True)
        session.exitstatus = 1
