"""`TextTask`: a task made of a token-free prompt source and a text reward (envs/tasks/__init__.py).

A subclass gives `score(prompt, response_text) -> float` (or an async def): 0.0 for a wrong answer; raising
is a failure (envs/tasks/scoring.py). Rendering: `messages` through the model's chat template when it has one
(Jinja, with add_generation_prompt), otherwise "role: content" lines; a plain `prompt` is used as it is, or as
one user message when there is a chat template. The tiny word-level tokenizer (built from `words()` when the
run has no tokenizer yet) encodes words it does not know as <pad>.
"""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable
from typing import Any

from laminar.envs.tasks import Prompt, PromptRow, PromptSource
from laminar.envs.tasks.tokenizer import build_word_tokenizer, special_ids


def render(row: PromptRow, chat_template: str | None, bos_token: str = "") -> str:
    """The prompt text the model sees; a chat template writes the model's bos_token itself where it wants one."""
    messages = row.messages if row.messages is not None else None
    if chat_template:
        import jinja2

        env = jinja2.Environment(autoescape=False, trim_blocks=True, lstrip_blocks=True)
        msgs = messages or [{"role": "user", "content": row.prompt or ""}]
        return env.from_string(chat_template).render(messages=msgs, add_generation_prompt=True,
                                                     bos_token=bos_token, eos_token="")
    if messages is None:
        return row.prompt or ""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def answer_text(answer: Any) -> str:
    if answer is None:
        return ""
    return answer if isinstance(answer, str) else json.dumps(answer)


class TextTask:
    """Prompts from `source`, reward from `score` on the decoded response (up to <eos>)."""

    name = "text"

    def __init__(self, *, source: PromptSource, seed: int = 0, tokenizer: Any = None,
                 chat_template: str | None = None) -> None:
        self.source, self.seed, self.chat_template = source, seed, chat_template
        self.tokenizer = tokenizer or build_word_tokenizer(self.words())
        ids = special_ids(self.tokenizer)
        self.bos_id, self.eos_id, self.pad_id = ids["bos"], ids["eos"], ids["pad"]

    def words(self) -> list[str]:
        return [*self.source.words(), *self.extra_words()]

    def extra_words(self) -> list[str]:
        """Words a response may use beyond those of the prompts and answers (for the tiny tokenizer)."""
        return []

    def prompt(self, prompt_id: int) -> Prompt:
        return self.prompt_from_row(self.source.row(prompt_id), prompt_id)

    def prompt_from_row(self, row: PromptRow, prompt_id: int) -> Prompt:
        """A row rendered and encoded as the model sees it (evaluation renders its own rows through this)."""
        # under a chat template the rendered text is the whole prompt (SmolLM2's starts with <|im_start|>, its bos)
        bos = (self.tokenizer.id_to_token(self.bos_id) or "") if self.chat_template else ""
        text = render(row, self.chat_template, bos)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        ids = ids if self.chat_template else [self.bos_id, *ids]
        meta = {"answer": row.answer, "metadata": row.metadata, "id": row.id}
        return Prompt(prompt_id=prompt_id, text=text, token_ids=ids, answer_meta=meta, source_id=row.id)

    def response_text(self, response_ids: list[int]) -> str:
        body = list(response_ids)
        if self.eos_id in body:
            body = body[: body.index(self.eos_id)]
        return self.tokenizer.decode(body, skip_special_tokens=True)

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float | Awaitable[float]:
        return self.score(prompt, self.response_text(response_ids))

    def score(self, prompt: Prompt, response_text: str) -> float | Awaitable[float]:
        """1.0 when the response is the answer (whitespace-normalised), else 0.0. Override for a real checker."""
        want = " ".join(answer_text(prompt.answer_meta.get("answer")).split())
        return 1.0 if " ".join(response_text.split()) == want else 0.0

    def demonstration(self, prompt: Prompt, rng: random.Random, accuracy: float) -> list[int]:
        """The answer's words, each kept with probability `accuracy` (else a random word of the vocabulary),
        then <eos>: the tiny model's warm-up learns the format, RL the content."""
        vocab = [w for w in self.words() if self.tokenizer.token_to_id(w) is not None] or ["<pad>"]
        want = answer_text(prompt.answer_meta.get("answer")).split() or [rng.choice(vocab)]
        words = [w if rng.random() < accuracy else rng.choice(vocab) for w in want]
        return [*self.tokenizer.encode(" ".join(words), add_special_tokens=False).ids, self.eos_id]


class FileTask(TextTask):
    """A task whose prompts come from task.prompts (a JSONL or Parquet file) and whose reward is exact match with
    the row's `answer`; subclass it and override `score` for another checker."""

    name = "file"

    def __init__(self, *, prompts: PromptSource, seed: int = 0, tokenizer: Any = None,
                 chat_template: str | None = None) -> None:
        super().__init__(source=prompts, seed=seed, tokenizer=tokenizer, chat_template=chat_template)
