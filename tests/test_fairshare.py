"""workflows/fairshare.py: worked examples, then the allocator's rules as properties over random pools."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar.workflows.fairshare import Ask, allocate


def _granted(slots: int, asks: list[Ask], engines=None) -> dict[str, int]:
    return {r: g.granted for r, g in allocate(slots, asks, engines).items()}


def test_three_runs_asking_two_share_four_slots():
    # level L=1 costs 3 slots, L=2 would cost 6 > 4: each gets 1, the one left goes to the oldest run (seq 0)
    asks = [Ask("b", 2, seq=1), Ask("a", 2, seq=0), Ask("c", 2, seq=2)]
    grants = allocate(4, asks)
    assert {r: g.granted for r, g in grants.items()} == {"a": 2, "b": 1, "c": 1}
    assert grants["a"].note == ""
    assert grants["b"].note == "granted 1 of 2 asked: 3 runs share 4 slots"


def test_a_small_ask_leaves_its_share_to_the_others():
    # 10 slots, asks 1, 8, 8: L=4 costs 1+4+4=9, L=5 costs 11: 1, 4(+1 to the older), 4
    assert _granted(10, [Ask("x", 1, seq=0), Ask("y", 8, seq=1), Ask("z", 8, seq=2)]) == {"x": 1, "y": 5, "z": 4}


def test_a_finished_run_leaves_its_slots_to_the_others():
    # the run that had 2 of 4 leaves: the two runs that had 1 each now get their ask of 2
    assert _granted(4, [Ask("b", 2, seq=1), Ask("c", 2, seq=2)]) == {"b": 2, "c": 2}


def test_a_quota_is_a_floor_then_fair_share_above_it():
    # 8 slots; "q" has quota 5 of ask 6; "a" and "b" ask 4. Floors 5,0,0 -> 3 left at level L=1 (5,1,1 = 7),
    # L=2 would be 5,2,2 = 9 > 8: the one left goes to the oldest run still at the level ("a", seq 1)
    grants = allocate(8, [Ask("q", 6, quota=5, seq=0), Ask("a", 4, seq=1), Ask("b", 4, seq=2)])
    assert {r: g.granted for r, g in grants.items()} == {"q": 5, "a": 2, "b": 1}
    assert grants["q"].note == "granted 5 of 6 asked: 3 runs share 8 slots (quota 5 met)"


def test_a_quota_can_leave_another_run_nothing_and_it_says_so():
    # 2 slots; "q" asks 2 with quota 2 (floor 2), "b" asks 1: floors fill the pool, "b" waits
    grants = allocate(2, [Ask("q", 2, quota=2, seq=0), Ask("b", 1, seq=1)])
    assert (grants["q"].granted, grants["b"].granted) == (2, 0)
    assert grants["b"].note == "granted 0 of 1 asked: 2 runs share 2 slots, 2 held by other runs' quotas"


def test_a_quota_below_the_fair_share_changes_nothing():
    assert _granted(6, [Ask("q", 4, quota=1, seq=0), Ask("a", 4, seq=1)]) == {"q": 3, "a": 3}


def test_overcommitted_quotas_are_shared_fairly_as_floors():
    # quotas 3 + 3 = 6 > 4 slots: the floors become 2 and 2, nothing is left above them
    grants = allocate(4, [Ask("p", 3, quota=3, seq=0), Ask("q", 3, quota=3, seq=1), Ask("r", 2, seq=2)])
    assert {r: g.granted for r, g in grants.items()} == {"p": 2, "q": 2, "r": 0}
    assert grants["r"].note == "granted 0 of 2 asked: 3 runs share 4 slots and their quotas (6) exceed them"


def test_more_runs_than_slots_the_newest_wait_and_say_why():
    grants = allocate(2, [Ask(f"r{i}", 1, seq=i) for i in range(3)])
    assert [grants[f"r{i}"].granted for i in range(3)] == [1, 1, 0]
    assert grants["r2"].note == "granted 0 of 1 asked: 3 runs share 2 slots"


def test_no_slots_reported():
    assert allocate(0, [Ask("a", 2)])["a"].note == (
        "granted 0 of 2 asked: the pool has no rollout slots (no `laminar workers` reported any)")


def test_slots_unknown_every_run_gets_its_ask():
    # no worker set reported (workers started one by one): the pool does not limit, as before it existed
    grants = allocate(None, [Ask("a", 2, seq=0), Ask("b", 3, seq=1)], frozenset({"torch"}))
    assert {r: (g.granted, g.note) for r, g in grants.items()} == {"a": (2, ""), "b": (3, "")}


def test_a_run_whose_engine_no_worker_serves_gets_nothing():
    grants = allocate(4, [Ask("v", 1, engine="vllm", seq=0), Ask("t", 2, engine="torch", seq=1)],
                      frozenset({"torch", "modelled"}))
    assert grants["v"].granted == 0 and grants["t"].granted == 2
    assert grants["v"].note == ("granted 0 of 1 asked: no worker in this pool serves rollout.engine='vllm' "
                                "(served: modelled, torch)")


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="slots=-1"):
        allocate(-1, [])
    with pytest.raises(ValueError, match="replicas=-2"):
        allocate(1, [Ask("a", -2)])
    with pytest.raises(ValueError, match="asks twice"):
        allocate(1, [Ask("a", 1), Ask("a", 2)])


_asks = st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), min_size=0, max_size=8).map(
    lambda xs: [Ask(f"run-{i}", r, quota=min(q, r), seq=i) for i, (r, q) in enumerate(xs)])


@settings(max_examples=400, deadline=None)
@given(slots=st.integers(0, 40), asks=_asks, data=st.data())
def test_properties(slots, asks, data):
    grants = _granted(slots, asks)
    g = [grants[a.run_id] for a in asks]
    assert sum(g) <= slots
    assert all(0 <= x <= a.replicas for x, a in zip(g, asks, strict=True))  # never above the ask
    floors = [min(a.replicas, a.quota) for a in asks]
    if sum(floors) <= slots:
        assert all(x >= f for x, f in zip(g, floors, strict=True))  # quotas respected when they fit
        if not any(floors):  # no quotas: nobody below min(ask, fair share)
            share = slots // len(asks) if asks else 0
            assert all(x >= min(a.replicas, share) for x, a in zip(g, asks, strict=True))
    if any(x < a.replicas for x, a in zip(g, asks, strict=True)):
        assert sum(g) == slots  # work-conserving: no slot idle while a run is short
    # max-min: a run short of its ask is never two below a run that holds more than its floor
    for x, a in zip(g, asks, strict=True):
        if x < a.replicas:
            assert all(y <= max(x + 1, f) for y, f in zip(g, floors, strict=True))
    # the order asks come in changes nothing
    shuffled = data.draw(st.permutations(asks))
    assert _granted(slots, list(shuffled)) == grants


def test_the_watchdog_names_the_grant_of_a_stalled_run():
    # a pooled run granted 0 of 1, trainer ready, no step for 6 s with run.stall_warn_s=3: it waits for replicas, and
    # the reason is the pool's; the same run with its grant met and replicas silent gets the plain "replicas" reason
    from laminar.watchdog import Facts, diagnose

    note = "granted 0 of 1 asked: 2 runs share 2 slots, 2 held by other runs' quotas"
    f = Facts(phase="running", idle_s=6.0, stall_warn_s=3.0, replicas_wanted=1, replicas_granted=0, grant_note=note)
    assert diagnose(f) == ("replicas", f"no step for 6s: {note}")
    assert diagnose(Facts(phase="running", idle_s=2.0, stall_warn_s=3.0, replicas_wanted=1, replicas_granted=0,
                          grant_note=note)) is None  # not stalled yet: `laminar status` shows the note row only
    met = Facts(phase="running", idle_s=6.0, stall_warn_s=3.0, replicas_wanted=1, replicas_granted=1)
    assert diagnose(met)[1].startswith("no step for 6s: 0 of 1 replicas reported")


def test_status_shows_asked_granted_running_and_why():
    from dataclasses import replace

    from laminar.client.run_control import _grant_rows
    from laminar.contract import RunStatus

    base = RunStatus(run_id="r", phase="running", step=0, total_steps=3, policy_version=0, ready_groups=0,
                     open_leases=0, groups_generated=0, groups_consumed=0, groups_consumed_twice=0, tokens_consumed=0,
                     reward_recent=[], versions_in_use=[], max_versions_in_use=0, staleness_histogram={},
                     trainer_wait_fraction=0.0, history_events=0, history_events_max=0, continued_as_new=0,
                     checkpoints=[], relays=[], replicas=[], started_at=0.0)
    assert _grant_rows(base) == {}  # a run that owns its workers: no pool rows
    short = replace(base, replicas_target=2, replicas_granted=1, replicas_running=1,
                    grant_note="granted 1 of 2 asked: 3 runs share 4 slots")
    assert _grant_rows(short) == {"replicas (asked/granted/running)": "2/1/1",
                                  "slot pool": "granted 1 of 2 asked: 3 runs share 4 slots"}
