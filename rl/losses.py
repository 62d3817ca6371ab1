"""Loss options as pure functions: advantage baselines, ratio levels (token, sequence/GSPO, CISPO), loss
aggregations (token, sequence, Dr. GRPO's constant), a k3 KL penalty to a frozen reference, truncation masks.

Each is checked against TRL's GRPOTrainer / RLOOTrainer on the same tensors (tests/test_losses.py). Where the
conventions differ (the std's degrees of freedom and epsilon, CISPO's cap), the docstring says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Baseline = Literal["group", "batch", "none", "rloo"]
Aggregation = Literal["token", "sequence", "constant"]
RatioLevel = Literal["token", "sequence", "cispo"]


def advantages(rewards: torch.Tensor, group_ids: list[str], baseline: Baseline = "group", *,
               unbiased: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """Per-sample advantages from rewards [N] and their group ids. With m_g, s_g the group's mean and std and
    s_B the std over the batch:

    group: (r - m_g) / (s_g + eps)      (GRPO; TRL scale_rewards="group")
    batch: (r - m_g) / (s_B + eps)      (TRL scale_rewards="batch")
    none:  r - m_g                      (Dr. GRPO; TRL scale_rewards="none")
    rloo:  r - (sum_g - r) / (n_g - 1) = n_g / (n_g - 1) * (r - m_g), the leave-one-out mean (RLOO; TRL
           RLOOTrainer with normalize_advantages=False); 0 for a group of one.

    The std is the population std (unbiased=False, eps 1e-6) as this project always had; TRL uses Bessel's
    correction and eps 1e-4 (unbiased=True, eps=1e-4 reproduces it).
    """
    r = rewards.to(torch.float64)
    out = torch.zeros_like(r)
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    batch_std = r.std(unbiased=unbiased) if r.numel() > 1 else r.new_zeros(())
    for idx in groups.values():
        x = r[idx]
        n = len(idx)
        centred = x - x.mean()
        if baseline == "group":
            std = x.std(unbiased=unbiased) if n > 1 else x.new_zeros(())
            out[idx] = centred / (std + eps)
        elif baseline == "batch":
            out[idx] = centred / (batch_std + eps)
        elif baseline == "none":
            out[idx] = centred
        elif baseline == "rloo":
            out[idx] = centred * n / (n - 1) if n > 1 else torch.zeros_like(x)
        else:
            raise ValueError(f"advantage baseline {baseline!r} is not one of group, batch, none, rloo")
    return out.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def truncated_mask(mask: torch.Tensor, finish_reasons: list[str]) -> torch.Tensor:
    """mask [B, T] with the rows of truncated samples (finish_reason "length": no end-of-sequence token)
    zeroed: they stay in the batch (and in its row count) but contribute no loss, as TRL's
    mask_truncated_completions does."""
    keep = torch.tensor([f != "length" for f in finish_reasons], dtype=mask.dtype, device=mask.device)
    return mask * keep[:, None]


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref) on tokens sampled from pi_theta (Schulman,
    "Approximating KL divergence"): exp(ref - logp) - (ref - logp) - 1 >= 0; differentiable in logp."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


@dataclass
class PolicyLoss:
    loss: torch.Tensor
    clip_fraction: float  # share of response tokens whose clip (or CISPO cap) was active
    weight: float  # what the loss is a mean over: tokens (token) or rows (sequence, constant)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                eps_low: float, eps_high: float, ratio_level: RatioLevel = "token",
                aggregation: Aggregation = "token", constant_tokens: int = 0,
                weight: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None, beta: float = 0.0,
                kl_ratio: bool = True) -> PolicyLoss:
    """The policy-gradient loss over [B, T] log-probs (logp carries the gradient; old_logp is pi_old, no
    gradient), advantages [B], mask [B, T] (1 on response tokens), weight [B, T] an optional per-token
    off-policy weight (rl/grpo.py's tis/decoupled). With clip(x) = clamp(x, 1 - eps_low, 1 + eps_high):

    ratio_level token: r_t = pi_theta / pi_old per token, l_t = -min(r_t A, clip(r_t) A).
    ratio_level sequence (GSPO): s = exp(mean_t log r_t) over the row's response tokens, the same for each of
      its tokens: l_t = -min(s A, clip(s) A).
    ratio_level cispo (MiniMax-M1): l_t = -sg(min(r_t, 1 + eps_high)) A log pi_theta, the capped ratio held
      constant (no gradient) so every token keeps a gradient. TRL caps at epsilon_high itself: its
      epsilon_high is 1 + eps_high here.
    KL penalty: with beta > 0, l_t += beta * c * k3(pi_theta, pi_ref) per token (`k3_kl`); c is the ratio
      (r_t, or s at sequence level) with kl_ratio, which makes the gradient the unbiased reverse-KL gradient
      off-policy too (DeepSeek-V3.2; TRL's use_bias_correction_kl, on by default), else 1.

    Aggregation of l over the mask M: token: sum l M / sum M (DAPO; TRL "dapo"/"bnpo"); sequence:
    mean_i (sum_t l M / sum_t M) (TRL "grpo"); constant: sum l M / (B * constant_tokens) (Dr. GRPO; TRL
    "dr_grpo" with max_completion_length = constant_tokens).
    """
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)[:, None]
    log_ratio = logp - old_logp
    if ratio_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    ratio = torch.exp(log_ratio)
    if ratio_level == "cispo":
        capped = ratio.clamp(max=1.0 + eps_high).detach()
        per_token = -capped * adv * logp
        was_clipped = (ratio > 1.0 + eps_high) & (adv > 0)
    elif ratio_level in ("token", "sequence"):
        unclipped = ratio * adv
        clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
        per_token = -torch.minimum(unclipped, clipped)
        was_clipped = clipped < unclipped
    else:
        raise ValueError(f"ratio level {ratio_level!r} is not one of token, sequence, cispo")
    if weight is not None:
        per_token = per_token * weight
    if beta > 0:
        if ref_logp is None:
            raise ValueError(f"beta={beta} needs the reference policy's log-probs (ref_logp)")
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + beta * (kl * ratio if kl_ratio else kl)
    per_token = per_token.expand_as(mask)
    tokens = float(mask.sum())
    rows = logp.shape[0]
    if aggregation == "token":
        loss, w = (per_token * mask).sum() / max(tokens, 1.0), tokens
    elif aggregation == "sequence":
        loss, w = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean(), float(rows)
    elif aggregation == "constant":
        if constant_tokens < 1:
            raise ValueError(f"aggregation 'constant' needs constant_tokens >= 1, got {constant_tokens}")
        loss, w = (per_token * mask).sum() / (rows * constant_tokens), float(rows)
    else:
        raise ValueError(f"aggregation {aggregation!r} is not one of token, sequence, constant")
    clip_fraction = float((was_clipped.expand_as(mask) & (mask > 0)).sum()) / max(tokens, 1.0)
    return PolicyLoss(loss=loss, clip_fraction=clip_fraction, weight=w)
