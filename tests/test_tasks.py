"""The task interface: naming a task (built-in, package.module:Class, entry point), prompt files (JSONL and
Parquet), chat-template rendering, and the failure semantics: a reward that raises, hangs, returns NaN or a
value of the wrong type is a failure, never a reward; its group is retried with a fresh prompt and reward call,
then dropped and its lease closed once as failed (real torch engine, real replica batch, real ledger)."""

from __future__ import annotations

import json
import math
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prometheus_client import REGISTRY

from laminar.config import RunConfig
from laminar.envs.tasks import RewardFailure, build_task, get_task
from laminar.envs.tasks.prompt_file import FilePrompts
from laminar.envs.tasks.repeat import RepeatTask
from laminar.envs.tasks.scoring import score
from laminar.envs.tasks.text import FileTask, render
from laminar.errors import ConfigError
from laminar.refs import SegmentRef
from laminar.rl.engine import TorchEngine
from laminar.rl.model import build_model
from laminar.services.rollout.batch import Batch, Counters
from laminar.workflows.ledger import Ledger
from laminar.workflows.state import RunState
from tests.fixtures.user_task import FAILS, PROMPTS, REASON, TASK_NAME, CopyTask


def _cfg(*overrides: str) -> RunConfig:
    return RunConfig.load(None, list(overrides))


# -- naming a task ---------------------------------------------------------------------------------------


def test_default_is_the_builtin_repeat_task_with_its_max_count():
    task = build_task(_cfg("task.max_count=16").task, seed=3)
    assert isinstance(task, RepeatTask) and (task.seed, task.max_count) == (3, 16)


def test_a_user_class_by_module_path_gets_its_prompt_file_and_params():
    cfg = _cfg(f"task.name={TASK_NAME}", f"task.prompts={PROMPTS}", "task.params={\"hang_s\": 1.5}")
    task = build_task(cfg.task, seed=0)
    assert isinstance(task, CopyTask) and task.hang_s == 1.5 and len(task.source) == 12


def test_an_entry_point_names_a_task(tmp_path, monkeypatch):
    # a real installed distribution's metadata (what pip writes), found on sys.path by importlib.metadata
    dist = tmp_path / "copytask_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: copytask-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[laminar.tasks]\ncopy = {TASK_NAME}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    task = build_task(_cfg("task.name=copy", f"task.prompts={PROMPTS}").task, seed=0)
    assert isinstance(task, CopyTask)


@pytest.mark.parametrize(("overrides", "message"), [
    (["task.name=sorting"], "'sorting' is not a known task"),
    (["task.name=no_such_pkg.mod:Task"], "module 'no_such_pkg.mod' cannot be imported"),
    (["task.name=laminar.envs.tasks.repeat:NoSuchTask"], "has no 'NoSuchTask'"),
    ([f"task.prompts={PROMPTS}"], "task 'repeat' reads no prompt file"),
    (["task.params={\"colour\": 1}"], "task.params has colour, which task 'repeat' does not take"),
    (["task.name=file"], "could not be built"),  # the file task without task.prompts
])
def test_bad_task_config_is_a_config_error_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_task(_cfg(*overrides).task, seed=0)


@pytest.mark.parametrize(("overrides", "message"), [
    (["task.name=sorting"], "'sorting' is not a known task"),
    ([f"task.prompts={PROMPTS}"], "task 'repeat' reads no prompt file"),
    ([f"task.name={TASK_NAME}", f"task.prompts={PROMPTS}", "task.params={\"colour\": 1}"], "task.params has colour"),
    ([f"task.name={TASK_NAME}", "task.prompts=/no/such/prompts.jsonl"], "is not a file on this host"),
])
def test_laminar_run_checks_the_task_before_anything_starts(overrides, message):
    from typer.testing import CliRunner

    from laminar.cli.main import app

    res = CliRunner().invoke(app, ["run", "examples/tiny.toml", *[f"--{o}" for o in overrides]])
    assert res.exit_code != 0 and message in " ".join(res.output.split()), res.output


