"""Held-out evaluation: the prompts, the generation with an engine, the scoring and the summary record
(docs/evaluation.md). No Temporal, no store: `laminar eval` (workers/cli_eval.py) drives it in one process.

Scoring is the training reward's: `task.reward` through rl.tasks.scoring.score with task.reward_timeout_s, so an
eval and a training group agree on what a right answer is. A sample whose reward cannot be computed, or whose
prompt the engine cannot admit, is a failure: counted in `failures`, scored 0 in the accuracies (never dropped, so
a failing checker cannot raise accuracy), and left out of mean_reward.

Per prompt i with n = eval.samples responses, c_i of them passing (reward >= eval.pass_threshold):
- accuracy = pass@1 = mean_i c_i / n (the unbiased pass@1 estimator; with greedy n = 1 it is the share right);
- pass@k = mean_i [c_i > 0] (k = n);
- mean@k = mean_i (mean reward of prompt i's n samples, failures as 0);
- accuracy_stderr = the standard error over prompts of c_i / n: sqrt(var / N), var with N - 1. The eval's own
  noise: two policies whose accuracies differ by less than about twice it are not told apart by this set.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from laminar.config import EvalSection, RunConfig
from laminar.errors import ConfigError, EngineError
from rl.tasks import Prompt, RewardFailure


def eval_prompts(task: Any, section: EvalSection, prompts_file: str = "") -> list[Prompt]:
    """The evaluation prompts: the first eval.size rows of prompts_file (or eval.prompts), in file order, else the
    task's held-out split (`heldout_rows`); rendered and encoded as training prompts are (`prompt_from_row`)."""
    path = prompts_file or section.prompts
    if not hasattr(task, "prompt_from_row"):
        raise ConfigError(f"task {type(task).__name__} renders no prompt rows, so it cannot be evaluated on held-out "
                          "prompts; evaluate a text task (math, file, a TextTask subclass)")
    if path:
        from rl.tasks.prompt_file import FilePrompts

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


@dataclass
class PromptResult:
    """One evaluation prompt's samples: reward per sample (None: the sample failed) and response lengths."""

    id: str
    rewards: list[float | None] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # reasons


@dataclass
class EvalSummary:
    prompts: int
    samples: int
    accuracy: float  # pass@1
    accuracy_stderr: float
    pass_at_k: float
    mean_at_k: float
    mean_reward: float
    response_len_mean: float
    failures: int


def summarise(results: list[PromptResult], samples: int, threshold: float) -> EvalSummary:
    """The module docstring's figures over the prompts' results."""
    n_prompts = len(results)
    per_prompt_pass, per_prompt_mean, scored, lengths, failures = [], [], [], [], 0
    for r in results:
        values = [0.0 if v is None else v for v in r.rewards]
        passed = sum(1 for v in r.rewards if v is not None and v >= threshold)
        per_prompt_pass.append(passed / samples)
        per_prompt_mean.append(sum(values) / samples)
        scored.extend(v for v in r.rewards if v is not None)
        lengths.extend(r.lengths)
        failures += sum(1 for v in r.rewards if v is None)
    accuracy = sum(per_prompt_pass) / n_prompts if n_prompts else 0.0
    var = (sum((a - accuracy) ** 2 for a in per_prompt_pass) / (n_prompts - 1)) if n_prompts > 1 else 0.0
    return EvalSummary(
        prompts=n_prompts, samples=samples, accuracy=accuracy, accuracy_stderr=math.sqrt(var / n_prompts) if n_prompts
        else 0.0, pass_at_k=sum(1 for a in per_prompt_pass if a > 0) / n_prompts if n_prompts else 0.0,
        mean_at_k=sum(per_prompt_mean) / n_prompts if n_prompts else 0.0,
        mean_reward=sum(scored) / len(scored) if scored else 0.0,
        response_len_mean=sum(lengths) / len(lengths) if lengths else 0.0, failures=failures)


def generate_and_score(engine: Any, task: Any, prompts: list[Prompt], samples: int,
                       reward_timeout_s: float) -> list[PromptResult]:
    """Every prompt's `samples` responses from the engine (continuous batching), each scored once."""
    from rl.tasks.scoring import score

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
