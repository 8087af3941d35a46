"""The process helpers the benchmarks, the demo and the end-to-end tests start their stacks with."""

import collections
from pathlib import Path

import pytest

from lora_affinity_lab import processes


class _Started:
    def __init__(self, name: str) -> None:
        self.name = name


def test_a_proxy_that_never_answered_is_started_once_more_and_one_that_exited_is_not(monkeypatch, capsys):
    started, outcomes = [], []
    monkeypatch.setattr(processes, "start_litellm_proxy",
                        lambda config, port, log_dir, name, env: started.append(name) or _Started(name))

    def wait(proc, port):
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return proc

    monkeypatch.setattr(processes, "wait_proxy", wait)
    outcomes[:] = [TimeoutError("proxy did not start: ...gc.freeze pinned 784997 startup objects"), "live"]
    proc = processes.litellm_proxy(Path("c.yaml"), 4000, Path("."), name="proxy")
    assert started == ["proxy", "proxy-again"] and proc.name == "proxy-again"
    assert "proxy did not start within its timeout; starting it once more" in capsys.readouterr().err

    started.clear()
    outcomes[:] = [RuntimeError("proxy exited: bad config")]
    with pytest.raises(RuntimeError, match="bad config"):
        processes.litellm_proxy(Path("c.yaml"), 4000, Path("."), name="proxy")
    assert started == ["proxy"]  # an error, not a stall: no second start

    started.clear()
    outcomes[:] = [TimeoutError("stalled"), TimeoutError("stalled again")]
    with pytest.raises(TimeoutError, match="stalled again"):
        processes.litellm_proxy(Path("c.yaml"), 4000, Path("."), name="proxy")
    assert started == ["proxy", "proxy-again"]  # once more, not forever


def test_free_port_never_gives_out_the_same_port_twice(monkeypatch):
    """Callers take several ports before binding any (Redis, then the replicas): a port the kernel offers again
    must not be handed to two of them (the soak once started a replica on Redis's port)."""
    offered = iter([40001, 40001, 40002, 40001, 40003])

    class _Socket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(processes, "_HANDED_OUT", collections.deque(maxlen=1024), raising=False)  # (a fresh memory)
    monkeypatch.setattr(processes.socket, "socket", _Socket)
    assert [processes.free_port() for _ in range(3)] == [40001, 40002, 40003]
