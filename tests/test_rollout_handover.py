"""A rollout replica acts on a hand-over at its next contact, even with no free slot and no complete group:
its in-flight groups go to its (fenced) partial pool and it returns, so continue-as-new never waits for
the long tail. The replica runs its real loop and a real torch engine; the control plane is the replica's
`ControlPort` seam, answered here the way the workflow answers once a hand-over is pending."""

from __future__ import annotations

from dataclasses import replace

from laminar.config import RunConfig
from laminar.contract import (
    AddExperienceInput,
    AddExperienceResult,
    ClaimPromptsInput,
    ClaimPromptsResult,
    Lease,
)
from laminar.records import Trajectory
from laminar.rl.model import model_state_dict
from laminar.services.model_files import publish_model_files, resolve_model_dir
from laminar.services.rollout import CONTACT_S, RolloutReplica
from laminar.storage import keys
from laminar.storage.objects import open_store
from laminar.storage.trajectories import TrajectoryStore

RUN = "handover-unit"
GROUPS = 2  # = rollout.max_inflight_groups: once admitted, the replica has no free slot (it never claims work)
GROUP_SIZE = 8


class HandoverPending:
    """Leases GROUPS groups on the first work claim; from then on every answer says `handover`."""

    def __init__(self) -> None:
        self.leased = False
        self.contacts_after_handover = 0

    def claim(self, inp: ClaimPromptsInput) -> ClaimPromptsResult:
        if inp.first_claim:
            return ClaimPromptsResult(leases=[], newest_policy_version=0, relays=[])
        if not self.leased:
            self.leased = True
            return ClaimPromptsResult(leases=[Lease(f"g{i:08d}", i) for i in range(GROUPS)], newest_policy_version=0,
                                      relays=[])
        self.contacts_after_handover += 1
        return ClaimPromptsResult(leases=[], newest_policy_version=0, relays=[], handover=True)

    def add_experience(self, inp: AddExperienceInput) -> AddExperienceResult:
        self.contacts_after_handover += 1
        return AddExperienceResult(accepted=list(inp.segment.group_ids), duplicates=[], handover=True)

    def heartbeat(self, details: dict) -> None:
        pass

    def cancelled(self) -> bool:
        return False


