"""The end-to-end tests' stacks, built in one place: a real redis-server, simulated vLLM replicas (or the fake
pods whose metrics a test scripts), the scraper and `litellm --config` proxies.

A module's fixture opens a `Stack`, starts what it needs and yields; leaving the `with` stops every process in
the reverse order of its start, whatever ended the fixture. Ports come from one pool, so a proxy's port is never
one a replica is about to bind.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml
from lora_affinity_lab.bench.tokenizer_files import (
    CHAT_TEMPLATE,  # the simulator's rendering, as Jinja
)
from lora_affinity_lab.processes import start_litellm_proxy, wait_proxy
from procs import (
    Proc,
    child_env,
    fake_pods,
    free_port,
    free_port_range,
    litellm_proxy,
    lora_affinity,
    proxy_config,
    redis_server,
    wait_port,
)
from tokenizer_files import train_tokenizer

CLI_MODULE = "lora_affinity_plugin.ops.cli"


@dataclass
class KvSim:
    """Simulated replicas that publish vLLM's KV events and tokenize with the tests' trained `tokenizer.json`."""

    pods: list[int]
    pub: int
    replay: int
    """The first replica's event and replay ports; replica i publishes on these plus i."""
    tokenizers: dict[str, dict[str, str]]
    """The plugin's `tokenizers` setting for them: the same tokenizer and the simulator's chat template."""

    def name_endpoints(self, config: dict[str, Any], publishing: int | None = None) -> None:
        """Each deployment's KV-event endpoints in `config` (past the first `publishing` pods: none)."""
        for i, deployment in enumerate(config["model_list"]):
            deployment["model_info"] = (
                {"kv_events_endpoint": f"tcp://127.0.0.1:{self.pub + i}",
                 "kv_events_replay_endpoint": f"tcp://127.0.0.1:{self.replay + i}"}
                if publishing is None or i < publishing else {"kv_events_endpoint": ""})


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Proc] = []
        self._taken: set[int] = set()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def port(self) -> int:
        """A free port none of this stack's processes holds or is about to bind."""
        port = next(p for p in iter(free_port, None) if p not in self._taken)
        self._taken.add(port)
        return port

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        """Any other process of the stack (a hosted API, a second scraper), stopped with the rest."""
        proc = Proc(name, args, self.tmp, env=env)
        self.procs.append(proc)
        return proc

    def redis(self) -> int:
        """A real redis-server; its port."""
        port = self.port()
        self.procs.append(redis_server(port, self.tmp))
        return port

    def port_range(self, count: int) -> int:
        """`count` consecutive free ports (a simulator's replicas, their KV-event endpoints); the first."""
        base = free_port_range(count)
        while any(p in self._taken for p in range(base, base + count)):
            base = free_port_range(count)
        self._taken.update(range(base, base + count))
        return base

    def sim(self, replicas: int, *args: str, env: dict[str, str] | None = None) -> list[int]:
        """`lora-affinity sim` with `replicas` replicas on consecutive ports, listening; their ports."""
        base = self.port_range(replicas)
        self.start("sim", [sys.executable, "-m", CLI_MODULE, "sim", "--replicas", str(replicas), "--base-port",
                           str(base), *args], env=env)
        ports = list(range(base, base + replicas))
        for port in ports:
            wait_port(port)
        return ports

    def kv_sim(self, replicas: int, *args: str) -> KvSim:
        """`sim` with every replica publishing KV events on ports of its own, tokenizing with a trained tokenizer
        written to the stack's folder beside the chat template."""
        train_tokenizer(self.tmp / "tokenizer.json")
        (self.tmp / "chat.jinja").write_text(CHAT_TEMPLATE)
        pub, replay = self.port_range(replicas), self.port_range(replicas)
        events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                             "replay_endpoint": f"tcp://*:{replay}"})
        pods = self.sim(replicas, *args, "--tokenizer", str(self.tmp / "tokenizer.json"), "--kv-events-config", events)
        files = {"tokenizer": str(self.tmp / "tokenizer.json"), "chat_template": str(self.tmp / "chat.jinja")}
        return KvSim(pods, pub, replay, {"*": files})

    def fake_pods(self, count: int) -> list[int]:
        """`tests/fake_pods.py` pods, whose metrics and answers a test scripts; their ports."""
        ports = [self.port() for _ in range(count)]
        self.procs.append(fake_pods(ports, self.tmp))
        return ports

    def config(self, pods: list[int], redis_port: int, name: str = "config.yaml",
               edit: Callable[[dict[str, Any]], None] | None = None, **plugin: object) -> Path:
        """A proxy config over one wildcard deployment per pod with the plugin (`processes.proxy_config`),
        changed by `edit` when given, written to the stack's folder."""
        config = proxy_config(pods, redis_port, **plugin)
        if edit is not None:
            edit(config)
        path = self.tmp / name
        path.write_text(yaml.safe_dump(config))
        return path

    def scraper(self, config: Path, env: dict[str, str] | None = None, name: str = "scraper") -> Proc:
        proc = lora_affinity(["scrape", "--config", str(config)], self.tmp, name, env=env)
        self.procs.append(proc)
        return proc

    def proxy(self, config: Path, env: dict[str, str] | None = None, name: str = "proxy") -> tuple[Proc, str]:
        """A started `litellm --config` proxy and its URL."""
        port = self.port()
        proc = litellm_proxy(config, port, self.tmp, name, env=env or child_env())
        self.procs.append(proc)
        return proc, f"http://127.0.0.1:{port}"

    def proxies(self, configs: Path | list[Path], names: list[str],
                envs: list[dict[str, str] | None] | None = None) -> list[tuple[Proc, str]]:
        """Several proxies (on one config, or one each), started side by side; each with its URL."""
        started = []
        for i, name in enumerate(names):
            config = configs[i] if isinstance(configs, list) else configs
            port = self.port()
            proc = start_litellm_proxy(config, port, self.tmp, name, env=(envs[i] if envs else None) or child_env())
            self.procs.append(proc)
            started.append((proc, port))
        return [(wait_proxy(proc, port), f"http://127.0.0.1:{port}") for proc, port in started]
