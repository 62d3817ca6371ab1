"""workflows/status.py: what a run shows, on real parts (Ledger, RelayChain, Trainer, ReplicaSet, SlotGrants) with a
fake runtime: its phase, the status query's counts, search attributes (at once on a phase change, else at most every
SEARCH_ATTRIBUTES_EVERY_S, only when started with them and behind the patch), and the stall watchdog's events."""

from __future__ import annotations

import asyncio

import pytest

from laminar.config import RunConfig
from laminar.contract import RelayInfo, ReplicaGrant, ScaleResult
from laminar.policy import policy_for
from laminar.workflows.grants import SlotGrants
from laminar.workflows.ledger import Ledger
from laminar.workflows.migrations import Migrations
from laminar.workflows.relay_chain import RelayChain
from laminar.workflows.replica_set import ReplicaSet
from laminar.workflows.segment import Segment
from laminar.workflows.state import RunState
from laminar.workflows.status import SEARCH_ATTRIBUTES_EVERY_S, StatusBoard
from laminar.workflows.trainer import Trainer
from tests.fixtures.fake_runtime import FakeRuntime


class Run:
    def __init__(self, pool: str = "", has_search_attributes: bool = True, patched: bool = True) -> None:
        self.cfg = RunConfig.load(None, ["run.steps=10", "rollout.replicas=2", "relay.relays=2", "run.stall_warn_s=10"])
        self.state = RunState(run_id="run-s", pool=pool)
        self.rt, self.seg = FakeRuntime(), Segment()
        self.ledger = Ledger(self.state)
        self.relays = RelayChain(self.state, self.ledger, self.cfg, self.rt, run_relay=None,  # type: ignore[arg-type]
                                 closing=lambda: self.seg.closing)
        self.trainer = Trainer(self.state, self.ledger, self.cfg, policy_for(self.cfg), self.rt, self.relays,
                               train_steps_patched=lambda: True, committed=lambda: None, stepped=lambda: None)
        self.replicas = ReplicaSet(self.state, self.ledger, Migrations(self.ledger), self.cfg, self.rt,
                                   start=lambda r: asyncio.get_running_loop().create_future(), may_start=lambda: True)
        self.grants = SlotGrants(self.state, self.cfg, self.rt, "run/run-s", signal=None,  # type: ignore[arg-type]
                                 scale_to=self.replicas.scale_to, may_apply=lambda: True, closing=lambda: False)
        self.upserts: list[dict[str, object]] = []
        self.patch_asked = 0

        def search_patched() -> bool:
            self.patch_asked += 1
            return patched

        self.board = StatusBoard(
            self.state, self.ledger, self.cfg, self.rt, self.seg, self.trainer, self.replicas, self.relays,
            self.grants, history_length=lambda: 42, has_search_attributes=lambda: has_search_attributes,
            search_patched=search_patched,
            upsert=lambda updates: self.upserts.append({u.key.name: u.value for u in updates}))


@pytest.mark.parametrize(
    ("case", "change", "phase"),
    [
        ("before the trainer is up", {}, "starting"),
        ("trainer up", {"trainer_ready": True}, "running"),
        ("paused", {"trainer_ready": True, "paused": True}, "paused"),
        ("stopping", {"trainer_ready": True, "paused": True, "stopping": True}, "stopping"),
        ("every step taken", {"trainer_ready": True, "step": 10}, "stopping"),
    ],
)
def test_the_phase(case, change, phase):
    run = Run()
    for k, v in change.items():
        setattr(run.state, k, v)
    assert run.board.phase() == phase, case


def test_failed_and_finished_come_from_the_segment():
    run = Run()
    run.seg.finished = True
    assert run.board.phase() == "finished"
    run.seg.error = "bad config"
    assert run.board.phase() == "failed"


async def test_the_status_counts_what_the_parts_run():
    run = Run()
    run.relays.joined_signal(RelayInfo(relay_id="host-0", host_id="host-0", address="10.0.0.1:7000"))
    run.replicas.start_all()
    run.replicas.tasks["replica-1"].set_result(None)
    st = run.board.status()
    assert (st.phase, st.total_steps, st.history_events) == ("starting", 10, 42)
    assert (st.replicas_target, st.replicas_running, st.relays_target) == (2, 1, 2)
    assert st.stall_warn_s == 10 and not st.training


async def test_a_pooled_run_shows_its_ask_and_grant():
    run = Run(pool="pool/p")
    run.grants.granted(ReplicaGrant(granted=1, note="1 of 2: shared"))
    assert isinstance(run.grants.scale_ask(3), ScaleResult)
    st = run.board.status()
    assert st.replicas_target == 3 and st.replicas_running == 1
    assert (st.replicas_granted, st.grant_note) == (1, "1 of 2: shared")


def test_search_attributes_on_a_phase_change_at_once_else_at_most_every_few_seconds():
    run = Run()
    run.state.reward_recent = [0.25]
    run.board.upsert_search_attributes()
    assert run.upserts == [{"LaminarPhase": "starting", "LaminarStep": 0, "LaminarPolicyVersion": 0,
                            "LaminarReward": 0.25}]
    run.state.trainer_ready, run.state.step = True, 1
    run.rt.t = 1.0
    run.board.upsert_search_attributes()  # a phase change: at once
    run.state.step = 2
    run.rt.t = 2.0
    run.board.upsert_search_attributes()  # the same phase within the interval: not yet
    assert [u["LaminarPhase"] for u in run.upserts] == ["starting", "running"]
    run.rt.t = 1.0 + SEARCH_ATTRIBUTES_EVERY_S
    run.board.upsert_search_attributes()
    assert run.upserts[-1]["LaminarStep"] == 2 and len(run.upserts) == 3


@pytest.mark.parametrize(("has", "patched", "asked"), [(False, True, 0), (True, False, 1)])
def test_no_search_attributes_without_them_or_the_patch(has, patched, asked):
    run = Run(has_search_attributes=has, patched=patched)
    run.board.upsert_search_attributes()
    assert run.upserts == [] and run.patch_asked == asked  # the patch is asked only when an upsert would follow


def test_the_watchdog_notes_a_stall_once_and_clears_it():
    run = Run()
    run.rt.t = 11.0  # no relay joined for longer than run.stall_warn_s
    run.board.watch()
    run.board.watch()
    assert run.state.stall == "weights"
    assert [(e.kind, e.subject) for e in run.state.events] == [("stall", "weights")]
    run.relays.joined_signal(RelayInfo(relay_id="host-0", host_id="host-0", address="10.0.0.1:7000"))
    run.board.watch()  # the trainer is not up yet: now it waits for the trainer
    assert run.state.stall == "trainer" and run.state.events[-1].subject == "trainer"
    run.state.trainer_ready, run.state.trainer_ready_at = True, 11.0
    run.board.watch()
    assert run.state.stall == ""


async def test_the_watchdog_ticks_every_half_stall_warn_until_the_segment_closes():
    run = Run()
    ticks = 0

    def watch() -> None:
        nonlocal ticks
        ticks += 1
        if ticks == 3:
            run.seg.closing = True

    run.board.watch = watch  # type: ignore[method-assign]
    await asyncio.wait_for(run.board.watchdog(), 5)
    assert run.rt.sleeps == [5.0, 5.0, 5.0] and ticks == 3
