"""Ray launcher: the processes the local launcher plans (control, trainer, per host one relay and one rollout
worker), each started and watched by a Ray actor on a Ray cluster.

Placement (`plan_placements`, pure): the trainer asks for its GPUs (trainer.device = "cuda": 1, or
trainer.fsdp_procs with the fsdp backend; 0 on CPU); each host's relay and rollout worker form one placement
group of two bundles, STRICT_PACK, so they land on one Ray node and share its /dev/shm (the rollout pulls weights
from its relay's shared memory); the rollout worker asks for one GPU per replica it runs (rollout.device = "cuda").

Each actor starts `laminar worker ...` as a child process (the same argv and LAMINAR_* settings as locally) and
exits when the child dies, so Ray restarts the actor (`max_restarts`), which starts the child again: that is the
local launcher's supervisor on a cluster. Recovery does not wait for that restart: Temporal retries the work on
any free worker. A drill's fault kills the child (its own fault queue, `--allow-faults`), as it does locally.

Ray is imported here only, lazily: nothing on the default (local) path imports it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laminar.config import RunConfig
from laminar.errors import ConfigError, LaminarError
from laminar.logs import get_logger
from workers.launcher import ManagedProcess, process_cpu_s

log = get_logger(__name__)

NAMESPACE = "laminar"  # Ray namespace of the actors; an actor is named `<tag>/<process>` (tag: the run id)
ROLE_CPUS = {"control": 1.0, "trainer": 1.0, "relay": 1.0, "rollout": 1.0}  # logical CPUs Ray reserves per role
MAX_RESTARTS = -1  # Ray restarts a dead worker actor without limit, as the local supervisor does
RESTART_DELAY_S = 1.0  # a restarted actor waits this long before starting its child (no tight crash loop)
LOCAL_OBJECT_STORE_BYTES = 100 * 1024**2  # a local Ray's object store: the workers pass no objects through Ray
PLACEMENT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Placement:
    """One worker process as a Ray actor: what it runs and what Ray reserves for it."""

    name: str  # the process name (control, trainer, relay-host-0, rollout-host-0, ...)
    role: str  # control | trainer | relay | rollout
    host_id: str | None  # the simulated host (relay and rollout), None for control and trainer
    args: list[str]  # argv after `laminar worker`
    env: dict[str, str]  # the LAMINAR_* settings of the child
    log_path: str
    num_cpus: float
    num_gpus: float
    bind_node_ip: bool = False  # relay: listen on the Ray node's IP (relays of other nodes must reach it)


@dataclass
class HostGroup:
    """A host's relay and rollout worker: one STRICT_PACK placement group, bundle 0 the relay, 1 the rollout."""

    host_id: str
    members: list[Placement] = field(default_factory=list)

    def bundles(self) -> list[dict[str, float]]:
        return [{k: v for k, v in (("CPU", p.num_cpus), ("GPU", p.num_gpus)) if v > 0} for p in self.members]


