"""workflows/evaluation.py `Evaluation` without Temporal (a fake runtime and record command): rounds open for due
versions once published, claims carry results, holdings and eval leases, a replica's lost answer or death returns
its leases, each closed round is recorded once, and the training ledger is never touched."""

from __future__ import annotations

from laminar.config import RunConfig
from laminar.contract import ClaimPromptsInput, EvalLease, EvalReport, RecordEvalInput, ReplicaReport
from laminar.evalstats import PromptResult
from laminar.workflows.evaluation import Evaluation
from laminar.workflows.state import RunState
from tests.fixtures.fake_runtime import FakeRuntime

N = 5


def claim(replica: str, version: int, room: int = 0, holding=(), results=(), unloadable=()) -> ClaimPromptsInput:
    report = ReplicaReport(replica_id=replica, host_id="h", policy_version=version, in_flight=0, kv_used=0,
                           kv_capacity=1)
    return ClaimPromptsInput(report=report, max_groups=0, eval_set=N, eval_room=room, eval_holding=list(holding),
                             eval_results=list(results), eval_unloadable=list(unloadable))


def scored(leases: list[EvalLease], reward: float = 1.0) -> list[EvalReport]:
    return [EvalReport(x.policy_version, x.index, PromptResult(id=str(x.index), rewards=[reward], lengths=[3]))
            for x in leases]


async def test_rounds_lease_pinned_record_once_and_release_on_death():
    cfg = RunConfig.load(None, ["run.steps=4", "eval.at_start=true", "eval.at_end=true"])
    state, rt, recorded = RunState(run_id="r"), FakeRuntime(), []

    async def record(inp: RecordEvalInput) -> bool:
        recorded.append(inp)
        return True

    ev = Evaluation(state, cfg, rt, record)
    assert ev.due == [0, 4] and ev.wanted()
    assert ev.on_claim(claim("a", 0, room=3), True) == [], "off until the run turns it on (patch eval-rounds)"
    ev.on = True
    a = ev.on_claim(claim("a", 0, room=3), True)
    assert a == [EvalLease(0, 0), EvalLease(0, 1), EvalLease(0, 2)]
    # b's answer is lost: its next claim holds none of them, so they go back and are leased again first
    b = ev.on_claim(claim("b", 0, room=3), True)
    assert b == [EvalLease(0, 3), EvalLease(0, 4)]
    assert ev.on_claim(claim("b", 0, room=2), True) == [EvalLease(0, 3), EvalLease(0, 4)]
    # a dies (its retry's first claim holds nothing): its leases go to c
    assert ev.on_claim(claim("a", 0, room=0), True) == []
    c = ev.on_claim(claim("c", 0, room=5, results=scored(b)), True)
    assert sorted(c) == a and ev.pending() == {"0": 3}
    # a zombie's late result for a scored prompt is ignored (first kept)
    ev.on_claim(claim("b", 0, results=scored(b[:1], reward=0.0)), True)
    assert state.eval.rounds[0].duplicates == 1
    # the version 4 round does not exist before version 4 is published; a replica at version 0 gets nothing of it
    ev.on_claim(claim("c", 0, holding=c, results=scored(c)), True)
    await ev.settle()
    assert [r.policy_version for r in recorded] == [0] and len(recorded[0].results) == N
    assert all(r.rewards == [1.0] for r in recorded[0].results), "the first result of each prompt"
    assert state.eval_done[0].recorded and state.eval.rounds[0].results == {}, "results dropped once recorded"
    state.policy_version = 4
    assert ev.waiting_at_end()
    assert ev.on_claim(claim("b", 3, room=5, unloadable=[4]), True) == []
    d = ev.on_claim(claim("b", 4, room=5), True)
    assert [x.policy_version for x in d] == [4] * N
    ev.release("b")  # retired by `laminar scale`
    assert state.eval.rounds[4].released == list(range(N))
    ev.on_claim(claim("c", 4, room=5), False)
    ev.on_claim(claim("c", 4, results=scored(d)), True)
    await ev.finish()
    assert not ev.waiting_at_end() and [r.policy_version for r in recorded] == [0, 4]
    assert [(s.policy_version, s.recorded, s.summary.accuracy) for s in state.eval_done] == [(0, True, 1.0),
                                                                                          (4, True, 1.0)]
    # the training ledger never saw an eval prompt
    assert state.prompt_cursor == 0 and state.open_leases == {} and state.groups_generated == 0
