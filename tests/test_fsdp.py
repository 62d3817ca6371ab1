"""trainer.backend = "fsdp": FSDP2 on gloo with 2 processes (this test process is rank 0, as the trainer worker is;
rank 1 is a child `python -m rl.fsdp`) takes the same step as the single-process trainer.

Tolerances: loss and mean grad norm to 1e-5 relative; every updated weight to 2e-6 absolute. The two differ only
in the order of float32 sums (each rank's share of a minibatch, then the gradient reduction); AdamW's first
update is lr x g / (|g| + eps), about lr = 2e-3 in size for every weight with a gradient, so 2e-6 is 1e-3 of
an update: a wrong loss scale or a missed reduction moves weights by a whole update.
"""

from __future__ import annotations

import random

import pytest
import torch

from laminar.config import RunConfig
from laminar.envs.tasks.tokenizer import build_word_tokenizer
from laminar.records import Trajectory
from laminar.rl.fsdp import FsdpTrainer
from laminar.rl.model import build_model, load_pretrained, save_pretrained
from laminar.rl.trainer import Trainer

HF = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 24, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "tie_word_embeddings": True, "initializer_range": 0.1, "torch_dtype": "float32",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = build_word_tokenizer([f"w{i}" for i in range(20)])
    assert tok.get_vocab_size() <= HF["vocab_size"]
    return save_pretrained(build_model(HF, seed=3), tok, tmp_path_factory.mktemp("fsdp") / "model")


def batch(seed: int) -> list[Trajectory]:
    """Two groups of four, responses of 1-9 tokens, rewards in [0, 1], behaviour log-probs near -3."""
    rng = random.Random(seed)
    out = []
    for g in range(2):
        prompt = [rng.randrange(4, 24) for _ in range(3)]
        for i in range(4):
            n = rng.randrange(1, 10)
            out.append(Trajectory(run_id="fsdp", prompt_id=g, group_id=f"g{g}", sample_index=i, prompt_ids=prompt,
                                  response_ids=[rng.randrange(4, 24) for _ in range(n)],
                                  logprobs=[-3.0 + rng.uniform(-0.3, 0.3) for _ in range(n)],
                                  reward=rng.random(), policy_version=0, replica_id="r", started_at=0.0,
                                  ended_at=0.0, finish_reason="length"))
    return out


def test_one_fsdp_step_on_two_gloo_ranks_equals_the_single_process_step(model_dir) -> None:
    section = RunConfig.load(None, ["trainer.minibatches=2", "trainer.backend=fsdp", "trainer.fsdp_procs=2"]).trainer
    model, _, _ = load_pretrained(model_dir)
    single = Trainer(model, section, group_size=4, temperature=0.9)
    fsdp = FsdpTrainer(model_dir, section, group_size=4, temperature=0.9)
    try:
        assert fsdp.world == 2
        for version, seed in enumerate((1, 2)):  # two steps: the second starts from AdamW state of the first
            want, got = single.step(batch(seed), version), fsdp.step(batch(seed), version)
            print(f"step {version}: loss {want.loss:.7f} / {got.loss:.7f}, grad norm {want.grad_norm:.6f} / "
                  f"{got.grad_norm:.6f}")
            assert got.samples == want.samples == 8 and got.tokens == want.tokens
            assert got.loss == pytest.approx(want.loss, rel=1e-5, abs=1e-7)
            assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-5)
            assert got.clip_fraction == pytest.approx(want.clip_fraction, abs=1e-9)
            assert got.entropy == pytest.approx(want.entropy, rel=1e-6)
            full, ref = fsdp.policy_state_dict(), single.policy_state_dict()
            assert sorted(full) == sorted(ref)
            worst = max(float((full[k] - ref[k]).abs().max()) for k in ref)
            moved = min(float((ref[k] - w0).abs().max()) for k, w0 in _initial(model_dir).items())
            print(f"step {version}: max |fsdp - single| weight {worst:.2e}; smallest max move {moved:.2e}")
            assert worst <= 2e-6 and moved > 1e-4  # every tensor moved by far more than the tolerance

        # checkpoints: the FSDP trainer's parts are the single trainer's (names and values), and load back
        parts, ref_parts = fsdp.state_parts(), single.state_parts()
        assert sorted(parts["model"]) == sorted(ref_parts["model"]) and sorted(parts["optim"]) == sorted(ref_parts["optim"])
        for key, value in ref_parts["optim"].items():
            assert torch.allclose(parts["optim"][key].float(), value.float(), rtol=1e-4, atol=1e-8), key
        fsdp.load_state_parts(ref_parts)
        assert max(float((fsdp.policy_state_dict()[k] - v).abs().max()) for k, v in ref_parts["model"].items()) == 0.0
    finally:
        fsdp.close()


def _initial(model_dir) -> dict[str, torch.Tensor]:
    model, _, _ = load_pretrained(model_dir)
    return {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
