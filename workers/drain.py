"""`laminar drain WORKER`: give one worker process of this deployment the notice (laminar/notice.py), as a spot
machine's preemption warning or a cluster's drain would, and wait until it has left.

A worker is named as the launchers name it: `control`, `trainer`, `relay-<host>`, `rollout-<host>`. It is found
among this machine's processes by its command line (`... cli.main worker <role>`) and its LAMINAR_HOME and
LAMINAR_HOST_ID, so the command works for `laminar run`, `laminar workers` and hand-started workers alike. A
worker that got the notice stops taking work at once and exits 0 once its activities have left (a rollout
replica hands its groups to other replicas; the trainer finishes its step and checkpoints; a relay leaves the
chain), within LAMINAR_NOTICE_S; a launcher that supervises it starts a fresh one.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from laminar.errors import ConfigError


@dataclass(frozen=True)
class Drained:
    name: str
    pid: int
    left_s: float | None  # seconds from the notice to its exit; None: still running after the wait


def worker_name(cmdline: list[str], environ: dict[str, str]) -> str | None:
    """The launcher's name of a worker process, from its command line and environment (None: not a worker)."""
    if "laminar.cli.main" not in cmdline or "worker" not in cmdline:
        return None
    rest = cmdline[cmdline.index("worker") + 1:]
    role = next((a for a in rest if not a.startswith("-") and not a.isdigit()), None)
    if role in ("control", "trainer"):
        return role
    if role in ("relay", "rollout"):
        return f"{role}-{environ.get('LAMINAR_HOST_ID') or 'host-0'}"
    return None


def find_workers(home: Path) -> dict[str, list[psutil.Process]]:
    """This deployment's worker processes (LAMINAR_HOME == home) on this machine, by name."""
    found: dict[str, list[psutil.Process]] = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid == os.getpid() or not p.info["cmdline"]:
                continue
            name = worker_name(p.info["cmdline"], {})
            if name is None:
                continue
            env = p.environ()
            if Path(env.get("LAMINAR_HOME", "")).resolve() != home.resolve():
                continue
            found.setdefault(worker_name(p.info["cmdline"], env) or name, []).append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def drain(home: Path, name: str, wait_s: float) -> list[Drained]:
    """SIGTERM (the notice) to every process of worker `name`, then wait up to wait_s for each to exit."""
    workers = find_workers(home)
    if name not in workers:
        have = ", ".join(sorted(workers)) or "none"
        raise ConfigError(f"drain: no worker named {name!r} runs under LAMINAR_HOME={home} on this machine "
                          f"(running: {have}); names are control, trainer, relay-<host>, rollout-<host>")
    t0 = time.monotonic()
    procs = workers[name]
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    left: dict[int, float] = {}
    while len(left) < len(procs) and time.monotonic() - t0 < wait_s:
        for p in procs:
            if p.pid not in left and _gone(p):
                left[p.pid] = round(time.monotonic() - t0, 2)
        time.sleep(0.1)
    return [Drained(name, p.pid, left.get(p.pid)) for p in procs]


def _gone(p: psutil.Process) -> bool:
    """Exited: no such process, or a zombie its parent (the launcher) has not reaped yet."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
