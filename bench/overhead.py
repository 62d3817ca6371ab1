"""`laminar bench overhead`: the single-process loop (rl/sync_loop.py) and `laminar run` on the same config,
one after the other, so the price of separate processes and a durable control plane is one number.

Each side reports wall time, response tokens consumed per second, the reward rise (last fifth minus
first tenth of the steps), the time until the 30-step moving average of reward first exceeds 0.6 and
0.8, and groups consumed twice; `laminar run`'s side also carries its time breakdown (the summary's
`profile`). The loop's wall time starts after both models are loaded; laminar's is the summary's
(workflow start to result, worker start-up included).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from laminar.config import RunConfig
from laminar.reporting.report import moving_mean
from laminar.reporting.summary import reward_rise

WINDOW = 30  # steps in the reward moving average
THRESHOLDS = (0.6, 0.8)


def time_to_reward(rewards: list[float], step_end_s: list[float], threshold: float,
                   window: int = WINDOW) -> float | None:
    """Seconds until the `window`-step moving average of reward first exceeds `threshold`: the end time of
    the first step i >= window - 1 whose last `window` rewards average above it; None if none does."""
    above = (i for i, mean in enumerate(moving_mean(rewards, window), start=window - 1) if mean > threshold)
    i = next(above, None)
    return None if i is None else round(step_end_s[i], 3)


def side(wall_s: float, tokens: int, rewards: list[float], step_end_s: list[float],
         groups_consumed_twice: int) -> dict[str, Any]:
    """One column of the comparison."""
    out: dict[str, Any] = {
        "wall_s": round(wall_s, 2),
        "steps": len(rewards),
        "tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else 0.0,
        "reward_rise": round(reward_rise(rewards), 4),
        "groups_consumed_twice": groups_consumed_twice,
    }
    for t in THRESHOLDS:
        out[f"time_to_reward_{str(t).replace('.', '_')}_s"] = time_to_reward(rewards, step_end_s, t)
    return out


def ratios(loop: dict[str, Any], laminar: dict[str, Any]) -> dict[str, float | None]:
    """laminar / loop for wall time and times to reward, loop / laminar for tokens/s (higher = slower)."""
    out: dict[str, float | None] = {}
    for key in ("wall_s", *(k for k in loop if k.startswith("time_to_reward"))):
        a, b = loop.get(key), laminar.get(key)
        out[key] = round(b / a, 2) if a and b is not None else None
    a, b = loop["tokens_per_s"], laminar["tokens_per_s"]
    out["tokens_per_s"] = round(a / b, 2) if b else None
    a, b = loop.get("cpu_s"), laminar.get("cpu_s")
    out["cpu_s"] = round(b / a, 2) if a and b is not None else None
    return out


def run_loop(cfg: RunConfig, home: Path) -> dict[str, Any]:
    """The single-process loop in this process (torch's default thread count: every core)."""
    from laminar.rl.sync_loop import run_sync_loop
    from laminar.services.model_files import resolve_model_dir

    cpu0 = time.process_time()
    result = run_sync_loop(cfg, resolve_model_dir(cfg, home))
    cpu = time.process_time() - cpu0
    rewards = [m.reward_mean for m in result.metrics]
    out = side(result.wall_s, sum(m.tokens for m in result.metrics), rewards, result.step_end_s, 0)
    out["cpu_s"] = round(cpu, 2)  # every thread of this process, model loading included
    return out


def run_laminar(config_path: Path, overrides: list[str]) -> dict[str, Any]:
    """`laminar run` in a child process (it starts the dev stack if none runs); its summary -> one column.
    Interrupted or failing, the child is stopped as Ctrl-C stops it (SIGTERM: it ends its run and its workers),
    and the run is terminated if it still runs: no run of the benchmark outlives it."""
    from laminar.client.run_control import end_runs_now
    from laminar.client.settings import Settings

    run_id = "bench-overhead-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="laminar-bench-") as tmp:
        summary_path = Path(tmp) / "summary.json"
        child = subprocess.Popen([sys.executable, "-m", "laminar.cli.main", "run", str(config_path), "--run-id", run_id,
                                  "--summary", str(summary_path), *overrides])
        try:
            if child.wait() != 0:
                raise subprocess.CalledProcessError(child.returncode, child.args)
        except BaseException:
            if child.poll() is None:
                child.terminate()
                child.wait(timeout=120)
            end_runs_now(Settings.from_env(), [run_id], "laminar bench overhead was interrupted or failed")
            raise
        s = json.loads(summary_path.read_text())
    tokens = round(s["tokens_per_s"] * s["wall_s"])
    out = side(s["wall_s"], tokens, s["reward_per_step"], s["step_end_s"], s["groups_consumed_twice"])
    out["run_id"] = s["run_id"]
    out["profile"] = s.get("profile")
    out["cpu_s"] = cpu_total(out["profile"])
    return out


def cpu_total(profile: dict[str, Any] | None) -> float | None:
    """The CPU seconds of every process of the run that the summary names (its workers and, when `laminar run`
    started or found the dev stack, the Temporal server since it started): on a machine whose cores are all
    busy, wall time follows CPU time, so laminar's CPU against the loop's is a ratio that other load on the
    machine moves far less than the wall times'."""
    cpu = (profile or {}).get("cpu_s") or {}
    return round(sum(cpu.values()), 2) if cpu else None
