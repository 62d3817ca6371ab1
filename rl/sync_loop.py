"""A synchronous on-policy reference loop: the engine generates groups, the trainer steps, weights are
copied back. No Temporal, no store; used to check that the default task/model/recipe learns, and as
the algorithmic baseline the asynchronous system is compared against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from laminar.config import RunConfig
from laminar.envs.tasks import build_task
from laminar.logs import get_logger
from laminar.records import Trajectory
from laminar.rl.engine import TorchEngine
from laminar.rl.model import load_pretrained
from laminar.rl.trainer import Trainer, UpdateMetrics

log = get_logger(__name__)


@dataclass
class SyncLoopResult:
    metrics: list[UpdateMetrics] = field(default_factory=list)
    response_lens: list[list[int]] = field(default_factory=list)  # per step
    step_end_s: list[float] = field(default_factory=list)  # seconds from the loop's start to each step's end
    wall_s: float = 0.0


def generate_groups(engine: TorchEngine, task, prompt_ids: list[int], group_size: int, run_id: str):
    """Generate group_size responses to each prompt with continuous batching -> trajectories."""
    pending = [(pid, k) for pid in prompt_ids for k in range(group_size)]
    prompts = {pid: task.prompt(pid) for pid in prompt_ids}
    out: list[Trajectory] = []
    started = time.time()
    while pending or engine.in_flight():
        while pending and engine.free_slots():
            pid, k = pending.pop(0)
            engine.add(f"{pid}/{k}", prompts[pid].token_ids)
        for f in engine.step():
            pid, k = (int(x) for x in f.request_id.split("/"))
            out.append(
                Trajectory(
                    run_id=run_id,
                    prompt_id=pid,
                    group_id=f"{run_id}/{pid}",
                    sample_index=k,
                    prompt_ids=f.prompt_ids,
                    response_ids=f.response_ids,
                    logprobs=f.logprobs,
                    reward=task.reward(prompts[pid], f.response_ids),
                    policy_version=engine.policy_version or 0,
                    replica_id="sync",
                    started_at=started,
                    ended_at=time.time(),
                    finish_reason=f.finish_reason,
                )
            )
    return out


def run_sync_loop(cfg: RunConfig, model_dir, steps: int | None = None) -> SyncLoopResult:
    """Run `steps` (default cfg.run.steps) synchronous GRPO steps from the model in model_dir."""
    steps = steps or cfg.run.steps
    policy, tokenizer, hf = load_pretrained(model_dir)
    rollout_model, _, _ = load_pretrained(model_dir)
    task = build_task(cfg.task, seed=cfg.run.seed, tokenizer=tokenizer)
    r = cfg.rollout
    trainer_class, fingerprint = Trainer, None
    if cfg.trainer.lora is not None:  # versions are adapters, merged into the base the engine holds (rl/lora.py)
        from laminar.rl.lora import LoraTrainer, base_fingerprint
        from laminar.rl.model import model_state_dict

        trainer_class, fingerprint = LoraTrainer, base_fingerprint(model_state_dict(rollout_model))
    engine = TorchEngine(
        rollout_model,
        tokenizer,
        max_inflight_seqs=r.max_inflight_groups * r.group_size,
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        seed=cfg.run.seed,
        eos_id=task.eos_id,
        base_fingerprint=fingerprint,
    )
    trainer = trainer_class(
        policy, cfg.trainer, group_size=r.group_size, temperature=r.temperature, pad_id=task.pad_id
    )
    result = SyncLoopResult()
    started = time.time()
    per_step = cfg.trainer.groups_per_step
    for step in range(steps):
        engine.load_weights(trainer.policy_state_dict(), policy_version=step)
        trajs = generate_groups(
            engine, task, list(range(step * per_step, (step + 1) * per_step)), r.group_size, "sync"
        )
        m = trainer.step(trajs, trainer_version=step)
        result.metrics.append(m)
        result.response_lens.append([len(t.response_ids) for t in trajs])
        result.step_end_s.append(time.time() - started)
        log.info(
            "sync_step_finished",
            step=step,
            reward=round(m.reward_mean, 3),
            tokens=m.tokens,
            entropy=round(m.entropy, 3),
            clip=round(m.clip_fraction, 3),
        )
    result.wall_s = time.time() - started
    return result
