"""Replay a recorded TrainingRunWorkflow history against the current code (no server needed).

tests/histories/training_run_golden_v1.json was recorded from a real 4-step run with
`temporal workflow show -w run/golden-v1 -o json`. A workflow change that breaks determinism for
running workflows fails here; such a change needs `workflow.patched()` (or a new recording, when the
change is deliberately incompatible and no old run can still be live).
"""

from __future__ import annotations

from pathlib import Path

from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from laminar.converter import DATA_CONVERTER
from workflows.training_run import TrainingRunWorkflow

HISTORIES = Path(__file__).parent / "histories"


async def test_golden_histories_replay():
    files = sorted(HISTORIES.glob("training_run_*.json"))
    assert files, f"no recorded histories under {HISTORIES}"
    replayer = Replayer(workflows=[TrainingRunWorkflow], data_converter=DATA_CONVERTER)
    for f in files:
        history = WorkflowHistory.from_json(f"run/{f.stem}", f.read_text())
        assert len(history.events) > 20, f"{f.name} is too short to exercise the workflow"
        await replayer.replay_workflow(history)
