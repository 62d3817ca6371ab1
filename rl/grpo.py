"""GRPO with clip-higher: the pure pieces (advantages, staleness filter, token-level loss).

Group-normalised advantages, ratio clipped to [1 - eps_low, 1 + eps_high], token-level loss aggregation
(sum over every response token of the batch / number of those tokens), three off-policy corrections
(`trainer.off_policy`: ppo, tis, decoupled) and what they see of the behaviour/trainer gap (importance
weights, KL), staleness = trainer version - sample version. See docs/architecture/engines.md.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import torch

from laminar.records import Trajectory

ADV_EPS = 1e-6


def group_advantages(rewards: list[float], group_ids: list[str]) -> torch.Tensor:
    """(reward - group mean) / (group std + 1e-6), per group_id; std is the population std (ddof 0)."""
    r = torch.tensor(rewards, dtype=torch.float64)
    out = torch.zeros_like(r)
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    for idx in groups.values():
        x = r[idx]
        out[idx] = (x - x.mean()) / (x.std(unbiased=False) + ADV_EPS)
    return out.float()


def split_stale(
    trajectories: list[Trajectory], trainer_version: int, max_staleness: int
) -> tuple[list[Trajectory], dict[int, int], int]:
    """-> (kept, staleness histogram of the kept samples {staleness: count}, dropped count).

    max_staleness < 0 keeps everything; otherwise samples with staleness > max_staleness are dropped (and only
    counted), so the histogram is the staleness of what is trained on.
    """
    staleness = [trainer_version - t.policy_version for t in trajectories]
    keep = [max_staleness < 0 or s <= max_staleness for s in staleness]
    hist = dict(sorted(Counter(s for s, k in zip(staleness, keep, strict=True) if k).items()))
    kept = [t for t, k in zip(trajectories, keep, strict=True) if k]
    return kept, hist, len(trajectories) - len(kept)


def lr_factor(step: int, decay_steps: int, min_ratio: float) -> float:
    """The learning rate at trainer step `step`, as a fraction of trainer.lr: cosine decay from 1 at step 0 to
    min_ratio at step decay_steps, then held there; decay_steps 0: constant 1. A function of the step alone, so
    a trainer restored from a checkpoint continues the schedule where the run was."""
    if decay_steps <= 0:
        return 1.0
    x = min(max(step, 0), decay_steps) / decay_steps
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * x))


OffPolicy = Literal["ppo", "tis", "decoupled"]


@dataclass
class LossParts:
    loss: torch.Tensor
    clip_fraction: float
    tokens: int


def clipped_token_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    proximal_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    off_policy: OffPolicy = "ppo",
    tis_cap: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> LossParts:
    """PPO-clip loss with clip-higher, aggregated over tokens (sum over response tokens / their count).

    logp: [B, T] log pi_theta, the policy being updated (carries the gradient); behaviour_logp: [B, T] log
    pi_behaviour, recorded by the engine that sampled; proximal_logp: [B, T] log pi_prox, the trainer's
    weights at the start of the step (no gradient); mask: [B, T], 1 on response tokens; advantages: [B].
    Per token, with w = pi_prox / pi_behaviour and clip(r) = clamp(r, 1 - eps_low, 1 + eps_high):

    ppo: PPO with the behaviour policy as pi_old: -min(r A, clip(r) A), r = pi_theta / pi_behaviour.
    tis: truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
      off-policy RL training"; verl's tis_imp_ratio_cap): PPO against the trainer's own pi_old = pi_prox,
      reweighted by the truncated weight: -min(w, tis_cap) * min(r A, clip(r) A), r = pi_theta / pi_prox.
    decoupled: decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization"; AReaL's
      use_decoupled_loss): -w * min(r A, clip(r) A), r = pi_theta / pi_prox. With tis_cap > 0 a token whose
      w exceeds tis_cap is dropped (weight 0, still counted in the token mean), as AReaL's
      behav_imp_weight_cap does; tis_cap 0 keeps the paper's uncapped w.

    For tis and decoupled the clip bounds the move away from pi_prox, so it can only bite once pi_theta has
    left pi_prox: from the second minibatch of a step on (trainer.minibatches > 1).

    Entropy bonus: with entropy_coef > 0, entropy [B, T] (H(pi_theta) per position, carrying the gradient;
    `token_entropy`) is rewarded per response token, -entropy_coef * H, unweighted, in the same token mean:
    it keeps the policy from collapsing to one answer per prompt, where a group's samples agree, its advantages
    are 0 and nothing corrects the policy any more (docs/decisions/reward-collapse.md, 2026-12-02).
    """
    mask = mask.float()
    adv = advantages[:, None].expand_as(logp)
    if off_policy == "ppo":
        ratio = torch.exp(logp - behaviour_logp)
        weight = torch.ones_like(logp)
    else:
        ratio = torch.exp(logp - proximal_logp)
        w = torch.exp(proximal_logp - behaviour_logp)
        if off_policy == "tis":
            weight = w.clamp(max=tis_cap)
        elif tis_cap > 0:
            weight = torch.where(w <= tis_cap, w, torch.zeros_like(w))
        else:
            weight = w
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -weight * torch.minimum(unclipped, clipped)
    if entropy_coef > 0:
        if entropy is None:
            raise ValueError(f"entropy_coef={entropy_coef} needs the per-token entropy (token_entropy of the logits)")
        per_token = per_token - entropy_coef * entropy
    tokens = int(mask.sum().item())
    loss = (per_token * mask).sum() / max(tokens, 1)
    was_clipped = (clipped < unclipped) & (mask > 0)
    clip_fraction = float(was_clipped.sum().item()) / max(tokens, 1)
    return LossParts(loss=loss, clip_fraction=clip_fraction, tokens=tokens)


def token_entropy(logp_all: torch.Tensor) -> torch.Tensor:
    """[B, T, V] log-probabilities -> [B, T] entropy -sum_v p log p (differentiable; nats)."""
    return -(logp_all.exp() * logp_all).sum(-1)


@dataclass
class BehaviourDrift:
    """How far the behaviour policy is from the trainer's, over the response tokens of a batch."""

    weight_mean: float  # mean of w = pi_prox / pi_behaviour (before any cap)
    weight_max: float
    capped_fraction: float  # share of tokens with w > tis_cap (truncated by tis, dropped by decoupled)
    kl: float  # KL(pi_behaviour || pi_prox) per token, k3 estimator


def behaviour_drift(
    proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, tis_cap: float = 0.0
) -> BehaviourDrift:
    """Importance weights w = pi_prox / pi_behaviour and the KL between the two policies.

    The tokens were sampled from pi_behaviour, so with log w = log pi_prox - log pi_behaviour the k3 estimator
    (Schulman, "Approximating KL divergence") (w - 1) - log w is an unbiased, never negative, per-token
    estimate of KL(pi_behaviour || pi_prox); the mean over response tokens is reported. tis_cap 0: nothing
    is capped. Empty mask: all zeros.
    """
    sel = mask > 0
    if not bool(sel.any()):
        return BehaviourDrift(0.0, 0.0, 0.0, 0.0)
    log_w = (proximal_logp - behaviour_logp)[sel].double()
    w = log_w.exp()
    capped = float((w > tis_cap).double().mean()) if tis_cap > 0 else 0.0
    return BehaviourDrift(
        weight_mean=float(w.mean()),
        weight_max=float(w.max()),
        capped_fraction=capped,
        kl=float((w - 1 - log_w).mean()),
    )
