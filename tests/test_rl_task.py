"""Task registry and the default `repeat` task: determinism, verifiable reward, long-tailed lengths."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from laminar.envs.tasks import get_task, known_tasks
from laminar.envs.tasks.tokenizer import build_word_tokenizer, special_ids
from laminar.errors import ConfigError


def test_unknown_task_lists_known_ones():
    with pytest.raises(ConfigError, match=r"'sorting' is not a known task \(known tasks: .*repeat"):
        get_task("sorting")
    assert {"repeat", "file"} <= set(known_tasks())


def test_tokenizer_specials_and_round_trip(tmp_path):
    from tokenizers import Tokenizer

    tok = build_word_tokenizer(["a", "b", ":"])
    tok.save(str(tmp_path / "tokenizer.json"))
    back = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert special_ids(back) == {"pad": 0, "bos": 1, "eos": 2}
    assert back.encode("a b :", add_special_tokens=False).ids == [3, 4, 5]


def test_prompts_are_deterministic_from_seed_and_id():
    t1, t2, t3 = (get_task("repeat", seed=s, max_count=48) for s in (7, 7, 8))
    assert [t1.prompt(i) for i in range(20)] == [t2.prompt(i) for i in range(20)]
    assert [t1.prompt(i).text for i in range(20)] != [t3.prompt(i).text for i in range(20)]
    p = t1.prompt(3)
    assert p.token_ids[0] == t1.bos_id and len(p.token_ids) == 4
    assert p.text == f"{p.answer_meta['symbol']} {p.answer_meta['count']} :"


def test_reward_hand_worked():
    task = get_task("repeat", seed=0, max_count=48)
    p = next(task.prompt(i) for i in range(1000) if task.prompt(i).answer_meta["count"] == 4)
    s, eos = p.answer_meta["symbol_id"], task.eos_id
    other = next(t for t in task._symbol_ids if t != s)
    # Exact answer: symbol score 4/4, length score exp(0) -> 0.7 + 0.3 = 1.0
    assert task.reward(p, [s] * 4 + [eos]) == pytest.approx(1.0)
    # 3 right + 1 wrong, right length: 0.7 * 3/4 + 0.3 * 1 = 0.825
    assert task.reward(p, [s, s, other, s, eos]) == pytest.approx(0.825)
    # 6 right, too long: symbol 6 / max(4, 6) = 1.0; length exp(-|6-4| / max(1, 4/4)) = e^-2
    assert task.reward(p, [s] * 6 + [eos]) == pytest.approx(0.7 + 0.3 * math.exp(-2))
    # Tokens after <eos> do not count; empty answer: 0 + 0.3 * exp(-4) (L = 0, n = 4)
    assert task.reward(p, [eos, s, s]) == pytest.approx(0.3 * math.exp(-4))


def test_requested_lengths_are_long_tailed():
    task = get_task("repeat", seed=0, max_count=48)
    lengths = np.array([task.prompt(i).answer_meta["count"] + 1 for i in range(20000)])  # + <eos>
    p50, p99 = np.percentile(lengths, [50, 99])
    # P(n) ∝ n^-1.2 on 1..48: n p50 = 3, p99 = 45 -> lengths 4 and 46
    assert p50 == 4 and p99 >= 44
    assert p99 >= 5 * p50


def test_demonstrations_are_noisy_with_the_requested_accuracy():
    task = get_task("repeat", seed=0, max_count=48)
    rng = random.Random(0)
    right = total = 0
    for i in range(400):
        p = task.prompt(i)
        demo = task.demonstration(p, rng, 0.3)
        assert demo[-1] == task.eos_id
        right += sum(t == p.answer_meta["symbol_id"] for t in demo[:-1])
        total += len(demo) - 1
    assert 0.25 < right / total < 0.35
