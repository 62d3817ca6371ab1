"""Several runs on one worker set: `laminar workers` started once, as a real process, and three runs of the
default example started on it with `laminar start`, against the session's Temporal dev server (in a namespace of
their own, so no other test's workers serve them) and the S3 dev server.

Before relays held versions per run, the second run's version 0 evicted the first run's from every relay and the
first run's replicas waited for weights forever. Here every run finishes with none lost and none consumed twice,
and each run's replicas waited for weights only seconds.

The worker set's 4 rollout slots are shared through its slot pool (workflows/pool.py): while the three runs are
live they are granted 2, 1 and 1 (max-min fair, the odd slot to the oldest), the two short ones say so in their
status, and a finished run's slots go to the runs still going.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from datetime import timedelta

import pytest
from temporalio.api.workflowservice.v1 import RegisterNamespaceRequest
from temporalio.client import Client

from laminar import contract
from laminar.client.converter import DATA_CONVERTER
from laminar.contract import PoolStatus, RunStatus, pool_workflow_id, workflow_id_for
from laminar.storage import keys
from laminar.storage.objects import S3ObjectStore
from tests.fixtures.s3 import create_bucket, stop_process
from tests.fixtures.stack import TEST_OVERRIDES
from tests.fixtures.temporal import temporal_address
from tests.fixtures.waiting import async_wait_until

LAMINAR = [sys.executable, "-m", "laminar.cli.main"]
RUNS = 3
# The first run ends first, so its slots go to the two still going. It must still be live when the third is
# started: each `laminar start` is a new process (seconds of imports), and with 3 steps the first run had finished
# before the third arrived, so the pool never held all three (seen on main once steps got faster).
STEPS = [12, 24, 24]
RUN_TIMEOUT_S = 600  # three runs on one trainer and 4 rollout slots, on a busy 2-core machine
# The default example's workers: rollout.replicas=2 on relay.relays=2 hosts, one replica each plus one spare slot
# (cli/run.py), so 4 rollout slots for 3 runs asking 2 each. Max-min fair: level 1 costs 3 slots,
# level 2 would cost 6 > 4, so each run gets 1 and the slot left goes to the oldest: 2, 1, 1.
SLOTS = 4
CONTINUE_EVERY = 2  # each run continues as new every 2 steps: its grant and ask carry over, it re-states its ask
SHARED_GRANTS = [2, 1, 1]
WAIT_WEIGHTS_MAX_S = 10.0  # "a few seconds": replicas waiting for weights poll the relays every 0.5 s


async def _namespace(client: Client) -> str:
    name = f"multi-{uuid.uuid4().hex[:8]}"
    await client.workflow_service.register_namespace(RegisterNamespaceRequest(
        namespace=name, workflow_execution_retention_period=timedelta(days=1)))
    return name


async def _pool_reports(client: Client, slots: int) -> PoolStatus:
    """Wait until `laminar workers` has reported its slots to the pool (a pool no worker set reports to limits
    nothing, so runs started before the report would run their full ask until it comes)."""
    async def reported() -> PoolStatus | None:
        try:
            p = await client.get_workflow_handle(pool_workflow_id()).query(contract.POOL_STATUS, result_type=PoolStatus)
        except Exception:  # noqa: BLE001 - not started yet, or no control worker yet
            return None
        return p if p.slots == slots else None
    return await async_wait_until(reported, 120, f"the worker set to report {slots} slots", interval_s=0.5)


def _wait_weights_s(store: S3ObjectStore, run_id: str) -> dict[str, float]:
    """Per rollout replica incarnation: seconds it sat idle waiting for weights (laminar.timing's wait_weights)."""
    out = {}
    for key in store.list(keys.profile_prefix(run_id, "rollout")):
        buckets = json.loads(store.get(key))["buckets"]
        out[key.rsplit("/", 1)[-1]] = buckets.get("wait_weights", {}).get("s", 0.0)
    return out


@pytest.mark.slow  # make test stays under 15 min; run with -m slow
async def test_three_runs_share_one_worker_set(temporal_env, moto_server, tmp_path):
    namespace = await _namespace(temporal_env.client)
    bucket = create_bucket(moto_server)
    env = {**os.environ, "LAMINAR_HOME": str(tmp_path / "home"),
           "LAMINAR_TEMPORAL_ADDRESS": temporal_address(temporal_env.client), "LAMINAR_NAMESPACE": namespace,
           "LAMINAR_STORE": f"s3://{bucket}", "LAMINAR_S3_ENDPOINT": moto_server, "LAMINAR_LOG_LEVEL": "info"}
    overrides = [f"--{o}" for o in TEST_OVERRIDES if not o.startswith("run.steps")]
    client = await Client.connect(temporal_address(temporal_env.client), namespace=namespace,
                                  data_converter=DATA_CONVERTER)
    log_path = tmp_path / "workers.log"
    with open(log_path, "wb") as log:
        workers = subprocess.Popen([*LAMINAR, "workers", "examples/tiny.toml", *overrides], env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
    try:
        await _pool_reports(client, SLOTS)
        run_ids = [f"t-multi-{uuid.uuid4().hex[:6]}-{i}" for i in range(RUNS)]
        for run_id, steps in zip(run_ids, STEPS, strict=True):
            started = await asyncio.to_thread(
                subprocess.run, [*LAMINAR, "start", "examples/tiny.toml", "--steps", str(steps), "--run-id", run_id,
                                 *overrides, f"--run.continue_as_new_every={CONTINUE_EVERY}"], env=env,
                capture_output=True, text=True, timeout=120)
            assert started.returncode == 0, started.stdout + started.stderr
        handles = [client.get_workflow_handle(workflow_id_for(r), result_type=RunStatus) for r in run_ids]
        pool = client.get_workflow_handle(pool_workflow_id())
        watch = _ShareWatch(pool, handles)
        watching = asyncio.create_task(watch.run())
        finals: list[RunStatus] = await asyncio.wait_for(
            asyncio.gather(*(h.result(rpc_timeout=None) for h in handles)), RUN_TIMEOUT_S)
        watching.cancel()
        shared, notes = watch.shared, watch.notes
        # while all three were live the pool granted 2, 1, 1 in start order, and the two short runs said why
        assert shared is not None, "never saw the three runs share the slots"
        assert shared.slots == SLOTS and [r.run_id for r in shared.runs] == run_ids, shared
        assert [r.granted for r in shared.runs] == SHARED_GRANTS, shared
        for run_id in run_ids[1:]:
            assert f"granted 1 of 2 asked: 3 runs share {SLOTS} slots" in notes[run_id], (run_id, notes[run_id])
        # the first run's slots went to the two still going once it finished: the pool granted them 2 each, and the
        # third run (granted 1 since it arrived) had its second replica report then (a replica started during a
        # continue-as-new starts in the next segment, without a replica_added event: the reports are the evidence)
        assert watch.after_first == [2, 2], watch.after_first
        reported = [sorted(r.replica_id for r in f.replicas) for f in finals]
        assert reported[2] == ["replica-0", "replica-1"], reported
        print("shared", [(r.run_id, r.asked, r.granted) for r in shared.runs], "after the first", watch.after_first,
              "reported", reported,
              "replica_leaving", [sorted(k for k in f.event_times if k.startswith("replica_leaving/")) for f in finals])
        # and every run left the pool as it finished
        left = await pool.query(contract.POOL_STATUS, result_type=PoolStatus)
        assert left.runs == [] and left.slots == SLOTS, left
        store = S3ObjectStore(bucket, endpoint_url=moto_server)
        waits = {}
        for run_id, final, steps in zip(run_ids, finals, STEPS, strict=True):
            assert final.phase == "finished" and final.step == steps, (run_id, final.phase, final.step)
            assert final.continued_as_new >= 1, (run_id, final.continued_as_new)  # continues as new every 2 steps
            # groups_per_step=2: 6 steps consume 12 groups; every group generated is consumed or still ready
            assert final.groups_consumed == steps * 2 and final.groups_consumed_twice == 0
            assert final.groups_generated == final.groups_consumed + final.ready_groups  # none lost
            # No replica ever found its run's version gone from every relay (so none needed a republish): with one
            # version store per relay, the runs' versions evicted each other and a run's replicas
            # reported version_missing, then waited ~4.5 s for the republish (measured with that store).
            assert not [k for k in final.event_times if k.startswith("version_missing/")], final.event_times
            # the replicas write their profiles as they return, after the run's result
            waits[run_id] = await async_wait_until(lambda r=run_id: _wait_weights_s(store, r), 60,
                                                   f"{run_id}'s rollout profiles", interval_s=1.0)
        print("wait_weights_s", json.dumps(waits))
        for run_id, per_replica in waits.items():
            assert max(per_replica.values()) < WAIT_WEIGHTS_MAX_S, (run_id, per_replica)
    finally:
        stop_process(workers, timeout_s=60)  # SIGTERM: `laminar workers` stops its own processes
        print(log_path.read_text(errors="replace")[-3000:])


class _ShareWatch:
    """Until cancelled, every 0.5 s: the pool's grants while all the runs are live (the first such snapshot with every
    slot granted), and every grant note each run's status showed."""

    def __init__(self, pool, handles) -> None:
        self.pool, self.handles = pool, handles
        self.shared: PoolStatus | None = None
        self.after_first: list[int] | None = None  # the grants once the first run has left and the others have not
        self.notes: dict[str, set[str]] = {h.id.removeprefix("run/"): set() for h in handles}

    async def run(self) -> None:
        while True:
            try:
                p = await self.pool.query(contract.POOL_STATUS, result_type=PoolStatus)
                if self.shared is None and len(p.runs) == len(self.handles) and sum(r.granted for r in p.runs) == p.slots:
                    self.shared = p
                others = [h.id.removeprefix("run/") for h in self.handles[1:]]
                if self.shared is not None and [r.run_id for r in p.runs] == others:
                    self.after_first = [r.granted for r in p.runs]
                for h in self.handles:
                    st = await h.query(contract.STATUS, result_type=RunStatus)
                    if st.grant_note:
                        self.notes[st.run_id].add(st.grant_note)
            except Exception:  # noqa: BLE001 - a query racing a continue-as-new or a finish: look again
                pass
            await asyncio.sleep(0.5)


STARVED_WARN_S = 3  # run.stall_warn_s of the run the quota leaves without a slot: the watchdog names it after this
Q_STEPS = 1000  # the quota run goes on until the test stops it (`laminar stop`), once the starved run said why


@pytest.mark.slow  # 16-19 s; `make test` stays under 15 minutes (run with -m slow)
async def test_a_run_left_no_slot_says_why_then_runs(temporal_env, moto_server, tmp_path):
    # Workers for rollout.replicas=1 on relay.relays=1: 1 slot + 1 spare = 2 slots. Run "q" asks 2 with rollout.quota=2:
    # its floor is both slots. Run "w" asks 1 and is granted 0 (floors 2 + 0 fit in 2 slots; level 0 leaves nothing):
    # `laminar status` says so at once, the watchdog names it after run.stall_warn_s, and once "q" is stopped and
    # leaves, "w" is granted its slot and finishes. Neither loses a group or consumes one twice.
    namespace = await _namespace(temporal_env.client)
    bucket = create_bucket(moto_server)
    env = {**os.environ, "LAMINAR_HOME": str(tmp_path / "home"),
           "LAMINAR_TEMPORAL_ADDRESS": temporal_address(temporal_env.client), "LAMINAR_NAMESPACE": namespace,
           "LAMINAR_STORE": f"s3://{bucket}", "LAMINAR_S3_ENDPOINT": moto_server, "LAMINAR_LOG_LEVEL": "info"}
    overrides = [f"--{o}" for o in TEST_OVERRIDES if not o.startswith("run.steps")] + ["--relay.relays=1"]
    client = await Client.connect(temporal_address(temporal_env.client), namespace=namespace,
                                  data_converter=DATA_CONVERTER)
    log_path = tmp_path / "workers.log"
    with open(log_path, "wb") as log:
        workers = subprocess.Popen([*LAMINAR, "workers", "examples/tiny.toml", *overrides, "--rollout.replicas=1"],
                                   env=env, stdout=log, stderr=subprocess.STDOUT)

    def start(run_id: str, *extra: str) -> None:
        done = subprocess.run([*LAMINAR, "start", "examples/tiny.toml", "--run-id", run_id, *overrides, *extra],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr

    def status(run_id: str) -> dict:
        done = subprocess.run([*LAMINAR, "status", run_id, "--json"], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout)

    try:
        await _pool_reports(client, 2)
        q, w = (f"t-quota-{uuid.uuid4().hex[:6]}-{k}" for k in "qw")
        await asyncio.to_thread(start, q, "--steps", str(Q_STEPS), "--rollout.replicas=2", "--rollout.quota=2")
        hq = client.get_workflow_handle(workflow_id_for(q), result_type=RunStatus)

        async def q_granted() -> bool:
            return (await hq.query(contract.STATUS, result_type=RunStatus)).replicas_granted == 2
        await async_wait_until(q_granted, 120, f"{q} granted 2", interval_s=0.5)
        await asyncio.to_thread(start, w, "--steps", "3", "--rollout.replicas=1", f"--run.stall_warn_s={STARVED_WARN_S}")
        note = "granted 0 of 1 asked: 2 runs share 2 slots, 2 held by other runs' quotas"

        def starved() -> dict | None:
            st = status(w)
            assert st["phase"] in ("starting", "running"), f"{w} is {st['phase']} before its watchdog line showed"
            return st if st["watchdog"] and st["phase"] == "running" else None
        st = await async_wait_until(lambda: asyncio.to_thread(starved), 180, f"{w}'s watchdog line", interval_s=1.0)
        print("starved status", json.dumps({k: st[k] for k in ("replicas_granted", "grant_note", "watchdog")}))
        assert st["replicas_granted"] == 0 and st["grant_note"] == note and st["replicas_running"] == 0, st
        assert st["watchdog"].startswith("waits for replicas: no step for ") and st["watchdog"].endswith(note), st
        shown = subprocess.run([*LAMINAR, "pool", "--json"], env=env, capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        pool = json.loads(shown.stdout)
        assert pool["slots"] == 2 and [(r["run_id"], r["asked"], r["quota"], r["granted"]) for r in pool["runs"]] == [
            (q, 2, 2, 2), (w, 1, 0, 0)], pool
        stopped = subprocess.run([*LAMINAR, "stop", q], env=env, capture_output=True, text=True, timeout=60)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        finals = await asyncio.wait_for(asyncio.gather(
            hq.result(rpc_timeout=None),
            client.get_workflow_handle(workflow_id_for(w), result_type=RunStatus).result(rpc_timeout=None)), 600)
        for final in finals:
            assert final.phase == "finished", (final.run_id, final.phase)
            assert final.groups_consumed_twice == 0 and final.groups_generated == final.groups_consumed + final.ready_groups
        assert finals[1].step == finals[1].total_steps, finals[1].step  # "w" ran all its steps once it had a slot
        assert "stall/replicas" in finals[1].event_times, finals[1].event_times.keys()  # the run event, too
    finally:
        stop_process(workers, timeout_s=60)
        print(log_path.read_text(errors="replace")[-2000:])


def test_trainer_republishes_a_run_it_has_moved_away_from(tmp_path):
    # One trainer process serves several runs in turn. After a step of run "s", run "r"'s version is gone from a
    # relay (a new one here): the republish pushes the version the trainer kept for "r" (it used to skip, -1).
    from dataclasses import replace

    from laminar.contract import RepublishInput
    from laminar.relay import client as relay_client
    from laminar.relay.server import RelayServer
    from laminar.services.trainer import TrainerService
    from laminar.storage.objects import LocalObjectStore
    from laminar.storage.trajectories import TrajectoryStore
    from tests.test_modelled import _batch, _input

    store = LocalObjectStore(tmp_path / "store")
    trajs = TrajectoryStore(store)
    (tmp_path / "shm").mkdir()
    old, new = RelayServer("host-0", shm_dir=str(tmp_path / "shm")), RelayServer("host-1", shm_dir=str(tmp_path / "shm"))
    old_addr, new_addr = old.start(), new.start()
    try:
        svc = TrainerService(store, tmp_path / "home")
        svc.train_step(_input(0, _batch(trajs, 0), [old_addr]))  # run r: step 1, version 1
        svc.train_step(replace(_input(0, _batch(trajs, 10), [old_addr]), run_id="s"))  # run s from scratch: step 1
        assert svc.run_id == "s"
        # both runs' version 1 side by side on the relay that took the pushes
        assert relay_client.latest_version(old_addr, run="r") == 1 and relay_client.latest_version(old_addr, run="s") == 1
        assert relay_client.fetch_latest(new_addr, run="r") == (None, None)
        assert svc.republish(RepublishInput(run_id="r", step=1, relay_chain=[new_addr])) == 1
        assert relay_client.fetch_latest(new_addr, run="r")[1] == relay_client.fetch_latest(old_addr, run="r")[1]
        assert svc.republish(RepublishInput(run_id="r", step=2, relay_chain=[new_addr])) == -1  # not at that step
        assert svc.republish(RepublishInput(run_id="t", step=1, relay_chain=[new_addr])) == -1  # never published
    finally:
        old.stop()
        new.stop()


def test_replica_reports_its_version_missing_only_when_no_relay_holds_one(tmp_path):
    # A replica that needs weights (none loaded) and whose poll reaches a relay holding nothing of its run reports
    # version_missing; once a relay holds a version of its run (another run's do not count), it does not.
    from laminar import metrics as prom
    from laminar.contract import RelayInfo
    from laminar.policy import policy_for
    from laminar.relay import client as relay_client
    from laminar.relay.server import RelayServer
    from laminar.rl.modelled import ModelledEngine
    from laminar.services.rollout.batch import Counters
    from laminar.services.rollout.weights import Weights
    from tests.test_modelled import SERVICE_CFG

    (tmp_path / "shm").mkdir()
    relays = [RelayServer(f"host-{i}", shm_dir=str(tmp_path / "shm")) for i in range(2)]
    addrs = [r.start() for r in relays]
    try:
        engine = ModelledEngine(SERVICE_CFG, max_inflight_seqs=4, global_sync=False, sleep=lambda s: None)
        weights = Weights(engine, policy_for(SERVICE_CFG), "r", "replica-0", "host-0", None, Counters(),
                          prom.ReplicaMetrics.of("replica-0"))
        weights.relays = [RelayInfo(f"host-{i}", f"host-{i}", a) for i, a in enumerate(addrs)]
        assert not weights.version_missing()  # never polled: nothing known yet
        relay_client.push(addrs[0], 0, b"\0" * 64, chain=[], run="other")  # another run's version 0
        weights.poll()
        assert weights.none_held and weights.version_missing()
        relay_client.push(addrs[1], 0, b"\0" * 64, chain=[], run="r")  # on the second relay only
        weights.poll()
        assert weights.newest_at_relay == 0 and not weights.version_missing()
    finally:
        for r in relays:
            r.stop()
