"""Local launcher: starts one process per role for `laminar run`, supervises and stops them by pid.

Layout for a config with H relays (simulated hosts) and R replicas: one control worker, one trainer
worker, and per host `host-i` one relay worker and one rollout worker with its share of the R replica
slots. A worker that dies is restarted with exponential backoff, as a cluster scheduler restarts a pod
(recovery itself never depends on that restart: Temporal retries the work on any free worker). The backoff
starts again from 1 s once a process has run for HEALTHY_S, so an old crash never delays a later restart.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from laminar.client.settings import Settings
from laminar.config import RunConfig
from laminar.devstack.stack import free_port
from laminar.logs import get_logger

log = get_logger(__name__)
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1

MAX_BACKOFF_S = 30.0
HEALTHY_S = 60.0  # a process that ran this long before it exited is restarted after the shortest backoff


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0  # restarts since the process last ran for healthy_s
    restart_at: float | None = None
    started_at: float = 0.0  # time.monotonic() of the last start
    pids: list[int] = field(default_factory=list)  # every incarnation's pid, oldest first (the process table)
    # each incarnation's start time as the OS has it (psutil create_time), beside `pids`: a pid the OS gives to a
    # later process is told apart from the incarnation by it (the chaos check `processes`); None if not read
    create_times: list[float | None] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


def plan_processes(cfg: RunConfig, settings: Settings, log_dir: Path, spare_slots: int = 0,
                   allow_faults: bool = False, metrics: bool = False) -> list[ManagedProcess]:
    """One process per role; each rollout worker gets its share of replicas plus `spare_slots`, so that a
    replica whose worker died is retried at once on a surviving worker. allow_faults: every process
    accepts recovery-drill faults on its own fault queue. metrics: each process serves Prometheus metrics
    on a free port of its own (LAMINAR_METRICS_PORT; a restarted process keeps its port)."""
    base = [sys.executable, "-m", "laminar.cli.main", "worker", *(["--allow-faults"] if allow_faults else [])]
    env = {**os.environ, **settings.to_env()}
    procs = [
        ManagedProcess("control", [*base, "control"], env, log_dir / "control.log"),
        ManagedProcess("trainer", [*base, "trainer"], env, log_dir / "trainer.log"),
    ]
    hosts = cfg.relay.relays
    for i, slots in enumerate(rollout_slots(cfg.rollout.replicas, hosts, spare_slots)):
        host_env = {**env, "LAMINAR_HOST_ID": f"host-{i}"}
        procs.append(ManagedProcess(f"relay-host-{i}", [*base, "relay"], host_env, log_dir / f"relay-host-{i}.log"))
        if slots:
            procs.append(ManagedProcess(f"rollout-host-{i}", [*base, *rollout_args(slots, spare_slots)], host_env,
                                        log_dir / f"rollout-host-{i}.log"))
    for p in procs:
        p.env = {**p.env, "LAMINAR_METRICS_PORT": str(free_port(settings.metrics_bind) if metrics else 0)}
    return procs


def rollout_slots(replicas: int, hosts: int, spare_slots: int) -> list[int]:
    """Rollout slots per host for `replicas` replicas: each host its share (the first hosts one more when they do
    not divide evenly), plus `spare_slots` on every host that has a share. 5 on 2 hosts, 1 spare: [4, 3]."""
    return [s + spare_slots if s else 0
            for s in (replicas // hosts + (1 if i < replicas % hosts else 0) for i in range(hosts))]


def rollout_args(slots: int, spare: int) -> list[str]:
    """`laminar worker`'s arguments for a rollout worker of `slots` slots, `spare` of them spares (polled for a new
    replica only after a wait, so that a run's replicas spread over its workers first: workers/rollout_slots.py)."""
    return ["rollout", "--slots", str(slots), *(["--spare", str(spare)] if spare else [])]


def slots_to_add(replicas: int, hosts: int, spare_slots: int, have: list[int]) -> list[int]:
    """Per host, the rollout slots to add so that `replicas` replicas fit as rollout_slots lays them out
    (`laminar scale` upward); never negative: a scale-down stops no worker (its idle slots stay)."""
    return [max(0, want - got) for want, got in zip(rollout_slots(replicas, hosts, spare_slots), have, strict=True)]


def metrics_url(p: ManagedProcess) -> str | None:
    """The process's Prometheus endpoint, None when it serves none."""
    port = int(p.env.get("LAMINAR_METRICS_PORT", "0") or 0)
    return f"http://{p.env.get('LAMINAR_METRICS_BIND', '127.0.0.1')}:{port}/metrics" if port else None


