"""The sandbox's bootstrap (envs/tools/sandbox.py runs this file by path, as root, in a fresh session:
`python -I -S -B sandbox_boot.py <config json>`; the standard library only, no site-packages).

It joins the sandbox's cgroups, unshares the namespaces, forks the PID namespace's init, which builds the new
root (an empty tmpfs holding read-only binds of the allow-list, envs/tools/sandbox_root.py; /dev with null, zero,
full, random, urandom; the new PID namespace's /proc; /tmp with the working directory) and switches to it
(pivot_root, the old root detached), forks the program's process (rlimits, uid, no new privileges, exec of the
shim, envs/tools/sandbox_shim.py, whose source the config carries) and reaps until it ends.
Protocol on the report pipe: "pid\t<init's host pid>", "setup\t<error>", "status\t<wait status>".
"""

import ctypes
import json
import os
import platform
import resource
import sys


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rfd = cfg["report_fd"]
    isolate = cfg["isolate"]
    work = cfg["work"]

    def say(*parts):
        os.write(rfd, ("\t".join(parts).replace("\n", " ") + "\n").encode("utf-8", "replace"))

    def fail(what, e):
        say("setup", f"{what}: {e}")
        os._exit(70)
    libc = ctypes.CDLL(None, use_errno=True)

    def die_with_parent(parent):  # PR_SET_PDEATHSIG = 1: SIGKILL when the parent goes, whatever killed it
        libc.prctl(1, 9, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(72)
    die_with_parent(cfg["supervisor"])
    code = sys.stdin.buffer.read()

    def check(rc, what):
        if rc != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"{what}: {os.strerror(e)}")

    def mount(src, target, fstype, flags, data):
        check(libc.mount(src and src.encode(), target.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                         data and data.encode()), f"mount {fstype or src or '(remount)'} on {target}")
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
                os.waitpid(pid, 0)
                break
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
        mount("tmpfs", root + "/tmp", "tmpfs", NOSUID | NODEV, f"size={cfg['tmpfs_bytes']},mode=755")
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
            null = os.open("/dev/null", os.O_RDONLY)
            os.dup2(null, 0)
            for name, (soft, hard) in cfg["rlimits"].items():
                resource.setrlimit(getattr(resource, name), (soft, hard))
            if isolate:
                os.setgroups([])
                os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
                os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
                libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
            os.set_inheritable(rfd, True)
            os.closerange(3, rfd)
            os.closerange(rfd + 1, 1 << 16)
            errors = []
            for py in cfg["python"]:
                try:
                    os.execve(py, [py, "-I", "-B", "-u", "-c", cfg["shim"], str(rfd), work], {})
                except OSError as e:
                    errors.append(f"{py}: {e.strerror}")
            raise OSError("cannot run " + ", ".join(errors))
        except BaseException as e:
            say("setup", f"starting Python as uid {cfg['uid']} in the sandbox: {type(e).__name__}: {e} (set "
                "SandboxLimits.python to an interpreter that user can run)")
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


if __name__ == "__main__":
    main()
