"""Multi-turn tool calls: the calculator's bounds, call parsing, and the replica's environment loop with a real
TorchEngine, a real partial pool (TrajectoryStore on a local object store) and the trainer's real collate:
tool output is appended as masked context, recorded in the pool, and never run again after a resume."""

from __future__ import annotations

import pytest
import torch
from temporalio.exceptions import ApplicationError

from laminar.activities.errors import permanent_errors
from laminar.contract import Lease
from laminar.envs.tasks.tool_use import ToolsTask
from laminar.envs.tools import Episode, ToolResult, call, parse_call
from laminar.envs.tools.calculator import Calculator, evaluate
from laminar.errors import CorruptDataError, UntrainableRowError
from laminar.records import untrainable
from laminar.rl.engine import TorchEngine
from laminar.rl.engine_api import Finished
from laminar.rl.model import build_model, model_state_dict
from laminar.rl.trainer import collate
from laminar.services.rollout.batch import Batch
from laminar.storage.objects import LocalObjectStore
from laminar.storage.trajectories import (
    TrajectoryStore,
    check_schema,
    table_to_trajectories,
    trajectories_to_table,
)

TASK = ToolsTask(seed=0)
HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": TASK.tokenizer.get_vocab_size(),
      "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": True}
MAX_NEW = 28


# -- the calculator ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expr, want", [("456 + 789", "1245"), ("140 - 860", "-720"), ("7 / 2", "3.5"),
                                        ("7 // 2", "3"), ("7 % 4", "3"), ("2 ** 10", "1024"), ("(1 + 2) * -3", "-9"),
                                        ("6 / 3", "2")])
def test_calculator_computes(expr, want):
    assert Calculator().run(expr) == want


@pytest.mark.parametrize("expr, why", [
    ("9 ** 9 ** 9 ** 9", "exponent"),  # 9**9 = 387420489 is the exponent of the next power: refused, not computed
    ("10 ** 31", "too large"), ("1 / 0", "division by zero"), ("__import__('os')", "not allowed"),
    ("x + 1", "not allowed"), ("'a' * 3", "not allowed"), ("1 +", "not an arithmetic"), ("", "empty"),
    ("1" * 201, "longer than 200"), ("+".join(["1"] * 60), "more than 100 parts"), ("0 ** -1", "zero to"),
])
def test_calculator_refuses_with_an_error_output_not_a_failure(expr, why):
    out = Calculator().run(expr)
    assert out.startswith("error: ") and why in out
    with pytest.raises(ValueError):
        evaluate(expr)


def test_a_call_must_end_the_turn():
    tools = [Calculator()]
    assert parse_call("<calc>12+3</calc>", tools)[1] == "12+3"
    assert parse_call("<calc>12+3</calc>  \n", tools)[1] == "12+3"
    assert parse_call("<calc>1</calc><answer>1</answer>", tools) is None  # an answer after the call: final
    assert parse_call("<answer>1</answer>", tools) is None


def test_a_tool_that_raises_is_a_failed_result():
    class Broken:
        name, tag = "broken", "python"

        def run(self, text: str) -> str:
            raise RuntimeError("sandbox died")

    result, latency = call(Broken(), "print(1)")
    assert result == ToolResult("", ok=False, detail="broken: RuntimeError: sandbox died") and latency >= 0


# -- the environment loop ------------------------------------------------------------------------------------

def _engine(seed: int = 0) -> TorchEngine:
    model = build_model(HF, seed=seed)
    e = TorchEngine(model, TASK.tokenizer, max_inflight_seqs=4, max_new_tokens=MAX_NEW, temperature=1.0, seed=seed,
                    eos_id=TASK.eos_id, max_prompt_len=32)
    e.load_weights(model_state_dict(model), policy_version=1)
    return e


def _batch(engine: TorchEngine, task=TASK) -> Batch:
    return Batch(engine, task, "run-t", "rollout-0", group_size=2, clock=lambda: 1.0)


def _ids(text: str) -> list[int]:
    return TASK.tokenizer.encode(text, add_special_tokens=False).ids


def _call_turn(batch: Batch, index: int) -> Finished:
    """Sample `index` of group g0 finishing turn 1 with a calculator call on its prompt's expression."""
    prompt = batch.groups["g0"].prompt
    expr = " ".join(ch for ch in prompt.answer_meta["metadata"]["expression"] if not ch.isspace())
    turn = [*_ids(f"<calc> {expr} </calc>"), TASK.eos_id]
    return Finished(f"g0/{index}", prompt.token_ids, turn, [-0.5] * len(turn), "stop")


