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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from laminar.errors import ConfigError

MODES = ("laminar",)  # scheduling policies; baselines (sync, one_step, stream, partial_rollout) plug in here


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunSection(_Section):
    run_id: str = Field("", description="Run id; empty means generated at start (`run-<utc time>`).")
    mode: Literal["laminar"] = Field(
        "laminar", description="Scheduling policy. `laminar`: trajectory-level asynchrony, no global barrier."
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


class ModelSection(_Section):
    path: str = Field(
        "",
        description="Hugging Face model directory (config.json, *.safetensors, tokenizer.json). "
        "Empty: build the tiny default model for the task under .laminar/models/.",
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
    name: Literal["repeat"] = Field("repeat", description="Task module under rl/tasks/ (reward function).")
    max_count: int = Field(48, ge=2, le=4096, description="Largest requested response length (tokens).")


class RolloutSection(_Section):
    replicas: int = Field(2, ge=1, le=1024, description="Rollout replicas (long-running activities).")
    group_size: int = Field(8, ge=2, le=1024, description="Samples per prompt (GRPO group size).")
    max_inflight_groups: int = Field(
        4, ge=1, le=4096, description="Groups one replica generates at once (KV-cache capacity, groups)."
    )
    max_new_tokens: int = Field(96, ge=1, le=1_000_000, description="Response length cap (tokens).")
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
        description="Replica heartbeat timeout: the failure detector of a dead rollout worker (s).",
    )


class TrainerSection(_Section):
    groups_per_step: int = Field(4, ge=1, le=65536, description="Complete groups consumed per step (groups).")
    lr: float = Field(2e-3, gt=0.0, le=1.0, description="AdamW learning rate (1/step).")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay (unitless).")
    grad_clip: float = Field(1.0, gt=0.0, description="Max global gradient norm (L2).")
    eps_low: float = Field(0.2, ge=0.0, le=1.0, description="PPO clip, lower (ratio 1-eps_low).")
    eps_high: float = Field(0.28, ge=0.0, le=10.0, description="Clip-higher, upper (ratio 1+eps_high).")
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
    minibatches: int = Field(
        1, ge=1, le=4096,
        description="Optimizer updates per step: the batch's samples are split into this many minibatches "
        "(count). With 1, pi_theta equals pi_prox at the only update, so tis/decoupled never clip.",
    )
    max_staleness: int = Field(
        -1, ge=-1, description="Drop (and count) samples staler than this many versions; -1 keeps all."
    )
    checkpoint_every: int = Field(10, ge=1, description="Commit a checkpoint every this many steps (steps).")
    heartbeat_timeout_s: float = Field(
        10.0, ge=1.0, le=3600.0, description="Trainer heartbeat timeout: detects a dead trainer process (s)."
    )
    keep_last: int = Field(3, ge=1, description="Committed checkpoints to retain (count).")

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
        if self.off_policy == "decoupled" and 0 < self.tis_cap < 1:
            raise ValueError(
                f"trainer.tis_cap={self.tis_cap} with trainer.off_policy='decoupled' must be 0 (no cap) or >= 1 "
                f"(a cap below 1 drops even on-policy tokens, whose weight is 1)"
            )
        return self


class RelaySection(_Section):
    relays: int = Field(2, ge=1, le=1024, description="Relays, one per (simulated) host (count).")
    heartbeat_timeout_s: float = Field(
        3.0, ge=1.0, le=3600.0, description="Relay heartbeat timeout: the failure detector of a dead relay (s)."
    )


class RunConfig(_Section):
    """What the experiment is. Where things run (addresses, store) comes from LAMINAR_* settings."""

    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    task: TaskSection = TaskSection()
    rollout: RolloutSection = RolloutSection()
    trainer: TrainerSection = TrainerSection()
    relay: RelaySection = RelaySection()

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
                raise ConfigError(f"config file {p} does not exist; pass a TOML file such as examples/tiny.toml") from None
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"config file {p} cannot be read ({e}); pass a readable UTF-8 TOML file") from None
        for item in overrides or []:
            apply_override(data, item)
        return cls.from_json(data)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def with_run_id(self, run_id: str) -> RunConfig:
        return self.model_copy(update={"run": self.run.model_copy(update={"run_id": run_id})})


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one `--section.key=value` override; the value is parsed as TOML (strings may be bare)."""
    text = item[2:] if item.startswith("--") else item
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"override {item!r} must look like --section.key=value, e.g. --trainer.lr=0.001")
    dotted, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    if _is_text_field(dotted) and not isinstance(value, str):
        value = raw  # a bare string that looks like a number or a date stays the string it is
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
    node[parts[-1]] = value


def _is_text_field(dotted: str) -> bool:
    parts = dotted.split(".")
    section = RunConfig.model_fields.get(parts[0]) if len(parts) == 2 else None
    fields = getattr(section.annotation, "model_fields", {}) if section is not None else {}
    return parts[-1] in fields and fields[parts[-1]].annotation is str


def describe_validation_error(e: ValidationError) -> str:
    """One line per problem: `field=value: what is wrong (field description)`."""
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "config"
        value = err.get("input")
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field; check the spelling against examples/tiny.toml"
        help_text = _field_description(loc)
        suffix = f" ({help_text})" if help_text else ""
        lines.append(f"{loc}={value!r}: {msg}{suffix}")
    return "invalid run config: " + "; ".join(lines)


def _field_description(loc: str) -> str:
    parts = loc.split(".")
    if len(parts) != 2:
        return ""
    section = RunConfig.model_fields.get(parts[0])
    if section is None or section.annotation is None:
        return ""
    field = getattr(section.annotation, "model_fields", {}).get(parts[1])
    return field.description if field is not None and field.description else ""
