"""Held-out evaluation during training (workflows/evaluation.py, services/rollout/evaluation.py) on the real stack:
eval rounds at eval.at_start, every eval.every_steps and eval.at_end, scored on the rollout replicas' eval engines,
one record per due version in the store, every prompt scored once, and the training accounting untouched."""

from __future__ import annotations

import pytest

from laminar.client.run_control import start_workflow
from laminar.config import RunConfig
from laminar.contract import RunStatus
from laminar.evalstats import due_versions
from laminar.services.eval_records import read_evals
from tests.fixtures.stack import small_config

EVAL = ["task.name=math", "rollout.max_new_tokens=8", "eval.size=12", "eval.samples=2", "eval.temperature=1.0",
        "eval.at_start=true", "eval.every_steps=2", "eval.at_end=true", "run.steps=5",
        "run.continue_as_new_every=2"]  # the rounds ride the state across hand-overs


def eval_set_ids(cfg: RunConfig) -> list[str]:
    """The ids of the eval set, as a replica renders it."""
    from laminar.envs.tasks import build_task
    from laminar.rl.evaluation import eval_prompts

    task = build_task(cfg.task, seed=cfg.run.seed)
    return [p.source_id or str(p.prompt_id) for p in eval_prompts(task, cfg.eval)]


def check_rounds(store, cfg: RunConfig, final: RunStatus, versions: list[int] | None = None) -> list[dict]:
    """Every due version (or these, the rounds a stopped run closed) has one record, each with every prompt of
    the set scored once (its k samples)."""
    due = due_versions(cfg.run.steps, cfg.eval.every_steps, cfg.eval.at_start, cfg.eval.at_end)
    records = read_evals(store, cfg.run.run_id)
    found = [r["policy_version"] for r in records]
    assert found == due if versions is None else (found == sorted(set(found)) and set(versions) <= set(found))
    ids = eval_set_ids(cfg)
    for r in records:
        assert [p["id"] for p in r["per_prompt"]] == ids, "the same prompts, in set order, once each"
        assert all(len(p["rewards"]) == cfg.eval.samples for p in r["per_prompt"]), "k samples per prompt"
        assert r["prompts"] == len(ids) and r["during_training"] is True
        assert 0.0 <= r["accuracy"] <= 1.0 and r["failures"] == sum(v is None for p in r["per_prompt"]
                                                                    for v in p["rewards"])
    if versions is None:
        assert final.eval_pending == {}
        assert sorted(s.policy_version for s in final.eval_done) == due, "closed in any order"
    assert all(s.recorded for s in final.eval_done)
    return records


def check_training_untouched(final: RunStatus, cfg: RunConfig) -> None:
    """Eval prompts are not training prompts: the ledger's identities hold as in a run without eval."""
    assert final.phase == "finished" and final.step == cfg.run.steps
    assert final.groups_consumed == cfg.run.steps * cfg.trainer.groups_per_step
    assert final.groups_consumed_twice == 0
    assert final.groups_generated == final.groups_consumed + final.ready_groups
    assert final.prompts_issued == (final.groups_generated + final.groups_failed + final.open_leases
                                    + final.returned_leases)


@pytest.mark.slow  # ~40 s each: a run of 5 steps with 4 eval rounds across continue-as-new
@pytest.mark.parametrize("mode", ["laminar", "sync"])  # sync: a barrier mode, eval adds no barrier of its own
async def test_eval_rounds_during_a_run_record_every_due_version_once(stack, tmp_path, mode):
    cfg = small_config(*EVAL, f"run.mode={mode}", f"tracking.dir={tmp_path}", "tracking.tensorboard=true")
    handle = await start_workflow(stack.client, cfg)
    final: RunStatus = await handle.result(rpc_timeout=None)
    check_training_untouched(final, cfg)
    records = check_rounds(stack.store, cfg, final)
    # each round in the trackers, at its version, written by the control worker (services/tracking.py EvalTrackers)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard" / cfg.run.run_id / "eval"))
    acc.Reload()
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("eval/accuracy")] == [
        (r["policy_version"], round(r["accuracy"], 4)) for r in records]
    assert final.continued_as_new >= 1, "the rounds rode the state across a hand-over"
