"""The sandbox's filesystem as an allow-list: what the new, empty root holds (envs/tools/sandbox.py builds it).

`root_plan(python, read_only) -> RootPlan` works out, once per interpreter, what that interpreter needs to run
and import its standard library:
- the interpreter's file (its real path, symlinks resolved);
- its standard library directories (`sysconfig` stdlib and platstdlib; lib-dynload is inside them);
- the directory of every file mapped into it after importing each extension module of lib-dynload (read from
  /proc/self/maps of a probe run of it): the shared libraries it and its extension modules load, libc and the
  dynamic loader included, with their sonames' symlinks beside them;
- the dynamic loader under the names programs ask for it by (`/lib64/ld-linux-x86-64.so.2` ...) and
  `/etc/ld.so.cache`, which maps library names to paths;
- the host's top-level symlinks (`/lib -> usr/lib` on a merged-/usr system), so those paths resolve;
plus each of `read_only`, a task's own read-only paths (a tool's data), at the same path.

Each path is placed as on the host: every symlink along it is recreated as the same symlink in the new root,
and its real target is bound (read-only, by the bootstrap). Binds are not recursive: a mount under a bound
directory is not carried. Intermediate directories are empty root-owned directories of the new root's tmpfs,
so naming `/root/.pyenv/versions/3.11.7/lib/python3.11` exposes that directory and nothing else of `/root`.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import subprocess
from dataclasses import dataclass

_PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_probe.py")  # run by path
_LOADER_NAMES = ("/lib64/ld-linux*.so*", "/lib/ld-linux*.so*", "/lib/ld-musl*.so*", "/lib/ld64.so*")


@dataclass(frozen=True)
class RootPlan:
    """The new root: `interpreter` (the path to exec, real), `binds` (host paths bound read-only at the same path,
    parents first; a bind of a file is a file) and `links` ((path, target) symlinks to recreate)."""

    interpreter: str
    binds: tuple[tuple[str, bool], ...]
    links: tuple[tuple[str, str], ...]


class RootPlanError(RuntimeError):
    """The interpreter cannot be probed (not there, not runnable), or a read-only path does not exist."""


def root_plan(python: str, read_only: tuple[str, ...] = ()) -> RootPlan:
    """What the sandbox's root holds for `python` and `read_only` (module docstring); RootPlanError if not."""
    return _plan(os.path.realpath(python), tuple(read_only))


@functools.lru_cache(maxsize=16)
def _plan(python: str, read_only: tuple[str, ...]) -> RootPlan:
    try:
        out = subprocess.run([python, "-I", "-S", "-B", _PROBE], capture_output=True, text=True, env={},
                             cwd="/", timeout=60, check=True).stdout
        probe = json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        raise RootPlanError(f"cannot probe the interpreter {python} (what it needs in the sandbox): {e}") from e
    wanted = [probe["executable"], *probe["stdlib"], *[d for d in probe["dynload"] if os.path.isdir(d)]]
    wanted += sorted({os.path.dirname(m) for m in probe["maps"] if os.path.exists(m) and m != probe["executable"]})
    wanted += [p for pattern in _LOADER_NAMES for p in sorted(glob.glob(pattern))]
    wanted += [p for p in ("/etc/ld.so.cache",) if os.path.exists(p)]
    for p in read_only:
        if not os.path.isabs(p) or not os.path.lexists(p):
            raise RootPlanError(f"read-only path {p!r} for the sandbox does not exist (it must be an absolute path "
                                "on this host)")
        wanted.append(p)
    binds: set[str] = set()
    links: dict[str, str] = {f"/{n}": os.readlink(f"/{n}") for n in sorted(os.listdir("/"))
                             if os.path.islink(f"/{n}")}
    for p in wanted:
        _place(os.path.normpath(p), binds, links, 0)
    kept = _outermost(binds)
    return RootPlan(probe["executable"], tuple((b, os.path.isdir(b)) for b in kept),
                    tuple((p, t) for p, t in sorted(links.items()) if not _under_any(p, kept)))


def _place(path: str, binds: set[str], links: dict[str, str], depth: int) -> None:
    """Make `path` resolve in the new root as on the host: each symlink along it recorded, its real target bound."""
    if depth > 40:
        raise RootPlanError(f"too many levels of symlinks placing {path} in the sandbox")
    parts = [p for p in path.split("/") if p]
    cur = "/"
    for i, part in enumerate(parts):
        nxt = os.path.join(cur, part)
        if os.path.islink(nxt):
            target = os.readlink(nxt)
            links[nxt] = target
            _place(os.path.normpath(os.path.join(cur, target, *parts[i + 1:])), binds, links, depth + 1)
            return
        cur = nxt
    if cur != "/" and os.path.exists(cur):
        binds.add(cur)


def _outermost(binds: set[str]) -> list[str]:
    """The binds that are not inside another bind of the same mount (that one carries them), parents first."""
    kept: list[str] = []
    for b in sorted(binds):
        outer = next((k for k in kept if b.startswith(k.rstrip("/") + "/")), None)
        if outer is None or os.stat(b).st_dev != os.stat(outer).st_dev:
            kept.append(b)
    return kept


def _under_any(path: str, dirs: list[str]) -> bool:
    return any(path.startswith(d.rstrip("/") + "/") for d in dirs)
