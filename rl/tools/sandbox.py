"""`PythonSandbox` (`<python>`): the model's Python program run in a separate, isolated process.

`run_python(code, limits) -> SandboxResult` is the whole sandbox; `PythonSandbox` is the thin tool around it.

Isolation (all real kernel mechanisms; nothing here trusts the program):
- a new network namespace (only a loopback device, left down: no connection anywhere, 127.0.0.1 included),
  a new PID namespace (the program cannot see or signal other processes; when its init dies, the kernel kills
  everything left in it, so nothing escapes by `setsid` or double fork), and new mount and IPC namespaces;
- in the mount namespace every mount is read-only, /tmp is a fresh root-owned tmpfs (size-capped) holding the
  working directory /tmp/work (the only writable place), /dev/shm and /run are empty read-only tmpfs, and
  /proc is the new PID namespace's;
- an unprivileged uid and gid (no supplementary groups), one per concurrent sandbox from
  `SandboxLimits.uid_base` .. `uid_base + uid_count - 1` (held by a lock file, so RLIMIT_NPROC, which counts
  per uid, stops one sandbox's fork bomb without starving another); no system user is created;
- rlimits: CPU seconds, address space, file size, open files, processes, no core files;
- an empty environment; stdin is /dev/null; a wall-clock timeout that SIGKILLs the sandbox's process group
  (its PID namespace's init, so the whole namespace goes);
- stdout and stderr (one stream, in order) read with a byte cap: the process is killed on exceeding it.

Which outcomes fail the tool (a `SandboxResult` with `failure` set, `ToolResult(ok=False)`: the replica fails
the group with reason "sandbox", retried then dropped) and which are output the model reads (docs/decisions.md):
- failure: the wall-clock timeout (`timeout`), the CPU limit (`cpu`: SIGXCPU / SIGKILL), the output cap
  (`output`), an uncaught MemoryError (`memory`), a fork or spawn refused by the process limit (`processes`),
  any socket connect/bind/send (`network`), a write, create, rename or delete outside the working directory
  (`write`), a file past the size limit or the tmpfs full (`file_size`), too many open files (`open_files`),
  death by any other signal (`signal`);
- output: everything else, a Python exception included (its traceback is the output), with `exit_code`.
The violations the kernel stops anyway (network, writes) are also reported by an audit hook inside the sandbox
(`sys.addaudithook`, which Python code cannot remove) so they fail the group instead of being an error message;
a program that bypasses the hook through ctypes is still stopped by the kernel, it just sees the error.

Needs root (or CAP_SYS_ADMIN + CAP_SETUID + CAP_SETGID) and kernel namespaces. Without them `run_python` raises
`SandboxUnavailable` naming what is missing; `SandboxLimits(allow_unsandboxed=True)` explicitly allows a weaker
mode (rlimits, timeout, empty environment, private temporary directory; no namespaces, no uid change).
"""

from __future__ import annotations

import fcntl
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

from rl.tools import ToolResult

_SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")
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
    memory_bytes: int = 1 << 30  # RLIMIT_AS per process
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE: the largest file it may write
    tmpfs_bytes: int = 64 << 20  # the working directory's tmpfs (all files together)
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 32  # RLIMIT_NPROC for its uid (threads count too)
    output_bytes: int = 64 << 10  # stdout + stderr; more kills it (failure "output")
    uid_base: int = 61000  # sandbox uids (and gids) are uid_base .. uid_base + uid_count - 1: no user owns them
    uid_count: int = 1000
    python: str = ""  # the interpreter run as the sandbox user; "" = the first of this process's
    # (sys.executable), /usr/bin/python3 and /usr/local/bin/python3 that the sandbox user can run
    allow_unsandboxed: bool = False  # without root/namespaces, run with rlimits only instead of raising

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_bytes", "file_bytes", "tmpfs_bytes", "open_files", "processes",
                     "output_bytes", "uid_count"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} = {getattr(self, name)!r}: must be > 0")
        if not 1000 <= self.uid_base or self.uid_base + self.uid_count > 65534:
            raise ValueError(f"SandboxLimits.uid_base = {self.uid_base}, uid_count = {self.uid_count}: the range "
                             "must lie in 1000..65533 (unprivileged, below nobody) and belong to no user")


