"""Every object-store key layout of a run (docs/architecture/storage.md, 'Storage layout'). Nothing else in the
project spells keys.

    runs/<run_id>/run.json                        (the marker: who started the run, its parent)
    runs/<run_id>/config.json
    runs/<run_id>/model/{config.json, tokenizer.json}
    runs/<run_id>/checkpoints/step-<n:08d>/{model-00001.safetensors, optim-00001.safetensors,
                                            trainer.json, manifest.json}
    runs/<run_id>/experience/<replica>/<seq>.parquet
    runs/<run_id>/partial/<replica>/g<segment:06d>-a<attempt:04d>[-b].parquet   (two slots; + .json, the commit manifest naming one)
    runs/<run_id>/drills/<drill_id>.json
    runs/<run_id>/metrics/step-<n:08d>.json
    runs/<run_id>/profile/<process>.json
    runs/<run_id>/summary.json
"""

from __future__ import annotations

import re

_STEP_DIR = re.compile(r"^step-(\d{8})$")
_PART_NAME = re.compile(r"^[A-Za-z0-9_.]+$")


def check_id(kind: str, value: str) -> str:
    """Return `value` if it is usable as one key segment, else raise ValueError naming kind and value."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind} must be a non-empty string, got {value!r}")
    if "/" in value or value in (".", ".."):
        raise ValueError(f"{kind} {value!r} cannot be used in an object key: it must not contain '/' "
                         f"or be '.' or '..'; pick an id made of letters, digits, '-', '_' or '.'")
    return value


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return step


def run_prefix(run_id: str) -> str:
    return f"runs/{check_id('run_id', run_id)}/"


def config(run_id: str) -> str:
    return f"{run_prefix(run_id)}config.json"


def run_marker(run_id: str) -> str:
    """The run's marker (storage/runs.py): written first, before anything else of the run."""
    return f"{run_prefix(run_id)}run.json"


def summary(run_id: str) -> str:
    return f"{run_prefix(run_id)}summary.json"


def scale_targets(run_id: str) -> str:
    """The replica and relay counts the run's last `laminar scale` set (client/run_control.py scale_run): what
    `laminar run` follows to start and retire its worker processes, without a workflow query."""
    return f"{run_prefix(run_id)}scale.json"


# -- checkpoints -------------------------------------------------------------------------------------

def checkpoints_prefix(run_id: str) -> str:
    return f"{run_prefix(run_id)}checkpoints/"


def step_dir(step: int) -> str:
    return f"step-{_check_step(step):08d}"


def checkpoint_prefix(run_id: str, step: int) -> str:
    return f"{checkpoints_prefix(run_id)}{step_dir(step)}/"


def checkpoint_part_file(part: str) -> str:
    """File name of a checkpoint part: part "model" -> "model-00001.safetensors"."""
    check_id("checkpoint part", part)
    if not _PART_NAME.match(part) or part in ("trainer", "manifest"):
        raise ValueError(f"checkpoint part name {part!r} is not allowed: use letters, digits, '_' or '.', "
                         f"and not 'trainer' or 'manifest' (those names are reserved)")
    return f"{part}-00001.safetensors"


def checkpoint_part(run_id: str, step: int, part: str) -> str:
    return f"{checkpoint_prefix(run_id, step)}{checkpoint_part_file(part)}"


def checkpoint_trainer(run_id: str, step: int) -> str:
    return f"{checkpoint_prefix(run_id, step)}trainer.json"


def checkpoint_manifest(run_id: str, step: int) -> str:
    return f"{checkpoint_prefix(run_id, step)}manifest.json"


def checkpoint_file(run_id: str, step: int, file_name: str) -> str:
    """Key of a file named in a checkpoint manifest (the manifest stores names relative to its step)."""
    return f"{checkpoint_prefix(run_id, step)}{check_id('checkpoint file name', file_name)}"


def parse_checkpoint_step(run_id: str, key: str) -> int | None:
    """The step of a key under runs/<run_id>/checkpoints/step-<n>/, or None if the key is not one."""
    prefix = checkpoints_prefix(run_id)
    if not key.startswith(prefix):
        return None
    head = key[len(prefix):].split("/", 1)[0]
    match = _STEP_DIR.match(head)
    return int(match.group(1)) if match else None


# -- experience --------------------------------------------------------------------------------------

