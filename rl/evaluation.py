"""Held-out evaluation: the prompts, the generation with an engine, the scoring and the summary record
(docs/evaluation.md). No Temporal, no store: `laminar eval` (cli/eval.py) drives it in one process.

Scoring is the training reward's: `task.reward` through envs.tasks.scoring.score with task.reward_timeout_s, so an
eval and a training group agree on what a right answer is. A sample whose reward cannot be computed, or whose
prompt the engine cannot admit, is a failure: counted in `failures`, scored 0 in the accuracies (never dropped, so
a failing checker cannot raise accuracy), and left out of mean_reward.

The figures (accuracy = pass@1, pass@k, mean@k, their standard error) are laminar/evalstats.py's.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from envs.tasks import Prompt, RewardFailure
from laminar.config import EvalSection, RunConfig
from laminar.errors import ConfigError, EngineError
from laminar.evalstats import EvalSummary, PromptResult


def eval_prompts(task: Any, section: EvalSection, prompts_file: str = "") -> list[Prompt]:
    """The evaluation prompts: the first eval.size rows of prompts_file (or eval.prompts), in file order, else the
    task's held-out split (`heldout_rows`); rendered and encoded as training prompts are (`prompt_from_row`)."""
    path = prompts_file or section.prompts
    if not hasattr(task, "prompt_from_row"):
        raise ConfigError(f"task {type(task).__name__} renders no prompt rows, so it cannot be evaluated on held-out "
                          "prompts; evaluate a text task (math, file, a TextTask subclass)")
    if path:
        from envs.tasks.prompt_file import FilePrompts

        source = FilePrompts(path, shuffle=False)
        rows = [source.rows[i] for i in range(min(section.size, len(source)))]
    elif hasattr(task, "heldout_rows"):
        rows = task.heldout_rows(section.size)
    else:
        raise ConfigError(f"task {getattr(task, 'name', type(task).__name__)!r} has no held-out split; set "
                          "eval.prompts (or --prompts) to a JSONL or Parquet file of evaluation prompts")
    if not rows:
        raise ConfigError("the evaluation prompt set is empty; set eval.prompts to a file with rows")
    return [task.prompt_from_row(row, i) for i, row in enumerate(rows)]


def generate_and_score(engine: Any, task: Any, prompts: list[Prompt], samples: int,
                       reward_timeout_s: float) -> list[PromptResult]:
    """Every prompt's `samples` responses from the engine (continuous batching), each scored once."""
    from envs.tasks.scoring import score

    results = [PromptResult(id=p.source_id or str(p.prompt_id)) for p in prompts]
    pending = [(i, k) for i in range(len(prompts)) for k in range(samples)]
    pending.reverse()
    while pending or engine.in_flight():
        while pending and engine.free_slots():
            i, k = pending.pop()
            try:
                engine.add(f"{i}/{k}", prompts[i].token_ids)
            except EngineError as e:
                results[i].rewards.append(None)
                results[i].failures.append(f"generation: {e}")
        for f in engine.step():
            i = int(f.request_id.split("/")[0])
            results[i].lengths.append(len(f.response_ids))
            try:
                results[i].rewards.append(score(task, prompts[i], f.response_ids, reward_timeout_s))
            except RewardFailure as e:
                results[i].rewards.append(None)
                results[i].failures.append(f"{e.reason}: {e.detail}"[:200])
    return results


def eval_record(cfg: RunConfig, summary: EvalSummary, results: list[PromptResult], *, run_id: str,
                policy_version: int, source: str, wall_s: float) -> dict[str, Any]:
    """The record `laminar eval` stores (storage/keys.py eval_result): summary, settings and every prompt's
    rewards, so a reader can recompute any figure."""
    return {"run_id": run_id, "policy_version": policy_version, "source": source, **asdict(summary),
            "temperature": cfg.eval.temperature, "pass_threshold": cfg.eval.pass_threshold,
            "prompt_set": cfg.eval.prompts or f"task:{cfg.task.name}:heldout", "wall_s": round(wall_s, 3),
            "time": time.time(), "per_prompt": [asdict(r) for r in results]}
