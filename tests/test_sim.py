"""The simulator (sim/): its cost model's numbers, KV admission, that every schedule comes from the project's own
policy / repack code (a double changes the schedule), and that a small sweep completes."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from laminar import policy as real_policy
from laminar.config import RunConfig
from laminar.rl.costs import CostModel, chain_broadcast_s
from laminar.sim import params as P
from laminar.sim.core import REAL_POLICY, Lengths, PolicyFns, SimConfig, Simulator, simulate
from laminar.sim.scenarios import placements
from laminar.sim.sweep import SweepSpec, golden_max, speedup_summary, sweep

# A small cluster that runs in well under a second: 4 replicas, 2 groups of 4 per replica, 8 groups per step.
SMALL_COSTS = CostModel(
    step_floor_s=0.01, kv_read_s_per_token=0.0, compute_s_per_seq=0.01 / 16, prefill_s_per_token=1e-5,
    trainer_s_per_token=1e-4, weight_bytes=1e9, relay_gbytes_s=100.0, pcie_gbytes_s=50.0, broadcast_gbytes_s=31.5)


def small(mode: str = "laminar", **kw) -> SimConfig:
    base = dict(mode=mode, replicas=4, costs=SMALL_COSTS, kv_capacity=1_000_000, max_inflight_seqs=8,
                groups_per_step=8, group_size=4, prompt_tokens=16, lengths=Lengths(p50=200, cap=4000, seed=1),
                iterations=6, warmup=2)
    base.update(kw)
    return SimConfig(**base)


# -- cost model ------------------------------------------------------------------------------------------------

def test_cost_model_reproduces_the_modelled_engine_defaults():
    c = CostModel.from_modelled(RunConfig().modelled)
    # [modelled] defaults: decode_step_s 0.025 flat up to roofline_batch 64, linear above
    assert c.decode_step_s(1) == pytest.approx(0.025)
    assert c.decode_step_s(64) == pytest.approx(0.025)
    assert c.decode_step_s(128) == pytest.approx(0.05)  # 128 / 64 x 25 ms
    assert c.roofline_batch() == 64
    # 7.6e9 params x 2 B = 15.2 GB: relay hop 15.2/100 + local pull 15.2/50 = 0.152 + 0.304 s; broadcast 15.2/31.5
    assert c.load_s(global_sync=False) == pytest.approx(0.456)
    assert c.load_s(global_sync=False, local_pull=False) == pytest.approx(0.608)
    assert c.load_s(global_sync=True) == pytest.approx(15.2 / 31.5)


def test_decode_roofline_and_kv_reads_for_7b_on_one_h800():
    c = P.MODELS["7b"].costs(tp=1, train_gpus=8)
    # weights 7.62e9 x 2 B = 15.24 GB read at 3.35 TB/s x 0.8 = 2.68 TB/s: 5.687 ms, + 2 ms step overhead
    assert c.step_floor_s == pytest.approx(15.24e9 / 2.68e12 + 2e-3)
    # compute-bound: 2 x 7.62e9 FLOP per sequence at 989 TFLOP/s x 0.5 = 30.82 us a sequence
    assert c.compute_s_per_seq == pytest.approx(2 * 7.62e9 / 494.5e12)
    # roofline batch: 7.687 ms / 30.82 us = 249.4 -> 249
    assert c.roofline_batch() == 249
    assert c.decode_step_s(100) == pytest.approx(c.step_floor_s)  # below the roofline: flat
    assert c.decode_step_s(500) == pytest.approx(500 * c.compute_s_per_seq)  # above: 15.41 ms
    # KV reads: 28 layers x 4 heads x 128 x 2 x 2 B = 57,344 B a token; 1M cached tokens read in 21.4 ms
    assert c.decode_step_s(100, 1e6) == pytest.approx(c.step_floor_s + 1e6 * 57344 / 2.68e12)


def test_decode_steps_closed_form_matches_the_sum_and_inverts():
    c = P.MODELS["32b"].costs(tp=4, train_gpus=64)
    batch, kv0, steps = 120, 300_000, 250
    by_hand = sum(c.decode_step_s(batch, kv0 + batch * i) for i in range(steps))  # memory-bound throughout
    assert c.decode_steps_s(batch, kv0, steps) == pytest.approx(by_hand, rel=1e-9)
    t = c.decode_steps_s(batch, kv0, steps)
    assert c.steps_within(batch, kv0, t) == steps
    assert c.steps_within(batch, kv0, t * 0.999) == steps - 1


def test_kv_capacity_per_replica():
    # 7B, TP 1: 80 GB x 0.9 - 2 GB activations - 15.24 GB weights = 54.76 GB / 57,344 B = 954,938 tokens
    assert P.MODELS["7b"].kv_capacity_tokens(1) == 954_938
    # 72B, TP 8: 8 x 70 GB - 145.4 GB = 414.6 GB / (80 x 8 x 128 x 4 = 327,680 B) = 1,265,258 tokens
    assert P.MODELS["72b"].kv_capacity_tokens(8) == 1_265_258
    with pytest.raises(ValueError, match="does not fit"):
        P.MODELS["72b"].kv_capacity_tokens(1)


def test_chain_broadcast_appendix_d():
    # 72B (145.4 GB) from the master to 127 relays at 100 GB/s, T_start 5 us:
    # 1.454 + 126 x 5e-6 + 2 sqrt(126 x 1.454 x 5e-6) = 1.454 + 0.00063 + 0.0605 = 1.515 s (paper Fig. 18: < 1.6 s)
    t = chain_broadcast_s(128, 145.4e9, 100e9, 5e-6)
    assert t == pytest.approx(1.454 + 126 * 5e-6 + 2 * math.sqrt(126 * 1.454 * 5e-6))
    assert t < 1.6
    assert chain_broadcast_s(2, 1e9, 1e9, 0.01) == pytest.approx(1.01)  # one hop


def test_kv_capacity_bounds_admission():
    # Slots for 16 sequences (4 groups of 4). Prompts of 16 tokens: a group needs 4 x 16 = 64 tokens to be
    # admitted. With 150 tokens of KV a replica admits group 1 (0 + 64 <= 150) and group 2 (64 + 64 = 128 <=
    # 150) but never a third while those two hold at least their 128 prompt tokens (128 + 64 > 150).
    roomy = simulate(small(max_inflight_seqs=16))
    tight = simulate(small(max_inflight_seqs=16, kv_capacity=150))
    assert roomy.peak_in_flight == 16
    assert tight.peak_in_flight == 8
    assert tight.tokens_per_s < roomy.tokens_per_s


# -- the schedule comes from the project's policy and repack code ----------------------------------------------

def test_real_policy_rules_hold_in_the_simulated_schedule():
    for mode, bound in (("sync", 0), ("one_step", 1), ("stream", 1)):
        res = simulate(small(mode))
        assert res.complete and res.tokens_per_s > 0
        assert max(res.staleness_histogram) <= bound, (mode, res.staleness_histogram)
    sim = Simulator(small("laminar"))
    assert sim.run().complete
    assert sim.ledger.state.groups_consumed == 6 * 8 and sim.ledger.state.groups_consumed_twice == 0


def test_a_policy_double_that_forbids_leasing_ahead_changes_the_schedule():
    calls = []

    def no_lease_ahead(policy, prompt_cursor, version, groups_generated):
        calls.append(prompt_cursor)
        return max(0, (version + 1) * policy.groups_per_step - prompt_cursor)  # only the trainer's current batch

    real = simulate(small("laminar"))
    double = simulate(small("laminar"), replace(REAL_POLICY, fresh_lease_room=no_lease_ahead))
    assert calls  # the simulator asked the double
    assert max(real.staleness_histogram) >= 1  # laminar leases ahead: some samples are a version old
    assert max(double.staleness_histogram) == 0  # nothing leased ahead: every sample on-policy
    assert double.tokens_per_s < real.tokens_per_s
    assert double.step_times != real.step_times


def test_repack_is_the_planner_s_decision():
    # 2 replicas' worth of long tails: the real planner moves trajectories, a planner that plans nothing does not
    cfg = small("laminar", replicas=6, lengths=Lengths(p50=200, cap=4000, seed=3), iterations=8)
    real = simulate(cfg)
    none = simulate(cfg, PolicyFns(plan_repack=lambda loads, **kw: []))
    assert real.repacks > 0 and none.repacks == 0
    assert real.step_times != none.step_times
    assert simulate(replace(cfg, repack=False)).repacks == 0  # rollout.repack off: policy.repacks is False


def test_policy_fns_default_to_the_project_s_functions():
    assert REAL_POLICY.fresh_lease_room is real_policy.fresh_lease_room
    assert REAL_POLICY.trainer_batch is real_policy.trainer_batch
    assert REAL_POLICY.may_start is real_policy.may_start and REAL_POLICY.load_action is real_policy.load_action


# -- search and sweeps -----------------------------------------------------------------------------------------

def test_golden_search_finds_the_peak_of_a_unimodal_function():
    seen = []

    def f(i):
        seen.append(i)
        return -abs(i - 37)

    assert golden_max(f, 0, 126) == 37
    assert len(set(seen)) < 20  # far fewer than the 127 candidates


def test_placements_are_whole_machines_and_sync_is_colocated():
    m = P.MODELS["72b"]
    assert [p.label() for p in placements(m, 64, "sync")] == ["colocated"]
    splits = placements(m, 64, "laminar")
    assert [p.train for p in splits] == [8, 16, 24, 32, 40, 48, 56]
    assert all(p.rollout % 8 == 0 and p.replicas == p.rollout // 8 for p in splits)


def test_small_sweep_completes_with_every_mode():
    spec = SweepSpec(model="7b", gpus=(16,), workload="uniform", iterations=3, warmup=1, search_iterations=2,
                     search_warmup=1)
    report = sweep(spec)
    rows = report["rows"]
    assert [r["mode"] for r in rows] == ["laminar", "sync", "one_step", "stream", "partial_rollout"]
    assert all(r["complete"] and r["tokens_per_s"] > 0 for r in rows)
    assert rows[1]["placement"] == "colocated" and rows[1]["staleness_max"] == 0
    assert rows[0]["laminar_speedup"] == 1.0
    assert set(speedup_summary(rows)) == {"sync", "one_step", "stream", "partial_rollout"}


@pytest.mark.slow  # make test stays under 15 min; run with -m slow
def test_a_sweep_on_worker_processes_gives_the_rows_it_gives_in_one_process():
    # the cells are independent and seeded alike: only the timing fields (wall_s, sim_s) may differ
    spec = SweepSpec(model="7b", gpus=(16, 32), workload="uniform", modes=("laminar", "sync"), iterations=3,
                     warmup=1, search_iterations=2, search_warmup=1)
    serial, parallel = sweep(spec, workers=1)["rows"], sweep(spec, workers=2)["rows"]
    timing = {"wall_s", "sim_s"}
    assert [(r["gpus"], r["mode"]) for r in parallel] == [(16, "laminar"), (16, "sync"), (32, "laminar"), (32, "sync")]
    assert [{k: v for k, v in r.items() if k not in timing} for r in parallel] == [
        {k: v for k, v in r.items() if k not in timing} for r in serial]


# -- failures --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["rollout", "preempt", "trainer", "relay"])
def test_a_failure_costs_throughput_and_the_run_still_completes(kind):
    costs = {"rollout_detect_s": 4.0, "rollout_restart_s": 60.0, "machine_replace_s": 252.0,
             "trainer_detect_s": 12.8, "trainer_restart_s": 0.17, "checkpoint_load_s": 30.0, "checkpoint_every": 10,
             "relay_detect_s": 2.7, "relay_rebuild_s": 0.11}
    cfg = small("laminar", iterations=10, failure_costs=costs, replicas_per_machine=2)
    base = simulate(cfg)
    at = base.step_times[3]  # during the measured window
    hit = simulate(replace(cfg, failures=((kind, at),)))
    assert hit.complete
    assert sum(hit.step_tokens) > 0
    if kind == "relay":  # the host's replicas pull from another relay: a little slower at most
        assert hit.tokens_per_s <= base.tokens_per_s * 1.001
    else:
        assert hit.tokens_per_s < base.tokens_per_s
    if kind == "trainer":  # down for 12.8 + 0.17 + 30 s at least: the step after `at` comes that much later
        assert min(t for t in hit.step_times if t > at) >= at + 42.97


# -- command line ----------------------------------------------------------------------------------------------

def test_relay_link_from_the_relay_benchmark_report():
    from pathlib import Path

    from laminar.sim.scenarios import RelayLink
    link = RelayLink.from_bench(Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "data" / "relay-bench.json")
    assert 1e6 < link.bytes_per_s < 1e12 and 0 < link.t_start_s < 1
    with pytest.raises(ValueError, match="laminar bench relay"):
        RelayLink.from_bench(Path(__file__))


def test_simulate_command_writes_table_json_and_rejects_bad_input(tmp_path):
    import json

    from typer.testing import CliRunner

    from laminar.cli.main import app
    out = tmp_path / "sim.json"
    res = CliRunner().invoke(app, ["simulate", "--model", "7b", "--gpus", "16", "--modes", "laminar,sync",
                                   "--workload", "uniform", "--iterations", "3", "--warmup", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["rows"]] == ["laminar", "sync"]
    assert "laminar vs it" in res.output
    bad = CliRunner().invoke(app, ["simulate", "--model", "13b"])
    assert bad.exit_code == 2 and "13b" in bad.output
    bad = CliRunner().invoke(app, ["simulate", "--fail", "gpu@10"])
    assert bad.exit_code == 2


def test_tool_calling_workload_holds_kv_during_calls_and_repacks():
    # 1..3 segments per trajectory with a sandbox call (median 2 s) between them; paused sequences keep their KV
    lengths = Lengths(p50=100, cap=4000, turns_max=3, env_p50_s=2.0, seed=5)
    cfg = small("laminar", replicas=6, lengths=lengths, tool_output_tokens=8, iterations=8)
    res = simulate(cfg)
    assert res.complete and res.tokens_per_s > 0
    single = simulate(replace(cfg, lengths=replace(lengths, turns_max=1)))
    assert res.step_times != single.step_times  # the calls change the schedule
    for mode in ("sync", "partial_rollout"):
        assert simulate(replace(cfg, mode=mode)).complete


def test_the_validation_twin_charges_the_replica_loop_s_time_outside_the_engine():
    from laminar.sim.scenarios import with_replica_loop

    slower = with_replica_loop(SMALL_COSTS, 0.2)
    assert slower.decode_steps_s(8, 0.0, 100) == pytest.approx(SMALL_COSTS.decode_steps_s(8, 0.0, 100) / 0.8)
    assert slower.prefill_s(1000) == pytest.approx(SMALL_COSTS.prefill_s(1000) / 0.8)
    assert (slower.trainer_s_per_token, slower.weight_bytes) == (SMALL_COSTS.trainer_s_per_token, SMALL_COSTS.weight_bytes)
    assert with_replica_loop(SMALL_COSTS, 0.0) == SMALL_COSTS
    with pytest.raises(ValueError, match="share=1.0"):
        with_replica_loop(SMALL_COSTS, 1.0)
    # the validation's own twin (cli/sim.py simulate_like_bench) charges it: generation-bound, it is that much slower
    base = simulate(small())
    charged = simulate(replace(small(), costs=with_replica_loop(SMALL_COSTS, 0.2)))
    assert charged.tokens_per_s < base.tokens_per_s * 0.9
