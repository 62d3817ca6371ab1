"""GSM8K-format JSONL a user already has on disk: one `{"question": ..., "answer": "...#### 72"}` a line.

The reference answer is the text after the last `####`, stripped, thousands commas removed ("#### 1,000" ->
"1000"); the worked solution before it is kept in the row's metadata (`solution`), never shown to the model.
An optional `id` field names the row (its line number otherwise). Nothing is downloaded: the file is read whole
at construction and checked line by line (an error names the file, the line and the fix).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from laminar.envs.tasks import PromptRow
from laminar.errors import ConfigError


def gsm8k_answer(answer: str) -> str | None:
    """The final answer of a GSM8K `answer` field: `"3 + 4 = 7\\n#### 7"` -> `"7"`, `"#### 1,000"` -> `"1000"`;
    None when it has no `####`."""
    if "####" not in answer:
        return None
    final = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return final or None


class Gsm8kPrompts:
    """A `PromptSource` over a GSM8K-format JSONL file; prompt id p is row order(p // n)[p % n] for n rows (the
    file is walked in passes, each pass in a seeded order)."""

    def __init__(self, path: str | Path, *, seed: int = 0) -> None:
        self.path, self.seed = Path(path), seed
        if not self.path.is_file():
            raise ConfigError(f"task.params.path={str(path)!r} is not a file on this host; give a local GSM8K-format "
                              f".jsonl file (one {{\"question\", \"answer\": \"... #### n\"}} a line)")
        self.rows: list[PromptRow] = []
        with self.path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    self.rows.append(self._row(lineno, line))
        if not self.rows:
            raise ConfigError(f"task.params.path={str(path)!r} has no rows; add at least one GSM8K problem")
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def _row(self, lineno: int, line: str) -> PromptRow:
        def bad(what: str) -> ConfigError:
            return ConfigError(f"task.params.path={str(self.path)!r} line {lineno}: {what}; each line is a JSON object "
                               f"with `question` (string) and `answer` (string ending in `#### <number>`)")

        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise bad(f"not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise bad(f"a row is a JSON object, not {type(obj).__name__}")
        question, answer = obj.get("question"), obj.get("answer")
        if not isinstance(question, str) or not question.strip():
            raise bad("`question` must be a non-empty string")
        if not isinstance(answer, str):
            raise bad("`answer` must be a string")
        final = gsm8k_answer(answer)
        if final is None:
            raise bad(f"`answer` has no `#### <final answer>` (it ends {answer[-40:]!r})")
        rid = obj.get("id", lineno)
        return PromptRow(id=str(rid), prompt=question.strip(), answer=final,
                         metadata={"solution": answer.rsplit("####", 1)[0].strip()})

    def row(self, prompt_id: int) -> PromptRow:
        epoch, index = divmod(prompt_id, len(self.rows))
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            random.Random(f"gsm8k:{self.seed}:{epoch}").shuffle(order)
            self._orders = {epoch: order}  # one pass cached: prompt ids are leased in order
        return self.rows[self._orders[epoch][index]]

    def words(self) -> list[str]:
        """Every whitespace-separated word of the questions and answers, in first-seen order."""
        seen: dict[str, None] = {}
        for r in self.rows:
            seen.update(dict.fromkeys((r.prompt or "").split()))
            seen.update(dict.fromkeys(str(r.answer).split()))
        return list(seen)
