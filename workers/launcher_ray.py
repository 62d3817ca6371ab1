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

A node that goes away: Ray moves the placement groups that had bundles on it to nodes with room (GCS reschedules
them) and restarts their actors there, each starting its worker again; Temporal hands the lost work to the
survivors meanwhile. A node told it will go (a drain: `ray drain-node`, the autoscaler's idle or preemption
termination, a spot warning wired to the drain API) is watched by every actor on it (DRAIN_POLL_S): the actor gives
its worker the notice (SIGTERM, laminar/notice.py), the worker leaves within LAMINAR_NOTICE_S and exits 0, the actor
exits, and Ray starts it again elsewhere once the node is gone (Ray schedules nothing new on a draining node).

`laminar scale`: match_replicas adds a rollout worker next to a host's relay (hard node affinity to the relay's
node: it maps the relay's /dev/shm) for the slots new replicas need; match_relays starts a new host's relay (its
own placement group) or gives a removed host's workers the notice. The supervisor (start_supervision) starts again
an added rollout worker whose node went away (hard affinity makes Ray give it up) next to its relay's new node.

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
from laminar.rl.factory import trainer_gpus
from laminar.workers.launcher import ManagedProcess, process_cpu_s, rollout_args, slots_to_add

log = get_logger(__name__)