def _drain(engine: TorchEngine, batch: Batch) -> None:
    while engine.in_flight():
        batch.record(engine.step())


def test_a_tool_turn_appends_masked_output_and_is_recorded_and_never_rerun_after_a_resume(tmp_path):
    engine = _engine()
    a = _batch(engine)
    a.admit([Lease("g0", 0)])
    engine.abort(["g0/0"])  # sample 0's first turn is played by hand below; sample 1 is left to the model
    prompt = a.groups["g0"].prompt
    a.record([_call_turn(a, 0)])
    assert a.tool_executions == {("g0", 0, 0): 1} and a.tool_turns_unsaved == 1
    # the engine holds sample 0 again: turn 1 without its <eos>, then the tool's output
    expr_tokens = len(_call_turn(a, 0).response_ids) - 1  # <calc> + 7 symbols + </calc> = 9
    out = TASK.tool_output_ids(str(prompt.answer_meta["answer"]))  # <result> - 7 2 0 </result>: 6 tokens
    held = {rid: (resp, lps) for rid, _, resp, lps in engine.snapshot_inflight()}
    assert held["g0/0"][0] == _call_turn(a, 0).response_ids[:-1] + out
    assert held["g0/0"][1] == [-0.5] * expr_tokens + [0.0] * len(out)
    # the pool row of the sample between turns carries the tool output and its mask
    store = TrajectoryStore(LocalObjectStore(str(tmp_path)))
    rows = a.rows(a.groups, engine.snapshot_inflight())
    store.write_partial("run-t", "rollout-0", (0, 1), rows)
    (row,) = [t for t in rows if t.sample_index == 0]
    assert row.tool_mask == [1] * expr_tokens + [0] * len(out)
    assert row.extra["turns"] == "2" and row.extra["tool_calls"] == "1"
    # the replica dies; its retry resumes from the pool on a fresh engine and batch
    engine.abort()
    by_group: dict = {}
    for t in store.read_partial("run-t", "rollout-0"):
        by_group.setdefault(t.group_id, []).append(t)
    engine2 = _engine(seed=1)
    b = _batch(engine2)
    b.resume(by_group, 1)
    _drain(engine2, b)
    # turn 2 is the last of max_turns = 2: the completed call is never run again, and no new one runs
    assert b.tool_executions.get(("g0", 0, 0), 0) == 0
    executions = {k: a.tool_executions.get(k, 0) + b.tool_executions.get(k, 0)
                  for k in {*a.tool_executions, *b.tool_executions}}
    assert all(n == 1 for n in executions.values())  # executions == distinct calls
    (group,) = b.completed
    done = group.done[0]
    assert done.response_ids[: expr_tokens + len(out)] == row.response_ids
    assert done.tool_mask[: expr_tokens + len(out)] == row.tool_mask
    assert set(done.tool_mask[expr_tokens + len(out):]) <= {1} and len(done.tool_mask) == len(done.response_ids)


def test_the_trainer_masks_tool_output_out_of_the_loss():
    engine = _engine()
    a = _batch(engine)
    a.admit([Lease("g0", 0)])
    engine.abort(["g0/0"])
    a.record([_call_turn(a, 0)])
    _drain(engine, a)
    (group,) = a.completed
    t = group.done[0]
    batch = collate([t], TASK.pad_id)
    p = len(t.prompt_ids)
    # the response mask is the tool mask, shifted onto next-token targets; zero on the 6 tool-output tokens
    assert batch.response_mask[0, p - 1: p - 1 + len(t.response_ids)].tolist() == [float(m) for m in t.tool_mask]
    assert batch.response_mask.sum().item() == len(t.response_ids) - 6
    t.tool_mask = t.tool_mask[:-1]
    with pytest.raises(UntrainableRowError, match=r"group g0 sample 0 .*tool_mask of"):
        collate([t], TASK.pad_id)
    # in the trainer's activities (activities/trainer.py) the refusal is permanent: the step is not retried with
    # the same row forever, the run fails with the message
    with pytest.raises(ApplicationError, match="group g0 sample 0") as refused:
        with permanent_errors(CorruptDataError):
            collate([t], TASK.pad_id)
    assert refused.value.non_retryable and refused.value.type == "CorruptData"


