"""Tasks: prompts plus a reward. The interface every task implements, and where tasks come from.

Naming a task (config `task.name`, resolved by `envs.tasks.loader.resolve_task_class`):
- a built-in: `"repeat"` (the default; envs/tasks/repeat.py), and the others in `loader.BUILTIN`;
- `"package.module:Class"`: any importable class;
- an entry point in the `laminar.tasks` group (`[project.entry-points."laminar.tasks"] mytask = "pkg.mod:Cls"`).

Building one (`envs.tasks.loader.build_task(cfg.task, seed=..., tokenizer=...)`): the class is called with the
keyword arguments its constructor accepts, of `seed` (run.seed), `tokenizer` (the run's `tokenizers.Tokenizer`,
or None while the tiny base model is being built: the task then builds its own word-level tokenizer from
`words()`), `chat_template` (the model's Jinja chat template, or None), `max_count` (task.max_count),
`prompts` (a `FilePrompts` over task.prompts, or None when it is empty) and every key of `task.params`. A
`task.params` key or a `task.prompts` file the class does not accept is a ConfigError, never dropped.

The `Task` protocol (what the replica, the sync loop and the base-model builder call):
- `tokenizer`, `bos_id`, `eos_id`, `pad_id`;
- `words() -> list[str]`: the vocabulary its prompts and answers use (for the tiny word-level tokenizer);
- `prompt(prompt_id: int) -> Prompt`: deterministic from (seed, prompt_id); prompt ids are 0, 1, 2, ... in
  lease order (a file source cycles through its rows, in a seeded order per pass);
- `reward(prompt, response_ids) -> float` or an awaitable of one: in [0, 1] by convention; a *wrong* answer is
  0.0. Anything else is a failure, not a reward (below);
- `demonstration(prompt, rng, accuracy) -> list[int]` (optional): a plausible, imperfect response for the tiny
  model's supervised warm-up (model.pretrain_steps > 0 needs it).

Prompt source and reward are separate (`PromptSource`, `TextTask` in envs/tasks/text.py): a source yields
token-free `PromptRow`s (a seeded generator, or `FilePrompts` over a JSONL / Parquet file with columns id,
prompt or messages, answer, metadata: docs/guides/tasks.md); `TextTask` renders a row with the chat template where
the model has one (otherwise the plain text, or "role: content" lines for messages), encodes it, decodes the
response up to <eos> and calls its `score(prompt, response_text)`, sync or async. A math task is a TextTask
with a generator source and an answer checker; a tool-calling environment is a TextTask whose episode runs in
the replica's environment loop (services/rollout/__init__.py).

Failure semantics (envs/tasks/scoring.py `score`; the replica's group retry in services/rollout/batch.py): the
reward function raising, running past task.reward_timeout_s, or returning NaN, an infinity or a non-number
(bool included) raises `RewardFailure(reason)`; a prompt the task cannot build or the engine cannot admit is a
`generation` failure. The replica then retries the whole group from its prompt with
a fresh call context, up to task.max_group_retries times; after that the group is reported failed, its lease
is closed once as failed (`groups_failed` in status, summary and metrics; reason and prompt id in the log),
and it is never trained on.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Prompt:
    """One prompt: its id, text, token ids (starting with <bos>) and what the verifier needs.
    source_id: the row's `id` in a prompt file ("" for generated prompts), logged with failures."""

    prompt_id: int
    text: str
    token_ids: list[int]
    answer_meta: dict[str, Any] = field(default_factory=dict)
    source_id: str = ""


@dataclass(frozen=True)
class PromptRow:
    """A token-free prompt as a source gives it: `prompt` (text) or `messages` ([{"role", "content"}, ...]),
    the reference `answer` (any JSON value, None when the verifier needs none) and free `metadata`."""

    id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    answer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)


class RewardFailure(Exception):
    """The reward could not be computed (not a wrong answer): `reason` is one of raised | timeout | nan |
    wrong_type | sandbox | generation, `detail` says what happened."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@runtime_checkable
class PromptSource(Protocol):
    """Where prompts come from, token-free: deterministic in (its seed, prompt_id)."""

    def row(self, prompt_id: int) -> PromptRow: ...
    def words(self) -> list[str]: ...


class Task(Protocol):
    """What the replica, the sync loop and the base-model builder call (see the module docstring)."""

    tokenizer: Any
    bos_id: int
    eos_id: int
    pad_id: int

    def words(self) -> list[str]: ...
    def prompt(self, prompt_id: int) -> Prompt: ...
    def reward(self, prompt: Prompt, response_ids: list[int]) -> float | Awaitable[float]: ...


def known_tasks() -> list[str]:
    from laminar.envs.tasks.loader import BUILTIN

    return sorted(BUILTIN)


def get_task(name: str, **params):
    """Build task `name` (built-in, "package.module:Class" or entry point) with these constructor arguments."""
    from laminar.envs.tasks.loader import resolve_task_class

    return resolve_task_class(name)(**params)


def build_task(section, *, seed: int, tokenizer=None, chat_template: str | None = None):
    """The task of a run's `task` section (envs/tasks/loader.py)."""
    from laminar.envs.tasks.loader import build_task as build

    return build(section, seed=seed, tokenizer=tokenizer, chat_template=chat_template)


__all__ = ["Prompt", "PromptRow", "PromptSource", "RewardFailure", "Task", "build_task",
           "get_task", "known_tasks"]
