"""Per-sandbox limits with cgroups: one cgroup per sandbox run, so memory, processes and CPU are capped for the
whole sandbox (every process of it together), not per process as rlimits are.

`cgroup_support() -> CgroupSupport` finds, once per process, what this machine offers:
- cgroup v2 ("v2"): a cgroup2 mount whose root offers the memory, pids and cpu controllers. The sandboxes' cgroups
  are `laminar-sandbox/<name>` at that mount's root (the root is the one cgroup that may hold processes and
  still give controllers to its children); limits `memory.max` (and `memory.swap.max` 0), `pids.max`, `cpu.max`;
  a memory kill is `oom_kill` in `memory.events`.
- cgroup v1 ("v1"): the legacy memory, pids and cpu hierarchies (a machine whose v2 mount has none of these
  controllers, as a hybrid-mode host). The sandbox's cgroup is `laminar-sandbox-<name>` under this process's own
  cgroup of each (so it also counts toward any limit this process has); limits `memory.limit_in_bytes` (and
  `memory.memsw.limit_in_bytes` where swap is accounted), `pids.max`, `cpu.cfs_quota_us` / `cpu.cfs_period_us`;
  a memory kill is `oom_kill` in `memory.oom_control`.
- none ("none", with the reason): not root, no writable hierarchy with the three controllers. The sandbox then
  relies on its rlimits alone, which are per process (32 processes of 1 GiB each fit a "1 GiB" sandbox) and on
  RLIMIT_NPROC per uid; `SandboxResult.limits` says "rlimits" and `PythonSandbox` logs it as a warning.

The bootstrap (running as root, before it unshares or forks) writes its pid into each `cgroup.procs`; every
process of the sandbox descends from it, so all are inside. `SandboxCgroup.close()` kills what is left and
removes the cgroup.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from dataclasses import dataclass

CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000


@dataclass(frozen=True)
class CgroupSupport:
    """What per-sandbox limits this machine has: `kind` "v2" | "v1" | "none"; `parents` the directory each
    sandbox's cgroup is made in (one for v2, one per controller for v1); `reason` why not, for "none"."""

    kind: str
    parents: tuple[str, ...] = ()
    reason: str = ""


@functools.lru_cache(maxsize=1)
def cgroup_support() -> CgroupSupport:
    """This machine's per-sandbox limits (module docstring), found once per process."""
    if os.geteuid() != 0:
        return CgroupSupport("none", reason="not root: cannot make cgroups")
    mounts = _cgroup_mounts()
    why = []
    for point in mounts.get("cgroup2", []):
        have = _read(os.path.join(point, "cgroup.controllers")).split()
        if not set(CONTROLLERS) <= set(have):
            why.append(f"the cgroup v2 mount {point} offers {' '.join(have) or 'no controllers'}, not "
                       f"{', '.join(CONTROLLERS)} (they are bound to v1 hierarchies or disabled)")
            continue
        parent = os.path.join(point, "laminar-sandbox")
        try:
            _enable(point)
            os.makedirs(parent, exist_ok=True)
            _enable(parent)
            return CgroupSupport("v2", (parent,))
        except OSError as e:
            why.append(f"cannot delegate {', '.join(CONTROLLERS)} under {point}: {e}")
    v1 = []
    own = _own_v1_paths()
    for c in CONTROLLERS:
        point = mounts.get(c, [None])[0]
        if point is None:
            why.append(f"no cgroup v1 hierarchy with the {c} controller")
            break
        parent = os.path.join(point, own.get(c, "/").lstrip("/"))
        if not os.access(parent, os.W_OK):
            why.append(f"the cgroup v1 directory {parent} is not writable")
            break
        v1.append(parent)
    else:
        return CgroupSupport("v1", tuple(v1))
    return CgroupSupport("none", reason="; ".join(why) or "no cgroup mounts")


class SandboxCgroup:
    """One sandbox run's cgroup (v2) or cgroups (v1, one per controller), made with the limits written."""

    def __init__(self, support: CgroupSupport, name: str, memory_bytes: int, processes: int, cpus: float) -> None:
        self.kind = support.kind
        self.dirs = [os.path.join(p, name if self.kind == "v2" else f"laminar-sandbox-{name}") for p in support.parents]
        for d in self.dirs:
            if os.path.isdir(d):  # left by a supervisor killed mid-run: empty it first
                _kill_all(d)
                _rmdir(d)
            os.mkdir(d)
        quota = max(1000, int(cpus * CPU_PERIOD_US))
        if self.kind == "v2":
            d = self.dirs[0]
            _write(d, "memory.max", memory_bytes)
            _write(d, "memory.swap.max", 0, optional=True)
            _write(d, "pids.max", processes)
            _write(d, "cpu.max", f"{quota} {CPU_PERIOD_US}")
        else:
            mem, pids, cpu = self.dirs
            _write(mem, "memory.limit_in_bytes", memory_bytes)
            _write(mem, "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
            _write(pids, "pids.max", processes)
            _write(cpu, "cpu.cfs_period_us", CPU_PERIOD_US)
            _write(cpu, "cpu.cfs_quota_us", quota)

    @property
    def procs_files(self) -> list[str]:
        """The files the bootstrap writes its pid into to join."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def oom_killed(self) -> int:
        """How many processes of the sandbox the kernel killed at its memory limit."""
        text = _read(os.path.join(self.dirs[0], "memory.events" if self.kind == "v2" else "memory.oom_control"))
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def close(self) -> None:
        """SIGKILL anything still inside (nothing, once the namespace's init is gone) and remove the cgroups."""
        for d in self.dirs:
            _kill_all(d)
            _rmdir(d)


def _cgroup_mounts() -> dict[str, list[str]]:
    """Mount points: "cgroup2" -> [points]; a v1 controller name -> [points] of hierarchies carrying it."""
    out: dict[str, list[str]] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _, options = (right.split() + ["", "", ""])[:3]
            point = left.split()[4].encode().decode("unicode_escape")
            if fstype == "cgroup2":
                out.setdefault("cgroup2", []).append(point)
            elif fstype == "cgroup":
                for opt in options.split(","):
                    if opt in CONTROLLERS:
                        out.setdefault(opt, []).append(point)
    return out


def _own_v1_paths() -> dict[str, str]:
    """This process's cgroup path in each v1 hierarchy ("4:memory:/a/b" -> {"memory": "/a/b"})."""
    out = {}
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(","):
            out[c] = path
    return out


def _enable(d: str) -> None:
    have = _read(os.path.join(d, "cgroup.subtree_control")).split()
    missing = [c for c in CONTROLLERS if c not in have]
    if missing:
        _write(d, "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _write(d: str, name: str, value: object, optional: bool = False) -> None:
    try:
        with open(os.path.join(d, name), "w") as f:
            f.write(str(value))
    except FileNotFoundError:
        if not optional:
            raise


def _kill_all(d: str) -> None:
    for _ in range(3):
        pids = [int(p) for p in _read(os.path.join(d, "cgroup.procs")).split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _rmdir(d: str) -> None:
    """Remove a cgroup; its last processes may take a moment to be released after they are reaped."""
    for i in range(100):
        try:
            os.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.005 * min(i + 1, 10))
    os.rmdir(d)
