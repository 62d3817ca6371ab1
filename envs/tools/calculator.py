"""`Calculator` (`<calc>`): arithmetic on numbers with `+ - * / // % **`, unary `+ -` and parentheses, by an
in-process AST evaluator. Nothing else parses: no names, calls, attributes or subscripts, so no code runs.

Bounds (each breach is the output "error: ...", which the model reads; never a tool failure): at most
MAX_CHARS characters, MAX_NODES syntax nodes, exponents with |exponent| <= MAX_EXPONENT, and every
intermediate result at most MAX_ABS in magnitude (so `9**9**9**9` is refused before it is computed, and a
long chain of products cannot grow without limit). Integer results are exact; a float result is printed
with up to 12 significant digits.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_CHARS = 200
MAX_NODES = 100
MAX_EXPONENT = 64
MAX_ABS = 10**30

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """Input the calculator refuses; its message is the tool's output after "error: "."""


def evaluate(expression: str) -> int | float:
    """The value of `expression`, or CalcError. `"123 + 456"` -> 579; `"7 / 2"` -> 3.5; `"2 ** 3"` -> 8."""
    text = expression.strip()
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalcError("not an arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"expression has more than {MAX_NODES} parts")
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalcError(f"exponent {right} is beyond +-{MAX_EXPONENT}")
        if isinstance(node.op, ast.Pow) and left == 0 and right < 0:
            raise CalcError("zero to a negative power")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except OverflowError:
            raise CalcError("result too large") from None
        if isinstance(value, complex):
            raise CalcError("complex result")
        return _bounded(value)
    raise CalcError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("result is not finite")
    if abs(value) > MAX_ABS:
        raise CalcError("result too large")
    return value


def format_value(value: int | float) -> str:
    """An int as it is; a float as an int when it is whole (`3.0` -> `3`), else 12 significant digits."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


class Calculator:
    """The `<calc>` tool: `run("123 + 456")` -> `"579"`; bad input -> `"error: <why>"` (module docstring)."""

    name = "calculator"
    tag = "calc"

    def run(self, text: str) -> str:
        try:
            return format_value(evaluate(text))
        except CalcError as e:
            return f"error: {e}"
