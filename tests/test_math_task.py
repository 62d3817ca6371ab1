"""The `math` task: answer extraction, validation before any scorer, exact match, math-verify, the curriculum,
reasoning-gym's seeded generators, the GSM8K loader, and the code-injection answer that must reach no scorer."""

from __future__ import annotations

import json
import random

import pytest

from laminar.config import RunConfig
from laminar.envs.tasks import build_task, get_task, known_tasks
from laminar.envs.tasks.answers import (
    arithmetic_answer,
    exact_match,
    extract_answer,
    freeform_answer,
    math_verify_match,
)
from laminar.envs.tasks.gsm8k import Gsm8kPrompts, gsm8k_answer
from laminar.envs.tasks.math import WARMUP_IDS, countdown_reward, curriculum_level, spaced
from laminar.errors import ConfigError


def _ids(task, text: str) -> list[int]:
    return [*task.tokenizer.encode(text, add_special_tokens=False).ids, task.eos_id]


# --- extraction, validation, checking -------------------------------------------------------------------------

def test_extract_answer_takes_the_last_closed_tag_only():
    assert extract_answer("so <answer> 12 </answer>") == "12"
    assert extract_answer("<answer>1</answer> then <answer>2</answer>") == "2"
    assert extract_answer("<answer>\n3\n</answer>") == "3"
    assert extract_answer("the answer is 12") is None
    assert extract_answer("<answer>12") is None  # unclosed: nothing


def test_arithmetic_validation_accepts_only_plain_expressions():
    for ok in ("12", "-7", "1*9 + 20", "(3 + 4) / 7", "2.5"):
        assert arithmetic_answer(ok) == ok
    for bad in ("__import__('os').system('touch /tmp/x')", "open('/tmp/x','w')", "x + 1", "9**9**9**9",
                "9 * * 9", "1e9", "", "   ", None, "1" * 201):
        assert arithmetic_answer(bad) is None, bad


def test_freeform_validation_keeps_latex_and_rejects_code():
    for ok in ("72", "\\frac{1}{2}", "x^2 + 1", "$1,000$", "0.5"):
        assert freeform_answer(ok) == ok
    for bad in ("__import__('os')", "open('/tmp/x','w')", "a**b", 'eval("1")', None, "   "):
        assert freeform_answer(bad) is None, bad


def test_exact_match_normalises_only_spacing_commas_and_dollars():
    assert exact_match("1 2", "12")
    assert exact_match("$1,000$", "1000")
    assert not exact_match("12.0", "12")  # exact: math-verify is the lenient checker
    assert not exact_match("the answer is 12", "12")
    assert not exact_match(None, "12")


def test_math_verify_accepts_equivalent_forms_and_rejects_wrong_ones():
    assert math_verify_match("\\frac{1}{2}", "0.5")  # 1/2 = 0.5
    assert math_verify_match("72.0", "72")
    assert math_verify_match("144/2", "72")  # 144 / 2 = 72
    assert not math_verify_match("73", "72")
    assert not math_verify_match("open('/tmp/x','w')", "72")  # rejected by validation, never parsed


# --- the code-injection answer reaches no scorer --------------------------------------------------------------

@pytest.mark.parametrize("template", ["__import__('os').system('touch {p}')", "open('{p}','w')"])
def test_code_injection_answer_is_rejected_before_any_scorer(tmp_path, monkeypatch, template):
    target = tmp_path / "pwned"
    answer = template.format(p=target)
    # The trap is real: reasoning-gym's countdown scorer hands its answer to sympy's parse_expr, which runs it.
    from reasoning_gym.games.countdown import CountdownConfig, CountdownDataset

    CountdownDataset(CountdownConfig(seed=0, size=1)).score_answer(answer, {"metadata": {"numbers": [1], "target": 1}})
    assert target.exists()
    target.unlink()

    # Through the task, the same answer is rejected before reasoning-gym, sympy or math-verify see it.
    import math_verify
    import math_verify.parser
    import reasoning_gym.games.countdown as countdown_module

    seen: list[str] = []

    def spy(original):
        def called(*args, **kwargs):
            seen.append(str(args[:1]))
            return original(*args, **kwargs)
        return called

    monkeypatch.setattr(CountdownDataset, "score_answer", spy(CountdownDataset.score_answer))
    monkeypatch.setattr(countdown_module, "parse_expr", spy(countdown_module.parse_expr))
    monkeypatch.setattr(math_verify.parser, "parse_expr", spy(math_verify.parser.parse_expr))
    monkeypatch.setattr(math_verify, "parse", spy(math_verify.parse))
    for generator in ("countdown", "chain_sum"):
        task = get_task("math", seed=0, generator=generator)
        p = task.prompt(0)
        assert task.score(p, f"<answer>{answer}</answer>") == 0.0
    assert countdown_reward(answer, {"numbers": [1], "target": 1}) == 0.0
    assert math_verify_match(answer, "1") is False
    assert seen == [] and not target.exists()


# --- curriculum and generators --------------------------------------------------------------------------------

