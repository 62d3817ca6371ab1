"""GRPO with clip-higher: the pure pieces (advantages, staleness filter, token-level loss).

DESIGN.md §7: group-normalised advantages, ratio clipped to [1 - eps_low, 1 + eps_high], token-level
loss aggregation (sum over every response token of the batch / number of those tokens), optional
truncated importance sampling, staleness = trainer version - sample version.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

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
    """-> (kept, staleness histogram over all samples {staleness: count}, dropped count).

    max_staleness < 0 keeps everything; otherwise samples with staleness > max_staleness are dropped.
    """
    staleness = [trainer_version - t.policy_version for t in trajectories]
    hist = dict(sorted(Counter(staleness).items()))
    if max_staleness < 0:
        return list(trajectories), hist, 0
    kept = [t for t, s in zip(trajectories, staleness, strict=True) if s <= max_staleness]
    return kept, hist, len(trajectories) - len(kept)


@dataclass
class LossParts:
    loss: torch.Tensor
    clip_fraction: float
    tokens: int


def clipped_token_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    tis_cap: float = 0.0,
) -> LossParts:
    """PPO-clip loss with clip-higher, aggregated over tokens.

    logp, behaviour_logp, mask: [B, T] (mask 1 on response tokens); advantages: [B] (per sample).

    tis_cap == 0: pi_old is the behaviour policy, ratio = exp(logp - behaviour_logp).
    tis_cap > 0 (decoupled PPO / truncated IS): pi_old is the current policy before this update
    (logp detached), so ratio = exp(logp - logp.detach()), and each token is weighted by
    min(pi_old / pi_behaviour, tis_cap), correcting for the behaviour/trainer mismatch with bounded
    variance.
    """
    mask = mask.float()
    adv = advantages[:, None].expand_as(logp)
    if tis_cap > 0:
        ratio = torch.exp(logp - logp.detach())
        weight = torch.exp(logp.detach() - behaviour_logp).clamp(max=tis_cap)
    else:
        ratio = torch.exp(logp - behaviour_logp)
        weight = torch.ones_like(logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -weight * torch.minimum(unclipped, clipped)
    tokens = int(mask.sum().item())
    loss = (per_token * mask).sum() / max(tokens, 1)
    was_clipped = (clipped < unclipped) & (mask > 0)
    clip_fraction = float(was_clipped.sum().item()) / max(tokens, 1)
    return LossParts(loss=loss, clip_fraction=clip_fraction, tokens=tokens)
