"""The nemesis of `laminar chaos`: carries a chaos schedule (chaos/schedule.py) out against a live run and heals
every fault it injects.

It aims at the processes of the run's process table (`<LAMINAR_HOME>/runs/<run_id>/processes.json`, written
by the local launcher: workers/launcher.py), on the machine that runs them, by pid. The store, readonly and
Temporal faults reuse the dev stack's own interruptions (devstack/stack.py: `interrupt_s3`, the store drill's,
`readonly_s3` and `restart_temporal`). A partition drops a relay's data-plane packets with iptables or nft
(`make setup` installs iptables where neither exists and it runs as root); where neither works, each partition
fault is recorded as skipped with that reason, and the chaos report shows it. Process faults are signals sent by pid rather than the drills' fault activities: a
fault's delivery must not depend on Temporal, which another fault may be restarting at that moment, and the
drills' activity only knows SIGKILL.

Each fault runs on its own thread (inject, hold, heal), so faults overlap as the schedule says. Whatever
happens, `heal_all` undoes what is still held (SIGCONT, partition rules removed) before the command exits. A
nemesis killed outright cannot; each partition rule names its owner's pid, and the next nemesis removes the rules
of owners that no longer run (`sweep_stale_rules`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from laminar.chaos.schedule import Fault, Schedule
from laminar.logs import get_logger

log = get_logger(__name__)
RESTART_WAIT_S = 90.0  # a killed or preempted process must be back (a new pid in the table) within this
NO_PACKET_FILTER = ("no packet filter on this machine: neither iptables nor nft is installed and usable (needs root; "
                    "`make setup` installs iptables as root)")


@dataclass
class FaultRecord:
    """What the nemesis did with one fault; times are Unix seconds."""

    index: int
    kind: str
    target: str
    planned_at: float
    hold_s: float
    injected_at: float | None = None
    healed_at: float | None = None
    pid: int | None = None  # the process hit (process and partition kinds)
    new_pid: int | None = None  # its next incarnation (kill, preempt)
    detail: str = ""  # the port partitioned, the tool used, the writes refused, or why the fault was skipped
    skipped: bool = False
    refused: int | None = None  # readonly: writes the store refused while it held


def read_table(path: Path) -> dict:
    """The launcher's process table, {} while it is not written yet."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def current_pid(path: Path, name: str) -> int | None:
    return current_incarnation(path, name)[0]


def current_incarnation(path: Path, name: str) -> tuple[int | None, float | None]:
    """(pid, start time) of the named process's newest incarnation in the launcher's table; the start time is None
    in a table written before the launcher recorded them."""
    row = next((r for r in read_table(path).get("processes", []) if r["name"] == name), None)
    if row is None:
        return None, None
    pids, times = row.get("pids") or [], row.get("create_times") or []
    created = times[-1] if times and pids and pids[-1] == row["pid"] and len(times) == len(pids) else None
    return row["pid"], created


# psutil derives create_time from the boot time and the start in clock ticks (1/100 s): the same process reads the
# same, a later one with the same pid reads later by at least the pid's reuse, far more than this
SAME_START_S = 0.05


def same_start(proc: psutil.Process, created: float | None) -> bool:
    """Whether `proc` is the incarnation that started at `created` (not a later process given its pid)."""
    return created is None or abs(proc.create_time() - created) <= SAME_START_S


def alive(pid: int, created: float | None) -> bool:
    """Whether the incarnation (pid, start time) still runs: a zombie does not, nor a process the OS has since given
    the same pid."""
    try:
        proc = psutil.Process(pid)
        return same_start(proc, created) and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def partition_tool() -> str | None:
    """The packet filter this machine can drop a port's packets with: iptables or nft, else None."""
    for tool, probe in (("iptables", ["iptables", "-S", "OUTPUT"]), ("nft", ["nft", "list", "tables"])):
        if shutil.which(tool) and subprocess.run(probe, capture_output=True, timeout=10).returncode == 0:
            return tool
    return None


RULE_TAG = "laminar-chaos pid="  # + the nemesis's pid: whose rule it is (a sweep removes those of dead owners)


def _partition_commands(tool: str, port: int, add: bool, owner: int | None = None) -> list[list[str]]:
    """Drop every TCP packet to or from `port` (both directions on loopback too), or remove that again. Each rule
    names its owner (this process by default), so one left by a nemesis that was killed can be found."""
    owner = os.getpid() if owner is None else owner
    if tool == "iptables":
        op = "-I" if add else "-D"
        tag = ["-m", "comment", "--comment", f"{RULE_TAG}{owner}"]
        return [["iptables", op, "INPUT", "-p", "tcp", "--dport", str(port), *tag, "-j", "DROP"],
                ["iptables", op, "OUTPUT", "-p", "tcp", "--sport", str(port), *tag, "-j", "DROP"]]
    table = f"laminar_chaos_{owner}_{port}"
    if add:
        return [["nft", "add", "table", "inet", table],
                ["nft", "add", "chain", "inet", table, "in", "{ type filter hook input priority -10 ; }"],
                ["nft", "add", "chain", "inet", table, "out", "{ type filter hook output priority -10 ; }"],
                ["nft", "add", "rule", "inet", table, "in", "tcp", "dport", str(port), "drop"],
                ["nft", "add", "rule", "inet", table, "out", "tcp", "sport", str(port), "drop"]]
    return [["nft", "delete", "table", "inet", table]]


