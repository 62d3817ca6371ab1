"""Prompts from a local file: JSONL (one JSON object a line) or Parquet, same columns (docs/guides/tasks.md):

- `id` (string or integer, optional: the row's index in the file when absent): logged with failures;
- `prompt` (string) or `messages` (a list of {"role": ..., "content": ...}): exactly one of them;
- `answer` (any JSON value, optional): what the task's reward checks against;
- `metadata` (object, optional): passed to the reward untouched.

Read whole at construction and checked row by row (an error names the file, the line and the fix). Prompt id
p is row `order(p // n)[p % n]` for n rows: the file is walked in passes, each pass in a seeded order.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from laminar.envs.tasks import PromptRow
from laminar.errors import ConfigError

COLUMNS = ("id", "prompt", "messages", "answer", "metadata")


class FilePrompts:
    """A `PromptSource` over a JSONL or Parquet prompt file."""

    def __init__(self, path: str | Path, *, seed: int = 0, shuffle: bool = True) -> None:
        self.path, self.seed, self.shuffle = Path(path), seed, shuffle
        if not self.path.is_file():
            raise ConfigError(f"task.prompts={str(path)!r} is not a file on this host; give a local .jsonl or "
                              f".parquet file (docs/guides/tasks.md has the columns)")
        suffix = self.path.suffix.lower()
        if suffix in (".jsonl", ".json", ".ndjson"):
            raw = self._read_jsonl()
        elif suffix in (".parquet", ".pq"):
            raw = self._read_parquet()
        else:
            raise ConfigError(f"task.prompts={str(path)!r}: unknown extension {suffix!r}; use .jsonl or .parquet")
        if not raw:
            raise ConfigError(f"task.prompts={str(path)!r} has no rows; add at least one prompt")
        self.rows = [self._row(i, where, obj) for i, (where, obj) in enumerate(raw)]
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, prompt_id: int) -> PromptRow:
        n = len(self.rows)
        epoch, index = divmod(prompt_id, n)
        return self.rows[self._order(epoch)[index]]

    def words(self) -> list[str]:
        """Every whitespace-separated word of the prompts, messages ("role:" as envs/tasks/text.py renders them
        without a chat template) and answers, in first-seen order."""
        seen: dict[str, None] = {}
        for r in self.rows:
            texts = [r.prompt or ""] + [f"{m['role']}: {m['content']}" for m in r.messages or []]
            if r.answer is not None:
                texts.append(r.answer if isinstance(r.answer, str) else json.dumps(r.answer))
            for text in texts:
                seen.update(dict.fromkeys(text.split()))
        return list(seen)

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(f"prompts:{self.seed}:{epoch}").shuffle(order)
            self._orders = {epoch: order}  # one pass cached: prompt ids are leased in order
        return self._orders[epoch]

    def _read_jsonl(self) -> list[tuple[str, Any]]:
        out = []
        with self.path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    out.append((f"line {lineno}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ConfigError(f"task.prompts={str(self.path)!r} line {lineno} is not JSON ({e}); write one "
                                      f"JSON object a line") from None
        return out

    def _read_parquet(self) -> list[tuple[str, Any]]:
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(self.path)
        except Exception as e:  # noqa: BLE001 - any unreadable file is a config error naming it
            raise ConfigError(f"task.prompts={str(self.path)!r} is not a readable Parquet file ({e})") from None
        return [(f"row {i}", obj) for i, obj in enumerate(table.to_pylist())]

    def _row(self, index: int, where: str, obj: Any) -> PromptRow:
        def bad(what: str) -> ConfigError:
            return ConfigError(f"task.prompts={str(self.path)!r} {where}: {what}; each row has `prompt` (string) or "
                               f"`messages` (list of {{role, content}}), and optionally id, answer, metadata")

        if not isinstance(obj, dict):
            raise bad(f"a row is a JSON object, not {type(obj).__name__}")
        obj = {k: v for k, v in obj.items() if v is not None}  # Parquet fills absent columns with nulls
        unknown = sorted(set(obj) - set(COLUMNS))
        if unknown:
            raise bad(f"unknown column(s) {', '.join(unknown)} (put extra fields under `metadata`)")
        prompt, messages = obj.get("prompt"), obj.get("messages")
        if (prompt is None) == (messages is None):
            raise bad("exactly one of `prompt` and `messages` must be set")
        if prompt is not None and not (isinstance(prompt, str) and prompt.strip()):
            raise bad("`prompt` must be a non-empty string")
        if messages is not None:
            ok = isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)
            if not ok:
                raise bad("`messages` must be a non-empty list of {\"role\": str, \"content\": str}")
            messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        metadata = obj.get("metadata", {})
        if not isinstance(metadata, dict):
            raise bad("`metadata` must be an object")
        rid = obj.get("id", index)
        if not isinstance(rid, (str, int)) or isinstance(rid, bool):
            raise bad("`id` must be a string or an integer")
        return PromptRow(id=str(rid), prompt=prompt, messages=messages, answer=obj.get("answer"), metadata=metadata)