def test_check_task_builds_nothing_and_passes_a_good_task():
    from laminar.envs.tasks.loader import check_task

    check_task(_cfg(f"task.name={TASK_NAME}", f"task.prompts={PROMPTS}", "task.params={\"hang_s\": 2}").task)
    check_task(_cfg().task)


def test_get_task_keeps_working_for_builtins():
    assert get_task("repeat", seed=0, max_count=8).max_count == 8


# -- prompt files -----------------------------------------------------------------------------------------


def _rows() -> list[dict]:
    return [json.loads(line) for line in PROMPTS.read_text().splitlines()]


def test_jsonl_and_parquet_files_give_the_same_prompts(tmp_path):
    rows = _rows()
    path = tmp_path / "p.parquet"
    # Parquet has one type per column: metadata a struct; a value a row lacks is null (read back as absent)
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()),
                        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                        ("answer", pa.string()), ("metadata", pa.struct([("fail", pa.string())]))])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    a, b = FilePrompts(PROMPTS, seed=5), FilePrompts(path, seed=5)
    assert [a.row(i) for i in range(30)] == [b.row(i) for i in range(30)]
    first = {r["id"]: r for r in rows}["c01"]
    got = next(a.row(i) for i in range(12) if a.row(i).id == "c01")
    assert got.messages == first["messages"] and got.prompt is None and got.answer == "green grey white"


def test_each_pass_over_the_file_serves_every_row_once_in_a_seeded_order():
    src = FilePrompts(PROMPTS, seed=1)
    passes = [[src.row(p).id for p in range(12 * k, 12 * (k + 1))] for k in range(3)]
    assert all(sorted(ids) == [f"c{i:02d}" for i in range(12)] for ids in passes)
    assert passes[0] != passes[1]  # reshuffled per pass (12! orders: equal by chance with p ~ 2e-9)
    assert passes == [[FilePrompts(PROMPTS, seed=1).row(p).id for p in range(12 * k, 12 * (k + 1))]
                      for k in range(3)]


@pytest.mark.parametrize(("line", "message"), [
    ('{"id": "x"}', "exactly one of `prompt` and `messages`"),
    ('{"prompt": "a", "messages": [{"role": "user", "content": "a"}]}', "exactly one of"),
    ('{"prompt": "a", "extra": 1}', "unknown column"),
    ('{"messages": [{"role": "user"}]}', "`messages` must be"),
    ('{"prompt": "a", "metadata": [1]}', "`metadata` must be an object"),
    ("not json", "line 1 is not JSON"),
])
def test_a_bad_row_names_the_file_line_and_fix(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message) as info:
        FilePrompts(path)
    assert str(path) in str(info.value)


def test_missing_or_empty_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="is not a file"):
        FilePrompts(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="has no rows"):
        FilePrompts(tmp_path / "empty.jsonl")


def test_messages_use_the_chat_template_when_the_model_has_one():
    row = FilePrompts(PROMPTS).rows[1]
    assert render(row, None) == "user: copy : green grey white"
    template = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    assert render(row, template) == "<|user|> copy : green grey white <|assistant|>"
    plain = FilePrompts(PROMPTS).rows[0]  # a plain prompt becomes one user message under a template
    assert render(plain, template) == "<|user|> copy : black white <|assistant|>"


def test_the_file_task_rewards_an_exact_answer_and_builds_its_tokenizer_from_the_file():
    task = FileTask(prompts=FilePrompts(PROMPTS))
    p = task.prompt(0)
    answer = task.tokenizer.encode(p.answer_meta["answer"], add_special_tokens=False).ids
    assert 0 not in p.token_ids[1:]  # every prompt word is in the vocabulary (0 is <pad>, the unknown word)
    assert score(task, p, [*answer, task.eos_id, 7], 1.0) == 1.0  # after <eos> nothing counts
    assert score(task, p, answer[:1] + [task.eos_id], 1.0) == 0.0  # wrong answer: reward 0, not a failure


