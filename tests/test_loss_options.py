"""The trainer's loss options (trainer.advantage, ratio, loss_aggregation, mask_truncated, kl_beta) in real
steps of a tiny model: micro-batching leaves each update unchanged, the KL reference stays frozen and travels
with the checkpoint, truncated samples leave the loss. The maths is checked against TRL in tests/test_losses.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pydantic import ValidationError

from laminar.config import TrainerSection
from laminar.rl.model import build_model, bytes_to_state_dict, state_dict_to_bytes
from laminar.rl.trainer import Trainer
from tests.test_rl_trainer import HF, on_policy_batch

OPTIONS = [
    {"ratio": "sequence", "loss_aggregation": "sequence"},
    {"ratio": "cispo", "advantage": "rloo"},
    {"loss_aggregation": "constant", "loss_constant_tokens": 8, "advantage": "none"},
    {"kl_beta": 0.1, "advantage": "batch"},
]


@pytest.mark.parametrize("options", OPTIONS)
def test_micro_batches_give_the_same_update_under_each_option(options) -> None:
    weights = []
    for micro in (None, 2):
        model = build_model(HF, seed=0)
        trainer = Trainer(model, TrainerSection(lr=1e-2, minibatches=2, micro_batch_samples=micro, **options),
                          group_size=3)
        batch = on_policy_batch(build_model(HF, seed=0))
        trainer.step(batch, trainer_version=0)
        trainer.step(on_policy_batch(model, version=1), trainer_version=1)  # off the proximal policy: clips bite
        weights.append(trainer.policy_state_dict())
    start = build_model(HF, seed=0).state_dict()
    assert any(not torch.equal(weights[0][k], start[k]) for k in weights[0])  # the steps moved the weights
    for k in weights[0]:
        assert torch.allclose(weights[0][k], weights[1][k], atol=1e-6), k


def test_kl_reference_stays_frozen_and_is_restored_from_the_checkpoint() -> None:
    cfg = TrainerSection(lr=1e-2, kl_beta=0.5)
    a = Trainer(build_model(HF, seed=0), cfg, group_size=3)
    start = {k: v.clone() for k, v in a.policy_state_dict().items()}
    a.step(on_policy_batch(a.model), trainer_version=0)
    parts = a.state_parts()
    assert all(torch.equal(parts["reference"][k], start[k]) for k in start)
    assert any(not torch.equal(parts["model"][k], start[k]) for k in start)
    restored = {name: bytes_to_state_dict(state_dict_to_bytes(p)) for name, p in parts.items()}
    b = Trainer(build_model(HF, seed=1), cfg, group_size=3)  # another start: its reference must be replaced
    b.load_state_parts(restored)
    batch = on_policy_batch(a.model, version=1)
    ma, mb = a.step(batch, trainer_version=1), b.step(batch, trainer_version=1)
    assert ma.loss == mb.loss and ma.grad_norm == mb.grad_norm
    # the penalty is in the loss: with beta 0 the same step from the same state differs
    c = Trainer(build_model(HF, seed=1), TrainerSection(lr=1e-2), group_size=3)
    c.load_state_parts({k: v for k, v in restored.items() if k != "reference"})
    assert c.step(batch, trainer_version=1).loss != ma.loss
    assert "reference" not in c.state_parts()


def test_mask_truncated_takes_truncated_samples_out_of_the_loss() -> None:
    model = build_model(HF, seed=0)
    batch = on_policy_batch(model)
    batch[1] = dataclasses.replace(batch[1], finish_reason="length")
    m = Trainer(model, TrainerSection(lr=1e-2, mask_truncated=True), group_size=3).step(batch, trainer_version=0)
    assert m.tokens == sum(len(t.response_ids) for t in batch) - len(batch[1].response_ids)
    m = Trainer(build_model(HF, seed=0), TrainerSection(lr=1e-2), group_size=3).step(batch, trainer_version=0)
    assert m.tokens == sum(len(t.response_ids) for t in batch)


@pytest.mark.parametrize("fields,error", [
    ({"loss_aggregation": "constant"}, "trainer.loss_constant_tokens"),
    ({"kl_beta": 0.1, "lora": {"r": 4}}, "trainer.kl_beta=0.1"),
    ({"ratio": "sequence", "entropy_coef": 0.01}, "trainer.entropy_coef=0.01"),
])
def test_loss_option_conflicts_are_refused_by_name(fields, error) -> None:
    with pytest.raises(ValidationError, match=error.replace(".", r"\.")):
        TrainerSection(**fields)


def test_kl_beta_with_the_fsdp_backend_is_refused_when_the_config_is_checked():
    from laminar.config import RunConfig
    from laminar.errors import ConfigError
    from laminar.rl.factory import check_engines

    cfg = RunConfig.load(None, ["--trainer.kl_beta=0.04", "--trainer.backend=fsdp"])
    with pytest.raises(ConfigError, match="trainer.kl_beta=0.04 needs trainer.backend='single'"):
        check_engines(cfg)