@dataclass(frozen=True)
class SandboxResult:
    """One run: `output` (stdout and stderr interleaved, decoded), `exit_code` (None when killed), and
    `failure` (one of FAILURES, None when the program ran to its end) with `detail`."""

    output: str
    exit_code: int | None
    failure: str | None = None
    detail: str = ""
    wall_s: float = 0.0
    isolated: bool = True

    @property
    def ok(self) -> bool:
        return self.failure is None


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a Python program in a fresh sandbox (module docstring); never raises for what the program
    does, raises SandboxUnavailable when the machine cannot sandbox."""
    limits = limits or SandboxLimits()
    isolate = _can_isolate(limits)
    with _UidLease(limits) as uid:
        return _run(code, limits, uid, isolate)


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

    def __enter__(self) -> int:
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
            self.fd = fd
            return uid
        raise SandboxUnavailable(f"all {self.limits.uid_count} sandbox uids from {self.limits.uid_base} are in "
                                 "use: raise SandboxLimits.uid_count")

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the flock


def _run(code: str, limits: SandboxLimits, uid: int, isolate: bool) -> SandboxResult:
    t0 = time.monotonic()
    host_dir = "" if isolate else tempfile.mkdtemp(prefix="laminar-sandbox-")
    report_r, report_w = os.pipe()
    cfg = {"report_fd": report_w, "supervisor": os.getpid(), "isolate": isolate, "uid": uid, "work": WORKDIR if isolate else host_dir,
           "python": [limits.python] if limits.python else [sys.executable, *_SYSTEM_PYTHONS], "shim": _SHIM, "tmpfs_bytes": limits.tmpfs_bytes,
           "rlimits": {"RLIMIT_CPU": [limits.cpu_s, limits.cpu_s + 1],
                       "RLIMIT_AS": [limits.memory_bytes] * 2, "RLIMIT_FSIZE": [limits.file_bytes] * 2,
                       "RLIMIT_NOFILE": [limits.open_files] * 2, "RLIMIT_NPROC": [_nproc(limits, isolate)] * 2,
                       "RLIMIT_CORE": [0, 0]}}
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-c", _BOOT, json.dumps(cfg)],
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
        return _supervise(proc, report_r, limits, t0, isolate)
    finally:
        os.close(report_r)
        if proc.poll() is None:  # only on an exception in here: never leave the sandbox behind
            _kill(proc, None)
        proc.stdout.close()  # type: ignore[union-attr]
        if host_dir:
            shutil.rmtree(host_dir, ignore_errors=True)


def _nproc(limits: SandboxLimits, isolate: bool) -> int:
    """RLIMIT_NPROC counts every process of the uid: a sandbox uid has none but the program's; unsandboxed, the
    program shares this user's uid, so it may start `processes` more than the user runs now."""
    if isolate:
        return limits.processes
    mine = sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == os.getuid())
    return mine + limits.processes


def _supervise(proc: subprocess.Popen, report_r: int, limits: SandboxLimits, t0: float,
               isolate: bool) -> SandboxResult:
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
    code = os.WEXITSTATUS(status) if failure is None and status is not None else None
    return SandboxResult(text, code, failure, detail[:200], wall, isolate)


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


