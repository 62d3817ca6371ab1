"""The installed distribution provides every package of the repository, so `laminar` works from any
directory (console scripts do not put the checkout on sys.path)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_imports_outside_the_checkout(tmp_path):
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")
    assert {"laminar", "workflows", "activities", "workers", "storage", "services", "rl", "relay"} <= set(packages)
    code = "; ".join(f"import {name}" for name in packages) + "; import workers.processes, cli.main"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_every_file_a_package_reads_at_run_time_is_package_data():
    """A non-Python file inside a package (the packaged default config, laminar/defaults/) reaches the wheel only
    through [tool.setuptools.package-data]; tests/test_wheel.py builds the wheel and runs from it."""
    import fnmatch
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    include = [p.rstrip("*") for p in setuptools["packages"]["find"]["include"]]
    data = setuptools.get("package-data", {})
    assert "laminar" in data and "cli" in include
    missing = []
    for package in include:
        for path in (ROOT / package).rglob("*"):
            if not path.is_file() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT / package).as_posix()
            if not any(fnmatch.fnmatch(rel, pattern) for pattern in data.get(package, [])):
                missing.append(f"{package}/{rel}")
    assert not missing, f"not package data (add to pyproject's [tool.setuptools.package-data]): {missing}"
