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

from laminar.config import EvalSection, RunConfig
from laminar.envs.tasks import Prompt, RewardFailure
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
        from laminar.envs.tasks.prompt_file import FilePrompts

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
    batch = EvalBatch(engine, task, samples, reward_timeout_s)
    for i, prompt in enumerate(prompts):
        batch.add(i, prompt)
    while batch.busy():
        batch.step()
    return [batch.results[i] for i in range(len(prompts))]


class EvalBatch:
    """Eval prompts through an engine, one engine step at a time: each prompt's `samples` samples, each scored once
    with the training reward; a prompt is done when all its samples are scored or failed. `laminar eval` runs it to
    the end (generate_and_score); a rollout replica steps it between its own steps (services/rollout/evaluation.py)."""

    def __init__(self, engine: Any, task: Any, samples: int, reward_timeout_s: float) -> None:
        self.engine, self.task, self.samples, self.reward_timeout_s = engine, task, samples, reward_timeout_s
        self.prompts: dict[Any, Prompt] = {}
        self.results: dict[Any, PromptResult] = {}
        self.queue: list[tuple[Any, int]] = []  # (key, sample) not yet in the engine, next last

    def add(self, key: Any, prompt: Prompt) -> None:
        self.prompts[key] = prompt
        self.results[key] = PromptResult(id=prompt.source_id or str(prompt.prompt_id))
        self.queue[:0] = [(key, k) for k in reversed(range(self.samples))]

    def busy(self) -> bool:
        return bool(self.queue) or self.engine.in_flight() > 0

    def done(self, key: Any) -> bool:
        return len(self.results[key].rewards) == self.samples

    def step(self) -> list[Any]:
        """Admit what fits, one engine step, score what finished; the keys completed by it."""
        from laminar.envs.tasks.scoring import score

        touched = []
        while self.queue and self.engine.free_slots():
            key, k = self.queue.pop()
            try:
                self.engine.add(f"{_token(key)}/{k}", self.prompts[key].token_ids)
            except EngineError as e:
                self.results[key].rewards.append(None)
                self.results[key].failures.append(f"generation: {e}")
                touched.append(key)
        keys = {_token(key): key for key in self.prompts}
        for f in self.engine.step():
            key = keys[f.request_id.rsplit("/", 1)[0]]
            result = self.results[key]
            result.lengths.append(len(f.response_ids))
            try:
                result.rewards.append(score(self.task, self.prompts[key], f.response_ids, self.reward_timeout_s))
            except RewardFailure as e:
                result.rewards.append(None)
                result.failures.append(f"{e.reason}: {e.detail}"[:200])
            touched.append(key)
        return [key for key in dict.fromkeys(touched) if self.done(key)]

    def pop(self, key: Any) -> PromptResult:
        """A done prompt's result, forgotten here."""
        self.prompts.pop(key)
        return self.results.pop(key)


def _token(key: Any) -> str:
    return "e" + "-".join(str(k) for k in key) if isinstance(key, tuple) else f"e{key}"


def eval_record(cfg: RunConfig, summary: EvalSummary, results: list[PromptResult], *, run_id: str,
                policy_version: int, source: str, wall_s: float) -> dict[str, Any]:
    """The record `laminar eval` stores (storage/keys.py eval_result): summary, settings and every prompt's
    rewards, so a reader can recompute any figure."""
    return {"run_id": run_id, "policy_version": policy_version, "source": source, **asdict(summary),
            "temperature": cfg.eval.temperature, "pass_threshold": cfg.eval.pass_threshold,
            "prompt_set": cfg.eval.prompts or f"task:{cfg.task.name}:heldout", "wall_s": round(wall_s, 3),
            "time": time.time(), "per_prompt": [asdict(r) for r in results]}
