"""Engines and trainers from the run config: the one place that maps `rollout.engine`, `trainer.engine` and
`trainer.backend` to classes (rl/engine_api.py has the protocols they implement).

Engine and trainer names and traits live here alone (tests/test_engine_seams.py): callers never compare engine
names or ask an engine which class it is; they call `build_engine`, `build_trainer`, and ask the traits
(`check_engines`, `time_scale`, `decode_batch_limit`, `trainer_gpus`, `engines_served`, `engine_traits`) for what
they must know before any engine exists. Deterministic and import-light: the workflow asks `check_engines`,
`time_scale` and `decode_batch_limit`.
Import-light: the engine and trainer modules (torch models, vLLM) are imported by the builder that needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laminar.config import RunConfig
from laminar.errors import ConfigError
from laminar.policy import Policy

if TYPE_CHECKING:
    from laminar.rl.engine_api import Engine, PolicyTrainer

# (config.json as a dict, tokenizer, task) of the run, from its published model files (services/model_files.py)
RunFiles = Callable[[], tuple[dict, Any, Any]]
# a LoRA run's base weights {name: tensor}, published by its trainer (services/model_files.py load_run_base)
RunBase = Callable[[], dict]


@dataclass(frozen=True)
class EngineTraits:
    """What the rest of the system may know of a rollout engine without naming it."""

    spare_slots: int  # spare replica slots a rollout worker keeps: 1 takes over a dead worker's replica; 0 when
    # a process holds one engine only (vLLM, rl/vllm_engine.py)
    trainers: tuple[str, ...]  # the trainer engines it pairs with (a modelled engine's trajectories carry no real
    # tokens to train on)
    modelled_time: bool = False  # its time is modelled: modelled.speedup x faster than wall time, and its decode
    # batch runs at full speed up to modelled.roofline_batch
    every_worker: bool = True  # every rollout worker serves it; False: only a worker set started for it (vLLM)
    lora: bool = False  # it applies LoRA versions (trainer.lora, rl/lora.py) to the run's base weights it holds
    lora_requests: bool = False  # it can also serve them unmerged, as LoRA requests (rollout.lora_apply = "adapter")
    cheap_to_keep: bool = False  # an idle copy holds no memory worth freeing: a replica parked at a continue-as-new
    # (services/rollout/attach.py) that nobody adopted may wait for its adopter instead of being closed at once


@dataclass(frozen=True)
class BackendTraits:
    """What the rest of the system may know of a trainer backend (trainer.backend) without naming it."""

    trainers: tuple[str, ...]  # the trainer engines it runs (a sharded backend needs weights to shard)
    sharded: bool = False  # trainer.fsdp_procs rank processes (one GPU each on CUDA); else one process
    lora: bool = False  # it trains LoRA adapters (trainer.lora, rl/lora.py)


ENGINE_TRAITS = {"torch": EngineTraits(spare_slots=1, trainers=("torch",), lora=True),
                 "vllm": EngineTraits(spare_slots=0, trainers=("torch",), every_worker=False, lora=True,
                                      lora_requests=True),
                 "modelled": EngineTraits(spare_slots=1, trainers=("modelled",), modelled_time=True,
                                          cheap_to_keep=True)}
BACKEND_TRAITS = {"single": BackendTraits(trainers=("torch", "modelled"), lora=True),
                  "fsdp": BackendTraits(trainers=("torch",), sharded=True)}


def engine_traits(cfg: RunConfig) -> EngineTraits:
    return ENGINE_TRAITS[cfg.rollout.engine]


def check_engines(cfg: RunConfig) -> RunConfig:
    """The run's engines fit together (rollout.engine with trainer.engine, trainer.backend with trainer.engine);
    ConfigError naming the fields and the fix if not. Every caller that validates a run config asks this: the
    commands when they load a config and the workflow on its input (beside RunConfig.from_json)."""
    r, t = cfg.rollout, cfg.trainer
    if t.engine not in ENGINE_TRAITS[r.engine].trainers:
        pairs = "; ".join(f"{name} with {' or '.join(e.trainers)}" for name, e in ENGINE_TRAITS.items())
        raise ConfigError(
            f"rollout.engine={r.engine!r} and trainer.engine={t.engine!r} must match: a modelled engine's "
            f"trajectories carry no real tokens to train on; pair rollout.engine with trainer.engine as in: {pairs}")
    if t.engine not in (fits := BACKEND_TRAITS[t.backend].trainers):
        raise ConfigError(
            f"trainer.backend={t.backend!r} needs trainer.engine={' or '.join(map(repr, fits))} (got {t.engine!r}); "
            "the modelled trainer has no weights to shard")
    if t.lora is not None:
        _check_lora(cfg)
    if t.micro_batch_samples is not None and t.backend != "single":
        raise ConfigError(
            f"trainer.micro_batch_samples={t.micro_batch_samples} with trainer.backend={t.backend!r} is not "
            "implemented: its ranks would have to run the same number of micro-batches, in step, for the gradient "
            "reduction; set trainer.backend = 'single', or remove trainer.micro_batch_samples")
    if t.kl_beta > 0 and t.backend != "single":
        raise ConfigError(f"trainer.kl_beta={t.kl_beta} needs trainer.backend='single' (the {t.backend} backend holds "
                          "no reference model); set trainer.kl_beta=0 or trainer.backend='single'")
    e = cfg.eval
    if (e.every_steps > 0 or e.at_start or e.at_end) and r.engine != "torch":
        asked = ", ".join(f for f, on in (("eval.every_steps", e.every_steps), ("eval.at_start", e.at_start),
                                          ("eval.at_end", e.at_end)) if on)
        raise ConfigError(
            f"{asked} with rollout.engine={r.engine!r}: evaluation during training runs on the torch engine's replicas "
            "only (an eval engine beside the training one, services/rollout/evaluation.py); set rollout.engine = "
            "'torch', or evaluate checkpoints afterwards with `laminar eval CONFIG --checkpoint RUN_ID@STEP`")
    return cfg


def _check_lora(cfg: RunConfig) -> None:
    """trainer.lora needs an engine that applies adapters to base weights it holds (which pairs with a trainer
    that has weights: the torch engine merges each version, vLLM serves it through its LoRA requests) and a backend
    that trains adapters."""
    r, t = cfg.rollout, cfg.trainer
    if not ENGINE_TRAITS[r.engine].lora:
        fits = [name for name, e in ENGINE_TRAITS.items() if e.lora]
        raise ConfigError(
            f"trainer.lora with rollout.engine={r.engine!r} is not implemented: only {fits} apply LoRA versions "
            "(to the base weights the engine holds); set "
            f"rollout.engine to one of {fits} (and trainer.engine to one it pairs with), or remove trainer.lora")
    if r.lora_apply == "adapter" and not ENGINE_TRAITS[r.engine].lora_requests:
        fits = [name for name, e in ENGINE_TRAITS.items() if e.lora_requests]
        raise ConfigError(
            f"rollout.lora_apply='adapter' with rollout.engine={r.engine!r}: that engine merges each LoRA version into "
            f"its weights and serves no LoRA requests (only {fits} do); set rollout.lora_apply to 'auto' or 'merge', "
            f"or rollout.engine to one of {fits}")
    if not BACKEND_TRAITS[t.backend].lora:
        fits = [name for name, b in BACKEND_TRAITS.items() if b.lora]
        raise ConfigError(
            f"trainer.lora is not supported with trainer.backend={t.backend!r} yet (its ranks would shard and gather "
            f"the frozen base too); set trainer.backend to one of {fits}, or remove trainer.lora")


def time_modelled(engine: str) -> bool:
    """Whether the rollout engine's time is modelled (modelled.speedup applies to it)."""
    return ENGINE_TRAITS[engine].modelled_time


