"""Held-out evaluation (rl/evaluation.py, services/evaluate.py, `laminar eval`): the figures, the math task's held-out
split, greedy decoding, and an evaluation of a checkpoint written by a run that has ended, read from the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from laminar.config import RunConfig
from laminar.envs.tasks import get_task
from laminar.envs.tasks.math import WARMUP_IDS, is_held_out, problem_key
from laminar.errors import ConfigError
from laminar.evalstats import PromptResult, summarise
from laminar.rl.evaluation import eval_prompts

LEVELS = [{"max_terms": 2, "max_digits": 1}, {"max_terms": 3, "max_digits": 2}]


def test_summarise_worked_example():
    results = [PromptResult("a", rewards=[1.0, 0.0], lengths=[4, 6]),
               PromptResult("b", rewards=[0.0, 0.0], lengths=[5, 5]),
               PromptResult("c", rewards=[1.0, None], lengths=[3], failures=["timeout: x"])]
    s = summarise(results, samples=2, threshold=1.0)
    # per prompt c_i / n: 0.5, 0, 0.5 -> accuracy 1/3; pass@2: a and c passed once -> 2/3
    assert s.accuracy == pytest.approx(1 / 3) and s.pass_at_k == pytest.approx(2 / 3)
    # stderr: deviations 1/6, -1/3, 1/6 -> var (1/36 + 1/9 + 1/36) / 2 = 1/12; sqrt(1/12 / 3) = 1/6
    assert s.accuracy_stderr == pytest.approx(1 / 6)
    # mean@2 with the failure as 0: (0.5 + 0 + 0.5) / 3; mean reward over the 5 scored samples: 2 / 5
    assert s.mean_at_k == pytest.approx(1 / 3) and s.mean_reward == pytest.approx(0.4)
    assert s.failures == 1 and s.response_len_mean == pytest.approx(23 / 5) and s.prompts == 3


def test_math_heldout_split_is_disjoint_from_training_and_has_every_level():
    task = get_task("math", seed=3, levels=LEVELS, prompts_per_level=50)
    rows = task.heldout_rows(16)
    keys = [problem_key("chain_sum", r.metadata) for r in rows]
    assert len(rows) == 16 and len(set(keys)) == 16, "distinct problems"
    assert all(is_held_out(k) for k in keys)
    assert rows[0].metadata["level"] == 1 and {r.metadata["level"] for r in rows} == {0, 1}, "the hardest first"
    # neither the training stream (both levels) nor the warm-up shows a held-out problem
    ids = [*range(200), *range(WARMUP_IDS, WARMUP_IDS + 200)]
    training = {problem_key("chain_sum", task.source.row(p).metadata) for p in ids}
    assert not training & set(keys) and not any(is_held_out(k) for k in training)
    again = get_task("math", seed=3, levels=LEVELS, prompts_per_level=50).heldout_rows(16)
    assert [r.prompt for r in again] == [r.prompt for r in rows], "seeded: the same split every time"
    other = get_task("math", seed=4, levels=LEVELS, prompts_per_level=50).heldout_rows(16)
    assert [r.prompt for r in other] != [r.prompt for r in rows]
    assert rows[0].id == "chain_sum:heldout:1:0"


def test_eval_prompts_from_a_file_in_file_order(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n"
                            for i in range(5)))
    task = get_task("math", seed=0, levels=LEVELS[:1])
    cfg = RunConfig.load(None, ["eval.size=3"])
    prompts = eval_prompts(task, cfg.eval, str(path))
    assert [p.source_id for p in prompts] == ["q0", "q1", "q2"]
    assert prompts[1].token_ids == task.prompt_from_row(_row(path, 1), 1).token_ids


def _row(path, i):
    from laminar.envs.tasks.prompt_file import FilePrompts

    return FilePrompts(path, shuffle=False).rows[i]


def test_a_task_without_a_split_needs_a_file():
    task = get_task("math", seed=0, generator="chain_sum", levels=LEVELS[:1])
    with pytest.raises(ConfigError, match="eval.prompts"):
        eval_prompts(get_task("file", prompts=task.source), RunConfig().eval)


def test_greedy_decoding_ignores_the_sampling_seed():
    import torch

    from laminar.rl.engine import TorchEngine
    from laminar.rl.model import build_model

    task = get_task("math", seed=0, levels=LEVELS[:1])
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": task.tokenizer.get_vocab_size(),
          "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "intermediate_size": 64, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    outs = []
    for seed in (0, 1):
        model = build_model(hf, seed=0)
        engine = TorchEngine(model, task.tokenizer, max_inflight_seqs=4, max_new_tokens=6, temperature=0.0,
                             seed=seed, eos_id=task.eos_id)
        engine.load_weights({k: v.clone() for k, v in model.state_dict().items()}, 0)
        for i in range(4):
            engine.add(str(i), task.prompt(i).token_ids)
        done = []
        while engine.in_flight():
            done.extend(engine.step())
        outs.append(sorted((f.request_id, tuple(f.response_ids)) for f in done))
        assert all(lp <= 0 for f in done for lp in f.logprobs)
    assert outs[0] == outs[1]
    assert torch.is_grad_enabled()


def test_evaluate_a_model_directory_stores_the_record(tmp_path):
    from laminar.rl.base_model import build_base_model
    from laminar.services.eval_records import read_evals
    from laminar.services.evaluate import evaluate
    from laminar.storage.objects import open_store

    cfg = RunConfig.load(None, ["task.name=math", "model.pretrain_steps=0", "rollout.max_new_tokens=6",
                                "eval.size=5", "eval.samples=3", "eval.temperature=1.0", "run.run_id=r-eval"])
    model_dir = build_base_model(cfg, tmp_path / "model")
    store = open_store((tmp_path / "store").as_uri())
    outcome = evaluate(store, cfg, str(model_dir))
    assert outcome.target.run_id == "r-eval" and outcome.target.policy_version == 0
    assert outcome.summary.prompts == 5 and outcome.summary.samples == 3
    (record,) = read_evals(store, "r-eval")
    assert [len(p["rewards"]) for p in record["per_prompt"]] == [3] * 5
    assert sum(len(p["lengths"]) for p in record["per_prompt"]) == 15, "every sample generated once"
    assert record["prompt_set"] == "task:math:heldout"


@pytest.mark.slow  # ~60 s: a run on the stack, then the CLI in a child process
async def test_laminar_eval_of_a_checkpoint_of_an_ended_run(stack, tmp_path):
    """A short run ends; `laminar eval` (the real CLI, a child process) evaluates its last committed checkpoint from
    the store with the math task's held-out split, and stores the record under the run."""
    from laminar.client.run_control import start_workflow
    from laminar.storage import keys
    from tests.fixtures.stack import small_config

    overrides = ["task.name=math", "rollout.max_new_tokens=8", "eval.size=12", "eval.samples=2",
                 "eval.temperature=1.0"]
    cfg = small_config(*overrides)
    handle = await start_workflow(stack.client, cfg)
    final = await handle.result()
    assert final.step == cfg.run.steps
    config = tmp_path / "math.toml"
    config.write_text('[task]\nname = "math"\n[rollout]\nmax_new_tokens = 8\n'
                      '[eval]\nsize = 12\nsamples = 2\ntemperature = 1.0\n')
    env = {**os.environ, "LAMINAR_HOME": str(stack.home), "LAMINAR_STORE": stack.settings.store_url}
    out = subprocess.run([sys.executable, "-m", "laminar.cli.main", "eval", str(config), "--checkpoint",
                          f"{cfg.run.run_id}@{cfg.run.steps}", "--json"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    shown = json.loads(out.stdout)
    assert shown["prompts"] == 12 and shown["samples"] == 2 and shown["policy_version"] == cfg.run.steps
    record = json.loads(stack.store.get(keys.eval_result(cfg.run.run_id, cfg.run.steps)))
    assert len(record["per_prompt"]) == 12 and all(len(p["rewards"]) == 2 for p in record["per_prompt"])
    assert record["accuracy"] == pytest.approx(shown["accuracy"]) and 0.0 <= record["accuracy"] <= 1.0
    missing = subprocess.run([sys.executable, "-m", "laminar.cli.main", "eval", str(config), "--checkpoint",
                              f"{cfg.run.run_id}@999"], capture_output=True, text=True, env=env, timeout=300)
    assert missing.returncode == 1 and "no committed checkpoint at step 999" in missing.stderr