# Runs as root in a fresh session: unshares the namespaces, forks the PID namespace's init, which mounts the
# read-only view and the tmpfs, forks the program's process (rlimits, uid, exec of the shim) and reaps until it
# ends. Protocol on the report pipe: "pid\t<init's host pid>", "setup\t<error>", "status\t<wait status>".
_BOOT = r'''
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1]); rfd = cfg["report_fd"]; isolate = cfg["isolate"]; work = cfg["work"]
def say(*parts):
    os.write(rfd, ("\t".join(parts).replace("\n", " ") + "\n").encode("utf-8", "replace"))
def fail(what, e):
    say("setup", "%s: %s" % (what, e)); os._exit(70)
libc = ctypes.CDLL(None, use_errno=True)
def die_with_parent(parent):  # PR_SET_PDEATHSIG = 1: SIGKILL when the parent goes, whatever killed it
    libc.prctl(1, 9, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(72)
die_with_parent(cfg["supervisor"])
code = sys.stdin.buffer.read()
def check(rc, what):
    if rc != 0:
        e = ctypes.get_errno(); raise OSError(e, "%s: %s" % (what, os.strerror(e)))
def mount(src, target, fstype, flags, data):
    check(libc.mount(src and src.encode(), target.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                     data and data.encode()), "mount %s on %s" % (fstype or "(remount)", target))
if isolate:
    try:  # CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC
        check(libc.unshare(0x00020000 | 0x40000000 | 0x20000000 | 0x08000000), "unshare")
    except OSError as e:
        fail("new namespaces (needs root and a kernel with namespaces)", e)
boot = os.getpid()
pid = os.fork()
if pid:
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    say("pid", str(pid))
    while True:
        try:
            os.waitpid(pid, 0); break
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    os._exit(0)
try:
    os.setpgid(0, 0)
except OSError:
    pass
die_with_parent(0 if isolate else boot)  # in its PID namespace the bootstrap is parent 0
RO, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
try:
    if isolate:
        mount(None, "/", None, REC | PRIVATE, None)
        points = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                points.append((fields[4].encode().decode("unicode_escape"), fields[5]))
        for point, opts in points:
            if point.startswith(("/proc", "/dev")) and point != "/dev/shm" or "ro" in opts.split(","):
                continue
            if os.path.isdir(point):
                try:
                    mount(None, point, None, REMOUNT | BIND | RO | NOSUID | NODEV, None)
                except OSError:
                    mount(None, point, None, REMOUNT | BIND | RO, None)
        mount("tmpfs", "/tmp", "tmpfs", NOSUID | NODEV, "size=%d,mode=755" % cfg["tmpfs_bytes"])
        for hide in ("/dev/shm", "/run"):
            if os.path.isdir(hide):
                mount("tmpfs", hide, "tmpfs", RO | NOSUID | NODEV | NOEXEC, "size=4k,mode=755")
        mount("proc", "/proc", "proc", NOSUID | NODEV | NOEXEC, None)
        os.mkdir(work, 0o700)
        os.chown(work, cfg["uid"], cfg["uid"])
    main = os.path.join(work, "main.py")
    with open(main, "wb") as f:
        f.write(code)
    if isolate:
        os.chown(main, cfg["uid"], cfg["uid"])
except OSError as e:
    fail("the sandbox's mounts and working directory", e)
child = os.fork()
if child == 0:
    try:
        os.chdir(work)
        null = os.open("/dev/null", os.O_RDONLY); os.dup2(null, 0)
        for name, (soft, hard) in cfg["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if isolate:
            os.setgroups([]); os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        os.set_inheritable(rfd, True)
        os.closerange(3, rfd); os.closerange(rfd + 1, 1 << 16)
        errors = []
        for py in cfg["python"]:
            try:
                os.execve(py, [py, "-I", "-B", "-u", "-c", cfg["shim"], str(rfd), work], {})
            except OSError as e:
                errors.append("%s: %s" % (py, e.strerror))
        raise OSError("cannot run " + ", ".join(errors))
    except BaseException as e:
        say("setup", "starting Python as uid %d in the sandbox: %s: %s (set SandboxLimits.python to an "
            "interpreter that user can run)" % (cfg["uid"], type(e).__name__, e))
        os._exit(71)
while True:
    try:
        p, st = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    except InterruptedError:
        continue
    if p == child:
        say("status", str(st))
        break
if not isolate:
    os.killpg(0, 9)  # whatever the program left in its group (in a PID namespace, the kernel does this)
os._exit(0)
'''

