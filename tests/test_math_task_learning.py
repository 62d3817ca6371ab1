"""`laminar run examples/math.toml` learns: the tiny model's reward on chain_sum rises by at least 0.15.

The real stack (its own Temporal dev server under a temporary LAMINAR_HOME, worker processes, the tiny base
model built with its 1000-step warm-up), as a user runs it. The summary's rise is the mean reward over the last
fifth of steps minus the mean over the first tenth (reporting/summary.py). Measured on a 2-core machine shared
with other jobs (docs/guides/tasks.md, 'The math task'): 400 steps, the numbers are there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from laminar.reporting.summary import reward_rise


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_laminar_run_math_example_learns(tmp_path):
    summary_path = tmp_path / "summary.json"
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "laminar.cli.main", "run", "examples/math.toml", "--summary", str(summary_path)],
        env={**os.environ, "LAMINAR_HOME": str(tmp_path / "home")}, capture_output=True, text=True, timeout=1100)
    wall = time.monotonic() - t0
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    s = json.loads(summary_path.read_text())
    rewards = s["reward_per_step"]
    rise = reward_rise(rewards)
    print(f"math example: steps={s['steps']} rise={rise:.3f} first={rewards[0]:.3f} last={rewards[-1]:.3f} "
          f"wall_s={wall:.0f} consumed_twice={s['groups_consumed_twice']} failed={s['groups_failed']}")
    assert s["steps"] == 400 and len(rewards) == 400
    assert rise >= 0.15, rewards
    assert s["groups_consumed_twice"] == 0 and s["groups_failed"] == 0
    assert wall < 600, wall  # the bound: under 10 minutes, base model build included
