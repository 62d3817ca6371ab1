"""The installed distribution has one top-level import name, `laminar`, and provides every package of the
repository under it, so `laminar` works from any directory and cannot collide with another project's `cli`,
`client` or `storage`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import laminar

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def source_packages() -> set[str]:
    """Every package folder of the checkout, by its installed name (`workflows/` is `laminar.workflows`)."""
    out = {"laminar"}
    for top in laminar.SUBPACKAGES:
        out |= {"laminar." + p.parent.relative_to(ROOT).as_posix().replace("/", ".")
                for p in (ROOT / top).rglob("__init__.py")}
    return out


def test_every_top_level_folder_is_a_subpackage() -> None:
    folders = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "laminar"}
    assert folders == set(laminar.SUBPACKAGES), "a top-level package folder is missing from laminar.SUBPACKAGES"
    assert SETUPTOOLS["package-dir"] == {f"laminar.{n}": n for n in laminar.SUBPACKAGES}


def test_the_package_list_is_whole() -> None:
    assert set(SETUPTOOLS["packages"]) == source_packages(), "pyproject's [tool.setuptools] packages is not whole"


def test_every_package_imports_outside_the_checkout(tmp_path):
    code = "; ".join(f"import {name}" for name in sorted(source_packages())) + "; import laminar.workers.processes"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_every_file_a_package_reads_at_run_time_is_package_data():
    """A non-Python file inside a package (the packaged default config, laminar/defaults/) reaches the wheel only
    through [tool.setuptools.package-data]; tests/test_wheel.py builds the wheel and runs from it."""
    import fnmatch

    data = SETUPTOOLS.get("package-data", {})
    assert "laminar" in data
    missing = []
    for package, folder in [("laminar", "laminar"), *((f"laminar.{n}", n) for n in laminar.SUBPACKAGES)]:
        for path in (ROOT / folder).rglob("*"):
            if not path.is_file() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT / folder).as_posix()
            if not any(fnmatch.fnmatch(rel, pattern) for pattern in data.get(package, [])):
                missing.append(f"{folder}/{rel}")
    assert not missing, f"not package data (add to pyproject's [tool.setuptools.package-data]): {missing}"


GENERIC = {"cli", "client", "storage", "services", "rl", "bench", "envs", "sim", "relay", "workers", "workflows",
           "activities", "chaos", "devstack", "reporting", "tests"}


def test_the_wheel_installs_one_top_level_name(tmp_path):
    """Build the wheel from a copy of the checkout and list the import names it puts into site-packages."""
    src = tmp_path / "src"
    skip = {".git", ".venv", ".venv-vllm", ".laminar", "build", "dist", "site", "tests", "docs", "__pycache__",
            ".pytest_cache", ".ruff_cache", "node_modules"}
    shutil.copytree(ROOT, src, ignore=lambda d, names: [n for n in names if n in skip or n.endswith(".egg-info")])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "-q", "-w", str(tmp_path / "dist"), str(src)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("laminar-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0].removesuffix(".py") for n in names if ".dist-info/" not in n}
    print("wheel top-level import names:", sorted(top))
    assert top == {"laminar"}, f"the wheel installs {sorted(top - {'laminar'})} beside laminar"
    assert not top & GENERIC
    assert {"laminar/workflows/ledger.py", "laminar/cli/main.py", "laminar/defaults/tiny.toml"} <= set(names)
