"""Eval rounds (workflows/eval_rounds.py): pinned to one version, each prompt scored once, nothing lost when a
replica dies, the same prompts with or without faults. Property tests drive random leases, deaths and duplicate
reports against the no-fault result."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from laminar.evalstats import PromptResult
from laminar.workflows.eval_rounds import EvalRounds, due_versions


def _result(p: int) -> PromptResult:
    return PromptResult(id=str(p), rewards=[float(p % 2)], lengths=[4])


def test_due_versions_worked_examples():
    assert due_versions(25, 10, True, True) == [0, 10, 20, 25]
    assert due_versions(20, 10, False, True) == [10, 20]
    assert due_versions(5, 0, True, False) == [0]
    assert due_versions(5, 0, False, False) == []


def test_leases_are_pinned_to_the_round_version():
    rounds = EvalRounds(prompts=4, samples=1)
    rounds.open(10, now=0.0)
    assert rounds.lease("r0", room=8, version_held=11) == [], "a replica at another version gets none"
    assert rounds.lease("r0", room=3, version_held=10) == [(10, 0), (10, 1), (10, 2)]
    assert rounds.lease("r1", room=3, version_held=10) == [(10, 3)]
    assert rounds.lease("r1", room=3, version_held=10) == [], "every prompt is out"


def test_a_dead_replica_leases_go_back_first_and_late_reports_are_ignored():
    rounds = EvalRounds(prompts=4, samples=1)
    rounds.open(0, now=0.0)
    rounds.lease("r0", room=2, version_held=0)  # prompts 0, 1
    rounds.lease("r1", room=2, version_held=0)  # prompts 2, 3
    assert rounds.report(0, 2, _result(2), now=1.0)
    assert rounds.release("r1") == 1  # prompt 3 was still out
    assert rounds.lease("r0", room=4, version_held=0) == [(0, 3)]
    assert rounds.report(0, 3, _result(3), now=2.0)
    assert not rounds.report(0, 3, _result(3), now=2.5), "the dead replica's late report of 3 is a duplicate"
    assert rounds.pending() == {0: 2}
    for p in (0, 1):
        assert rounds.report(0, p, _result(p), now=3.0)
    s = rounds.summary(0)
    assert s is not None and s.prompts == 4 and s.accuracy == 0.5  # prompts 1 and 3 pass
    assert rounds.rounds[0].duplicates == 1 and rounds.rounds[0].closed_at == 3.0 and rounds.pending() == {}


def _play(ops: list[tuple[str, int, int]], prompts: int) -> EvalRounds:
    """Replicas r0..r2 at version 5 lease, report (sometimes twice) and die; then the survivors report what they
    hold and a fresh replica leases and scores the rest."""
    rounds = EvalRounds(prompts=prompts, samples=1)
    rounds.open(5, now=0.0)
    held: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    for op, replica, n in ops:
        rid = f"r{replica}"
        if op == "lease":
            held[rid] += [p for _, p in rounds.lease(rid, room=n, version_held=5)]
        elif op == "report" and held[rid]:
            p = held[rid].pop(0)
            rounds.report(5, p, _result(p), now=1.0)
            if n % 2:
                rounds.report(5, p, _result(p), now=1.0)  # a retried report
        elif op == "die":
            rounds.release(rid)  # its in-flight prompts are lost with it (a late report may still come)
            late = held[rid][:1]
            held[rid] = []
            for p in late:
                rounds.report(5, p, _result(p), now=1.0)
    for prompts_held in held.values():  # the survivors finish what they hold
        for p in prompts_held:
            rounds.report(5, p, _result(p), now=1.5)
    for _ in range(3):  # a fresh replica drains the rest (one pass must do; the bound catches a leak)
        for _, p in rounds.lease("r9", room=prompts, version_held=5):
            rounds.report(5, p, _result(p), now=2.0)
    return rounds


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["lease", "report", "die"]), st.integers(0, 2), st.integers(1, 4)),
                max_size=60), st.integers(1, 12))
def test_every_prompt_scored_once_and_the_same_set_as_without_faults(ops, prompts):
    with_faults = _play(ops, prompts)
    without = _play([], prompts)
    rnd = with_faults.rounds[5]
    assert sorted(rnd.results) == list(range(prompts)) == sorted(without.rounds[5].results)
    assert with_faults.summary(5) == without.summary(5)
    assert not rnd.leases and rnd.closed_at is not None