def plan_placements(cfg: RunConfig, procs: list[ManagedProcess], bind_node_ip: bool = False) -> list[Placement]:
    """The Ray placement of `plan_processes`'s processes (same names, argv and LAMINAR_* settings).

    GPUs: the trainer 1 on CUDA (trainer.fsdp_procs with the fsdp backend), 0 on CPU; a rollout worker one per
    replica of its host's share (spare slots take over a dead worker's replica and get none of their own)."""
    hosts = cfg.relay.relays
    out = []
    for p in procs:
        args = p.argv[p.argv.index("worker") + 1:]
        role = p.name.split("-", 1)[0]
        if role not in ROLE_CPUS:
            raise LaminarError(f"process {p.name!r}: no Ray placement for role {role!r}")
        host = p.env.get("LAMINAR_HOST_ID") if role in ("relay", "rollout") else None
        gpus = 0.0
        if role == "trainer" and cfg.trainer.device == "cuda":
            gpus = float(cfg.trainer.fsdp_procs if cfg.trainer.backend == "fsdp" else 1)
        if role == "rollout" and cfg.rollout.device == "cuda":
            i = int(p.name.rsplit("-", 1)[1])
            gpus = float(cfg.rollout.replicas // hosts + (1 if i < cfg.rollout.replicas % hosts else 0))
        env = {k: v for k, v in p.env.items() if k.startswith("LAMINAR_")}
        out.append(Placement(p.name, role, host, args, env, str(p.log_path), ROLE_CPUS[role], gpus,
                             bind_node_ip=bind_node_ip and role == "relay"))
    return out


def host_groups(placements: list[Placement]) -> list[HostGroup]:
    """Per host, its relay then its rollout worker (the order of the placement group's bundles)."""
    groups: dict[str, HostGroup] = {}
    for p in placements:
        if p.host_id is not None:
            groups.setdefault(p.host_id, HostGroup(p.host_id)).members.append(p)
    for g in groups.values():
        g.members.sort(key=lambda p: p.role != "relay")
    return list(groups.values())


def _plain(resources: dict[str, float]) -> dict[str, float]:
    """CPUs, GPUs and custom resources of a Ray resource map, without Ray's per-node and placement-group entries."""
    return {k: v for k, v in resources.items()
            if k not in ("memory", "object_store_memory") and "_group_" not in k and not k.startswith("node:")}


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("--launcher ray needs Ray: install the `ray` extra (pip install -e '.[ray]')") from None
    return ray


class _WorkerActor:
    """Starts `laminar worker <args>` and exits when it dies, so that Ray restarts this actor (and the worker)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_path: str, bind_node_ip: bool) -> None:
        import ray

        from workers.launcher import _die_with_parent

        ctx = ray.get_runtime_context()
        self.name = name
        self.node_id = ctx.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.restarted = ctx.was_current_actor_reconstructed
        if self.restarted:
            time.sleep(RESTART_DELAY_S)
        child_env = {**os.environ, **env}  # os.environ: Ray's CUDA_VISIBLE_DEVICES for this actor's GPUs
        if bind_node_ip:
            child_env["LAMINAR_RELAY_BIND"] = self.node_ip
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        self.stopping = False
        self.proc: subprocess.Popen | None = None
        started = threading.Event()
        failed: list[BaseException] = []

        def watch() -> None:
            # Started from this thread, which lives as long as the child: PDEATHSIG fires when the thread that
            # forked dies, so the child dies with this actor's process, never before.
            try:
                with open(log_path, "ab") as out:
                    self.proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "worker", *args],
                                                 env=child_env, stdout=out, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL, start_new_session=True,
                                                 preexec_fn=_die_with_parent)
            except BaseException as e:  # the actor's constructor must fail, not wait for a child that never came
                failed.append(e)
                return
            finally:
                started.set()
            code = self.proc.wait()
            if not self.stopping:
                with open(log_path, "a") as f:
                    f.write(f"[ray launcher] {name} pid {self.proc.pid} exited with {code}; Ray restarts it\n")
                os._exit(1)  # a crash to Ray: it restarts the actor (max_restarts)

        threading.Thread(target=watch, name=f"watch-{name}", daemon=True).start()
        started.wait()
        if failed:
            raise LaminarError(f"{name}: cannot start `laminar worker {' '.join(args)}` ({failed[0]}); "
                               f"see {log_path}") from failed[0]

    def info(self) -> dict:
        assert self.proc is not None
        return {"name": self.name, "pid": self.proc.pid, "node_id": self.node_id, "node_ip": self.node_ip,
                "restarted": self.restarted, "cpu_s": process_cpu_s(self.proc.pid)}

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM the child, SIGKILL it after timeout_s; its exit code."""
        assert self.proc is not None
        self.stopping = True
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                return self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                continue
        return None


class RayLauncher:
    """The LocalLauncher interface (start_all, start_supervision, cpu_seconds, pids, stop_all) on Ray.

    address: a running cluster (`ray.init(address=...)`); None starts a local Ray sized to the placements."""

    def __init__(self, processes: list[ManagedProcess], placements: list[Placement], tag: str,
                 address: str | None = None) -> None:
        self.processes = {p.name: p for p in processes}
        self.placements = placements
        self.tag = tag
        self.address = address
        self.actors: dict[str, Any] = {}
        self._groups: list[Any] = []
        self._ray: Any = None
        self._owns_ray = False

    def actor_name(self, process: str) -> str:
        return f"{self.tag}/{process}"

    def start_all(self) -> None:
        ray = self._ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._owns_ray = not ray.is_initialized()  # a caller's own connection stays open at stop_all
        if self._owns_ray:
            # ray.init installs its own SIGTERM handler in the driver; the caller's (stop everything) stays.
            handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
            if self.address:
                try:
                    ray.init(address=self.address, namespace=NAMESPACE, log_to_driver=False)
                except (ValueError, ConnectionError) as e:
                    raise LaminarError(
                        f"--ray-address={self.address!r}: cannot connect ({e}); use the head's host:port (what `ray "
                        f"start --head` prints, port 6379 by default), `auto` on a cluster node, or leave it out "
                        f"for a local Ray") from None
            else:
                cpus = sum(p.num_cpus for p in self.placements)
                os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a local Ray sends no usage report
                ray.init(address="local", num_cpus=max(cpus, os.cpu_count() or 1),  # never a running Ray
                         object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                         include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
            if threading.current_thread() is threading.main_thread():
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)
        if not self.address:  # a local Ray has what this machine has: no node will join, fail at once
            need = {p.name: p.num_gpus for p in self.placements if p.num_gpus}
            have = ray.cluster_resources().get("GPU", 0.0)
            if sum(need.values()) > have:
                raise LaminarError(f"the workers ask for GPUs {need} (trainer.device, rollout.device = 'cuda'); this "
                                   f"machine's Ray has {have:g}: use a smaller config, or --ray-address of a cluster")
        actor_cls = ray.remote(max_restarts=MAX_RESTARTS)(_WorkerActor)
        strategies: dict[str, Any] = {}
        for g in host_groups(self.placements):
            pg = placement_group(g.bundles(), strategy="STRICT_PACK", name=self.actor_name(g.host_id))
            self._groups.append(pg)
            try:
                ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise LaminarError(
                    f"Ray could not place host {g.host_id} (bundles {g.bundles()}, STRICT_PACK: one node) within "
                    f"{PLACEMENT_TIMEOUT_S:.0f} s; cluster resources {_plain(ray.cluster_resources())}: add a node "
                    f"that fits them, or lower rollout.replicas per host (relay.relays hosts)") from None
            for i, p in enumerate(g.members):
                strategies[p.name] = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
        for p in self.placements:
            opts: dict[str, Any] = {"name": self.actor_name(p.name), "num_cpus": p.num_cpus, "num_gpus": p.num_gpus}
            if p.name in strategies:
                opts["scheduling_strategy"] = strategies[p.name]
            self.actors[p.name] = actor_cls.options(**opts).remote(p.name, p.args, p.env, p.log_path, p.bind_node_ip)
        started = self.info(timeout_s=PLACEMENT_TIMEOUT_S)
        for name, info in started.items():
            log.info("process_started", name=name, pid=info["pid"], node=info["node_ip"], launcher="ray")
        if missing := [p for p in self.placements if p.name not in started]:
            asks = {p.name: {"CPU": p.num_cpus, "GPU": p.num_gpus} for p in missing}
            raise LaminarError(f"Ray did not start {asks} within {PLACEMENT_TIMEOUT_S:.0f} s; cluster resources "
                               f"{_plain(ray.cluster_resources())}, free {_plain(ray.available_resources())}: add a "
                               f"node that fits them (their logs: {', '.join(p.log_path for p in missing)})")

    def start_supervision(self, interval_s: float = 0.5) -> None:
        """Nothing to do: Ray restarts a dead worker's actor (MAX_RESTARTS)."""

    def info(self, timeout_s: float = 60.0) -> dict[str, dict]:
        """Each live actor's process: pid, Ray node id and IP, CPU seconds (actors restarting are left out)."""
        ray = self._ray
        refs = {actor.info.remote(): name for name, actor in self.actors.items()}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        out = {}
        for ref in done:
            try:
                out[refs[ref]] = ray.get(ref)
            except ray.exceptions.RayActorError:
                continue
        return out

    def cpu_seconds(self) -> dict[str, float]:
        return {n: i["cpu_s"] for n, i in self.info(timeout_s=5.0).items() if i["cpu_s"] is not None}

    def stop_all(self, timeout_s: float = 15.0) -> None:
        """Stop every worker (SIGTERM, then SIGKILL after timeout_s), then the actors and placement groups; leave
        Ray (disconnect from a cluster, stop a local Ray) unless the caller had connected before start_all."""
        ray = self._ray
        if ray is None:
            return
        refs = [a.stop.remote(timeout_s) for a in self.actors.values()]
        try:
            ray.get(refs, timeout=timeout_s + 10)
        except Exception as e:  # an actor restarting or gone: ray.kill below ends it and its child
            log.warning("ray_stop_incomplete", error=str(e))
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        from ray.util.placement_group import remove_placement_group

        for pg in self._groups:
            remove_placement_group(pg)
        log.info("processes_stopped", count=len(self.actors), launcher="ray")
        self.actors.clear()
        self._groups.clear()
        if self._owns_ray:
            ray.shutdown()
