"""`laminar model export`: a committed checkpoint as a Hugging Face directory (config.json, tokenizer files and
model.safetensors), or, for a LoRA run (rl/lora.py), as a peft adapter directory (adapter_config.json,
adapter_model.safetensors) beside the tokenizer; `merge` writes the adapter merged into the run's base weights
instead, a plain model directory. The architecture and tokenizer come from the run's published model files.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from laminar.services.evaluate import load_checkpoint, load_checkpoint_weights
from laminar.services.model_files import MODEL_FILES, TOKENIZER_CONFIG
from laminar.storage import keys
from laminar.storage.objects import ObjectStore


def export_checkpoint(store: ObjectStore, checkpoint: str, out: Path, merge: bool = False) -> str:
    """Write the checkpoint RUN_ID[@STEP] to `out`; returns what was written: 'model', 'adapter' or 'merged'."""
    from laminar.rl.lora import is_adapter, write_peft_adapter
    from laminar.rl.model import build_model, model_state_dict

    run_id, loaded = load_checkpoint(store, checkpoint)
    weights = loaded.parts["model"]
    out.mkdir(parents=True, exist_ok=True)
    for name in (*MODEL_FILES, TOKENIZER_CONFIG):
        if store.exists(key := keys.model_file(run_id, name)):
            (out / name).write_bytes(store.get(key))
    if is_adapter(weights) and not merge:
        write_peft_adapter(out, weights, base_model=f"{run_id} base weights")
        return "adapter"
    model = build_model(json.loads((out / "config.json").read_text()), seed=0)
    load_checkpoint_weights(store, run_id, model, weights)
    tensors = {k: v.contiguous() for k, v in model_state_dict(model).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return "merged" if is_adapter(weights) else "model"