# Runs as the sandbox user, before the program: an audit hook that reports (and refuses) network use and writes
# outside the working directory, and the program's uncaught exception classified (memory, processes, file
# size, open files) or printed as the traceback the model reads. Protocol: "violation\t<kind>\t<detail>".
_SHIM = r'''
import errno, os, sys
sys.dont_write_bytecode = True
_fd, _work = int(sys.argv[1]), sys.argv[2]
_state = {"busy": False, "spawned": False}
_ALLOW = ("/dev/null", "/dev/stdout", "/dev/stderr", "/dev/tty", "/dev/zero")
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATHS = {"os.mkdir": (0,), "os.rmdir": (0,), "os.remove": (0,), "os.rename": (0, 1), "os.link": (1,),
          "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
          "os.mkfifo": (0,), "os.mknod": (0,), "os.chflags": (0,), "os.setxattr": (0,), "os.removexattr": (0,)}
_NET = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg")
_SPAWN = ("os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "os.exec")
def _report(kind, detail):
    try:
        os.write(_fd, ("violation\t%s\t%s\n" % (kind, str(detail).replace("\n", " ")[:300])).encode("utf-8", "replace"))
    except OSError:
        pass
def _inside(p):
    if isinstance(p, int):
        return True
    try:
        a = os.path.abspath(os.fsdecode(p))
        if a in _ALLOW or a.startswith(("/proc/self/fd/", "/dev/fd/")):
            return True
        r = os.path.realpath(a)
        return r == _work or r.startswith(_work + "/")
    except Exception:
        return False
def _hook(event, args):
    if _state["busy"]:
        return
    _state["busy"] = True
    try:
        bad = None
        if event == "open":
            path, mode, flags = args
            w = isinstance(flags, int) and flags & _WRITE or mode is not None and any(c in str(mode) for c in "wax+")
            if w and not _inside(path):
                bad = ("write", "open %r for writing, outside %s" % (path, _work))
        elif event in _PATHS:
            for i in _PATHS[event]:
                if i < len(args) and args[i] is not None and not _inside(args[i]):
                    bad = ("write", "%s %r, outside %s" % (event, args[i], _work)); break
        elif event in _NET:
            bad = ("network", "%s %r" % (event, args[1] if len(args) > 1 else ""))
        elif event in _SPAWN:
            _state["spawned"] = True
    finally:
        _state["busy"] = False
    if bad:
        _report(*bad)
        raise PermissionError(errno.EPERM, "sandbox: " + bad[1])
sys.addaudithook(_hook)
import tempfile
tempfile.tempdir = _work
_main = os.path.join(_work, "main.py")
sys.argv[:] = [_main]; sys.path.insert(0, _work)
_g = {"__name__": "__main__", "__file__": _main, "__builtins__": __builtins__}
try:
    with open(_main, "rb") as _f:
        _code = compile(_f.read(), _main, "exec")
    del _f
    exec(_code, _g)
except SystemExit:
    raise
except BaseException as _e:
    _no = getattr(_e, "errno", None)
    if isinstance(_e, MemoryError):
        _report("memory", "MemoryError (address space limit)")
    elif isinstance(_e, BlockingIOError) and _no == errno.EAGAIN and _state["spawned"]:
        _report("processes", "%s: %s (process limit)" % (type(_e).__name__, _e))
    elif _no in (errno.EFBIG, errno.ENOSPC, errno.EDQUOT):
        _report("file_size", "%s: %s" % (type(_e).__name__, _e))
    elif _no in (errno.EMFILE, errno.ENFILE):
        _report("open_files", "%s: %s" % (type(_e).__name__, _e))
    import traceback
    traceback.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    sys.exit(1)
'''
