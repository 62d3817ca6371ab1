"""`laminar bench throughput`: the metric arithmetic (records -> numbers, expected values worked out in the
comments), the run configs it builds, the table, JSON and plot (reading the store: tests/test_storage_records.py),
and one end-to-end run of the real command on a tiny modelled setting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from laminar.bench.throughput import (
    WORKLOAD_SETS,
    BenchSpec,
    KvPoll,
    RunData,
    TrajRow,
    add_ratios,
    batch_tokens,
    consumed_group_ids,
    control_plane_share,
    dump_json,
    fmt_num,
    generation_tokens_per_s,
    kv_utilisation,
    latency_percentiles,
    mean_prompt_tokens,
    measure,
    plot,
    scaled_overrides,
    slot_utilisation,
    staleness,
    table_rows,
    tokens_per_s,
    trainer_idle_fraction,
    version_intervals,
    warmup_steps,
    weight_sync_stall_s,
    window,
)
from laminar.config import MODES, RunConfig
from laminar.contract import ReplicaReport, RunStatus
from laminar.storage import keys
from laminar.storage.objects import LocalObjectStore
from laminar.storage.records import step_records

RUN = "run-bench"


def _traj(group: str, prompt: int, replica: str = "replica-0", version: int = 0, start: float = 0.0,
          end: float = 1.0, sample: int = 0, prompt_tokens: int = 4, response_tokens: int = 10) -> TrajRow:
    return TrajRow(group, prompt, sample, replica, version, start, end, prompt_tokens, response_tokens)


def _rec(step: int, time: float, lengths: list[int] | None = None, wait: float = 0.0, busy: float = 1.0,
         stall: float = 0.0, dropped: int = 0) -> dict:
    """A step record as services/trainer.py writes it (the keys the benchmark reads): `lengths` are the
    response lengths of the trained samples; `dropped` more samples were read but dropped as too stale."""
    lengths = lengths or []
    return {"step": step, "time": time, "samples": len(lengths), "tokens": sum(lengths), "dropped_stale": dropped,
            "response_lengths": lengths + [1000] * dropped, "wait_s": wait, "busy_s": busy, "stall_s": stall}


# -- configuration -------------------------------------------------------------------------------------

def test_warmup_is_the_first_fifth_at_least_one_step() -> None:
    assert warmup_steps(20) == 4  # 20 // 5
    assert warmup_steps(9) == 1  # 9 // 5 = 1
    assert warmup_steps(3) == 1  # 3 // 5 = 0 -> at least 1
    assert warmup_steps(2) == 1  # leaves step 2 to measure
    with pytest.raises(ValueError, match="iterations=1 .* --iterations 2"):
        warmup_steps(1)


def test_scaled_workload_is_one_global_batch_of_replicas_times_per_rollout_concurrency() -> None:
    overrides = scaled_overrides("laminar", 8, "modelled", "long_tail", 20)
    cfg = RunConfig.load(None, overrides)
    # 8 replicas x 4 groups x 8 samples = 256 samples = 32 groups per step; 2 batches may wait: 64
    assert cfg.trainer.groups_per_step == 32 and cfg.rollout.group_size == 8
    assert cfg.trainer.groups_per_step * cfg.rollout.group_size == 256
    assert cfg.rollout.max_inflight_groups == 4 and cfg.rollout.max_ready_groups == 64
    assert (cfg.run.steps, cfg.rollout.replicas, cfg.run.mode) == (20, 8, "laminar")
    assert cfg.rollout.engine == cfg.trainer.engine == "modelled" and cfg.modelled.workload == "long_tail"
    assert cfg.trainer.minibatches == 1
    # every mode accepts the same numbers (one_step/stream need max_ready_groups >= 2 x groups_per_step;
    # stream needs groups_per_step = 4 x replicas to split into its 4 minibatches)
    for mode in MODES:
        for replicas in (1, 2, 8):
            assert RunConfig.load(None, scaled_overrides(mode, replicas, "torch", "uniform", 3)).run.mode == mode


def test_stream_trains_each_batch_in_four_minibatch_steps() -> None:
    cfg = RunConfig.load(None, scaled_overrides("stream", 8, "modelled", "long_tail", 20))
    # 20 global batches of 32 groups = 80 trainer steps of 8 groups (64 samples) each
    assert (cfg.trainer.minibatches, cfg.run.steps, cfg.trainer.groups_per_step) == (4, 80, 32)


def test_uniform_runs_at_a_lower_speedup_and_an_explicit_speedup_wins() -> None:
    # the long tail's iterations are ~300 modelled s, the uniform ones ~40: the same wall-clock control latency
    # is a 7x larger share of the latter, so its runs go 2.5x slower (WORKLOAD_SPEEDUP)
    assert RunConfig.load(None, scaled_overrides("laminar", 8, "modelled", "long_tail", 3)).modelled.speedup == 25.0
    assert RunConfig.load(None, scaled_overrides("laminar", 8, "modelled", "uniform", 3)).modelled.speedup == 10.0
    assert not any(o.startswith("modelled.speedup=") for o in scaled_overrides("sync", 8, "torch", "uniform", 3))
    spec = BenchSpec(modes=("sync",), workloads=("uniform",), replicas=2, iterations=3,
                     extra_overrides=("--modelled.speedup=50",))
    assert spec.run_config("sync", "uniform", "20260101-000000").modelled.speedup == 50.0  # the command line's


def test_tools_workload_runs_at_the_long_tail_speedup_and_both_keeps_its_meaning() -> None:
    # tools: long-tailed turns plus tool waits, iterations at least as long as the long tail's: its speedup, 25
    cfg = RunConfig.load(None, scaled_overrides("laminar", 8, "modelled", "tools", 3))
    assert (cfg.modelled.workload, cfg.modelled.speedup) == ("tools", 25.0)
    assert WORKLOAD_SETS == {"both": ("long_tail", "uniform"), "all": ("long_tail", "uniform", "tools")}
    spec = BenchSpec(modes=("laminar", "sync"), workloads=WORKLOAD_SETS["all"], replicas=2, iterations=3)
    assert [(w, m) for w, m, _ in spec.runs()][-2:] == [("tools", "laminar"), ("tools", "sync")]
    assert spec.run_config("sync", "tools", "20260101-000000").run.run_id == "bench-20260101-000000-tools-sync"


@pytest.mark.parametrize(("args", "message"), [
    (("async", 8, "modelled", "long_tail", 3), "mode='async' is not a run mode"),
    (("sync", 8, "modelled", "bimodal", 3), "workload='bimodal' is not a modelled workload"),
    (("sync", 8, "vllm", "uniform", 3), "engine='vllm' is not an engine"),
])
def test_scaled_overrides_name_the_bad_value(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        scaled_overrides(*args)


def test_spec_builds_one_config_per_mode_and_workload_with_extra_overrides_on_top() -> None:
    spec = BenchSpec(modes=("sync",), workloads=("uniform",), replicas=2, iterations=3,
                     extra_overrides=("--modelled.response_p50_tokens=64",))
    cfg = spec.run_config("sync", "uniform", "20260101-000000")
    assert cfg.run.run_id == "bench-20260101-000000-uniform-sync"
    assert cfg.trainer.groups_per_step == 8  # 2 replicas x 4 groups
    assert cfg.modelled.response_p50_tokens == 64 and cfg.modelled.workload == "uniform"
    keys.check_id("run_id", cfg.run.run_id)  # a valid store key part


# -- metric arithmetic ---------------------------------------------------------------------------------

def test_window_starts_at_the_end_of_the_last_warmup_step() -> None:
    records = [_rec(1, 100.0), _rec(2, 110.0), _rec(3, 130.0)]
    measured, t_from, t_to = window(records, 1)
    assert [r["step"] for r in measured] == [2, 3] and (t_from, t_to) == (100.0, 130.0)
    with pytest.raises(ValueError, match="3 step records but warm-up is 3 steps"):
        window(records, 3)


def test_tokens_per_s_is_batch_tokens_over_modelled_window() -> None:
    # prompt 5 tokens. Step 2: 2 samples x 5 + (10 + 20) = 40; step 3: 1 x 5 + 30 = 35; step 1 is warm-up.
    # window 100 -> 130 = 30 wall s x scale 100 = 3000 modelled s; 75 / 3000 = 0.025 tokens per modelled s
    # step 3 also read 2 samples of 1000 tokens that it dropped as too stale: not trained, not counted
    records = [_rec(1, 100.0, [999, 999]), _rec(2, 110.0, [10, 20]), _rec(3, 130.0, [30], dropped=2)]
    assert batch_tokens(records[1], 5) == 40 and batch_tokens(records[2], 5) == 35
    assert tokens_per_s(records, 1, 5, 100.0) == pytest.approx(0.025)
    # the torch engine: scale 1, so 75 / 30 = 2.5 tokens per wall s
    assert tokens_per_s(records, 1, 5, 1.0) == pytest.approx(2.5)


def test_mean_prompt_tokens() -> None:
    assert mean_prompt_tokens([_traj("g1", 1, prompt_tokens=4), _traj("g1", 1, prompt_tokens=6)]) == 5.0
    assert mean_prompt_tokens([]) == 0.0


def test_generation_rate_counts_trajectories_that_ended_in_the_window() -> None:
    trajs = [_traj("a", 0, end=99.0, response_tokens=7),  # before the window
             _traj("b", 1, end=105.0, response_tokens=11),
             _traj("c", 2, end=130.0, response_tokens=13),  # the window's end is included
             _traj("d", 3, end=131.0, response_tokens=17)]  # after it
    # (11 + 13) response tokens / ((130 - 100) x 2) modelled s = 24 / 60 = 0.4
    assert generation_tokens_per_s(trajs, 100.0, 130.0, 2.0) == pytest.approx(0.4)
    assert generation_tokens_per_s(trajs, 100.0, 100.0, 2.0) == 0.0  # an empty window


def test_kv_utilisation_averages_replicas_then_polls_in_the_window() -> None:
    polls = [
        KvPoll(99.0, [(90, 100)]),  # before the window
        KvPoll(100.0, [(10, 100), (30, 100)]),  # (0.1 + 0.3) / 2 = 0.2
        KvPoll(110.0, []),  # no replica reported yet: skipped, not a zero
        KvPoll(120.0, [(0, 0), (50, 100)]),  # capacity 0 (no weights yet) is left out: 0.5
        KvPoll(131.0, [(100, 100)]),  # after the window
    ]
    # (0.2 + 0.5) / 2 = 0.35
    assert kv_utilisation(polls, 100.0, 130.0) == pytest.approx(0.35)
    assert kv_utilisation(polls, 200.0, 300.0) is None


def test_trainer_idle_fraction_and_sync_stall_over_the_window() -> None:
    records = [_rec(1, 10.0, wait=50.0, busy=50.0, stall=5.0),  # warm-up: left out
               _rec(2, 14.0, wait=3.0, busy=1.0, stall=0.01),
               _rec(3, 20.0, wait=1.0, busy=5.0, stall=0.03)]
    # waits 3 + 1 = 4 over (3 + 1) + (1 + 5) = 10 -> 0.4
    assert trainer_idle_fraction(records, 1) == pytest.approx(0.4)
    # stall (0.01 + 0.03) / 2 = 0.02 wall s per step x scale 100 = 2.0 modelled s
    assert weight_sync_stall_s(records, 1, 100.0) == pytest.approx(2.0)
    # stream: 4 minibatch steps per batch, one publish per batch: (0.01 + 0.03) x 4 / 2 steps = 0.08 per batch
    assert weight_sync_stall_s(records, 1, 1.0, steps_per_batch=4) == pytest.approx(0.08)
    # a step whose publish was skipped records stall 0.0; an old record without the key counts as 0 too
    del records[2]["stall_s"]
    assert weight_sync_stall_s(records, 1, 1.0) == pytest.approx(0.005)  # (0.01 + 0) / 2


def test_staleness_drops_empty_gaps_and_sorts_numerically() -> None:
    hist, top = staleness({"10": 1, "2": 3, "0": 5, "1": 0})
    assert hist == {0: 5, 2: 3, 10: 1} and list(hist) == [0, 2, 10] and top == 10
    assert staleness({}) == ({}, 0)


def test_consumed_groups_whole_batches_by_prompt_batch() -> None:
    # B = 2 groups per step, 2 steps done: prompts 0..3 (batches 0 and 1) were consumed, 4 and 5 not,
    # whatever the order they completed in
    trajs = [_traj(f"g{p}", p, end=10.0 - p) for p in range(6)]
    assert consumed_group_ids(trajs, True, 2, groups_consumed=4) == {"g0", "g1", "g2", "g3"}
    # stream ended inside batch 2 (prompts 4, 5) after one minibatch of 1 group: the one that completed first
    # of that batch, g5 (ends at 5) before g4 (ends at 6)
    assert consumed_group_ids(trajs, True, 2, groups_consumed=5) == {"g0", "g1", "g2", "g3", "g5"}


def test_consumed_groups_oldest_ready_by_group_completion() -> None:
    # A group completes when its LAST sample ends: gA at 5 (samples end 1 and 5), gB at 3, gC at 3, gD at 9.
    # The first 3 to complete: gB and gC (tie at 3, broken by id), then gA.
    trajs = [_traj("gA", 0, end=1.0), _traj("gA", 0, end=5.0, sample=1), _traj("gB", 1, end=3.0),
             _traj("gC", 2, end=3.0), _traj("gD", 3, end=9.0)]
    assert consumed_group_ids(trajs, False, 3, groups_consumed=3) == {"gA", "gB", "gC"}
    assert consumed_group_ids(trajs, False, 3, groups_consumed=2) == {"gB", "gC"}


def test_latency_percentiles_over_consumed_trajectories_in_modelled_seconds() -> None:
    # 100 consumed trajectories with latencies 1..100 wall s, x scale 2 -> 2..200 modelled s.
    # nearest rank: p50 = 50th smallest = 100; p99 = 99th smallest = 198. The unconsumed 1000 s one is ignored.
    trajs = [_traj("g1", 1, start=10.0, end=10.0 + i, sample=i) for i in range(1, 101)]
    trajs.append(_traj("g9", 9, start=0.0, end=1000.0))
    assert latency_percentiles(trajs, {"g1"}, 2.0) == (100.0, 198.0)
    assert latency_percentiles(trajs, set(), 2.0) == (0.0, 0.0)


def test_control_plane_share_over_steps_after_the_first() -> None:
    records = [_rec(1, 0.0, wait=0.0, busy=2.0), _rec(2, 0.0, wait=1.0, busy=2.0), _rec(3, 0.0, wait=3.0, busy=2.0)]
    # iteration time of steps 2..3: (1 + 2) + (3 + 2) = 8 s; 0.4 s of control-plane wait -> 0.05
    assert control_plane_share(0.4, records) == pytest.approx(0.05)
    assert control_plane_share(0.4, records[:1]) == 0.0


def test_version_intervals_merge_per_replica_and_version_in_modelled_time() -> None:
    t0 = 1000.0
    trajs = [
        _traj("a", 0, "replica-10", 0, start=1000.0, end=1002.0),
        _traj("a", 0, "replica-10", 0, start=1001.0, end=1003.0, sample=1),  # overlaps: merged -> [0, 3]
        _traj("b", 1, "replica-10", 0, start=1003.0, end=1004.0),  # touches: merged -> [0, 4]
        _traj("c", 2, "replica-10", 1, start=1005.0, end=1006.0),  # a newer version: its own interval
        _traj("d", 3, "replica-10", 0, start=1007.0, end=1008.0),  # a gap: a separate interval
        _traj("e", 4, "replica-2", 1, start=1001.0, end=1002.5),
    ]
    got = version_intervals(trajs, t0, scale=10.0)
    # replicas in natural order (2 before 10); seconds since t0 x 10
    assert list(got) == ["replica-2", "replica-10"]
    assert got["replica-2"] == [(10.0, 25.0, 1)]
    assert got["replica-10"] == [(0.0, 40.0, 0), (50.0, 60.0, 1), (70.0, 80.0, 0)]


def test_ratios_are_per_workload_against_laminar() -> None:
    results = [{"mode": "laminar", "workload": "long_tail", "tokens_per_s": 100.0},
               {"mode": "sync", "workload": "long_tail", "tokens_per_s": 50.0},
               {"mode": "sync", "workload": "uniform", "tokens_per_s": 80.0},  # no laminar run on uniform
               {"mode": "stream", "workload": "long_tail", "tokens_per_s": None}]  # a failed run
    add_ratios(results)
    assert [r["ratio_to_laminar"] for r in results] == [1.0, 0.5, None, None]


def test_fmt_num() -> None:
    assert [fmt_num(v) for v in (12345.6, 100.0, 41.23, 0.01234, 0.0)] == ["12,346", "100", "41.2", "0.0123", "0"]


# -- records in a real store ---------------------------------------------------------------------------

def _status(**overrides: object) -> RunStatus:
    fields: dict[str, object] = dict(
        run_id=RUN, phase="finished", step=3, total_steps=3, policy_version=3, ready_groups=1, open_leases=0,
        groups_generated=7, groups_consumed=6, groups_consumed_twice=0, tokens_consumed=0, reward_recent=[],
        versions_in_use=[3], max_versions_in_use=2, staleness_histogram={"0": 8, "1": 4}, trainer_wait_fraction=0.0,
        history_events=100, history_events_max=100, continued_as_new=0, checkpoints=[], relays=[],
        replicas=[ReplicaReport("replica-0", "host-0", 3, 0, 0, 100)], started_at=0.0,
    )
    fields.update(overrides)
    return RunStatus(**fields)  # type: ignore[arg-type]


def _run_data(tmp_path: Path, mode: str = "laminar") -> RunData:
    """A 3-step run of 2 groups per step (1 replica x ... overridden), 2 samples per group, scale 10."""
    cfg = RunConfig.load(None, [*scaled_overrides(mode, 1, "modelled", "long_tail", 3), "trainer.groups_per_step=2",
                                "rollout.group_size=2", "rollout.max_ready_groups=4", "modelled.speedup=10"])
    cfg = cfg.with_run_id(RUN)
    store = LocalObjectStore(tmp_path / "store")
    for r in [_rec(1, 100.0, [10, 10, 10, 10], wait=0.0, busy=1.0, stall=0.01),
              _rec(2, 104.0, [20, 20, 20, 20], wait=3.0, busy=1.0, stall=0.02),
              _rec(3, 110.0, [30, 30, 30, 30], wait=4.0, busy=2.0, stall=0.03)]:
        store.put(keys.step_metrics(RUN, r["step"]), json.dumps(r).encode())
    # 7 groups g0..g6, 2 samples each, prompt 6 tokens; group p completes at 99 + 2p (its samples take 1 s and
    # 2 s + p... see ends); g6 completes last and is the one still ready
    trajs = []
    for p in range(7):
        for s in range(2):
            trajs.append(TrajRow(f"g{p}", p, s, f"replica-{p % 2}", p // 2, 95.0 + p, 97.0 + 2 * p - (1 - s),
                                 6, 10 * (s + 1)))
    return RunData(cfg=cfg, final=_status(), started_at=90.0,
                   polls=[KvPoll(101.0, [(25, 100)]), KvPoll(109.0, [(75, 100)]), KvPoll(120.0, [(0, 100)])],
                   records=step_records(store, RUN), trajectories=trajs, control_plane_s=0.5)


def test_measure_one_run(tmp_path: Path) -> None:
    row = measure(_run_data(tmp_path))
    # warm-up 1 step; window 100 -> 110 wall s x 10 = 100 modelled s
    # tokens: prompt 6 (every trajectory); step 2: 4 x 6 + 80 = 104; step 3: 4 x 6 + 120 = 144; 248 / 100 = 2.48
    assert row["tokens_per_s"] == 2.5  # 2.48 rounded to 1 place
    # trajectories ended in (100, 110]: group p sample s ends at 96 + 2p + s: p=2: 100 (out), 101 (in, 20);
    # p=3: 102 (10), 103 (20); p=4: 104, 105 (30); p=5: 106, 107 (30); p=6: 108, 109 (30): 140 / 100 = 1.4
    assert row["generation_tokens_per_s"] == 1.4
    assert row["samples_dropped_stale"] == 0
    assert row["kv_utilisation"] == 0.5  # polls at 101 (0.25) and 109 (0.75); 120 is after the window
    assert row["trainer_idle_fraction"] == round(7 / 10, 4)  # waits 3 + 4 over (3 + 1) + (4 + 2)
    assert row["weight_sync_stall_s"] == 0.25  # (0.02 + 0.03) / 2 x 10
    assert (row["staleness_max"], row["staleness_histogram"]) == (1, {"0": 8, "1": 4})
    # consumed: the first 6 groups to complete (g0..g5; g6 completes last); latencies: group p sample s runs
    # 95 + p -> 96 + 2p + s, i.e. 1 + p + s wall s, x 10: {10, 20, 20, 30, ..., 60, 70} (12 values).
    # sorted: 10 20 20 30 30 40 40 50 50 60 60 70; p50 rank 6 -> 40; p99 rank ceil(11.88) = 12 -> 70
    assert (row["latency_p50_s"], row["latency_p99_s"]) == (40.0, 70.0)
    assert row["control_plane_share"] == round(0.5 / 10, 4)  # 0.5 s over steps 2..3: (3 + 1) + (4 + 2)
    assert (row["iterations"], row["trainer_steps"], row["warmup_steps"]) == (3, 3, 1)
    assert (row["window_s"], row["wall_s"]) == (100.0, 20.0)
    assert (row["mode"], row["workload"], row["groups_consumed_twice"], row["time_unit"]) == \
        ("laminar", "long_tail", 0, "modelled s")


def test_measure_whole_batch_mode_consumes_by_prompt_batch(tmp_path: Path) -> None:
    row = measure(_run_data(tmp_path, mode="sync"))
    # sync trains batch b at step b: 3 steps x 2 groups = prompts 0..5, the same groups as above here
    assert (row["latency_p50_s"], row["latency_p99_s"]) == (40.0, 70.0)
    assert row["mode"] == "sync"


def test_table_json_and_plot(tmp_path: Path) -> None:
    data = _run_data(tmp_path)
    row = measure(data)
    intervals = version_intervals(data.trajectories, 90.0, 10.0)
    row["timeline"] = {r: [list(iv) for iv in ivs] for r, ivs in intervals.items()}
    failed = {"mode": "sync", "workload": "long_tail", "run_id": "x", "error": "run x failed: boom",
              "tokens_per_s": None, "iterations": 0}
    report = {"results": [row, failed], "config": {"replicas": 1, "engine": "modelled", "iterations": 3}}
    add_ratios(report["results"])
    rows = table_rows(report)
    assert rows[0][:4] == ["laminar", "long_tail", "2.5", "1.00x"]
    assert rows[1][2] == "failed: run x failed: boom" and rows[1][3] == "-"
    dump_json(report, tmp_path / "r.json")
    again = json.loads((tmp_path / "r.json").read_text())
    # replica-0's first interval: g0 (version 0) ran 95 -> 97, minus t0 90, x 10
    assert again["results"][0]["timeline"]["replica-0"][0] == [50.0, 70.0, 0]
    plot(again, tmp_path / "r.png")  # redrawn from the JSON
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- end to end ----------------------------------------------------------------------------------------

@pytest.mark.slow  # make test stays under 15 min; run with -m slow
@pytest.mark.timeout(240)
def test_end_to_end_two_modes_two_replicas_three_iterations(tmp_path: Path) -> None:
    """END TO END, about a minute on 2 cores: the real command with its own dev stack (in tmp_path) runs
    laminar and sync, modelled engine, lengths cut to a p50 of 64 and a cap of 512 tokens so each run takes
    seconds."""
    env = {**os.environ, "LAMINAR_HOME": str(tmp_path / "home"), "LAMINAR_LOG_LEVEL": "warning"}
    for k in ("LAMINAR_TEMPORAL_ADDRESS", "LAMINAR_STORE", "LAMINAR_S3_ENDPOINT"):
        env.pop(k, None)
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "laminar.cli.main", "bench", "throughput", "--modes", "laminar,sync", "--replicas", "2",
         "--iterations", "3", "--workload", "long_tail", "--json", str(out), "--plot", str(tmp_path / "out.png"),
         "--modelled.response_p50_tokens=64", "--modelled.max_response_tokens=512", "--modelled.speedup=100"],
        env=env, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(r["mode"], r["workload"]) for r in report["results"]] == [("laminar", "long_tail"), ("sync", "long_tail")]
    for r in report["results"]:
        assert r["iterations"] == 3 and r["groups_consumed_twice"] == 0 and r["tokens_per_s"] > 0
        assert r["time_unit"] == "modelled s" and r["latency_p99_s"] >= r["latency_p50_s"] > 0
    laminar, sync = report["results"]
    assert sync["staleness_max"] == 0 and sync["staleness_histogram"] == {"0": 3 * 8 * 8}  # 3 steps x 8 groups x 8
    assert laminar["ratio_to_laminar"] == 1.0 and sync["ratio_to_laminar"] > 0
    assert report["config"]["groups_per_step"] == 8 and report["config"]["time_scale"] == 100.0
    assert "tokens/s" in proc.stdout and (tmp_path / "out.png").stat().st_size > 0


def test_slot_utilisation_is_in_flight_over_slots_within_the_window() -> None:
    polls = [KvPoll(0.0, [], (32, 32)), KvPoll(1.0, [(1, 10), (1, 10)], (32, 16)), KvPoll(2.0, [], (8, 0)),
             KvPoll(3.0, [], ())]
    # window [1, 2]: poll 1 -> (32 + 16) / 64 = 0.75; poll 2 -> (8 + 0) / 64 = 0.125; mean 0.4375
    assert slot_utilisation(polls, 1.0, 2.0, slots=32) == pytest.approx(0.4375)
    assert slot_utilisation(polls, 3.0, 4.0, slots=32) is None  # no replica reported
