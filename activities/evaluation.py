"""The `record_eval` activity (control worker): a closed eval round's record, stored as `laminar eval` stores one
(services/evaluate.py store_record). The workflow schedules it once per round (workflows/evaluation.py); a retry
writes the same record again, so the store holds one record per evaluated version."""

from __future__ import annotations

import asyncio

from temporalio import activity

from laminar import contract
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
        return summary.accuracy