NAMESPACE = "laminar"  # Ray namespace of the actors; an actor is named `<tag>/<process>` (tag: the run id)
ROLE_CPUS = {"control": 1.0, "trainer": 1.0, "relay": 1.0, "rollout": 1.0}  # logical CPUs Ray reserves per role
MAX_RESTARTS = -1  # Ray restarts a dead worker actor without limit, as the local supervisor does
RESTART_DELAY_S = 1.0  # a restarted actor waits this long before starting its child (no tight crash loop)
LOCAL_OBJECT_STORE_BYTES = 100 * 1024**2  # a local Ray's object store: the workers pass no objects through Ray
PLACEMENT_TIMEOUT_S = 60.0
DRAIN_POLL_S = 1.0  # how often each actor asks Ray whether its node is draining
DRAIN_RPC_TIMEOUT_S = 5.0


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

    GPUs: the trainer's on CUDA (rl.factory.trainer_gpus: one per rank of a sharded backend), 0 on CPU; a rollout
    worker one per replica of its host's share (spare slots take over a dead worker's replica and get none of
    their own)."""
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
            gpus = float(trainer_gpus(cfg))  # one per rank of a sharded backend (rl.factory)
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


def draining_nodes(ray: Any) -> dict[str, int]:
    """Ray's nodes being drained: hex node id -> the drain deadline (ms since the epoch; 0 when none was given).

    Ray 2.60 has no public API for it: this is the GCS's own answer (GcsClient.get_draining_nodes, what Ray Serve's
    and Ray Data's node caches read). A node is draining from the drain request (`ray drain-node`, the autoscaler,
    `ray stop`'s SIGTERM drain) until it is gone."""
    return ray._private.worker.global_worker.gcs_client.get_draining_nodes(timeout=DRAIN_RPC_TIMEOUT_S)


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

        from laminar.workers.launcher import _die_with_parent

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
        self.notice: dict | None = None  # the node's drain notice, once seen: {"at": time.time(), "deadline_ms"}
        self.notice_s = float(env.get("LAMINAR_NOTICE_S") or 30.0)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        started = threading.Event()
        failed: list[BaseException] = []

        def watch() -> None:
            # Started from this thread, which lives as long as the child: PDEATHSIG fires when the thread that
            # forked dies, so the child dies with this actor's process, never before.
            try:
                with open(log_path, "ab") as out:
                    self.proc = subprocess.Popen([sys.executable, "-m", "laminar.cli.main", "worker", *args],
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
                why = " after its node's drain notice" if self.notice else ""
                self._log(f"{name} pid {self.proc.pid} exited with {code}{why}; Ray restarts it"
                          + (" once the node is gone" if self.notice else ""))
                os._exit(1)  # a crash to Ray: it restarts the actor (max_restarts), never on a draining node

        threading.Thread(target=watch, name=f"watch-{name}", daemon=True).start()
        started.wait()
        if failed:
            raise LaminarError(f"{name}: cannot start `laminar worker {' '.join(args)}` ({failed[0]}); "
                               f"see {log_path}") from failed[0]
        threading.Thread(target=self._watch_drain, args=(ray,), name=f"drain-{name}", daemon=True).start()

    def _log(self, line: str) -> None:
        with open(self.log_path, "a") as f:
            f.write(f"[ray launcher] {line}\n")

    def _watch_drain(self, ray: Any) -> None:
        """Until the worker stops: when Ray drains this actor's node, give the worker the notice (SIGTERM)."""
        failing = False
        while not self.stopping and self.notice is None:
            time.sleep(DRAIN_POLL_S)
            try:
                nodes = draining_nodes(ray)
            except Exception as e:  # the GCS unreachable a moment: ask again, say so once
                if not failing:
                    self._log(f"cannot ask Ray whether node {self.node_id} is draining ({e}); asking again")
                failing = True
                continue
            failing = False
            if self.node_id in nodes and not self.stopping:
                self.give_notice(nodes[self.node_id])

    def give_notice(self, deadline_ms: int) -> None:
        """The node's drain notice to the worker: SIGTERM (laminar/notice.py: it leaves within LAMINAR_NOTICE_S)."""
        assert self.proc is not None
        self.notice = {"at": time.time(), "deadline_ms": deadline_ms}
        notice_s = self.notice_s
        left = f"{deadline_ms / 1000 - time.time():.0f} s" if deadline_ms else "no deadline"
        short = deadline_ms and deadline_ms / 1000 - time.time() < notice_s
        self._log(f"node {self.node_id} is draining ({left}): SIGTERM to {self.name} pid {self.proc.pid}, its notice"
                  + (f"; the node goes before LAMINAR_NOTICE_S={notice_s:g} s" if short else ""))
        try:
            os.kill(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def info(self) -> dict:
        assert self.proc is not None
        return {"name": self.name, "pid": self.proc.pid, "node_id": self.node_id, "node_ip": self.node_ip,
                "restarted": self.restarted, "cpu_s": process_cpu_s(self.proc.pid), "notice": self.notice,
                "exit_code": self.proc.poll()}

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
    """The LocalLauncher interface (start_all, start_supervision, match_replicas, match_relays, cpu_seconds, pids,
    stop_all) on Ray.

    address: a running cluster (`ray.init(address=...)`); None starts a local Ray sized to the placements."""

    def __init__(self, processes: list[ManagedProcess], placements: list[Placement], tag: str,
                 address: str | None = None) -> None:
        self.processes = {p.name: p for p in processes}
        self.placements = placements
        self.tag = tag
        self.address = address
        self.actors: dict[str, Any] = {}
        self._groups: list[Any] = []
        self._host_groups: dict[str, Any] = {}  # host id -> its placement group
        self._near_relay: dict[str, Placement] = {}  # added rollout workers, placed on their relay's node
        self._retiring: list[threading.Thread] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ray: Any = None
        self._actor_cls: Any = None
        self._owns_ray = False

    def actor_name(self, process: str) -> str:
        return f"{self.tag}/{process}"

    def start_all(self) -> None:
        ray = self._ray = import_ray()
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
        strategies: dict[str, Any] = {}
        for g in host_groups(self.placements):
            pg = self._place_host(g)
            for i, p in enumerate(g.members):
                strategies[p.name] = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
        for p in self.placements:
            self._start_actor(p, strategies.get(p.name))
        self._check_started(self.placements)

    def _place_host(self, g: HostGroup) -> Any:
        """A host's placement group (STRICT_PACK: one node), ready; LaminarError when Ray cannot place it."""
        ray = self._ray
        from ray.util.placement_group import placement_group

        pg = placement_group(g.bundles(), strategy="STRICT_PACK", name=self.actor_name(g.host_id))
        self._groups.append(pg)
        self._host_groups[g.host_id] = pg
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise LaminarError(
                f"Ray could not place host {g.host_id} (bundles {g.bundles()}, STRICT_PACK: one node) within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s; cluster resources {_plain(ray.cluster_resources())}: add a node "
                f"that fits them, or lower rollout.replicas per host (relay.relays hosts)") from None
        return pg

    def _start_actor(self, p: Placement, strategy: Any = None) -> None:
        if self._actor_cls is None:
            self._actor_cls = self._ray.remote(max_restarts=MAX_RESTARTS)(_WorkerActor)
        actor_cls = self._actor_cls
        opts: dict[str, Any] = {"name": self.actor_name(p.name), "num_cpus": p.num_cpus, "num_gpus": p.num_gpus}
        if strategy is not None:
            opts["scheduling_strategy"] = strategy
        self.actors[p.name] = actor_cls.options(**opts).remote(p.name, p.args, p.env, p.log_path, p.bind_node_ip)

    def _check_started(self, placements: list[Placement]) -> None:
        ray = self._ray
        started = self.info(timeout_s=PLACEMENT_TIMEOUT_S, names=[p.name for p in placements])
        for name, info in started.items():
            log.info("process_started", name=name, pid=info["pid"], node=info["node_ip"], launcher="ray")
        if missing := [p for p in placements if p.name not in started]:
            asks = {p.name: {"CPU": p.num_cpus, "GPU": p.num_gpus} for p in missing}
            raise LaminarError(f"Ray did not start {asks} within {PLACEMENT_TIMEOUT_S:.0f} s; cluster resources "
                               f"{_plain(ray.cluster_resources())}, free {_plain(ray.available_resources())}: add a "
                               f"node that fits them (their logs: {', '.join(p.log_path for p in missing)})")

    def _relay_node(self, host_id: str, timeout_s: float) -> str | None:
        """The Ray node id of the host's relay, None while its actor is not up."""
        return self.info(timeout_s=timeout_s, names=[f"relay-{host_id}"]).get(f"relay-{host_id}", {}).get("node_id")

    def _start_near_relay(self, p: Placement, timeout_s: float = PLACEMENT_TIMEOUT_S) -> bool:
        """An added rollout worker on its relay's node (hard affinity: Ray gives it up when the node goes, and the
        supervisor starts it again next to the relay's new node); False while the relay is not up."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        assert p.host_id is not None
        node = self._relay_node(p.host_id, timeout_s)
        if node is None:
            return False
        self._near_relay[p.name] = p
        self._start_actor(p, NodeAffinitySchedulingStrategy(node_id=node, soft=False))
        return True

    def match_replicas(self, replicas: int, hosts: int, spare_slots: int) -> list[str]:
        """`laminar scale`: as LocalLauncher.match_replicas, on Ray: per host whose rollout slots fall short of
        `replicas` replicas (slots_to_add), one more rollout worker with the missing slots, on the node of that
        host's relay (it maps the relay's /dev/shm), asking one GPU per new replica when the rollout workers run on
        GPUs. Returns the names started; stops nothing (a removed replica frees its slot)."""
        have = [0] * hosts
        for p in self.placements:
            if p.role == "rollout" and p.host_id and p.host_id.startswith("host-"):
                i = int(p.host_id.removeprefix("host-"))
                if i < hosts:
                    have[i] += int(p.args[p.args.index("--slots") + 1])
        gpu_per_replica = 1.0 if any(p.role == "rollout" and p.num_gpus for p in self.placements) else 0.0
        by_name = {p.name: p for p in self.placements}
        started = []
        with self._lock:
            for i, add in enumerate(slots_to_add(replicas, hosts, spare_slots, have)):
                relay = by_name.get(f"relay-host-{i}")
                if not add or relay is None or self._stop.is_set():
                    continue
                name = next(f"rollout-host-{i}-{k}" for k in range(1, 10_000) if f"rollout-host-{i}-{k}" not in by_name)
                spare = spare_slots if not have[i] else 0  # a host's first rollout worker keeps its spares
                args = [*relay.args[:-1], *rollout_args(add, spare)]
                gpus = gpu_per_replica * (add - spare)
                p = Placement(name, "rollout", relay.host_id, args, {**relay.env, "LAMINAR_METRICS_PORT": "0"},
                              str(Path(relay.log_path).with_name(f"{name}.log")), ROLE_CPUS["rollout"], gpus)
                if self._start_near_relay(p):
                    self.placements.append(p)
                    by_name[name] = p
                    self._check_started([p])
                    started.append(name)
        return started

    def match_relays(self, relays: int, notice_s: float = 30.0) -> tuple[list[str], list[str]]:
        """`laminar scale --relays M`, as LocalLauncher.match_relays, on Ray: a new host's relay in its own placement
        group (same argv and settings as host-0's relay, its own LAMINAR_HOST_ID); a host beyond M: its relay's and
        rollout workers' actors give their workers the notice (SIGTERM), SIGKILL what is left after notice_s, then
        go, with the host's placement group. Returns (started, stopped) process names; call match_replicas(replicas,
        relays, ...) after it."""
        if relays < 1:
            raise ValueError(f"relays={relays}: a run needs at least one relay (one per host)")
        started: list[str] = []
        stopped: list[str] = []
        with self._lock:
            relays_now = sorted((p for p in self.placements if p.role == "relay"), key=lambda p: p.name)
            if not relays_now or self._stop.is_set():
                return started, stopped
            template = relays_now[0]
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            for i in range(relays):
                name = f"relay-host-{i}"
                if any(p.name == name for p in self.placements):
                    continue
                host = f"host-{i}"
                p = Placement(name, "relay", host, list(template.args),
                              {**template.env, "LAMINAR_HOST_ID": host, "LAMINAR_METRICS_PORT": "0"},
                              str(Path(template.log_path).with_name(f"{name}.log")), template.num_cpus, 0.0,
                              bind_node_ip=template.bind_node_ip)
                pg = self._place_host(HostGroup(host, [p]))
                self.placements.append(p)
                self._start_actor(p, PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                      placement_group_bundle_index=0))
                self._check_started([p])
                started.append(name)
            gone = [p for p in self.placements if p.host_id and p.host_id.startswith("host-")
                    and int(p.host_id.removeprefix("host-")) >= relays]
            for p in gone:
                self.placements.remove(p)
                self._near_relay.pop(p.name, None)
                stopped.append(p.name)
            actors = [self.actors.pop(p.name) for p in gone if p.name in self.actors]
            groups = [self._host_groups.pop(h) for h in {p.host_id for p in gone} if h in self._host_groups]
            if actors or groups:
                t = threading.Thread(target=self._retire, args=(actors, groups, notice_s), name="ray-retire",
                                     daemon=True)
                self._retiring.append(t)
                t.start()
        for name in started:
            log.info("relay_started", name=name, launcher="ray")
        for name in stopped:
            log.info("host_retired", name=name, notice_s=notice_s, launcher="ray")
        return started, stopped

    def _retire(self, actors: list[Any], groups: list[Any], notice_s: float) -> None:
        """Give the actors' workers the notice, wait for them (SIGKILL after notice_s), then end the actors and
        remove the placement groups."""
        ray = self._ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.get([a.stop.remote(notice_s) for a in actors], timeout=notice_s + 15)
        except Exception as e:  # an actor restarting or gone: ray.kill below ends it and its child
            log.warning("ray_retire_incomplete", error=str(e))
        for a in actors:
            ray.kill(a, no_restart=True)
        for pg in groups:
            if pg in self._groups:
                self._groups.remove(pg)
            remove_placement_group(pg)

    def start_supervision(self, interval_s: float = 2.0) -> None:
        """Ray restarts a dead worker's actor (MAX_RESTARTS), and moves a lost node's placement groups; this thread
        starts again an added rollout worker that Ray gave up (its node went: hard affinity) next to its relay."""

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.supervise()
                except Exception as e:  # the cluster busy a moment: try again next round
                    log.warning("ray_supervise_failed", error=str(e))

        self._thread = threading.Thread(target=loop, name="ray-launcher-supervisor", daemon=True)
        self._thread.start()

    def supervise(self) -> list[str]:
        """Start again each added rollout worker whose actor is gone (its node went); returns their names."""
        ray = self._ray
        restarted = []
        with self._lock:
            for name, p in list(self._near_relay.items()):
                if self._stop.is_set():
                    break
                try:
                    ray.get_actor(self.actor_name(name))
                    continue  # alive or restarting
                except ValueError:
                    pass  # dead: Ray frees a dead actor's name
                if self._start_near_relay(p, timeout_s=1.0):
                    log.warning("process_replaced", name=name, launcher="ray", reason="its node is gone")
                    restarted.append(name)
        return restarted

    def info(self, timeout_s: float = 60.0, names: list[str] | None = None) -> dict[str, dict]:
        """Each live actor's process: pid, Ray node id and IP, CPU seconds (actors restarting are left out)."""
        ray = self._ray
        refs = {actor.info.remote(): name for name, actor in self.actors.items() if names is None or name in names}
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
        self._stop.set()
        if ray is None:
            return
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            refs = [a.stop.remote(timeout_s) for a in self.actors.values()]
            try:
                ray.get(refs, timeout=timeout_s + 10)
            except Exception as e:  # an actor restarting or gone: ray.kill below ends it and its child
                log.warning("ray_stop_incomplete", error=str(e))
            for actor in self.actors.values():
                ray.kill(actor, no_restart=True)
            for t in self._retiring:
                t.join(timeout=timeout_s + 20)
            from ray.util.placement_group import remove_placement_group

            for pg in self._groups:
                remove_placement_group(pg)
            log.info("processes_stopped", count=len(self.actors), launcher="ray")
            self.actors.clear()
            self._groups.clear()
            self._host_groups.clear()
        if self._owns_ray:
            ray.shutdown()