def sweep_stale_rules(tool: str) -> list[str]:
    """Remove the partition rules whose owner (a nemesis) is no longer alive: a `laminar chaos` killed before it
    healed leaves its ports dropped, and a later process on such a port would be silently cut off. Rules of a
    live owner (another chaos run on this machine) are left alone. Returns what was removed."""
    removed = []
    if tool == "iptables":
        listing = subprocess.run(["iptables", "-S"], capture_output=True, text=True, timeout=10).stdout
        for line in listing.splitlines():
            if RULE_TAG in line and line.startswith("-A ") and not _owner_alive(line):
                _run_all([["iptables", "-D", *shlex.split(line)[1:]]], check=False)
                removed.append(line)
    else:
        listing = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, timeout=10).stdout
        for line in listing.splitlines():
            name = line.split()[-1] if line.startswith("table inet laminar_chaos_") else ""
            parts = name.removeprefix("laminar_chaos_").split("_")
            if len(parts) == 2 and parts[0].isdigit() and not psutil.pid_exists(int(parts[0])):
                _run_all([["nft", "delete", "table", "inet", name]], check=False)
                removed.append(line)
    if removed:
        log.warning("chaos_stale_rules_removed", tool=tool, rules=removed)
    return removed


def _owner_alive(rule: str) -> bool:
    """Whether the nemesis named in a rule's comment (`laminar-chaos pid=N`) still runs."""
    found = re.search(re.escape(RULE_TAG) + r"(\d+)", rule)
    return found is not None and psutil.pid_exists(int(found.group(1)))


def data_ports(pid: int) -> list[int]:
    """The TCP ports the process listens on, less its metrics port: a relay's data plane."""
    proc = psutil.Process(pid)
    metrics = int(proc.environ().get("LAMINAR_METRICS_PORT", "0") or 0)
    return sorted({c.laddr.port for c in proc.net_connections(kind="tcp")
                   if c.status == psutil.CONN_LISTEN and c.laddr.port != metrics})


