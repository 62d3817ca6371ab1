"""Temporal over mutual TLS, for real: a Temporal dev server behind nginx (stream), which terminates TLS and demands a
client certificate signed by the test's CA (certificates made here with `cryptography`). A client and a worker
without a certificate are refused with a message that names the settings to set; workers with one run a short
run, started through the proxy with the `temporal` CLI as infra/README.md does. The same run checks that the S3
credentials (standard AWS chain, distinctive values), the Temporal API key and the relay token appear in no log, no
workflow history and no stored object. Also the LAMINAR_TEMPORAL_TLS_* settings' errors, without a server.

nginx and its stream module come from Debian (`make proxy`); where they are missing the proxy tests skip, saying so.
stunnel (Debian's stunnel4) was tried first: it negotiates no ALPN, and the SDK's gRPC client (tonic) refuses a
TLS connection without `h2` (H2NotNegotiated), certificate or not.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from laminar.client.connect import connect
from laminar.client.settings import Settings
from laminar.contract import CONTROL_QUEUE, RunStatus, workflow_id_for
from laminar.devstack.stack import DevStack, free_port, port_free
from laminar.errors import ConfigError, LaminarError
from laminar.storage.objects import open_store
from laminar.workers.launcher import LocalLauncher, plan_processes
from tests.fixtures.s3 import create_bucket, stop_process
from tests.fixtures.stack import small_config
from tests.fixtures.temporal import history_chain, temporal_binary
from tests.fixtures.waiting import wait_until

SERVER_NAME = "temporal.laminar.test"  # on the server certificate (with 127.0.0.1); the clients verify this name
# Distinctive secrets: a leak of any of them into a log, a history or an object is found by a plain search.
SECRETS = {
    "AWS_ACCESS_KEY_ID": "AKIALAMINARMTLS7Q3Z",
    "AWS_SECRET_ACCESS_KEY": f"laminar-s3-secret-{uuid.uuid4().hex}",
    "LAMINAR_TEMPORAL_API_KEY": f"laminar-api-key-{uuid.uuid4().hex}",
    "LAMINAR_RELAY_TOKEN": f"laminar-relay-token-{uuid.uuid4().hex}",
}
STEPS = 2


# ---------------------------------------------------------------------------------------------- certificates

@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_client_cert: Path  # signed by another CA: the proxy must refuse it
    other_client_key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool, usage=None, sans=None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
         .public_key(key.public_key())
         .serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False, data_encipherment=False,
                                          key_agreement=False, encipher_only=False, decipher_only=False),
                            critical=True)
    if usage is not None:
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans is not None:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate | None = None, key=None) -> Path:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        path.chmod(0o600)
    return path


def make_pki(d: Path) -> Pki:
    d.mkdir(parents=True, exist_ok=True)
    ca_key, other_ca_key, server_key, client_key, other_key = (_key() for _ in range(5))
    ca = _cert("laminar test CA", ca_key, "laminar test CA", ca_key, ca=True)
    server = _cert(SERVER_NAME, server_key, "laminar test CA", ca_key, ca=False,
                   usage=ExtendedKeyUsageOID.SERVER_AUTH,
                   sans=[x509.DNSName(SERVER_NAME), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client = _cert("laminar-worker", client_key, "laminar test CA", ca_key, ca=False,
                   usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    other = _cert("intruder", other_key, "another CA", other_ca_key, ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    return Pki(
        ca=_write(d / "ca.pem", ca),
        server_cert=_write(d / "server.pem", server), server_key=_write(d / "server.key", key=server_key),
        client_cert=_write(d / "client.pem", client), client_key=_write(d / "client.key", key=client_key),
        other_client_cert=_write(d / "other.pem", other), other_client_key=_write(d / "other.key", key=other_key),
    )


# ------------------------------------------------------------------------------------- settings, no server

def test_tls_settings_resolve_round_trip_and_hide_the_api_key(tmp_path):
    pki = make_pki(tmp_path / "pki")
    os.symlink(pki.client_cert, tmp_path / "rel.pem")
    env = {"LAMINAR_HOME": str(tmp_path / "home"), "LAMINAR_TEMPORAL_TLS_CERT": "rel.pem",  # relative to cwd
           "LAMINAR_TEMPORAL_TLS_KEY": str(pki.client_key), "LAMINAR_TEMPORAL_TLS_CA": str(pki.ca),
           "LAMINAR_TEMPORAL_TLS_SERVER_NAME": SERVER_NAME, "LAMINAR_TEMPORAL_API_KEY": "k3y-abc"}
    s = Settings.from_env(env, cwd=tmp_path)
    assert s.temporal_tls is True  # on by itself: certificates were given
    assert s.temporal_tls_cert == pki.client_cert  # absolute and resolved, so a child in another cwd finds it
    assert s.temporal_tls_server_name == SERVER_NAME and s.temporal_api_key == "k3y-abc"
    assert Settings.from_env(s.to_env(), cwd=Path("/")) == s  # children get the same settings
    assert "k3y-abc" not in repr(s)
    # The defaults: no TLS; an API key alone turns it on (as the temporal CLI does), and so does TLS=true.
    assert Settings.from_env({}, cwd=tmp_path).temporal_tls is False
    assert Settings.from_env({"LAMINAR_TEMPORAL_API_KEY": "k"}, cwd=tmp_path).temporal_tls is True
    plain_tls = Settings.from_env({"LAMINAR_TEMPORAL_TLS": "true"}, cwd=tmp_path)
    assert plain_tls.temporal_tls and plain_tls.temporal_tls_cert is None
    assert Settings.from_env(plain_tls.to_env(), cwd=tmp_path) == plain_tls


@pytest.mark.parametrize("case, expected", [
    ("missing", ["LAMINAR_TEMPORAL_TLS_CERT='nope/client.pem'", "does not exist",
                 "point it at the client certificate (PEM)"]),
    ("swapped", ["LAMINAR_TEMPORAL_TLS_KEY=", "has no 'PRIVATE KEY-----' block",
                 "point it at the client certificate's private key (PEM)"]),
    ("cert_only", ["LAMINAR_TEMPORAL_TLS_KEY is unset while LAMINAR_TEMPORAL_TLS_CERT=", "set both"]),
    ("tls_false", ["LAMINAR_TEMPORAL_TLS=false contradicts LAMINAR_TEMPORAL_TLS_CA", "unset LAMINAR_TEMPORAL_TLS"]),
    ("server_name", ["LAMINAR_TEMPORAL_TLS_SERVER_NAME='temporal:7233' is invalid", "without a port"]),
    ("api_key", ["LAMINAR_TEMPORAL_API_KEY='<hidden>' is invalid", "no 'Bearer ' prefix"]),
])
def test_tls_setting_errors_name_the_variable_the_value_and_the_fix(tmp_path, case, expected):
    pki = make_pki(tmp_path / "pki")
    env = {
        "missing": {"LAMINAR_TEMPORAL_TLS_CERT": "nope/client.pem", "LAMINAR_TEMPORAL_TLS_KEY": str(pki.client_key)},
        "swapped": {"LAMINAR_TEMPORAL_TLS_CERT": str(pki.client_cert), "LAMINAR_TEMPORAL_TLS_KEY": str(pki.client_cert)},
        "cert_only": {"LAMINAR_TEMPORAL_TLS_CERT": str(pki.client_cert)},
        "tls_false": {"LAMINAR_TEMPORAL_TLS": "false", "LAMINAR_TEMPORAL_TLS_CA": str(pki.ca)},
        "server_name": {"LAMINAR_TEMPORAL_TLS_SERVER_NAME": "temporal:7233"},
        "api_key": {"LAMINAR_TEMPORAL_API_KEY": "Bearer s3cr3t-value"},
    }[case]
    with pytest.raises(ConfigError) as e:
        Settings.from_env(env, cwd=tmp_path)
    for part in expected:
        assert part in str(e.value)
    assert "s3cr3t-value" not in str(e.value)


# ------------------------------------------------------------------------------ the proxy and the stack

@dataclass
class MtlsStack:
    home: Path
    pki: Pki
    proxy_address: str
    proxy_log: Path
    env: dict[str, str]  # LAMINAR_* of the workers, with the client certificate (secrets included)
    settings: Settings

    def without_certificate(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in self.env.items() if k not in ("LAMINAR_TEMPORAL_TLS_CERT", "LAMINAR_TEMPORAL_TLS_KEY",
                                                              "LAMINAR_TEMPORAL_API_KEY")}
        return {**env, **extra}


NGINX_STREAM_MODULE = Path("/usr/lib/nginx/modules/ngx_stream_module.so")  # Debian's libnginx-mod-stream


def proxy_missing() -> str | None:
    """Why the proxy cannot run here, or None."""
    if shutil.which("nginx") is None:
        return "nginx is not installed"
    if not NGINX_STREAM_MODULE.exists():
        return f"nginx's stream module {NGINX_STREAM_MODULE} is not installed"
    return None


def _start_proxy(pki: Pki, listen: int, target: int, d: Path) -> tuple[subprocess.Popen, Path]:
    """nginx's stream module as the TLS terminator: TLS on `listen` (ALPN h2, which gRPC clients demand), plain
    TCP to `target`; a client must present a certificate the test CA signed (ssl_verify_client on), or the
    handshake fails. One process (master_process off) in the foreground, so its pid is the one to stop."""
    conf = d / "nginx.conf"
    log_path = d / "nginx.log"
    conf.write_text(f"""load_module {NGINX_STREAM_MODULE};
