"""Golden workflow histories (recorded by tests/histories/record.py, replayed by tests/test_replay_golden.py),
and the few ways the two read them. Pure: no server, no worker, no torch."""

from __future__ import annotations

import json
from pathlib import Path

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory

HISTORIES = Path(__file__).parent
MAX_FILE_BYTES = 400_000  # a golden history stays small: a few steps of a tiny run
PATCH_MARKER = "core_patch"  # the marker the SDK records for workflow.patched(id): details["patch-data"] = {"id": ...}


def history_files() -> list[Path]:
    return sorted(HISTORIES.glob("*.json"))


def load(path: Path) -> WorkflowHistory:
    """A recorded history (`temporal workflow show -o json` or fetch_history's JSON), labelled by its file."""
    return WorkflowHistory.from_json(f"golden/{path.stem}", path.read_text())


def event_name(event) -> str:
    return EventType.Name(event.event_type).removeprefix("EVENT_TYPE_")


def workflow_type(history: WorkflowHistory) -> str:
    return history.events[0].workflow_execution_started_event_attributes.workflow_type.name


def patch_ids(history: WorkflowHistory) -> set[str]:
    """The ids of the workflow.patched() markers a history records."""
    ids = set()
    for e in history.events:
        attrs = e.marker_recorded_event_attributes
        if e.HasField("marker_recorded_event_attributes") and attrs.marker_name == PATCH_MARKER:
            ids.add(json.loads(attrs.details["patch-data"].payloads[0].data)["id"])
    return ids


def activity_types(history: WorkflowHistory) -> set[str]:
    return {e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
            if e.HasField("activity_task_scheduled_event_attributes")}


def update_names(history: WorkflowHistory) -> list[str]:
    return [e.workflow_execution_update_accepted_event_attributes.accepted_request.input.name
            for e in history.events if e.HasField("workflow_execution_update_accepted_event_attributes")]


def count(history: WorkflowHistory, name: str) -> int:
    """Events of one type, by its name without the EVENT_TYPE_ prefix."""
    return sum(1 for e in history.events if event_name(e) == name)
