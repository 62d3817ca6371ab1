"""A continue-as-new that replicas do not feel (services/rollout/attach.py, workflows/carry.py): parking, the compact
carried state, the retry delay of a refused update, and the ledger across continue-as-new with replicas kept, in any
interleaving Hypothesis picks (no group lost, none accepted twice)."""

from __future__ import annotations

import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from laminar.client.converter import DATA_CONVERTER
from laminar.config import RunConfig
from laminar.contract import Lease, ReplicaReport
from laminar.refs import SegmentRef
from laminar.services.rollout.attach import Parking
from laminar.services.rollout.timing import TIMING
from laminar.workflows.carry import COMPACT, encode_state
from laminar.workflows.ledger import Ledger
from laminar.workflows.segment import parse_input
from laminar.workflows.state import LastClaim, OpenLease, ReadyGroup, RunState
from tests.helpers import next_batch

CFG = RunConfig.load(None, [])
REPLICAS = ["replica-0", "replica-1", "replica-2"]


def carry(state: RunState, compact: bool = True) -> RunState:
    """The state through a continue-as-new: encoded as the workflow sends it, JSON on the wire, parsed as the next
    segment's __init__ parses its input."""
    conv = DATA_CONVERTER.payload_converter
    sent = {"config": CFG.to_json(), "state": encode_state(state) if compact else state}
    received = conv.from_payloads(conv.to_payloads([sent]), None)[0]
    _, got = parse_input(received)
    assert got is not None
    return got


# -- parking ----------------------------------------------------------------------------------------------------


def test_a_parked_replica_is_adopted_once_by_its_own_id():
    p: Parking[str] = Parking()
    assert p.park("run/a", "replica-0", "r0", at=0.0) is None
    assert p.adopt("run/b", "replica-0") is None and p.adopt("run/a", "replica-1") is None
    assert p.adopt("run/a", "replica-0") == "r0"
    assert p.adopt("run/a", "replica-0") is None  # at most once
    assert len(p) == 0


def test_parking_again_displaces_the_older_and_old_ones_expire():
    p: Parking[str] = Parking()
    p.park("run/a", "replica-0", "old", at=0.0)
    assert p.park("run/a", "replica-0", "new", at=1.0) == "old"  # the caller closes the displaced one
    p.park("run/a", "replica-1", "other", at=5.0)
    assert p.expired(now=100.0, after_s=97.0) == ["new"]
    assert p.expired(now=100.0, after_s=97.0) == []
    assert p.take_all() == ["other"] and len(p) == 0


def test_a_refused_update_is_retried_soon_with_jitter_and_backs_off_to_the_poll():
    t = TIMING
    first = [t.update_retry_s(0, u) for u in (0.0, 0.5, 0.999)]
    assert first == sorted(first) and t.update_retry_base_s / 2 <= first[0] and first[-1] <= t.update_retry_base_s
    assert first[0] < first[-1]  # replicas refused together come back spread out
    bounds = [t.update_retry_s(n, 1.0) for n in range(12)]
    assert bounds == sorted(bounds) and bounds[-1] == t.update_retry_max_s  # an outage still waits 2 s a try
    assert all(t.update_retry_max_s / 2 <= t.update_retry_s(n, 0.0) for n in range(8, 12))
    assert t.update_retry_s(10**6, 0.3) <= t.update_retry_max_s  # no overflow


def test_a_replica_beats_every_quarter_of_its_heartbeat_timeout_and_at_most_every_heartbeat_every_s():
    t = TIMING
    assert t.beat_every_s(3.0) == pytest.approx(0.75)  # the default: the worker still lets one a second through
    assert t.beat_every_s(10.0) == pytest.approx(2.5)  # a run at scale trades detection for server CPU
    assert t.beat_every_s(0.3) == t.heartbeat_every_s  # never faster than the loop's own bound
    assert t.beat_every_s(300.0) == t.heartbeat_max_s  # nor slower than a cancellation may wait (a 5-minute timeout)
    for timeout in (1.0, 3.0, 10.0, 30.0, 600.0):
        assert 3 * t.beat_every_s(timeout) < timeout  # three beats may be late or lost before the server times it out


