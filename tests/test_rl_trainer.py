"""GRPO pieces worked by hand (advantages, the three off-policy losses, importance weights and KL), and the
Trainer on a real tiny model (staleness, minibatches, off-policy metrics, checkpoint parts)."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from laminar.config import RunConfig, TrainerSection
from laminar.errors import ConfigError
from laminar.records import Trajectory
from laminar.rl.grpo import (
    behaviour_drift,
    clipped_token_loss,
    group_advantages,
    lr_factor,
    split_stale,
    token_entropy,
)
from laminar.rl.model import build_model, bytes_to_state_dict, model_state_dict, state_dict_to_bytes
from laminar.rl.trainer import Trainer, micro_batch_rows

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
    A fifth, masked-out token must change nothing. ppo takes the ratio against the behaviour policy, so the
    proximal log-probs (here far off, -5) must change nothing either."""
    behaviour = torch.zeros(4, 2)
    logp = torch.tensor(
        [[math.log(1.5), 9.0], [math.log(0.5), 9.0], [math.log(0.5), 9.0], [math.log(1.5), 9.0]]
    )
    logp.requires_grad_(True)
    mask = torch.tensor([[1, 0], [1, 0], [1, 0], [1, 0]])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    parts = clipped_token_loss(logp, behaviour, torch.full((4, 2), -5.0), adv, mask, eps_low=0.2, eps_high=0.28)
    assert parts.loss.item() == pytest.approx(0.13, abs=1e-6)
    assert parts.clip_fraction == pytest.approx(0.5) and parts.tokens == 4
    parts.loss.backward()
    # d(-ratio * A)/dlogp = -ratio * A, divided by 4 tokens
    assert logp.grad[:, 0].tolist() == pytest.approx([0.0, -0.5 / 4, 0.0, 1.5 / 4], abs=1e-6)
    assert logp.grad[:, 1].tolist() == [0.0] * 4