# -- one reward call ---------------------------------------------------------------------------------------


class _Reward:
    def __init__(self, fn):
        self.reward = fn


async def _async_half(prompt, ids):
    return 0.5


@pytest.mark.parametrize(("fn", "reason"), [
    (lambda p, ids: 1 / 0, "raised"),
    (lambda p, ids: time.sleep(5), "timeout"),
    (lambda p, ids: math.nan, "nan"),
    (lambda p, ids: math.inf, "nan"),
    (lambda p, ids: "1.0", "wrong_type"),
    (lambda p, ids: True, "wrong_type"),  # a bool is not a reward
    (lambda p, ids: None, "wrong_type"),
])
def test_a_failed_reward_call_is_a_failure_with_its_reason(fn, reason):
    t0 = time.monotonic()
    with pytest.raises(RewardFailure) as info:
        score(_Reward(fn), None, [], 0.3)
    assert info.value.reason == reason
    assert time.monotonic() - t0 < 2.0  # a hang is abandoned after the 0.3 s limit, not waited out


def test_sync_and_async_rewards_and_ints_are_rewards():
    assert score(_Reward(_async_half), None, [], 1.0) == 0.5
    assert score(_Reward(lambda p, ids: 0), None, [], 1.0) == 0.0
    assert score(_Reward(lambda p, ids: 1), None, [], 1.0) == 1.0


# -- a failed group in the replica and the ledger ---------------------------------------------------------


def _engine(task: CopyTask, slots: int) -> TorchEngine:
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
          "vocab_size": task.tokenizer.get_vocab_size(), "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "tie_word_embeddings": True}
    engine = TorchEngine(build_model(hf, seed=0), task.tokenizer, max_inflight_seqs=slots, max_new_tokens=4,
                         temperature=1.0, seed=0, eos_id=task.eos_id, max_prompt_len=16)
    engine.policy_version = 0
    return engine


@pytest.mark.parametrize("mode", FAILS)
def test_a_failing_group_is_retried_then_dropped_and_its_lease_closed_once_as_failed(mode):
    group_size, retries = 2, 2
    task = CopyTask(prompts=FilePrompts(PROMPTS), hang_s=5.0)
    state = RunState(run_id="r")
    ledger = Ledger(state)
    leases = ledger.lease("replica-0", 12)  # pass 0: every row once
    fail_mode = {lease.group_id: task.prompt(lease.prompt_id).answer_meta["metadata"].get("fail") for lease in leases}
    ours = [lease for lease in leases if fail_mode[lease.group_id] in (None, mode)]  # 8 good rows + this mode's
    counters = Counters()
    metric = {name: (f"laminar_rollout_{name}_total", {"replica": "replica-0", "reason": REASON[mode]})
              for name in ("group_retries", "groups_failed")}
    before = {k: REGISTRY.get_sample_value(*v) or 0.0 for k, v in metric.items()}
    batch = Batch(_engine(task, 12 * group_size), task, "r", "replica-0", group_size, time.monotonic,
                  reward_timeout_s=0.2, max_group_retries=retries, counters=counters)
    batch.admit(ours)
    t0, steps = time.monotonic(), 0
    while batch.engine.in_flight():
        batch.record(batch.engine.step())
        steps += 1
        assert steps < 200, "the batch never drained: a failed group is retried forever"
    # the failing group took 1 + retries tries and left as failed with its reason; the 8 others completed
    assert len(batch.failed) == 1 and not batch.groups
    failed = batch.failed[0]
    assert fail_mode[failed.group_id] == mode
    assert (failed.reason, failed.attempts) == (REASON[mode], 1 + retries)
    assert failed.source_id == task.prompt(failed.prompt_id).source_id != ""
    # Prometheus (laminar/metrics.py): 2 retries, then 1 group dropped, for this reason
    after = {k: REGISTRY.get_sample_value(*v) for k, v in metric.items()}
    assert (after["group_retries"] - before["group_retries"], after["groups_failed"] - before["groups_failed"]) == (
        retries, 1)
    assert counters.tokens_regenerated > 0  # the failed tries' samples were thrown away, counted
    if mode == "hang":  # 3 tries x 0.2 s limit, each abandoned at the limit: >= 0.6 s; waiting out the 5 s sleep
        # would take >= 3 x 5 = 15 s, so 12 s leaves room for generating the 8 other groups on a loaded machine
        assert 0.6 <= time.monotonic() - t0 < 12.0
    completed = {g.lease.group_id for g in batch.completed}
    assert len(completed) == 8 and failed.group_id not in completed
    assert all(not math.isnan(t.reward) for g in batch.completed for t in g.done.values())
    # the report: complete groups into `ready`, the failed one closed as failed, never ready
    seg = SegmentRef(key="seg-1", sha256="", size=0, rows=16, group_ids=sorted(completed))
    accepted, _ = ledger.add_segment(seg, "replica-0")
    closed = ledger.fail_groups(batch.failed, "replica-0", at=1.0)
    assert sorted(accepted) == sorted(completed) and closed == [failed.group_id]
    assert failed.group_id not in {g.group_id for g in state.ready}
    assert ledger.fail_groups(batch.failed, "replica-0", at=2.0) == []  # a retried report closes nothing
    assert state.groups_failed == 1 and state.failures == [failed]
    # every leased prompt is generated, failed, or still leased: 12 = 8 + 1 + 3 (the other modes' rows)
    assert state.prompt_cursor == state.groups_generated + state.groups_failed + len(state.open_leases) + len(
        state.returned) == 12
    assert failed.group_id not in {lease.group_id for lease in ledger.lease("replica-0", 5)}  # never leased again
    status = ledger.status("running", 10, 0)
    assert status.groups_failed == 1 and status.failures[0].reason == REASON[mode]
    assert any(e.kind == "group_failed" and e.subject == REASON[mode] for e in status.events)


