"""Replay the recorded workflow histories against the current code (no server needed).

tests/histories/*.json are real runs' histories: training_run_golden_v1 (a 4-step laminar run on a server
without the search attributes, recorded with `temporal workflow show -w run/golden-v1 -o json`) and the ones
`python -m tests.histories.record` records (stream, repack, continue-as-new, search attributes, recovery drills;
tests/histories/README.md). A workflow change that breaks determinism for running workflows fails here; such a
change needs `workflow.patched()` (or a new recording, when the change is deliberately incompatible and no old
run can still be live). A new `workflow.patched("id")` fails the coverage test until a history that records its
marker is recorded.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from temporalio.worker import Replayer

from laminar import contract
from laminar.client.converter import DATA_CONVERTER
from laminar.drills.workflow import RecoveryDrillWorkflow
from laminar.workflows.pool import SlotPoolWorkflow
from laminar.workflows.training_run import TrainingRunWorkflow
from tests.histories import MAX_FILE_BYTES, count, history_files, load, patch_ids, workflow_type

WORKFLOWS_DIR = Path(__file__).parents[1] / "workflows"
FILES = history_files()
# A training run's shortest history is a few steps: start, relays, init, replicas, steps, drain (> 20 events). A
# drill's is plan, inject, observe: 3 activities of 3 events each and their workflow tasks (> 10 events).
# A slot pool's: a report, two asks, their grants (signals in, external signals out) and the leaves (> 10 events).
MIN_EVENTS = {contract.TRAINING_RUN_WORKFLOW: 20, contract.RECOVERY_DRILL_WORKFLOW: 10, contract.SLOT_POOL_WORKFLOW: 10}


def source_patch_ids(directory: Path = WORKFLOWS_DIR) -> dict[str, str]:
    """Every `workflow.patched("id")` in directory/*.py: id -> where. A patch id that is not a string literal is
    an error (its history coverage could not be checked)."""
    found: dict[str, str] = {}
    for path in sorted(directory.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "patched"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "workflow"):
                where = f"{path.name}:{node.lineno}"
                arg = node.args[0] if node.args else None
                assert isinstance(arg, ast.Constant) and isinstance(arg.value, str), \
                    f"{where}: workflow.patched() needs a string literal id, so that its history coverage is checked"
                found[arg.value] = where
    return found


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
async def test_golden_history_replays(path: Path):
    assert path.stat().st_size <= MAX_FILE_BYTES, f"{path.name}: {path.stat().st_size} bytes; record a smaller run"
    history = load(path)
    kind = workflow_type(history)
    assert kind in MIN_EVENTS, f"{path.name}: workflow type {kind!r} is not one this test replays"
    assert len(history.events) > MIN_EVENTS[kind], f"{path.name} is too short to exercise {kind}"
    replayer = Replayer(workflows=[TrainingRunWorkflow, RecoveryDrillWorkflow, SlotPoolWorkflow],
                        data_converter=DATA_CONVERTER)
    await replayer.replay_workflow(history)  # nondeterminism raises here, naming the command that differs


def test_histories_cover_every_patch_both_workflows_and_continue_as_new():
    assert len(FILES) >= 6, f"expected the golden set (tests/histories/README.md), found {[f.name for f in FILES]}"
    histories = {f.name: load(f) for f in FILES}
    in_source = source_patch_ids()
    assert in_source, f"no workflow.patched(...) found under {WORKFLOWS_DIR}: the parser is broken"
    recorded = {pid for h in histories.values() for pid in patch_ids(h)}
    missing = {pid: where for pid, where in in_source.items() if pid not in recorded}
    assert not missing, (f"no golden history records the patch marker of {missing}; record one that takes the "
                         f"patched branch (python -m tests.histories.record, tests/histories/README.md)")
    kinds = {workflow_type(h) for h in histories.values()}
    assert kinds == set(MIN_EVENTS), f"the histories cover the workflow types {sorted(kinds)}"
    continued = [n for n, h in histories.items() if count(h, "WORKFLOW_EXECUTION_CONTINUED_AS_NEW")]
    assert continued, "no golden history ends in ContinueAsNew (record continue_as_new)"


def test_source_patch_ids_finds_every_literal(tmp_path):
    """The coverage test's parser, on a worked example: two patched() calls (one inside a boolean expression, as
    in training_run.py), a look-alike method on another object, and a comment are told apart."""
    (tmp_path / "a.py").write_text(
        'from temporalio import workflow\n'
        'def f(x):\n'
        '    if x or not workflow.patched("one"):\n'
        '        return workflow.patched("two")\n'
        '    x.patched("not-a-patch")  # workflow.patched("in-a-comment")\n'
    )
    assert source_patch_ids(tmp_path) == {"one": "a.py:3", "two": "a.py:4"}
