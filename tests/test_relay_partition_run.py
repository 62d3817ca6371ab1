"""The master relay's port partitioned for 30 s during a real run of the default example, and the master relay
given notice (SIGTERM) or killed (SIGKILL): how long the trainer stalls. `slow`: a few minutes.

The whole run (dev stack, workers, `laminar run examples/tiny.toml --rollout.replicas=4`) runs in a private
network namespace (tests/netpart.py), so the partition (every packet to or from the master relay's port dropped)
touches nothing else on the machine. The driver (`python -m tests.test_relay_partition_run`) prints its
measurements as JSON; the test asserts on them. Measured before the relay timeouts and breakers: 30 s without a
step (the push blocked for the 30 s connect timeout), and another 4.1 s on the next push.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import netpart

REPO_ROOT = Path(__file__).resolve().parents[1]
PARTITION_S = 30.0


def _events(path: Path, name: str) -> list[dict]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        if f'"{name}"' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == name:
            rec["t"] = _ts(rec["timestamp"])
            out.append(rec)
    return out


def _ts(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _wait(what: str, probe, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


def _steps(log: Path) -> list[tuple[float, int]]:
    return [(e["t"], e["step"]) for e in _events(log, "train_step_completed")]


def _longest_gap(steps: list[tuple[float, int]], start: float, end: float) -> float:
    """The longest time without a completed step inside [start, end] (the window's edges count as bounds)."""
    times = [start] + [t for t, _ in steps if start < t < end] + [end]
    return max(b - a for a, b in zip(times, times[1:], strict=False))


def _relay_pid(home: Path, host: str) -> int | None:
    """The pid of this run's relay worker of `host`, as its launcher last started it (run.log), when it is alive
    and is this run's (its LAMINAR_HOME): never a process of another run on the machine."""
    import psutil

    started = [e["pid"] for e in _events(home / "run.log", "process_started") if e.get("name") == f"relay-{host}"]
    if not started:
        return None
    try:
        proc = psutil.Process(started[-1])
        if proc.status() == psutil.STATUS_ZOMBIE or proc.environ().get("LAMINAR_HOME") != str(home):
            return None
    except psutil.Error:
        return None
    return proc.pid


def drive(steps: int) -> dict:
    home = Path(os.environ["LAMINAR_HOME"])
    run_id = f"partition-{int(time.time())}"
    home.mkdir(parents=True, exist_ok=True)
    logs = home / "logs" / run_id
    laminar = str(Path(sys.executable).parent / "laminar")
    env = {**os.environ, "LAMINAR_LOG_FORMAT": "json"}
    run = subprocess.Popen([laminar, "run", str(REPO_ROOT / "examples" / "tiny.toml"), "--rollout.replicas=4",
                            "--steps", str(steps), "--run-id", run_id, "--log-format", "json"],
                           env=env, cwd=REPO_ROOT, stdout=(home / "run.log").open("w"), stderr=subprocess.STDOUT,
                           start_new_session=True)
    out: dict = {"run_id": run_id}
    try:
        trainer = logs / "trainer.log"
        master = _wait("the master relay's address",
                       lambda: [e["addr"] for e in _events(logs / "relay-host-0.log", "relay_started")], 300)[-1]
        out["master"] = master
        _wait("step 20", lambda: any(s >= 20 for _, s in _steps(trainer)), 600)
        before = time.time()
        time.sleep(10)
        t_part = time.time()
        out["gap_before_s"] = _longest_gap(_steps(trainer), before, t_part)
        netpart.drop_port(int(master.rsplit(":", 1)[1]))
        try:
            time.sleep(PARTITION_S)
        finally:
            netpart.heal()
        t_heal = time.time()
        time.sleep(15)
        s = _steps(trainer)
        out["steps_during_partition"] = sum(1 for t, _ in s if t_part < t < t_heal)
        out["gap_partition_s"] = _longest_gap(s, t_part, t_heal)
        out["gap_after_heal_s"] = _longest_gap(s, t_heal, t_heal + 15)
        out["push_failed"] = [(round(e["t"] - t_part, 2), e["error"][:120])
                              for e in _events(trainer, "relay_push_failed") if e["t"] > t_part]
        out["stall_s_partition"] = round(sum(e.get("stall_s", 0) for e in _events(trainer, "train_step_completed")
                                             if t_part < e["t"] < t_heal), 3)
        # Replicas on host-0 (the partitioned relay's host) that had loaded from it before: when each first loaded a
        # version from the other relay (over TCP).
        loads = _events(logs / "rollout-host-0.log", "policy_loaded")
        firsts = {}
        for rep in sorted({e["replica_id"] for e in loads if e["t"] <= t_part}):
            tcp = [e for e in loads if e["replica_id"] == rep and e["t"] > t_part and e["via"] == "tcp"]
            firsts[rep] = round(tcp[0]["t"] - t_part, 2) if tcp else None
        out["host0_first_tcp_load_s"] = firsts
        out["host0_poll_failures"] = len([e for e in _events(logs / "rollout-host-0.log", "relay_poll_failed")
                                          if t_part < e["t"] < t_heal])
        control = (logs / "control.log").read_text(errors="replace") if (logs / "control.log").exists() else ""
        out["control_relay_out"] = control.count("relay_out")
        # Back in the chain: the trainer pushes to it as master again (it is first by relay id).
        back = [e["t"] for e in _events(trainer, "weights_published") if e["t"] > t_heal and e.get("address") == master]
        out["master_again_after_heal_s"] = round(back[0] - t_heal, 2) if back else None
        # Notice, then kill, of the master relay's worker (host-0): the longest step gap in the 5 s after each (the
        # fault itself) and in the 20 s after (the restarted relay's rejoin and republish included), the failed
        # pushes and the publish stall summed over the 20 s.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            _wait("host-0's relay worker", lambda: _relay_pid(home, "host-0"), 120)
            time.sleep(15)  # it rejoined (or is back after the previous fault) and holds the newest version
            pid = _relay_pid(home, "host-0")
            assert pid is not None, "host-0's relay worker went away"
            t0 = time.time()
            os.kill(pid, sig)
            time.sleep(20)
            s = _steps(trainer)
            out[f"gap_{sig.name}_5s"] = round(_longest_gap(s, t0, t0 + 5), 3)
            out[f"gap_{sig.name}_20s"] = round(_longest_gap(s, t0, t0 + 20), 3)
            out[f"steps_{sig.name}_20s"] = sum(1 for t, _ in s if t0 < t < t0 + 20)
            out[f"push_failed_{sig.name}"] = sum(1 for e in _events(trainer, "relay_push_failed") if t0 < e["t"] < t0 + 20)
            out[f"stall_{sig.name}_20s"] = round(sum(e.get("stall_s", 0) for e in _events(trainer, "train_step_completed")
                                                     if t0 < e["t"] < t0 + 20), 3)
        out["relay_exits"] = [(e.get("name"), e.get("code")) for e in _events(home / "run.log", "process_exited")]
        out["notice_left"] = [(round(e["t"], 1), e.get("spent_s"), e.get("busy"))
                              for e in _events(logs / "relay-host-0.log", "relay_left")]
        out["notice_update"] = [e.get("update_s") for e in _events(logs / "relay-host-0.log", "relay_leaving")]
    finally:
        os.killpg(run.pid, signal.SIGINT)
        try:
            run.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
        subprocess.run([str(Path(sys.executable).parent / "laminar"), "dev", "down"], env=env, cwd=REPO_ROOT,
                       capture_output=True, timeout=120)
    return out


@pytest.mark.slow
def test_master_relay_partitioned_for_30_s_stalls_the_trainer_at_most_2_s(tmp_path):
    why = netpart.unavailable()
    if why:
        pytest.skip(f"partition run: {why}")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "LAMINAR_HOME": str(tmp_path / "home")}
    done = netpart.run_in_netns([sys.executable, "-m", "tests.test_relay_partition_run", "400"], env=env,
                                timeout_s=1500, capture_output=True, text=True, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    m = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(m, indent=1))
    # Before: 30 s without a step. Now the push fails once at the master (1 s connect timeout) and the breaker
    # skips it after that: the longest gap is one connect timeout plus a normal step.
    assert m["gap_partition_s"] <= 2.0 + m["gap_before_s"]
    assert m["steps_during_partition"] > 0
    # The replicas of host-0 load a newer version from the other relay within 5 s of the partition.
    assert m["host0_first_tcp_load_s"] and all(v is not None and v <= 5.0 for v in m["host0_first_tcp_load_s"].values())
    # The workflow took the master out of the chain, and back after the heal (probes back off to 8 s).
    assert m["control_relay_out"] >= 1
    assert m["master_again_after_heal_s"] is not None and m["master_again_after_heal_s"] <= 15
    # A relay on notice left the chain by its update and exited 0 (the launcher restarted it): no push failed (it
    # was out of the chain before it stopped serving), and the trainer stalled no longer than when it was killed.
    # Steps come 0.3-2 s apart on this shared machine (gap_before_s), so a gap is compared with the longer of
    # the kill's and the quiet one's, plus 0.5 s.
    assert m["notice_update"] and ["relay-host-0", 0] in m["relay_exits"]
    assert m["push_failed_SIGTERM"] == 0
    assert m["gap_SIGTERM_5s"] <= max(m["gap_SIGKILL_5s"], m["gap_before_s"]) + 0.5


if __name__ == "__main__":
    print(json.dumps(drive(int(sys.argv[1]))))