def test_only_the_lease_holder_fails_a_group():
    from laminar.contract import FailedGroup

    ledger = Ledger(RunState(run_id="r"))
    (lease,) = ledger.lease("replica-0", 1)
    failure = FailedGroup(lease.group_id, lease.prompt_id, "raised")
    ledger.release_leases_of("replica-0", keep=set())  # replica-0 restarted: its lease went back to the pool
    assert ledger.fail_groups([failure], "replica-0") == []  # its old process's failure: the group is retried
    (again,) = ledger.lease("replica-1", 1)
    assert again.group_id == lease.group_id
    assert ledger.fail_groups([failure], "replica-0") == []  # nor does it fail replica-1's lease
    assert ledger.fail_groups([failure], "replica-1") == [lease.group_id]
    assert ledger.state.groups_failed == 1 and not ledger.state.open_leases and not ledger.state.returned
    # a group that already completed is not failed afterwards (a late, stale failure report)
    (other,) = ledger.lease("replica-1", 1)
    ledger.add_segment(SegmentRef(key="s", sha256="", size=0, rows=2, group_ids=[other.group_id]))
    assert ledger.fail_groups([FailedGroup(other.group_id, other.prompt_id, "nan")], "replica-1") == []
    assert ledger.state.groups_failed == 1


# -- barrier modes: a batch with a failed group trains on the groups it has -------------------------------


