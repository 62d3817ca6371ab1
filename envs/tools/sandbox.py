"""`PythonSandbox` (`<python>`): the model's Python program run in a separate, isolated process.

`run_python(code, limits) -> SandboxResult` is the whole sandbox; `PythonSandbox` is the thin tool around it.

Isolation (all real kernel mechanisms; nothing here trusts the program):
- a new network namespace (only a loopback device, left down: no connection anywhere, 127.0.0.1 included),
  a new PID namespace (the program cannot see or signal other processes; when its init dies, the kernel kills
  everything left in it, so nothing escapes by `setsid` or double fork), and new mount and IPC namespaces;
- in the mount namespace a new, empty root (pivot_root; the host's root detached) holding only an allow-list
  (envs/tools/sandbox_root.py): read-only binds of the interpreter, its standard library and the libraries it
  loads, /dev with null, zero, full, random, urandom, the new PID namespace's /proc (hidepid=2), a fresh
  root-owned tmpfs /tmp (size-capped) holding the working directory /tmp/work (the only writable place), and
  a task's own `read_only` paths;
- a cgroup per run for the whole sandbox's memory, processes and CPU (envs/tools/sandbox_cgroup.py; v2, or v1
  where the controllers are there); a kill at its memory limit is a `memory` failure;
- an unprivileged uid and gid (no supplementary groups), one per concurrent sandbox from
  `SandboxLimits.uid_base` .. `uid_base + uid_count - 1` (held by a lock file, so RLIMIT_NPROC, which counts
  per uid, stops one sandbox's fork bomb without starving another); no system user is created;
- rlimits: CPU seconds, address space, file size, open files, processes, no core files (per process: the only
  memory and process limits where there is no cgroup, reported as `SandboxResult.limits == "rlimits"`);
  no new privileges;
- an empty environment; stdin is /dev/null; a wall-clock timeout that SIGKILLs the sandbox's process group
  (its PID namespace's init, so the whole namespace goes);
- stdout and stderr (one stream, in order) read with a byte cap: the process is killed on exceeding it.

Which outcomes fail the tool (a `SandboxResult` with `failure` set, `ToolResult(ok=False)`: the replica fails
the group with reason "sandbox", retried then dropped) and which are output the model reads (docs/decisions/sandbox.md):
- failure: the wall-clock timeout (`timeout`), the CPU limit (`cpu`: SIGXCPU / SIGKILL), the output cap
  (`output`), an uncaught MemoryError or a kill at the cgroup's memory limit (`memory`), a fork or spawn refused by the process limit (`processes`),
  any socket connect/bind/send (`network`), a write, create, rename or delete outside the working directory
  (`write`), a file past the size limit or the tmpfs full (`file_size`), too many open files (`open_files`),
  death by any other signal (`signal`);
- output: everything else, a Python exception included (its traceback is the output), with `exit_code`.
The violations the kernel stops anyway (network, writes) are also reported by an audit hook inside the sandbox
(`sys.addaudithook`, which Python code cannot remove) so they fail the group instead of being an error message;
a program that bypasses the hook through ctypes is still stopped by the kernel, it just sees the error.

The processes: the bootstrap (envs/tools/sandbox_boot.py, run by path as root: namespaces, the new root, the
program's process) and the shim (envs/tools/sandbox_shim.py, run by the sandboxed interpreter before the program:
the audit hook, the exception's classification); both are real modules, linted like the rest.

Needs root (or CAP_SYS_ADMIN + CAP_SETUID + CAP_SETGID) and kernel namespaces. Without them `run_python` raises
`SandboxUnavailable` naming what is missing; `SandboxLimits(allow_unsandboxed=True)` explicitly allows a weaker
mode (rlimits, timeout, empty environment, private temporary directory; no namespaces, no uid change).
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import psutil

from laminar.envs.tools import ToolResult
from laminar.envs.tools.sandbox_cgroup import SandboxCgroup, cgroup_support
from laminar.envs.tools.sandbox_root import RootPlan, RootPlanError, root_plan
from laminar.logs import get_logger

log = get_logger(__name__)

_SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")
_HERE = os.path.dirname(os.path.abspath(__file__))
BOOT = os.path.join(_HERE, "sandbox_boot.py")  # run by path, as root (envs/tools/sandbox_boot.py)
SHIM = os.path.join(_HERE, "sandbox_shim.py")  # its source goes to the sandboxed interpreter (no project file
# is in the sandbox's root)
WORKDIR = "/tmp/work"  # the working directory inside the sandbox
FAILURES = ("timeout", "cpu", "output", "memory", "processes", "network", "write", "file_size", "open_files",
            "signal")


class SandboxUnavailable(RuntimeError):
    """The machine cannot sandbox (no root, no namespaces, no interpreter the sandbox user can run)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed run may use. Defaults fit a tool call: a short program with small output."""

    wall_s: float = 10.0  # wall clock, startup included; then the whole sandbox is SIGKILLed
    cpu_s: int = 5  # RLIMIT_CPU per process (SIGXCPU at cpu_s, SIGKILL at cpu_s + 1)
    memory_bytes: int = 1 << 30  # the whole sandbox's memory (cgroup), and RLIMIT_AS of each of its processes
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE: the largest file it may write
    tmpfs_bytes: int = 64 << 20  # the working directory's tmpfs (all files together)
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 32  # the whole sandbox's processes and threads (cgroup pids.max; RLIMIT_NPROC of its uid)
    cpus: float = 1.0  # CPU time per wall second for the whole sandbox, in cores (cgroup cpu.max)
    output_bytes: int = 64 << 10  # stdout + stderr; more kills it (failure "output")
    uid_base: int = 61000  # sandbox uids (and gids) are uid_base .. uid_base + uid_count - 1: no user owns them
    uid_count: int = 1000
    python: str = ""  # the interpreter run as the sandbox user; "" = the first of this process's
    # (sys.executable, its real path), /usr/bin/python3 and /usr/local/bin/python3 that can be probed
    read_only: tuple[str, ...] = ()  # host paths (absolute) the program may read, at the same path: a tool's data
    cgroup: bool = True  # per-sandbox limits in a cgroup where the machine has one; False: rlimits only
    allow_unsandboxed: bool = False  # without root/namespaces, run with rlimits only instead of raising

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_bytes", "file_bytes", "tmpfs_bytes", "open_files", "processes",
                     "cpus", "output_bytes", "uid_count"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} = {getattr(self, name)!r}: must be > 0")
        if not 1000 <= self.uid_base or self.uid_base + self.uid_count > 65534:
            raise ValueError(f"SandboxLimits.uid_base = {self.uid_base}, uid_count = {self.uid_count}: the range "
                             "must lie in 1000..65533 (unprivileged, below nobody) and belong to no user")
        for p in self.read_only:
            if not isinstance(p, str) or not os.path.isabs(p) or os.path.normpath(p) == "/":
                raise ValueError(f"SandboxLimits.read_only entry {p!r}: must be an absolute path other than /")
            if os.path.normpath(p).split("/")[1] in ("tmp", "dev", "proc"):
                raise ValueError(f"SandboxLimits.read_only entry {p!r}: the sandbox has its own /tmp, /dev and "
                                 "/proc; put the data elsewhere (/var/tmp, /srv ...)")


@dataclass(frozen=True)
class SandboxResult:
    """One run: `output` (stdout and stderr interleaved, decoded), `exit_code` (None when killed), and
    `failure` (one of FAILURES, None when the program ran to its end) with `detail`; `limits` says how its
    memory, processes and CPU were limited: "cgroup v2", "cgroup v1" (the whole sandbox) or "rlimits" (per
    process: weaker)."""

    output: str
    exit_code: int | None
    failure: str | None = None
    detail: str = ""
    wall_s: float = 0.0
    isolated: bool = True
    limits: str = "rlimits"

    @property
    def ok(self) -> bool:
        return self.failure is None


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a Python program in a fresh sandbox (module docstring); never raises for what the program
    does, raises SandboxUnavailable when the machine cannot sandbox."""
    limits = limits or SandboxLimits()
    isolate = _can_isolate(limits)
    plan = _plan(limits) if isolate else None
    with _UidLease(limits) as lease:
        cgroup = _cgroup(limits, lease.uid)
        try:
            return _run(code, limits, lease, plan, cgroup)
        finally:
            if cgroup is not None:
                cgroup.close()


