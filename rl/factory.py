"""Engines and trainers from the run config: the one place that maps `rollout.engine`, `trainer.engine` and
`trainer.backend` to classes (rl/engine_api.py has the protocols they implement).

Callers never compare engine names or ask an engine which class it is: they call `build_engine`,
`build_trainer`, and read `engine_traits` for what a launcher must know before any engine exists.
Import-light: the engine and trainer modules (torch models, vLLM) are imported by the builder that needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laminar.config import RunConfig
from laminar.policy import Policy

if TYPE_CHECKING:
    from rl.engine_api import Engine, PolicyTrainer

# (config.json as a dict, tokenizer, task) of the run, from its published model files (services/model_files.py)
RunFiles = Callable[[], tuple[dict, Any, Any]]
# a LoRA run's base weights {name: tensor}, published by its trainer (services/model_files.py load_run_base)
RunBase = Callable[[], dict]


@dataclass(frozen=True)
class EngineTraits:
    spare_slots: int  # spare replica slots a rollout worker keeps: 1 takes over a dead worker's replica; 0 when
    # a process holds one engine only (vLLM, rl/vllm_engine.py)


ENGINE_TRAITS = {"torch": EngineTraits(spare_slots=1), "vllm": EngineTraits(spare_slots=0),
                 "modelled": EngineTraits(spare_slots=1)}


def engine_traits(cfg: RunConfig) -> EngineTraits:
    return ENGINE_TRAITS[cfg.rollout.engine]


def build_engine(cfg: RunConfig, *, policy: Policy, seed: int, run_files: RunFiles,
                 run_base: RunBase | None = None) -> tuple[Engine, Any]:
    """(engine, task) of one rollout replica; seed: its sampling seed (the modelled engine samples nothing).
    run_base: read (once) by a torch engine of a LoRA run, whose versions are adapters (rl/lora.py)."""
    if cfg.trainer.lora is not None:  # the config pairs it with the torch engine only
        if run_base is None:
            raise ValueError("trainer.lora is set: a torch engine needs run_base, the run's base weights")
        return _torch_engine(cfg, policy, seed, run_files, run_base)
    return _ENGINES[cfg.rollout.engine](cfg, policy, seed, run_files)


def _modelled_engine(cfg: RunConfig, policy: Policy, seed: int, run_files: RunFiles):
    from rl.modelled import ModelledEngine, ModelledTask

    r = cfg.rollout  # lengths depend on run.seed alone (not the replica)
    return ModelledEngine(cfg, max_inflight_seqs=r.max_inflight_groups * r.group_size,
                          global_sync=policy.global_sync), ModelledTask(cfg)


def _vllm_engine(cfg: RunConfig, policy: Policy, seed: int, run_files: RunFiles):
    from rl.vllm_engine import VllmEngine

    r = cfg.rollout  # vLLM builds the architecture from config.json; nothing else imports vllm
    hf, _, task = run_files()
    return VllmEngine(hf, max_inflight_seqs=r.max_inflight_groups * r.group_size, max_new_tokens=r.max_new_tokens,
                      max_prompt_len=r.max_prompt_len, temperature=r.temperature, seed=seed, eos_id=task.eos_id,
                      device=r.device, dtype=r.dtype), task


def _torch_engine(cfg: RunConfig, policy: Policy, seed: int, run_files: RunFiles, run_base: RunBase | None = None):
    """One GPU per replica where the process has them (rl.model.ROLLOUT_DEVICES; given back at close). With
    run_base (a LoRA run) the model holds the base weights and each version's adapter is merged into them."""
    import torch

    from rl.engine import TorchEngine
    from rl.model import ROLLOUT_DEVICES, build_model, placement

    r = cfg.rollout
    hf, tokenizer, task = run_files()
    device, dtype = placement("rollout", r.device, r.dtype)
    on_close = None
    if device.type == "cuda":
        index = ROLLOUT_DEVICES.acquire(torch.cuda.device_count())
        device, on_close = torch.device("cuda", index), lambda: ROLLOUT_DEVICES.release(index)
    model, fingerprint = build_model(hf, seed=0).to(device, dtype), None
    if run_base is not None:
        from rl.lora import load_base

        fingerprint = load_base(model, run_base())
    return TorchEngine(model, tokenizer,
                       max_inflight_seqs=r.max_inflight_groups * r.group_size, max_new_tokens=r.max_new_tokens,
                       max_prompt_len=r.max_prompt_len, temperature=r.temperature, seed=seed, eos_id=task.eos_id,
                       on_close=on_close, base_fingerprint=fingerprint), task


_ENGINES = {"torch": _torch_engine, "vllm": _vllm_engine, "modelled": _modelled_engine}


def build_trainer(cfg: RunConfig, *, policy: Policy, max_staleness: int, model_dir: Callable[[], Path]
                  ) -> PolicyTrainer:
    """The run's trainer; model_dir: the model directory, resolved (and its files published) only by a trainer
    that has real weights. max_staleness: the bound the run applies (laminar.policy.staleness_bound)."""
    if cfg.trainer.engine == "modelled":
        from rl.modelled import ModelledTrainer

        return ModelledTrainer(cfg, max_staleness=max_staleness)
    from rl.model import load_pretrained, placement

    path = model_dir()
    model, tokenizer, _ = load_pretrained(path)
    pad = tokenizer.token_to_id("<pad>")
    # optimizer updates per step: stream's step is one of its minibatches already
    section = cfg.trainer.model_copy(update={"max_staleness": max_staleness,
                                             "minibatches": cfg.trainer.minibatches // policy.steps_per_version})
    common = {"group_size": cfg.rollout.group_size, "temperature": cfg.rollout.temperature,
              "pad_id": 0 if pad is None else pad}
    if cfg.trainer.backend == "fsdp":  # this process is rank 0 (rl/fsdp.py)
        from rl.fsdp import FsdpTrainer

        return FsdpTrainer(path, section, **common)
    from rl.trainer import Trainer

    device, dtype = placement("trainer", cfg.trainer.device, cfg.trainer.dtype)
    if cfg.trainer.lora is not None:  # adapters only (rl/lora.py)
        from rl.lora import LoraTrainer

        return LoraTrainer(model.to(device), section, compute_dtype=dtype, **common)
    return Trainer(model.to(device), section, compute_dtype=dtype, **common)
