"""The tiny Llama/Qwen2 model: Hugging Face names, save/load, safetensors bytes, padding, KV cache."""

from __future__ import annotations

import json

import pytest
import torch

from laminar.envs.tasks.tokenizer import build_word_tokenizer
from laminar.errors import ConfigError
from laminar.rl.model import (
    KVCache,
    build_model,
    bytes_to_state_dict,
    load_pretrained,
    model_state_dict,
    save_pretrained,
    state_dict_to_bytes,
)

WORDS = ["a", "b", "c", ":", "1", "2", "3"]


def hf_config(**over) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 3 + len(WORDS),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }
    cfg.update(over)
    return cfg


VARIANTS = {
    "llama_tied": hf_config(),
    "llama_untied": hf_config(tie_word_embeddings=False),
    "qwen2_bias": hf_config(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False
    ),
}


def test_parameter_names_are_hugging_face_names():
    names = set(model_state_dict(build_model(VARIANTS["llama_untied"], seed=0)))
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(2):
        p = f"model.layers.{i}."
        expected |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        expected |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    assert names == expected
    qwen = set(model_state_dict(build_model(VARIANTS["qwen2_bias"], seed=0)))
    assert {f"model.layers.0.self_attn.{x}_proj.bias" for x in "qkv"} <= qwen
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen
    tied = set(model_state_dict(build_model(VARIANTS["llama_tied"], seed=0)))
    assert "lm_head.weight" not in tied  # saved once, as Hugging Face does


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_save_load_round_trip_gives_identical_logits(tmp_path, variant):
    model = build_model(VARIANTS[variant], seed=1).eval()
    tok = build_word_tokenizer(WORDS)
    save_pretrained(model, tok, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    loaded, tok2, hf = load_pretrained(tmp_path)
    assert hf["model_type"] == VARIANTS[variant]["model_type"]
    assert tok2.get_vocab() == tok.get_vocab()
    ids = torch.tensor([[1, 3, 8, 6, 3, 3], [1, 4, 9, 6, 4, 2]])
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))


def test_sharded_checkpoint_loads(tmp_path):
    from safetensors.torch import save_file

    model = build_model(VARIANTS["llama_untied"], seed=2).eval()
    sd = {k: v.contiguous() for k, v in model_state_dict(model).items()}
    keys = sorted(sd)
    half = len(keys) // 2
    shards = {
        "model-00001-of-00002.safetensors": keys[:half],
        "model-00002-of-00002.safetensors": keys[half:],
    }
    for name, ks in shards.items():
        save_file({k: sd[k] for k in ks}, str(tmp_path / name))
    weight_map = {k: name for name, ks in shards.items() for k in ks}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(VARIANTS["llama_untied"]))
    build_word_tokenizer(WORDS).save(str(tmp_path / "tokenizer.json"))
    loaded, _, _ = load_pretrained(tmp_path)
    ids = torch.tensor([[1, 3, 8, 6]])
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))


def test_state_dict_bytes_round_trip_is_exact_and_not_pickle():
    model = build_model(VARIANTS["llama_tied"], seed=3)
    full = model.state_dict()  # includes the tied lm_head sharing storage with embed_tokens
    blob = state_dict_to_bytes(full)
    assert not blob.startswith(b"\x80")  # pickle protocol marker
    back = bytes_to_state_dict(blob)
    assert set(back) == set(full)
    assert all(torch.equal(back[k], full[k]) for k in full)


def test_unknown_model_type_and_mismatched_weights_raise_config_error(tmp_path):
    with pytest.raises(ConfigError, match="model_type"):
        build_model(hf_config(model_type="no-such-model"))  # gpt2 & co. load through transformers (rl/hf_model.py)
    model = build_model(VARIANTS["llama_tied"], seed=0)
    save_pretrained(model, build_word_tokenizer(WORDS), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(num_hidden_layers=3)))
    with pytest.raises(ConfigError, match="missing"):
        load_pretrained(tmp_path)


def test_padding_mask_matches_unpadded_rows():
    model = build_model(VARIANTS["llama_untied"], seed=4).eval()
    short, long = [1, 3, 8, 6], [1, 4, 9, 6, 4, 4]
    with torch.no_grad():
        ref_short = model(torch.tensor([short]))[0]
        ref_long = model(torch.tensor([long]))[0]
        right = model(torch.tensor([short + [0, 0], long]), torch.tensor([[1] * 4 + [0, 0], [1] * 6]))
        left = model(torch.tensor([[0, 0] + short]), torch.tensor([[0, 0, 1, 1, 1, 1]]))
    torch.testing.assert_close(right[0, :4], ref_short, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(right[1], ref_long, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        left[0, 2:], ref_short, atol=1e-5, rtol=1e-5
    )  # positions restart at the first real token


@pytest.mark.parametrize("variant", ["llama_tied", "qwen2_bias"])
def test_incremental_kv_cache_decode_equals_full_forward(variant):
    """Prefill two slots with prompts of different lengths, then decode token by token in one batch;
    every decode logit must equal the full-sequence logit at the same position."""
    model = build_model(VARIANTS[variant], seed=5).eval()
    seqs = [[1, 3, 8, 6, 3, 3, 5, 4, 3], [1, 4, 9, 6, 4, 4, 4, 7, 8, 9, 3]]
    prompt_lens = [3, 5]
    cache = KVCache(model.config, slots=3, max_len=16)
    slot_ids = [2, 0]  # non-trivial slot placement
    with torch.no_grad():
        full = [model(torch.tensor([s]))[0] for s in seqs]
        for s, p, slot in zip(seqs, prompt_lens, slot_ids, strict=True):
            out = model.forward_cached(
                torch.tensor([s[:p]]), torch.arange(p)[None], cache, torch.tensor([slot]), p
            )
            torch.testing.assert_close(out[0], full[seqs.index(s)][:p], atol=1e-5, rtol=1e-5)
        pos = list(prompt_lens)
        for _ in range(6):
            toks = torch.tensor([[s[q]] for s, q in zip(seqs, pos, strict=True)])
            positions = torch.tensor([[q] for q in pos])
            out = model.forward_cached(toks, positions, cache, torch.tensor(slot_ids), max(pos) + 1)
            for b, q in enumerate(pos):
                torch.testing.assert_close(out[b, 0], full[b][q], atol=1e-5, rtol=1e-5)
            pos = [q + 1 for q in pos]
