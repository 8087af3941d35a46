"""The README's quick start, from its own text: its `config.yaml` block and its scraper command start a real
LiteLLM proxy and scraper (only the hosts are this machine's), a request through the proxy is routed by the
plugin, and the proxy's /metrics/ serves the plugin's series. The README cannot drift from what starts."""

from __future__ import annotations

import re
import shlex
import time

import httpx
import yaml
from procs import MASTER_KEY, Decisions, debug_env, fake_pods, free_port, litellm_proxy, lora_affinity, redis_server
from paths import ROOT

README = ROOT / "README.md"


def _quick_start() -> tuple[str, list[str]]:
    """The README's install section: its config.yaml block and its `lora-affinity scrape` command."""
    text = README.read_text()
    section = text[text.index("## Install it into your LiteLLM proxy"):text.index("## What it achieves")]
    config = next(b for b in re.findall(r"```yaml\n(.*?)```", section, re.S) if "model_list:" in b)
    command = next(line for b in re.findall(r"```bash\n(.*?)```", section, re.S) for line in b.splitlines()
                   if line.startswith("lora-affinity scrape"))
    return config, shlex.split(command.split("#")[0])[1:]


def test_the_readmes_config_and_commands_start_a_proxy_that_routes_and_shows_the_plugins_metrics(tmp_path):
    config_text, scrape_args = _quick_start()
    pods = [free_port(), free_port()]
    redis_port, proxy_port = free_port(), free_port()
    for i, port in enumerate(pods):  # the README's hosts, this machine's ports
        config_text = config_text.replace(f"http://vllm-{i}:8000/v1", f"http://127.0.0.1:{port}/v1")
    config_text = config_text.replace("redis://redis:6379/0", f"redis://127.0.0.1:{redis_port}/0")
    config = yaml.safe_load(config_text)
    assert config["general_settings"]["master_key"] == "os.environ/LITELLM_MASTER_KEY"
    assert "prometheus" in config["litellm_settings"]["callbacks"]
    assert all("127.0.0.1" in d["litellm_params"]["api_base"] for d in config["model_list"])
    (tmp_path / "config.yaml").write_text(config_text)
    assert scrape_args[:2] == ["scrape", "--config"] and scrape_args[2] == "config.yaml"
    scrape_args[2] = str(tmp_path / "config.yaml")
    procs = [redis_server(redis_port, tmp_path), fake_pods(pods, tmp_path)]
    try:
        procs.append(lora_affinity(scrape_args, tmp_path, "scraper"))
        proxy = litellm_proxy(tmp_path / "config.yaml", proxy_port, tmp_path, env=debug_env())
        procs.append(proxy)
        decisions = Decisions(proxy)
        url = f"http://127.0.0.1:{proxy_port}"
        headers = {"Authorization": f"Bearer {MASTER_KEY}"}
        deadline = time.monotonic() + 60
        while True:  # until the scraper's records reach the proxy and the plugin decides
            reply = httpx.post(url + "/v1/completions", headers=headers, timeout=30,
                               json={"model": "sql-lora", "prompt": "Hello", "max_tokens": 5})
            assert reply.status_code == 200, reply.text
            if decisions.count():
                break
            assert time.monotonic() < deadline, "the plugin never decided"
            time.sleep(0.5)
        call_id = reply.headers.get("x-litellm-call-id")
        assert call_id and f"call {call_id}: sql-lora -> " in proxy.log()  # the decision line names the call
        page = httpx.get(url + "/metrics/", headers=headers, timeout=30)  # the master key, as the README says
        assert page.status_code == 200, page.text[:300]
        assert "lora_affinity_" in page.text
    finally:
        for proc in reversed(procs):
            proc.stop()
