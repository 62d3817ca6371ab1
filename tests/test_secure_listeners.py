"""Secure by default off loopback (laminar/listeners.py): real listeners on a real non-loopback address.

The address is put on a veth pair created for the test in this machine's network namespace (needs root
and iproute2; 127.0.0.2 would not do, it is loopback), and the pair is deleted in `finally`. On it:
- `laminar worker relay` and `laminar workers` without LAMINAR_RELAY_TOKEN refuse to start (exit 2,
  naming the variable and the opt-out), a relay started with LAMINAR_INSECURE=1 serves and logs the risk,
  and one with a token serves authenticated clients;
- the S3 dev server (which has no secret) refuses without --insecure and serves with it;
- the metrics endpoint, served by a real process, refuses without LAMINAR_METRICS_TOKEN, serves with
  LAMINAR_INSECURE=1, and with a token answers 401 without the bearer header and 200 with it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from laminar.devstack.stack import free_port
from laminar.errors import ConfigError
from laminar.listeners import check_bind, insecure_from_env, is_loopback
from laminar.relay import client
from laminar.relay.server import RelayServer

ROOT = Path(__file__).resolve().parents[1]
LAMINAR = [sys.executable, "-m", "laminar.cli.main"]


@pytest.fixture(scope="module")
def lan_address() -> Iterator[str]:
    """A non-loopback IPv4 address of this machine, on a veth pair made for this test and deleted after."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to put a non-loopback address on a veth pair")
    tag = f"lsec{os.getpid() % 100000}"
    addr = f"10.251.{os.getpid() % 250 + 1}.1"
    run = lambda *a: subprocess.run(["ip", *a], check=True, capture_output=True, text=True)  # noqa: E731
    try:
        run("link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b")
        run("addr", "add", f"{addr}/32", "dev", f"{tag}a")
        run("link", "set", f"{tag}a", "up")
        run("link", "set", f"{tag}b", "up")
        yield addr
    finally:
        subprocess.run(["ip", "link", "del", f"{tag}a"], capture_output=True)  # takes its peer and address too


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAMINAR_")}
    return {**env, "PYTHONPATH": str(ROOT), "LAMINAR_LOG_FORMAT": "console", **extra}


def test_loopback_is_told_apart():
    assert is_loopback("127.0.0.1") and is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.0.0.1")
    assert not is_loopback("no-such-host.invalid")  # unresolvable: not known to be loopback
    assert insecure_from_env({"LAMINAR_INSECURE": " TRUE "}) and not insecure_from_env({"LAMINAR_INSECURE": "0"})
    check_bind("x", "127.0.0.1", secret=None, variable="V", insecure=False, risk="r")  # loopback: fine
    check_bind("x", "0.0.0.0", secret="s" * 16, variable="V", insecure=False, risk="r")  # has its secret: fine
    with pytest.raises(ConfigError, match=r"x would listen on 0\.0\.0\.0.*without V: r\. Set V .*--insecure"):
        check_bind("x", "0.0.0.0", secret=None, variable="V", insecure=False, risk="r")
    with capture_logs() as logs:
        check_bind("x", "0.0.0.0", secret=None, variable="V", insecure=True, risk="r")
    assert [(e["event"], e["log_level"], e["risk"]) for e in logs] == [("insecure_listener", "warning", "r")]