def experience_prefix(run_id: str, replica_id: str | None = None) -> str:
    base = f"{run_prefix(run_id)}experience/"
    return base if replica_id is None else f"{base}{check_id('replica_id', replica_id)}/"


def experience_segment(run_id: str, replica_id: str, seq: str) -> str:
    return f"{experience_prefix(run_id, replica_id)}{check_id('segment seq', seq)}.parquet"


def migration(run_id: str, migration_id: str) -> str:
    """The groups a repack source handed over (workflows/migrations.py); read by the destination."""
    return f"{run_prefix(run_id)}migrations/{check_id('migration id', migration_id)}.parquet"


Fence = tuple[int, int]  # (history segment, activity attempt) of the replica incarnation that wrote a pool


def partial_prefix(run_id: str, replica_id: str) -> str:
    return f"{run_prefix(run_id)}partial/{check_id('replica_id', replica_id)}/"


def _fence_name(fence: Fence) -> str:
    generation, attempt = fence
    if generation < 0 or attempt < 1:
        raise ValueError(f"partial pool fence {fence} must be (generation >= 0, attempt >= 1)")
    return f"g{generation:06d}-a{attempt:04d}"


def partial_pool(run_id: str, replica_id: str, fence: Fence, slot: int = 0) -> str:
    """One of the two Parquet slots of a fence's pool (storage/trajectories.py write_partial: a flush writes the
    slot its manifest does not name, then the manifest, so a crash or outage mid-flush leaves the last commit)."""
    if slot not in (0, 1):
        raise ValueError(f"partial pool slot {slot} must be 0 or 1")
    return f"{partial_prefix(run_id, replica_id)}{_fence_name(fence)}{'-b' if slot else ''}.parquet"


def partial_manifest(run_id: str, replica_id: str, fence: Fence) -> str:
    return f"{partial_prefix(run_id, replica_id)}{_fence_name(fence)}.json"


_FENCE_FILE = re.compile(r"^g(\d{6})-a(\d{4})(-b)?\.(json|parquet)$")


def parse_partial_fence(run_id: str, replica_id: str, key: str) -> Fence | None:
    """The fence of a key under the replica's partial prefix, or None if the key is not a pool file."""
    prefix = partial_prefix(run_id, replica_id)
    match = _FENCE_FILE.match(key[len(prefix):]) if key.startswith(prefix) else None
    return (int(match.group(1)), int(match.group(2))) if match else None


# -- reports -----------------------------------------------------------------------------------------

def drill_reports_prefix(run_id: str) -> str:
    return f"{run_prefix(run_id)}drills/"


def drill_report(run_id: str, drill_id: str) -> str:
    return f"{drill_reports_prefix(run_id)}{check_id('drill_id', drill_id)}.json"


def workflow_resets_prefix(run_id: str) -> str:
    return f"{run_prefix(run_id)}workflow-resets/"


def workflow_reset(run_id: str, new_run_id: str) -> str:
    """The repairer's record of one reset of the run's workflow (services/repair.py), by the reset run's id."""
    return f"{workflow_resets_prefix(run_id)}{check_id('temporal run id', new_run_id)}.json"


def step_metrics(run_id: str, step: int) -> str:
    return f"{run_prefix(run_id)}metrics/{step_dir(step)}.json"


def step_metrics_prefix(run_id: str) -> str:
    return f"{run_prefix(run_id)}metrics/"


def evals_prefix(run_id: str) -> str:
    """Held-out evaluation records of the run (rl/evaluation.py eval_record), one per policy version evaluated."""
    return f"{run_prefix(run_id)}evals/"


def eval_result(run_id: str, policy_version: int) -> str:
    return f"{evals_prefix(run_id)}{step_dir(policy_version)}.json"


def profile_prefix(run_id: str, role: str | None = None) -> str:
    """Every process's time breakdown, or those of one role's processes (`trainer`, `rollout`)."""
    return f"{run_prefix(run_id)}profile/" + ("" if role is None else f"{check_id('profile role', role)}-")


def profile(run_id: str, process: str) -> str:
    """One process's time breakdown (laminar.timing), e.g. `trainer-1234` or a rollout replica incarnation."""
    return f"{profile_prefix(run_id)}{check_id('profile process', process)}.json"


# -- model -------------------------------------------------------------------------------------------

def model_file(run_id: str, file_name: str) -> str:
    """The run's model config.json / tokenizer.json, published by the trainer for rollout replicas."""
    return f"{run_prefix(run_id)}model/{check_id('model file', file_name)}"
