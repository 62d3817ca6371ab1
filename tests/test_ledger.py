"""Exactly-once accounting (docs/architecture/invariants.md) on the real Ledger over a real RunState: leases, the
experience index, consumed batches, checkpoint replay and the counters behind the status query."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from laminar.config import RunConfig
from laminar.contract import (
    BatchPart,
    FailedGroup,
    ReplicaReport,
    StepMetrics,
    TrainStepInput,
    TrainStepResult,
    retained_batches_bytes,
)
from laminar.refs import CheckpointRef, SegmentRef
from laminar.storage import keys
from laminar.storage.objects import sha256_hex
from laminar.workflows.ledger import Ledger
from laminar.workflows.state import RECENT_REWARDS, RunState
from tests.helpers import next_batch

RUN = "run-ledger"


def _seg(seq: str, group_ids: list[str], policy_version: int = 0, replica: str = "replica-0") -> SegmentRef:
    key = keys.experience_segment(RUN, replica, seq)
    return SegmentRef(key=key, sha256=sha256_hex(key.encode()), size=100 * len(group_ids), rows=8 * len(group_ids),
                      group_ids=list(group_ids), policy_version=policy_version, tokens=10 * len(group_ids))


def _ckpt(step: int) -> CheckpointRef:
    return CheckpointRef(run_id=RUN, step=step, manifest_key=keys.checkpoint_manifest(RUN, step),
                         manifest_sha256=sha256_hex(str(step).encode()), policy_version=step)


def _metrics(reward: float = 0.5, tokens: int = 0, staleness: dict[str, int] | None = None,
             consumed_twice: int = 0) -> StepMetrics:
    return StepMetrics(reward_mean=reward, loss=0.1, grad_norm=1.0, samples=8, tokens=tokens, response_len_mean=5.0,
                       staleness=staleness or {}, dropped_stale=0, clip_fraction=0.0, consumed_twice=consumed_twice)


def _input(ledger: Ledger, batch: list[BatchPart]) -> TrainStepInput:
    return TrainStepInput(run_id=RUN, config={}, step=ledger.state.step, batch=batch, checkpoint=ledger.state.checkpoint,
                          replay=list(ledger.state.uncommitted), relay_chain=[])


def _result(step: int, checkpoint: bool = False, **metrics: object) -> TrainStepResult:
    return TrainStepResult(step=step, policy_version=step, metrics=_metrics(**metrics),  # type: ignore[arg-type]
                           checkpoint=_ckpt(step) if checkpoint else None, steps_redone=0, publish_stall_s=0.0)


def _ids(parts: list[BatchPart]) -> list[str]:
    return [g for p in parts for g in p.group_ids]


def _ready_ids(ledger: Ledger) -> list[str]:
    return [g.group_id for g in ledger.state.ready]


# -- leases ---------------------------------------------------------------------------------------


def test_fresh_leases_have_sequential_ids_and_one_owner() -> None:
    ledger = Ledger(RunState(run_id=RUN))
    a = ledger.lease("replica-0", 2)
    b = ledger.lease("replica-1", 3)
    # prompt_cursor runs 0,1 for replica-0 then 2,3,4 for replica-1; group ids are g + 8-digit prompt id
    assert [(x.group_id, x.prompt_id) for x in a] == [("g00000000", 0), ("g00000001", 1)]
    assert [(x.group_id, x.prompt_id) for x in b] == [("g00000002", 2), ("g00000003", 3), ("g00000004", 4)]
    assert ledger.state.prompt_cursor == 5
    assert {g: lease.replica_id for g, lease in ledger.state.open_leases.items()} == {
        "g00000000": "replica-0", "g00000001": "replica-0",
        "g00000002": "replica-1", "g00000003": "replica-1", "g00000004": "replica-1",
    }
    assert ledger.lease("replica-0", 0) == []
    assert ledger.held_by("replica-0", ["g00000000", "g00000002", "g99999999"]) == ["g00000000"]


def test_released_leases_go_out_again_first_with_their_ids() -> None:
    ledger = Ledger(RunState(run_id=RUN))
    ledger.lease("replica-0", 3)  # g0, g1, g2
    ledger.lease("replica-1", 1)  # g3
    # replica-0 restarted and resumes g1 from its partial pool: g0 and g2 go back, oldest first
    assert ledger.release_leases_of("replica-0", keep={"g00000001"}) == ["g00000000", "g00000002"]
    assert ledger.held_by("replica-0", ["g00000000", "g00000001", "g00000002"]) == ["g00000001"]
    assert [x.group_id for x in ledger.state.returned] == ["g00000000", "g00000002"]
    # the next claimant gets the two returned groups (same prompt ids) before one fresh prompt (id 4)
    leases = ledger.lease("replica-1", 3)
    assert [(x.group_id, x.prompt_id) for x in leases] == [("g00000000", 0), ("g00000002", 2), ("g00000004", 4)]
    assert ledger.state.returned == []
    assert ledger.state.open_leases["g00000000"].replica_id == "replica-1"
    assert ledger.state.open_leases["g00000001"].replica_id == "replica-0"
    # releasing a replica that holds nothing releases nothing
    assert ledger.release_leases_of("replica-7", keep=set()) == []


def test_duplicate_reports_are_counted_not_readded() -> None:
    ledger = Ledger(RunState(run_id=RUN))
    ledger.lease("replica-0", 3)
    seg = _seg("0", ["g00000000", "g00000001"])
    assert ledger.add_segment(seg) == (["g00000000", "g00000001"], [])
    # a retried report of the same segment: both already in ready
    assert ledger.add_segment(seg) == ([], ["g00000000", "g00000001"])
    # a report naming one new and one known group, plus a group never leased
    mixed = _seg("1", ["g00000001", "g00000002", "g00000099"])
    assert ledger.add_segment(mixed) == (["g00000002"], ["g00000001", "g00000099"])
    assert _ready_ids(ledger) == ["g00000000", "g00000001", "g00000002"]
    assert ledger.state.groups_generated == 3  # 2 + 0 + 1
    assert ledger.state.duplicate_reports == 4  # 0 + 2 + 2
    assert ledger.state.open_leases == {}
    # a segment with no accepted group is not indexed
    assert ledger.add_segment(_seg("2", ["g00000000"])) == ([], ["g00000000"])
    assert set(ledger.state.segments) == {seg.key, mixed.key}
    # a group repeated inside one segment enters ready once
    ledger.lease("replica-0", 1)  # g3
    assert ledger.add_segment(_seg("3", ["g00000003", "g00000003"])) == (["g00000003"], ["g00000003"])
    assert _ready_ids(ledger).count("g00000003") == 1


def test_zombie_completion_of_a_returned_group_is_accepted_once() -> None:
    ledger = Ledger(RunState(run_id=RUN))
    ledger.lease("replica-0", 3)  # g0 g1 g2
    ledger.release_leases_of("replica-0", keep=set())  # replica-0 thought lost: all three returned
    # the old process finishes g1 after all: accepted, and g1 leaves the returned pool
    assert ledger.add_segment(_seg("0", ["g00000001"])) == (["g00000001"], [])
    assert [x.group_id for x in ledger.state.returned] == ["g00000000", "g00000002"]
    # its retry of the same report is a duplicate
    assert ledger.add_segment(_seg("0", ["g00000001"])) == ([], ["g00000001"])
    # the next claimant is not handed g1 again: g0, g2, then fresh g3
    assert [x.group_id for x in ledger.lease("replica-1", 3)] == ["g00000000", "g00000002", "g00000003"]
    assert ledger.state.groups_generated == 1
    assert ledger.state.duplicate_reports == 1


def test_zombie_completion_of_a_reassigned_group_wins_once() -> None:
    ledger = Ledger(RunState(run_id=RUN))
    ledger.lease("replica-0", 1)  # g0
    ledger.release_leases_of("replica-0", keep=set())
    ledger.lease("replica-1", 1)  # g0 again, now held by replica-1
    # the zombie reports first: accepted, replica-1's lease is closed; replica-1's later report is a duplicate
    assert ledger.add_segment(_seg("0", ["g00000000"], replica="replica-0")) == (["g00000000"], [])
    assert ledger.held_by("replica-1", ["g00000000"]) == []
    assert ledger.add_segment(_seg("0", ["g00000000"], replica="replica-1")) == ([], ["g00000000"])
    assert _ready_ids(ledger) == ["g00000000"]
    # the ready entry points at the zombie's segment, the one indexed
    assert ledger.state.ready[0].segment_key == keys.experience_segment(RUN, "replica-0", "0")


# -- trainer --------------------------------------------------------------------------------------


def test_next_batch_takes_oldest_in_arrival_order_grouped_by_segment() -> None:
    ledger = Ledger(RunState(run_id=RUN))
    ledger.lease("replica-0", 6)
    a = _seg("a", ["g00000002", "g00000000"], policy_version=1)  # arrival order within a segment is kept
    b = _seg("b", ["g00000001"], policy_version=2, replica="replica-1")
    c = _seg("c", ["g00000003", "g00000004", "g00000005"], policy_version=2)
    for s in (a, b, c):
        ledger.add_segment(s)
    # 4 oldest: a's two, b's one, then the first of c
    batch = next_batch(ledger, 4)
    assert [(p.segment.key, p.group_ids) for p in batch] == [
        (a.key, ["g00000002", "g00000000"]), (b.key, ["g00000001"]), (c.key, ["g00000003"]),
    ]
    assert batch[0].segment == a and batch[2].segment == c
    # next_batch (tests/helpers.py) only looks: nothing leaves ready until commit_step
    assert len(ledger.state.ready) == 6
    # asking for more than is ready returns what there is
    assert _ids(next_batch(ledger, 10)) == ["g00000002", "g00000000", "g00000001", "g00000003", "g00000004",
                                           "g00000005"]
    assert next_batch(ledger, 0) == []


def test_commit_step_consumes_exactly_the_batch_and_prunes_segments() -> None:
    ledger = Ledger(RunState(run_id=RUN))
    ledger.lease("replica-0", 5)
    a = _seg("a", ["g00000000", "g00000001"])
    b = _seg("b", ["g00000002", "g00000003"])
    ledger.add_segment(a)
    ledger.add_segment(b)
    inp = _input(ledger, next_batch(ledger, 3))  # a: g0 g1, b: g2
    # a group that arrives while the step runs is not consumed by it
    ledger.add_segment(_seg("c", ["g00000004"]))
    ledger.commit_step(inp, _result(1, tokens=300, staleness={"0": 6, "1": 2}), keep_last=3)
    assert _ready_ids(ledger) == ["g00000003", "g00000004"]
    # a is fully consumed -> pruned; b still has g3; c has g4
    assert set(ledger.state.segments) == {b.key, keys.experience_segment(RUN, "replica-0", "c")}
    assert ledger.state.step == 1 and ledger.state.policy_version == 1
    assert ledger.state.uncommitted == [inp.batch]
    assert ledger.state.checkpoint is None
    assert ledger.state.groups_consumed == 3
    assert ledger.state.tokens_consumed == 300
    # the replayed batch still carries a's ref after a left the index
    assert ledger.state.uncommitted[0][0].segment == a


def test_commit_step_counters_staleness_and_checkpoint_window() -> None:
    ledger = Ledger(RunState(run_id=RUN))
    ledger.lease("replica-0", 8)
    ledger.add_segment(_seg("0", [f"g{i:08d}" for i in range(8)]))
    rewards = []
    for step in range(1, 5):
        inp = _input(ledger, next_batch(ledger, 2))
        staleness = {"0": 4, "1": 4} if step % 2 else {"2": 1, "10": 7}
        ledger.commit_step(inp, _result(step, checkpoint=True, reward=step / 10, tokens=50, staleness=staleness,
                                        consumed_twice=0), keep_last=2)
        rewards.append(step / 10)
    # 4 steps x 2 groups; tokens 4 x 50
    assert ledger.state.groups_consumed == 8 and ledger.state.tokens_consumed == 200
    assert ledger.state.ready == [] and ledger.state.segments == {}
    # checkpoints at 1,2,3,4 with keep_last=2 -> the last two
    assert [c.step for c in ledger.state.checkpoints] == [3, 4]
    assert ledger.state.checkpoint == _ckpt(4)
    assert ledger.state.uncommitted == []
    # steps 1,3 add {"0": 4, "1": 4} each, steps 2,4 add {"2": 1, "10": 7} each (string keys throughout)
    assert ledger.state.staleness_histogram == {"0": 8, "1": 8, "2": 2, "10": 14}
    assert ledger.state.reward_recent == rewards
    # the status orders the histogram numerically: "10" after "2"
    assert list(ledger.status("running", 4, 0).staleness_histogram) == ["0", "1", "2", "10"]


def test_reward_window_is_bounded() -> None:
    ledger = Ledger(RunState(run_id=RUN))
    for step in range(1, RECENT_REWARDS + 6):
        ledger.commit_step(_input(ledger, []), _result(step, reward=float(step)), keep_last=3)
    # RECENT_REWARDS + 5 steps with reward == step: the window holds steps 6 .. RECENT_REWARDS + 5
    assert ledger.state.reward_recent == [float(s) for s in range(6, RECENT_REWARDS + 6)]


def test_consumed_twice_is_summed_from_the_trainer() -> None:
    ledger = Ledger(RunState(run_id=RUN))
    ledger.commit_step(_input(ledger, []), _result(1, consumed_twice=2), keep_last=3)
    ledger.commit_step(_input(ledger, []), _result(2, consumed_twice=1), keep_last=3)
    assert ledger.state.groups_consumed_twice == 3  # 2 + 1


def test_stream_minibatches_already_complete_go_to_the_trainer_together_up_to_the_publish() -> None:
    from laminar.policy import policy_for, steps_to_publish

    # stream, B = 4 groups per batch in 2 minibatches of 2; version 1 is published after step 2 (batch 0 done)
    cfg = RunConfig.load(None, ["run.mode=stream", "trainer.groups_per_step=4", "trainer.minibatches=2",
                                "rollout.max_ready_groups=8", "trainer.checkpoint_every=1"])
    policy = policy_for(cfg)
    assert [steps_to_publish(policy, s) for s in range(5)] == [2, 1, 2, 1, 2]
    ledger = Ledger(RunState(run_id=RUN))
    ledger.lease("replica-0", 8)  # prompts 0..7: batches 0 and 1
    g = [f"g{i:08d}" for i in range(8)]
    ledger.add_segment(_seg("0", [g[2], g[0], g[5]]))  # 3 of batch 0, 1 of batch 1
    # only minibatch 0 of batch 0 is complete: one input, as next_train_input builds it
    assert [i.step for i in ledger.next_train_inputs(cfg, ["relay-0"], steps_to_publish(policy, 0))] == [0]
    ledger.add_segment(_seg("1", [g[3], g[4], g[1]]))  # batch 0 whole; 2 of batch 1 (its first minibatch)
    first, second = ledger.next_train_inputs(cfg, ["relay-0"], steps_to_publish(policy, 0))
    # steps 0 and 1 (the whole of batch 0, in arrival order), not step 2: batch 1 waits for version 1
    assert (first.step, _ids(first.batch)) == (0, [g[2], g[0]])
    assert (second.step, _ids(second.batch)) == (1, [g[3], g[1]])
    # the second is whole on its own: the same restore point, the first's batch appended to its replay
    assert second.checkpoint == first.checkpoint and second.replay == [*first.replay, first.batch]
    assert second.config == first.config and second.fallbacks == first.fallbacks
    assert first == ledger.next_train_input(cfg, ["relay-0"])  # nothing was consumed by asking
    # what travels: the first input whole and the later batches alone; the trainer rebuilds the same inputs
    from laminar.client.converter import DATA_CONVERTER  # what every laminar client and worker decodes with
    from laminar.contract import TrainStepsInput

    msg = TrainStepsInput(first=first, then=[second.batch])
    conv = DATA_CONVERTER.payload_converter
    back = conv.from_payloads(conv.to_payloads([msg]), [TrainStepsInput])[0]
    assert back.inputs() == [first, second]
    # both commit in order (a checkpoint after each, checkpoint_every=1): then batch 1's first minibatch is next
    ledger.commit_step(first, _result(1, checkpoint=True), keep_last=3)
    ledger.commit_step(second, _result(2, checkpoint=True), keep_last=3)
    (nxt,) = ledger.next_train_inputs(cfg, ["relay-0"], steps_to_publish(policy, 2))
    assert (nxt.step, _ids(nxt.batch), nxt.checkpoint.step, nxt.replay) == (2, [g[5], g[4]], 2, [])


def test_other_modes_never_bundle_steps() -> None:
    from laminar.policy import policy_for, steps_to_publish

    for mode in ("laminar", "sync", "one_step", "partial_rollout"):
        cfg = RunConfig.load(None, [f"run.mode={mode}", "trainer.groups_per_step=2", "rollout.max_ready_groups=8"])
        assert all(steps_to_publish(policy_for(cfg), s) == 1 for s in range(6)), mode


def test_train_input_replays_batches_since_the_checkpoint() -> None:
    cfg = RunConfig.load(None, ["trainer.groups_per_step=2", "trainer.checkpoint_every=2"])
    ledger = Ledger(RunState(run_id=RUN))
    ledger.lease("replica-0", 12)
    ledger.add_segment(_seg("0", [f"g{i:08d}" for i in range(6)]))
    ledger.add_segment(_seg("1", [f"g{i:08d}" for i in range(6, 12)]))
    batches: list[list[BatchPart]] = []
    seen: list[tuple[int, int | None, int]] = []
    for _ in range(6):
        inp = ledger.next_train_input(cfg, ["relay-0", "relay-1"])
        base = inp.checkpoint.step if inp.checkpoint is not None else 0
        assert base + len(inp.replay) == inp.step
        # the replayed batches are exactly those of steps base .. step-1, in order
        assert inp.replay == batches[base:inp.step]
        assert inp.config == cfg.to_json() and inp.relay_chain == ["relay-0", "relay-1"]
        seen.append((inp.step, None if inp.checkpoint is None else inp.checkpoint.step, len(inp.replay)))
        batches.append(inp.batch)
        step = inp.step + 1
        ledger.commit_step(inp, _result(step, checkpoint=step % cfg.trainer.checkpoint_every == 0),
                           keep_last=cfg.trainer.keep_last)
    # (step, checkpoint step, replay length): a checkpoint lands after steps 2 and 4 (every 2)
    assert seen == [(0, None, 0), (1, None, 1), (2, 2, 0), (3, 2, 1), (4, 4, 0), (5, 4, 1)]
    # 6 steps x 2 groups = all 12, each once, oldest first
    assert [g for b in batches for g in _ids(b)] == [f"g{i:08d}" for i in range(12)]
    assert [c.step for c in ledger.state.checkpoints] == [2, 4, 6]


def test_the_payload_bound_holds_the_batches_a_run_carries() -> None:
    """laminar.contract.retained_batches_bytes, which the config's check and `laminar run`'s warning use, bounds
    what a real ledger puts in a train step's input (replay + fallback_replay) and carries in its state
    (committed_batches + uncommitted) once keep_last checkpoints are retained: every group in a segment of its own
    is the worst case, and the bound's ids are longer than this test's, so the bound is met within 40 %."""
    from temporalio.converter import default

    keep_last, every, per_step = 2, 3, 2
    cfg = RunConfig.load(None, [f"trainer.groups_per_step={per_step}", f"trainer.checkpoint_every={every}",
                                f"trainer.keep_last={keep_last}"])
    ledger = Ledger(RunState(run_id=RUN))
    steps = 4 * every
    ledger.lease("replica-0", steps * per_step)
    for i in range(steps * per_step):
        ledger.add_segment(_seg(f"{i:08d}", [f"g{i:08d}"]))
    conv = default().payload_converter
    largest_input = largest_state = 0
    for _ in range(steps):
        inp = ledger.next_train_input(cfg, ["relay-0"])
        largest_input = max(largest_input, len(conv.to_payloads([[*inp.fallback_replay, *inp.replay]])[0].data))
        step = inp.step + 1
        ledger.commit_step(inp, _result(step, checkpoint=step % every == 0), keep_last=keep_last)
        carried = [*ledger.state.committed_batches, *ledger.state.uncommitted]
        largest_state = max(largest_state, len(conv.to_payloads([carried])[0].data))
    bound = retained_batches_bytes(keep_last, every, per_step)
    assert 0.6 * bound <= max(largest_input, largest_state) <= bound, (largest_input, largest_state, bound)


# -- replicas and status --------------------------------------------------------------------------


def _report(replica: str, version: int) -> ReplicaReport:
    return ReplicaReport(replica_id=replica, host_id="host-0", policy_version=version)


def test_max_versions_in_use_is_the_high_water_mark() -> None:
    ledger = Ledger(RunState(run_id=RUN))
    ledger.note_report(_report("replica-0", -1))  # no weights yet: not a version in use
    assert ledger.versions_in_use() == [] and ledger.state.max_versions_in_use == 0
    ledger.note_report(_report("replica-1", 0))  # {0}
    ledger.note_report(_report("replica-0", 0))  # {0}
    assert ledger.state.max_versions_in_use == 1
    ledger.note_report(_report("replica-1", 1))  # {0, 1}
    ledger.note_report(_report("replica-2", 2))  # {0, 1, 2}
    assert ledger.versions_in_use() == [0, 1, 2] and ledger.state.max_versions_in_use == 3
    ledger.note_report(_report("replica-0", 2))  # {1, 2}
    ledger.note_report(_report("replica-1", 2))  # {2}
    assert ledger.versions_in_use() == [2]
    assert ledger.state.max_versions_in_use == 3


@pytest.mark.parametrize(("wait_s", "busy_s", "fraction"), [
    (3.0, 9.0, 0.25),  # 3 / (3 + 9)
    (0.0, 5.0, 0.0),  # never waited
    (2.0, 0.0, 1.0),  # only waited
    (0.0, 0.0, 0.0),  # nothing yet: defined as 0, not a division by zero
])
def test_status_trainer_wait_fraction(wait_s: float, busy_s: float, fraction: float) -> None:
    state = RunState(run_id=RUN, trainer_wait_s=wait_s, trainer_busy_s=busy_s)
    assert Ledger(state).status("running", 10, 0).trainer_wait_fraction == pytest.approx(fraction)


def test_status_reports_the_counts() -> None:
    ledger = Ledger(RunState(run_id=RUN, history_events_max=500, continued_as_new=1, started_at=12.5))
    ledger.note_report(_report("replica-1", 0))
    ledger.note_report(_report("replica-0", 0))
    ledger.lease("replica-0", 5)
    ledger.add_segment(_seg("0", ["g00000000", "g00000001", "g00000002"]))
    ledger.commit_step(_input(ledger, next_batch(ledger, 2)), _result(1, checkpoint=True, tokens=40), keep_last=3)
    st = ledger.status("running", 10, history_events=300)
    assert (st.run_id, st.phase, st.step, st.total_steps, st.policy_version) == (RUN, "running", 1, 10, 1)
    # 5 leased, 3 reported (2 open), 2 consumed (1 ready)
    assert (st.open_leases, st.groups_generated, st.groups_consumed, st.ready_groups) == (2, 3, 2, 1)
    assert st.tokens_consumed == 40 and st.checkpoints == [_ckpt(1)]
    assert [r.replica_id for r in st.replicas] == ["replica-0", "replica-1"]  # sorted by id
    assert st.history_events == 300 and st.history_events_max == 500  # max(500, 300)
    assert ledger.status("running", 10, history_events=700).history_events_max == 700
    assert (st.continued_as_new, st.started_at) == (1, 12.5)


# -- property: any interleaving -------------------------------------------------------------------

REPLICAS = ["replica-0", "replica-1", "replica-2"]
DEFAULT_CFG = RunConfig.load(None, [])


class LedgerMachine(RuleBasedStateMachine):
    """Replicas lease, report (with retries, duplicates and zombie reports after a restart), restart, and the
    trainer consumes and commits steps (some with a checkpoint), in any order Hypothesis picks; on a failure it
    shrinks to a minimal sequence. A small model of what the ledger must do is kept beside it: who holds each
    open lease, which groups were generated (accepted once), which failed, which were consumed. After every rule:
    every group ever leased is in exactly one of consumed, ready, failed, open_leases or returned, none is
    consumed twice, and a restarted trainer would replay exactly the batches since the checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger(RunState(run_id=RUN))
        self.owner: dict[str, str] = {}  # open lease -> replica (the model of open_leases)
        self.zombie: dict[str, set[str]] = {r: set() for r in REPLICAS}  # a restarted replica's old process held
        self.reported: list[SegmentRef] = []
        self.leased: set[str] = set()
        self.generated: set[str] = set()
        self.failed: set[str] = set()
        self.consumed: list[str] = []
        self.batches: list[list[BatchPart]] = []  # the batch of each step, in order
        self.seq = 0

    def held(self, r: str) -> list[str]:
        return sorted(g for g, o in self.owner.items() if o == r)

    def report(self, r: str, groups: list[str]) -> None:
        """A report is accepted exactly for the groups nobody reported before (once each), the rest counted."""
        self.seq += 1
        seg = _seg(str(self.seq), groups, replica=r)
        expected = [g for i, g in enumerate(groups)
                    if g not in self.generated and g not in self.failed and g not in groups[:i]]
        accepted, duplicates = self.ledger.add_segment(seg)
        assert accepted == expected
        assert len(duplicates) == len(groups) - len(expected)
        self.generated |= set(accepted)
        for g in accepted:
            self.owner.pop(g, None)
        if accepted:
            self.reported.append(seg)

    @rule(r=st.sampled_from(REPLICAS), n=st.integers(0, 3))
    def lease(self, r: str, n: int) -> None:
        leases = self.ledger.lease(r, n)
        assert len(leases) == n
        for x in leases:
            assert x.group_id not in self.owner and x.group_id not in self.generated
            self.owner[x.group_id] = r
            self.leased.add(x.group_id)

    @precondition(lambda self: self.owner)
    @rule(data=st.data())
    def generate(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from(sorted(set(self.owner.values()))))
        self.report(r, data.draw(st.lists(st.sampled_from(self.held(r)), min_size=1, unique=True)))

    @rule(r=st.sampled_from(REPLICAS), data=st.data())
    def fail(self, r: str, data: st.DataObject) -> None:
        """A replica reports groups failed (on every try): its own open leases close as failed, once; any other
        group it names (a retried report, a zombie's, one complete or leased elsewhere) is ignored."""
        others = sorted(self.leased - set(self.held(r)))
        groups = data.draw(st.lists(st.sampled_from(self.held(r) + others), unique=True)) if self.leased else []
        expected = [g for g in groups if self.owner.get(g) == r]
        before = self.ledger.state.groups_failed
        closed = self.ledger.fail_groups([FailedGroup(g, int(g[1:]), "raised") for g in groups], r)
        assert closed == expected and self.ledger.state.groups_failed == before + len(expected)
        for g in closed:
            del self.owner[g]
        self.failed |= set(closed)

    @precondition(lambda self: self.reported)
    @rule(data=st.data())
    def retry_report(self, data: st.DataObject) -> None:
        seg = data.draw(st.sampled_from(self.reported))
        before = (_ready_ids(self.ledger), self.ledger.state.groups_generated)
        assert self.ledger.add_segment(seg) == ([], seg.group_ids)  # a retried report is a no-op
        assert (_ready_ids(self.ledger), self.ledger.state.groups_generated) == before

    @precondition(lambda self: any(self.zombie.values()))
    @rule(data=st.data())
    def zombie_report(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from([r for r in REPLICAS if self.zombie[r]]))
        g = data.draw(st.sampled_from(sorted(self.zombie[r])))  # the old process finishes a group after all
        self.zombie[r].discard(g)
        self.report(r, [g])

    @rule(r=st.sampled_from(REPLICAS), data=st.data())
    def restart(self, r: str, data: st.DataObject) -> None:
        held = self.held(r)
        keep = set(data.draw(st.lists(st.sampled_from(held), unique=True))) if held else set()
        released = self.ledger.release_leases_of(r, keep)  # resumed from the partial pool: `keep`
        assert sorted(released) == sorted(set(held) - keep)
        for g in released:
            del self.owner[g]
        self.zombie[r] |= set(released)

    @precondition(lambda self: self.ledger.state.ready)
    @rule(n=st.integers(1, 4), checkpoint=st.booleans(), r=st.sampled_from(REPLICAS), data=st.data())
    def train_step(self, n: int, checkpoint: bool, r: str, data: st.DataObject) -> None:
        oldest = _ready_ids(self.ledger)[:n]
        inp = _input(self.ledger, next_batch(self.ledger, n))
        assert _ids(inp.batch) == oldest
        if self.held(r) and data.draw(st.booleans()):  # a report that arrives while the step runs
            self.report(r, self.held(r)[:1])
        self.ledger.commit_step(inp, _result(self.ledger.state.step + 1, checkpoint=checkpoint), keep_last=2)
        self.consumed.extend(oldest)
        self.batches.append(inp.batch)

    @invariant()
    def every_group_in_exactly_one_place(self) -> None:
        s = self.ledger.state
        assert {g: lease.replica_id for g, lease in s.open_leases.items()} == self.owner
        ready, returned = _ready_ids(self.ledger), [x.group_id for x in s.returned]
        everywhere = self.consumed + ready + sorted(self.failed) + list(s.open_leases) + returned
        assert len(self.consumed) == len(set(self.consumed)), "a group was consumed twice"
        assert len(everywhere) == len(set(everywhere)), "a group is in two places"
        assert set(everywhere) == self.leased, "a leased group was lost"
        assert set(self.consumed) | set(ready) == self.generated
        assert s.groups_generated == len(self.generated) and s.groups_consumed == len(self.consumed)
        assert s.groups_failed == len(self.failed) and not self.failed & self.generated
        assert s.prompt_cursor == s.groups_generated + s.groups_failed + len(s.open_leases) + len(s.returned)
        # every ready group's segment is still indexed, and nothing else is
        assert set(s.segments) == {g.segment_key for g in s.ready}

    @invariant()
    def a_restarted_trainer_replays_the_batches_since_the_checkpoint(self) -> None:
        inp = self.ledger.next_train_input(DEFAULT_CFG, [])
        base = inp.checkpoint.step if inp.checkpoint is not None else 0
        assert inp.step == len(self.batches) and base + len(inp.replay) == inp.step
        assert inp.replay == self.batches[base:]


TestLedgerInterleavings = LedgerMachine.TestCase
TestLedgerInterleavings.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_regenerated_and_reprefilled_tokens_count_once_per_accepted_report() -> None:
    ledger = Ledger(RunState(run_id=RUN))
    ledger.lease("replica-0", 1)
    seg = _seg("s1", ["g00000000"])
    ledger.add_segment(seg, "replica-0", tokens_regenerated=7, reprefill_tokens=300)
    ledger.add_segment(seg, "replica-0", tokens_regenerated=7, reprefill_tokens=300)  # the same report retried
    st = ledger.status("running", 10, 0)
    assert (st.tokens_regenerated, st.reprefill_tokens, st.duplicate_reports) == (7, 300, 1)