# -- the carried state ------------------------------------------------------------------------------------------


def _rich_state() -> RunState:
    ref = SegmentRef(key="k/1", sha256="ab", size=3, rows=4, group_ids=["g00000007"], policy_version=2, tokens=9)
    s = RunState(run_id="r", step=3, prompt_cursor=12, relay_ids=["host-0"], policy_version=3)
    s.open_leases = {f"g{i:08d}": OpenLease(f"g{i:08d}", i, REPLICAS[i % 3]) for i in range(8)}
    s.open_leases["odd-9"] = OpenLease("odd-9", 9, "replica-2", resume=ref, resume_version=2, returned_at=4.5)
    s.returned = [OpenLease("g00000010", 10, "replica-9", resume=ref, resume_version=1, returned_at=1.25),
                  OpenLease("g00000011", 11, "replica-0")]
    s.last_claims = {"replica-0": LastClaim("p-c3", [Lease("g00000000", 0), Lease("odd-9", 9, ref, 2)]),
                     "replica-1": LastClaim("p-c1", [])}
    s.ready = [ReadyGroup("g00000005", "k/1", 2, 5)]
    s.segments = {"k/1": ref}
    s.replicas = {"replica-0": ReplicaReport("replica-0", "h", 3, in_flight=4)}
    s.eval = {"rounds": {"3": {"x": 1}}}
    return s


@pytest.mark.parametrize("compact", [True, False])
def test_the_state_carries_over_unchanged(compact: bool):
    s = _rich_state()
    assert carry(s, compact=compact) == s


def test_compact_leases_are_columns_and_small():
    s = RunState(run_id="r", prompt_cursor=5000)
    s.open_leases = {f"g{i:08d}": OpenLease(f"g{i:08d}", i, f"replica-{i % 80}") for i in range(5000)}
    conv = DATA_CONVERTER.payload_converter
    old = len(conv.to_payloads([{"state": s}])[0].data)
    new = len(conv.to_payloads([{"state": encode_state(s)}])[0].data)
    assert COMPACT in encode_state(s) and new * 5 < old, (new, old)
    t0 = time.process_time()
    assert carry(s) == s
    assert time.process_time() - t0 < 1.0  # ~0.05 s here; value_to_type took 0.2-0.3 s for half these leases


# -- the ledger across continue-as-new with replicas kept ------------------------------------------------------