daemon off;
master_process off;
pid {d / "nginx.pid"};
error_log {log_path} info;
events {{ worker_connections 256; }}
stream {{
    server {{
        listen 127.0.0.1:{listen} ssl;
        ssl_certificate {pki.server_cert};
        ssl_certificate_key {pki.server_key};
        ssl_client_certificate {pki.ca};
        ssl_verify_client on;
        ssl_protocols TLSv1.2 TLSv1.3;
        ssl_alpn h2;
        proxy_pass 127.0.0.1:{target};
    }}
}}
""")
    proc = subprocess.Popen(["nginx", "-p", str(d), "-c", str(conf), "-e", str(log_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    wait_until(lambda: proc.poll() is not None or not port_free(listen), timeout_s=10,
               what=f"nginx (pid {proc.pid}) to listen on {listen}")
    if proc.poll() is not None:
        pytest.fail(f"nginx exited with {proc.returncode}; log {log_path}:\n{log_path.read_text(errors='replace')}")
    return proc, log_path


@pytest.fixture(scope="module")
def mtls(tmp_path_factory, moto_server) -> Iterator[MtlsStack]:
    if (why := proxy_missing()) is not None:
        pytest.skip(f"{why}: `make proxy` installs Debian's nginx and libnginx-mod-stream (needs root and apt)")
    home = tmp_path_factory.mktemp("mtls-home")
    pki = make_pki(home / "pki")
    dev = DevStack(home)
    dev_port = free_port()
    dev.up(port=dev_port, ui=False)  # plain gRPC on loopback; only the proxy is meant to be reached
    proxy_port = free_port()
    proxy, proxy_log = _start_proxy(pki, proxy_port, dev_port, home)
    bucket = create_bucket(moto_server)
    env = {
        "LAMINAR_HOME": str(home),
        "LAMINAR_TEMPORAL_ADDRESS": f"127.0.0.1:{proxy_port}",
        "LAMINAR_STORE": f"s3://{bucket}/runs",
        "LAMINAR_S3_ENDPOINT": moto_server,
        "LAMINAR_LOG_LEVEL": "debug",  # the most a log says: a leak would show here first
        "LAMINAR_TEMPORAL_TLS_CERT": str(pki.client_cert),
        "LAMINAR_TEMPORAL_TLS_KEY": str(pki.client_key),
        "LAMINAR_TEMPORAL_TLS_CA": str(pki.ca),
        "LAMINAR_TEMPORAL_TLS_SERVER_NAME": SERVER_NAME,
        "LAMINAR_TEMPORAL_API_KEY": SECRETS["LAMINAR_TEMPORAL_API_KEY"],
        "LAMINAR_RELAY_TOKEN": SECRETS["LAMINAR_RELAY_TOKEN"],
    }
    try:
        yield MtlsStack(home, pki, f"127.0.0.1:{proxy_port}", proxy_log, env, Settings.from_env(env))
    finally:
        stop_process(proxy)
        dev.down()


def _worker_env(env: dict[str, str]) -> dict[str, str]:
    """A child's whole environment: ours without LAMINAR_* and AWS_*, then `env`, then the distinctive S3 keys."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LAMINAR_", "AWS_"))}
    return {**base, "AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": SECRETS["AWS_ACCESS_KEY_ID"],
            "AWS_SECRET_ACCESS_KEY": SECRETS["AWS_SECRET_ACCESS_KEY"], **env}


