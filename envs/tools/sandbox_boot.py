"""The programs envs/tools/sandbox.py starts: `BOOT` (the root bootstrap that builds the sandbox) and `SHIM` (run by
the sandboxed interpreter before the model's program). Python source as text: each runs as its own interpreter."""

# Runs as root in a fresh session: joins the sandbox's cgroups, unshares the namespaces, forks the PID
# namespace's init, which builds the new root (an empty tmpfs holding read-only binds of the allow-list,
# envs/tools/sandbox_root.py; /dev with null, zero, full, random, urandom; the new PID namespace's /proc; /tmp with
# the working directory) and switches to it (pivot_root, the old root detached), forks the program's process
# (rlimits, uid, no new privileges, exec of the shim) and reaps until it ends.
# Protocol on the report pipe: "pid\t<init's host pid>", "setup\t<error>", "status\t<wait status>".
BOOT = r'''
import ctypes, json, os, platform, resource, sys
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
                     data and data.encode()), "mount %s on %s" % (fstype or src or "(remount)", target))
try:
    for procs in cfg["cgroups"]:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
except OSError as e:
    fail("joining the sandbox's cgroup", e)
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
RO, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, MOVE, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 8192, 16384, 1 << 18
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}.get(platform.machine())
def bind_ro(src, dst, is_dir, flags=NOSUID | NODEV):
    if is_dir:
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    mount(src, dst, None, BIND, None)
    try:
        mount(None, dst, None, REMOUNT | BIND | RO | flags, None)
    except OSError:
        mount(None, dst, None, REMOUNT | BIND | RO, None)
def build_root(root):
    mount(None, "/", None, REC | PRIVATE, None)
    mount("tmpfs", root, "tmpfs", NOSUID | NODEV, "size=1m,mode=755")
    for path, is_dir in cfg["binds"]:
        bind_ro(path, root + path, is_dir)
    for path, target in cfg["links"]:
        os.makedirs(os.path.dirname(root + path), exist_ok=True)
        os.symlink(target, root + path)
    dev = root + "/dev"
    os.mkdir(dev)
    mount("tmpfs", dev, "tmpfs", NOSUID | NOEXEC, "size=64k,mode=755")
    for name in ("null", "zero", "full", "random", "urandom"):
        if os.path.exists("/dev/" + name):
            bind_ro("/dev/" + name, dev + "/" + name, False, NOSUID | NOEXEC)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, dev + "/" + name)
    mount(None, dev, None, REMOUNT | RO | NOSUID | NOEXEC, None)
    os.mkdir(root + "/proc")
    try:  # hidepid=2: only its own uid's processes are visible (not the root-owned init)
        mount("proc", root + "/proc", "proc", NOSUID | NODEV | NOEXEC, "hidepid=2")
    except OSError:
        mount("proc", root + "/proc", "proc", NOSUID | NODEV | NOEXEC, None)
    os.mkdir(root + "/tmp")
    mount("tmpfs", root + "/tmp", "tmpfs", NOSUID | NODEV, "size=%d,mode=755" % cfg["tmpfs_bytes"])
    os.chdir(root)
    if PIVOT_ROOT is not None:  # the old root stacked on the new one, then detached: no path leads to it
        check(libc.syscall(PIVOT_ROOT, b".", b"."), "pivot_root")
        check(libc.umount2(b".", 2), "detach the old root")  # MNT_DETACH
    else:
        mount(root, "/", None, MOVE, None)
        os.chroot(".")
    os.chdir("/")
    mount(None, "/", None, REMOUNT | BIND | RO | NOSUID | NODEV, None)
try:
    os.umask(0o022)
    if isolate:
        build_root(cfg["root"])
        os.mkdir(work, 0o700)
        os.chown(work, cfg["uid"], cfg["uid"])
    main = os.path.join(work, "main.py")
    with open(main, "wb") as f:
        f.write(code)
    if isolate:
        os.chown(main, cfg["uid"], cfg["uid"])
except OSError as e:
    fail("the sandbox's root and working directory", e)
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
            libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
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
SHIM = r'''
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