def _stale_episode(a: Batch, index: int, mask_len: int) -> None:
    """Sample `index` of g0 carries turns of an older try: a tool mask longer than its new response (the chaos
    run's "8 response tokens but a tool_mask of 12")."""
    from laminar.envs.tools import ToolCall

    ep = Episode(mask=[1] * (mask_len - 2) + [0, 0])
    ep.calls.append(ToolCall(0, "calculator", 0.0))
    a.episodes[f"g0/{index}"] = ep


def test_a_sample_the_trainer_could_never_train_fails_its_group_and_never_becomes_data():
    for retries in (1, 0):
        engine = _engine()
        a = Batch(engine, TASK, "run-t", "rollout-0", group_size=2, clock=lambda: 1.0, max_group_retries=retries)
        a.admit([Lease("g0", 0)])
        engine.abort(["g0/0"])
        _stale_episode(a, 0, 12)
        a.record([Finished("g0/0", a.groups["g0"].prompt.token_ids, _ids("1 2 3"), [-0.5] * 3, "length")])
        if retries:  # generated again from its prompt, without the stale turns: trainable rows
            assert not a.failed and "g0" in a.groups
            _drain(engine, a)
            (group,) = a.completed
            assert all(untrainable(t) is None for t in group.done.values())
            collate(list(group.done.values()), TASK.pad_id)
        else:  # no retry left: dropped as a failed group (counted by the workflow), never a row of a batch
            assert [(f.group_id, f.reason) for f in a.failed] == [("g0", "malformed")]
            assert "sample 0: 3 response tokens but a tool_mask of 12" in a.failed[0].detail
            assert not a.completed and not a.groups


def test_a_resumed_finished_row_the_trainer_could_never_train_fails_its_group():
    engine = _engine()
    a = _batch(engine)
    a.admit([Lease("g0", 0)])
    _drain(engine, a)
    rows = list(a.completed[0].done.values())
    rows[1].logprobs = rows[1].logprobs[:-1]  # a row an older incarnation wrote wrong
    b = Batch(_engine(seed=1), TASK, "run-t", "rollout-0", group_size=2, clock=lambda: 1.0, max_group_retries=0)
    b.resume({"g0": rows}, 1)
    assert [(f.group_id, f.reason) for f in b.failed] == [("g0", "malformed")]
    assert "behaviour log-probs" in b.failed[0].detail and not b.completed and not b.groups


def test_a_failing_tool_fails_the_group_with_reason_sandbox_then_drops_it():
    class BrokenCalc(ToolsTask):
        def __init__(self) -> None:
            super().__init__(seed=0)

            class Broken:
                name, tag = "calculator", "calc"

                def run(self, text: str) -> str:
                    raise RuntimeError("down")
            self.tools = [Broken()]

    engine = _engine()
    a = Batch(engine, BrokenCalc(), "run-t", "rollout-0", group_size=2, clock=lambda: 1.0, max_group_retries=0)
    a.admit([Lease("g0", 0)])
    engine.abort(["g0/0"])
    a.record([_call_turn(a, 0)])
    assert [(f.group_id, f.reason) for f in a.failed] == [("g0", "sandbox")]
    assert "RuntimeError: down" in a.failed[0].detail and not a.groups and not a.episodes


def test_old_segments_without_the_mask_column_still_read():
    engine = _engine()
    a = _batch(engine)
    a.admit([Lease("g0", 0)])
    _drain(engine, a)
    rows = a.completed[0].done.values()
    table = trajectories_to_table(list(rows))
    old = table.drop(["tool_mask"])
    check_schema(old.schema, "a segment written before tool_mask")  # missing an optional column: no error
    with pytest.raises(CorruptDataError, match="missing columns"):
        check_schema(table.drop(["extra"]).schema, "a segment without extra")
    assert [t.tool_mask for t in table_to_trajectories(old)] == [[], []]


def test_episode_round_trips_through_a_row():
    ep = Episode(mask=[1, 1, 0, 0])
    from laminar.envs.tools import ToolCall

    ep.calls.append(ToolCall(0, "calculator", 0.25))
    back = Episode.from_row(ep.full_mask(7), ep.extra())
    assert back.mask == [1, 1, 0, 0] and back.calls == ep.calls and back.turns == 2
    assert torch.tensor(ep.full_mask(7)).tolist() == [1, 1, 0, 0, 1, 1, 1]


