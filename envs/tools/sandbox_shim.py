"""The shim the sandboxed interpreter runs before the model's program (envs/tools/sandbox_boot.py execs it as the
sandbox user: `python -I -B -u -c <this file's source> <report fd> <working directory>`; envs/tools/sandbox.py reads
the source, as the sandbox's root holds no file of the project). The standard library only.

It installs an audit hook that reports (and refuses) network use and writes outside the working directory, runs
the program (<working directory>/main.py) as __main__, and classifies the program's uncaught exception (memory,
processes, file size, open files) or prints it as the traceback the model reads.
Protocol on the report pipe: "violation\t<kind>\t<detail>".
"""

import errno
import os
import sys

_fd, _work = -1, ""  # the report pipe and the working directory (main sets them from argv)
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
        text = str(detail).replace("\n", " ")[:300]
        os.write(_fd, f"violation\t{kind}\t{text}\n".encode("utf-8", "replace"))
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
                bad = ("write", f"open {path!r} for writing, outside {_work}")
        elif event in _PATHS:
            for i in _PATHS[event]:
                if i < len(args) and args[i] is not None and not _inside(args[i]):
                    bad = ("write", f"{event} {args[i]!r}, outside {_work}")
                    break
        elif event in _NET:
            bad = ("network", f"{event} {args[1] if len(args) > 1 else ''!r}")
        elif event in _SPAWN:
            _state["spawned"] = True
    finally:
        _state["busy"] = False
    if bad:
        _report(*bad)
        raise PermissionError(errno.EPERM, "sandbox: " + bad[1])


def main() -> None:
    global _fd, _work
    sys.dont_write_bytecode = True
    _fd, _work = int(sys.argv[1]), sys.argv[2]
    sys.addaudithook(_hook)
    import tempfile
    tempfile.tempdir = _work
    _main = os.path.join(_work, "main.py")
    sys.argv[:] = [_main]
    sys.path.insert(0, _work)
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
            _report("processes", f"{type(_e).__name__}: {_e} (process limit)")
        elif _no in (errno.EFBIG, errno.ENOSPC, errno.EDQUOT):
            _report("file_size", f"{type(_e).__name__}: {_e}")
        elif _no in (errno.EMFILE, errno.ENFILE):
            _report("open_files", f"{type(_e).__name__}: {_e}")
        import traceback
        traceback.print_exception(type(_e), _e, _e.__traceback__.tb_next)
        sys.exit(1)


if __name__ == "__main__":
    main()