def test_relay_worker_refuses_a_lan_bind_without_a_token(lan_address: str, tmp_path: Path):
    env = _env(LAMINAR_HOME=str(tmp_path), LAMINAR_RELAY_BIND=lan_address, LAMINAR_TEMPORAL_ADDRESS="127.0.0.1:1")
    proc = subprocess.run([*LAMINAR, "worker", "relay"], env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert f"would listen on {lan_address}" in out and "LAMINAR_RELAY_TOKEN" in out, out
    assert "--insecure" in out and "LAMINAR_INSECURE=1" in out, out


def test_workers_refuse_up_front_without_a_token(lan_address: str, tmp_path: Path):
    env = _env(LAMINAR_HOME=str(tmp_path), LAMINAR_RELAY_BIND=lan_address, LAMINAR_TEMPORAL_ADDRESS="127.0.0.1:1")
    started = time.monotonic()
    proc = subprocess.run([*LAMINAR, "workers", "examples/tiny.toml"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "LAMINAR_RELAY_TOKEN" in out and "--insecure" in out, out
    assert not (tmp_path / "logs" / "workers").exists()  # refused before any worker process started
    assert time.monotonic() - started < 60
    env = _env(LAMINAR_HOME=str(tmp_path), LAMINAR_METRICS_BIND=lan_address)  # run makes a relay token, not this
    proc = subprocess.run([*LAMINAR, "run", "examples/tiny.toml"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "LAMINAR_METRICS_TOKEN" in out and "--insecure" in out, out
    assert not (tmp_path / "dev.json").exists()  # refused before the dev stack started


def test_relay_on_a_lan_address(lan_address: str):
    with pytest.raises(ConfigError, match="LAMINAR_RELAY_TOKEN"):
        RelayServer("r-lan", bind_host=lan_address).start()
    payload = os.urandom(3 << 20)
    with capture_logs() as logs:
        insecure = RelayServer("r-insecure", bind_host=lan_address, insecure=True)
        addr = insecure.start()
    try:
        assert addr.startswith(f"{lan_address}:")
        warned = [e for e in logs if e["event"] == "insecure_listener"]
        assert len(warned) == 1 and warned[0]["missing"] == "LAMINAR_RELAY_TOKEN" and "push weights" in warned[0]["risk"]
        client.push(addr, 1, payload, [])
        assert client.fetch_latest(addr) == (1, payload)
    finally:
        insecure.stop()
    token = secrets.token_hex(16)
    with RelayServer("r-token", bind_host=lan_address, token=token) as relay:
        assert relay.addr is not None
        client.push(relay.addr, 2, payload, [], token=token)
        assert client.fetch_latest(relay.addr, token=token) == (2, payload)


def test_s3_dev_server_on_a_lan_address(lan_address: str, tmp_path: Path):
    port = free_port(lan_address)
    cmd = [sys.executable, "-m", "laminar.devstack.s3_server", "-H", lan_address, "-p", str(port), "--snapshot", str(tmp_path)]
    refused = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert "has no secret of its own" in refused.stderr and "--insecure" in refused.stderr, refused.stderr
    proc = subprocess.Popen([*cmd, "--insecure"], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(2)]
        assert any(f"serving S3 at http://{lan_address}:{port}" in line for line in lines), lines
        assert "insecure_listener" in lines[0], lines  # the accepted risk is logged first
    finally:
        proc.terminate()
        proc.wait(60)


_METRICS_SCRIPT = """
import sys, time
from laminar.logs import configure_logging
from laminar.metrics import serve
from laminar.client.settings import Settings
configure_logging("json", "info")
s = Settings.from_env()
print("URL", serve(s.metrics_port, s.metrics_bind, "control", "control", "host-0", token=s.metrics_token,
                   insecure=s.insecure), flush=True)
time.sleep(120)
"""


def _serve_metrics(env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _METRICS_SCRIPT], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("URL "):
            return proc, "".join(lines)
    proc.wait(30)
    return proc, "".join(lines)


def _get(url: str, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_endpoint_on_a_lan_address(lan_address: str, tmp_path: Path):
    base = _env(LAMINAR_HOME=str(tmp_path), LAMINAR_METRICS_BIND=lan_address)
    url = lambda port: f"http://{lan_address}:{port}/metrics"  # noqa: E731

    port = free_port(lan_address)
    proc, out = _serve_metrics({**base, "LAMINAR_METRICS_PORT": str(port)})
    try:
        assert proc.wait(30) != 0 and "LAMINAR_METRICS_TOKEN" in out and "LAMINAR_INSECURE=1" in out, out
    finally:
        proc.kill()

    port = free_port(lan_address)
    proc, out = _serve_metrics({**base, "LAMINAR_METRICS_PORT": str(port), "LAMINAR_INSECURE": "1"})
    try:
        assert f"URL {url(port)}" in out, out
        warned = [json.loads(line) for line in out.splitlines() if "insecure_listener" in line]
        assert warned and warned[0]["missing"] == "LAMINAR_METRICS_TOKEN" and warned[0]["level"] == "warning", out
        status, body = _get(url(port))
        assert status == 200 and "laminar_process_info" in body
    finally:
        proc.kill()
        proc.wait(10)

    token = secrets.token_hex(16)
    port = free_port(lan_address)
    proc, out = _serve_metrics({**base, "LAMINAR_METRICS_PORT": str(port), "LAMINAR_METRICS_TOKEN": token})
    try:
        assert f"URL {url(port)}" in out and "insecure_listener" not in out, out
        assert _get(url(port))[0] == 401
        assert _get(url(port), "wrong-" + token)[0] == 401
        status, body = _get(url(port), token)
        assert status == 200 and 'laminar_process_info{host="host-0",process="control",role="control"} 1.0' in body
    finally:
        proc.kill()
        proc.wait(10)