def _plan(limits: SandboxLimits) -> RootPlan:
    """The new root for the first interpreter that can be probed (envs/tools/sandbox_root.py)."""
    errors = []
    for python in [limits.python] if limits.python else [sys.executable, *_SYSTEM_PYTHONS]:
        try:
            return root_plan(python, limits.read_only)
        except RootPlanError as e:
            if limits.read_only and "read-only path" in str(e):
                raise SandboxUnavailable(str(e)) from e
            errors.append(str(e))
    raise SandboxUnavailable("no interpreter for the Python sandbox: " + "; ".join(errors) + " (set "
                             "SandboxLimits.python to one)")


def _cgroup(limits: SandboxLimits, uid: int) -> SandboxCgroup | None:
    """This run's cgroup with the limits written, or None (rlimits only: cgroup=False, or none on this machine)."""
    support = cgroup_support()
    if not limits.cgroup or support.kind == "none":
        return None
    try:
        return SandboxCgroup(support, str(uid), limits.memory_bytes, limits.processes, limits.cpus)
    except OSError as e:
        raise SandboxUnavailable(f"cannot make the sandbox's cgroup ({support.kind} under "
                                 f"{', '.join(support.parents)}): {e}; SandboxLimits(cgroup=False) runs it with "
                                 "rlimits only") from e


