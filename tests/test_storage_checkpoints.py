"""Checkpoint store contract on both backends: commit by manifest-last, verification, fallback, retention."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from laminar.errors import CorruptDataError
from laminar.storage import keys
from laminar.storage.checkpoints import CheckpointStore

RUN = "run-1"


def _parts(scale: float) -> dict[str, dict[str, torch.Tensor]]:
    return {
        "model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale,
                  "b": torch.tensor([1.0, 2.0], dtype=torch.bfloat16) * scale,
                  "pos": torch.arange(4, dtype=torch.int64)},
        "optim": {"exp_avg.w": torch.full((2, 3), scale), "step": torch.tensor(scale)},
    }


def _save(ckpts: CheckpointStore, step: int):
    # policy_version trails step by one here only so the two are told apart in assertions.
    return ckpts.save(RUN, step, _parts(float(step)), {"lr": 1e-5, "consumed_groups": [f"g{step}"]},
                      policy_version=step - 1)


def _flip_last_byte(store, key: str) -> None:
    data = bytearray(store.get(key))
    data[-1] ^= 0xFF  # the last byte is tensor data, so the file stays parseable but its sha256 changes
    store.put(key, bytes(data))


def test_save_then_load_round_trips_tensors_and_meta(object_store):
    ckpts = CheckpointStore(object_store)
    ref = _save(ckpts, 40)
    assert (ref.run_id, ref.step, ref.policy_version) == (RUN, 40, 39)
    assert ref.manifest_key == keys.checkpoint_manifest(RUN, 40)
    assert object_store.list(keys.checkpoint_prefix(RUN, 40)) == [
        f"runs/{RUN}/checkpoints/step-00000040/{name}"
        for name in ["manifest.json", "model-00001.safetensors", "optim-00001.safetensors", "trainer.json"]
    ]
    loaded = ckpts.load(ref)
    assert loaded.ref == ref
    assert loaded.meta == {"lr": 1e-5, "consumed_groups": ["g40"]}
    expected = _parts(40.0)
    assert loaded.parts.keys() == expected.keys()
    for part, tensors in expected.items():
        assert loaded.parts[part].keys() == tensors.keys()
        for name, tensor in tensors.items():
            assert loaded.parts[part][name].dtype == tensor.dtype
            assert torch.equal(loaded.parts[part][name], tensor)
    assert ckpts.list_committed(RUN) == [40]
    assert ckpts.latest(RUN) == ref


def test_no_checkpoint_means_latest_is_none(object_store):
    assert CheckpointStore(object_store).latest(RUN) is None
    assert CheckpointStore(object_store).list_committed(RUN) == []


def test_crash_between_parts_and_manifest_leaves_previous_checkpoint_latest(object_store):
    ckpts = CheckpointStore(object_store)
    ref10 = _save(ckpts, 10)
    _save(ckpts, 20)
    # A crash after the parts and trainer.json but before the manifest leaves exactly this state.
    object_store.delete(keys.checkpoint_manifest(RUN, 20))
    assert object_store.exists(keys.checkpoint_part(RUN, 20, "model"))
    assert ckpts.list_committed(RUN) == [10]
    assert ckpts.latest(RUN) == ref10
    # The restarted trainer saves step 20 again and it commits normally.
    ref20 = _save(ckpts, 20)
    assert ckpts.latest(RUN) == ref20


def test_flipped_byte_is_detected_and_latest_falls_back(object_store):
    ckpts = CheckpointStore(object_store)
    ref10 = _save(ckpts, 10)
    ref20 = _save(ckpts, 20)
    bad_key = keys.checkpoint_part(RUN, 20, "model")
    _flip_last_byte(object_store, bad_key)

    with pytest.raises(CorruptDataError) as info:
        ckpts.load(ref20)
    message = str(info.value)
    assert "step-20 part model-00001.safetensors: sha256 mismatch (expected " in message
    assert "corrupt" in message

    with capture_logs() as logs:
        assert ckpts.latest(RUN) == ref10
    skipped = [e for e in logs if e["event"] == "checkpoint_skipped"]
    assert len(skipped) == 1
    event = skipped[0]
    assert event["log_level"] == "warning"
    assert (event["step"], event["part"], event["falls_back_to"]) == (20, "model-00001.safetensors", 10)
    assert event["reason"] == "sha256 mismatch" and event["expected"] != event["actual"]
    assert event["expected"].endswith("..") and len(event["expected"]) == 10  # 8 hex chars + ".."
    assert ckpts.load(ref10).meta["consumed_groups"] == ["g10"]


def test_truncated_part_is_a_size_mismatch(object_store):
    ckpts = CheckpointStore(object_store)
    ref = _save(ckpts, 5)
    key = keys.checkpoint_part(RUN, 5, "optim")
    object_store.put(key, object_store.get(key)[:-3])
    with pytest.raises(CorruptDataError, match=r"step-5 part optim-00001.safetensors: size mismatch"):
        ckpts.load(ref)
    assert ckpts.latest(RUN) is None  # the only checkpoint is bad: nothing to fall back to


def test_all_bad_checkpoints_are_skipped_down_to_the_oldest_good_one(object_store):
    ckpts = CheckpointStore(object_store)
    ref1 = _save(ckpts, 1)
    _save(ckpts, 2)
    _save(ckpts, 3)
    object_store.delete(keys.checkpoint_trainer(RUN, 3))  # committed, but a file is gone
    _flip_last_byte(object_store, keys.checkpoint_part(RUN, 2, "optim"))
    with capture_logs() as logs:
        assert ckpts.latest(RUN) == ref1
    assert [(e["step"], e["part"], e["falls_back_to"]) for e in logs if e["event"] == "checkpoint_skipped"] == [
        (3, "trainer.json", 1), (2, "optim-00001.safetensors", 1)]


def test_resaving_a_step_replaces_it_and_stales_old_refs(object_store):
    ckpts = CheckpointStore(object_store)
    old = _save(ckpts, 7)
    new = ckpts.save(RUN, 7, _parts(70.0), {"lr": 2e-5}, policy_version=6)
    assert new.manifest_sha256 != old.manifest_sha256
    assert torch.equal(ckpts.load(new).parts["model"]["w"], _parts(70.0)["model"]["w"])
    with pytest.raises(CorruptDataError, match="step-7 part manifest.json: sha256 mismatch"):
        ckpts.load(old)


def test_save_deletes_nothing_and_retain_deletes_only_below_the_kept_step(object_store):
    ckpts = CheckpointStore(object_store)
    for step in (1, 2, 3, 4, 5):
        _save(ckpts, step)
    # Saving never deletes: whoever records the committed checkpoints decides what may go.
    assert ckpts.list_committed(RUN) == [1, 2, 3, 4, 5]
    object_store.delete(keys.checkpoint_manifest(RUN, 2))  # step 2 crashed before its manifest
    ckpts.retain(RUN, keep_from_step=4)
    # Everything under steps 1, 2 (the crashed leftovers too) and 3 is gone; 4 (the kept one) and 5 stay.
    remaining = {keys.parse_checkpoint_step(RUN, k) for k in object_store.list(keys.checkpoints_prefix(RUN))}
    assert remaining == {4, 5}
    assert ckpts.list_committed(RUN) == [4, 5] and ckpts.latest(RUN).step == 5
    ckpts.retain(RUN, keep_from_step=0)  # nothing is below step 0
    assert ckpts.list_committed(RUN) == [4, 5]


def test_invalid_arguments_are_rejected(object_store):
    ckpts = CheckpointStore(object_store)
    with pytest.raises(ValueError, match="no parts"):
        ckpts.save(RUN, 1, {}, {}, policy_version=0)
    with pytest.raises(ValueError, match="run_id"):
        ckpts.save("a/b", 1, _parts(1.0), {}, policy_version=0)
