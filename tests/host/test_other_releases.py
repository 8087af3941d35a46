"""How the plugin fits its host on the other LiteLLM releases users run, inside README's test command.

The whole suite runs on the newest release (`.venv`). `bash .ci/run` also makes `.venv-oldest` (1.94.0, the
oldest supported) and `.venv-1108` (1.108.7, the newest whose `litellm[proxy]` installs from the registry);
each test here runs a share of the host-fit tests in one of them, as a pytest of its own in that environment.
Run from the suite, they take their place among its modules on the suite's workers instead of a stage after it,
which left a core idle while its slowest module finished.

The oldest runs every host-fit test: routing through a real proxy, requests the plugin does not route, the
pooled client against LiteLLM's own, streaming disconnects, in-flight accounting. 1.108.7, between the oldest
and the newest, runs the in-process ones and routing through its own proxy: a middle release that kept both
ends' hooks is checked where its own proxy starts, for a third of the CPU. A missing environment fails, as
`tests/ops/test_install.py` does: it is `.ci/run`'s to make.
"""

from __future__ import annotations

import subprocess

import pytest
from paths import ROOT

IN_PROCESS = ["tests/host/test_strategy.py", "tests/host/test_pooling.py", "tests/fleet/test_discovery.py",
              "tests/host/test_host_bounds.py"]
THROUGH_A_PROXY = ["tests/e2e/test_e2e_proxy.py", "tests/e2e/test_e2e_disconnect.py"]
SHARES = {
    # (environment, share): the modules, about a minute or two of one worker each
    (".venv-oldest", "host"): ["tests/e2e/test_e2e_host.py"],
    (".venv-oldest", "proxy"): [*THROUGH_A_PROXY, "tests/e2e/test_e2e_inflight.py", *IN_PROCESS],
    (".venv-1108", "proxy"): ["tests/e2e/test_e2e_proxy.py", *IN_PROCESS],
}


@pytest.mark.parametrize(("env", "share"), list(SHARES), ids=[f"{e.lstrip('.')}-{s}" for e, s in SHARES])
def test_the_host_fit_tests_pass_on_another_litellm_release(env, share):
    pytest_bin = ROOT / env / "bin" / "pytest"
    if not pytest_bin.exists():
        pytest.fail(f"{ROOT / env} is missing: `bash .ci/run` makes it with another tested LiteLLM release")
    log = ROOT / env / f"pytest-{share}.log"  # kept: `.ci/run` prints each one's summary
    with log.open("w") as out:
        done = subprocess.run([str(pytest_bin), "-n", "0", "-p", "no:cacheprovider", "--disable-warnings",
                               *SHARES[(env, share)]], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=900)
    assert done.returncode == 0, log.read_text()[-6000:]
