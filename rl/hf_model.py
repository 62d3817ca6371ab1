"""Any Hugging Face causal LM through transformers, for an architecture the built-in model (rl/model.py: Llama,
Qwen2) does not cover. rl.model.build_model and rl.model.load_pretrained hand such a config.json here.

`HfCausalLM` gives the transformers model the interface the trainer and the torch engine use:
- `forward(input_ids, attention_mask)` -> float32 logits [B, T, V];
- `forward_cached(input_ids, positions, cache, slots, kv_len)`, the torch engine's call. transformers' own KV
  caches do not fit the engine's per-slot layout, so this path keeps the slot's token ids (not keys and values)
  and recomputes the slot's prefix [0, kv_len) on every call: correct (causal attention: a query at position p
  sees positions <= p only) but O(length) per token. Use it to train an architecture; for generation speed use
  rollout.engine = 'vllm' or a Llama/Qwen2 model;
- `state_dict()` / `load_state_dict()` / `named_parameters()` with the checkpoint's own names (no wrapper
  prefix), so weights published, checkpointed and saved are plain Hugging Face tensors;
- `config`: tie_word_embeddings, raw (config.json) and an empty KV shape for rl.model.KVCache.

transformers is imported only here (pinned in the `hf` extra and in `dev`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from laminar.errors import ConfigError


@dataclass(frozen=True)
class HfConfig:
    tie_word_embeddings: bool
    raw: dict[str, Any] = field(default_factory=dict)
    # rl.model.KVCache allocates [layers, slots, kv_heads, max_len, head_dim]: nothing for this path
    num_hidden_layers: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "this model's config.json names an architecture the built-in model does not cover (model_type other "
            "than llama or qwen2); it loads through transformers, which is not installed: pip install "
            "'laminar[hf]' (transformers==5.19.0)"
        ) from None
    return transformers


class HfCausalLM(nn.Module):
    def __init__(self, hf_model: nn.Module, raw: dict[str, Any]):
        super().__init__()
        self.hf = hf_model
        self.config = HfConfig(tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), raw=dict(raw))

    # names without the wrapper's prefix: the checkpoint's own
    def state_dict(self, *args, **kwargs):
        return self.hf.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.hf.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.hf.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.hf(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()

    def forward_cached(self, input_ids, positions, cache, slots, kv_len: int) -> torch.Tensor:
        """Write the tokens at (slots[b], positions[b, t]) of the cache's token table, run each slot's prefix
        [0, kv_len) and return the logits at `positions` [B, T, V]."""
        table = getattr(cache, "token_ids", None)
        if table is None:
            table = torch.zeros(cache.slots, cache.max_len, dtype=torch.long, device=input_ids.device)
            cache.token_ids = table
        table[slots[:, None], positions] = input_ids
        logits = self.forward(table[slots, :kv_len])
        rows = torch.arange(len(slots), device=input_ids.device)[:, None]
        return logits[rows, positions]


def build_hf_model(hf_config: dict[str, Any], seed: int | None = None) -> HfCausalLM:
    """A freshly initialised transformers model of this config.json (float32 unless it says otherwise)."""
    transformers = _transformers()
    try:
        config = transformers.AutoConfig.for_model(**hf_config)
    except (ValueError, KeyError) as e:
        raise ConfigError(
            f"config.json model_type={hf_config.get('model_type')!r} is neither built in (llama, qwen2) nor known "
            f"to transformers {transformers.__version__} ({e}); use a Hugging Face causal LM directory"
        ) from None
    with torch.random.fork_rng():  # seeded without touching the caller's generator
        if seed is not None:
            torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return HfCausalLM(model, hf_config).eval()


def load_hf_pretrained(model_dir, hf_config: dict[str, Any], dtype: torch.dtype | None) -> HfCausalLM:
    transformers = _transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype or "auto")
    return HfCausalLM(model, hf_config).eval()