class Ticks:
    """A clock that advances 50 ms per reading: the loop's intervals count loop turns, not wall time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 0.05
        return self.now


CFG = RunConfig.load(None, ["model.pretrain_steps=0", f"rollout.group_size={GROUP_SIZE}",
                            f"rollout.max_inflight_groups={GROUPS}", "rollout.max_new_tokens=2000",
                            "rollout.flush_interval_s=600"]).with_run_id(RUN)


def _store_with_model(tmp_path):
    store = open_store((tmp_path / "store").as_uri())
    publish_model_files(store, RUN, resolve_model_dir(CFG, tmp_path))
    return store


def _replica(store, control, clock, attempt: int) -> RolloutReplica:
    """Incarnation (history segment 3, `attempt`) of replica-0, holding version 0 as a relay would serve it."""
    replica = RolloutReplica(run_id=RUN, replica_id="replica-0", host_id="host-0", segment_prefix=f"seg-a{attempt}",
                             cfg=CFG, store=store, control=control, attempt=attempt, generation=3, clock=clock)
    replica.engine.load_weights(model_state_dict(replica.engine.model), 0)
    return replica


def test_hand_over_returns_at_the_next_contact_with_every_group_still_in_flight(tmp_path):
    # An untrained model (no warm-up) rarely samples <eos>: with 2000 new tokens allowed, no group of 8 can
    # complete in the few dozen engine steps before the replica's next contact (CONTACT_S = 1 s = 20 ticks).
    # Before the fix the replica, full and with nothing complete, contacted nobody until a group completed,
    # and then ignored `handover` in the report's answer: it returned hundreds of steps later, with at most
    # one group still in flight.
    store = _store_with_model(tmp_path)
    control, clock = HandoverPending(), Ticks()
    result = _replica(store, control, clock, attempt=1).run()

    assert result.handed_over == GROUPS and result.groups_completed == 0
    assert control.contacts_after_handover == 1  # it returned at the first contact that said so
    assert clock.now - 1000.0 < 4 * CONTACT_S  # within a few contacts' worth of loop turns
    pool = TrajectoryStore(store).read_partial(RUN, "replica-0")
    assert len(pool) == GROUPS * GROUP_SIZE  # every sample, finished or a prefix, is in the pool
    assert {t.finish_reason for t in pool} >= {"partial"}
    # under this incarnation's fence: history segment 3, attempt 1
    assert keys.partial_manifest(RUN, "replica-0", (3, 1)) in store.list(keys.partial_prefix(RUN, "replica-0"))


class HandoverAtStart(HandoverPending):
    """Every answer, the first claim included, says `handover`: the incarnation started while the run hands over."""

    def claim(self, inp: ClaimPromptsInput) -> ClaimPromptsResult:
        self.contacts_after_handover += 1
        return ClaimPromptsResult(leases=[], newest_policy_version=0, relays=[], handover=True)


def test_an_incarnation_started_during_a_hand_over_keeps_the_previous_pool(tmp_path):
    # Attempt 1 left 3 prefixes of g00000000 in its pool (fence (3, 1)). Attempt 2 starts while the run hands
    # over: it writes those rows under its own fence (3, 2) and returns. Before the fix its hand-over then wrote
    # its own (empty) batch under the same fence, so the next incarnation found an empty pool and generated the
    # group again from scratch.
    store = _store_with_model(tmp_path)
    rows = [Trajectory(run_id=RUN, prompt_id=0, group_id="g00000000", sample_index=i, prompt_ids=[1, 2],
                       response_ids=[3] * (i + 1), logprobs=[-0.5] * (i + 1), reward=0.0, policy_version=0,
                       replica_id="replica-0", started_at=1.0, ended_at=2.0, finish_reason="partial")
            for i in range(3)]
    TrajectoryStore(store).write_partial(RUN, "replica-0", (3, 1), rows)

    result = _replica(store, HandoverAtStart(), Ticks(), attempt=2).run()

    assert result.handed_over == 0 and result.groups_completed == 0
    kept = TrajectoryStore(store).read_partial(RUN, "replica-0")
    assert sorted((t.sample_index, len(t.response_ids)) for t in kept) == [(0, 1), (1, 2), (2, 3)]
    assert keys.partial_manifest(RUN, "replica-0", (3, 2)) in store.list(keys.partial_prefix(RUN, "replica-0"))


def test_a_corrupt_partial_pool_is_dropped_not_retried_forever(tmp_path):
    # The previous incarnation's pool fails its sha256 check: the new incarnation starts with nothing to
    # resume (its leases go back to the pool at the first claim and are generated again) instead of raising
    # the same CorruptDataError on every retry of the activity.
    store = _store_with_model(tmp_path)
    row = Trajectory(run_id=RUN, prompt_id=0, group_id="g00000000", sample_index=0, prompt_ids=[1, 2],
                     response_ids=[3], logprobs=[-0.5], reward=0.0, policy_version=0, replica_id="replica-0",
                     started_at=1.0, ended_at=2.0, finish_reason="partial")
    TrajectoryStore(store).write_partial(RUN, "replica-0", (3, 1), [row])
    pool_key = keys.partial_pool(RUN, "replica-0", (3, 1))
    data = bytearray(store.get(pool_key))
    data[len(data) // 2] ^= 0x01
    store.put(pool_key, bytes(data))

    result = _replica(store, HandoverPending(), Ticks(), attempt=2).run()  # raised CorruptDataError before the fix

    assert result.handed_over == GROUPS  # it went on to generate fresh groups
    # its own pool (attempt 2, in its two slots) replaced the corrupt one (attempt 1), which the sweep removed
    assert {keys.parse_partial_fence(RUN, "replica-0", k) for k in store.list(keys.partial_prefix(RUN, "replica-0"))} \
        == {(3, 2)}
    assert keys.partial_manifest(RUN, "replica-0", (3, 2)) in store.list(keys.partial_prefix(RUN, "replica-0"))


def test_an_empty_local_relay_falls_through_to_another_relay(tmp_path):
    # This host's relay restarted empty (a master-relay drill) while the other host's relay holds version 0.
    # The replica used to enter `with pull_local(...)` on the None it returns for "no version here" and die
    # with a TypeError on every retry; now it fetches the version over TCP from the other relay.
    from laminar.contract import RelayInfo
    from laminar.relay import client as relay_client
    from laminar.relay.server import RelayServer
    from laminar.rl.model import state_dict_to_bytes

    store = _store_with_model(tmp_path)
    (tmp_path / "shm").mkdir()
    local, remote = RelayServer("host-0", shm_dir=str(tmp_path / "shm")), RelayServer("host-1",
                                                                                     shm_dir=str(tmp_path / "shm"))
    local_addr, remote_addr = local.start(), remote.start()
    try:
        replica = RolloutReplica(run_id=RUN, replica_id="replica-0", host_id="host-0", segment_prefix="seg-a1",
                                 cfg=CFG, store=store, control=HandoverPending(), clock=Ticks())
        payload = state_dict_to_bytes(model_state_dict(replica.engine.model))
        relay_client.push(remote_addr, 0, payload, [], run=RUN)
        weights = replica.weights
        weights.relays = [RelayInfo("host-0", "host-0", local_addr), RelayInfo("host-1", "host-1", remote_addr)]
        weights.poll()  # own host's relay first: it holds nothing, the other one version 0
        assert weights.newest_at_relay == 0
        weights.load_newest()
        assert replica.engine.policy_version == 0
    finally:
        local.stop()
        remote.stop()


class HandoverKeep(HandoverPending):
    """As HandoverPending, but the hand-over says `keep`: the replica parks with its groups (run.handover_keep)."""

    def claim(self, inp: ClaimPromptsInput) -> ClaimPromptsResult:
        res = super().claim(inp)
        return replace(res, keep=res.handover)

    def add_experience(self, inp: AddExperienceInput) -> AddExperienceResult:
        return replace(super().add_experience(inp), keep=True)


class NextSegment:
    """The next segment's workflow: the first claim keeps every lease it resumes; then, after a few contacts, stop."""

    def __init__(self, contacts: int = 3) -> None:
        self.resuming: list[str] | None = None
        self.contacts, self.left = 0, contacts

    def claim(self, inp: ClaimPromptsInput) -> ClaimPromptsResult:
        if inp.first_claim:
            self.resuming = list(inp.resuming)
            return ClaimPromptsResult(leases=[], newest_policy_version=0, relays=[], resume_ok=list(inp.resuming))
        self.contacts += 1
        return ClaimPromptsResult(leases=[], newest_policy_version=0, relays=[], stop=self.contacts >= self.left)

    def add_experience(self, inp: AddExperienceInput) -> AddExperienceResult:
        self.contacts += 1
        return AddExperienceResult(accepted=list(inp.segment.group_ids), duplicates=[],
                                   stop=self.contacts >= self.left)

    def heartbeat(self, details: dict) -> None:
        pass

    def cancelled(self) -> bool:
        return False


