"""Where a run's model comes from, and how the rollout side learns its architecture.

The trainer resolves the model directory (a Hugging Face directory given in `model.path`, or the tiny
base model built for the task) and publishes its config.json and tokenizer.json to the store. Rollout
replicas on any host build the same architecture from those two small files and then take every
weight from the relay tier, so no replica needs the model directory on its own disk.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from laminar.config import RunConfig
from rl.base_model import build_base_model, fingerprint
from rl.model import build_model
from rl.tasks import get_task
from storage import keys
from storage.objects import ObjectStore

MODEL_FILES = ("config.json", "tokenizer.json")


def resolve_model_dir(cfg: RunConfig, home: Path) -> Path:
    if cfg.model.path:
        return Path(cfg.model.path)
    return build_base_model(cfg, home / "models" / f"{cfg.task.name}-{fingerprint(cfg)[:12]}")


def publish_model_files(store: ObjectStore, run_id: str, model_dir: Path) -> None:
    for name in MODEL_FILES:
        store.put(keys.model_file(run_id, name), (model_dir / name).read_bytes())


def load_run_model(store: ObjectStore, run_id: str, cfg: RunConfig):
    """(model with untrained weights, tokenizer, task) built from the run's published model files."""
    hf = json.loads(store.get(keys.model_file(run_id, "config.json")))
    tokenizer = Tokenizer.from_str(store.get(keys.model_file(run_id, "tokenizer.json")).decode())
    task = get_task(cfg.task.name, seed=cfg.run.seed, max_count=cfg.task.max_count, tokenizer=tokenizer)
    return build_model(hf, seed=0), tokenizer, task
