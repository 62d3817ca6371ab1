"""The simulator's control plane (sim/control.py): one run's workflow serves updates one task at a time, continues as
new every `updates_per_segment` updates (every replica stalls; with writes_out it prefills its groups again), and the
simulated runs pay for it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from laminar.sim.control import ControlPlaneCost, ControlServer
from laminar.sim.core import Simulator, simulate
from tests.test_sim import small

FREE = ControlPlaneCost(task_s=0.0, rtt_s=0.0, dispatch_s=0.0, updates_per_segment=10**9, continue_as_new_s=0.0,
                        handover_s=0.0)


def test_updates_queue_behind_each_other_fifo():
    srv = ControlServer(replace(FREE, task_s=0.01, rtt_s=0.002))
    answers = [srv.send(0.0)[0] for _ in range(3)]
    assert answers == pytest.approx([0.012, 0.022, 0.032])  # each waits for the ones before it
    assert srv.send(1.0)[0] == pytest.approx(1.012)  # an idle server answers in task + rtt
    stats = srv.stats(1.01)
    assert stats["updates"] == 4 and stats["queued_max_s"] == pytest.approx(0.02)
    assert stats["utilisation"] == pytest.approx(0.04 / 1.01, rel=1e-3)


def test_every_segment_ends_in_a_continue_as_new_that_holds_the_server():
    srv = ControlServer(replace(FREE, task_s=0.01, updates_per_segment=3, continue_as_new_s=0.5))
    out = [srv.send(0.0) for _ in range(4)]
    assert [h for _, h in out] == [False, False, True, False]
    assert out[2][0] == pytest.approx(0.53)  # the third update's task, then the new run's start
    assert out[3][0] == pytest.approx(0.54)
    assert srv.segments == 2


def test_an_activity_result_holds_the_server_without_counting_as_an_update():
    srv = ControlServer(replace(FREE, task_s=0.01, updates_per_segment=2))
    srv.task(0.0)
    assert srv.send(0.0) == (pytest.approx(0.02), False)


@pytest.mark.parametrize("field,value", [("task_s", -1.0), ("handover_s", -0.1), ("updates_per_segment", 0)])
def test_bad_costs_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        replace(FREE, **{field: value})


def test_a_free_control_plane_changes_nothing_that_matters():
    base = simulate(small())
    free = simulate(small(control_plane=FREE))
    assert free.complete and free.batches == base.batches
    assert free.tokens_per_s == pytest.approx(base.tokens_per_s, rel=0.05)
    assert free.control_plane["updates"] > 0 and free.control_plane["handovers"] == 0


@pytest.mark.parametrize("mode", ["laminar", "sync"])
def test_a_slower_workflow_costs_throughput_and_a_saturated_one_costs_most(mode):
    runs = [simulate(small(mode, control_plane=replace(FREE, task_s=t))) for t in (0.0, 0.002, 0.05)]
    assert all(r.complete for r in runs)
    tps = [r.tokens_per_s for r in runs]
    assert tps[0] >= tps[1] * 0.98 and tps[1] > tps[2]
    assert runs[2].control_plane["utilisation"] > runs[1].control_plane["utilisation"]
    assert runs[2].control_plane["queued_max_s"] > 0


def test_continue_as_new_stalls_every_replica_and_a_write_out_costs_a_reprefill():
    res = simulate(small(control_plane=replace(FREE, updates_per_segment=20, handover_s=0.5)))
    assert res.complete and res.control_plane["handovers"] >= 2
    assert res.control_plane["segments"] == res.control_plane["handovers"] + 1
    free = simulate(small(control_plane=replace(FREE, updates_per_segment=20)))  # the same hand-overs, free
    assert res.step_times[-1] > free.step_times[-1] + 0.5  # the last step comes later by the stalls
    # kept (as shipped): the groups stay in the engine; written out: every in-flight token is prefilled again
    # (measured on this config: 616 tokens prefilled again by preemption and repack alone, 24,132 with write-outs)
    written = simulate(small(control_plane=replace(FREE, updates_per_segment=20, writes_out=True)))
    assert written.control_plane["handovers"] == free.control_plane["handovers"]
    assert written.reprefill_tokens > 10 * free.reprefill_tokens


def test_costs_scale_to_the_modelled_engine_s_seconds():
    c = ControlPlaneCost(task_s=0.01, rtt_s=0.004, dispatch_s=0.02, updates_per_segment=1500, continue_as_new_s=0.3,
                         handover_s=0.5, writes_out=True)
    s = c.scaled(10.0)
    assert (s.task_s, s.rtt_s, s.dispatch_s, s.continue_as_new_s, s.handover_s) == pytest.approx((0.1, 0.04, 0.2, 3.0, 5.0))
    assert s.updates_per_segment == 1500 and s.writes_out


def test_no_group_is_trained_twice_or_lost_with_reports_in_flight_when_a_replica_dies():
    cfg = small(control_plane=replace(FREE, task_s=0.01, rtt_s=0.005), failures=(("rollout", 2.0),),
                failure_costs={"rollout_detect_s": 0.5, "rollout_restart_s": 0.1})
    sim = Simulator(cfg)
    res = sim.run()
    assert res.complete
    st = sim.ledger.state
    assert st.groups_consumed > 0 and st.groups_consumed_twice == 0 and st.duplicate_reports == 0
    # every prompt issued is trained, ready, leased (in flight, or its report on the way) or to be leased again:
    # none fell between a report and a death
    assert st.prompt_cursor == st.groups_consumed + len(st.ready) + len(st.open_leases) + len(st.returned)
    assert sum(len(r.sent) for r in sim.replicas) <= len(st.open_leases)


def test_the_sweep_s_run_takes_the_control_plane_it_is_given():
    from laminar.sim import params as P
    from laminar.sim.scenarios import CONTROL_PLANE, placements, sim_config

    m, w = P.MODELS["7b"], P.WORKLOADS["math"]
    pl = placements(m, 16, "laminar")[0]
    on, write, off, free_cas = (sim_config(m, w, "laminar", pl, control_plane=c)
                                for c in ("on", "write", "off", "no-handover"))
    assert on.control_plane == CONTROL_PLANE and on.control is not None and not on.control_plane.writes_out
    assert on.control_plane.handover_s == P.CONTROL_KEEP_STALL_S
    assert write.control_plane.writes_out and write.control_plane.handover_s == P.CONTROL_HANDOVER_S
    assert off.control_plane is None and off.control is None
    assert free_cas.control_plane.handover_s == 0 and free_cas.control_plane.task_s == CONTROL_PLANE.task_s
    with pytest.raises(ValueError, match="control_plane='maybe'"):
        sim_config(m, w, "laminar", pl, control_plane="maybe")


def test_simulate_refuses_an_unknown_control_plane():
    from typer.testing import CliRunner

    from laminar.cli.main import app

    bad = CliRunner().invoke(app, ["simulate", "--control-plane", "maybe"])
    assert bad.exit_code == 2 and "maybe" in bad.output and "no-handover" in bad.output


@pytest.mark.slow
def test_the_validation_s_simulator_side_charges_the_control_plane_in_modelled_seconds():
    from laminar.bench.throughput import BenchSpec
    from laminar.cli.sim import simulate_like_bench

    spec = BenchSpec(modes=("laminar",), workloads=("uniform",), replicas=4, engine="modelled", iterations=4,
                     owner="test")
    cfg = spec.run_config("laminar", "uniform", "sim", True)
    off, on = (simulate_like_bench(cfg, 4, c) for c in ("off", "on"))
    assert off["complete"] and on["complete"]
    assert on["tokens_per_s"] != off["tokens_per_s"]  # the workflow's tasks and dispatches, x modelled.speedup
    with pytest.raises(ValueError, match="control_plane='maybe'"):
        simulate_like_bench(cfg, 4, "maybe")