class KeepMachine(RuleBasedStateMachine):
    """Replicas lease and report; a continue-as-new carries the state (through the real encoding and parse) while
    every replica parks with what it holds; the next segment's activity adopts a parked replica in its process
    (a first claim resuming everything it holds) or lands elsewhere (a fresh start resuming what its partial pool
    had, the parked one closed unheard); replicas crash and restart; the trainer consumes. The model: each replica's
    live incarnation holds `mem[r]` (in flight or complete and not yet reported); a parked one is `parked`.
    After every rule: every group ever leased is in exactly one place, none is accepted twice, and every open lease
    is held in memory by its replica's live incarnation (else it would be lost: leased and never generated)."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger(RunState(run_id="keep"))
        self.mem: dict[str, set[str]] = {r: set() for r in REPLICAS}
        self.pool: dict[str, set[str]] = {r: set() for r in REPLICAS}  # its last partial-pool write
        self.parked: set[str] = set()
        self.leased: set[str] = set()
        self.generated: list[str] = []
        self.consumed: list[str] = []
        self.seq = 0

    def attached(self) -> list[str]:
        return [r for r in REPLICAS if r not in self.parked]

    @precondition(lambda self: self.attached())
    @rule(data=st.data(), n=st.integers(0, 3))
    def lease(self, data: st.DataObject, n: int) -> None:
        r = data.draw(st.sampled_from(self.attached()))
        for x in self.ledger.lease(r, n):  # returned ones (a crash, a fresh start elsewhere) go out again first
            assert x.group_id not in self.generated and all(x.group_id not in m for m in self.mem.values())
            self.leased.add(x.group_id)
            self.mem[r].add(x.group_id)

    @precondition(lambda self: any(self.mem[r] for r in self.attached()))
    @rule(data=st.data())
    def report(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from([r for r in self.attached() if self.mem[r]]))
        groups = data.draw(st.lists(st.sampled_from(sorted(self.mem[r])), min_size=1, unique=True))
        self.seq += 1
        seg = SegmentRef(key=f"s/{self.seq}", sha256="x", size=1, rows=1, group_ids=groups)
        accepted, duplicates = self.ledger.add_segment(seg, r)
        assert sorted(accepted) == sorted(groups) and not duplicates  # what a live incarnation holds is its own
        self.generated += accepted
        self.mem[r] -= set(groups)

    @precondition(lambda self: self.attached())
    @rule(data=st.data())
    def flush_pool(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from(self.attached()))
        self.pool[r] = set(self.mem[r])

    @precondition(lambda self: self.attached())
    @rule(data=st.data())
    def crash_and_restart(self, data: st.DataObject) -> None:
        """A retried activity: resumes its last pool (groups reported since are refused by held_by)."""
        r = data.draw(st.sampled_from(self.attached()))
        ok = self.ledger.first_claim(r, sorted(self.pool[r]))
        assert set(ok) <= self.pool[r] & self.mem[r]
        self.mem[r] = set(ok)

    @precondition(lambda self: not self.parked)
    @rule()
    def continue_as_new(self) -> None:
        """Every replica parks with what it holds; the state goes over the wire."""
        before = self.ledger.state
        self.ledger = Ledger(carry(before))
        assert self.ledger.state == before
        self.parked = set(REPLICAS)

    @precondition(lambda self: self.parked)
    @rule(data=st.data())
    def reattach_here(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from(sorted(self.parked)))
        held = sorted(self.mem[r])
        ok = self.ledger.first_claim(r, held)
        assert ok == held, "a parked replica lost a lease it held across the continue-as-new"
        self.parked.discard(r)

    @precondition(lambda self: self.parked)
    @rule(data=st.data())
    def started_elsewhere(self, data: st.DataObject) -> None:
        """The next activity landed in another process: the parked incarnation is closed without a word, the new one
        resumes what its pool holds, and the rest goes back to be leased again."""
        r = data.draw(st.sampled_from(sorted(self.parked)))
        ok = self.ledger.first_claim(r, sorted(self.pool[r]))
        self.mem[r] = set(ok)
        self.parked.discard(r)

    @precondition(lambda self: self.ledger.state.ready)
    @rule(n=st.integers(1, 4))
    def train_step(self, n: int) -> None:
        from tests.test_ledger import _input, _result

        ids = [g.group_id for g in self.ledger.state.ready[:n]]
        inp = _input(self.ledger, next_batch(self.ledger, n))
        self.ledger.commit_step(inp, _result(self.ledger.state.step + 1), keep_last=2)
        self.consumed += ids

    @invariant()
    def nothing_lost_nothing_twice(self) -> None:
        s = self.ledger.state
        ready, returned = [g.group_id for g in s.ready], [x.group_id for x in s.returned]
        everywhere = self.consumed + ready + list(s.open_leases) + returned
        assert len(self.generated) == len(set(self.generated)), "a group was accepted twice"
        assert len(everywhere) == len(set(everywhere)), "a group is in two places"
        assert set(everywhere) == self.leased, "a leased group was lost"
        assert s.prompt_cursor == s.groups_generated + s.groups_failed + len(s.open_leases) + len(s.returned)
        for g, lease in s.open_leases.items():
            assert g in self.mem[lease.replica_id], f"{g} is leased to {lease.replica_id}, which no longer holds it"


TestKeepInterleavings = KeepMachine.TestCase
TestKeepInterleavings.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