async def test_client_and_worker_without_a_client_certificate_are_refused(mtls):
    # A client with TLS and the right CA but no certificate: the proxy ends the handshake.
    no_cert = Settings.from_env(mtls.without_certificate())
    with pytest.raises(LaminarError) as e:
        await connect(no_cert)
    msg = str(e.value)
    assert f"cannot reach Temporal at {mtls.proxy_address}" in msg
    assert "over TLS without a client certificate" in msg
    assert "set LAMINAR_TEMPORAL_TLS_CERT and LAMINAR_TEMPORAL_TLS_KEY" in msg
    # A certificate from another CA is refused too (the proxy verifies the chain, not just its presence).
    other = Settings.from_env(mtls.without_certificate(LAMINAR_TEMPORAL_TLS_CERT=str(mtls.pki.other_client_cert),
                                                       LAMINAR_TEMPORAL_TLS_KEY=str(mtls.pki.other_client_key)))
    with pytest.raises(LaminarError) as e:
        await connect(other)
    assert f"over TLS with client certificate {mtls.pki.other_client_cert}" in str(e.value)
    assert "trusts the CA that signed LAMINAR_TEMPORAL_TLS_CERT" in str(e.value)
    # An API key instead of a certificate does not pass a proxy that demands one; the message still points at it.
    key_only = Settings.from_env(mtls.without_certificate(LAMINAR_TEMPORAL_API_KEY="an-api-key"))
    with pytest.raises(LaminarError) as e:
        await connect(key_only)
    assert "over TLS with an API key" in str(e.value) and "set LAMINAR_TEMPORAL_TLS_CERT" in str(e.value)
    assert "an-api-key" not in str(e.value)
    # The right certificate but a name the server's certificate does not carry: the client refuses the server.
    wrong_name = Settings.from_env({**mtls.env, "LAMINAR_TEMPORAL_TLS_SERVER_NAME": "elsewhere.laminar.test"})
    with pytest.raises(LaminarError) as e:
        await connect(wrong_name)
    assert "LAMINAR_TEMPORAL_TLS_SERVER_NAME a name on it" in str(e.value)
    assert SECRETS["LAMINAR_TEMPORAL_API_KEY"] not in str(e.value)
    # Plain gRPC to a TLS port: refused, and the message says TLS may be what is missing.
    plain = Settings.from_env({k: v for k, v in mtls.without_certificate().items()
                               if not k.startswith("LAMINAR_TEMPORAL_TLS")})
    with pytest.raises(LaminarError) as e:
        await connect(plain)
    assert "without TLS" in str(e.value) and "set LAMINAR_TEMPORAL_TLS=true" in str(e.value)
    # A worker process without a certificate exits 1 with the same one-line message, instead of serving.
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "laminar.cli.main", "worker", "control"],
                         env=_worker_env(mtls.without_certificate()), capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    said = " ".join(out.stderr.split())  # the console wraps long lines
    assert out.returncode == 1, out.stdout + out.stderr
    assert "over TLS without a client certificate" in said and "LAMINAR_TEMPORAL_TLS_CERT" in said
    assert took < 30, f"the refused worker took {took:.1f} s to give up"
    # The proxy saw the refusals: handshakes without a peer certificate / with an untrusted one.
    log = mtls.proxy_log.read_text(errors="replace")
    assert "client sent no required SSL certificate" in log, log[-2000:]
    assert "client SSL certificate verify error" in log, log[-2000:]


