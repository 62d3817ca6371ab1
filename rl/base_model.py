"""Build the tiny default "base model" for a task: a Llama config.json, the task tokenizer, and a short
supervised warm-up on a noisy version of the task, saved as a standard Hugging Face directory.

The warm-up teaches the format (answer with roughly n tokens, then <eos>) but only picks the right
symbol DEMO_ACCURACY of the time, so the result is a weak base model that RL then measurably improves.
Deterministic from cfg.run.seed; idempotent: a directory whose fingerprint.json matches is reused.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import torch

from laminar.config import RunConfig
from laminar.envs.tasks import build_task
from laminar.logs import get_logger
from laminar.rl.model import build_model, save_pretrained

log = get_logger(__name__)

DEMO_ACCURACY = 0.3  # P(a demonstration token is the right symbol)
PRETRAIN_BATCH = 32  # sequences per warm-up step
PRETRAIN_LR = 3e-3
RECIPE_VERSION = 1  # bump when the recipe below changes, so stale directories are rebuilt


def hf_config(cfg: RunConfig, vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    """A standard Hugging Face Llama config.json for the tiny model described by cfg.model."""
    m = cfg.model
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": max(256, 2 * (cfg.task.max_count + cfg.rollout.max_new_tokens)),
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "torch_dtype": "float32",
    }


def fingerprint(cfg: RunConfig) -> str:
    """What determines the base model: model shape, task, warm-up steps, seed, recipe version."""
    data = {
        "model": cfg.model.model_dump(mode="json"),
        # what shapes the model: the task and its prompts, by content (the vocabulary comes from them), not its
        # reward limits; unset fields left out, so the default task keeps its fingerprint
        "task": cfg.task.model_dump(mode="json", include={"name", "max_count", "prompts", "params"},
                                    exclude_defaults=True) | {"name": cfg.task.name, "max_count": cfg.task.max_count}
        | ({"prompts_sha256": hashlib.sha256(Path(cfg.task.prompts).read_bytes()).hexdigest()}
           if cfg.task.prompts and Path(cfg.task.prompts).is_file() else {}),
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "seed": cfg.run.seed,
        "recipe": [RECIPE_VERSION, DEMO_ACCURACY, PRETRAIN_BATCH, PRETRAIN_LR],
    }
    if cfg.task.name in ("math", "tools"):  # their warm-up leaves the held-out split out (envs/tasks/math.py)
        from laminar.envs.tasks.math import HOLDOUT_BUCKETS

        data["holdout_buckets"] = HOLDOUT_BUCKETS
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def build_base_model(cfg: RunConfig, out_dir: str | Path) -> Path:
    """Build (or reuse) the tiny base model directory for cfg; returns its path."""
    out = Path(out_dir)
    fp = fingerprint(cfg)
    fp_file = out / "fingerprint.json"
    if (out / "config.json").exists() and fp_file.exists():
        if json.loads(fp_file.read_text()).get("fingerprint") == fp:
            log.info("base_model_reused", path=str(out))
            return out
    task = build_task(cfg.task, seed=cfg.run.seed)
    tok = task.tokenizer
    hf = hf_config(cfg, tok.get_vocab_size(), {"bos": task.bos_id, "eos": task.eos_id, "pad": task.pad_id})
    torch.manual_seed(cfg.run.seed)
    model = build_model(hf, seed=cfg.run.seed)
    pretrain(model, task, steps=cfg.model.pretrain_steps, seed=cfg.run.seed)
    save_pretrained(model.eval(), tok, out)
    fp_file.write_text(json.dumps({"fingerprint": fp}))
    log.info("base_model_built", path=str(out), steps=cfg.model.pretrain_steps)
    return out


def pretrain(model, task, *, steps: int, seed: int) -> None:
    """Supervised warm-up on noisy demonstrations; loss on response tokens only."""
    rng = random.Random(f"pretrain:{seed}")
    optim = torch.optim.AdamW(model.parameters(), lr=PRETRAIN_LR, weight_decay=0.0)
    model.train()
    for step in range(1, steps + 1):
        ids, targets = _demo_batch(task, rng)
        logits = model(ids, (ids != task.pad_id).long())[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100
        )
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        if step % 50 == 0 or step == steps:
            log.info("base_model_pretrain_progressed", step=step, steps=steps, loss=round(loss.item(), 4))
    model.eval()


def _demo_batch(task, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, T] prompt + noisy response, and next-token targets (-100 off the response)."""
    rows = []
    for _ in range(PRETRAIN_BATCH):
        # Warm-up prompts come from a different id range than RL prompts (which start at 0).
        prompt = task.prompt(10**9 + rng.randrange(10**9))
        rows.append((prompt.token_ids, task.demonstration(prompt, rng, DEMO_ACCURACY)))
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), task.pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width - 1), -100, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        targets[i, len(p) - 1 : len(p) + len(r) - 1] = torch.tensor(r)
    return ids, targets
