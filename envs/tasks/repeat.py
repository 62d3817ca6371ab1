"""`repeat`: write SYM exactly n times, then stop. The default verifiable-reward task.

Prompt `<bos> SYM n :`, SYM one of 8 symbol words, n in 1..max_count; the correct response is n
copies of SYM followed by <eos>.

Why this task: the reward is verifiable and dense (partial credit per token and for length), so the
tiny model learns it by RL on CPU in a couple of minutes; and n is drawn from a power law
P(n) ∝ n^-1.2, so response lengths are long-tailed like real reasoning traces. For max_count=48:
n has p50 = 3, p90 = 25, p99 = 45, so response length (n + <eos>) has p99/p50 = 46/4 ≈ 11.5 once the
policy answers with the requested length (measured in tests/test_rl_learning.py).

Reward = 0.7 * symbol score + 0.3 * length score, where with L = response tokens before <eos>:
symbol score = (# of those tokens equal to SYM) / max(n, L), length score = exp(-|L - n| / max(1, n/4)).
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from itertools import accumulate

from laminar.envs.tasks import Prompt
from laminar.envs.tasks.tokenizer import build_word_tokenizer, special_ids

SYMBOLS = ("a", "b", "c", "d", "e", "f", "g", "h")
SEPARATOR = ":"
POWER = 1.2  # P(n) ∝ n^-POWER


class RepeatTask:
    name = "repeat"

    def __init__(self, *, seed: int = 0, max_count: int = 48, tokenizer=None):
        if max_count < 1:
            raise ValueError(f"max_count={max_count} must be at least 1")
        self.seed = seed
        self.max_count = max_count
        self.tokenizer = tokenizer or build_word_tokenizer(self.words())
        ids = special_ids(self.tokenizer)
        self.bos_id, self.eos_id, self.pad_id = ids["bos"], ids["eos"], ids["pad"]
        self._symbol_ids = [self._id(s) for s in SYMBOLS]
        self._cdf = list(accumulate(n**-POWER for n in range(1, max_count + 1)))

    def words(self) -> list[str]:
        return [*SYMBOLS, SEPARATOR, *(str(n) for n in range(1, self.max_count + 1))]

    def _id(self, word: str) -> int:
        tid = self.tokenizer.token_to_id(word)
        if tid is None:
            raise ValueError(f"tokenizer has no token for {word!r}; build it from RepeatTask.words()")
        return tid

    def prompt(self, prompt_id: int) -> Prompt:
        rng = random.Random(f"repeat:{self.seed}:{prompt_id}")
        symbol = rng.choice(SYMBOLS)
        count = 1 + bisect_left(self._cdf, rng.random() * self._cdf[-1])
        count = min(count, self.max_count)
        text = f"{symbol} {count} {SEPARATOR}"
        ids = [self.bos_id, *self.tokenizer.encode(text, add_special_tokens=False).ids]
        meta = {"symbol": symbol, "symbol_id": self._id(symbol), "count": count}
        return Prompt(prompt_id=prompt_id, text=text, token_ids=ids, answer_meta=meta)

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        body = list(response_ids)
        if self.eos_id in body:
            body = body[: body.index(self.eos_id)]
        n, length = prompt.answer_meta["count"], len(body)
        hits = sum(1 for t in body if t == prompt.answer_meta["symbol_id"])
        symbol_score = hits / max(n, length)
        length_score = math.exp(-abs(length - n) / max(1.0, n / 4))
        return 0.7 * symbol_score + 0.3 * length_score

    def demonstration(self, prompt: Prompt, rng: random.Random, accuracy: float) -> list[int]:
        """A noisy answer: length within ~±30% of n; each token is SYM with probability `accuracy`,
        otherwise a uniformly random other symbol. Ends with <eos>."""
        n = prompt.answer_meta["count"]
        length = max(1, round(n * math.exp(rng.gauss(0.0, 0.3))))
        right = prompt.answer_meta["symbol_id"]
        others = [s for s in self._symbol_ids if s != right]
        body = [right if rng.random() < accuracy else rng.choice(others) for _ in range(length)]
        return [*body, self.eos_id]