@dataclass
class MtlsRun:
    final: RunStatus
    histories: list
    log_dir: Path
    settings: Settings
    wall_s: float
    environs: dict[str, str]  # process name -> its /proc environ, read while it ran


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def mtls_run(mtls) -> AsyncIterator[MtlsRun]:
    """A short run over mTLS: the workers (control, trainer, one relay, one rollout) reach Temporal only through
    the proxy with the client certificate, and the store through the standard AWS variables."""
    cfg = small_config(f"run.steps={STEPS}", "relay.relays=1", "rollout.replicas=1")
    log_dir = mtls.home / "logs" / cfg.run.run_id
    procs = plan_processes(cfg, mtls.settings, log_dir)
    for p in procs:  # plan_processes copies our environment; the workers get the distinctive keys instead
        p.env = _worker_env({k: v for k, v in p.env.items() if k.startswith("LAMINAR_")})
    launcher = LocalLauncher(procs)
    t0 = time.monotonic()
    launcher.start_all()
    try:
        wf_id = workflow_id_for(cfg.run.run_id)
        # As infra/README.md starts a run: the temporal CLI, through the proxy, with the client certificate.
        cmd = [temporal_binary(), "workflow", "start", "--address", mtls.proxy_address, "--namespace", "default",
               "--tls-cert-path", str(mtls.pki.client_cert), "--tls-key-path", str(mtls.pki.client_key),
               "--tls-ca-path", str(mtls.pki.ca), "--tls-server-name", SERVER_NAME,
               "--type", "TrainingRunWorkflow", "--task-queue", CONTROL_QUEUE, "--workflow-id", wf_id,
               "--input", json.dumps({"config": cfg.to_json()})]
        started = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        assert started.returncode == 0, started.stdout + started.stderr
        client = await connect(mtls.settings)
        final = await client.get_workflow_handle(wf_id, result_type=RunStatus).result()
        wall_s = time.monotonic() - t0
        # The workers really held the secrets (so finding none below means something): each process's environment.
        environs = {name: Path(f"/proc/{p.pid}/environ").read_bytes().decode(errors="replace")
                    for name, p in launcher.processes.items()}
        yield MtlsRun(final, await history_chain(client, wf_id), log_dir, mtls.settings, wall_s, environs)
    finally:
        launcher.stop_all()