class LocalLauncher:
    def __init__(self, processes: list[ManagedProcess], healthy_s: float = HEALTHY_S) -> None:
        self.processes = {p.name: p for p in processes}
        self.healthy_s = healthy_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._retired: list[ManagedProcess] = []  # given the notice by match_relays, no longer supervised
        self.table_path: Path | None = None  # where publish_table writes the process table (None: nowhere)

    def start_supervision(self, interval_s: float = 0.5) -> None:
        """Supervise from a background thread until stop_all()."""

        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.supervise()

        self._thread = threading.Thread(target=loop, name="launcher-supervisor", daemon=True)
        self._thread.start()

    def start_all(self) -> None:
        for p in self.processes.values():
            self._start(p)

    def match_replicas(self, replicas: int, hosts: int, spare_slots: int) -> list[str]:
        """`laminar scale`: start a rollout worker on each host whose slots fall short of `replicas` replicas
        (slots_to_add); returns the names started. Workers are never stopped here: a removed replica returns
        and frees its slot, and an idle worker holds nothing."""
        have = [0] * hosts
        for p in self.processes.values():
            host = p.env.get("LAMINAR_HOST_ID", "")
            if "rollout" in p.argv and "--slots" in p.argv and host.startswith("host-"):
                i = int(host.removeprefix("host-"))
                if i < hosts:
                    have[i] += int(p.argv[p.argv.index("--slots") + 1])
        started = []
        with self._lock:
            for i, add in enumerate(slots_to_add(replicas, hosts, spare_slots, have)):
                relay = self.processes.get(f"relay-host-{i}")
                if not add or relay is None or self._stop.is_set():
                    continue
                name = next(f"rollout-host-{i}-{k}" for k in range(1, 10_000)
                            if f"rollout-host-{i}-{k}" not in self.processes)
                env = dict(relay.env)
                if env.get("LAMINAR_METRICS_PORT", "0") not in ("", "0"):
                    env["LAMINAR_METRICS_PORT"] = str(free_port(env.get("LAMINAR_METRICS_BIND", "127.0.0.1")))
                spare = spare_slots if not have[i] else 0  # a host's first rollout worker keeps its spares
                p = ManagedProcess(name, [*relay.argv[:-1], *rollout_args(add, spare)], env,
                                   relay.log_path.with_name(f"{name}.log"))
                self.processes[name] = p
                self._start(p)
                started.append(name)
        return started

    def match_relays(self, relays: int, notice_s: float = 30.0) -> tuple[list[str], list[str]]:
        """`laminar scale --relays M`: one relay per host host-0 .. host-(M-1). Starts the relay of each host that
        has none (same argv and settings as host-0's relay, its own LAMINAR_HOST_ID); gives a host beyond M the
        notice (SIGTERM: its relay leaves the chain, its rollout workers hand their groups over) and SIGKILLs what
        is left after notice_s, without restarting it. Returns (started, stopped) process names. Call
        match_replicas(replicas, relays, ...) after it: a new host's rollout slots and a gone host's share."""
        if relays < 1:
            raise ValueError(f"relays={relays}: a run needs at least one relay (one per host)")
        started, stopped = [], []
        with self._lock:
            template = next((p for n, p in sorted(self.processes.items()) if n.startswith("relay-host-")), None)
            if template is None or self._stop.is_set():
                return started, stopped
            for i in range(relays):
                name = f"relay-host-{i}"
                if name in self.processes:
                    continue
                env = {**template.env, "LAMINAR_HOST_ID": f"host-{i}"}
                if env.get("LAMINAR_METRICS_PORT", "0") not in ("", "0"):
                    env["LAMINAR_METRICS_PORT"] = str(free_port(env.get("LAMINAR_METRICS_BIND", "127.0.0.1")))
                p = ManagedProcess(name, list(template.argv), env, template.log_path.with_name(f"{name}.log"))
                self.processes[name] = p
                self._start(p)
                started.append(name)
            for name, p in list(self.processes.items()):
                host = p.env.get("LAMINAR_HOST_ID", "")
                if (host.startswith("host-") and int(host.removeprefix("host-")) >= relays
                        and name.split("-", 1)[0] in ("relay", "rollout")):
                    del self.processes[name]  # no longer supervised: never restarted
                    self._retired.append(p)
                    if p.proc is not None and p.proc.poll() is None:
                        _signal(p, signal.SIGTERM)
                        threading.Thread(target=_kill_after, args=(p, notice_s), name=f"retire-{name}",
                                         daemon=True).start()
                    stopped.append(name)
        for name in started:
            log.info("relay_started", name=name)
        for name in stopped:
            log.info("host_retired", name=name, notice_s=notice_s)
        return started, stopped

    def _start(self, p: ManagedProcess) -> None:
        p.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(p.log_path, "ab")  # noqa: SIM115 - owned by the child
        p.proc = subprocess.Popen(p.argv, env=p.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True, preexec_fn=_die_with_parent)
        out.close()
        p.restart_at = None
        p.started_at = time.monotonic()
        p.pids.append(p.proc.pid)
        p.create_times.append(create_time(p.proc.pid))
        log.info("process_started", name=p.name, pid=p.proc.pid, log=str(p.log_path))
        self.publish_table()

    def supervise(self) -> list[str]:
        """Restart processes that exited, with backoff; returns the names restarted now."""
        restarted = []
        now = time.monotonic()
        with self._lock:
            for p in self.processes.values():
                if self._stop.is_set():
                    break
                if self._restart_if_due(p, now):
                    restarted.append(p.name)
        return restarted

    def _restart_if_due(self, p: ManagedProcess, now: float) -> bool:
        if p.proc is None or p.proc.poll() is None:
            return False
        if p.restart_at is None:
            if now - p.started_at >= self.healthy_s:
                p.restarts = 0
            delay = min(MAX_BACKOFF_S, 2.0**p.restarts)
            p.restart_at = now + delay
            log.warning("process_exited", name=p.name, pid=p.proc.pid, code=p.proc.returncode,
                        restart_in_s=delay, log=str(p.log_path))
            return False
        if now < p.restart_at:
            return False
        p.restarts += 1
        self._start(p)
        return True

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) of each live process's current incarnation, by name."""
        out = {}
        for name, p in self.processes.items():
            if p.proc is not None and p.proc.poll() is None and (cpu := process_cpu_s(p.proc.pid)) is not None:
                out[name] = cpu
        return out

    def stop_all(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every live process we started, then SIGKILL what is left after timeout_s."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        live = [p for p in [*self.processes.values(), *self._retired] if p.proc is not None and p.proc.poll() is None]
        for p in live:
            _signal(p, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in live:
            assert p.proc is not None
            try:
                p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(p, signal.SIGKILL)
                p.proc.wait(timeout=5)
        log.info("processes_stopped", count=len(live))
        self.publish_table(stopped=True)

    def publish_table(self, stopped: bool = False) -> None:
        """Write the process table to table_path (atomically), if set: what `laminar chaos` aims its faults at
        and checks for leaks against (format: docs/architecture/failures.md, 'Process table')."""
        if self.table_path is None:
            return
        table = process_table(self.processes.values(), stopped)
        self.table_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.table_path.with_name(f".{self.table_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=2))
        tmp.replace(self.table_path)


def process_table(processes, stopped: bool = False) -> dict:
    """The launcher's processes: name, role, host, current pid and every earlier pid with its start time, restarts."""
    rows = []
    for p in processes:
        role = next((a for a in p.argv if a in ("control", "trainer", "relay", "rollout")), "")
        rows.append({"name": p.name, "role": role, "host_id": p.env.get("LAMINAR_HOST_ID", ""),
                     "pid": p.pid, "pids": list(p.pids), "create_times": list(p.create_times),
                     "restarts": len(p.pids) - 1 if p.pids else 0,
                     "log": str(p.log_path)})
    return {"format": 1, "launcher_pid": os.getpid(), "updated_at": round(time.time(), 3), "stopped": stopped,
            "processes": rows}


def create_time(pid: int) -> float | None:
    """When the OS started process `pid` (seconds since the epoch, as psutil reads it), None if it is gone."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process, None if it is gone or not readable."""
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return round(t.user + t.system, 2)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the launching thread dies, even by SIGKILL (Linux), so no
    worker outlives its launcher (a `laminar run` started again attaches with a fresh set of processes)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _kill_after(p: ManagedProcess, timeout_s: float) -> None:
    """Wait for a process given the notice to exit; SIGKILL it after timeout_s."""
    assert p.proc is not None
    try:
        p.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _signal(p, signal.SIGKILL)
        p.proc.wait(timeout=5)


def _signal(p: ManagedProcess, sig: int) -> None:
    assert p.proc is not None
    try:
        os.kill(p.proc.pid, sig)
    except ProcessLookupError:
        pass