def time_scale(cfg: RunConfig) -> float:
    """Engine seconds per wall second: modelled.speedup where the rollout engine's time is modelled, else 1.
    Deterministic (the workflow asks it)."""
    return cfg.modelled.speedup if time_modelled(cfg.rollout.engine) else 1.0


def decode_batch_limit(cfg: RunConfig) -> int:
    """Sequences one replica decodes at full speed: its slots, capped at modelled.roofline_batch where the
    rollout engine's time is modelled. Deterministic (the workflow asks it)."""
    slots = cfg.rollout.max_inflight_groups * cfg.rollout.group_size
    return min(cfg.modelled.roofline_batch, slots) if time_modelled(cfg.rollout.engine) else slots


def trainer_gpus(cfg: RunConfig) -> int:
    """GPUs the trainer worker holds on CUDA: one per rank of a sharded backend (trainer.fsdp_procs), else 1."""
    return cfg.trainer.fsdp_procs if BACKEND_TRAITS[cfg.trainer.backend].sharded else 1


def engines_served(cfg: RunConfig) -> list[str]:
    """The rollout engines every worker of a set started for `cfg` serves: those any rollout worker runs, plus the
    run's own (vLLM only in a set started for it, rl/vllm_engine.py)."""
    return sorted({*(name for name, e in ENGINE_TRAITS.items() if e.every_worker), cfg.rollout.engine})


def build_engine(cfg: RunConfig, *, policy: Policy, seed: int, run_files: RunFiles,
                 run_base: RunBase | None = None) -> tuple[Engine, Any]:
    """(engine, task) of one rollout replica; seed: its sampling seed (the modelled engine samples nothing).
    run_base: read (once) by the engine of a LoRA run, whose versions are adapters (rl/lora.py)."""
    if cfg.trainer.lora is not None:  # check_engines lets only engines with the lora trait through
        if run_base is None:
            raise ValueError("trainer.lora is set: the engine needs run_base, the run's base weights")
        return _ENGINES[cfg.rollout.engine](cfg, policy, seed, run_files, run_base)
    return _ENGINES[cfg.rollout.engine](cfg, policy, seed, run_files)


def lora_merges(cfg: RunConfig) -> bool:
    """Whether a vLLM engine merges LoRA versions into its weights (rollout.lora_apply; auto: on CPU, where vLLM's
    LoRA kernels decode several times slower than merged weights) or serves them as LoRA requests."""
    return cfg.rollout.lora_apply == "merge" or (cfg.rollout.lora_apply == "auto" and cfg.rollout.device == "cpu")


