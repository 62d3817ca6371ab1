"""The `record_eval` activity (control worker): a closed eval round's record, stored as `laminar eval` stores one
(services/eval_records.py store_record), and its figures on the control worker's metrics endpoint
(laminar/metrics.py `laminar_eval_*`). The workflow schedules it once per round (workflows/evaluation.py); a retry
writes the same record again, so the store holds one record per evaluated version."""

from __future__ import annotations

import asyncio

from temporalio import activity

from laminar import contract, metrics
from laminar.config import RunConfig
from laminar.contract import RecordEvalInput
from storage.objects import ObjectStore


class EvalActivities:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    @activity.defn(name=contract.RECORD_EVAL)
    async def record_eval(self, inp: RecordEvalInput) -> float:
        """Store the record; returns its accuracy (pass@1)."""
        from services.eval_records import EvalTarget, store_record

        cfg = RunConfig.from_json(inp.config)
        target = EvalTarget(inp.run_id, inp.policy_version, f"{inp.run_id}@{inp.policy_version}:during-training")
        summary, _ = await asyncio.to_thread(store_record, self.store, cfg, inp.results, target, inp.wall_s,
                                             duplicates=inp.duplicates, during_training=True)
        metrics.observe_eval(inp.run_id, inp.policy_version, summary.accuracy, summary.accuracy_stderr,
                             summary.failures)
        return summary.accuracy
