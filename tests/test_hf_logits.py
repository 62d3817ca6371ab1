"""A model directory the project writes (rl.model.save_pretrained: config.json, model.safetensors,
tokenizer.json) loads in transformers' AutoModelForCausalLM and computes the same logits as the built-in model,
so a trained policy goes straight to the rest of the ecosystem; and an architecture the built-in model does not
cover (here Mistral) loads through transformers for training and the torch engine (rl/hf_model.py).

Tolerance: max |logit difference| <= 1e-4 in float32 (the logits are of size ~3 here). Measured on this CPU: 0.0
for the three built-in configurations (transformers 5.19.0 does the same float32 arithmetic), and 9.5e-7 between
the torch engine's and the trainer's log-probs of a Mistral model run through transformers.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM  # noqa: E402

from laminar.envs.tasks.tokenizer import build_word_tokenizer  # noqa: E402
from laminar.rl.model import build_model, load_pretrained, save_pretrained  # noqa: E402

BASE = {"vocab_size": 40, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "initializer_range": 0.1, "torch_dtype": "float32"}
CONFIGS = {
    "llama-tied": {**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": True},
    "llama-bias": {**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": True,
                   "tie_word_embeddings": False},
    "qwen2": {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": False},
    # Qwen3's real shape: head_dim set apart from hidden_size / heads, q/k norms, no biases, tied (0.6B) embeddings
    "qwen3": {**BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32,
              "attention_bias": False, "tie_word_embeddings": True, "rope_theta": 1000000.0},
    # Llama 3.2's rope scaling, its original context scaled down so that some frequencies fall in each band
    "llama3": {**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 500000.0,
               "tie_word_embeddings": True, "rope_scaling": {"rope_type": "llama3", "factor": 32.0,
                                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                             "original_max_position_embeddings": 64}},
}
TOL = 1e-4


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding, as the trainer's batches have
    return ids, mask


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_saved_checkpoint_loads_in_transformers_with_the_same_logits(name: str, tmp_path) -> None:
    model = build_model(CONFIGS[name], seed=1)
    with torch.no_grad():  # a "trained" model: biases and norms away from their initial 0 and 1
        for pname, p in model.named_parameters():
            if pname.endswith(".bias") or pname.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(pname))) * 0.1)
    out = save_pretrained(model, build_word_tokenizer([f"w{i}" for i in range(30)]), tmp_path / name)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == CONFIGS[name]["architectures"][0]
    ids, mask = _ids()
    with torch.no_grad():
        ours = model.eval()(ids, mask)
        theirs = hf(input_ids=ids, attention_mask=mask).logits.float()
    real = mask.bool()  # padded positions are not compared (each side fills them differently)
    gap = float((ours - theirs)[real].abs().max())
    print(f"{name}: max |logit difference| {gap:.2e} over {int(real.sum())} positions, logits up to "
          f"{float(ours[real].abs().max()):.2f}")
    assert gap <= TOL
    # and back: the built-in loader reads the same directory into the same logits
    again, _, _ = load_pretrained(out)
    with torch.no_grad():
        assert torch.equal(again(ids, mask), ours)


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_the_torch_engine_generates_greedily_what_transformers_generates(name: str, tmp_path) -> None:
    from laminar.rl.engine import TorchEngine
    from laminar.rl.model import CausalLM, bytes_to_state_dict, model_state_dict, state_dict_to_bytes

    model = build_model({**CONFIGS[name], "initializer_range": 0.4}, seed=3)  # far from uniform: varied tokens
    assert isinstance(model, CausalLM)  # the fast path, with its KV cache
    out = save_pretrained(model, build_word_tokenizer([f"w{i}" for i in range(30)]), tmp_path / name)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    engine = TorchEngine(model.eval(), None, max_inflight_seqs=3, max_new_tokens=40, temperature=0.0, seed=0,
                         eos_id=39, max_prompt_len=8)
    engine.load_weights(bytes_to_state_dict(state_dict_to_bytes(model_state_dict(model))), 0)  # the relay's way
    prompts = [[1, 5, 7], [4, 9, 11, 13, 2], [8]]
    for i, p in enumerate(prompts):
        engine.add(f"g/{i}", p)
    finished = {}
    while engine.in_flight():
        finished.update({f.request_id: f for f in engine.step()})
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False, eos_token_id=39,
                               pad_token_id=0)[0, len(p):].tolist()
        got = finished[f"g/{i}"].response_ids
        assert got == want, (i, got, want)
    # real sequences: not one token repeated in all of them
    assert max(len(set(f.response_ids)) for f in finished.values()) > 2


MISTRAL = {**BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "tie_word_embeddings": False,
           "sliding_window": None, "eos_token_id": 2}


def test_an_architecture_the_builtin_model_does_not_cover_trains_and_generates_through_transformers(tmp_path) -> None:
    from laminar.config import RunConfig
    from laminar.records import Trajectory
    from laminar.rl.engine import TorchEngine
    from laminar.rl.hf_model import HfCausalLM
    from laminar.rl.model import bytes_to_state_dict, model_state_dict, state_dict_to_bytes
    from laminar.rl.trainer import Trainer

    built = build_model(MISTRAL, seed=0)
    assert isinstance(built, HfCausalLM)
    out = save_pretrained(built, build_word_tokenizer([f"w{i}" for i in range(30)]), tmp_path / "mistral")
    model, tokenizer, hf = load_pretrained(out)
    assert isinstance(model, HfCausalLM) and hf["model_type"] == "mistral" and tokenizer.get_vocab_size() > 0
    names = set(model_state_dict(model))
    assert "model.layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("hf.") for n in names)
    ids, mask = _ids()
    with torch.no_grad():
        assert torch.equal(model(ids, mask), built(ids, mask))

    # the torch engine generates with it (transformers path: the prefix recomputed per token) ...
    engine = TorchEngine(build_model(MISTRAL, seed=5), None, max_inflight_seqs=4, max_new_tokens=10,
                         temperature=0.9, seed=0, eos_id=2, max_prompt_len=8)
    engine.load_weights(bytes_to_state_dict(state_dict_to_bytes(model_state_dict(model))), 0)  # the relay's way
    for i in range(4):
        engine.add(f"g/{i}", [1, 5, 7 + i])
    finished = []
    while engine.in_flight():
        finished += engine.step()
    assert len(finished) == 4
    # ... with the log-probs the trainer computes for the same tokens, which it then trains on
    trainer = Trainer(model, RunConfig().trainer, group_size=4, temperature=0.9)
    rows = [Trajectory(run_id="hf", prompt_id=0, group_id="g", sample_index=i, prompt_ids=f.prompt_ids,
                       response_ids=f.response_ids, logprobs=f.logprobs, reward=float(i) / 3, policy_version=0,
                       replica_id="r", started_at=0.0, ended_at=0.0, finish_reason=f.finish_reason)
            for i, f in enumerate(finished)]
    gap = max(abs(a - b) for row, f in zip(trainer.response_logprobs(rows), finished, strict=True)
              for a, b in zip(row, f.logprobs, strict=True))
    print(f"mistral via transformers: max |trainer - engine| log-prob {gap:.2e}")
    assert gap <= TOL
    before = {k: v.clone() for k, v in trainer.policy_state_dict().items()}
    m = trainer.step(rows, 0)
    assert m.updated and m.tokens == sum(len(f.response_ids) for f in finished) and m.loss == m.loss
    after = trainer.policy_state_dict()
    assert sorted(after) == sorted(before) and any(not torch.equal(after[k], before[k]) for k in before)
