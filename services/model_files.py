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
from laminar.envs.tasks import build_task
from laminar.envs.tasks.tokenizer import with_model_specials
from laminar.errors import ConfigError
from laminar.rl.base_model import build_base_model, fingerprint
from laminar.storage import keys
from laminar.storage.objects import ObjectStore

MODEL_FILES = ("config.json", "tokenizer.json")
# published beside them: a pretrained model's special tokens and chat template ({} for the tiny base model)
TOKENIZER_CONFIG = "tokenizer_config.json"


def check_model_path(cfg: RunConfig) -> None:
    """Fail fast, before anything starts, when `model.path` is set but is not a Hugging Face model
    directory (config.json, tokenizer.json and safetensors weights). An empty path is fine: the trainer
    builds the task's tiny base model."""
    if not cfg.model.path:
        return
    d = Path(cfg.model.path)
    fix = ("set --model.path to a Hugging Face model directory (config.json, tokenizer.json, "
           "model.safetensors), or leave model.path empty to train the task's tiny base model")
    if not d.is_dir():
        raise ConfigError(f"model.path={cfg.model.path!r} is not a directory on this host; {fix}")
    weights = ("model.safetensors", "model.safetensors.index.json")
    missing = [name for name in MODEL_FILES if not (d / name).is_file()]
    if not any((d / name).is_file() for name in weights):
        missing.append(" or ".join(weights))
    if missing:
        raise ConfigError(f"model.path={cfg.model.path!r} has no {', '.join(missing)}; {fix}")


def resolve_model_dir(cfg: RunConfig, home: Path) -> Path:
    """The trainer's model directory: model.path, or the task's tiny base model (built once under home).
    Never needed by a modelled run (trainer.engine = 'modelled' builds no model)."""
    if cfg.model.path:
        check_model_path(cfg)
        return Path(cfg.model.path)
    return build_base_model(cfg, home / "models" / f"{cfg.task.name}-{fingerprint(cfg)[:12]}")


def tokenizer_config(model_dir: Path) -> dict:
    """The directory's tokenizer_config.json ({} when absent) with its chat template inlined: transformers 5
    saves the template beside it as chat_template.jinja (rl/gguf_import.py writes both)."""
    path, jinja = model_dir / "tokenizer_config.json", model_dir / "chat_template.jinja"
    out = json.loads(path.read_text()) if path.is_file() else {}
    if jinja.is_file():
        out["chat_template"] = jinja.read_text()
    return out


def publish_model_files(store: ObjectStore, run_id: str, model_dir: Path) -> None:
    for name in MODEL_FILES:
        store.put(keys.model_file(run_id, name), (model_dir / name).read_bytes())
    store.put(keys.model_file(run_id, TOKENIZER_CONFIG), json.dumps(tokenizer_config(model_dir)).encode())


def load_run_files(store: ObjectStore, run_id: str, cfg: RunConfig):
    """(config.json as a dict, tokenizer, task) of the run: what an engine builds its model from (rl.factory).
    A modelled run has none: its trainer publishes no model files."""
    hf = json.loads(store.get(keys.model_file(run_id, "config.json")))
    tokenizer = Tokenizer.from_str(store.get(keys.model_file(run_id, "tokenizer.json")).decode())
    key = keys.model_file(run_id, TOKENIZER_CONFIG)
    tok_cfg = json.loads(store.get(key)) if store.exists(key) else {}
    if tok_cfg.get("eos_token"):  # a pretrained model's tokenizer (the word-level one has <pad>, <bos>, <eos>)
        tokenizer = with_model_specials(tokenizer, tok_cfg)
    task = build_task(cfg.task, seed=cfg.run.seed, tokenizer=tokenizer, chat_template=tok_cfg.get("chat_template"))
    return hf, tokenizer, task


BASE_INDEX = "base.json"  # a LoRA run's base weights: {"files": {name: sha256}}, each file under "base-<name>"


def weight_files(model_dir: Path) -> list[str]:
    """The directory's safetensors weight files (one, or the shards its index names)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"]


def publish_base_weights(store: ObjectStore, run_id: str, model_dir: Path) -> None:
    """With trainer.lora, versions are adapters: rollout replicas read the base weights from the store once
    (load_run_base). Written once per run (a restore finds the same checksums and writes nothing), index last."""
    from laminar.storage.objects import sha256_hex

    data = {name: (model_dir / name).read_bytes() for name in weight_files(model_dir)}
    index = json.dumps({"files": {name: sha256_hex(b) for name, b in data.items()}}, sort_keys=True).encode()
    index_key = keys.model_file(run_id, BASE_INDEX)
    if store.exists(index_key) and store.get(index_key) == index:
        return
    for name, b in data.items():
        store.put(keys.model_file(run_id, f"base-{name}"), b)
    store.put(index_key, index)


def load_run_base(store: ObjectStore, run_id: str) -> dict:
    """The run's base weights {name: tensor} as its trainer published them, each file checked against its sha256."""
    from safetensors.torch import load

    from laminar.errors import CorruptDataError
    from laminar.storage.objects import sha256_hex

    index_key = keys.model_file(run_id, BASE_INDEX)
    if not store.exists(index_key):
        raise ConfigError(f"run {run_id} has no base weights in the store ({index_key}); its trainer publishes them "
                          "at start when trainer.lora is set: start the trainer first, or unset trainer.lora")
    out: dict = {}
    for name, sha in json.loads(store.get(index_key))["files"].items():
        data = store.get(keys.model_file(run_id, f"base-{name}"))
        if sha256_hex(data) != sha:
            raise CorruptDataError(f"run {run_id} base weights {name}: sha256 {sha256_hex(data)[:8]}.. does not "
                                   f"match the index's {sha[:8]}..; the store holds a corrupt object")
        out.update(load(data))
    return out
