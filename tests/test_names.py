"""The names of laminar/contract.py against the handlers: every activity the workers can register (each
`@activity.defn` under activities/ and drills/) and every workflow type, update, signal and query of the workflows is declared
there under its kind, and every name declared there is handled. A name declared but never handled, or handled under a name that
is not declared, fails here; callers spell names only through the module, so they cannot drift apart."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from temporalio import activity, workflow

from laminar import activities, contract, drills
from laminar.drills.workflow import RecoveryDrillWorkflow
from laminar.workflows.pool import SlotPoolWorkflow
from laminar.workflows.training_run import TrainingRunWorkflow

WORKFLOWS = (TrainingRunWorkflow, RecoveryDrillWorkflow, SlotPoolWorkflow)


def _activity_names() -> dict[str, str]:
    """Each `@activity.defn` under activities/ and drills/ (methods of the classes the workers instantiate, and
    functions): its registered name -> where it is defined."""
    found: dict[str, str] = {}
    for package in (activities, drills):
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for owner_name, owner in vars(module).items():
                if getattr(owner, "__module__", None) != module.__name__:
                    continue  # imported from elsewhere
                members = vars(owner).values() if inspect.isclass(owner) else [owner]
                for member in members:
                    defn = activity._Definition.from_callable(member) if callable(member) else None
                    if defn is not None:
                        assert defn.name not in found, f"activity name {defn.name!r} defined twice"
                        found[defn.name] = f"{module.__name__}.{owner_name}"
    return found


def _handled() -> dict[str, set[str]]:
    """What the handlers register, by kind."""
    defs = [workflow._Definition.from_class(w) for w in WORKFLOWS]
    return {
        "WORKFLOWS": {d.name for d in defs if d.name},
        "ACTIVITIES": set(_activity_names()),
        "UPDATES": {n for d in defs for n in d.updates},
        "SIGNALS": {n for d in defs for n in d.signals if n},
        "QUERIES": {n for d in defs for n in d.queries if n},
    }


def _declared() -> dict[str, str]:
    """Every name constant of laminar/contract.py (its task queues aside): value -> constant."""
    return {v: k for k, v in vars(contract).items()
            if k.isupper() and isinstance(v, str) and v not in contract.QUEUES}


def test_every_handled_name_is_declared_under_its_kind():
    for kind, handled in _handled().items():
        declared = set(getattr(contract, kind))
        assert handled - declared == set(), f"handled but not in contract.{kind}: {sorted(handled - declared)}"
        assert declared - handled == set(), f"in contract.{kind} but never handled: {sorted(declared - handled)}"


def test_every_declared_name_is_handled():
    handled = set().union(*_handled().values())
    unhandled = {const: value for value, const in _declared().items() if value not in handled}
    assert unhandled == {}, f"declared in laminar/contract.py but no handler registers them: {unhandled}"


def test_the_recorded_names_keep_their_values():
    """Running workflows and tests/histories hold these strings: a rename needs a new name, never a new value.
    (11 activities, 3 workflows, 7 updates, 7 signals, 2 queries: 30 names.)"""
    assert sorted(_declared()) == sorted([
        "TrainingRunWorkflow", "RecoveryDrillWorkflow", "SlotPoolWorkflow",
        "init_trainer", "train_step", "train_steps", "republish", "run_rollout_replica", "run_relay",
        "plan_drill", "interrupt_store", "observe_recovery", "inject_fault", "record_eval",
        "claim_prompts", "add_experience", "pause", "resume", "stop", "scale", "relay_leaving", "relay_joined",
        "trainer_checkpointed", "workflow_reset", "status", "replica_grant", "pool_slots", "pool_ask", "pool_leave", "pool_status",
    ])


def test_every_task_queue_is_listed():
    """The contract's string constants are names or queues: a queue constant left out of QUEUES would count as an
    undeclared name above."""
    queues = {k for k, v in vars(contract).items() if k.isupper() and k.endswith("_QUEUE") and isinstance(v, str)}
    assert {getattr(contract, k) for k in queues} == set(contract.QUEUES)