@pytest.mark.parametrize(("mode", "minibatches", "failing", "expected_steps"), [
    # sync, B = 2: batch 0 is prompts 0, 1; prompt 1 fails, so step 0 trains on prompt 0's group alone
    ("sync", 1, 1, [["g00000000"]]),
    # ... both fail: step 0 is empty (no update; the version advances, so the barrier moves on)
    ("sync", 1, 2, [[]]),
    # stream, B = 4 in 2 minibatches of 2: prompt 3 fails; minibatch 0 takes 2 groups, minibatch 1 the one left
    ("stream", 2, 1, [["g00000000", "g00000001"], ["g00000002"]]),
])
def test_a_barrier_mode_trains_a_batch_short_of_its_failed_groups(mode, minibatches, failing, expected_steps):
    from laminar.contract import FailedGroup
    from laminar.policy import policy_for

    b = 2 * minibatches
    cfg = _cfg(f"run.mode={mode}", f"trainer.groups_per_step={b}", f"trainer.minibatches={minibatches}",
               "rollout.max_ready_groups=16")
    policy = policy_for(cfg)
    ledger = Ledger(RunState(run_id="r"))
    leases = ledger.lease("replica-0", b)
    good, bad = leases[:-failing], leases[-failing:]
    if good:
        ledger.add_segment(SegmentRef(key="s", sha256="", size=0, rows=0, group_ids=[g.group_id for g in good]))
    if minibatches == 1:
        assert ledger.trainable(policy) is None  # the failed prompts' groups are still leased: wait for them
    ledger.fail_groups([FailedGroup(g.group_id, g.prompt_id, "timeout") for g in bad], "replica-0")
    assert ledger.settled(policy, 0)
    steps = []
    while (ids := ledger.trainable(policy)) is not None and len(steps) < 5:
        steps.append(ids)
        ledger.state.ready = [g for g in ledger.state.ready if g.group_id not in ids]
        ledger.state.step += 1
    assert steps == expected_steps
    # batch 1 may be leased now: the barrier counts the failed group as settled
    assert ledger.state.groups_generated + ledger.state.groups_failed == b


def test_a_batch_without_failures_is_never_settled_early():
    from laminar.policy import policy_for

    policy = policy_for(_cfg("run.mode=sync", "trainer.groups_per_step=2"))
    ledger = Ledger(RunState(run_id="r"))
    a, _ = ledger.lease("replica-0", 2)
    ledger.add_segment(SegmentRef(key="s", sha256="", size=0, rows=0, group_ids=[a.group_id]))
    assert not ledger.settled(policy, 0) and ledger.trainable(policy) is None


def test_the_tiny_models_fingerprint_follows_the_prompt_files_content(tmp_path):
    # the tiny tokenizer's vocabulary comes from the file: an edited file at the same path builds a new model
    from laminar.rl.base_model import fingerprint

    path = tmp_path / "p.jsonl"
    path.write_text(PROMPTS.read_text())
    cfg = _cfg("task.name=file", f"task.prompts={path}")
    before = fingerprint(cfg)
    assert fingerprint(cfg) == before
    path.write_text(PROMPTS.read_text() + '{"prompt": "copy : new words", "answer": "new words"}\n')
    assert fingerprint(cfg) != before


def test_a_prompt_the_engine_cannot_admit_fails_its_group_not_the_replica(tmp_path):
    # max_prompt_len = 16 (the engine of _engine): a 1 + 2 + 20 = 23-token prompt cannot be admitted
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "long", "prompt": "copy : " + " ".join(["red"] * 20), "answer": "red"}) + "\n"
                    + json.dumps({"id": "short", "prompt": "copy : red", "answer": "red"}) + "\n")
    task = CopyTask(prompts=FilePrompts(path, shuffle=False))
    ledger = Ledger(RunState(run_id="r"))
    long, short = ledger.lease("replica-0", 2)
    batch = Batch(_engine(task, 4), task, "r", "replica-0", 2, time.monotonic, max_group_retries=2)
    batch.admit([long, short])
    assert [(f.group_id, f.reason, f.attempts, f.source_id) for f in batch.failed] == [
        (long.group_id, "generation", 3, "long")]
    assert "max_prompt_len" in batch.failed[0].detail
    while batch.engine.in_flight():
        batch.record(batch.engine.step())
    assert [g.lease.group_id for g in batch.completed] == [short.group_id]


def test_a_task_path_stored_before_the_installed_namespace_still_loads():
    """Configs written before every package moved under `laminar.` name built-ins as `envs.tasks.math:MathTask`."""
    from laminar.envs.tasks.loader import resolve_task_class
    from laminar.envs.tasks.math import MathTask

    assert resolve_task_class("envs.tasks.math:MathTask") is MathTask
