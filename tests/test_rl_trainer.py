"""GRPO pieces worked by hand, and the Trainer on a real tiny model (staleness, checkpoint parts)."""

from __future__ import annotations

import math

import pytest
import torch

from laminar.config import TrainerSection
from laminar.records import Trajectory
from rl.grpo import clipped_token_loss, group_advantages, split_stale
from rl.model import build_model, bytes_to_state_dict, state_dict_to_bytes
from rl.trainer import Trainer

HF = {
    "model_type": "llama",
    "vocab_size": 12,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


def test_group_advantages_hand_worked():
    # Group g1 rewards [1, 0, 0, 1]: mean 0.5, population std 0.5 -> (r - 0.5) / 0.5 = [1, -1, -1, 1].
    # Group g2 rewards [0.2, 0.2]: std 0 -> advantage 0 (no signal), not NaN.
    # Group g3 rewards [0.9, 0.3, 0.6]: mean 0.6, std sqrt((0.09 + 0.09 + 0) / 3) = sqrt(0.06) = 0.2449
    #   -> [0.3, -0.3, 0] / 0.2449 = [1.2247, -1.2247, 0].
    adv = group_advantages(
        [1, 0, 0.2, 0, 0.9, 1, 0.2, 0.3, 0.6], ["g1", "g1", "g2", "g1", "g3", "g1", "g2", "g3", "g3"]
    )
    expected = [1, -1, 0, -1, 1.2247, 1, 0, -1.2247, 0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-4)


def test_clipped_loss_hand_worked():
    """Four tokens, eps_low 0.2, eps_high 0.28 (clip range [0.8, 1.28]):
    token  ratio  A    unclipped  clipped        min     loss = -min  gradient flows?
      1    1.5   +1      1.5      1.28 (clip)    1.28     -1.28       no (clipped)
      2    0.5   +1      0.5      0.8            0.5      -0.5        yes, d/dlogp = -0.5
      3    0.5   -1     -0.5     -0.8 (clip)    -0.8       0.8        no (clipped)
      4    1.5   -1     -1.5     -1.28          -1.5       1.5        yes, d/dlogp = +1.5
    token-level mean: (-1.28 - 0.5 + 0.8 + 1.5) / 4 = 0.52 / 4 = 0.13; clip fraction 2/4.
    A fifth, masked-out token must change nothing."""
    behaviour = torch.zeros(4, 2)
    logp = torch.tensor(
        [[math.log(1.5), 9.0], [math.log(0.5), 9.0], [math.log(0.5), 9.0], [math.log(1.5), 9.0]]
    )
    logp.requires_grad_(True)
    mask = torch.tensor([[1, 0], [1, 0], [1, 0], [1, 0]])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    parts = clipped_token_loss(logp, behaviour, adv, mask, eps_low=0.2, eps_high=0.28)
    assert parts.loss.item() == pytest.approx(0.13, abs=1e-6)
    assert parts.clip_fraction == pytest.approx(0.5) and parts.tokens == 4
    parts.loss.backward()
    # d(-ratio * A)/dlogp = -ratio * A, divided by 4 tokens
    assert logp.grad[:, 0].tolist() == pytest.approx([0.0, -0.5 / 4, 0.0, 1.5 / 4], abs=1e-6)
    assert logp.grad[:, 1].tolist() == [0.0] * 4


def test_truncated_importance_sampling_caps_the_weight():
    # pi_old/pi_behaviour = exp(logp - behaviour): token 1 e^1 = 2.718 -> capped at 2; token 2 e^-1 = 0.368.
    # ratio vs pi_old is 1 (single update), so loss = -(2 * A1 + 0.368 * A2) / 2 with A = [1, 1] = -1.1839.
    logp = torch.tensor([[0.0], [0.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.0], [1.0]])
    parts = clipped_token_loss(
        logp, behaviour, torch.tensor([1.0, 1.0]), torch.ones(2, 1), eps_low=0.2, eps_high=0.28, tis_cap=2.0
    )
    assert parts.loss.item() == pytest.approx(-(2.0 + math.exp(-1)) / 2, abs=1e-5)


def traj(group, k, version, reward, prompt=(1, 3, 4), response=(5, 6, 2), logprobs=None) -> Trajectory:
    return Trajectory(
        run_id="r",
        prompt_id=0,
        group_id=group,
        sample_index=k,
        prompt_ids=list(prompt),
        response_ids=list(response),
        logprobs=list(logprobs or [-2.0] * len(response)),
        reward=reward,
        policy_version=version,
        replica_id="x",
        started_at=0.0,
        ended_at=0.0,
        finish_reason="stop",
    )


def test_staleness_histogram_and_drop():
    # trainer_version 5; versions [5, 5, 4, 2] -> staleness [0, 0, 1, 3] -> {0: 2, 1: 1, 3: 1}
    ts = [traj("g", i, v, 0.0) for i, v in enumerate([5, 5, 4, 2])]
    kept, hist, dropped = split_stale(ts, 5, max_staleness=-1)
    assert hist == {0: 2, 1: 1, 3: 1} and dropped == 0 and len(kept) == 4
    kept, hist, dropped = split_stale(ts, 5, max_staleness=1)
    assert hist == {0: 2, 1: 1, 3: 1} and dropped == 1 and [t.policy_version for t in kept] == [5, 5, 4]


def on_policy_batch(model, version=0):
    """Two groups of three with behaviour log-probs computed by the model itself (ratio 1)."""
    out = []
    responses = [(5, 6, 2), (7, 7, 7, 2), (8, 2)]
    for g, rewards in (("g0", [1.0, 0.0, 0.5]), ("g1", [0.2, 0.9, 0.4])):
        for k, (resp, r) in enumerate(zip(responses, rewards, strict=True)):
            prompt = [1, 3, 4] if g == "g0" else [1, 9]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([prompt + list(resp)]))[0], -1)
            lps = [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(resp)]
            out.append(traj(g, k, version, r, prompt, resp, lps))
    return out