def test_a_group_restarted_from_its_prompt_gets_the_recorded_answer_of_a_completed_call(tmp_path):
    """The pool's start version can no longer be loaded, so the group is generated again from its prompt
    (PartialPool._restart_fresh): a regenerated turn making the same call is answered from the pool's record,
    one making a different call runs the tool (a new call)."""
    engine = _engine()
    a = _batch(engine)
    a.admit([Lease("g0", 0)])
    engine.abort(["g0/0", "g0/1"])
    a.record([_call_turn(a, 0), _call_turn(a, 1)])
    rows = a.rows(a.groups, engine.snapshot_inflight())
    engine.abort()
    engine2 = _engine(seed=1)
    b = _batch(engine2)
    b.remember_calls(rows)
    assert set(b.recorded) == {("g0", 0, 0), ("g0", 1, 0)}
    b.admit([Lease("g0", 0)])
    engine2.abort(["g0/0", "g0/1"])
    other = _call_turn(b, 1)
    other = Finished("g0/1", other.prompt_ids, [*_ids("<calc> 1 + 1 </calc>"), TASK.eos_id], [-0.5] * 6, "stop")
    b.record([_call_turn(b, 0), other])
    # sample 0 repeated its call: answered from the record, not run; sample 1 made another call: run once
    assert b.tool_executions == {("g0", 1, 0): 1}
    held = {rid: resp for rid, _, resp, _ in engine2.snapshot_inflight()}
    prompt = b.groups["g0"].prompt
    assert held["g0/0"][-6:] == TASK.tool_output_ids(str(prompt.answer_meta["answer"]))
    assert held["g0/1"][-3:] == _ids("<result> 2 </result>")
    executions = {k: a.tool_executions.get(k, 0) + b.tool_executions.get(k, 0) for k in a.tool_executions}
    assert executions == {("g0", 0, 0): 1, ("g0", 1, 0): 2}  # the same call once; sample 1's second is another call


# -- at most once: the write-ahead record of an engine step's calls -----------------------------------------------

def _pool(batch: Batch, store: TrajectoryStore, attempt: int):
    from laminar.services.rollout.batch import Counters
    from laminar.services.rollout.pool import PartialPool
    from laminar.timing import TimeBreakdown
    # the pool's writes and reads need no weights (only resume's version check does, done by hand here)
    return PartialPool(store, "run-t", "rollout-0", (0, attempt), batch, None, Counters(), TimeBreakdown())


def _executed(logs: list[dict]) -> dict[tuple[str, int, int], int]:
    out: dict[tuple[str, int, int], int] = {}
    for e in logs:
        if e["event"] == "tool_executed":
            key = (e["group_id"], e["sample"], e["turn"])
            out[key] = out.get(key, 0) + 1
    return out


def test_a_step_writes_its_call_intents_before_running_them_and_their_outputs_after(tmp_path):
    store = TrajectoryStore(LocalObjectStore(str(tmp_path)))
    engine = _engine()
    a = _batch(engine)
    pool = _pool(a, store, 1)
    a.admit([Lease("g0", 0)])
    engine.abort(["g0/0", "g0/1"])
    a.record([_call_turn(a, 0), _call_turn(a, 1)])
    # one write for the step's two intents (batched), before the two calls ran
    assert pool.writes == 1 and a.tool_executions == {("g0", 0, 0): 1, ("g0", 1, 0): 1} and a.tool_turns_unsaved == 2
    assert {t.extra.get("tool_intent") for t in store.read_partial("run-t", "rollout-0")} == {"0"}
    pool.flush_if_due(0.0, every_s=3600.0)  # the outputs are written at once, not at the flush interval
    assert pool.writes == 2 and a.tool_turns_unsaved == 0
    rows = store.read_partial("run-t", "rollout-0")
    assert len(rows) == 2 and all("tool_intent" not in t.extra and t.extra["tool_calls"] == "1" for t in rows)
    a.record([])  # a step with no call writes nothing more
    assert pool.writes == 2