class Nemesis:
    def __init__(self, table_path: Path, interrupt_store: Callable[[float], tuple[float, float]] | None,
                 restart_temporal: Callable[[], tuple[float, float]] | None, partition: str | None = None,
                 readonly_store: Callable[[float], tuple[float, float, int]] | None = None) -> None:
        self.table_path = table_path
        self._interrupt_store, self._restart_temporal = interrupt_store, restart_temporal
        self._readonly_store = readonly_store
        self.partition = partition  # iptables | nft | None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._stopped_pids: set[int] = set()  # SIGSTOPped and not yet continued
        self._partitioned: set[int] = set()  # ports whose packets are dropped now
        self.records: list[FaultRecord] = []

    def run(self, schedule: Schedule, t0: float, on_record: Callable[[FaultRecord], None] = lambda r: None) -> None:
        """Inject each fault at t0 + at_s on a thread of its own; return when every fault has healed (or
        the nemesis was stopped: then what is held is healed at once)."""
        if self.partition is not None:
            sweep_stale_rules(self.partition)
        threads = []
        for f in sorted(schedule.faults, key=lambda f: f.at_s):
            if self._stop.wait(max(0.0, t0 + f.at_s - time.time())):
                break
            rec = FaultRecord(f.index, f.kind, f.target, round(t0 + f.at_s, 3), f.hold_s)
            self.records.append(rec)
            th = threading.Thread(target=self._one, args=(f, rec, on_record), name=f"nemesis-{f.index}", daemon=True)
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
        self.heal_all()

    def stop(self) -> None:
        self._stop.set()

    def _one(self, f: Fault, rec: FaultRecord, on_record: Callable[[FaultRecord], None]) -> None:
        try:
            {"kill": self._kill, "stop": self._sigstop, "partition": self._partition, "store": self._store,
             "readonly": self._readonly, "temporal": self._temporal, "preempt": self._preempt}[f.kind](f, rec)
        except Exception as e:  # one fault failing to inject never stops the others; it is reported
            rec.skipped, rec.detail = True, f"{type(e).__name__}: {e}"
            log.warning("chaos_fault_failed", index=f.index, kind=f.kind, target=f.target, error=str(e))
        on_record(rec)

    def _target_pid(self, f: Fault, rec: FaultRecord) -> int | None:
        pid, created = current_incarnation(self.table_path, f.target)
        # alive() and not pid_exists(): the table's pid may have died (its restart not yet recorded) and been given
        # to an unrelated process since (pids wrap within minutes here: a sandbox spawns one per tool call)
        if pid is None or not alive(pid, created):
            rec.skipped, rec.detail = True, f"{f.target} had no live process (pid {pid}) at injection"
            return None
        rec.pid = pid
        return pid

    def _signal_and_wait_restart(self, f: Fault, rec: FaultRecord, sig: signal.Signals) -> None:
        if (pid := self._target_pid(f, rec)) is None:
            return
        os.kill(pid, sig)
        rec.injected_at = time.time()
        log.warning("chaos_fault_injected", index=f.index, kind=f.kind, target=f.target, pid=pid, signal=sig.name)
        deadline = time.time() + RESTART_WAIT_S
        while time.time() < deadline:  # healed when the launcher has started the next incarnation
            new = current_pid(self.table_path, f.target)
            if new is not None and new != pid:
                rec.new_pid, rec.healed_at = new, time.time()
                return
            time.sleep(0.2)
        rec.detail = f"no restart of {f.target} within {RESTART_WAIT_S:.0f}s"

    def _kill(self, f: Fault, rec: FaultRecord) -> None:
        self._signal_and_wait_restart(f, rec, signal.SIGKILL)

    def _preempt(self, f: Fault, rec: FaultRecord) -> None:
        self._signal_and_wait_restart(f, rec, signal.SIGTERM)

    def _sigstop(self, f: Fault, rec: FaultRecord) -> None:
        if (pid := self._target_pid(f, rec)) is None:
            return
        with self._lock:
            os.kill(pid, signal.SIGSTOP)
            self._stopped_pids.add(pid)
        rec.injected_at = time.time()
        log.warning("chaos_fault_injected", index=f.index, kind=f.kind, target=f.target, pid=pid, hold_s=f.hold_s)
        self._stop.wait(f.hold_s)
        self._continue(pid)
        rec.healed_at = time.time()

    def _partition(self, f: Fault, rec: FaultRecord) -> None:
        if self.partition is None:
            rec.skipped, rec.detail = True, NO_PACKET_FILTER
            return
        if (pid := self._target_pid(f, rec)) is None:
            return
        ports = data_ports(pid)
        if not ports:
            rec.skipped, rec.detail = True, f"{f.target} (pid {pid}) listens on no data port"
            return
        rec.detail = f"{self.partition} drop tcp port(s) {ports}"
        with self._lock:
            for port in ports:
                _run_all(_partition_commands(self.partition, port, add=True))
                self._partitioned.add(port)
        rec.injected_at = time.time()
        log.warning("chaos_fault_injected", index=f.index, kind=f.kind, target=f.target, ports=ports, hold_s=f.hold_s)
        self._stop.wait(f.hold_s)
        for port in ports:
            self._unpartition(port)
        rec.healed_at = time.time()

    def _store(self, f: Fault, rec: FaultRecord) -> None:
        if self._interrupt_store is None:
            rec.skipped, rec.detail = True, "the dev stack runs no S3 server to interrupt"
            return
        rec.injected_at = time.time()  # replaced by when the server was stopped
        stopped_at, back_at = self._interrupt_store(f.hold_s)
        rec.injected_at, rec.healed_at = stopped_at, back_at

    def _readonly(self, f: Fault, rec: FaultRecord) -> None:
        if self._readonly_store is None:
            rec.skipped, rec.detail = True, "the dev stack runs no S3 server to make read-only"
            return
        rec.injected_at = time.time()  # replaced by when the server went read-only
        on_at, off_at, refused = self._readonly_store(f.hold_s)
        rec.injected_at, rec.healed_at, rec.refused = on_at, off_at, refused
        rec.detail = f"{refused} write(s) refused with AccessDenied"

    def _temporal(self, f: Fault, rec: FaultRecord) -> None:
        if self._restart_temporal is None:
            rec.skipped, rec.detail = True, "no dev-stack Temporal server to restart"
            return
        rec.injected_at = time.time()
        stopped_at, back_at = self._restart_temporal()
        rec.injected_at, rec.healed_at = stopped_at, back_at

    def _continue(self, pid: int) -> None:
        with self._lock:
            if pid in self._stopped_pids:
                self._stopped_pids.discard(pid)
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    def _unpartition(self, port: int) -> None:
        with self._lock:
            if port in self._partitioned and self.partition is not None:
                self._partitioned.discard(port)
                _run_all(_partition_commands(self.partition, port, add=False), check=False)

    def heal_all(self) -> None:
        """Undo whatever is still held: continue stopped processes, remove partition rules."""
        for pid in list(self._stopped_pids):
            self._continue(pid)
        for port in list(self._partitioned):
            self._unpartition(port)


def _run_all(cmds: list[list[str]], check: bool = True) -> None:
    for cmd in cmds:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[:200]}")