def limits_kind(limits: SandboxLimits | None = None) -> str:
    """How sandboxes with these limits are limited on this machine: "cgroup v2", "cgroup v1" or "rlimits" (with
    why there is no cgroup)."""
    support = cgroup_support()
    if limits is not None and not limits.cgroup:
        return "rlimits (SandboxLimits.cgroup=False)"
    return f"cgroup {support.kind}" if support.kind != "none" else f"rlimits ({support.reason})"


def _can_isolate(limits: SandboxLimits) -> bool:
    missing = []
    if os.geteuid() != 0:
        missing.append(f"root (running as uid {os.geteuid()}): run the rollout worker as root, or in a "
                       "container with CAP_SYS_ADMIN, CAP_SETUID and CAP_SETGID")
    if not os.path.exists("/proc/self/ns/net") or not os.path.exists("/proc/self/ns/pid"):
        missing.append("kernel network/PID namespaces (/proc/self/ns/net, /proc/self/ns/pid): a Linux kernel "
                       "with CONFIG_NET_NS and CONFIG_PID_NS")
    if not missing:
        return True
    if limits.allow_unsandboxed:
        return False
    raise SandboxUnavailable("the Python sandbox needs " + "; and ".join(missing) + ". To run programs with "
                             "rlimits and a timeout only (no isolation), set allow_unsandboxed=True")