def test_token_entropy_hand_worked() -> None:
    # uniform over 4 tokens: log 4 = 1.3863; one-hot (p = 1, the rest ~0): 0; [0.5, 0.5, 0, 0]: log 2 = 0.6931
    probs = torch.tensor([[[0.25] * 4, [1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]])
    h = token_entropy(torch.log(probs.clamp(min=1e-30)))
    assert h.tolist()[0] == pytest.approx([math.log(4), 0.0, math.log(2)], abs=1e-6)


def test_entropy_bonus_hand_worked() -> None:
    """The clipped-loss tokens of test_clipped_loss_hand_worked (loss 0.13 over 4 tokens) with an entropy bonus
    of coefficient 0.1 and per-token entropies [1, 2, 3, 4] (a masked-out fifth token of entropy 100 does not
    count): loss 0.13 - 0.1 * (1 + 2 + 3 + 4) / 4 = 0.13 - 0.25 = -0.12, and d loss / d H = -0.1 / 4 per token."""
    behaviour = torch.zeros(4, 2)
    logp = torch.tensor([[math.log(1.5), 9.0], [math.log(0.5), 9.0], [math.log(0.5), 9.0], [math.log(1.5), 9.0]])
    mask = torch.tensor([[1, 0], [1, 0], [1, 0], [1, 0]])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    entropy = torch.tensor([[1.0, 100.0], [2.0, 100.0], [3.0, 100.0], [4.0, 100.0]], requires_grad=True)
    kw = dict(eps_low=0.2, eps_high=0.28)
    parts = clipped_token_loss(logp, behaviour, behaviour, adv, mask, **kw, entropy=entropy, entropy_coef=0.1)
    assert parts.loss.item() == pytest.approx(-0.12, abs=1e-6) and parts.tokens == 4
    parts.loss.backward()
    assert entropy.grad.tolist() == [pytest.approx([-0.025, 0.0])] * 4
    # coefficient 0 (the default): the entropy is not looked at; a coefficient without entropies is an error
    assert clipped_token_loss(logp, behaviour, behaviour, adv, mask, **kw, entropy=entropy).loss.item() == \
        pytest.approx(0.13, abs=1e-6)
    with pytest.raises(ValueError, match="entropy_coef=0.1 needs the per-token entropy"):
        clipped_token_loss(logp, behaviour, behaviour, adv, mask, **kw, entropy_coef=0.1)


def test_entropy_bonus_moves_a_policy_with_no_signal_towards_more_entropy() -> None:
    """Every group's samples score alike: advantages are all 0, so plain GRPO has no gradient and leaves the
    weights as they are; with trainer.entropy_coef the step raises the policy's entropy on those tokens."""
    batch = [dataclasses.replace(t, reward=0.5) for t in on_policy_batch(build_model(HF, seed=0))]
    plain = build_model(HF, seed=0)
    before = {k: v.clone() for k, v in model_state_dict(plain).items()}
    m0 = Trainer(plain, TrainerSection(lr=1e-2), group_size=3).step(batch, trainer_version=0)
    assert m0.grad_norm == 0.0 and all(torch.equal(before[k], v) for k, v in model_state_dict(plain).items())
    model = build_model(HF, seed=0)
    trainer = Trainer(model, TrainerSection(lr=1e-2, entropy_coef=0.1), group_size=3)
    m1 = trainer.step(batch, trainer_version=0)
    m2 = trainer.step(batch, trainer_version=1)
    assert m1.grad_norm > 0 and m1.entropy == pytest.approx(m0.entropy) and m2.entropy > m1.entropy


def test_lr_factor_hand_worked() -> None:
    # cosine from 1 to 0.1 over 100 steps: 0.1 + 0.9 * (1 + cos(pi * x)) / 2 -> x = 0.5: 0.55, x = 0.25: 0.1 + 0.9 * 0.8536 = 0.8682
    assert [lr_factor(s, 100, 0.1) for s in (0, 25, 50, 100, 5000)] == pytest.approx([1.0, 0.8682, 0.55, 0.1, 0.1],
                                                                                  abs=1e-4)
    assert lr_factor(7, 0, 0.1) == 1.0  # no decay: constant


def test_trainer_takes_the_learning_rate_of_the_step_it_trains_from() -> None:
    """The schedule is a function of trainer_version only: a restored trainer (or a redone step) gets the same lr."""
    model = build_model(HF, seed=0)
    trainer = Trainer(model, TrainerSection(lr=1e-2, lr_decay_steps=100, lr_min_ratio=0.1), group_size=3)
    trainer.step(on_policy_batch(model, version=50), trainer_version=50)
    assert trainer.optim.param_groups[0]["lr"] == pytest.approx(0.0055)
    trainer.step(on_policy_batch(model, version=400), trainer_version=400)
    assert trainer.optim.param_groups[0]["lr"] == pytest.approx(0.001)


# Four tokens as a later minibatch sees them: the trainer's weights have moved from pi_prox (ratio
# r = pi_theta / pi_prox) and the samples are off-policy (w = pi_prox / pi_behaviour). Clip range [0.8, 1.28].
# token  w           r    A   min(r A, clip(r) A)
#   1    e   = 2.718 1.5  +1  min(1.5, 1.28)  =  1.28 (clipped: no gradient)
#   2    1/e = 0.368 0.5  +1  min(0.5, 0.8)   =  0.5
#   3    1.5         0.5  -1  min(-0.5, -0.8) = -0.8  (clipped: no gradient)
#   4    1           1.5  -1  min(-1.5, -1.28) = -1.5
W = [math.e, math.exp(-1), 1.5, 1.0]
R = [1.5, 0.5, 0.5, 1.5]
ADV = [1.0, 1.0, -1.0, -1.0]
E = math.e


@pytest.mark.parametrize(("off_policy", "cap", "loss", "grad"), [
    # ppo: ratio against the behaviour policy, r * w = [4.077, 0.184, 0.75, 1.5]:
    #   min terms [1.28 (clip), 0.184, -0.8 (clip), -1.5]; loss -(1.28 + 0.184 - 0.8 - 1.5) / 4 = 0.2090;
    #   gradient -(r w) A / 4 on the unclipped tokens 2 and 4: [0, -0.184 / 4, 0, 1.5 / 4]
    ("ppo", 0.0, -(1.28 + 0.5 / E - 0.8 - 1.5) / 4, [0.0, -0.5 / E / 4, 0.0, 1.5 / 4]),
    # tis (Yao et al.): weight min(w, 2) = [2, 0.368, 1.5, 1]
    #   loss -(2 * 1.28 + 0.368 * 0.5 + 1.5 * -0.8 + 1 * -1.5) / 4 = -(2.56 + 0.184 - 1.2 - 1.5) / 4 = -0.01098;
    #   gradient -weight r A / 4 on tokens 2 and 4: [0, -0.368 * 0.5 / 4, 0, 1.5 / 4]
    ("tis", 2.0, -(2 * 1.28 + 0.5 / E - 1.2 - 1.5) / 4, [0.0, -0.5 / E / 4, 0.0, 1.5 / 4]),
    # decoupled (Hilton et al.; AReaL's cap): weight w, token 1 (w = 2.718 > 2) dropped: [0, 0.368, 1.5, 1]
    #   loss -(0 + 0.184 - 1.2 - 1.5) / 4 = +0.6290; same gradient as tis (token 1 is clipped anyway)
    ("decoupled", 2.0, -(0.5 / E - 1.2 - 1.5) / 4, [0.0, -0.5 / E / 4, 0.0, 1.5 / 4]),
    # decoupled without a cap: weight w = [2.718, 0.368, 1.5, 1]
    #   loss -(2.718 * 1.28 + 0.184 - 1.2 - 1.5) / 4 = -(3.479 + 0.184 - 2.7) / 4 = -0.2408
    ("decoupled", 0.0, -(E * 1.28 + 0.5 / E - 1.2 - 1.5) / 4, [0.0, -0.5 / E / 4, 0.0, 1.5 / 4]),
])
def test_off_policy_losses_hand_worked(off_policy: str, cap: float, loss: float, grad: list[float]) -> None:
    behaviour = torch.zeros(4, 1)
    proximal = torch.tensor([[math.log(w)] for w in W])  # w = exp(proximal - behaviour)
    logp = (proximal + torch.tensor([[math.log(r)] for r in R])).requires_grad_(True)  # r = exp(logp - proximal)
    parts = clipped_token_loss(logp, behaviour, proximal, torch.tensor(ADV), torch.ones(4, 1), eps_low=0.2,
                               eps_high=0.28, off_policy=off_policy, tis_cap=cap)  # type: ignore[arg-type]
    assert parts.loss.item() == pytest.approx(loss, abs=1e-6)
    assert parts.clip_fraction == 0.5 and parts.tokens == 4  # tokens 1 and 3, in all four cases
    parts.loss.backward()
    assert logp.grad[:, 0].tolist() == pytest.approx(grad, abs=1e-6)


def test_with_theta_at_the_proximal_policy_tis_is_truncated_is_policy_gradient() -> None:
    # The first (or only) minibatch: pi_theta == pi_prox, r = 1 inside the clip range, so the loss is
    # -sum(min(w, cap) * A) / tokens and nothing clips. w = [e, 1/e], A = [1, 1], cap 2:
    # loss -(2 + 0.368) / 2 = -1.1839; gradient -min(w, 2) A / 2 = [-1, -0.184].
    logp = torch.tensor([[0.0], [0.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.0], [1.0]])
    parts = clipped_token_loss(logp, behaviour, logp.detach().clone(), torch.tensor([1.0, 1.0]), torch.ones(2, 1),
                               eps_low=0.2, eps_high=0.28, off_policy="tis", tis_cap=2.0)
    assert parts.loss.item() == pytest.approx(-(2.0 + math.exp(-1)) / 2, abs=1e-6)
    assert parts.clip_fraction == 0.0
    parts.loss.backward()
    assert logp.grad[:, 0].tolist() == pytest.approx([-1.0, -math.exp(-1) / 2], abs=1e-6)


def test_behaviour_drift_hand_worked() -> None:
    # the four tokens above, w = [e, 1/e, 1.5, 1], plus a masked-out token with w = e^5 that must not count
    # mean w = (2.7183 + 0.3679 + 1.5 + 1) / 4 = 1.3965; max w = e
    # k3 = (w - 1) - log w: [1.7183 - 1, -0.6321 + 1, 0.5 - 0.4055, 0] = [0.7183, 0.3679, 0.0945, 0]
    #   -> KL mean (0.7183 + 0.3679 + 0.0945 + 0) / 4 = 0.2952
    # tis_cap 2: one of four tokens above it -> 0.25
    proximal = torch.tensor([[1.0, -1.0, math.log(1.5), 0.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    d = behaviour_drift(proximal, torch.zeros(1, 5), mask, tis_cap=2.0)
    assert d.weight_mean == pytest.approx((E + 1 / E + 2.5) / 4)
    assert d.weight_max == pytest.approx(E)
    assert d.kl == pytest.approx((E - 2 + 1 / E + 0.5 - math.log(1.5)) / 4)
    assert d.capped_fraction == 0.25
    assert behaviour_drift(proximal, torch.zeros(1, 5), mask).capped_fraction == 0.0  # no cap
    assert behaviour_drift(proximal, torch.zeros(1, 5), torch.zeros(1, 5)).weight_max == 0.0  # nothing to measure


def test_k3_over_the_behaviour_distribution_is_the_exact_kl() -> None:
    # q = pi_behaviour = [0.5, 0.3, 0.2], p = pi_prox = [0.2, 0.5, 0.3]. Ten tokens drawn in exact proportion to
    # q (5, 3, 2): the mean of k3 is sum_x q(x) ((p/q - 1) - log p/q) = (1 - 1) + KL(q || p)
    # = 0.5 ln 2.5 + 0.3 ln 0.6 + 0.2 ln(2/3) = 0.4581 - 0.1532 - 0.0811 = 0.2238.
    q, p = [0.5, 0.3, 0.2], [0.2, 0.5, 0.3]
    tokens = [0] * 5 + [1] * 3 + [2] * 2
    behaviour = torch.tensor([[math.log(q[x]) for x in tokens]])
    proximal = torch.tensor([[math.log(p[x]) for x in tokens]])
    kl = sum(qi * math.log(qi / pi) for qi, pi in zip(q, p, strict=True))
    assert kl == pytest.approx(0.2238, abs=1e-4)
    assert behaviour_drift(proximal, behaviour, torch.ones(1, 10)).kl == pytest.approx(kl, abs=1e-6)


@pytest.mark.parametrize(("overrides", "error"), [
    (["trainer.tis_cap=2"], "trainer.tis_cap=2.0 has no effect with trainer.off_policy='ppo'"),
    (["trainer.off_policy=tis"], "trainer.tis_cap=0.0 with trainer.off_policy='tis' must be >= 1"),
    (["trainer.off_policy=decoupled", "trainer.tis_cap=0.5"], "must be 0 (no cap) or >= 1"),
    (["trainer.off_policy=gspo"], "trainer.off_policy=gspo: Input should be"),
    (["trainer.minibatches=0"], "trainer.minibatches=0"),
])
def test_off_policy_config_is_unambiguous(overrides: list[str], error: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(error)):
        RunConfig.load(None, overrides)


def test_off_policy_config_defaults_to_plain_ppo() -> None:
    t = RunConfig.load(None, []).trainer
    assert (t.off_policy, t.tis_cap, t.minibatches) == ("ppo", 0.0, 1)
    t = RunConfig.load(None, ["trainer.off_policy=decoupled", "trainer.minibatches=4"]).trainer
    assert (t.off_policy, t.tis_cap, t.minibatches) == ("decoupled", 0.0, 4)


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
    # the version-2 sample (staleness 3) is dropped: the histogram is of what is trained on
    assert hist == {0: 2, 1: 1} and dropped == 1 and [t.policy_version for t in kept] == [5, 5, 4]


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


class FullWidthTrainer(Trainer):
    """The step as it was before the log-softmax started at the shortest prompt's last position: every position."""

    @staticmethod
    def _first_position(trajectories: list[Trajectory]) -> int:
        return 0


@pytest.mark.parametrize("minibatches", [1, 2])
def test_leaving_out_prompt_positions_changes_nothing_in_the_step(minibatches: int) -> None:
    """Positions before the shortest prompt's last token predict only prompt tokens: the step's update and figures
    are those of the full-width log-softmax (prompts of 3 and 2 tokens here, so one position is left out)."""
    cfg = TrainerSection(lr=1e-2, minibatches=minibatches)
    model, reference = build_model(HF, seed=0), build_model(HF, seed=0)
    batch = on_policy_batch(model)
    assert Trainer._first_position(batch) == 1
    m = Trainer(model, cfg, group_size=3).step(batch, trainer_version=0)
    r = FullWidthTrainer(reference, cfg, group_size=3).step(batch, trainer_version=0)
    for field in ("loss", "grad_norm", "entropy", "clip_fraction", "kl_behaviour", "is_weight_mean"):
        assert getattr(m, field) == pytest.approx(getattr(r, field), rel=1e-5, abs=1e-7), field
    got, want = model_state_dict(model), model_state_dict(reference)
    assert max(float((got[k] - want[k]).abs().max()) for k in got) <= 1e-6


@pytest.mark.parametrize("minibatches,micro", [(1, 4), (2, 2), (1, "budget")])
def test_micro_batches_give_the_same_update_as_the_whole_minibatch(minibatches: int, micro: int | str) -> None:
    """trainer.micro_batch_samples bounds memory, not the algorithm: the gradients of a minibatch's micro-batches add
    up to its one update. Two steps (AdamW state and the proximal reuse included), a stale batch with every
    off-policy term active, an entropy bonus; 6 samples in parts of 4 and 2, and two minibatches of 3 in parts of 2 and 1."""
    base = dict(lr=0.1, minibatches=minibatches, off_policy="tis", tis_cap=2.0, entropy_coef=0.01)
    model, stale = stale_setup()
    reference = build_model(HF, seed=0)
    reference.load_state_dict(model.state_dict())
    whole = Trainer(reference, TrainerSection(**base, memory_budget_mb=1e6), group_size=3)
    # "budget": trainer.memory_budget_mb sizes them, here to one row each (a row of the tiny model is ~0.02 MiB)
    split = {"memory_budget_mb": 0.03} if micro == "budget" else {"micro_batch_samples": micro}
    if micro == "budget":
        assert micro_batch_rows(model, 7, 5, 0.03) == 1 and micro_batch_rows(model, 7, 5, 1e6) >= 6
    parts = Trainer(model, TrainerSection(**base, **split), group_size=3)
    for version in (1, 2):
        r, m = whole.step(stale, trainer_version=version), parts.step(stale, trainer_version=version)
        for field in ("loss", "grad_norm", "entropy", "clip_fraction", "kl_behaviour", "is_weight_mean", "tokens"):
            assert getattr(m, field) == pytest.approx(getattr(r, field), rel=1e-4, abs=1e-6), (field, version)
        assert r.updated and r.grad_norm > 0 and r.kl_behaviour > 0  # a real, off-policy update
    # float32 sums in another order, then AdamW at lr 0.1: 1.1e-5 at most measured; a wrong weighting of the
    # micro-batches moves weights by the order of the learning rate
    got, want = model_state_dict(model), model_state_dict(reference)
    assert max(float((got[k] - want[k]).abs().max()) for k in got) <= 1e-4


def test_micro_batches_are_refused_with_fsdp_by_name() -> None:
    from laminar.rl.factory import check_engines

    with pytest.raises(ConfigError, match=re.escape("trainer.micro_batch_samples=4 with trainer.backend='fsdp' is "
                                                    "not implemented")):
        check_engines(RunConfig.load(None, ["--trainer.micro_batch_samples=4", "--trainer.backend=fsdp"]))
    with pytest.raises(ConfigError, match=re.escape("trainer.micro_batch_samples=0: Input should be greater than or "
                                                    "equal to 1")):
        RunConfig.load(None, ["--trainer.micro_batch_samples=0"])


def test_trainer_drops_stale_samples_and_skips_empty_updates():
    model = build_model(HF, seed=0)
    trainer = Trainer(model, TrainerSection(max_staleness=0), group_size=3)
    before = {k: v.clone() for k, v in trainer.policy_state_dict().items()}
    m = trainer.step(on_policy_batch(model, version=1), trainer_version=3)
    # all 6 samples have staleness 3 - 1 = 2 > 0: dropped, so the histogram of what was trained on is empty
    assert not m.updated and m.dropped_stale == 6 and m.staleness == {}
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


def stale_setup() -> tuple[torch.nn.Module, list[Trajectory]]:
    """A model one version ahead of its samples: the batch is sampled (log-probs recorded) at version 0, then
    the model takes one step at lr 0.1 on another copy of it, so the batch is off-policy by one version."""
    model = build_model(HF, seed=0)
    stale = on_policy_batch(model, version=0)
    Trainer(model, TrainerSection(lr=0.1), group_size=3).step(on_policy_batch(model), trainer_version=0)
    return model, stale


def test_trainer_measures_the_behaviour_gap_against_its_own_policy() -> None:
    model, stale = stale_setup()
    # independently: the model's own log-probs of the same tokens, one trajectory at a time
    now = on_policy_batch(model)
    log_w = [a - b for s, n in zip(stale, now, strict=True) for a, b in zip(n.logprobs, s.logprobs, strict=True)]
    w = [math.exp(x) for x in log_w]
    assert len(w) == 18  # 2 groups x (3 + 4 + 2) response tokens
    m = Trainer(model, TrainerSection(lr=0.1, off_policy="tis", tis_cap=2.0), group_size=3).step(stale, 1)
    assert m.is_weight_mean == pytest.approx(sum(w) / 18, rel=1e-5)
    assert m.is_weight_max == pytest.approx(max(w), rel=1e-5)
    assert m.kl_behaviour == pytest.approx(sum(x - 1 - lx for x, lx in zip(w, log_w, strict=True)) / 18, rel=1e-4)
    assert m.is_capped_fraction == sum(x > 2.0 for x in w) / 18 > 0  # this batch drifted past the cap
    # on-policy samples: w = 1 up to float rounding, KL 0
    fresh = build_model(HF, seed=0)
    m = Trainer(fresh, TrainerSection(), group_size=3).step(on_policy_batch(fresh), 0)
    assert m.is_weight_mean == pytest.approx(1.0, abs=1e-5) and m.is_weight_max == pytest.approx(1.0, abs=1e-5)
    assert m.kl_behaviour == pytest.approx(0.0, abs=1e-9) and m.is_capped_fraction == 0.0


@pytest.mark.parametrize(("off_policy", "cap", "weight"), [
    ("tis", 2.0, lambda w: min(w, 2.0)),
    ("decoupled", 2.0, lambda w: w if w <= 2.0 else 0.0),
    ("decoupled", 0.0, lambda w: w),
])
def test_one_minibatch_is_importance_weighted_policy_gradient(off_policy, cap, weight) -> None:
    """With one minibatch, pi_theta == pi_prox at the only update: r = 1, nothing clips, and the loss is
    -sum_t weight(w_t) * A_t / tokens over the stale batch, with w_t computed independently as above."""
    model, stale = stale_setup()
    now = on_policy_batch(model)
    adv = group_advantages([t.reward for t in stale], [t.group_id for t in stale]).tolist()
    expected = -sum(
        weight(math.exp(a - b)) * adv[i]
        for i, (s, n) in enumerate(zip(stale, now, strict=True))
        for a, b in zip(n.logprobs, s.logprobs, strict=True)
    ) / 18
    cfg = TrainerSection(lr=0.1, off_policy=off_policy, tis_cap=cap)
    m = Trainer(model, cfg, group_size=3).step(stale, trainer_version=1)
    assert m.loss == pytest.approx(expected, abs=1e-5)
    assert m.clip_fraction == 0.0


def test_clipping_bites_against_the_proximal_policy_from_the_second_minibatch() -> None:
    # ppo on the stale batch: the ratio against the behaviour policy starts away from 1, so the clip is
    # already active at the first update (7 of 18 tokens on this batch).
    model, stale = stale_setup()
    m = Trainer(model, TrainerSection(lr=0.1), group_size=3).step(stale, 1)
    assert m.clip_fraction > 0
    for off_policy in ("tis", "decoupled"):
        cfg = TrainerSection(lr=0.1, off_policy=off_policy, tis_cap=2.0)
        model, stale = stale_setup()
        assert Trainer(model, cfg, group_size=3).step(stale, 1).clip_fraction == 0.0  # one minibatch: r == 1
        # two minibatches (group g0, then g1): the first update moves pi_theta off pi_prox, and on g1's
        # 9 tokens the clip is active for some (4 of 18 tokens on this batch)
        model, stale = stale_setup()
        m = Trainer(model, cfg.model_copy(update={"minibatches": 2}), group_size=3).step(stale, 1)
        assert m.clip_fraction > 0, off_policy


def test_minibatches_make_one_update_each() -> None:
    model = build_model(HF, seed=0)
    trainer = Trainer(model, TrainerSection(minibatches=4), group_size=3)
    trainer.step(on_policy_batch(model), trainer_version=0)
    # 6 samples in 4 minibatches of 2, 2, 1, 1 samples: 4 AdamW updates
    assert {int(v) for k, v in trainer.state_parts()["optim"].items() if k.endswith("/step")} == {4}
    # more minibatches than samples: one update per sample
    trainer = Trainer(model, TrainerSection(minibatches=100), group_size=3)
    trainer.step(on_policy_batch(model), trainer_version=0)
    assert {int(v) for k, v in trainer.state_parts()["optim"].items() if k.endswith("/step")} == {6}


def test_bfloat16_is_refused_by_name_on_a_cpu_without_its_instructions() -> None:
    from laminar.rl.precision import check_cpu_dtype

    for field in ("trainer.dtype", "rollout.dtype"):
        with pytest.raises(ConfigError, match=re.escape(f"{field}='bfloat16' on a CPU without bfloat16 instructions")):
            check_cpu_dtype(field, "cpu", torch.bfloat16, {"avx2", "avx512f"})
        check_cpu_dtype(field, "cpu", torch.bfloat16, {"avx512_bf16"})  # either flag is enough
        check_cpu_dtype(field, "cpu", torch.bfloat16, {"amx_bf16"})
        check_cpu_dtype(field, "cpu", torch.float32, set())  # float32 needs nothing


@pytest.mark.skipif(not __import__("laminar.rl.precision", fromlist=["x"]).cpu_bf16_flags(),
                    reason="this CPU has no bfloat16 instructions (the refusal is tested above)")
def test_a_bfloat16_step_updates_the_weights_as_float32_does() -> None:
    """Autocast to bfloat16 (float32 master weights and AdamW state): the update of one step points the way
    float32's does and has its size, and a second step's figures agree (two steps: the AdamW moments differ)."""
    model, stale = stale_setup()
    reference = build_model(HF, seed=0)
    reference.load_state_dict(model.state_dict())
    before = {k: v.clone() for k, v in model_state_dict(model).items()}
    cfg = TrainerSection(lr=1e-3)
    fp32 = Trainer(reference, cfg, group_size=3)
    bf16 = Trainer(model, cfg, group_size=3, compute_dtype=torch.bfloat16)
    for version in (1, 2):
        r, m = fp32.step(stale, trainer_version=version), bf16.step(stale, trainer_version=version)
        assert m.loss == pytest.approx(r.loss, rel=0.05, abs=1e-3) and m.grad_norm == pytest.approx(r.grad_norm, rel=0.05)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    got = torch.cat([(v - before[k]).flatten() for k, v in model_state_dict(model).items()])
    want = torch.cat([(v - before[k]).flatten() for k, v in model_state_dict(reference).items()])
    cosine = float(torch.nn.functional.cosine_similarity(got, want, dim=0))
    assert cosine > 0.95 and float(got.norm() / want.norm()) == pytest.approx(1.0, rel=0.05)
