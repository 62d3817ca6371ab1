"""The `record_eval` activity (control worker): a closed eval round's record, stored as `laminar eval` stores one
(services/eval_records.py store_record), and its figures on the control worker's metrics endpoint
(laminar/metrics.py `laminar_eval_*`) and in the run's trackers (services/tracking.py EvalTrackers). The workflow schedules it once per round (workflows/evaluation.py); a retry
writes the same record again, so the store holds one record per evaluated version."""

from __future__ import annotations

import asyncio
from pathlib import Path

from temporalio import activity

from laminar import contract, metrics
from laminar.config import RunConfig
from laminar.contract import RecordEvalInput
from laminar.storage.objects import ObjectStore


class EvalActivities:
    def __init__(self, store: ObjectStore, home: Path) -> None:
        self.store, self.home = store, home
        self.trackers = asyncio.Lock()  # one tracker write at a time: one MLflow run per run id, never two created

    @activity.defn(name=contract.RECORD_EVAL)
    async def record_eval(self, inp: RecordEvalInput) -> float:
        """Store the record; returns its accuracy (pass@1)."""
        from laminar.services.eval_records import EvalTarget, store_record
        from laminar.services.tracking import enabled

        cfg = RunConfig.from_json(inp.config)
        target = EvalTarget(inp.run_id, inp.policy_version, f"{inp.run_id}@{inp.policy_version}:during-training")
        summary, _ = await asyncio.to_thread(store_record, self.store, cfg, inp.results, target, inp.wall_s,
                                             duplicates=inp.duplicates, releases=inp.releases,
                                             during_training=True)
        metrics.observe_eval(inp.run_id, inp.policy_version, summary.accuracy, summary.accuracy_stderr,
                             summary.failures)
        if enabled(cfg):
            async with self.trackers:
                await asyncio.to_thread(self._track, cfg, inp.run_id, inp.policy_version)
        return summary.accuracy

    def _track(self, cfg: RunConfig, run_id: str, version: int) -> None:
        """The run's trackers get this round; TensorBoard the whole series, from the records (services/tracking.py)."""
        from laminar.services.eval_records import read_evals
        from laminar.services.tracking import EvalTrackers, eval_scalars

        series = {int(r["policy_version"]): eval_scalars(r) for r in read_evals(self.store, run_id)}
        EvalTrackers(run_id, cfg, self.home).log(version, series)
