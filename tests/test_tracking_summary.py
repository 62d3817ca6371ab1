"""The summary lists the steps a tracker never wrote (reporting/summary.py tracker_missing), from the last step
record's `tracker_stats`, and the writer lists dropped steps as ranges (services/tracking_writer.py)."""

from __future__ import annotations

from laminar.reporting.summary import tracker_missing
from laminar.services.tracking_writer import step_ranges


def test_missing_steps_are_ranges_from_the_last_record():
    assert step_ranges([7, 1, 2, 3, 3, 9, 10]) == "1-3,7,9-10"
    records = [{"step": 1}, {"step": 2, "tracker_stats": {"mlflow": {"missing_steps": "66-70"},
                                                          "tensorboard": {"missing_steps": ""}}}]
    assert tracker_missing(records) == {"mlflow": "66-70"}
    assert tracker_missing([{"step": 1}]) == {} and tracker_missing([]) == {}
