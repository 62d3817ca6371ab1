"""The pure scaling decision (workflows/scale.py): which replicas start, which leave."""

import pytest

from workflows.scale import check_target, plan_scale, replica_ids


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
