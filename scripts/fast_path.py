"""Tokens/s of the torch engine on a tiny Qwen3 at 256 new tokens per sequence (4 sequences, one CPU thread):
the built-in fast path (KV cache) against the transformers path (the prefix recomputed per token), on the same
weights, side by side. Run: python scripts/fast_path.py"""

from __future__ import annotations

import time

import torch

from laminar.rl.engine import TorchEngine
from laminar.rl.hf_model import build_hf_model
from laminar.rl.model import build_model, model_state_dict

HF = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 128,
      "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
      "head_dim": 32, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
      "tie_word_embeddings": True, "torch_dtype": "float32"}


def tokens_per_s(model: torch.nn.Module, new_tokens: int = 256, seqs: int = 4) -> float:
    """Generated tokens per second; the end-of-sequence id is outside the vocabulary, so every sequence runs
    to new_tokens."""
    engine = TorchEngine(model.eval(), None, max_inflight_seqs=seqs, max_new_tokens=new_tokens, temperature=1.0,
                         seed=0, eos_id=HF["vocab_size"], max_prompt_len=16)
    engine.load_weights(model_state_dict(model), 0)
    for i in range(seqs):
        engine.add(f"g/{i}", [1, 2, 3 + i])
    start, tokens = time.perf_counter(), 0
    while engine.in_flight():
        tokens += sum(len(f.response_ids) for f in engine.step())
    assert tokens == seqs * new_tokens
    return tokens / (time.perf_counter() - start)


def main() -> None:
    torch.set_num_threads(1)
    fast = build_model(HF, seed=0)
    slow = build_hf_model(HF, 0)
    slow.load_state_dict(fast.state_dict(), strict=False)
    a, b = tokens_per_s(fast), tokens_per_s(slow)
    print(f"fast path {a:.0f} tokens/s, transformers path {b:.0f} tokens/s, ratio {a / b:.1f}x")


if __name__ == "__main__":
    main()
