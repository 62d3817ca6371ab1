"""The GRPO trainer: one step per batch of trajectories (pure torch, no Temporal, no store).

`Trainer.step` reads as the algorithm (see docs/architecture/engines.md): drop-and-count stale samples,
group-normalised advantages, the proximal log-probs (the trainer's policy at the start of the step, one
forward pass without gradient), then one AdamW update with gradient clipping per minibatch on the clipped
token-level loss. Behaviour log-probs come from the trajectories (recorded by the engine).

Checkpoint parts are flat tensor dicts with string keys (safetensors-ready, no pickle):
`state_parts() -> {"model": {...}, "optim": {"<param name>/exp_avg": ..., "<param name>/step": ...}}`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from laminar.config import TrainerSection
from laminar.errors import ConfigError, UntrainableRowError
from laminar.records import Trajectory, untrainable
from laminar.rl.grpo import (
    LossParts,
    behaviour_drift,
    clipped_token_loss,
    lr_factor,
    split_stale,
    token_entropy,
)
from laminar.rl.losses import advantages as loss_advantages
from laminar.rl.losses import policy_loss, truncated_mask
from laminar.rl.model import CausalLM, load_model_state, model_state_dict
from laminar.rl.precision import check_cpu_dtype, cpu_bf16_flags


@dataclass
class UpdateMetrics:
    """What one trainer step did. Staleness histogram: {trainer_version - policy_version: samples}.

    loss is the token-weighted mean over the step's minibatches, grad_norm the mean (before clipping),
    clip_fraction the share of response tokens whose clip was active. The is_weight_* fields and
    kl_behaviour compare each token's behaviour policy with the trainer's policy at the start of the step
    (rl/grpo.py behaviour_drift); entropy is that policy's too.
    """

    trainer_version: int
    samples: int
    tokens: int
    reward_mean: float
    loss: float
    grad_norm: float
    clip_fraction: float
    entropy: float
    response_len_mean: float
    dropped_stale: int
    staleness: dict[int, int] = field(default_factory=dict)
    updated: bool = True
    is_weight_mean: float = 0.0
    is_weight_max: float = 0.0
    is_capped_fraction: float = 0.0
    kl_behaviour: float = 0.0


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, T]
    targets: torch.Tensor  # [B, T-1] ids[:, 1:]
    response_mask: torch.Tensor  # [B, T-1] 1 where the target is a model response token (not tool output)
    behaviour_logp: torch.Tensor  # [B, T-1] aligned with targets (0 off the response)


def collate(trajectories: list[Trajectory], pad_id: int, device: torch.device | str = "cpu") -> Batch:
    """Right-pad prompt + response; align response tokens and behaviour log-probs with next-token targets
    (built on the host, handed over on `device` in one copy per tensor)."""
    width = max(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
    b = len(trajectories)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    am = torch.zeros(b, width, dtype=torch.long)
    rmask = torch.zeros(b, width - 1)
    blogp = torch.zeros(b, width - 1)
    for i, t in enumerate(trajectories):
        if (why := untrainable(t)) is not None:
            raise UntrainableRowError(
                f"run {t.run_id}: group {t.group_id} sample {t.sample_index} (replica {t.replica_id}, policy version "
                f"{t.policy_version}) cannot be trained: {why}. A retry would refuse it again; the replica that "
                "wrote it has a bug (its rows are checked before they join a group). The run stops here: fork it "
                "from its newest checkpoint (`laminar fork`) once the replica is fixed")
        p, r = len(t.prompt_ids), len(t.response_ids)
        ids[i, : p + r] = torch.tensor(t.prompt_ids + t.response_ids)
        am[i, : p + r] = 1
        rmask[i, p - 1 : p + r - 1] = 1  # logits at position j predict token j + 1
        if t.tool_mask:  # tool-output tokens: context, not actions; out of the loss and the log-prob comparisons
            rmask[i, p - 1 : p + r - 1] = torch.tensor(t.tool_mask, dtype=rmask.dtype)
        blogp[i, p - 1 : p + r - 1] = torch.tensor(t.logprobs)
    ids, am, rmask, blogp = (x.to(device) for x in (ids, am, rmask, blogp))
    return Batch(ids, am, ids[:, 1:], rmask, blogp)


def micro_batch_rows(model: CausalLM, width: int, logit_positions: int, budget_mib: float) -> int:
    """Rows per forward and backward pass that fit budget_mib: per row, float32 saved activations of about
    8 hidden + 4 intermediate values per token and layer, and about 6 vocabulary-wide tensors per logit position
    (logits, log-softmax, entropy and their gradients). At least one row."""
    c = getattr(model.config, "raw", None) or model.config  # the transformers path keeps its config as a dict
    get = c.get if isinstance(c, dict) else lambda k, d=0: getattr(c, k, d)
    layers, hidden = get("num_hidden_layers", 0), get("hidden_size", 0)
    per_token = layers * (8 * hidden + 4 * (get("intermediate_size", 0) or 4 * hidden))
    row_bytes = 4 * (width * per_token + logit_positions * 6 * get("vocab_size", 0))
    return max(1, int(budget_mib * 2**20 // max(row_bytes, 1)))


class Trainer:
    """Holds the policy and its AdamW optimizer between steps."""

    def __init__(
        self,
        model: CausalLM,
        cfg: TrainerSection,
        *,
        group_size: int,
        temperature: float = 1.0,
        pad_id: int = 0,
        compute_dtype: torch.dtype | None = None,
    ):
        """The model's parameters stay where and as they are (the optimizer's master weights: float32 unless the
        caller cast them); compute_dtype (e.g. torch.bfloat16 on CUDA) runs forward passes under autocast."""
        self.model = model
        self.device = next(model.parameters()).device
        check_cpu_dtype("trainer.dtype", self.device, compute_dtype, cpu_bf16_flags())
        self.compute_dtype = compute_dtype
        self.cfg = cfg
        self.group_size = group_size
        self.temperature = temperature
        self.pad_id = pad_id
        # what the optimizer trains: every weight, or only the adapters (rl/lora.py freezes the rest); tied weights once
        self._named = {name: p for name, p in model.named_parameters() if p.requires_grad}
        # data parallel (rl/fsdp.py sets these on every rank): rank r trains on rows r, r + world, ... of each
        # minibatch and the gradient reduction averages over the ranks
        self.rank, self.world = 0, 1
        self.optim = torch.optim.AdamW(
            self._named.values(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999), eps=1e-8
        )
        # trainer.kl_beta's frozen reference: the starting weights (a checkpoint's own reference replaces them)
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_beta > 0 else None

    def step(self, trajectories: list[Trajectory], trainer_version: int) -> UpdateMetrics:
        """One GRPO step on `trajectories`; trainer_version is the version being trained from.

        Advantages are normalised over the whole batch, then its samples are split into
        `cfg.minibatches` contiguous minibatches (fewer if there are fewer samples), one AdamW update each.
        """
        cfg = self.cfg
        kept, hist, dropped = split_stale(trajectories, trainer_version, cfg.max_staleness)
        if not kept:
            return UpdateMetrics(
                trainer_version, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, dropped, hist, updated=False
            )
        rewards = [t.reward for t in kept]
        advantages = loss_advantages(torch.tensor(rewards, dtype=torch.float64), [t.group_id for t in kept],
                                     cfg.advantage).float().to(self.device)
        batch = collate(kept, self.pad_id, self.device)
        # Log-probs only from the shortest prompt's last position on: the positions before it predict prompt tokens
        # of every row (mask 0), and their [B, T, vocab] log-softmax was most of the step's memory (a 135M model
        # with a 49k vocabulary and 70-token chat prompts: docs/guides/pretrained.md, 'Where a step's time goes').
        start = self._first_position(kept)
        mask, targets, behaviour_logp = (x[:, start:] for x in (batch.response_mask, batch.targets,
                                                                batch.behaviour_logp))
        if cfg.mask_truncated:
            mask = truncated_mask(mask, [t.finish_reason for t in kept])

        chunks = torch.arange(len(kept)).tensor_split(min(cfg.minibatches, len(kept)))
        micro = cfg.micro_batch_samples or (len(kept) if self.world > 1 else micro_batch_rows(
            self.model, batch.ids.shape[1], batch.ids.shape[1] - 1 - start, cfg.memory_budget_mb))
        # The proximal policy is the weights at the start of the step. With one minibatch the update's own
        # forward passes are at those weights (its micro-batches' gradients add up before the one update), so they
        # serve (detached) and no extra pass is paid; with more, a no-grad pass first, in micro-batches too. (The
        # model has no dropout: train and eval modes compute the same.)
        self.model.train()
        dp = self.world > 1  # every rank holds the whole batch; the proximal pass below is not split
        reuse = len(chunks) == 1 and not dp
        proximal_logp = torch.zeros_like(behaviour_logp)
        entropy_sum = 0.0
        if not reuse:
            with torch.no_grad():
                for part in torch.arange(len(kept)).split(micro):
                    logp_all = self._log_softmax(batch.ids[part], batch.attention_mask[part], start)
                    proximal_logp[part] = logp_all.gather(-1, targets[part][..., None])[..., 0]
                    entropy_sum += float((token_entropy(logp_all) * mask[part]).sum())
                    del logp_all

        lr = cfg.lr * lr_factor(trainer_version, cfg.lr_decay_steps, cfg.lr_min_ratio)
        for group in self.optim.param_groups:
            group["lr"] = lr
        loss_sum, clipped, grad_norms = 0.0, 0.0, []
        for minibatch in chunks:
            rows = minibatch[self.rank :: self.world]  # this rank's share (all of it in one process)
            per_row = cfg.loss_aggregation != "token"  # the loss is a mean over rows, not tokens
            minibatch_tokens = len(minibatch) if per_row else max(int(mask[minibatch].sum().item()), 1)
            self.optim.zero_grad(set_to_none=True)
            for part in rows.split(micro):
                logp_all = self._log_softmax(batch.ids[part], batch.attention_mask[part], start)
                logp = logp_all.gather(-1, targets[part][..., None])[..., 0]
                ent = token_entropy(logp_all) if cfg.entropy_coef > 0 else None  # the bonus's, and the figure's
                if reuse:  # this forward pass is at the step's starting weights: it is the proximal policy
                    proximal_logp[part] = logp.detach()
                    with torch.no_grad():
                        step_ent = ent.detach() if ent is not None else token_entropy(logp_all.detach())
                        entropy_sum += float((step_ent * mask[part]).sum())
                parts = self._loss(batch, part, start, logp, behaviour_logp[part], proximal_logp[part],
                                   advantages[part], mask[part]) if self._options() else clipped_token_loss(
                    logp,
                    behaviour_logp[part],
                    proximal_logp[part],
                    advantages[part],
                    mask[part],
                    eps_low=cfg.eps_low,
                    eps_high=cfg.eps_high,
                    off_policy=cfg.off_policy,
                    tis_cap=cfg.tis_cap,
                    entropy=ent,
                    entropy_coef=cfg.entropy_coef,
                )
                # the update's loss is the minibatch's token mean: each part (a micro-batch, or a rank's share) weighs
                # its own token mean by its share of the minibatch's tokens; times world in data parallel, because
                # the gradient reduction averages over the ranks
                scale = (len(part) if per_row else parts.tokens) / minibatch_tokens * (self.world if dp else 1)
                (parts.loss * scale).backward()
                del logp_all, logp, ent
                summed = self._all_sum([float(parts.loss.detach()) * parts.tokens,
                                        parts.clip_fraction * parts.tokens])
                loss_sum += summed[0]
                clipped += summed[1]
            norm = torch.nn.utils.clip_grad_norm_(list(self._named.values()), cfg.grad_clip)
            grad_norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
            self.optim.step()
        entropy = entropy_sum / max(float(mask.sum()), 1.0)
        drift = behaviour_drift(proximal_logp, behaviour_logp, mask, cfg.tis_cap)
        self.model.eval()

        tokens = int(mask.sum().item())
        return UpdateMetrics(
            trainer_version=trainer_version,
            samples=len(kept),
            tokens=tokens,
            reward_mean=sum(rewards) / len(rewards),
            loss=loss_sum / max(tokens, 1),
            grad_norm=sum(grad_norms) / len(grad_norms),
            clip_fraction=clipped / max(tokens, 1),
            entropy=entropy,
            response_len_mean=sum(len(t.response_ids) for t in kept) / len(kept),
            dropped_stale=dropped,
            staleness=hist,
            is_weight_mean=drift.weight_mean,
            is_weight_max=drift.weight_max,
            is_capped_fraction=drift.capped_fraction,
            kl_behaviour=drift.kl,
        )

    def _options(self) -> bool:
        """Whether the step uses rl/losses.py's options (else the default clipped token loss of rl/grpo.py)."""
        c = self.cfg
        return (c.ratio, c.loss_aggregation) != ("token", "token") or c.kl_beta > 0

    def _loss(self, batch: Batch, part, start, logp, behaviour_logp, proximal_logp, advantages, mask) -> LossParts:
        """rl/losses.py policy_loss under trainer.off_policy (pi_old and the weight w as clipped_token_loss has
        them) and, with kl_beta, the reference's log-probs of the same tokens."""
        c = self.cfg
        weight = None
        old = behaviour_logp if c.off_policy == "ppo" else proximal_logp
        if c.off_policy != "ppo":
            w = torch.exp(proximal_logp - behaviour_logp)
            weight = (w.clamp(max=c.tis_cap) if c.off_policy == "tis" else
                      torch.where(w <= c.tis_cap, w, torch.zeros_like(w)) if c.tis_cap > 0 else w)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = self._log_softmax(batch.ids[part], batch.attention_mask[part], start, self.reference).gather(
                    -1, batch.targets[part][:, start:][..., None])[..., 0]
        out = policy_loss(logp, old, advantages, mask, eps_low=c.eps_low, eps_high=c.eps_high, ratio_level=c.ratio,
                          aggregation=c.loss_aggregation, constant_tokens=c.loss_constant_tokens or 0,
                          weight=weight, ref_logp=ref, beta=c.kl_beta)
        return LossParts(loss=out.loss, clip_fraction=out.clip_fraction, tokens=int(mask.sum().item()))

    @staticmethod
    def _first_position(trajectories: list[Trajectory]) -> int:
        """The first position whose next-token log-prob any row's loss uses: the shortest prompt's last token."""
        return min(len(t.prompt_ids) for t in trajectories) - 1

    def _all_sum(self, values: list[float]) -> list[float]:
        """The sums over the data-parallel ranks (the values themselves in one process)."""
        if self.world == 1:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def _log_softmax(self, ids: torch.Tensor, attention_mask: torch.Tensor, start: int = 0,
                     model: torch.nn.Module | None = None) -> torch.Tensor:
        """[B, T-1-start, V] next-token log-probabilities at the sampling temperature (float32), from position
        `start` on (the targets ids[:, start + 1:]); model: the policy unless given (the KL reference)."""
        model = self.model if model is None else model
        if self.compute_dtype is not None and self.compute_dtype != torch.float32:
            with torch.autocast(self.device.type, dtype=self.compute_dtype):
                logits = model(ids, attention_mask)
        else:
            logits = model(ids, attention_mask)
        return torch.log_softmax(logits[:, start:-1].float() / self.temperature, dim=-1)

    @torch.no_grad()
    def response_logprobs(self, trajectories: list[Trajectory]) -> list[list[float]]:
        """The current policy's log-prob of each response token at the sampling temperature, per trajectory:
        what the engine recorded as behaviour log-probs when it sampled them under the same weights."""
        batch = collate(trajectories, self.pad_id, self.device)
        logp = self._log_softmax(batch.ids, batch.attention_mask).gather(-1, batch.targets[..., None])[..., 0]
        out = []
        for i, t in enumerate(trajectories):
            p, r = len(t.prompt_ids), len(t.response_ids)
            out.append(logp[i, p - 1 : p + r - 1].tolist())
        return out

    # -- weights and checkpoints ---------------------------------------------------------------

    def push_stall(self, global_sync: bool) -> float:
        return 0.0  # the relay push is the whole push

    def close(self) -> None:
        """Nothing to free beyond memory."""

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """Hugging Face-named weights to publish (detached; lm_head omitted when tied)."""
        return model_state_dict(self.model)

    def state_parts(self) -> dict[str, dict[str, torch.Tensor]]:
        """{"model": weights, "optim": AdamW state flattened as "<param name>/<state key>" tensors}."""
        optim: dict[str, torch.Tensor] = {}
        for name, p in self._named.items():
            for key, value in self.optim.state.get(p, {}).items():
                t = value if torch.is_tensor(value) else torch.tensor(value)
                optim[f"{name}/{key}"] = t.detach().to("cpu", copy=True).contiguous()
        model = {k: v.to("cpu", copy=True).contiguous() for k, v in self.policy_state_dict().items()}
        parts = {"model": model, "optim": optim}
        if self.reference is not None:  # trainer.kl_beta's frozen reference travels with the checkpoint
            parts["reference"] = {k: v.to("cpu", copy=True).contiguous()
                                  for k, v in model_state_dict(self.reference).items()}
        return parts

    def _load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        if "lora.base_fingerprint" in sd:  # rl/lora.py LoraTrainer restores those
            raise ConfigError("this checkpoint holds a LoRA adapter, not full weights; restore it with trainer.lora set "
                              "as in the run that wrote it (`laminar model export --merge` makes full weights of it)")
        load_model_state(self.model, sd)

    def load_state_parts(self, parts: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restore weights and AdamW state written by `state_parts` (hyperparameters come from cfg)."""
        with torch.no_grad():
            self._load_weights(parts["model"])
            if self.reference is not None and "reference" in parts:  # else: the starting weights stay the reference
                load_model_state(self.reference, parts["reference"])
        index = {name: i for i, name in enumerate(self._named)}
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in parts["optim"].items():
            name, _, field_name = key.rpartition("/")
            if name not in index:
                raise ValueError(f"optimizer state names parameter {name!r}, which the model does not have")
            state.setdefault(index[name], {})[field_name] = value.clone()
        self.optim.load_state_dict({"state": state, "param_groups": self.optim.state_dict()["param_groups"]})