def test_a_crash_between_the_intent_write_and_the_output_write_never_runs_the_call_again(tmp_path):
    """The rollout drill's case: the kill lands after a step's calls ran and before the pool write of their
    outputs. The next incarnation resumes from the pool: the calls whose intents are recorded without output
    are not run again (counted by `tool_executed` events across both incarnations); the samples read
    INTERRUPTED as those calls' output (mask 0) and finish."""
    from structlog.testing import capture_logs

    from laminar.services.rollout.batch import INTERRUPTED
    store = TrajectoryStore(LocalObjectStore(str(tmp_path)))
    engine = _engine()
    a = _batch(engine)
    _pool(a, store, 1)
    a.admit([Lease("g0", 0)])
    engine.abort(["g0/0", "g0/1"])
    turns = [_call_turn(a, 0), _call_turn(a, 1)]
    with capture_logs() as logs_a:
        a.record(turns)  # intents written, both calls run ... and the replica is killed before the next write
    assert _executed(logs_a) == {("g0", 0, 0): 1, ("g0", 1, 0): 1}
    engine.abort()
    # the next incarnation, as the replica starts it: a fresh engine, batch and pool on the same store
    engine2 = _engine(seed=1)
    b = _batch(engine2)
    resumed = _pool(b, store, 2).read()
    assert [t.extra["tool_intent"] for t in resumed["g0"]] == ["0", "0"]
    with capture_logs() as logs_b:
        b.resume(resumed, 1)
        held = {rid: resp for rid, _, resp, _ in engine2.snapshot_inflight()}
        _drain(engine2, b)
    assert _executed(logs_b) == {}  # not run again: executions == distinct calls == 2
    assert sorted(e["sample"] for e in logs_b if e["event"] == "tool_interrupted") == [0, 1]
    out = TASK.tool_output_ids(INTERRUPTED)  # the tiny tokenizer: <result> error </result>
    for i, turn in enumerate(turns):
        assert held[f"g0/{i}"][: len(turn.response_ids) - 1 + len(out)] == turn.response_ids[:-1] + out
    (group,) = b.completed  # max_turns = 2: turn 2 is the last; the group finishes, nothing lost
    call_tokens = len(turns[0].response_ids) - 1  # the turn without its <eos>
    assert group.done[0].tool_mask[: call_tokens + len(out)] == [1] * call_tokens + [0] * len(out)
    assert group.done[0].extra["tool_calls"] == "1"
    # a group generated again from its prompt instead (start version gone) answers the same call INTERRUPTED too
    c = _batch(_engine(seed=2))
    c.remember_calls([t for rows in resumed.values() for t in rows])
    expr_text = parse_call(TASK.turn_text(turns[0].response_ids), [Calculator()])[1]
    assert c.recorded[("g0", 0, 0)] == (expr_text, out)


def test_a_regenerated_group_keeps_its_recorded_answers_across_another_crash(tmp_path):
    """The chaos run's case: incarnation b generates a group again from its prompt (its start version was gone:
    PartialPool._restart_fresh) and dies before the regenerated turns reach their calls; incarnation c resumes
    b's pool. The answers b kept in memory travel in b's pool rows (extra `recorded_calls`), so c answers the
    same calls from the record: each call ran once over the three incarnations. Before, c ran them again."""
    from structlog.testing import capture_logs

    from laminar.services.rollout.batch import RECORDED
    store = TrajectoryStore(LocalObjectStore(str(tmp_path)))
    engine = _engine()
    a = _batch(engine)
    a.admit([Lease("g0", 0)])
    engine.abort(["g0/0", "g0/1"])
    with capture_logs() as logs_a:
        a.record([_call_turn(a, 0), _call_turn(a, 1)])
    rows_a = a.rows(a.groups, engine.snapshot_inflight())
    engine.abort()
    b = _batch(_engine(seed=1))
    pool_b = _pool(b, store, 2)
    b.restart_fresh({"g0": rows_a})  # from the prompt; the record of both calls is kept
    pool_b.write()  # a flush, then b dies with its regenerated samples before their calls
    rows_b = store.read_partial("run-t", "rollout-0")
    assert all(RECORDED in t.extra and t.tool_mask == [] for t in rows_b)
    engine3 = _engine(seed=2)
    c = _batch(engine3)
    resumed = _pool(c, store, 3).read()
    with capture_logs() as logs_c:
        c.resume(resumed, 1)
        engine3.abort(["g0/0", "g0/1"])
        c.record([_call_turn(c, 0), _call_turn(c, 1)])  # the regenerated turns make the same calls
    assert _executed(logs_a) == {("g0", 0, 0): 1, ("g0", 1, 0): 1}
    assert _executed(logs_c) == {}  # answered from the record: executions == distinct calls == 2
    assert sorted(e["sample"] for e in logs_c if e["event"] == "tool_reused") == [0, 1]
    prompt = c.groups["g0"].prompt
    held = {rid: resp for rid, _, resp, _ in engine3.snapshot_inflight()}
    assert held["g0/0"][-6:] == TASK.tool_output_ids(str(prompt.answer_meta["answer"]))
    # once answered, the record is in the prefix: the next rows carry no RECORDED entry
    assert all(RECORDED not in t.extra for t in c.rows(c.groups, engine3.snapshot_inflight()))


