"""`laminar bench control`: the pure cell arithmetic (bench/control_plan.py), and one short real run (its own dev
stack, the real control worker and workflow, synthetic replicas through the real updates)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from laminar.bench.control_plan import (
    Cell,
    cell_from_sim,
    done_when,
    draw_hold_s,
    handovers,
    heaviest,
    intervals,
    latency_summary,
    percentile,
    predicted_updates_per_s,
    replica_stalls,
    run_overrides,
    workflow_task_latencies,
)
from laminar.config import RunConfig
from laminar.rl.factory import check_engines
from laminar.services.rollout.timing import TIMING

ROOT = Path(__file__).resolve().parent.parent


def test_cell_refuses_what_cannot_run():
    for bad in ({"replicas": 0}, {"groups_per_s": 0.0}, {"slots": 0}, {"step_s": -1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Cell(**{"label": "x", "replicas": 2, "groups_per_s": 1.0, "slots": 4, **bad})


def test_little_law_hold_and_scaling():
    c = Cell("7b/256", replicas=80, groups_per_s=16.0, slots=64, step_s=30.0)
    assert c.per_replica_groups_per_s == pytest.approx(0.2)
    assert c.mean_hold_s == pytest.approx(320.0)  # 64 groups in flight, one finishing every 5 s
    d = c.scaled(2)
    assert (d.replicas, d.groups_per_s, d.slots, d.groups_per_step, d.step_s) == (160, 32.0, 64, 1024, 30.0)
    assert d.groups_per_step / d.groups_per_s == c.groups_per_step / c.groups_per_s  # a step as often
    assert d.mean_hold_s == pytest.approx(c.mean_hold_s)  # each replica as busy as before
    assert d.label == "7b/256 x2"
    with pytest.raises(ValueError):
        c.scaled(0)


def test_cell_from_a_simulated_row():
    row = {"model": "7b", "gpus": 256, "replicas": 80, "iteration_s": 32.0, "trainer_idle_fraction": 0.25}
    c = cell_from_sim(row, prompts_per_batch=512, group_size=16, seqs_per_replica=1024)
    assert (c.replicas, c.groups_per_s, c.slots, c.groups_per_step, c.step_s) == (80, 16.0, 64, 512, 24.0)
    with pytest.raises(ValueError, match="iteration_s"):
        cell_from_sim({**row, "iteration_s": 0}, 512, 16, 1024)


def test_predicted_updates_follow_the_cadence():
    # rare completions: a busy replica contacts the workflow about once per contact_s, a little more
    slow = Cell("slow", replicas=100, groups_per_s=1.0, slots=8)
    assert 100 / TIMING.contact_s <= predicted_updates_per_s(slow) <= 100 / TIMING.contact_s * 1.05
    # frequent completions: a report as soon as report_min_groups are complete
    fast = Cell("fast", replicas=10, groups_per_s=400.0, slots=8)
    assert predicted_updates_per_s(fast) == pytest.approx(400.0 / TIMING.report_min_groups)
    # monotone in the rate, linear in the replicas at a fixed per-replica rate
    rates = [predicted_updates_per_s(Cell("c", 10, g, 8)) for g in (1, 5, 20, 80, 320)]
    assert rates == sorted(rates)
    assert predicted_updates_per_s(slow.scaled(4)) == pytest.approx(4 * predicted_updates_per_s(slow))
    assert heaviest([slow, fast]) is fast


def test_hold_times_have_the_cells_mean():
    c = Cell("c", replicas=4, groups_per_s=2.0, slots=5)  # mean hold 10 s
    rng = random.Random(7)
    draws = [draw_hold_s(rng, c) for _ in range(20000)]
    assert sum(draws) / len(draws) == pytest.approx(10.0, rel=0.03)
    assert min(draws) >= 0


def test_run_overrides_make_a_valid_config():
    c = Cell("c", replicas=3, groups_per_s=2.0, slots=4, groups_per_step=8)
    cfg = check_engines(RunConfig.load(None, run_overrides(c, updates_per_segment=50)))
    assert (cfg.rollout.replicas, cfg.rollout.max_inflight_groups, cfg.trainer.groups_per_step) == (3, 4, 8)
    assert cfg.run.updates_per_segment == 50 and not cfg.rollout.repack and cfg.relay.relays == 1
    assert RunConfig.load(None, run_overrides(c)).run.updates_per_segment == RunConfig().run.updates_per_segment
    assert RunConfig.load(None, run_overrides(c)).rollout.heartbeat_timeout_s == RunConfig().rollout.heartbeat_timeout_s
    assert RunConfig.load(None, run_overrides(c, heartbeat_timeout_s=10.0)).rollout.heartbeat_timeout_s == 10.0


def test_percentiles_and_summary():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(range(1, 101)), 99) == 99
    assert latency_summary([0.01, 0.02, 0.5]) == {"count": 3, "p50_s": 0.02, "p99_s": 0.5, "max_s": 0.5}
    assert latency_summary([]) == {"count": 0, "p50_s": None, "p99_s": None, "max_s": None}
    assert intervals([10.0, 0.0, 25.0]) == [10.0, 15.0]


def test_workflow_task_latencies_from_history_events():
    events = [("EVENT_TYPE_WORKFLOW_TASK_SCHEDULED", 0.0), ("EVENT_TYPE_WORKFLOW_TASK_STARTED", 0.01),
              ("EVENT_TYPE_WORKFLOW_TASK_COMPLETED", 0.05), ("EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED", 0.05),
              ("EVENT_TYPE_WORKFLOW_TASK_SCHEDULED", 1.0), ("EVENT_TYPE_WORKFLOW_TASK_STARTED", 1.2),
              ("EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT", 11.2),  # no completion: not counted as completed
              ("EVENT_TYPE_WORKFLOW_TASK_SCHEDULED", 11.2), ("EVENT_TYPE_WORKFLOW_TASK_STARTED", 11.3),
              ("EVENT_TYPE_WORKFLOW_TASK_COMPLETED", 11.4)]
    to_start, to_complete = workflow_task_latencies(events)
    assert to_start == pytest.approx([0.01, 0.2, 0.1])
    assert to_complete == pytest.approx([0.05, 0.2])


def test_handovers_pair_returns_with_the_next_segments_first_claims():
    told = [(0, 10.0, 5), (0, 10.4, 7), (1, 30.0, 2)]
    resumed = [(0, 1.0), (1, 10.9), (1, 11.5), (2, 30.5)]
    h = handovers(told, resumed)
    assert [(x.generation, x.groups_written) for x in h] == [(0, 12), (1, 2)]
    assert h[0].stall_s == pytest.approx(1.5) and h[0].returned_at == 10.4
    assert h[1].stall_s == pytest.approx(0.5)
    assert handovers([(3, 5.0, 1)], [])[0].stall_s is None  # the run stopped before the next segment claimed


def test_replica_stalls_pair_each_park_with_that_replicas_first_claim_in_the_next_segment():
    parks = [("r0", 0, 10.0), ("r1", 0, 10.2), ("r0", 1, 40.0), ("r2", 0, 10.1)]
    resumed = [("r0", 0, 1.0), ("r1", 0, 1.1), ("r1", 1, 10.5), ("r0", 1, 11.0), ("r0", 1, 12.0), ("r0", 2, 40.3)]
    # r0: 10.0 -> 11.0 (its first answer of generation 1, not a later one), r1: 10.2 -> 10.5, r0 again: 40.0 -> 40.3;
    # r2 never resumed (started afresh elsewhere, or the run stopped): no stall
    assert replica_stalls(parks, resumed) == pytest.approx([1.0, 0.3, 0.3])
    assert replica_stalls(parks, []) == []


def _result(p99: float, lost: int = 0, twice: int = 0, every: float | None = 400.0, written: int = 10) -> dict:
    return {"updates": {"claim_prompts": {"p99_s": p99}, "add_experience": {"p99_s": 0.01}},
            "groups_lost": lost, "groups_consumed_twice": twice,
            "continue_as_new": {"interval_s": {"p50_s": every}, "groups_written_total": written}}


def test_done_when():
    assert all(ok for _, ok, _ in done_when(_result(0.2)))
    failing = {what for what, ok, _ in done_when(_result(0.3, lost=1, twice=2, every=20.0)) if not ok}
    assert failing == {"update p99 <= 0.25 s", "groups lost = 0", "groups consumed twice = 0",
                       "hand-overs that write groups out at most every 5 min"}
    assert len(done_when(_result(0.1, written=0))) == 3  # no hand-over wrote anything out: nothing to judge


@pytest.mark.slow
def test_bench_control_runs_the_real_workflow(tmp_path):
    """A few seconds of 3 synthetic replicas on a real dev server and control worker, with a continue-as-new
    forced by a small segment: every key of the report is there, and no group is lost or consumed twice."""
    from tests.fixtures.devhome import own_dev_stack

    out = tmp_path / "control.json"
    with own_dev_stack(tmp_path / "home") as dev:
        proc = subprocess.run(
            [sys.executable, "-m", "laminar.cli.main", "bench", "control", "--replicas", "3", "--groups-per-s", "6",
             "--slots", "3", "--groups-per-step", "4", "--step", "0.2s", "--duration", "8s", "--warmup", "1s",
             "--updates-per-segment", "30", "--json", str(out)],
            env={**dev.env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "updates/s" in proc.stderr  # progress lines while it runs
    r = json.loads(out.read_text())["results"][0]
    for key in ("updates_per_s", "updates", "all_updates", "workflow_task", "history_events_per_s", "cpu_cores",
                "server_rss_mib", "load_avg_1m", "continue_as_new", "groups_lost", "groups_consumed_twice",
                "accounting"):
        assert key in r, key
    assert r["updates_per_s"] > 0 and r["all_updates"]["p99_s"] is not None
    assert {"claim_prompts"} <= set(r["updates"])
    assert r["cpu_cores"]["temporal_server"] is not None and r["cpu_cores"]["control_worker"] is not None
    assert r["workflow_task"]["schedule_to_complete"]["count"] > 0
    assert r["continue_as_new"]["segments"] >= 2  # 30 updates a segment: it handed over at least once
    # run.handover_keep=true (the bench's default, --handover keep): the replicas parked with their groups and re-attached; none was written out
    assert r["continue_as_new"]["groups_written_total"] == 0 and r["continue_as_new"]["groups_kept_total"] > 0
    assert r["groups_lost"] == 0 and r["groups_consumed_twice"] == 0 and r["accounting"]["ok"], r["accounting"]
    assert r["trainer_steps"] >= 1 and r["replica_errors"] == []
