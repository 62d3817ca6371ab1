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
