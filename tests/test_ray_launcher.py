"""The Ray launcher (workers/launcher_ray.py): its placement plan, and `laminar run --launcher ray` on a
multi-node Ray cluster simulated on this machine (`ray.cluster_utils.Cluster`, CPU only), with a rollout and
a relay drill against the run.

The cluster, started once for the module (Ray's own processes are heavy on 2 cores): a head node and two worker
nodes, 2 logical CPUs each. Every role reserves 1 CPU (ROLE_CPUS), so a host's placement group (relay + rollout,
STRICT_PACK) needs a whole node: the two hosts land on two different nodes, and control and trainer (1 + 1) fill
the third. The run itself is the real CLI in a child process, against a dev stack with a local file store.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.client import WorkflowHandle

from laminar.cli.run import check_launcher
from laminar.client.connect import connect
from laminar.client.run_control import stop_run
from laminar.client.settings import Settings
from laminar.config import RunConfig
from laminar.contract import DrillInput, DrillReport, RunStatus, workflow_id_for
from laminar.devstack.stack import DevStack
from laminar.drills.command import run_drill
from laminar.errors import ConfigError, LaminarError
from laminar.workers.launcher import plan_processes
from laminar.workers.launcher_ray import NAMESPACE, ROLE_CPUS, host_groups, plan_placements
from tests.fixtures.s3 import free_port
from tests.fixtures.stack import TEST_OVERRIDES
from tests.fixtures.waiting import async_wait_until, wait_until

REPO = Path(__file__).resolve().parents[1]
NODE_CPUS = 2  # per Ray node: one host's relay + rollout (1 + 1), or control + trainer
MIB = 1024**2


def _plan(tmp_path: Path, *overrides: str, spare: int = 1):
    cfg = RunConfig.load(None, list(overrides))
    settings = Settings.from_env({"LAMINAR_HOME": str(tmp_path)})
    procs = plan_processes(cfg, settings, tmp_path / "logs", spare_slots=spare, allow_faults=True)
    return procs, plan_placements(cfg, procs)


def test_placement_on_cpu_mirrors_the_local_plan(tmp_path):
    procs, placements = _plan(tmp_path, "rollout.replicas=3", "relay.relays=2")
    assert [p.name for p in placements] == [p.name for p in procs] == [
        "control", "trainer", "relay-host-0", "rollout-host-0", "relay-host-1", "rollout-host-1"]
    by = {p.name: p for p in placements}
    # Same worker argv after `laminar worker`: 3 replicas on 2 hosts -> 2 and 1, plus one spare slot each.
    assert by["rollout-host-0"].args == ["--allow-faults", "rollout", "--slots", "3", "--spare", "1"]
    assert by["rollout-host-1"].args == ["--allow-faults", "rollout", "--slots", "2", "--spare", "1"]
    assert by["relay-host-1"].env["LAMINAR_HOST_ID"] == "host-1"
    assert all(k.startswith("LAMINAR_") for p in placements for k in p.env)  # nothing else of this shell
    assert all(p.num_gpus == 0 for p in placements)  # CPU config: no GPU asked for
    assert [(g.host_id, [m.role for m in g.members], g.bundles()) for g in host_groups(placements)] == [
        ("host-0", ["relay", "rollout"], [{"CPU": 1.0}, {"CPU": 1.0}]),
        ("host-1", ["relay", "rollout"], [{"CPU": 1.0}, {"CPU": 1.0}]),
    ]


def test_placement_gpus_per_trainer_and_per_replica(tmp_path):
    # fsdp over 4 ranks: 4 GPUs for the trainer; 5 replicas on 2 hosts -> 3 and 2 GPUs (the spare slot gets none).
    _, placements = _plan(tmp_path, "trainer.device=cuda", "trainer.backend=fsdp", "trainer.fsdp_procs=4",
                          "rollout.device=cuda", "rollout.replicas=5", "relay.relays=2")
    gpus = {p.name: p.num_gpus for p in placements}
    assert gpus == {"control": 0, "trainer": 4, "relay-host-0": 0, "rollout-host-0": 3, "relay-host-1": 0,
                    "rollout-host-1": 2}
    assert host_groups(placements)[0].bundles() == [{"CPU": 1.0}, {"CPU": 1.0, "GPU": 3.0}]
    _, single = _plan(tmp_path, "trainer.device=cuda")
    assert {p.name: p.num_gpus for p in single}["trainer"] == 1


def test_launcher_option_errors_name_the_fix():
    with pytest.raises(ConfigError, match=r"--launcher='k8s' is not one of local, ray"):
        check_launcher("k8s", None)
    with pytest.raises(ConfigError, match=r"--ray-address='10.0.0.1:6379' needs --launcher ray"):
        check_launcher("local", "10.0.0.1:6379")
    check_launcher("ray", None)  # the `ray` extra is installed (make test)


def test_default_path_never_imports_ray():
    code = ("import sys, laminar.cli.main, laminar.cli.run, laminar.workers.launcher, laminar.workers.processes; "
            "sys.exit(1 if 'ray' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_ray_cluster_config_passes_rays_schema():
    """infra/ray/cluster.yaml through Ray's own `ray up` schema (after Ray fills in its provider defaults), and
    it sets every LAMINAR_* variable but the three the launcher sets per worker."""
    import yaml
    from jsonschema import ValidationError
    from ray.autoscaler._private.util import prepare_config, validate_config

    from laminar.client.settings import _Variables

    path = REPO / "infra/ray/cluster.yaml"
    config = yaml.safe_load(path.read_text())
    validate_config(prepare_config(copy.deepcopy(config)))
    assert {"gpu_trainer", "gpu_rollout"} <= set(config["available_node_types"])
    broken = copy.deepcopy(config)
    broken["available_node_types"]["gpu_rollout"]["min_worker"] = 2  # a typo: the schema rejects it
    with pytest.raises(ValidationError):
        validate_config(prepare_config(broken))
    env_file = "\n".join(config["head_setup_commands"])
    set_here = set(re.findall(r"^\s*(LAMINAR_[A-Z0-9_]+)=", env_file, re.MULTILINE))
    every = {f"LAMINAR_{name.upper()}" for name in _Variables.model_fields}
    assert set_here == every - {"LAMINAR_HOST_ID", "LAMINAR_RELAY_BIND", "LAMINAR_METRICS_PORT"}


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """A 3-node Ray cluster (head + 2) and a dev stack (Temporal, file store); yields (ray address, LAMINAR_HOME)."""
    import ray
    from ray.cluster_utils import Cluster

    home = tmp_path_factory.mktemp("ray-home")
    saved = os.environ.get("RAY_USAGE_STATS_ENABLED")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no report to Ray's servers (nothing leaves this machine)
    node = {"num_cpus": NODE_CPUS, "object_store_memory": 100 * MIB}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    dev = DevStack(home)
    try:
        for _ in range(2):
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        dev.up(port=free_port(), ui=False)
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        yield cluster.address, home
    finally:
        ray.shutdown()
        dev.down()
        cluster.shutdown()
        if saved is None:
            os.environ.pop("RAY_USAGE_STATS_ENABLED", None)
        else:
            os.environ["RAY_USAGE_STATS_ENABLED"] = saved


def _actor_info(run_id: str, process: str) -> dict:
    import ray

    return ray.get(ray.get_actor(f"{run_id}/{process}").info.remote(), timeout=60)


async def _step(handle: WorkflowHandle) -> int:
    try:
        return (await handle.query("status", result_type=RunStatus)).step
    except Exception:
        return 0


async def _drill(settings: Settings, handle: WorkflowHandle, run_id: str, fault: str) -> DrillReport:
    at = await _step(handle) + 2
    report = await run_drill(settings, DrillInput(run_id=run_id, drill_id="", fault=fault, at_step=at,
                                                  timeout_s=120.0))
    assert report.recovered and report.detected_at is not None, report
    assert report.groups_lost == 0 and report.groups_consumed_twice == 0, report
    assert report.steps_during_outage >= 1, f"training stopped while the {fault} worker was down: {report}"
    return report


@pytest.mark.slow  # 50 s with its cluster; `make test` stays under 15 minutes (run with -m slow)
async def test_run_and_drills_on_a_ray_cluster(ray_cluster, tmp_path):
    address, home = ray_cluster
    # control + trainer + 2 hosts x (relay + rollout) = 1 + 1 + 2 x 2 = 6 CPUs: the 3 nodes exactly.
    r = ROLE_CPUS
    assert r["control"] + r["trainer"] + 2 * (r["relay"] + r["rollout"]) == 3 * NODE_CPUS
    run_id = f"t-ray-{uuid.uuid4().hex[:8]}"
    overrides = [f"--{o}" for o in [*TEST_OVERRIDES, "run.steps=1000", "rollout.replicas=4",
                                     "trainer.heartbeat_timeout_s=5", "trainer.checkpoint_every=4"]]
    summary = tmp_path / "summary.json"
    argv = [sys.executable, "-m", "laminar.cli.main", "run", str(REPO / "examples/tiny.toml"), "--launcher", "ray",
            "--ray-address", address, "--run-id", run_id, "--summary", str(summary), *overrides]
    out = open(tmp_path / "run.out", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, "LAMINAR_HOME": str(home)},
                            stdout=out, stderr=subprocess.STDOUT)
    settings = Settings.from_env({"LAMINAR_HOME": str(home)})
    try:
        client = await connect(settings)
        handle = client.get_workflow_handle(workflow_id_for(run_id), result_type=RunStatus)
        await async_wait_until(lambda: _step(handle), 150, "the run's first step on Ray", interval_s=0.5)

        # Each host's relay and rollout worker run on one Ray node (one STRICT_PACK placement group), the two
        # hosts on two nodes (a host's bundles fill a node), and relays listen on their node's IP.
        info = {p: _actor_info(run_id, p) for p in
                ("control", "trainer", "relay-host-0", "rollout-host-0", "relay-host-1", "rollout-host-1")}
        for h in ("host-0", "host-1"):
            assert info[f"relay-{h}"]["node_id"] == info[f"rollout-{h}"]["node_id"], info
        assert info["relay-host-0"]["node_id"] != info["relay-host-1"]["node_id"], info
        assert len({i["node_id"] for i in info.values()}) == 3, info
        relays = await async_wait_until(lambda: _relays(handle, 2), 60, "both relays in the chain")
        for r in relays:
            assert r.address.rpartition(":")[0] == info[f"relay-{r.relay_id}"]["node_ip"], (r, info)

        rollout = await _drill(settings, handle, run_id, "rollout")
        relay = await _drill(settings, handle, run_id, "relay")
        # Ray restarted the actors of the two killed processes (max_restarts), each with a new worker process;
        # the relay drill's target is a relay id, which is its host's id.
        after = wait_until(lambda: _all_info(run_id, info), 60, "every worker's actor answering")
        restarted = {p for p, i in after.items() if i["restarted"]}
        assert f"relay-{relay.target}" in restarted and len(restarted) == 2, (rollout, relay, after)
        assert len({p for p in restarted if p.startswith("rollout-")}) == 1, after
        assert all(after[p]["pid"] != info[p]["pid"] for p in restarted), after

        await stop_run(settings, run_id)
        final: RunStatus = await handle.result()
        assert proc.wait(timeout=90) == 0, (tmp_path / "run.out").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
        out.close()
    assert final.groups_consumed_twice == 0
    assert final.prompts_issued == (final.groups_consumed + final.ready_groups + final.open_leases
                                    + final.returned_leases), "a prompt group was lost"
    s = json.loads(summary.read_text())
    assert s["groups_consumed_twice"] == 0 and s["steps"] == final.step > 0
    import ray

    with pytest.raises(ValueError):  # `laminar run` removed its actors when it ended
        ray.get_actor(f"{run_id}/trainer")


async def _relays(handle: WorkflowHandle, n: int) -> list | None:
    relays = (await handle.query("status", result_type=RunStatus)).relays
    return relays if len(relays) >= n else None


def _all_info(run_id: str, processes) -> dict | None:
    """Every process's actor info, or None while one of them is restarting."""
    try:
        return {p: _actor_info(run_id, p) for p in processes}
    except Exception:
        return None