def test_trainer_step_moves_logprobs_with_the_advantage():
    model = build_model(HF, seed=0)
    trainer = Trainer(model, TrainerSection(lr=1e-2), group_size=3)
    batch = on_policy_batch(model)
    m = trainer.step(batch, trainer_version=0)
    assert m.updated and m.samples == 6 and m.tokens == 2 * (3 + 4 + 2) and m.staleness == {0: 6}
    assert m.reward_mean == pytest.approx(0.5) and m.clip_fraction == 0.0  # ratio is exactly 1
    assert m.grad_norm > 0 and m.entropy > 0 and m.response_len_mean == pytest.approx(3.0)
    after = on_policy_batch(model)
    # In group g0 sample 0 had the best reward (A > 0) and sample 1 the worst (A < 0).
    assert sum(after[0].logprobs) > sum(batch[0].logprobs)
    assert sum(after[1].logprobs) < sum(batch[1].logprobs)


def test_trainer_drops_stale_samples_and_skips_empty_updates():
    model = build_model(HF, seed=0)
    trainer = Trainer(model, TrainerSection(max_staleness=0), group_size=3)
    before = {k: v.clone() for k, v in trainer.policy_state_dict().items()}
    m = trainer.step(on_policy_batch(model, version=1), trainer_version=3)
    assert not m.updated and m.dropped_stale == 6 and m.staleness == {2: 6}
    assert all(torch.equal(before[k], v) for k, v in trainer.policy_state_dict().items())


def test_state_parts_round_trip_gives_identical_next_step():
    cfg = TrainerSection(lr=5e-3, weight_decay=0.01)
    a = Trainer(build_model(HF, seed=0), cfg, group_size=3)
    a.step(on_policy_batch(a.model), trainer_version=0)
    parts = a.state_parts()
    assert any(k.endswith("/exp_avg_sq") for k in parts["optim"]) and any(
        k.endswith("/step") for k in parts["optim"]
    )
    # Through safetensors bytes, as a checkpoint would travel.
    restored = {name: bytes_to_state_dict(state_dict_to_bytes(p)) for name, p in parts.items()}
    b = Trainer(build_model(HF, seed=1), cfg, group_size=3)
    b.load_state_parts(restored)
    batch = on_policy_batch(a.model, version=1)
    ma, mb = a.step(batch, trainer_version=1), b.step(batch, trainer_version=1)
    assert ma.loss == mb.loss and ma.grad_norm == mb.grad_norm
    sa, sb = a.policy_state_dict(), b.policy_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