def test_a_kept_replica_parks_without_writing_and_its_next_segment_resumes_every_group(tmp_path):
    # run.handover_keep: told `handover` with `keep`, the replica returns at that contact as before, but writes no
    # partial pool and keeps its engine; adopted by the next segment's activity, its first claim resumes every group
    # it holds, and its engine carries on with the same sequences (longer prefixes at the stop than at the park).
    store = _store_with_model(tmp_path)
    control, clock = HandoverKeep(), Ticks()
    replica = _replica(store, control, clock, attempt=1)
    result = replica.run()

    assert replica.parked and result.kept == GROUPS and result.handed_over == 0
    assert control.contacts_after_handover == 1
    assert TrajectoryStore(store).read_partial(RUN, "replica-0") == []  # nothing written out (only the empty fence)
    at_park = {rid: len(response) for rid, _, response, _ in replica.engine.snapshot_inflight()}
    assert at_park  # sequences still generating when it parked

    nxt = NextSegment()
    replica.reattach(nxt, attempt=1, generation=4)
    result = replica.run(reattach=True)

    assert nxt.resuming == [f"g{i:08d}" for i in range(GROUPS)]
    assert not replica.parked and result.handed_over == GROUPS
    pool = TrajectoryStore(store).read_partial(RUN, "replica-0")  # the stop wrote them, under the new fence
    assert len(pool) == GROUP_SIZE * GROUPS
    assert keys.partial_manifest(RUN, "replica-0", (4, 1)) in store.list(keys.partial_prefix(RUN, "replica-0"))
    at_stop = {f"{t.group_id}/{t.sample_index}": len(t.response_ids) for t in pool}
    assert all(at_stop[rid] >= n for rid, n in at_park.items())  # the same sequences, carried on
    assert sum(at_stop[rid] for rid in at_park) > sum(at_park.values())
