"""Offline LiteLLM for every test, and the test helpers (procs.py, fake_pods.py) importable."""

import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS", "True")
os.environ.setdefault("LITELLM_TELEMETRY_DISABLED", "true")
sys.path.insert(0, os.path.dirname(__file__))


# --- the suite cleans up after itself -------------------------------------------------------------
# Each run gets a tag in the environment and a temporary folder of its own (TMPDIR), both inherited by
# everything it starts: two runs side by side (CI tests two LiteLLM releases at once) never take each
# other's processes or folders for leftovers.
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

_RUN_TAG = "LORA_AFFINITY_TEST_RUN"


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller set both up before starting it
        return
    run_dir = tempfile.mkdtemp(prefix="pytest-lora-affinity-")
    os.environ[_RUN_TAG] = uuid.uuid4().hex
    os.environ["TMPDIR"] = run_dir
    tempfile.tempdir = None  # re-read TMPDIR
    config._run_dir = run_dir


def _our_processes() -> dict[int, str]:
    """Processes started by this run (and still running): those whose environment carries its tag."""
    tag = f"{_RUN_TAG}={os.environ.get(_RUN_TAG, '')}".encode()
    mine = {os.getpid(), os.getppid()}
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ").strip()
        except OSError:
            continue
        if tag in environ and "execnet" not in cmdline and "import sys;exec(eval(" not in cmdline:
            found[int(entry.name)] = cmdline[:160]  # (the xdist workers themselves are not leftovers)
    return found


def _our_folders() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("lora-affinity-*")}


# Under pytest-xdist (README's test command) each module runs whole on one worker, in this order
# (--no-loadscope-reorder): the longest start first, so the workers finish together.
_SLOWEST_FIRST = ("test_other_releases", "test_bench_soak", "test_bench_live", "test_bench_host_cost", "test_demo", "test_e2e_host",
                  "test_e2e_pooling", "test_e2e_prometheus", "test_e2e_disconnect", "test_e2e_redis_topologies",
                  "test_e2e_settings", "test_e2e_faults", "test_e2e_hostile", "test_e2e_kv_events")


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        name = item.module.__name__ if item.module else ""
        return _SLOWEST_FIRST.index(name) if name in _SLOWEST_FIRST else len(_SLOWEST_FIRST)

    items.sort(key=rank)  # stable: each module's own order is kept


def _is_xdist_worker(session) -> bool:
    """Under pytest-xdist the controller checks, once every worker is done (workers see each other's processes)."""
    return hasattr(session.config, "workerinput")


def pytest_sessionstart(session):
    if _is_xdist_worker(session):
        return
    session.config._before_suite = (_our_processes(), _our_folders())


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if a process it started or a temporary folder it made is still there."""
    if _is_xdist_worker(session):
        return
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
    else:
        shutil.rmtree(session.config._run_dir, ignore_errors=True)
