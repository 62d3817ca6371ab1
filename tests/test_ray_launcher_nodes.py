"""Nodes that go away under a run on Ray (workers/launcher_ray.py), on a multi-node Ray cluster simulated on this
machine (`ray.cluster_utils.Cluster`, CPU only), against a dev stack with a local file store:

1. a node is lost (its worker processes SIGKILLed, then the node removed): Ray moves that host's placement group to
   a surviving node and restarts its relay and rollout worker there; the run goes on;
2. a node is drained (the GCS drain request `ray drain-node` sends, reason preemption): the launcher's actors on it
   give their workers the notice (SIGTERM), the workers exit 0, and once the node is removed they start again on a
   surviving node; the run goes on;
3. `laminar scale` on Ray: match_replicas adds a rollout worker next to each host's relay (the run's replicas
   2 x 2 -> 6), match_relays starts a third host's relay and gives it the notice again;
4. the node holding everything but control and trainer is lost: both hosts start again on a second spare node,
   and the launcher's supervisor starts the added rollout workers again next to their relays.
At the end: 0 groups lost, 0 consumed twice.

The cluster: a head with no CPU (nothing lands on it, so every worker is on a node the test may remove) and three
nodes of 2 logical CPUs. Every role reserves 1 CPU (ROLE_CPUS) and a host's relay + rollout are one STRICT_PACK
placement group of 2 CPUs: the two hosts fill two nodes, control and trainer the third. The spare node (8 CPUs)
joins after the run started, so it is the only place a lost host's group fits: 2 hosts x 2 CPUs, then 2 added
rollout workers and a relay, 1 CPU each = 7 of its 8 CPUs; the second spare (8 CPUs) takes the 6 that are left.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from laminar.cli.run import _spare_slots, make_launcher
from laminar.client.connect import connect
from laminar.client.run_control import scale_run, start_run, stop_run
from laminar.client.settings import Settings
from laminar.config import RunConfig
from laminar.contract import RunStatus, workflow_id_for
from laminar.devstack.stack import DevStack
from laminar.workers.launcher_ray import NAMESPACE, RayLauncher
from tests.fixtures.s3 import free_port
from tests.fixtures.stack import TEST_OVERRIDES
from tests.fixtures.waiting import async_wait_until

pytestmark = pytest.mark.slow  # up to 5 Ray nodes and a run through three node losses: minutes on 2 cores

NODE_CPUS = 2
SPARE_CPUS = 8
NOTICE_S = 5.0  # LAMINAR_NOTICE_S of the workers: a drained node's workers leave within this
MIB = 1024**2
HOST_PROCS = ("relay-host-{i}", "rollout-host-{i}")


@pytest.fixture(scope="module")
def ray_nodes(tmp_path_factory) -> Iterator[tuple[object, Path]]:
    """A Ray cluster (a CPU-less head + 3 nodes of 2 CPUs) and a dev stack; yields (cluster, LAMINAR_HOME)."""
    import ray
    from ray.cluster_utils import Cluster

    home = tmp_path_factory.mktemp("ray-nodes-home")
    saved = os.environ.get("RAY_USAGE_STATS_ENABLED")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no report to Ray's servers (nothing leaves this machine)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 100 * MIB,
                                                            "include_dashboard": False})
    dev = DevStack(home)
    try:
        for _ in range(3):
            cluster.add_node(num_cpus=NODE_CPUS, object_store_memory=100 * MIB)
        cluster.wait_for_nodes()
        dev.up(port=free_port(), ui=False)
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        yield cluster, home
    finally:
        ray.shutdown()
        dev.down()
        cluster.shutdown()
        if saved is None:
            os.environ.pop("RAY_USAGE_STATS_ENABLED", None)
        else:
            os.environ["RAY_USAGE_STATS_ENABLED"] = saved


async def _status(handle) -> RunStatus | None:
    try:
        return await handle.query("status", result_type=RunStatus)
    except Exception:
        return None


async def _steps_past(handle, step: int, what: str, timeout_s: float = 180) -> RunStatus:
    async def past() -> RunStatus | None:
        st = await _status(handle)
        return st if st is not None and st.step >= step else None

    return await async_wait_until(past, timeout_s, what, interval_s=0.5)


async def _relays_back(handle, n: int) -> list | None:
    st = await _status(handle)
    return st.relays if st is not None and len(st.relays) == n else None


def _node_of(cluster, node_id: str):
    return next(n for n in cluster.worker_nodes if n.node_id == node_id)


async def _moved(launcher: RayLauncher, names: list[str], to: str, before: dict, timeout_s: float = 120,
                 restarted: bool = True) -> dict:
    """Wait until every named process runs again on node `to`, with a new pid, in its actor restarted by Ray
    (restarted) or in a new actor (the launcher's supervisor); their infos."""

    async def check() -> dict | None:
        info = await asyncio.to_thread(launcher.info, 2.0, names)
        ok = all(n in info and info[n]["node_id"] == to and info[n]["pid"] != before[n]["pid"]
                 and info[n]["restarted"] == restarted and info[n]["exit_code"] is None for n in names)
        return info if ok else None

    return await async_wait_until(check, timeout_s, f"{names} running again on the spare node", interval_s=1.0)


def _drain(cluster, node_id: str, deadline_s: float) -> None:
    """What `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N` sends the GCS."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=cluster.address)
    accepted, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   "test: spot preemption warning", int((time.time() + deadline_s) * 1000))
    assert accepted, why


async def test_lost_and_drained_nodes_and_scale_on_ray(ray_nodes, tmp_path):
    cluster, home = ray_nodes
    t_start = time.monotonic()
    run_id = f"t-rayn-{uuid.uuid4().hex[:8]}"
    cfg = RunConfig.load(None, [*TEST_OVERRIDES, "run.steps=1000", "rollout.replicas=4", "relay.relays=2",
                                "trainer.heartbeat_timeout_s=5", "trainer.checkpoint_every=4"]).with_run_id(run_id)
    settings = Settings.from_env({"LAMINAR_HOME": str(home), "LAMINAR_NOTICE_S": f"{NOTICE_S:g}"})
    launcher = make_launcher("ray", cfg, settings, run_id, cluster.address)
    assert isinstance(launcher, RayLauncher)
    figures: dict[str, float] = {}
    try:
        launcher.start_all()
        launcher.start_supervision(interval_s=1.0)
        await start_run(settings, cfg)
        handle = (await connect(settings)).get_workflow_handle(workflow_id_for(run_id), result_type=RunStatus)
        await _steps_past(handle, 2, "the run's first steps on Ray")

        info = launcher.info()
        # Each host's relay and rollout on one node, the hosts on two nodes, control + trainer on the third.
        nodes = {h: info[f"relay-host-{h}"]["node_id"] for h in (0, 1)}
        assert all(info[f"rollout-host-{h}"]["node_id"] == nodes[h] for h in (0, 1)), info
        assert len({nodes[0], nodes[1], info["trainer"]["node_id"]}) == 3, info
        spare = cluster.add_node(num_cpus=SPARE_CPUS, object_store_memory=100 * MIB)
        cluster.wait_for_nodes()

        # 1. host-0's node is lost: its worker processes die at once (SIGKILL), then the node goes.
        lost = [p.format(i=0) for p in HOST_PROCS]
        at = (await _status(handle)).step
        for name in lost:
            os.kill(info[name]["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        cluster.remove_node(_node_of(cluster, nodes[0]))
        await _moved(launcher, lost, spare.node_id, info)
        figures["lost_node_replaced_s"] = time.monotonic() - t0
        figures["lost_node_steps_until_replaced"] = (await _status(handle)).step - at
        assert figures["lost_node_steps_until_replaced"] >= 1, "training stopped while host-0 was down"
        await _steps_past(handle, at + 3, "3 steps after the node loss")
        figures["lost_node_3_steps_s"] = time.monotonic() - t0
        await async_wait_until(lambda: _relays_back(handle, 2), 90, "host-0's new relay back in the chain")
        figures["lost_relay_rejoined_s"] = time.monotonic() - t0

        # 2. host-1's node is drained (preemption, 60 s deadline): the launcher gives its workers the notice; they
        # exit 0 within NOTICE_S; then the node goes and the host starts again on the spare node.
        drained = [p.format(i=1) for p in HOST_PROCS]
        at = (await _status(handle)).step
        t0 = time.monotonic()
        _drain(cluster, nodes[1], deadline_s=60)
        logs = {n: Path(launcher.processes[n].log_path) for n in drained}

        def left_on_notice() -> bool:
            return all("exited with 0 after its node's drain notice" in logs[n].read_text() for n in drained)

        await async_wait_until(lambda: left_on_notice() or None, NOTICE_S + 30, "the drained workers to exit 0")
        figures["drain_notice_to_exit_s"] = time.monotonic() - t0
        for n in drained:
            text = logs[n].read_text()
            assert f"node {nodes[1]} is draining" in text and "notice_received" in text, text[-2000:]
        cluster.remove_node(_node_of(cluster, nodes[1]))
        t1 = time.monotonic()
        await _moved(launcher, drained, spare.node_id, info)
        figures["drained_node_replaced_s"] = time.monotonic() - t1
        await _steps_past(handle, at + 3, "3 steps after the drain")
        await async_wait_until(lambda: _relays_back(handle, 2), 90, "host-1's new relay back in the chain")
        figures["drained_relay_rejoined_s"] = time.monotonic() - t1

        # 3. scale 4 -> 6 replicas: per host (both on the spare node now) 4 replicas need 2 + 1 spare slots...
        # 6 need 3 + 1: one more rollout worker of 1 slot next to each relay.
        await scale_run(settings, run_id, 6)
        started = launcher.match_replicas(6, 2, _spare_slots(cfg))
        assert started == ["rollout-host-0-1", "rollout-host-1-1"], started
        info = launcher.info()
        assert all(info[n]["node_id"] == spare.node_id for n in started), info

        async def six_running() -> RunStatus | None:
            s = await _status(handle)
            return s if s is not None and s.replicas_running == 6 else None

        st = await async_wait_until(six_running, 120, "6 replicas running after the scale", interval_s=1.0)
        await _steps_past(handle, st.step + 3, "3 steps with 6 replicas")
        # A third host's relay (its own placement group), then back to 2 hosts: it gets the notice and exits 0.
        assert launcher.match_relays(3) == (["relay-host-2"], [])
        assert "relay-host-2" in launcher.info(names=["relay-host-2"])
        relay2 = Path(next(p.log_path for p in launcher.placements if p.name == "relay-host-2"))
        await async_wait_until(lambda: "worker_started" in relay2.read_text() or None, 60, "host-2's relay serving")
        assert launcher.match_relays(2, notice_s=NOTICE_S) == ([], ["relay-host-2"])
        launcher._retiring[-1].join(timeout=NOTICE_S + 30)
        text = relay2.read_text()
        assert "notice_received" in text and "worker_stopped" in text, text[-2000:]

        # 4. The spare node, which holds both hosts and the two added rollout workers now, is lost: Ray moves both
        # hosts' groups to a second spare node; Ray gives up the added workers (hard affinity to the lost node) and
        # the launcher's supervisor starts them again next to their relays.
        spare2 = cluster.add_node(num_cpus=SPARE_CPUS, object_store_memory=100 * MIB)
        cluster.wait_for_nodes()
        info = launcher.info()
        at = (await _status(handle)).step
        for name in [*lost, *drained, *started]:
            os.kill(info[name]["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        cluster.remove_node(spare)
        await _moved(launcher, [*lost, *drained], spare2.node_id, info)
        await _moved(launcher, started, spare2.node_id, info, restarted=False)
        figures["spare_lost_replaced_s"] = time.monotonic() - t0
        await _steps_past(handle, at + 3, "3 steps after the spare node's loss")
        await async_wait_until(six_running, 120, "6 replicas running again", interval_s=1.0)
        await async_wait_until(lambda: _relays_back(handle, 2), 90, "both relays back in the chain")
        figures["spare_lost_recovered_s"] = time.monotonic() - t0

        await stop_run(settings, run_id)
        final: RunStatus = await handle.result()
    finally:
        launcher.stop_all(timeout_s=10)
    assert final.groups_consumed_twice == 0
    assert final.prompts_issued == (final.groups_consumed + final.ready_groups + final.open_leases
                                    + final.returned_leases), "a prompt group was lost"
    figures["wall_s"] = time.monotonic() - t_start
    print(f"figures step={final.step} consumed={final.groups_consumed} " + " ".join(
        f"{k}={v:.1f}" for k, v in figures.items()))
