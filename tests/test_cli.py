"""The `laminar` command line through its real entry point, in subprocesses."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from laminar.contract import RunStatus, workflow_id_for
from tests.fixtures.stack import TEST_OVERRIDES
from tests.fixtures.waiting import wait_until

LAMINAR = [sys.executable, "-m", "laminar.cli.main"]
ROOT = Path(__file__).resolve().parents[1]


def _laminar(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*LAMINAR, *args], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout)


def _ok(out: subprocess.CompletedProcess) -> subprocess.CompletedProcess | None:
    return out if out.returncode == 0 else None


def test_run_rejects_bad_config_before_starting_anything(tmp_path):
    env = {"LAMINAR_HOME": str(tmp_path / "home")}
    out = _laminar(["run", "examples/tiny.toml", "--rollout.group_size=1", "--trainer.lr=-1"], env)
    assert out.returncode == 2, out.stdout + out.stderr
    text = " ".join((out.stdout + out.stderr).split())
    assert "rollout.group_size=1" in text and "greater than or equal to 2" in text
    assert "trainer.lr=-1" in text
    assert not (tmp_path / "home" / "dev.json").exists()  # no dev stack was started


def test_run_rejects_unknown_field(tmp_path):
    out = _laminar(["run", "examples/tiny.toml", "--trainer.learning_rate=0.1"], {"LAMINAR_HOME": str(tmp_path)})
    assert out.returncode == 2
    assert "trainer.learning_rate" in out.stderr and "unknown field" in out.stderr


async def test_start_status_stop(stack, tmp_path):
    env = {**stack.settings.to_env()}
    overrides = [f"--{o}" for o in TEST_OVERRIDES if not o.startswith("run.steps")]
    started = _laminar(["start", "examples/tiny.toml", "--steps", "500", "--run-id", "t-cli-sss", *overrides], env)
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip().splitlines()[-1] == "run_id=t-cli-sss"
    assert stack.store.exists("runs/t-cli-sss/config.json")
    handle = stack.client.get_workflow_handle(workflow_id_for("t-cli-sss"), result_type=RunStatus)
    # The status query needs the control worker to have picked the run up; poll the CLI until it answers.
    status = wait_until(lambda: _ok(_laminar(["status", "t-cli-sss", "--json"], env)), 60, "laminar status to answer")
    assert json.loads(status.stdout)["run_id"] == "t-cli-sss"
    stopped = _laminar(["stop", "t-cli-sss"], env)
    assert stopped.returncode == 0, stopped.stderr
    final = await handle.result()
    assert final.phase == "finished" and final.step < 500 and final.groups_consumed_twice == 0


def test_example_client_script_runs(stack):
    sets = [arg for o in TEST_OVERRIDES if not o.startswith("run.steps") for arg in ("--set", o)]
    out = subprocess.run([sys.executable, "examples/start_and_watch.py", "examples/tiny.toml", "--steps", "2", *sets],
                         env={**os.environ, **stack.settings.to_env()}, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("run_id=")
    assert "finished: steps=2" in lines[-1] and "consumed_twice=0" in lines[-1]


def test_laminar_run_end_to_end(tmp_path):
    """The main job's entry point: dev stack, worker processes, workflow, summary, and a clean exit."""
    home = tmp_path / "home"
    overrides = [f"--{o}" for o in TEST_OVERRIDES if not o.startswith("run.steps")]
    out = _laminar(["run", "examples/tiny.toml", "--steps", "6", "--summary", str(tmp_path / "s.json"), *overrides],
                   {"LAMINAR_HOME": str(home)}, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.splitlines()[0].startswith("run_id=")
    summary = json.loads((tmp_path / "s.json").read_text())
    expected = {"steps", "reward_per_step", "response_len_p50", "response_len_p99", "tokens_per_s",
                "staleness_histogram", "max_versions_in_use", "trainer_wait_fraction", "groups_generated",
                "groups_consumed", "groups_consumed_twice", "checkpoints", "temporal_history_events_max"}
    assert expected <= set(summary)
    assert summary["steps"] == 6 and len(summary["reward_per_step"]) == 6
    assert summary["groups_consumed_twice"] == 0 and summary["groups_consumed"] == 6 * 2
    assert sum(summary["staleness_histogram"].values()) == summary["groups_consumed"] * 4  # group_size 4
    # It started the dev stack, so it stopped it: no record of live processes is left behind.
    assert not (home / "dev.json").exists()


# A command run in a subprocess goes through cli.main.main (run_then_exit), never a Typer app called directly: the
# Temporal client's native threads can crash a finalising interpreter after the command finished (a `dev up` of
# tests/test_devstack.py exited -11 in CI when it called `dev_app()` directly).
_APP_CALLED = re.compile(r"\bfrom laminar\.cli\.[\w.]+ import [^;\n]*;[^\n]*\b(?!main\()\w+\(\)")


def apps_called_directly(source: str) -> list[int]:
    """Lines where a string literal imports from cli and calls something other than main()."""
    tree = ast.parse(source)
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and _APP_CALLED.search(n.value)]


def test_subprocesses_run_commands_through_the_entry_point():
    bad = "from laminar.cli.dev import dev_app; " + "dev_app()"  # in two literals, so this file passes its own scan
    assert apps_called_directly(f'ENTRY = "{bad}"\n') == [1]
    assert apps_called_directly('ENTRY = "from laminar.cli.main import main; main()"\n') == []
    found = [f"{p.relative_to(ROOT)}:{line}" for p in sorted((ROOT / "tests").rglob("*.py"))
             for line in apps_called_directly(p.read_text())]
    assert found == [], f"run commands as `python -m laminar.cli.main ...` (laminar.cli.main.main): {found}"


def test_worker_rejects_a_spare_that_leaves_no_slot(tmp_path):
    out = _laminar(["worker", "rollout", "--slots", "1", "--spare", "1"], {"LAMINAR_HOME": str(tmp_path)})
    assert out.returncode == 2
    assert "--spare=1 must be at least 0 and below --slots=1" in " ".join(out.stderr.split())
