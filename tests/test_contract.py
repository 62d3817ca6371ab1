"""laminar/contract.py, the one module a caller needs to start, signal and query workflows: it stays import-light
(workflows import it through the sandbox pass-through; `client/` imports no `workflows/`), and the start input
that no longer names the workflow's state type still carries that state exactly as before."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

from pydantic import TypeAdapter
from temporalio.converter import value_to_type

from laminar.client.converter import DATA_CONVERTER
from laminar.contract import PoolAsk, PoolInput, PoolState, ReplicaGrant, SlotReport, TrainingRunInput
from laminar.workflows.state import RunState

ROOT = Path(__file__).resolve().parents[1]


def _recorded_continue_as_new_input() -> dict:
    """The input of a recorded continue-as-new (a full RunState of a run mid-way)."""
    history = json.loads((ROOT / "tests/histories/training_run_continue_as_new_1.json").read_text())
    for e in history["events"]:
        a = e.get("workflowExecutionContinuedAsNewEventAttributes")
        if a:
            return json.loads(base64.b64decode(a["input"]["payloads"][0]["data"]))
    raise AssertionError("no continue-as-new in the recorded history")


def _encode(value) -> dict:
    return json.loads(DATA_CONVERTER.payload_converter.to_payloads([value])[0].data)


def test_the_contract_imports_nothing_but_the_standard_library_and_laminar():
    code = ("import sys, laminar.contract; print(sorted({m.split('.')[0] for m in sys.modules if not "
            "m.startswith('_')} - set(sys.stdlib_module_names)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "['laminar']", out.stdout


def test_a_continued_run_s_state_is_encoded_as_its_full_runstate_json():
    """TrainingRunInput.state is `Any` in the contract (callers need not know RunState): continue-as-new still
    writes RunState's full JSON, the same as a field typed RunState writes, and the workflow decodes it back."""
    recorded = _recorded_continue_as_new_input()
    state = value_to_type(RunState, recorded["state"])
    sent = _encode(TrainingRunInput(config=recorded["config"], state=state))
    assert sent["state"] == json.loads(TypeAdapter(RunState).dump_json(state))
    assert value_to_type(RunState, sent["state"]) == state
    assert sent["config"] == recorded["config"] and sent["pool"] == ""


def test_a_new_run_s_input_is_config_no_state_and_its_pool():
    assert _encode(TrainingRunInput(config={"run": {"steps": 3}}, pool="pool/laminar-rollout")) == {
        "config": {"run": {"steps": 3}}, "state": None, "pool": "pool/laminar-rollout"}


def test_the_slot_pool_s_state_round_trips_typed():
    state = PoolState(reports={"w": SlotReport(reporter="w", slots=4, engines=["modelled"])},
                      asks={"r": PoolAsk(run_id="r", workflow_id="run/r", replicas=2, quota=1)}, seq={"r": 0},
                      next_seq=1, sent={"r": ReplicaGrant(granted=2)})
    payload = DATA_CONVERTER.payload_converter.to_payloads([PoolInput(state=state)])
    assert DATA_CONVERTER.payload_converter.from_payloads(payload, [PoolInput]) == [PoolInput(state=state)]
