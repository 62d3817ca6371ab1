"""Checkpoints: safetensors parts, trainer.json, then manifest.json last (docs/architecture/invariants.md).

A checkpoint is committed once its manifest exists; readers trust only committed checkpoints whose every
file matches the manifest's size and sha256. Never pickle: tensors go through safetensors, metadata JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from laminar.errors import CorruptDataError, ObjectNotFoundError
from laminar.refs import CheckpointRef
from laminar.storage import keys
from laminar.storage.objects import ObjectStore, sha256_hex

if TYPE_CHECKING:
    import torch

MANIFEST_FORMAT = 1
TRAINER_FILE = "trainer.json"


@dataclass
class LoadedCheckpoint:
    """A verified checkpoint: its ref, its parts as tensors keyed by part name, and the trainer metadata."""

    ref: CheckpointRef
    parts: dict[str, dict[str, torch.Tensor]]
    meta: dict[str, Any]


@dataclass(frozen=True)
class _Problem:
    """Why a checkpoint file does not match its manifest entry."""

    file: str
    reason: str  # "missing", "size mismatch", "sha256 mismatch"
    expected: str
    actual: str

    def describe(self, step: int) -> str:
        return (f"checkpoint step-{step} part {self.file}: {self.reason} (expected {self.expected}, got "
                f"{self.actual}); the store holds a corrupt or incomplete object")


def _short(sha: str) -> str:
    return f"{sha[:8]}.."


class CheckpointStore:
    """Saves, finds and loads checkpoints of a run in an ObjectStore."""

    def __init__(self, store: ObjectStore):
        self.store = store

    # -- writing -------------------------------------------------------------------------------------

    def save(self, run_id: str, step: int, parts: dict[str, dict[str, torch.Tensor]], meta: dict[str, Any],
             policy_version: int) -> CheckpointRef:
        """Write every part, then trainer.json, then the manifest (the commit). Deletes nothing older:
        whoever records committed checkpoints decides what may go (`retain`)."""
        if not parts:
            raise ValueError(f"checkpoint step-{step} of run {run_id} has no parts; pass e.g. {{'model': state_dict}}")
        manifest_key = keys.checkpoint_manifest(run_id, step)
        # Re-saving a step (a restarted trainer) must not leave the old manifest vouching for new parts.
        self.store.delete(manifest_key)
        files: dict[str, dict[str, Any]] = {}
        part_files: dict[str, str] = {}
        for part, tensors in parts.items():
            file_name = keys.checkpoint_part_file(part)
            files[file_name] = self._put(keys.checkpoint_part(run_id, step, part), _serialize(tensors))
            part_files[part] = file_name
        trainer = {"step": step, "policy_version": policy_version, "meta": meta}
        files[TRAINER_FILE] = self._put(keys.checkpoint_trainer(run_id, step),
                                        json.dumps(trainer, sort_keys=True).encode())
        manifest = {"format": MANIFEST_FORMAT, "run_id": run_id, "step": step, "policy_version": policy_version,
                    "parts": part_files, "files": files}
        manifest_bytes = json.dumps(manifest, sort_keys=True, indent=1).encode()
        self.store.put(manifest_key, manifest_bytes)
        structlog.get_logger().info("checkpoint_saved", run_id=run_id, step=step, policy_version=policy_version,
                                    bytes=sum(f["size"] for f in files.values()) + len(manifest_bytes))
        return CheckpointRef(run_id=run_id, step=step, manifest_key=manifest_key,
                             manifest_sha256=sha256_hex(manifest_bytes), policy_version=policy_version)

    def _put(self, key: str, data: bytes) -> dict[str, Any]:
        self.store.put(key, data)
        return {"sha256": sha256_hex(data), "size": len(data)}

    def retain(self, run_id: str, keep_from_step: int) -> None:
        """Delete every checkpoint of steps below `keep_from_step`, committed or crashed half-way.

        The trainer passes the oldest checkpoint the workflow still records (it may restore from any of
        them), so a checkpoint the workflow points to is never deleted, even if this step's result is lost.
        """
        by_step: dict[int, list[str]] = {}
        for key in self.store.list(keys.checkpoints_prefix(run_id)):
            step = keys.parse_checkpoint_step(run_id, key)
            if step is not None and step < keep_from_step:
                by_step.setdefault(step, []).append(key)
        for step, step_keys in sorted(by_step.items()):
            manifest_key = keys.checkpoint_manifest(run_id, step)
            # Uncommit first (manifest), so a reader never sees a manifest whose parts are gone.
            for key in sorted(step_keys, key=lambda k: k != manifest_key):
                self.store.delete(key)
            structlog.get_logger().info("checkpoint_deleted", run_id=run_id, step=step, keep_from_step=keep_from_step)

    # -- finding -------------------------------------------------------------------------------------

    def list_committed(self, run_id: str) -> list[int]:
        """Steps whose manifest exists, ascending (parts not verified; see latest())."""
        steps = set()
        for key in self.store.list(keys.checkpoints_prefix(run_id)):
            step = keys.parse_checkpoint_step(run_id, key)
            if step is not None and key == keys.checkpoint_manifest(run_id, step):
                steps.add(step)
        return sorted(steps)

    def verified_at(self, run_id: str, step: int) -> CheckpointRef | None:
        """The ref of the checkpoint of this step if it is committed and every file verifies, else None."""
        return self._verify(run_id, step)[0]

    def latest(self, run_id: str) -> CheckpointRef | None:
        """The newest committed checkpoint whose files all verify, or None if there is none.

        A committed checkpoint that fails verification is skipped with a `checkpoint_skipped` warning.
        Verification reads every file, so this costs one full read of each checkpoint it inspects.
        """
        skipped: list[tuple[int, _Problem]] = []
        found: CheckpointRef | None = None
        for step in reversed(self.list_committed(run_id)):
            ref, problem = self._verify(run_id, step)
            if problem is None:
                found = ref
                break
            skipped.append((step, problem))
        log = structlog.get_logger()
        for step, problem in skipped:
            log.warning("checkpoint_skipped", run_id=run_id, step=step, part=problem.file, reason=problem.reason,
                        expected=problem.expected, actual=problem.actual,
                        falls_back_to=found.step if found else None, error=problem.describe(step))
        return found

    def verify(self, run_id: str, step: int) -> str | None:
        """None when the committed checkpoint of `step` verifies (every file's size and sha256), else what is wrong."""
        problem = self._verify(run_id, step)[1]
        return None if problem is None else problem.describe(step)

    def _verify(self, run_id: str, step: int) -> tuple[CheckpointRef | None, _Problem | None]:
        manifest_key = keys.checkpoint_manifest(run_id, step)
        try:
            manifest_bytes = self.store.get(manifest_key)
        except ObjectNotFoundError:
            return None, _Problem("manifest.json", "missing", "a committed manifest", "no object")
        try:
            manifest = _parse_manifest(manifest_bytes, run_id, step)
        except CorruptDataError as exc:
            return None, _Problem("manifest.json", "unreadable manifest", "valid manifest JSON", str(exc))
        for file_name, entry in sorted(manifest["files"].items()):
            problem = self._check_file(run_id, step, file_name, entry)[1]
            if problem is not None:
                return None, problem
        return CheckpointRef(run_id=run_id, step=step, manifest_key=manifest_key,
                             manifest_sha256=sha256_hex(manifest_bytes),
                             policy_version=int(manifest["policy_version"])), None

    def _check_file(self, run_id: str, step: int, file_name: str,
                    entry: dict[str, Any]) -> tuple[bytes | None, _Problem | None]:
        try:
            data = self.store.get(keys.checkpoint_file(run_id, step, file_name))
        except ObjectNotFoundError:
            return None, _Problem(file_name, "missing", f"{entry['size']} bytes", "no object")
        if len(data) != entry["size"]:
            return None, _Problem(file_name, "size mismatch", f"{entry['size']} bytes", f"{len(data)} bytes")
        actual = sha256_hex(data)
        if actual != entry["sha256"]:
            return None, _Problem(file_name, "sha256 mismatch", _short(entry["sha256"]), _short(actual))
        return data, None

    # -- loading -------------------------------------------------------------------------------------

    def load(self, ref: CheckpointRef) -> LoadedCheckpoint:
        """Read and verify a checkpoint (manifest sha256 and every file); CorruptDataError on any mismatch."""
        from safetensors.torch import load as load_safetensors

        try:
            manifest_bytes = self.store.get(ref.manifest_key)
        except ObjectNotFoundError as exc:
            raise CorruptDataError(f"checkpoint step-{ref.step} of run {ref.run_id}: manifest {ref.manifest_key} "
                                   f"is gone; the checkpoint was deleted or never committed; "
                                   f"ask CheckpointStore.latest() for a current ref") from exc
        actual = sha256_hex(manifest_bytes)
        if actual != ref.manifest_sha256:
            raise CorruptDataError(
                f"checkpoint step-{ref.step} part manifest.json: sha256 mismatch (expected "
                f"{_short(ref.manifest_sha256)}, got {_short(actual)}); the manifest was rewritten or corrupted "
                f"since the ref was made; ask CheckpointStore.latest() for a current ref")
        manifest = _parse_manifest(manifest_bytes, ref.run_id, ref.step)
        blobs: dict[str, bytes] = {}
        for file_name, entry in sorted(manifest["files"].items()):
            data, problem = self._check_file(ref.run_id, ref.step, file_name, entry)
            if problem is not None:
                raise CorruptDataError(problem.describe(ref.step))
            blobs[file_name] = data
        parts = {part: load_safetensors(blobs[file_name]) for part, file_name in manifest["parts"].items()}
        trainer = json.loads(blobs[TRAINER_FILE])
        return LoadedCheckpoint(ref=ref, parts=parts, meta=trainer["meta"])


def _serialize(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save as save_safetensors

    return save_safetensors({name: t.detach().cpu().contiguous() for name, t in tensors.items()})


def _parse_manifest(data: bytes, run_id: str, step: int) -> dict[str, Any]:
    where = f"checkpoint step-{step} of run {run_id}: manifest.json"
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptDataError(f"{where} is not valid JSON ({exc}); the store holds a corrupt object") from exc
    missing = [f for f in ("format", "step", "policy_version", "parts", "files") if f not in manifest]
    if missing:
        raise CorruptDataError(f"{where} lacks fields {missing}; the store holds a corrupt or foreign object")
    if manifest["format"] != MANIFEST_FORMAT or manifest["step"] != step:
        raise CorruptDataError(f"{where} has format {manifest['format']} and step {manifest['step']}, expected "
                               f"format {MANIFEST_FORMAT} and step {step}; it was written by another version "
                               f"or copied from another step")
    return manifest