class _UidLease:
    """A uid of the range no other sandbox on this host holds now (an flock on a per-uid file)."""

    def __init__(self, limits: SandboxLimits) -> None:
        self.limits, self.fd = limits, -1
        self.dir = os.path.join(tempfile.gettempdir(), f"laminar-sandbox-uids-{os.getuid()}")

    def __enter__(self) -> _UidLease:
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        st = os.lstat(self.dir)
        if st.st_uid != os.getuid() or st.st_mode & 0o077 or not os.path.isdir(self.dir):
            raise SandboxUnavailable(f"{self.dir} (the sandbox uid locks) must be a directory of uid "
                                     f"{os.getuid()} with mode 0700; remove it and run again")
        start = os.getpid() % self.limits.uid_count  # spread processes over the range
        for i in range(self.limits.uid_count):
            uid = self.limits.uid_base + (start + i) % self.limits.uid_count
            fd = os.open(os.path.join(self.dir, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.fd, self.uid = fd, uid
            self.root = os.path.join(self.dir, "root")  # the new root's mount point (in the sandbox's namespace)
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            return self
        raise SandboxUnavailable(f"all {self.limits.uid_count} sandbox uids from {self.limits.uid_base} are in "
                                 "use: raise SandboxLimits.uid_count")

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the flock


def _run(code: str, limits: SandboxLimits, lease: _UidLease, plan: RootPlan | None,
         cgroup: SandboxCgroup | None) -> SandboxResult:
    t0 = time.monotonic()
    isolate = plan is not None
    host_dir = "" if isolate else tempfile.mkdtemp(prefix="laminar-sandbox-")
    report_r, report_w = os.pipe()
    pythons = [plan.interpreter] if plan else [limits.python] if limits.python else [sys.executable, *_SYSTEM_PYTHONS]
    cfg = {"report_fd": report_w, "supervisor": os.getpid(), "isolate": isolate, "uid": lease.uid,
           "work": WORKDIR if isolate else host_dir, "python": pythons, "shim": _shim_source(),
           "tmpfs_bytes": limits.tmpfs_bytes, "root": lease.root, "binds": plan.binds if plan else [],
           "links": plan.links if plan else [], "cgroups": cgroup.procs_files if cgroup else [],
           "rlimits": {"RLIMIT_CPU": [limits.cpu_s, limits.cpu_s + 1],
                       "RLIMIT_AS": [limits.memory_bytes] * 2, "RLIMIT_FSIZE": [limits.file_bytes] * 2,
                       "RLIMIT_NOFILE": [limits.open_files] * 2, "RLIMIT_NPROC": [_nproc(limits, isolate)] * 2,
                       "RLIMIT_CORE": [0, 0]}}
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", BOOT, json.dumps(cfg)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                pass_fds=(report_w,), env={}, cwd="/", start_new_session=True)
    finally:
        os.close(report_w)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(code.encode("utf-8", "surrogateescape"))
            proc.stdin.close()
        except BrokenPipeError:
            pass
        return _supervise(proc, report_r, limits, t0, isolate, cgroup)
    finally:
        os.close(report_r)
        if proc.poll() is None:  # only on an exception in here: never leave the sandbox behind
            _kill(proc, None)
        proc.stdout.close()  # type: ignore[union-attr]
        if host_dir:
            shutil.rmtree(host_dir, ignore_errors=True)


@functools.cache
def _shim_source() -> str:
    """The shim's source (envs/tools/sandbox_shim.py): the bootstrap hands it to the sandboxed interpreter with -c."""
    with open(SHIM, encoding="utf-8") as f:
        return f.read()


def _nproc(limits: SandboxLimits, isolate: bool) -> int:
    """RLIMIT_NPROC counts every process of the uid: a sandbox uid has none but the program's; unsandboxed, the
    program shares this user's uid, so it may start `processes` more than the user runs now."""
    if isolate:
        return limits.processes
    mine = sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == os.getuid())
    return mine + limits.processes


def _supervise(proc: subprocess.Popen, report_r: int, limits: SandboxLimits, t0: float,
               isolate: bool, cgroup: SandboxCgroup | None) -> SandboxResult:
    out_fd = proc.stdout.fileno()  # type: ignore[union-attr]
    sel = selectors.DefaultSelector()
    sel.register(out_fd, selectors.EVENT_READ)
    sel.register(report_r, selectors.EVENT_READ)
    out, report = bytearray(), bytearray()
    deadline = t0 + limits.wall_s
    failure, detail, init_pid, status = None, "", None, None
    open_fds = 2
    while open_fds and failure is None:
        left = deadline - time.monotonic()
        if left <= 0:
            failure, detail = "timeout", f"still running after {limits.wall_s:g} s wall clock"
            break
        for key, _ in sel.select(left):
            data = os.read(key.fd, 1 << 16)
            if not data:
                sel.unregister(key.fd)
                open_fds -= 1
            elif key.fd == out_fd:
                out += data
                if len(out) > limits.output_bytes:
                    failure, detail = "output", f"more than {limits.output_bytes} bytes of output"
            else:
                report += data
        while b"\n" in report:
            line, _, report[:] = report.partition(b"\n")
            kind, _, rest = line.decode("utf-8", "replace").partition("\t")
            if kind == "pid":  # the bootstrap's, first; a later one (the program writing it) is ignored
                init_pid = init_pid or _child_of(proc.pid, rest)
            elif kind == "status":
                status = int(rest)
            elif kind == "setup":
                _kill(proc, init_pid)
                raise SandboxUnavailable(f"the Python sandbox could not start: {rest}")
            elif kind == "violation" and failure is None:
                failure, _, detail = rest.partition("\t")
                if failure not in FAILURES:
                    failure, detail = "signal", f"unknown report {line[:100]!r}"
    sel.close()
    _kill(proc, init_pid) if failure is not None else _wait(proc, init_pid)
    wall = time.monotonic() - t0
    text = bytes(out[:limits.output_bytes]).decode("utf-8", "replace")
    if failure is None and status is not None and os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        failure = "cpu" if sig in (signal.SIGXCPU, signal.SIGKILL) else "signal"
        detail = f"killed by {name}" + (f" (CPU limit {limits.cpu_s} s)" if failure == "cpu" else "")
    if failure is None and status is None:
        failure, detail = "signal", "the sandbox ended without reporting the program's exit status"
    killed = cgroup.oom_killed() if cgroup is not None else 0
    if killed and failure in (None, "cpu", "signal", "processes"):  # the kernel's SIGKILL at the cgroup limit
        failure, detail = "memory", (f"{killed} process(es) killed at the sandbox's memory limit "
                                     f"({limits.memory_bytes} bytes, {cgroup.kind} cgroup)")  # type: ignore[union-attr]
    code = os.WEXITSTATUS(status) if failure is None and status is not None else None
    how = f"cgroup {cgroup.kind}" if cgroup is not None else "rlimits"
    return SandboxResult(text, code, failure, detail[:200], wall, isolate, how)


def _child_of(parent: int, text: str) -> int | None:
    """int(text) if that process is `parent`'s child (the init's pid is signalled as root: never trust it)."""
    try:
        pid = int(text)
        return pid if pid > 1 and psutil.Process(pid).ppid() == parent else None
    except (ValueError, psutil.Error):
        return None


def _wait(proc: subprocess.Popen, init_pid: int | None) -> None:
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        _kill(proc, init_pid)


def _kill(proc: subprocess.Popen, init_pid: int | None) -> None:
    """SIGKILL the sandbox's process group: its init's (the PID namespace dies with it, and the bootstrap then
    reaps it and exits), or the bootstrap's own before the init's pid is known; then reap the bootstrap."""
    if proc.poll() is None:
        try:
            os.killpg(init_pid or proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # the bootstrap is stuck: its death SIGKILLs the init (PDEATHSIG)
        for group in {init_pid, proc.pid} - {None}:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        proc.wait()


class PythonSandbox:
    """The `<python>` tool: runs the text as a program in `run_python`; its output (traceback included) is the
    tool output, a sandbox violation a failed ToolResult (the group fails with reason "sandbox")."""

    name = "python"
    tag = "python"

    def __init__(self, limits: SandboxLimits | None = None, *, probe: bool = True) -> None:
        self.limits = limits or SandboxLimits()
        _can_isolate(self.limits)  # fail at task build, not at the first call
        how = limits_kind(self.limits)
        if how.startswith("cgroup"):
            log.info("sandbox_limits_per_sandbox", limits=how)
        else:  # weaker: memory and CPU per process (a fork tree multiplies them)
            log.warning("sandbox_limits_per_process", limits=how)
        if probe:  # a machine that cannot sandbox (mounts, interpreter) raises SandboxUnavailable here
            r = run_python("print('ok')", self.limits)
            if r.output != "ok\n":
                raise SandboxUnavailable(f"the sandbox's probe program printed {r.output[:200]!r} "
                                         f"({r.failure}: {r.detail}), not 'ok'")

    def run(self, text: str) -> ToolResult:
        r = run_python(text, self.limits)
        if r.failure is not None:
            return ToolResult(r.output, ok=False, detail=f"python {r.failure}: {r.detail}")
        return ToolResult(r.output if r.exit_code == 0 else f"{r.output}[exit code {r.exit_code}]\n")
