"""The pure scaling decisions: which replicas start and which leave (workflows/scale.py), and the rollout worker
slots the local launcher adds for them (workers/launcher.py)."""

import pytest

from laminar.client.settings import Settings
from laminar.config import RunConfig
from laminar.workers.launcher import LocalLauncher, plan_processes, rollout_slots, slots_to_add
from laminar.workflows.scale import check_target, plan_scale, replica_ids


def test_grow_takes_the_lowest_free_ids():
    # 2 -> 6: replica-0 and replica-1 run, so the new ones are replica-2..replica-5
    plan = plan_scale(replica_ids(2), [], {}, 6)
    assert plan.start == ["replica-2", "replica-3", "replica-4", "replica-5"]
    assert plan.remove == []
    assert plan.active == replica_ids(6)


def test_grow_skips_ids_still_leaving():
    # replica-1 was removed and has not returned: its activity id is still in use, so 1 -> 3 starts 2 and 3
    plan = plan_scale(["replica-0"], ["replica-1"], {}, 3)
    assert plan.start == ["replica-2", "replica-3"]
    assert plan.active == ["replica-0", "replica-2", "replica-3"]


def test_shrink_removes_the_least_loaded_then_the_highest_index():
    # 6 -> 2: held leases 0:5 1:0 2:3 3:0 4:1 5:0. Fewest first: 1,3,5 hold 0 (highest index first: 5,3,1),
    # then 4 (1 lease); 4 removals = {5, 3, 1, 4}; 0 (5 leases) and 2 (3 leases) stay.
    held = {"replica-0": 5, "replica-1": 0, "replica-2": 3, "replica-3": 0, "replica-4": 1, "replica-5": 0}
    plan = plan_scale(replica_ids(6), [], held, 2)
    assert plan.remove == ["replica-1", "replica-3", "replica-4", "replica-5"]
    assert plan.keep == ["replica-0", "replica-2"]
    assert plan.start == []


def test_shrink_with_equal_load_returns_to_the_first_ids():
    # 4 -> 2 with every replica holding 2 leases: ties go to the highest index, so 3 and 2 leave
    plan = plan_scale(replica_ids(4), [], {r: 2 for r in replica_ids(4)}, 2)
    assert plan.remove == ["replica-2", "replica-3"]
    assert plan.active == ["replica-0", "replica-1"]


def test_same_count_is_an_empty_plan():
    plan = plan_scale(replica_ids(3), [], {}, 3)
    assert plan.start == [] and plan.remove == [] and plan.active == replica_ids(3)


@pytest.mark.parametrize("bad", [0, -1, 1025])
def test_target_out_of_range_is_refused_with_the_fix(bad):
    with pytest.raises(ValueError, match=f"replicas={bad} must be between 1 and 1024"):
        check_target(bad)


# -- the local launcher's side: rollout worker slots for the target (workers/launcher.py) ----------------------


def test_rollout_slots_per_host():
    # 5 replicas on 2 hosts, 1 spare: shares 3 (5 // 2 + the remainder) and 2, each + 1 spare -> [4, 3]
    assert rollout_slots(5, 2, 1) == [4, 3]
    # 1 replica on 2 hosts: host-1 has no share, so no worker (and no spare) there
    assert rollout_slots(1, 2, 1) == [2, 0]


def test_slots_to_add_when_scaling_2_to_6_and_back():
    # `laminar run` laid out 2 replicas on 2 hosts with 1 spare each: [2, 2]. 6 replicas want [3 + 1, 3 + 1]:
    # add 2 slots per host. Back to 2: nothing to add, and nothing is taken away (never negative).
    assert slots_to_add(6, 2, 1, [2, 2]) == [2, 2]
    assert slots_to_add(2, 2, 1, [4, 4]) == [0, 0]


def test_match_replicas_starts_a_rollout_worker_per_short_host(tmp_path):
    cfg = RunConfig.load(None, ["relay.relays=2", "rollout.replicas=2"])
    settings = Settings.from_env({"LAMINAR_HOME": str(tmp_path)})
    launcher = LocalLauncher(plan_processes(cfg, settings, tmp_path / "logs", spare_slots=1))
    try:
        # 2 -> 6 replicas: each host's worker has 2 slots and needs 4 (see above): one more worker of 2 slots each
        started = launcher.match_replicas(6, 2, 1)
        assert started == ["rollout-host-0-1", "rollout-host-1-1"]
        for i, name in enumerate(started):
            p = launcher.processes[name]
            assert p.argv[-3:] == ["rollout", "--slots", "2"] and p.env["LAMINAR_HOST_ID"] == f"host-{i}"
            assert p.pid is not None
        assert launcher.match_replicas(6, 2, 1) == []  # the slots are there now
        assert launcher.match_replicas(2, 2, 1) == []  # a scale-down stops nothing
    finally:
        launcher.stop_all(timeout_s=5)
    assert all(p.proc is None or p.proc.poll() is not None for p in launcher.processes.values())

def test_a_host_without_a_rollout_worker_gets_one_with_its_spare(tmp_path):
    # 1 replica on 2 hosts: host-0 has 1 + 1 spare, host-1 none; 2 replicas: host-1's first worker, its spare named
    cfg = RunConfig.load(None, ["relay.relays=2", "rollout.replicas=1"])
    settings = Settings.from_env({"LAMINAR_HOME": str(tmp_path)})
    launcher = LocalLauncher(plan_processes(cfg, settings, tmp_path / "logs", spare_slots=1))
    try:
        assert launcher.match_replicas(2, 2, 1) == ["rollout-host-1-1"]
        assert launcher.processes["rollout-host-1-1"].argv[-5:] == ["rollout", "--slots", "2", "--spare", "1"]
    finally:
        launcher.stop_all(timeout_s=5)