def test_a_host_ray_cannot_place_fails_with_its_bundles(ray_cluster, tmp_path, monkeypatch):
    """rollout.device = cuda on this CPU-only cluster: host-0's group asks for a GPU no node has. start_all fails
    and names the host, the bundles and the cluster's resources (3 nodes x 2 CPUs = 6 CPUs, no GPU)."""
    import laminar.workers.launcher_ray as launcher_ray

    address, home = ray_cluster
    monkeypatch.setattr(launcher_ray, "PLACEMENT_TIMEOUT_S", 3.0)
    cfg = RunConfig.load(None, ["rollout.device=cuda", "rollout.replicas=1", "relay.relays=1"])
    settings = Settings.from_env({"LAMINAR_HOME": str(home)})
    procs = plan_processes(cfg, settings, tmp_path / "logs", spare_slots=1)
    launcher = launcher_ray.RayLauncher(procs, plan_placements(cfg, procs), f"t-{uuid.uuid4().hex[:8]}", address)
    try:
        with pytest.raises(LaminarError) as e:
            launcher.start_all()
    finally:
        launcher.stop_all()
    assert ("Ray could not place host host-0 (bundles [{'CPU': 1.0}, {'CPU': 1.0, 'GPU': 1.0}], STRICT_PACK: one "
            "node) within 3 s; cluster resources {'CPU': 6.0}") in str(e.value)
    assert launcher.actors == {}  # nothing was started