def test_curriculum_levels_rise_with_prompt_id_and_warmup_ids_spread():
    # 3 levels of 100 prompt ids: 0..99 -> 0, 100..199 -> 1, 200 and on -> 2 (the last level stays)
    assert [curriculum_level(p, 3, 100) for p in (0, 99, 100, 199, 200, 10**6)] == [0, 0, 1, 1, 2, 2]
    # warm-up ids: level = id % 3; 10**9 % 3 = 1 (10**9 = 333333333 * 3 + 1)
    assert [curriculum_level(WARMUP_IDS + k, 3, 100) for k in range(3)] == [1, 2, 0]


def test_chain_sum_prompts_are_seeded_compact_and_follow_the_curriculum():
    levels = [{"max_terms": 2, "max_digits": 1}, {"max_terms": 4, "max_digits": 2}]
    t1, t2, t3 = (get_task("math", seed=s, levels=levels, prompts_per_level=50) for s in (0, 0, 1))
    assert [t1.prompt(i) for i in range(60)] == [t2.prompt(i) for i in range(60)]
    assert [t1.prompt(i).text for i in range(60)] != [t3.prompt(i).text for i in range(60)]
    for pid in range(50):  # level 0: `a op b =`, single digits, 4 words after <bos>
        p = t1.prompt(pid)
        a, op, b, eq = p.text.split()
        assert a in "0123456789" and b in "0123456789" and op in "+-" and eq == "="
        assert int(p.answer_meta["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert len(p.token_ids) == 5 and p.answer_meta["metadata"]["level"] == 0
    later = [t1.prompt(pid) for pid in range(50, 150)]
    assert all(p.answer_meta["metadata"]["level"] == 1 for p in later)
    assert max(len(p.token_ids) for p in later) > 5  # up to 4 terms of up to 2 digits
    for p in later:  # the answer is the expression's value; every word is one token
        assert int(p.answer_meta["answer"]) == eval(p.answer_meta["metadata"]["expression"])  # digits and +/- only
        assert t1.pad_id not in p.token_ids


def test_chain_sum_reward_is_exact_match_on_the_tag():
    task = get_task("math", seed=0, levels=[{"max_terms": 2, "max_digits": 1}])
    p = task.prompt(0)
    right = p.answer_meta["answer"]
    assert task.reward(p, _ids(task, f"<answer> {spaced(right)} </answer>")) == 1.0
    assert task.response_text(_ids(task, f"<answer> {spaced(right)} </answer>")) == f"<answer>{right}</answer>"
    wrong = str(int(right) + 1)
    assert task.reward(p, _ids(task, f"<answer> {spaced(wrong)} </answer>")) == 0.0
    assert task.reward(p, _ids(task, spaced(right))) == 0.0  # no tag: no credit
    # the right number elsewhere in the text earns nothing (reasoning-gym's default scorers give partial credit)
    assert task.score(p, f"{right} <answer>{wrong}</answer>") == 0.0
    assert task.score(p, f"<answer>{right} or {wrong}</answer>") == 0.0


def test_last_number_answers_credit_the_last_number_when_there_is_no_tag():
    """task.params.answer = "last_number" (chain_sum): a model that never writes the tag (SmolLM2-135M-Instruct,
    docs/guides/pretrained.md) is scored on the last number it writes; a tag, when there is one, still decides."""
    from laminar.envs.tasks.answers import last_number

    assert last_number("46 + 60 = 106.") == "106" and last_number("4 - 6 = -2") == "-2"
    assert last_number("The answer is 2.5, not 3") == "3" and last_number("no idea") is None
    task = get_task("math", seed=0, levels=[{"max_terms": 2, "max_digits": 1}], answer="last_number")
    p = task.prompt(0)
    right, wrong = p.answer_meta["answer"], str(int(p.answer_meta["answer"]) + 1)
    assert task.score(p, f"The final answer is {right}.") == 1.0
    assert task.score(p, f"{right}, or maybe {wrong}") == 0.0  # the last number, not any number
    assert task.score(p, f"{right} <answer>{wrong}</answer>") == 0.0  # a tag decides
    assert task.score(p, f"<answer>{right}</answer>") == 1.0
    assert get_task("math", seed=0, levels=[{"max_terms": 2, "max_digits": 1}]).score(p, f"is {right}.") == 0.0


def test_the_instruction_is_a_param_and_last_number_is_for_chain_sum_only():
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.add_special_tokens(["<pad>", "<bos>", "<eos>"])
    task = get_task("math", seed=0, tokenizer=tok, instruction="Give only the final answer.")
    assert task.prompt(0).text.endswith("=\nGive only the final answer.")
    assert task.heldout_rows(1)[0].prompt.endswith("\nGive only the final answer.")
    with pytest.raises(ConfigError, match="task.params.answer='last_number' is for generator 'chain_sum'"):
        get_task("math", generator="countdown", answer="last_number")
    with pytest.raises(ConfigError, match="task.params.answer='number' is not one of tag, last_number"):
        get_task("math", answer="number")
    with pytest.raises(ConfigError, match="task.params.instruction='' must be a non-empty string"):
        get_task("math", instruction="")


def test_demonstrations_are_right_with_the_requested_accuracy():
    task = get_task("math", seed=0)
    rng = random.Random(0)
    prompts = [task.prompt(WARMUP_IDS + i) for i in range(400)]
    rewards = [task.reward(p, task.demonstration(p, rng, 0.3)) for p in prompts]
    # 400 draws at p = 0.3: mean 0.3, sd sqrt(0.3 * 0.7 / 400) = 0.023; +-0.07 is 3 sd
    assert abs(sum(rewards) / len(rewards) - 0.3) < 0.07
    assert {p.answer_meta["metadata"]["level"] for p in prompts} == set(range(5))  # all default levels


def test_countdown_reward_checks_numbers_and_target_without_partial_credit():
    task = get_task("math", seed=0, generator="countdown")
    p = task.prompt(0)
    meta = p.answer_meta["metadata"]
    assert task.reward(p, task.demonstration(p, random.Random(0), 1.0)) == 1.0
    nums, target = meta["numbers"], meta["target"]
    assert task.prompt(0).text == f"{spaced(', '.join(map(str, nums)))} = {spaced(str(target))}"
    assert countdown_reward(" + ".join(map(str, nums)), {"numbers": nums, "target": sum(nums)}) == 1.0
    assert countdown_reward(" + ".join(map(str, nums)), {"numbers": nums, "target": sum(nums) + 1}) == 0.0
    # right value with the wrong numbers: reasoning-gym says 0.05, the task 0.0
    assert countdown_reward(str(target), {"numbers": nums, "target": target}) == 0.0
    assert countdown_reward(None, {"numbers": nums, "target": target}) == 0.0


def test_text_rendering_for_a_real_tokenizer_asks_for_the_tag():
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.add_special_tokens(["<pad>", "<bos>", "<eos>"])
    task = get_task("math", seed=0, tokenizer=tok)
    assert not task.compact
    text = task.prompt(0).text
    assert text.startswith("State the final answer to the following arithmetic problem:")
    assert "<answer></answer>" in text


def test_bad_params_are_config_errors_naming_the_field():
    with pytest.raises(ConfigError, match="task.params.generator='algebra'"):
        get_task("math", generator="algebra")
    with pytest.raises(ConfigError, match=r"task.params.levels\[0\]"):
        get_task("math", levels=[{"max_termz": 2}])
    with pytest.raises(ConfigError, match=r"task.params.levels\[0\] sets seed"):
        get_task("math", levels=[{"seed": 2}])
    with pytest.raises(ConfigError, match="needs task.params.path"):
        get_task("math", generator="gsm8k")


def test_math_is_a_builtin_configured_from_toml(tmp_path):
    assert "math" in known_tasks()
    cfg = RunConfig.load("examples/math.toml", [])
    task = build_task(cfg.task, seed=cfg.run.seed)
    assert task.generator == "chain_sum" and task.compact
    assert len(task.prompt(0).token_ids) == 5  # <bos> a op b =


# --- GSM8K-format JSONL ---------------------------------------------------------------------------------------

def _gsm8k_file(tmp_path, rows):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_gsm8k_answer_is_the_text_after_the_last_marks():
    assert gsm8k_answer("4 + 3 = <<4+3=7>>7\n#### 7") == "7"
    assert gsm8k_answer("#### 1,000") == "1000"
    assert gsm8k_answer("no marks") is None


def test_gsm8k_loader_reads_rows_in_seeded_passes_and_checks_with_math_verify(tmp_path):
    rows = [{"question": f"Tom has {n} apples and buys 2 more. How many?", "answer": f"{n}+2={n + 2}\n#### {n + 2}"}
            for n in range(5)]
    path = _gsm8k_file(tmp_path, rows)
    src = Gsm8kPrompts(path, seed=0)
    first_pass = sorted(src.row(p).answer for p in range(5))
    assert first_pass == ["2", "3", "4", "5", "6"]  # n + 2 for n = 0..4: each row once per pass
    assert src.row(0).metadata["solution"].endswith("=" + src.row(0).answer)
    task = get_task("math", seed=0, generator="gsm8k", path=str(path))
    p = task.prompt(0)
    want = p.answer_meta["answer"]
    assert task.score(p, f"... so <answer>{want}.0</answer>") == 1.0  # math-verify: 6.0 == 6
    assert task.score(p, f"<answer>{int(want) + 1}</answer>") == 0.0
    assert task.score(p, f"{want}") == 0.0


def test_gsm8k_loader_errors_name_the_file_line_and_fix(tmp_path):
    path = _gsm8k_file(tmp_path, [{"question": "q", "answer": "#### 1"}, {"question": "q", "answer": "no marks"}])
    with pytest.raises(ConfigError, match=r"line 2: `answer` has no `#### <final answer>`"):
        Gsm8kPrompts(path)
    with pytest.raises(ConfigError, match="is not a file"):
        Gsm8kPrompts(tmp_path / "missing.jsonl")
