"""No Python program hides in a string literal: every program the project runs is a module ruff checks.

Every string literal of the first-party code (the repository's packages and examples; tests/ excepted, whose
strings are the hostile programs the sandbox tests run) is tried as Python source: one of at least three lines
that `ast.parse` accepts and that defines, imports or loops (def, class, import, for, while, with, try) is a
program in a string. Move it to a module of its own and run that by path or `-m` (as envs/tools/sandbox_boot.py,
sandbox_shim.py and sandbox_probe.py are), or read its source from that module's file where it must be handed
over as text. Shell scripts, the Makefile and infra/ feed no Python program to an interpreter by heredoc either
(scripts/gpu-check.sh runs scripts/gpu_check.py).
"""

from __future__ import annotations

import ast
import re
import subprocess
import textwrap
from pathlib import Path

from tests.test_layering import modules

ROOT = Path(__file__).resolve().parents[1]
MIN_LINES = 3
KEYWORDS = re.compile(r"^\s*(def|class|import|from|for|while|with|try|async)\b", re.M)  # a quick sieve
HEREDOC = re.compile(r"\bpython[0-9.]*\b[^\n]*<<")  # `python3 - <<'PY'` and the like
STATEMENTS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.For,
              ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try)


def _text(node: ast.AST) -> str | None:
    """The literal's text; an f-string's replacement fields read as a name (`_`), so a templated program counts."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "_" for v in node.values)
    return None


def is_program(text: str) -> bool:
    """At least MIN_LINES non-blank lines of Python that define, import or loop."""
    if sum(1 for line in text.splitlines() if line.strip()) < MIN_LINES or not KEYWORDS.search(text):
        return False
    try:
        tree = ast.parse(textwrap.dedent(text).strip("\n"))
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(n, STATEMENTS) for n in ast.walk(tree))


def programs_in(source: str) -> list[int]:
    """Lines where a string literal of `source` holds a Python program (f-strings' parts are not looked at alone)."""
    tree = ast.parse(source)
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    return [n.lineno for n in ast.walk(tree) if id(n) not in parts and (t := _text(n)) is not None and is_program(t)]


def test_no_string_literal_of_the_project_is_a_python_program() -> None:
    files = modules()
    assert len(files) > 50 and "envs.tools.sandbox" in files  # the walk found the project
    found = [f"{path.relative_to(ROOT)}:{line}" for path in files.values()
             for line in programs_in(path.read_text())]
    assert found == [], ("Python programs in string literals (make each a module ruff checks, run it by path or "
                         "-m):\n" + "\n".join(found))


def test_the_check_finds_a_program_and_leaves_prose_and_one_liners_alone() -> None:
    program = 'BOOT = r"""\nimport os, sys\nfor a in sys.argv:\n    print(a)\n"""\n'
    templated = 'CODE = f"""import json\nvalue = {x!r}\nprint(json.dumps(value))\n"""\n'
    assert programs_in(program) == [1] and programs_in(templated) == [1]
    assert programs_in('"""A docstring of prose.\n\nIt says what the module is for,\nin words."""\n') == []
    assert programs_in('cmd = [sys.executable, "-c", "import sys; print(sys.version)"]\n') == []
    assert programs_in('TABLE = """\na = 1\nb = 2\nc = 3\n"""\n') == []  # parses, but neither defines nor loops


def test_no_shell_script_feeds_python_a_program_by_heredoc() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    scripts = [ROOT / f for f in tracked if f.endswith((".sh", ".bash", ".yml", ".yaml", "Makefile", "Dockerfile"))
               and not f.startswith("tests/") and (ROOT / f).is_file()]
    assert any(p.name == "Makefile" for p in scripts)
    found = [f"{p.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}" for p in scripts
             for text in [p.read_text()] for m in HEREDOC.finditer(text)]
    assert found == [], "Python programs in heredocs (make each a module ruff checks):\n" + "\n".join(found)
    assert HEREDOC.search("timeout 60 python3 - \"$OUT\" <<'PY'\nimport sys\nPY\n")
