"""Eval records in the store: one per evaluated policy version, at runs/<run id>/evals/step-<version>.json
(storage/keys.py eval_result), written by `laminar eval` (services/evaluate.py) and, during training, by the control
worker's `record_eval` (activities/evaluation.py). Imports no torch: the control process writes them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from laminar.config import RunConfig
from laminar.evalstats import EvalSummary, PromptResult, summarise
from laminar.logs import get_logger
from laminar.rl.evaluation import eval_record
from laminar.storage import keys
from laminar.storage.objects import ObjectStore

log = get_logger(__name__)


@dataclass(frozen=True)
class EvalTarget:
    """What is evaluated: the run whose records get the result, its policy version, and a label."""

    run_id: str
    policy_version: int
    source: str



def store_record(store: ObjectStore, cfg: RunConfig, results: list[PromptResult], target: EvalTarget,
                 wall_s: float, **extra: Any) -> tuple[EvalSummary, str]:
    """Summarise the prompts' results and store the record at runs/<run id>/evals/step-<version>.json (replacing
    one there): `laminar eval`'s, and a closed eval round's during training (activities/evaluation.py)."""
    summary = summarise(results, cfg.eval.samples, cfg.eval.pass_threshold)
    record = eval_record(cfg, summary, results, run_id=target.run_id, policy_version=target.policy_version,
                         source=target.source, wall_s=wall_s) | extra
    key = keys.eval_result(target.run_id, target.policy_version)
    store.put(key, json.dumps(record).encode())
    log.info("eval_completed", run_id=target.run_id, policy_version=target.policy_version, prompts=summary.prompts,
             accuracy=round(summary.accuracy, 4), failures=summary.failures, wall_s=round(wall_s, 2),
             source=target.source)
    return summary, key


def read_evals(store: ObjectStore, run_id: str) -> list[dict[str, Any]]:
    """The run's eval records, by policy version."""
    out = [json.loads(store.get(k)) for k in store.list(keys.evals_prefix(run_id)) if k.endswith(".json")]
    return sorted(out, key=lambda r: r["policy_version"])
