"""Run events and regenerated tokens in the ledger: what drills and summaries rely on."""

from __future__ import annotations

from laminar.refs import SegmentRef
from laminar.workflows.ledger import Ledger
from laminar.workflows.state import RunState


def test_a_burst_of_routine_events_never_pushes_out_a_fault():
    ledger = Ledger(RunState(run_id="r"))
    ledger.note_event("relay_lost", "host-1", 100.0)
    for i in range(200):  # e.g. relays re-joining at every continue-as-new, far more than the recent window
        ledger.note_event("relay_joined", f"host-{i % 2}", 101.0 + i)
    st = ledger.status(phase="running", total_steps=10, history_events=0)
    assert st.event_times["relay_lost/host-1"] == [100.0]
    assert len(st.events) == 50  # the display window stays bounded
    assert st.event_times["relay_joined/host-0"][-1] == 299.0  # 101 + 198
    assert len(st.event_times["relay_joined/host-0"]) == 8  # bounded per (kind, subject)


def test_a_retried_report_does_not_count_regenerated_tokens_twice():
    ledger = Ledger(RunState(run_id="r"))
    (lease,) = ledger.lease("replica-0", 1)
    seg = SegmentRef(key="runs/r/experience/replica-0/s1.parquet", sha256="0" * 64, size=1, rows=8,
                     group_ids=[lease.group_id], policy_version=0, tokens=40)
    assert ledger.add_segment(seg, "replica-0", 1.0, tokens_regenerated=12) == ([lease.group_id], [])
    # the same report again (its response was lost and the replica retried it): a no-op
    assert ledger.add_segment(seg, "replica-0", 2.0, tokens_regenerated=12) == ([], [lease.group_id])
    st = ledger.status(phase="running", total_steps=10, history_events=0)
    assert st.tokens_regenerated == 12 and st.duplicate_reports == 1
