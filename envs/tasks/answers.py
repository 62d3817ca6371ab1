"""Answer checking for verifiable math: tag extraction, validation before any scorer, exact match, math-verify.

The order is the security and reward-hacking boundary of every math reward:
1. `extract_answer`: the text inside the LAST `<answer>...</answer>` tag, or None. Nothing outside the tag
   counts, so an answer hidden somewhere in longer text earns nothing (reasoning-gym's default scorers give
   partial credit for that).
2. validation: `arithmetic_answer` (the pattern `^[0-9+\\-*/() .]+$`, no `**`, at most MAX_ANSWER_CHARS)
   or `freeform_answer` (digits, letters, LaTeX punctuation; no quotes, no `_`, no `**`). An answer that fails is
   wrong, and it never reaches sympy: reasoning-gym's countdown scorer calls sympy's `parse_expr`, which
   EXECUTES its argument (`__import__('os').system(...)` runs), and `2**2**2**30` would hang any evaluator.
3. the check: `exact_match` (normalised text equality) or `math_verify_match` (math-verify, for free-form
   answers like `\\frac{1}{2}` vs `0.5`), run without signal-based timeouts (they fail off the main thread);
   validation's length cap and character set are what bound its work.
"""

from __future__ import annotations

import re

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
ARITHMETIC = re.compile(r"^[0-9+\-*/() .]+$")
FREEFORM = re.compile(r"^[0-9A-Za-z+\-*/^()\[\]{}\\ .,=%$:|!<>]+$")
MAX_ANSWER_CHARS = 200


def extract_answer(text: str) -> str | None:
    """The stripped text of the last `<answer>...</answer>` in `text`; None when there is no closed tag.

    `"so <answer> 12 </answer>"` -> `"12"`; `"<answer>1</answer> <answer>2</answer>"` -> `"2"`;
    `"the answer is 12"` -> None."""
    found = ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number written in `text` (an optional minus sign, digits, an optional decimal part); None when
    there is none. `"46 + 60 = 106."` -> `"106"`; `"4 - 6 = -2"` -> `"-2"`; `"no idea"` -> None."""
    found = LAST_NUMBER.findall(text)
    return found[-1] if found else None


def arithmetic_answer(answer: str | None) -> str | None:
    """`answer` if it is a plain arithmetic expression a scorer may parse, else None.

    Allowed: digits, `+ - * / ( ) .` and spaces, at most MAX_ANSWER_CHARS, no `**` (power is no countdown
    operator, and `9**9**9**9` is a CPU bomb)."""
    if answer is None or not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
        return None
    if not ARITHMETIC.match(answer) or "**" in answer.replace(" ", ""):
        return None
    return answer


def freeform_answer(answer: str | None) -> str | None:
    """`answer` if it is a short math answer safe to hand to math-verify (numbers, LaTeX like `\\frac{1}{2}`,
    `x^2`), else None: no quotes, no underscores (so no `__import__`), no `**`, at most MAX_ANSWER_CHARS."""
    if answer is None or not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
        return None
    if not FREEFORM.match(answer) or "**" in answer.replace(" ", ""):
        return None
    return answer


def normalise(answer: str) -> str:
    """Whitespace, thousands commas and a surrounding `$...$` removed: `" $1,000$ "` -> `"1000"`."""
    text = answer.strip()
    if len(text) >= 2 and text[0] == text[-1] == "$":
        text = text[1:-1]
    return re.sub(r"[\s,]", "", text)


def exact_match(answer: str | None, expected: str) -> bool:
    """Exact equality after `normalise`: `"1 2"` == `"12"`, `"1,000"` == `"1000"`, `"12.0"` != `"12"`."""
    return answer is not None and normalise(answer) == normalise(expected)


def math_verify_match(answer: str | None, expected: str) -> bool:
    """math-verify's equivalence of a VALIDATED free-form answer and the gold answer: `"\\frac{1}{2}"` vs
    `"0.5"` -> True, `"72.0"` vs `"72"` -> True. Runs only on what `freeform_answer` accepts."""
    answer = freeform_answer(answer)
    if answer is None:
        return False
    if exact_match(answer, expected):
        return True
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold = parse(_as_latex(expected), extraction_config=configs, parsing_timeout=None)
    pred = parse(_as_latex(answer), extraction_config=configs, parsing_timeout=None)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


def _as_latex(text: str) -> str:
    """Wrap a bare answer in `$...$` so LaTeX like `\\frac{1}{2}` is found; `$...$` stays as it is."""
    text = text.strip()
    return text if text.startswith("$") else f"${text}$"
