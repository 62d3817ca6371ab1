"""Verifiable-reward tasks, one small module per task with the same interface.

A task is built from its parameters and answers:
- `words() -> list[str]`: the vocabulary its prompts and answers use (for the tiny tokenizer);
- `prompt(prompt_id) -> Prompt`: deterministic from (seed, prompt_id);
- `reward(prompt, response_ids) -> float` in [0, 1];
- `demonstration(prompt, rng, accuracy) -> list[int]`: a plausible, imperfect response, used only
  for the supervised warm-up that makes the tiny base model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from laminar.errors import ConfigError


@dataclass(frozen=True)
class Prompt:
    """One prompt: its id, text, token ids (starting with <bos>) and what the verifier needs."""

    prompt_id: int
    text: str
    token_ids: list[int]
    answer_meta: dict[str, Any] = field(default_factory=dict)


def _registry() -> dict[str, type]:
    from rl.tasks.repeat import RepeatTask

    return {"repeat": RepeatTask}


def known_tasks() -> list[str]:
    return sorted(_registry())


def get_task(name: str, **params):
    """Build task `name` with its parameters (seed, max_count, tokenizer, ...)."""
    registry = _registry()
    if name not in registry:
        raise ConfigError(
            f"task.name={name!r} is not a known task; known tasks: {', '.join(sorted(registry))}"
        )
    return registry[name](**params)


__all__ = ["Prompt", "get_task", "known_tasks"]
