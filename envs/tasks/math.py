"""`math`: verifiable arithmetic, offline. Problems from reasoning-gym's seeded generators (`chain_sum`,
`countdown`) or a GSM8K-format JSONL file on disk (`gsm8k`); the answer is read from `<answer>...</answer>`.

Configured by task.params: `generator` ("chain_sum" | "countdown" | "gsm8k"), `levels` (a difficulty
curriculum: a list of reasoning-gym config overrides, e.g. `[{max_terms = 2, max_digits = 1}, {max_terms = 3,
max_digits = 2}]`), `prompts_per_level` (prompt ids per level), `path` (the GSM8K file), `instruction` (the line
after each problem, for a real tokenizer; default INSTRUCTION), `answer` ("tag", the default, or "last_number":
chain_sum only, the last number of a response that has no tag, for a model that never writes the tag).

Curriculum: prompt id p (leased 0, 1, 2, ... in order) is at level min(p // prompts_per_level, levels - 1), so
difficulty rises as the run goes on; each level is its own reasoning-gym dataset, seeded from (seed, level), and
p is its item index, so a prompt is deterministic in (seed, p). The tiny model's warm-up draws prompt ids from
WARMUP_IDS up (rl/base_model.py); those are spread over all levels (level p % levels).

Two renderings. With the tiny word-level tokenizer (no tokenizer yet, or a WordLevel one) the prompt is compact
and every digit and operator is its own word: chain_sum `4 + 1 3 =` (4 + 13), countdown `3 , 1 2 , 5 = 2 0`
(make 20 from 3, 12 and 5); the response `<answer> 1 7 </answer>` decodes by joining its tokens, to
`<answer>17</answer>`. With a real tokenizer the prompt is reasoning-gym's question (GSM8K's) plus INSTRUCTION.

Held-out split (`heldout_rows`, the `[eval]` section's default prompts): one problem in HOLDOUT_BUCKETS, chosen by a
hash of its text (chain_sum: the expression; countdown: numbers and target), is held out. The training stream and
the warm-up never show a held-out problem (a prompt id whose item is held out takes the next item of a fixed
stride that is not), and the split is drawn from datasets seeded apart from the training ones, round-robin over
every curriculum level (the hardest included), distinct problems only. A small problem space holds few: chain_sum's
one-digit level has 200 problems (a +- b, a and b in 0..9), so about 25 held out.

Reward (envs/tasks/answers.py), 1.0 or 0.0, never partial credit:
- chain_sum: the tag's text, validated as arithmetic, equals the answer exactly (after removing whitespace); with
  `answer = "last_number"`, a response without a tag is scored on the last number it writes;
- countdown: the tag's text, validated as arithmetic BEFORE reasoning-gym's scorer sees it (that scorer runs
  sympy's `parse_expr`, which executes code), uses exactly the given numbers and equals the target;
- gsm8k: the tag's text, validated as a short free-form answer, equals the `#### n` answer by math-verify.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from typing import Any

from laminar.envs.tasks import Prompt, PromptRow
from laminar.envs.tasks.answers import (
    arithmetic_answer,
    exact_match,
    extract_answer,
    last_number,
    math_verify_match,
)
from laminar.envs.tasks.text import TextTask
from laminar.errors import ConfigError

GENERATORS = ("chain_sum", "countdown", "gsm8k")
WARMUP_IDS = 10**9  # rl/base_model.py draws warm-up prompts from ids at and above this
HOLDOUT_BUCKETS = 8  # one problem in this many (by a hash of its text) is held out of training for evaluation
HOLDOUT_STRIDE = 1_000_003  # a training prompt id whose item is held out takes item id + k * this (k = 1, 2, ...)
HOLDOUT_SCAN = 2000  # items of each level's evaluation dataset scanned for held-out problems (count)
DIGITS = tuple(str(d) for d in range(10))
SYMBOLS = ("+", "-", "*", "/", "(", ")", "=", ",", ".")
OPEN, CLOSE = "<answer>", "</answer>"
INSTRUCTION = "Give only the final answer inside <answer></answer>, for example <answer>42</answer>."
ANSWER_FORMATS = ("tag", "last_number")  # task.params.answer: what a chain_sum response's answer is

DEFAULT_LEVELS: dict[str, list[dict[str, Any]]] = {
    # reasoning-gym's own curriculum steps for chain_sum: terms 2..12, digits 1..10
    "chain_sum": [{"max_terms": 2, "max_digits": 1}, {"max_terms": 3, "max_digits": 1},
                  {"max_terms": 3, "max_digits": 2}, {"max_terms": 4, "max_digits": 2},
                  {"max_terms": 5, "max_digits": 3}],
    "countdown": [{"min_numbers": 3, "max_numbers": 3, "max_value": 20, "min_target": 10, "max_target": 100},
                  {"min_numbers": 3, "max_numbers": 4, "max_value": 50, "min_target": 10, "max_target": 500},
                  {}],  # {}: reasoning-gym's defaults (4-6 numbers up to 100, target 100..999)
}
BASE_CONFIG: dict[str, dict[str, Any]] = {
    # the lower bounds a level's `max_*` ranges start from
    "chain_sum": {"min_terms": 2, "min_digits": 1, "allow_negation": False},
    "countdown": {},
}


def spaced(text: str) -> str:
    """Every non-space character as its own word: `"12 + 3 ="` -> `"1 2 + 3 ="`."""
    return " ".join(ch for ch in text if not ch.isspace())


def curriculum_level(prompt_id: int, levels: int, prompts_per_level: int) -> int:
    """The difficulty level of prompt_id: min(prompt_id // prompts_per_level, levels - 1); a warm-up prompt id
    (at or above WARMUP_IDS) is at level prompt_id % levels."""
    if prompt_id >= WARMUP_IDS:
        return prompt_id % levels
    return min(prompt_id // prompts_per_level, levels - 1)


def problem_key(generator: str, metadata: dict[str, Any]) -> str:
    """The text that identifies a problem: chain_sum's expression, countdown's numbers and target."""
    if generator == "chain_sum":
        return f"chain_sum:{''.join(str(metadata['expression']).split())}"
    return f"countdown:{sorted(metadata['numbers'])}:{metadata['target']}"


def is_held_out(key: str) -> bool:
    """One problem in HOLDOUT_BUCKETS, by the first 8 hex digits of sha256(key)."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % HOLDOUT_BUCKETS == 0


def _is_word_level(tokenizer: Any) -> bool:
    if tokenizer is None:
        return True
    import json

    return json.loads(tokenizer.to_str()).get("model", {}).get("type") == "WordLevel"


class GeneratedPrompts:
    """A `PromptSource` over reasoning-gym's seeded `chain_sum` or `countdown` generator with a curriculum."""

    def __init__(self, generator: str, *, seed: int, levels: list[dict[str, Any]], prompts_per_level: int,
                 compact: bool, instruction: str = INSTRUCTION) -> None:
        if not isinstance(levels, list) or not levels or not all(isinstance(lv, dict) for lv in levels):
            raise ConfigError(f"task.params.levels={levels!r} must be a non-empty list of tables of reasoning-gym "
                              f"{generator} config fields, e.g. [{{max_terms = 2, max_digits = 1}}]")
        if not isinstance(prompts_per_level, int) or prompts_per_level < 1:
            raise ConfigError(f"task.params.prompts_per_level={prompts_per_level!r} must be a positive integer")
        self.generator, self.seed, self.compact, self.instruction = generator, seed, compact, instruction
        self.prompts_per_level = prompts_per_level
        self.datasets = self._datasets(levels, "math")
        self._levels = levels

    def _datasets(self, levels: list[dict[str, Any]], purpose: str) -> list[Any]:
        """One seeded reasoning-gym dataset per level; purpose "math" (training) or "math-eval" (held-out split)."""
        import reasoning_gym

        generator, seed, out = self.generator, self.seed, []
        for i, overrides in enumerate(levels):
            bad = sorted({"seed", "size"} & set(overrides))
            if bad:
                raise ConfigError(f"task.params.levels[{i}] sets {', '.join(bad)}; the task seeds each level from "
                                  f"run.seed, remove them")
            level_seed = random.Random(f"{purpose}:{generator}:{seed}:{i}").randrange(2**31)
            try:
                ds = reasoning_gym.create_dataset(generator, seed=level_seed, size=WARMUP_IDS,
                                                  **(BASE_CONFIG[generator] | overrides))
            except (TypeError, AssertionError, ValueError) as e:
                raise ConfigError(f"task.params.levels[{i}]={overrides!r} is not a valid reasoning-gym {generator} "
                                  f"config ({type(e).__name__}: {e}); use its config fields, e.g. "
                                  f"{DEFAULT_LEVELS[generator][0]!r}") from None
            out.append(ds)
        return out

    def level(self, prompt_id: int) -> int:
        return curriculum_level(prompt_id, len(self.datasets), self.prompts_per_level)

    def row(self, prompt_id: int) -> PromptRow:
        """Training (and warm-up) prompt prompt_id: never a held-out problem."""
        level = self.level(prompt_id)
        dataset, index = self.datasets[level], prompt_id
        item = dataset[index]
        for _ in range(HOLDOUT_SCAN):
            if not is_held_out(problem_key(self.generator, item["metadata"])):
                break
            index += HOLDOUT_STRIDE
            item = dataset[index]
        else:
            raise ConfigError(f"task.params.levels[{level}]={self._levels[level]!r}: {HOLDOUT_SCAN} draws found only "
                              f"held-out problems; widen the level (more terms or digits)")
        return self._row(item, level, prompt_id)

    def heldout_rows(self, n: int) -> list[PromptRow]:
        """Up to n distinct held-out problems, round-robin over the levels (hardest included), from evaluation
        datasets seeded apart from the training ones; fewer when the levels hold fewer (module docstring)."""
        datasets = self._datasets(self._levels, "math-eval")
        found: list[list[Any]] = [[] for _ in datasets]
        seen: set[str] = set()
        for level, ds in enumerate(datasets):
            for index in range(HOLDOUT_SCAN):
                item = ds[index]
                key = problem_key(self.generator, item["metadata"])
                if key not in seen and is_held_out(key):
                    seen.add(key)
                    found[level].append(item)
                    if len(found[level]) >= n:
                        break
        rows: list[PromptRow] = []
        for i in range(max(map(len, found), default=0)):  # round-robin, the hardest level first in each round
            for level in reversed(range(len(datasets))):
                if i < len(found[level]) and len(rows) < n:
                    row = self._row(found[level][i], level, i)
                    rows.append(dataclasses.replace(row, id=f"{self.generator}:heldout:{level}:{i}"))
        return rows

    def _row(self, item: dict[str, Any], level: int, prompt_id: int) -> PromptRow:
        meta = item["metadata"]
        if self.generator == "chain_sum":
            text = f"{spaced(meta['expression'])} =" if self.compact else f"{item['question']}\n{self.instruction}"
            metadata = {"level": level, "expression": meta["expression"]}
        else:
            numbers = ", ".join(str(n) for n in meta["numbers"])
            text = f"{spaced(numbers)} = {spaced(str(meta['target']))}" if self.compact else \
                f"{item['question']}\n{self.instruction}"
            metadata = {"level": level, "numbers": list(meta["numbers"]), "target": meta["target"]}
        return PromptRow(id=f"{self.generator}:{level}:{prompt_id}", prompt=text, answer=item["answer"],
                         metadata=metadata)

    def words(self) -> list[str]:
        return [*DIGITS, *SYMBOLS]


class MathTask(TextTask):
    """Verifiable math (module docstring): task.name = "math", task.params.generator picks the problems."""

    name = "math"

    def __init__(self, *, seed: int = 0, tokenizer: Any = None, chat_template: str | None = None,
                 generator: str = "chain_sum", levels: list[dict[str, Any]] | None = None,
                 prompts_per_level: int = 1000, path: str = "", instruction: str = INSTRUCTION,
                 answer: str = "tag") -> None:
        if generator not in GENERATORS:
            raise ConfigError(f"task.params.generator={generator!r} is not a math generator; use one of "
                              f"{', '.join(GENERATORS)}")
        if answer not in ANSWER_FORMATS:
            raise ConfigError(f"task.params.answer={answer!r} is not one of {', '.join(ANSWER_FORMATS)}")
        if answer != "tag" and generator != "chain_sum":
            raise ConfigError(f"task.params.answer={answer!r} is for generator 'chain_sum' (a number); "
                              f"{generator} answers in <answer></answer>: remove it")
        if not isinstance(instruction, str) or not instruction.strip():
            raise ConfigError(f"task.params.instruction={instruction!r} must be a non-empty string (the line after "
                              "each problem)")
        self.generator, self.answer_format = generator, answer
        self.compact = _is_word_level(tokenizer)
        if generator == "gsm8k":
            from laminar.envs.tasks.gsm8k import Gsm8kPrompts

            if not path:
                raise ConfigError("task.params.generator='gsm8k' needs task.params.path: a local GSM8K-format "
                                  ".jsonl file ({\"question\", \"answer\": \"... #### n\"} a line)")
            if levels is not None:
                raise ConfigError("task.params.levels is for chain_sum and countdown; remove it for gsm8k")
            source: Any = Gsm8kPrompts(path, seed=seed)
            if not self.compact:
                source = _Instructed(source)
        else:
            if path:
                raise ConfigError(f"task.params.path={path!r} is only read by generator 'gsm8k'; remove it")
            source = GeneratedPrompts(generator, seed=seed, prompts_per_level=prompts_per_level,
                                      levels=DEFAULT_LEVELS[generator] if levels is None else levels,
                                      compact=self.compact, instruction=instruction)
        super().__init__(source=source, seed=seed, tokenizer=tokenizer, chat_template=chat_template)

    def extra_words(self) -> list[str]:
        return [OPEN, CLOSE, *DIGITS, *SYMBOLS]

    def heldout_rows(self, n: int) -> list[PromptRow]:
        """The held-out split (module docstring): up to n problems the training stream never shows."""
        if not isinstance(self.source, GeneratedPrompts):
            raise ConfigError(f"task.params.generator={self.generator!r} has no held-out split (its prompts are a "
                              "file); set eval.prompts to a file of evaluation prompts")
        return self.source.heldout_rows(n)

    def response_text(self, response_ids: list[int]) -> str:
        """The response up to <eos>; with the word-level tokenizer its tokens joined without spaces
        (`<answer> 1 7 </answer>` -> `<answer>17</answer>`)."""
        if not self.compact:
            return super().response_text(response_ids)
        body = list(response_ids)
        if self.eos_id in body:
            body = body[: body.index(self.eos_id)]
        special = {self.bos_id, self.eos_id, self.pad_id}
        return "".join(self.tokenizer.id_to_token(t) or "" for t in body if t not in special)

    def score(self, prompt: Prompt, response_text: str) -> float:
        answer = extract_answer(response_text)
        if answer is None and self.answer_format == "last_number":
            answer = last_number(response_text)
        expected = str(prompt.answer_meta["answer"])
        if self.generator == "chain_sum":
            return 1.0 if exact_match(arithmetic_answer(answer), expected) else 0.0
        if self.generator == "countdown":
            return countdown_reward(answer, prompt.answer_meta["metadata"])
        return 1.0 if math_verify_match(answer, expected) else 0.0

    def demonstration(self, prompt: Prompt, rng: random.Random, accuracy: float) -> list[int]:
        """`<answer> right </answer> <eos>` with probability `accuracy`, else a near miss: a number off by 1..3,
        or (countdown) the solution with one operator changed."""
        right = str(prompt.answer_meta["answer"])
        answer = right if rng.random() < accuracy else _near_miss(right, rng)
        text = f"{OPEN} {spaced(answer)} {CLOSE}" if self.compact else f"{OPEN}{answer}{CLOSE}"
        return [*self.tokenizer.encode(text, add_special_tokens=False).ids, self.eos_id]


def countdown_reward(answer: str | None, metadata: dict[str, Any]) -> float:
    """1.0 when `answer` is a plain arithmetic expression (validated first: only then does reasoning-gym's
    scorer, which runs sympy's parse_expr on it, see it) using exactly `metadata["numbers"]` and equal to
    `metadata["target"]`; otherwise 0.0 (reasoning-gym's 0.01 / 0.05 partial credits count as 0)."""
    answer = arithmetic_answer(answer)
    if answer is None:
        return 0.0
    from reasoning_gym.games.countdown import CountdownConfig, CountdownDataset

    scorer = CountdownDataset(CountdownConfig(seed=0, size=1))
    entry = {"metadata": {"numbers": list(metadata["numbers"]), "target": metadata["target"]}}
    return 1.0 if scorer.score_answer(answer, entry) == 1.0 else 0.0


def _near_miss(right: str, rng: random.Random) -> str:
    try:
        return str(int(right) + rng.choice((-3, -2, -1, 1, 2, 3)))
    except ValueError:
        pass
    ops = [i for i, ch in enumerate(right) if ch in "+-*/"]
    if ops:
        i = rng.choice(ops)
        return right[:i] + rng.choice([o for o in "+-*" if o != right[i]]) + right[i + 1:]
    return right + "1"


class _Instructed:
    """A prompt source whose prompts end with INSTRUCTION (GSM8K questions for a real tokenizer)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def row(self, prompt_id: int) -> PromptRow:
        row = self.source.row(prompt_id)
        return PromptRow(id=row.id, prompt=f"{row.prompt}\n{INSTRUCTION}", answer=row.answer, metadata=row.metadata)

    def words(self) -> list[str]:
        return [*self.source.words(), *INSTRUCTION.split()]
