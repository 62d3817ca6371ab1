"""A starved replica claims again as soon as a newer version reaches its relay (services/rollout/control.py
Contacts.woken), in the replica loop's scheduler and in the simulator's twin of it (sim/core.py _see)."""

from __future__ import annotations

from dataclasses import replace

from laminar.services.rollout.control import Contacts
from laminar.services.rollout.timing import TIMING
from laminar.sim.core import ControlTiming, Simulator
from tests.test_sim import small


def _due(c: Contacts, now: float, relay: int | None, want: int = 4) -> bool:
    return c.claim_due(now, want, groups=0, completed=0, waiting=False, holding=False, urgent=False,
                       relay_version=relay)


def test_an_empty_claim_waits_for_its_back_off_or_for_a_newer_version_at_the_relay():
    c = Contacts(TIMING, max_inflight_groups=4)
    for _ in range(6):  # claims come back empty at version 3: the back-off grows to its bound
        c.asked = 4
        c.claimed(0, paused=False, run_version=3)
    assert c.claim_every == TIMING.idle_claim_max_s and c.awaited_version() == 4
    c.last_claim = 100.0
    assert not _due(c, 100.5, relay=3)  # the back-off holds while the relay has nothing newer
    assert _due(c, 100.5, relay=4)  # version 4 at the relay: the trainer stepped, prompts may be free
    assert not _due(c, 100.5, relay=4, want=0)  # ... but only with a free slot to fill
    c.claiming(4)
    assert c.woke_for == 4 and c.claim_every == 0.0
    # the workflow had not committed the step yet: empty again at 3; the relay's 4 does not wake it twice, the
    # back-off starts over from claim_poll_s
    c.asked = 4
    c.claimed(0, paused=False, run_version=3)
    assert c.claim_every == TIMING.claim_poll_s and c.awaited_version() == 5
    c.last_claim = 101.0
    assert not _due(c, 101.0 + TIMING.claim_poll_s / 2, relay=4)
    assert _due(c, 101.0 + TIMING.claim_poll_s * 1.01, relay=4)
    c.asked = 4
    c.claimed(2, paused=False, run_version=4)  # leases: nothing to wake for
    assert c.awaited_version() is None and not c.woken(9)


def test_a_paused_run_or_a_claim_for_nothing_does_not_arm_the_wake():
    c = Contacts(TIMING, max_inflight_groups=4)
    c.asked = 4
    c.claimed(0, paused=True, run_version=3)
    assert c.awaited_version() is None and not c.woken(4)
    c.asked = 4
    c.claimed(0, paused=False, run_version=3)
    c.asked = 0  # a contact that asked for nothing keeps what the last claim armed
    c.claimed(0, paused=False, run_version=3)
    assert c.awaited_version() == 4


class _Starts(Simulator):
    """The simulator, recording when each replica starts groups of each version and when steps commit."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.starts: dict[int, list[float]] = {}
        self.commits: list[float] = []

    def _admit(self, r):
        before = len(r.pending)
        super()._admit(r)
        if len(r.pending) < before:
            self.starts.setdefault(r.version, []).append(self.now)

    def _on_step_done(self, data):
        self.commits.append(self.now)
        super()._on_step_done(data)


def test_the_simulator_s_starved_replicas_start_the_next_batch_when_its_version_reaches_them():
    # sync: every replica idles at the barrier with its claims backed off to 20 s, far longer than the trainer's
    # step; each starts the next batch once the new version is at its relay (load and poll, well under 1 s)
    slow = ControlTiming(version_poll_s=5.0, version_wait_poll_s=0.02, claim_poll_s=1.0, idle_claim_max_s=20.0,
                         claim_min_groups=1, report_min_groups=1, report_max_wait_s=0.0, contact_s=1.0)
    sim = _Starts(replace(small("sync"), control=slow))
    res = sim.run()
    assert res.complete
    for version in range(1, len(sim.commits)):
        first = min(sim.starts[version]) - sim.commits[version - 1]
        assert 0 <= first < 1.0, (version, first)
