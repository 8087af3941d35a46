"""Redis with TLS, a password and an ACL user limited to the plugin's keys; /metrics behind a token.
Secrets never appear in logs, errors or `status`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import httpx
import pytest
import yaml
from procs import MASTER_KEY, Proc, child_env, wait_port
from stacks import Stack

PASSWORD, USER_PASSWORD, TOKEN = "adm1n-s3cret", "us3r-s3cret", "metr1cs-t0ken"
SECRETS = (PASSWORD, USER_PASSWORD, TOKEN)
CLI = [sys.executable, "-m", "lora_affinity_plugin.ops.cli", "--log-level", "INFO"]


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("security")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=test-ca", cwd=tmp)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj",
            "/CN=127.0.0.1", cwd=tmp)
    (tmp / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            "server.crt", "-days", "2", "-extfile", "ext.cnf", cwd=tmp)
    with Stack(tmp) as s:
        tls_port = s.port()
        (tmp / "users.acl").write_text(
            f"user default on >{PASSWORD} ~* &* +@all\n"
            f"user lora on >{USER_PASSWORD} ~{{lora_affinity}}:* &{{lora_affinity}}:* +@all\n")
        s.start("redis-tls", [shutil.which("redis-server"), "--port", "0", "--tls-port", str(tls_port),
                              "--tls-cert-file", str(tmp / "server.crt"), "--tls-key-file", str(tmp / "server.key"),
                              "--tls-ca-cert-file", str(tmp / "ca.crt"), "--tls-auth-clients", "no",
                              "--aclfile", str(tmp / "users.acl"), "--save", "", "--bind", "127.0.0.1"])
        wait_port(tls_port)
        pods = s.sim(2, "--metrics-token", TOKEN)
        url = f"rediss://lora:{USER_PASSWORD}@127.0.0.1:{tls_port}/0?ssl_ca_certs={tmp / 'ca.crt'}"

        def through_the_environment(config):
            config["lora_affinity"]["redis_url"] = "os.environ/REDIS_URL"

        path = s.config(pods, 0, edit=through_the_environment, scrape_interval_ms=100,
                        metrics_bearer_token="os.environ/VLLM_METRICS_TOKEN", metrics_token_pods=["127.0.0.1:*"])
        env = child_env(REDIS_URL=url, VLLM_METRICS_TOKEN=TOKEN)
        s.start("scraper", CLI + ["scrape", "--config", str(path)], env=env)
        _, proxy_url = s.proxy(path, env=child_env(REDIS_URL=url, VLLM_METRICS_TOKEN=TOKEN, LORA_AFFINITY_LOG_LEVEL="DEBUG"))
        time.sleep(0.5)
        yield {"config": path, "env": env, "procs": s.procs, "tls_port": tls_port,
               "proxy_port": int(proxy_url.rsplit(":", 1)[1]), "sim": pods[0], "tmp": tmp}


def cli(stack, *args, env=None):
    return subprocess.run(CLI + list(args), capture_output=True, text=True, env=env or stack["env"], timeout=60)


def test_scraper_and_status_over_tls_with_an_acl_user(stack):
    out = cli(stack, "status", "--json", "--config", str(stack["config"]))
    assert out.returncode == 0, out.stderr
    pods = json.loads(out.stdout)["pods"]
    assert [p["state"] for p in pods] == ["fresh", "fresh"]  # the scraper sent the bearer token
    text = cli(stack, "status", "--config", str(stack["config"])).stdout
    assert "rediss://lora:***@127.0.0.1" in text
    assert not any(secret in out.stdout + text for secret in SECRETS)


def test_the_proxy_routes_by_metrics_over_tls(stack):
    for _ in range(4):
        r = httpx.post(f"http://127.0.0.1:{stack['proxy_port']}/v1/completions",
                       headers={"Authorization": f"Bearer {MASTER_KEY}"},
                       json={"model": "sql-lora", "prompt": "x", "max_tokens": 5}, timeout=60)
        assert r.status_code == 200
    log = stack["procs"][-1].log()
    assert "sql-lora ->" in log and "routing by metrics unavailable" not in log


def test_a_wrong_metrics_token_marks_the_pods(stack):
    env = {**stack["env"], "VLLM_METRICS_TOKEN": "wrong"}
    path = stack["tmp"] / "other.yaml"
    config = yaml.safe_load(stack["config"].read_text())
    config["lora_affinity"]["key_prefix"] = "lora_affinity_other"  # a second tenant on the same Redis
    path.write_text(yaml.safe_dump(config))
    env["REDIS_URL"] = env["REDIS_URL"].replace("lora:" + USER_PASSWORD, ":" + PASSWORD)
    scraper = Proc("scraper-wrong", CLI + ["scrape", "--config", str(path)], stack["tmp"], env=env)
    try:
        time.sleep(1.5)
        out = cli(stack, "status", "--json", "--config", str(path), env=env)
        rows = json.loads(out.stdout)["pods"]
        assert [r["state"] for r in rows] == ["down", "down"] and rows[0]["error"] == "HTTP 401 from /metrics"
        first = json.loads(cli(stack, "status", "--json", "--config", str(stack["config"])).stdout)["pods"]
        assert [p["state"] for p in first] == ["fresh", "fresh"]  # the first tenant's records are untouched
    finally:
        scraper.stop()
    assert not any(secret in scraper.log() for secret in SECRETS)


def test_secrets_never_appear_in_logs_or_errors(stack):
    bad = cli(stack, "status", "--redis-url", f"redis://:{PASSWORD}@127.0.0.1:1/0")
    assert bad.returncode != 0 and "redis://***@127.0.0.1:1/0" in bad.stderr
    invalid = cli(stack, "thresholds", "show", "--redis-url", f"http://:{PASSWORD}@x")
    assert invalid.returncode != 0
    for proc in stack["procs"]:
        log = proc.log()
        assert not any(secret in log for secret in SECRETS), proc.name
    assert not any(secret in bad.stderr + invalid.stderr for secret in SECRETS)