async def test_short_run_over_mtls(mtls_run):
    final = mtls_run.final
    assert final.phase == "finished" and final.step == STEPS
    assert final.groups_consumed == STEPS * 2  # trainer.groups_per_step=2 (tests/fixtures/stack.py)
    assert final.groups_consumed_twice == 0
    assert final.groups_generated == final.groups_consumed + final.ready_groups  # none lost
    print(f"mTLS short run: {mtls_run.wall_s:.1f} s from worker start to result")


async def test_secrets_appear_in_no_log_history_or_stored_object(mtls_run):
    # Every log under the home: the workers' (at debug level), the Temporal dev server's and the proxy's.
    logs = sorted(mtls_run.log_dir.parent.parent.rglob("*.log"))
    assert {p.name for p in logs} >= {"control.log", "trainer.log", "relay-host-0.log", "rollout-host-0.log",
                                      "temporal.log", "nginx.log"}
    texts = {str(p): p.read_text(errors="replace") for p in logs}
    texts.update({f"history {i}": json.dumps(h.to_json_dict()) for i, h in enumerate(mtls_run.histories)})
    store = open_store(mtls_run.settings.store_url, endpoint_url=mtls_run.settings.s3_endpoint)
    keys = store.list("")
    assert any(k.endswith(".safetensors") or "checkpoint" in k for k in keys), keys[:20]
    for k in keys:
        texts[f"object {k}"] = store.get(k).decode("latin-1")
    assert all(texts.values()), [k for k, v in texts.items() if not v]  # every log and history has content
    for name, secret in SECRETS.items():
        holders = [p for p, environ in mtls_run.environs.items() if f"{name}={secret}" in environ]
        assert len(holders) == 4, f"{name} reached only {holders}"  # control, trainer, relay and rollout
        leaks = [where for where, text in texts.items() if secret in text]
        assert not leaks, f"{name} appears in {leaks}"
    print(f"searched {len(logs)} logs, {len(mtls_run.histories)} histories, {len(keys)} objects")
