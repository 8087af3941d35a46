"""Installing the plugin into a LiteLLM environment leaves its LiteLLM release in place and adds no extras.

`bash .ci/run` makes `.venv` with the newest tested LiteLLM release (1.110.2, its proxy's dependencies
installed by hand), `.venv-1108` with 1.108.7 and `.venv-oldest` with the oldest. The check asks pip, in
each, what installing the plugin would change (`--dry-run --report`), so nothing is modified.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
from pathlib import Path

import pytest
from paths import ROOT

OTHER_ENVS = [ROOT / ".venv", ROOT / ".venv-1108", ROOT / ".venv-oldest"]
BENCH_ONLY = {"tqdm", "matplotlib", "fakeredis"}


def _version_in(env: Path, package: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    return subprocess.run([str(env / "bin" / "python"), "-c", code], check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.mark.parametrize("other_env", OTHER_ENVS, ids=lambda p: p.name)
def test_pip_install_beside_another_litellm_release_changes_nothing_of_litellm(tmp_path, other_env):
    OTHER_ENV = other_env  # noqa: N806
    if not (OTHER_ENV / "bin" / "pip").exists():
        pytest.fail(f"{OTHER_ENV} is missing: `bash .ci/run` makes it with another tested LiteLLM release")
    theirs = _version_in(OTHER_ENV, "litellm")
    report = tmp_path / "report.json"
    subprocess.run([str(OTHER_ENV / "bin" / "pip"), "install", "--dry-run", "--quiet", "--report", str(report),
                    str(ROOT)], check=True, capture_output=True, text=True, timeout=600)
    would_install = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert "litellm" not in would_install
    assert would_install == {"lora-affinity-plugin"}  # its runtime dependencies are all there already
    assert _version_in(OTHER_ENV, "litellm") == theirs


def test_the_runtime_dependencies_leave_out_what_only_benchmarks_use():
    requires = importlib.metadata.requires("lora-affinity-plugin") or []
    unconditional = {r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
                     for r in requires if "extra ==" not in r}
    assert not unconditional & BENCH_ONLY, unconditional
    assert "litellm" in unconditional
    assert not any(r.startswith("litellm[") for r in requires)  # no extra pins LiteLLM's proxy: it would downgrade a host


def test_a_lab_command_without_the_lab_installed_names_it(monkeypatch, capsys):
    from lora_affinity_plugin.ops import cli

    monkeypatch.setattr(cli, "_lab", lambda: None)
    assert cli.main(["demo", "--speed", "5"]) == 2
    assert "pip install ./lab" in capsys.readouterr().err
    assert cli.main(["--log-level", "WARNING", "bench"]) == 2


def test_the_runtime_never_imports_the_lab():
    """The scraper's command and the proxy's callback load no module of the lab's."""
    code = ("import sys, lora_affinity_plugin.host.proxy_callback, lora_affinity_plugin.ops.cli as c; c.build_parser('scrape'); "
            "print(sorted(m for m in sys.modules if m.startswith('lora_affinity_lab')))")
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


def test_the_proxy_needs_neither_zeromq_nor_msgpack():
    """KV events are the scraper's (the `kv-events` extra): a proxy, even with `kv_events` on, loads neither, and
    the scraper loads them only when the setting is on."""
    code = ("import sys, lora_affinity_plugin.host.proxy_callback, lora_affinity_plugin.fleet.follower, lora_affinity_plugin.fleet.view; "
            "from lora_affinity_plugin.scraping.worker import Scraper; from lora_affinity_plugin.config.settings import build_settings; "
            "Scraper.for_config(build_settings({}, environ={}), [{'model_name': 'm', 'litellm_params': "
            "{'model': 'hosted_vllm/m', 'api_base': 'http://10.0.0.1:8000/v1'}}]); "
            "print(sorted(m for m in ('zmq', 'msgspec') if m in sys.modules))")
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]", out.stderr[-2000:]
    assert {"pyzmq", "msgspec"} <= {r.split(">")[0].strip().lower() for r in
                                   importlib.metadata.requires("lora-affinity-plugin") or [] if 'extra == "kv-events"' in r}


def test_kv_events_without_the_extra_name_it():
    code = ("import sys; sys.modules['zmq'] = None; from lora_affinity_plugin.scraping.worker import Scraper; "
            "from lora_affinity_plugin.config.settings import build_settings\n"
            "try:\n    Scraper.for_config(build_settings({'kv_events': True}, environ={}), [])\n"
            "except ValueError as exc:\n    print(exc)")
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120)
    assert "kv_events: following the pods' KV events needs the kv-events extra" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "pip install 'lora-affinity-plugin[kv-events]'" in out.stdout
