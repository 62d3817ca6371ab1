"""The torch engine on a real tiny model: continuous batching, KV cache, behaviour log-probs, resume."""

from __future__ import annotations

import pytest
import torch

from laminar.envs.tasks import get_task
from laminar.errors import EngineError
from laminar.rl.engine import TorchEngine
from laminar.rl.model import build_model, model_state_dict

TASK = get_task("repeat", seed=0, max_count=16)
HF = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": TASK.tokenizer.get_vocab_size(),
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}
NO_EOS = -1  # an id never sampled: every sequence runs to max_new_tokens


def make_engine(*, slots=4, max_new_tokens=8, temperature=1.0, seed=0, eos_id=NO_EOS, model_seed=0):
    model = build_model(HF, seed=model_seed)
    engine = TorchEngine(
        model,
        TASK.tokenizer,
        max_inflight_seqs=slots,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        eos_id=eos_id,
        max_prompt_len=16,
    )
    engine.load_weights(model_state_dict(model), policy_version=3)
    return engine


def recomputed_logprobs(model, prompt_ids, response_ids, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + response_ids]))[0] / temperature
    logp = torch.log_softmax(logits, -1)[len(prompt_ids) - 1 : -1]
    return logp.gather(1, torch.tensor(response_ids)[:, None])[:, 0]


def run_to_end(engine, max_steps=200):
    out, steps = [], 0
    while engine.in_flight():
        out += engine.step()
        steps += 1
        assert steps < max_steps
    return out


def test_sequences_finish_independently_and_new_requests_join_while_others_run():
    engine = make_engine(slots=2, max_new_tokens=8)
    p = [TASK.prompt(i).token_ids for i in range(3)]
    # A resumes with 5 of its 8 tokens already generated, so it needs 3 steps; B needs 8.
    engine.add("A", p[0], prefix_ids=[3, 3, 3, 3, 3], prefix_logprobs=[-1.0] * 5)
    engine.add("B", p[1])
    assert engine.free_slots() == 0
    with pytest.raises(EngineError, match="slots are busy"):
        engine.add("X", p[2])
    finished_at = {}
    for step in range(1, 12):
        for f in engine.step():
            finished_at[f.request_id] = (step, f)
        if step == 3:
            assert engine.free_slots() == 1  # A's slot is free immediately
            engine.add("C", p[2])  # joins at step 4 while B is still running
    assert {k: v[0] for k, v in finished_at.items()} == {"A": 3, "B": 8, "C": 11}
    a = finished_at["A"][1]
    assert a.response_ids[:5] == [3, 3, 3, 3, 3] and len(a.response_ids) == 8
    assert all(f.finish_reason == "length" for _, f in finished_at.values())
    assert engine.in_flight() == 0 and engine.kv_usage() == (0, 2 * (16 + 8))


def test_kv_usage_counts_cached_positions():
    engine = make_engine(slots=4, max_new_tokens=8)
    engine.add("a", TASK.prompt(0).token_ids)  # 4 prompt tokens
    engine.add("b", TASK.prompt(1).token_ids)
    engine.step()
    engine.step()
    assert engine.kv_usage() == (2 * (4 + 2), 4 * 24)


def test_behaviour_logprobs_equal_recomputed_logprobs():
    """Mixed prompt lengths, a request joining mid-batch, a resumed prefix and temperature != 1:
    the engine's log-probs must equal a full forward of prompt + response at the same temperature."""
    engine = make_engine(slots=3, max_new_tokens=10, temperature=0.7, seed=1)
    engine.add("0", TASK.prompt(0).token_ids)
    engine.add("1", [1, 4])
    engine.add("2", TASK.prompt(2).token_ids, prefix_ids=[5, 6], prefix_logprobs=[0.0, 0.0])
    out = engine.step() + engine.step()
    out += run_to_end(engine)
    assert len(out) == 3
    engine.add("3", TASK.prompt(3).token_ids)
    out += run_to_end(engine)
    for f in out:
        start = 2 if f.request_id == "2" else 0  # the resumed prefix carries the caller's log-probs
        expected = recomputed_logprobs(engine.model, f.prompt_ids, f.response_ids, 0.7)[start:]
        torch.testing.assert_close(torch.tensor(f.logprobs[start:]), expected, atol=1e-4, rtol=1e-4)


def test_stop_on_eos_includes_the_eos_token():
    # Near-greedy sampling: find the token the model emits at step 3, then make it the <eos>.
    probe = make_engine(temperature=0.01)
    probe.add("p", TASK.prompt(0).token_ids)
    greedy = run_to_end(probe)[0].response_ids
    stop_id = greedy[2]
    engine = make_engine(temperature=0.01, eos_id=stop_id)
    engine.add("p", TASK.prompt(0).token_ids)
    (f,) = run_to_end(engine)
    first = greedy.index(stop_id)
    assert f.finish_reason == "stop" and f.response_ids == greedy[: first + 1]


def test_load_weights_only_between_batches():
    engine = make_engine()
    engine.add("a", TASK.prompt(0).token_ids)
    engine.step()
    other = build_model(HF, seed=9)
    with pytest.raises(EngineError, match="only between batches"):
        engine.load_weights(model_state_dict(other), policy_version=4)
    assert engine.policy_version == 3
    run_to_end(engine)
    engine.load_weights(model_state_dict(other), policy_version=4)
    assert engine.policy_version == 4
    assert torch.equal(engine.model.lm_head.weight, other.lm_head.weight)


def test_add_rejects_unservable_requests():
    model = build_model(HF, seed=0)
    fresh = TorchEngine(
        model, TASK.tokenizer, max_inflight_seqs=2, max_new_tokens=4, temperature=1.0, seed=0, eos_id=2
    )
    with pytest.raises(EngineError, match="no weights loaded"):
        fresh.add("a", [1, 3])
    engine = make_engine(max_new_tokens=4)
    with pytest.raises(EngineError, match="max_prompt_len"):
        engine.add("long", [1] * 17)
    with pytest.raises(EngineError, match="prefix"):
        engine.add("p", [1, 3], prefix_ids=[3, 3, 3, 3], prefix_logprobs=[0.0] * 4)


def test_snapshot_and_resume_continue_the_same_sequence():
    engine = make_engine(slots=2, max_new_tokens=10, seed=4)
    engine.add("a", TASK.prompt(0).token_ids)
    engine.add("b", TASK.prompt(1).token_ids)
    for _ in range(4):
        engine.step()
    snap = engine.snapshot_inflight()
    assert [(rid, len(r), len(lp)) for rid, _, r, lp in snap] == [("a", 4, 4), ("b", 4, 4)]
    # A fresh engine (e.g. another replica on the same policy version) resumes both.
    other = make_engine(slots=2, max_new_tokens=10, seed=5)
    for rid, prompt, resp, lps in snap:
        other.add(rid, prompt, prefix_ids=resp, prefix_logprobs=lps)
    out = {f.request_id: f for f in run_to_end(other)}
    for rid, prompt, resp, lps in snap:
        f = out[rid]
        assert f.response_ids[:4] == resp and f.logprobs[:4] == lps and len(f.response_ids) == 10
        expected = recomputed_logprobs(other.model, prompt, f.response_ids)
        torch.testing.assert_close(torch.tensor(f.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_same_seed_same_samples():
    outs = []
    for _ in range(2):
        engine = make_engine(seed=11)
        for i in range(3):
            engine.add(str(i), TASK.prompt(i).token_ids)
        outs.append(sorted((f.request_id, f.response_ids) for f in run_to_end(engine)))
    assert outs[0] == outs[1]
