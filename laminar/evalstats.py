"""The figures of a held-out evaluation, from each prompt's sample rewards (pure; shared by `laminar eval`,
rl/evaluation.py, and the workflow's eval rounds, workflows/eval_rounds.py).

A sample whose reward failed is None: scored 0 in the accuracies, left out of mean_reward, counted in failures.

Per prompt i with n = eval.samples responses, c_i of them passing (reward >= eval.pass_threshold):
- accuracy = pass@1 = mean_i c_i / n (the unbiased pass@1 estimator; with greedy n = 1 it is the share right);
- pass@k = mean_i [c_i > 0] (k = n);
- mean@k = mean_i (mean reward of prompt i's n samples, failures as 0);
- accuracy_stderr = the standard error over prompts of c_i / n: sqrt(var / N), var with N - 1. The eval's own
  noise: two policies whose accuracies differ by less than about twice it are not told apart by this set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


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


def due_versions(steps: int, every_steps: int, at_start: bool, at_end: bool) -> list[int]:
    """The policy versions a run of `steps` steps evaluates, ascending.
    Worked example: steps 25, every 10, start and end -> [0, 10, 20, 25]."""
    due = set(range(every_steps, steps + 1, every_steps)) if every_steps > 0 else set()
    if at_start:
        due.add(0)
    if at_end:
        due.add(steps)
    return sorted(due)
