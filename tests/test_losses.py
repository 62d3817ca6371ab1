"""rl/losses.py against TRL's own GRPOTrainer / RLOOTrainer code on the same tensors, in float64: losses and
gradients within 1e-6. TRL runs for real (a tiny transformers model, its trainer constructed on CPU); only the
log-prob forward pass is replaced, so its loss code sees the tensors the comparison hands it."""

from __future__ import annotations

import pytest
import torch

from laminar.rl.losses import advantages, k3_kl, policy_loss, truncated_mask

trl = pytest.importorskip("trl")  # in the dev extra; skipped only where it is not installed

VOCAB = 64
EOS, PAD = 1, 0


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, "<bos>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def _trainer(tmp_path, cls_name: str, rewards: list[float], **args):
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=EOS, pad_token_id=PAD,
                      bos_token_id=2)
    config_cls = getattr(trl, cls_name.replace("Trainer", "Config"))
    conf = config_cls(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, use_cpu=True, report_to=[], bf16=False, **args)

    def reward(completions, **_):
        return rewards[: len(completions)]

    return getattr(trl, cls_name)(model=Qwen2ForCausalLM(cfg), reward_funcs=reward, args=conf,
                                  train_dataset=Dataset.from_dict({"prompt": ["w3 w4"] * 8}),
                                  processing_class=_tokenizer())


REWARDS = [0.0, 1.0, 1.0, 3.0, 2.0, 0.5, 2.0, -1.0]
GROUPS = ["a"] * 4 + ["b"] * 4


def _scored(trainer):
    return trainer._generate_and_score_completions([{"prompt": "w3 w4 w5"}] * 4 + [{"prompt": "w6 w7"}] * 4)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_advantages_match_trl(tmp_path, scale):
    out = _scored(_trainer(tmp_path, "GRPOTrainer", REWARDS, scale_rewards=scale))
    ours = advantages(torch.tensor(REWARDS, dtype=torch.float64), GROUPS, scale, unbiased=True, eps=1e-4)
    assert torch.allclose(ours, out["advantages"].double(), atol=1e-6)
    assert ours.abs().max() > 0.1  # the rewards vary: the comparison is not between zeros


def test_rloo_advantages_match_trl(tmp_path):
    out = _scored(_trainer(tmp_path, "RLOOTrainer", REWARDS, beta=0.0))
    ours = advantages(torch.tensor(REWARDS, dtype=torch.float64), GROUPS, "rloo")
    assert torch.allclose(ours, out["advantages"].double(), atol=1e-6)
    # leave-one-out: the first sample's baseline is the mean of the other three of its group
    assert float(ours[0]) == pytest.approx(0.0 - (1.0 + 1.0 + 3.0) / 3)


def test_mask_truncated_matches_trl(tmp_path):
    out = _scored(_trainer(tmp_path, "GRPOTrainer", REWARDS, mask_truncated_completions=True))
    ids = out["completion_ids"]
    full = torch.ones_like(ids)
    # a completion that ends with <eos> stopped; the rest ran into max_completion_length
    finish = ["stop" if (row == EOS).any() else "length" for row in ids]
    lengths = [int((row == EOS).nonzero()[0]) + 1 if f == "stop" else ids.shape[1] for row, f in zip(ids, finish, strict=True)]
    for i, n in enumerate(lengths):
        full[i, n:] = 0
    ours = truncated_mask(full, finish)
    assert torch.equal(ours, out["completion_mask"].to(ours.dtype))
    assert "length" in finish


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    return _trainer(tmp_path_factory.mktemp("trl"), "GRPOTrainer", REWARDS)


def _tensors(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 7
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4  # ratios well outside the clip
    ref = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    lengths = [7, 5, 1, 6, 3, 7]
    mask = torch.zeros(b, t, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return logp, old, ref, mask, adv


def _trl_loss(trainer, logp, old, ref, mask, adv, *, loss_type, level, beta, eps_low, eps_high):
    leaf = logp.clone().requires_grad_(True)
    trainer.loss_type, trainer.importance_sampling_level, trainer.beta = loss_type, level, beta
    trainer.epsilon_low, trainer.epsilon_high = eps_low, eps_high
    trainer.current_gradient_accumulation_steps = 1
    trainer.args.steps_per_generation = 1
    trainer.model.train()
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, torch.zeros_like(leaf), None)
    b, t = logp.shape
    inputs = {"prompt_ids": torch.full((b, 2), 3), "prompt_mask": torch.ones(b, 2, dtype=torch.long),
              "completion_ids": torch.full((b, t), 4), "completion_mask": mask.long(), "advantages": adv,
              "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), leaf.grad


CASES = [  # (ours: ratio level, aggregation) -> TRL (loss_type, importance_sampling_level)
    ("token", "token", "dapo", "token"),
    ("token", "sequence", "grpo", "token"),
    ("token", "constant", "dr_grpo", "token"),
    ("sequence", "sequence", "grpo", "sequence"),  # GSPO as its paper runs it
    ("sequence", "token", "dapo", "sequence"),
    ("cispo", "token", "cispo", "token"),
]


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("ratio_level,aggregation,loss_type,level", CASES)
def test_policy_loss_matches_trl(grpo, ratio_level, aggregation, loss_type, level, beta):
    logp, old, ref, mask, adv = _tensors()
    eps_low, eps_high = 0.2, 0.28
    want, want_grad = _trl_loss(grpo, logp, old, ref, mask, adv, loss_type=loss_type, level=level, beta=beta,
                                eps_low=eps_low, eps_high=1 + eps_high if loss_type == "cispo" else eps_high)
    leaf = logp.clone().requires_grad_(True)
    got = policy_loss(leaf, old, adv, mask, eps_low=eps_low, eps_high=eps_high, ratio_level=ratio_level,
                      aggregation=aggregation, constant_tokens=grpo.max_completion_length, ref_logp=ref, beta=beta)
    got.loss.backward()
    assert abs(float(got.loss.detach()) - float(want)) < 1e-6
    assert torch.allclose(leaf.grad, want_grad, atol=1e-6, rtol=0)
    assert want_grad.abs().max() > 1e-3  # a real gradient, not zeros on both sides
    assert 0 < got.clip_fraction < 1  # the clip (or cap) bites on some tokens and not on others


def test_aggregations_differ_and_kl_is_never_negative():
    logp, old, ref, mask, adv = _tensors(1)
    losses = {a: float(policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, aggregation=a,
                                   constant_tokens=7).loss) for a in ("token", "sequence", "constant")}
    assert len(set(round(v, 9) for v in losses.values())) == 3
    assert float(k3_kl(logp, ref).min()) >= 0
    assert float(k3_kl(logp, logp).abs().max()) == 0
