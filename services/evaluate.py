"""`laminar eval`'s domain service: evaluate one policy (a committed checkpoint of a run, or a Hugging Face model
directory) on the held-out prompts in this process, with the training reward, and store the record
(rl/evaluation.py says what is measured; storage/keys.py eval_result where).

A checkpoint reference is `RUN_ID@STEP` (that committed checkpoint, verified file by file) or `RUN_ID` (the newest
committed one that verifies). The model's architecture and tokenizer come from the run's published model files,
as a rollout replica builds them, so a checkpoint of a run that has ended evaluates without its model directory.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from laminar.config import RunConfig
from laminar.errors import ConfigError, CorruptDataError
from laminar.evalstats import EvalSummary
from laminar.logs import get_logger
from laminar.rl.evaluation import eval_prompts, generate_and_score
from laminar.services.eval_records import EvalTarget, store_record
from laminar.storage.checkpoints import CheckpointStore, LoadedCheckpoint
from laminar.storage.objects import ObjectStore

log = get_logger(__name__)

EVAL_SLOTS = 64  # sequences the one-process engine decodes at once (count)


@dataclass(frozen=True)
class EvalOutcome:
    target: EvalTarget
    summary: EvalSummary
    key: str  # where the record is stored
    wall_s: float


def _run_and_step(ref: str) -> tuple[str, int | None]:
    m = re.fullmatch(r"([^@/]+)(?:@(\d+))?", ref)
    if m is None:
        raise ConfigError(f"--checkpoint {ref!r} is neither a model directory on this host nor RUN_ID[@STEP]; pass "
                          "e.g. run-20261201-120000@40, or a Hugging Face model directory")
    return m.group(1), None if m.group(2) is None else int(m.group(2))


def load_checkpoint(store: ObjectStore, checkpoint: str) -> tuple[str, LoadedCheckpoint]:
    """(run id, the verified checkpoint) of a reference RUN_ID@STEP or RUN_ID (its newest that verifies)."""
    run_id, step = _run_and_step(checkpoint)
    checkpoints = CheckpointStore(store)
    ref = checkpoints.latest(run_id) if step is None else checkpoints.verified_at(run_id, step)
    if ref is None:
        have = checkpoints.list_committed(run_id)
        why = "" if step is None else f" ({checkpoints.verify(run_id, step) or 'not committed'})"
        raise CorruptDataError(f"run {run_id} has no committed checkpoint{'' if step is None else f' at step {step}'} "
                               f"that verifies{why}; committed steps: {have or 'none'}")
    return run_id, checkpoints.load(ref)


def load_policy(store: ObjectStore, cfg: RunConfig, checkpoint: str) -> tuple[Any, Any, Any, EvalTarget]:
    """(model, tokenizer, task, target) of a checkpoint reference or a model directory."""
    from laminar.envs.tasks import build_task
    from laminar.rl.model import build_model, load_pretrained

    path = Path(checkpoint)
    if path.is_dir():
        from laminar.envs.tasks.tokenizer import with_model_specials
        from laminar.services.model_files import tokenizer_config

        model, tokenizer, _ = load_pretrained(path)
        tok_cfg = tokenizer_config(path)  # a pretrained model's specials and chat template, as a run publishes them
        if tok_cfg.get("eos_token"):
            tokenizer = with_model_specials(tokenizer, tok_cfg)
        task = build_task(cfg.task, seed=cfg.run.seed, tokenizer=tokenizer, chat_template=tok_cfg.get("chat_template"))
        run_id = cfg.run.run_id or f"eval-{re.sub(r'[^A-Za-z0-9_.-]', '-', path.resolve().name)}"
        return model, tokenizer, task, EvalTarget(run_id, 0, str(path.resolve()))
    run_id, loaded = load_checkpoint(store, checkpoint)
    ref = loaded.ref
    from laminar.services.model_files import load_run_files

    hf, tokenizer, task = load_run_files(store, run_id, cfg)
    model = build_model(hf, seed=0).to(torch.float32)
    load_checkpoint_weights(store, run_id, model, loaded.parts["model"])
    version = int(loaded.meta.get("policy_version", ref.step))
    return model.eval(), tokenizer, task, EvalTarget(run_id, version, f"{run_id}@{ref.step}")


def load_checkpoint_weights(store: ObjectStore, run_id: str, model: Any, weights: dict) -> None:
    """Copy a checkpoint's model part into `model`: as saved, or, for a LoRA run's (rl/lora.py), the base weights
    its trainer published with the adapter merged in, as a rollout engine applies it (refused on another base)."""
    from laminar.rl.lora import AdapterMerge, is_adapter, load_base
    from laminar.rl.model import load_model_state

    if not is_adapter(weights):
        load_model_state(model, weights)
        return
    from laminar.services.model_files import load_run_base

    AdapterMerge(model, load_base(model, load_run_base(store, run_id))).apply(weights)


def evaluate(store: ObjectStore, cfg: RunConfig, checkpoint: str, prompts_file: str = "") -> EvalOutcome:
    """Evaluate and store the record; the record of a version evaluated again is replaced (the newest wins)."""
    from laminar.rl.factory import build_local_engine
    from laminar.rl.model import model_state_dict

    started = time.perf_counter()
    model, tokenizer, task, target = load_policy(store, cfg, checkpoint)
    prompts = eval_prompts(task, cfg.eval, prompts_file)
    width = max(len(p.token_ids) for p in prompts)
    engine = build_local_engine(model, tokenizer, max_inflight_seqs=min(EVAL_SLOTS, len(prompts) * cfg.eval.samples),
                         max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.eval.temperature,
                         seed=cfg.run.seed, eos_id=task.eos_id, max_prompt_len=max(width, cfg.rollout.max_prompt_len))
    engine.load_weights(model_state_dict(model), target.policy_version)
    with torch.no_grad():
        results = generate_and_score(engine, task, prompts, cfg.eval.samples, cfg.task.reward_timeout_s)
    wall_s = time.perf_counter() - started
    summary, key = store_record(store, cfg, results, target, wall_s)
    return EvalOutcome(target, summary, key, wall_s)