def _modelled_engine(cfg: RunConfig, policy: Policy, seed: int, run_files: RunFiles):
    from laminar.rl.modelled import ModelledEngine, ModelledTask

    r = cfg.rollout  # lengths depend on run.seed alone (not the replica)
    return ModelledEngine(cfg, max_inflight_seqs=r.max_inflight_groups * r.group_size,
                          global_sync=policy.global_sync), ModelledTask(cfg)


def _vllm_engine(cfg: RunConfig, policy: Policy, seed: int, run_files: RunFiles, run_base: RunBase | None = None):
    """With run_base (a LoRA run) vLLM holds the base weights and applies each version as a LoRA request or merged
    into them (lora_merges)."""
    from laminar.rl.vllm_engine import VllmEngine

    r = cfg.rollout  # vLLM builds the architecture from config.json; nothing else imports vllm
    hf, _, task = run_files()
    lora = {} if run_base is None else {"base": run_base(), "lora_rank": cfg.trainer.lora.r,
                                        "lora_merge": lora_merges(cfg)}
    return VllmEngine(hf, max_inflight_seqs=r.max_inflight_groups * r.group_size, max_new_tokens=r.max_new_tokens,
                      max_prompt_len=r.max_prompt_len, temperature=r.temperature, seed=seed, eos_id=task.eos_id,
                      device=r.device, dtype=r.dtype, **lora), task


def _torch_engine(cfg: RunConfig, policy: Policy, seed: int, run_files: RunFiles, run_base: RunBase | None = None):
    """One GPU per replica where the process has them (rl.model.ROLLOUT_DEVICES; given back at close). With
    run_base (a LoRA run) the model holds the base weights and each version's adapter is merged into them."""
    import torch

    from laminar.rl.engine import TorchEngine
    from laminar.rl.model import ROLLOUT_DEVICES, build_model, placement

    r = cfg.rollout
    hf, tokenizer, task = run_files()
    device, dtype = placement("rollout", r.device, r.dtype)
    on_close = None
    if device.type == "cuda":
        index = ROLLOUT_DEVICES.acquire(torch.cuda.device_count())
        device, on_close = torch.device("cuda", index), lambda: ROLLOUT_DEVICES.release(index)
    model, fingerprint = build_model(hf, seed=0).to(device, dtype), None
    if run_base is not None:
        from laminar.rl.lora import load_base

        fingerprint = load_base(model, run_base())
    return TorchEngine(model, tokenizer,
                       max_inflight_seqs=r.max_inflight_groups * r.group_size, max_new_tokens=r.max_new_tokens,
                       max_prompt_len=r.max_prompt_len, temperature=r.temperature, seed=seed, eos_id=task.eos_id,
                       on_close=on_close, base_fingerprint=fingerprint), task


_ENGINES = {"torch": _torch_engine, "vllm": _vllm_engine, "modelled": _modelled_engine}


def build_local_engine(model: Any, tokenizer: Any, **kw: Any) -> Engine:
    """An engine over a model this process holds already (`laminar eval`: a checkpoint's weights, whatever engine
    the run rolled out with): the torch engine. kw: TorchEngine's (max_inflight_seqs, max_new_tokens, ...)."""
    from laminar.rl.engine import TorchEngine

    return TorchEngine(model, tokenizer, **kw)


def build_trainer(cfg: RunConfig, *, policy: Policy, max_staleness: int, model_dir: Callable[[], Path]
                  ) -> PolicyTrainer:
    """The run's trainer; model_dir: the model directory, resolved (and its files published) only by a trainer
    that has real weights. max_staleness: the bound the run applies (laminar.policy.staleness_bound)."""
    if cfg.trainer.engine == "modelled":
        from laminar.rl.modelled import ModelledTrainer

        return ModelledTrainer(cfg, max_staleness=max_staleness)
    from laminar.rl.model import load_pretrained, placement

    path = model_dir()
    model, tokenizer, _ = load_pretrained(path)
    pad = tokenizer.token_to_id("<pad>")
    # optimizer updates per step: stream's step is one of its minibatches already
    section = cfg.trainer.model_copy(update={"max_staleness": max_staleness,
                                             "minibatches": cfg.trainer.minibatches // policy.steps_per_version})
    common = {"group_size": cfg.rollout.group_size, "temperature": cfg.rollout.temperature,
              "pad_id": 0 if pad is None else pad}
    if cfg.trainer.backend == "fsdp":  # this process is rank 0 (rl/fsdp.py)
        from laminar.rl.fsdp import FsdpTrainer

        return FsdpTrainer(path, section, **common)
    from laminar.rl.trainer import Trainer

    device, dtype = placement("trainer", cfg.trainer.device, cfg.trainer.dtype)
    if cfg.trainer.lora is not None:  # adapters only (rl/lora.py)
        from laminar.rl.lora import LoraTrainer

        return LoraTrainer(model.to(device), section, compute_dtype=dtype, **common)
    return Trainer(model.to(device), section, compute_dtype=dtype, **common)