def test_a_group_handed_off_and_back_from_its_prompt_carries_no_stale_turns(tmp_path):
    """The chaos run's case (after the pool fixes): a replica hands a group whose samples are between turns to a
    repack destination, which declines; the group comes back to the same replica with the migration's segment,
    under a version it no longer holds, so it is generated again from its prompt (Repack.take_leases ->
    restart_fresh). The replica's episodes of the first try must not survive: a stale one gave the new, shorter
    response the old tool mask (12 entries for 8 tokens), which the trainer refused at every retry of its step."""
    from laminar.contract import MigrationOrder
    from laminar.services.rollout.batch import Counters
    from laminar.services.rollout.migration import Repack
    from laminar.timing import TimeBreakdown

    store = TrajectoryStore(LocalObjectStore(str(tmp_path)))
    engine = _engine()
    a = _batch(engine)
    repack = Repack(a, store, "run-t", "rollout-0", Counters(), TimeBreakdown())
    a.admit([Lease("g0", 0)])
    engine.abort(["g0/0", "g0/1"])
    a.record([_call_turn(a, 0), _call_turn(a, 1)])  # both samples between turns: episodes with a tool answer
    assert set(a.episodes) == {"g0/0", "g0/1"}
    repack.on_answer(MigrationOrder("m1", "rollout-1", 1), [])  # hand-off; the destination declines
    handoff, _ = repack.outgoing()
    assert handoff is not None and handoff.segment is not None and not a.groups
    engine.load_weights(model_state_dict(build_model(HF, seed=0)), policy_version=2)  # it moved on to version 2
    repack.take_leases([Lease("g0", 0, resume=handoff.segment, resume_version=1)])  # back, from the prompt
    assert a.recorded  # the completed calls are kept for the regenerated turns
    _drain(engine, a)
    (group,) = a.completed
    for t in group.done.values():
        assert t.tool_mask == [] or len(t.tool_mask) == len(t.response_ids), (t.response_ids, t.tool_mask)
    collate(list(group.done.values()), TASK.pad_id)  # what the trainer does with them


def test_a_source_that_dies_before_its_hand_off_is_recorded_keeps_the_groups_in_its_pool(tmp_path):
    """The last chaos run's case: a replica ran a step's calls, handed the groups off in a migration, and died
    (a read-only store failed its next write) before the claim carrying the hand-off reached the workflow, so the
    leases were still its own. Its pool, written after the hand-off, no longer held the groups: the retry's first
    claim did not resume them, they went back from their prompts and their calls ran again. The pool now keeps
    the handed-off rows until that claim is answered."""
    from laminar.contract import MigrationOrder
    from laminar.services.rollout.batch import Counters
    from laminar.services.rollout.migration import Repack
    from laminar.timing import TimeBreakdown

    store = TrajectoryStore(LocalObjectStore(str(tmp_path)))
    engine = _engine()
    a = _batch(engine)
    pool = _pool(a, store, 1)
    repack = Repack(a, store, "run-t", "rollout-0", Counters(), TimeBreakdown())
    a.admit([Lease("g0", 0)])
    engine.abort(["g0/0", "g0/1"])
    a.record([_call_turn(a, 0), _call_turn(a, 1)])  # the calls ran
    repack.on_answer(MigrationOrder("m1", "rollout-1", 1), [])  # handed off at once
    pool.write()  # the next flush: the batch holds nothing, the hand-off is not recorded yet
    rows = {t.sample_index: t for t in store.read_partial("run-t", "rollout-0")}
    assert set(rows) == {0, 1} and all(t.extra["tool_calls"] == "1" for t in rows.values())
    # the retry resumes them from its pool with their calls answered: none runs again
    b = _batch(_engine(seed=1))
    b.resume(_pool(b, store, 2).read(), 1)
    assert b.tool_executions == {} and set(b.episodes) == {"g0/0", "g0/1"}
    # once the claim that carried the hand-off is answered, the workflow has the groups: the pool drops them
    handoff, _ = repack.outgoing()
    assert handoff is not None and handoff.segment is not None
    repack.on_answer(None, [])
    pool.write()
    assert store.read_partial("run-t", "rollout-0") == []
