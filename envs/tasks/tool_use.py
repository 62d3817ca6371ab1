"""`tools`: chain_sum arithmetic with a calculator tool, over two or more model turns (envs/tools/__init__.py;
the replica's environment loop in services/rollout/batch.py runs the calls).

A prompt is a sum of large operands (default: two 3-digit terms, `4 5 6 + 7 8 9 =` with the tiny word-level
tokenizer), too large for the tiny model to add reliably. It may answer at once (`<answer> 1 2 4 5 </answer>`)
or call the calculator first: turn 1 `<calc> 4 5 6 + 7 8 9 </calc>` <eos>; the environment appends
`<result> 1 2 4 5 </result>` (tool-output tokens, masked out of the loss); turn 2 `<answer> 1 2 4 5 </answer>`
<eos>. Reward: MathTask's chain_sum check of the last `<answer>` in the whole response (1.0 or 0.0).

Configured by task.params: `levels` (MathTask's curriculum; default TOOL_LEVELS), `prompts_per_level`,
`max_turns` (model turns per episode, default 2) and `tool_use` (the share of warm-up demonstrations that call
the calculator, default 0.3; the rest answer directly, right DEMO_ACCURACY of the time, so the warm-up model
uses the tool only some of the time and RL has something to raise).

Warm-up (rl/base_model.py, prompt ids at and above WARMUP_IDS): the task decides per warm-up prompt id which
turn it demonstrates: a first turn that calls the tool (`tool_use`), a second turn whose prompt already holds
a call and its result (SECOND_TURN_SHARE; the demonstration copies the result into `<answer>`), or a direct
answer (the rest). The second-turn prompt is token for token the context the model sees in an episode, since
the environment drops the first turn's <eos>.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from laminar.envs.tasks import Prompt
from laminar.envs.tasks.math import CLOSE, OPEN, WARMUP_IDS, MathTask, _near_miss, spaced
from laminar.envs.tools.calculator import Calculator
from laminar.errors import ConfigError

TOOL_LEVELS = [{"max_terms": 2, "min_digits": 3, "max_digits": 3}]
CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE = "<calc>", "</calc>", "<result>", "</result>"
TOOL_WORDS = [CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE, "error"]
SECOND_TURN_SHARE = 0.4  # of warm-up prompts: the second turn after a call


class ToolsTask(MathTask):
    """Arithmetic with a `<calc>` tool over up to `max_turns` model turns (module docstring)."""

    name = "tools"

    def __init__(self, *, seed: int = 0, tokenizer: Any = None, chat_template: str | None = None,
                 levels: list[dict[str, Any]] | None = None, prompts_per_level: int = 1000, max_turns: int = 2,
                 tool_use: float = 0.3) -> None:
        if not isinstance(max_turns, int) or not 1 <= max_turns <= 16:
            raise ConfigError(f"task.params.max_turns={max_turns!r} must be an integer in 1..16 (model turns per "
                              f"episode; 2 lets the model call the calculator once and then answer)")
        if not isinstance(tool_use, int | float) or not 0.0 <= tool_use <= 1.0 - SECOND_TURN_SHARE:
            raise ConfigError(f"task.params.tool_use={tool_use!r} must be in 0..{1 - SECOND_TURN_SHARE:g} (the share "
                              f"of warm-up demonstrations that call the calculator)")
        super().__init__(seed=seed, tokenizer=tokenizer, chat_template=chat_template, generator="chain_sum",
                         levels=TOOL_LEVELS if levels is None else levels, prompts_per_level=prompts_per_level)
        self.max_turns, self.tool_use = max_turns, float(tool_use)
        self.tools = [Calculator()]

    def extra_words(self) -> list[str]:
        return [*super().extra_words(), *TOOL_WORDS]

    def turn_text(self, turn_ids: list[int]) -> str:
        """One model turn's text (up to its <eos>), as the environment parses it for a call."""
        return self.response_text(turn_ids)

    def tool_output_ids(self, output: str) -> list[int]:
        """The tokens appended after a call: `<result> 1 2 4 5 </result>` (a refusal: `<result> error </result>`
        with the tiny tokenizer, whose vocabulary has no letters)."""
        if self.compact:
            body = spaced(output) if output and set(output) <= set("0123456789+-*/().") else "error"
            text = f"{RESULT_OPEN} {body} {RESULT_CLOSE}"
        else:
            text = f"{RESULT_OPEN}{output}{RESULT_CLOSE}"
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _kind(self, prompt_id: int) -> str:
        """Which turn the warm-up prompt `prompt_id` demonstrates: call | second | direct."""
        u = random.Random(f"tools:{self.seed}:{prompt_id}").random()
        return "call" if u < self.tool_use else "second" if u < self.tool_use + SECOND_TURN_SHARE else "direct"

    def _join(self, *parts: str) -> str:
        return " ".join(parts) if self.compact else "".join(parts)

    def _expression(self, prompt: Prompt) -> str:
        expr = str(prompt.answer_meta["metadata"]["expression"])
        return spaced(expr) if self.compact else expr

    def prompt(self, prompt_id: int) -> Prompt:
        """MathTask's prompt; a warm-up prompt of kind "second" also holds the first turn and its result."""
        prompt = super().prompt(prompt_id)
        if prompt_id < WARMUP_IDS or self._kind(prompt_id) != "second":
            return prompt
        call = self._join(CALL_OPEN, self._expression(prompt), CALL_CLOSE)
        ids = [*prompt.token_ids, *self.tokenizer.encode(call, add_special_tokens=False).ids,
               *self.tool_output_ids(str(prompt.answer_meta["answer"]))]
        return replace(prompt, token_ids=ids, answer_meta={**prompt.answer_meta, "warmup": "second"})

    def demonstration(self, prompt: Prompt, rng: random.Random, accuracy: float) -> list[int]:
        """A first turn calling the tool, a second turn copying the result, or a direct answer right with
        probability `accuracy` (a near miss otherwise), by the prompt's warm-up kind; each ends with <eos>."""
        right = str(prompt.answer_meta["answer"])
        kind = self._kind(prompt.prompt_id) if prompt.prompt_id >= WARMUP_IDS else "direct"
        if kind == "call":
            text = self._join(CALL_OPEN, self._expression(prompt), CALL_CLOSE)
        else:
            answer = right if kind == "second" or rng.random() < accuracy else _near_miss(right, rng)
            text = self._join(OPEN, spaced(answer) if self.compact else answer, CLOSE)
        return [*self.tokenizer.encode(text, add_special_tokens=False).ids, self.eos_id]
