"""LoRA through peft (rl/lora.py) with real parts: the config, the trainer training adapters only, a version that is
the adapter plus the base fingerprint and round-trips into the torch engine, the refusal of another base, the
checkpoint round trip, the base weights through the store, the merged and peft exports."""

from __future__ import annotations

import json
import re

import pytest
import torch

from laminar.config import RunConfig, TrainerSection
from laminar.errors import ConfigError, EngineError
from laminar.rl.engine import TorchEngine
from laminar.rl.lora import (
    FINGERPRINT_KEY,
    LoraTrainer,
    base_fingerprint,
    fingerprint_of,
    is_adapter,
    load_base,
    merged_state_dict,
    write_peft_adapter,
)
from laminar.rl.model import build_model, bytes_to_state_dict, model_state_dict, state_dict_to_bytes
from tests.test_rl_trainer import HF, on_policy_batch

pytest.importorskip("peft")

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def section(**lora) -> TrainerSection:
    return TrainerSection(lr=5e-2, lora={**LORA, **lora})


def lora_trainer(seed: int = 0, **lora) -> LoraTrainer:
    return LoraTrainer(build_model(HF, seed=seed), section(**lora), group_size=3)


def engine_for(base_seed: int = 0) -> TorchEngine:
    """A torch engine holding the base weights of build_model(HF, seed=base_seed), as a LoRA run's replica does."""
    model = build_model(HF, seed=99)  # its own init, overwritten by the base (as rl/factory.py builds it)
    fp = load_base(model, model_state_dict(build_model(HF, seed=base_seed)))
    return TorchEngine(model, None, max_inflight_seqs=4, max_new_tokens=4, temperature=1.0, seed=0, eos_id=2,
                       base_fingerprint=fp)


def test_config_is_off_by_default_and_errors_name_field_value_and_fix() -> None:
    assert RunConfig().trainer.lora is None
    cfg = RunConfig.load(None, ["--trainer.lora.r=16"])
    assert cfg.trainer.lora is not None and (cfg.trainer.lora.r, cfg.trainer.lora.alpha) == (16, 16.0)
    with pytest.raises(ConfigError, match=re.escape("trainer.lora.r=0: Input should be greater than or equal to 1 "
                                                    "(LoRA rank")):
        RunConfig.load(None, ["--trainer.lora.r=0"])
    from laminar.rl.factory import check_engines  # the engine rules (names and traits live there)

    check_engines(RunConfig.load(None, ["--trainer.lora.r=4", "--rollout.engine=vllm"]))  # LoRA requests
    with pytest.raises(ConfigError, match="trainer.backend='fsdp'"):
        check_engines(RunConfig.load(None, ["--trainer.lora.r=4", "--trainer.backend=fsdp"]))
    with pytest.raises(ConfigError, match="rollout.engine='modelled' is not implemented"):
        check_engines(RunConfig.load(None, ["--trainer.lora.r=4", "--rollout.engine=modelled",
                                            "--trainer.engine=modelled"]))


def test_target_modules_that_match_nothing_fail_at_trainer_init_listing_the_modules() -> None:
    with pytest.raises(ConfigError, match=re.escape("['qkv'] match no linear module of the model; its linear "
                                                    "modules are ['down_proj', 'gate_proj', 'k_proj', 'lm_head', "
                                                    "'o_proj', 'q_proj', 'up_proj', 'v_proj']")):
        lora_trainer(target_modules=["q_proj", "qkv"])
    with pytest.raises(ConfigError, match="lm_head shares its weight"):
        lora_trainer(target_modules=["lm_head"])


def test_all_linear_adapts_every_linear_module_but_the_output_head_and_the_engine_applies_it() -> None:
    """["all-linear"] on a model with tied embeddings (SmolLM2's shape): peft cannot find the built-in model's head, so
    left to itself it adapted lm_head too, and every replica refused every version ("adapter targets lm_head")."""
    trainer = lora_trainer(target_modules=["all-linear"])
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainer._named}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for version in range(2):
        trainer.step(on_policy_batch(trainer.model, version), trainer_version=version)
    engine = engine_for(base_seed=0)
    engine.load_weights(bytes_to_state_dict(state_dict_to_bytes(trainer.policy_state_dict())), policy_version=2)
    ids = torch.tensor([[1, 3, 4, 5, 6, 2]])
    with torch.no_grad():
        assert torch.allclose(engine.model(ids), trainer.model(ids), atol=1e-5)


def test_an_adapter_for_a_module_the_engine_lacks_is_a_permanent_error_naming_it() -> None:
    """Every version of the run would be refused the same way: a ConfigError (the replica fails for good and the run
    ends with this message), not an EngineError the replica retries without end."""
    trainer = lora_trainer()
    sd = dict(trainer.policy_state_dict())
    for suffix in (".lora_A.weight", ".lora_B.weight"):
        sd["lm_head" + suffix] = sd["model.layers.0.self_attn.q_proj" + suffix]
    with pytest.raises(ConfigError, match=re.escape("adapter targets lm_head, which this engine's model has no weight "
                                                    "of its own for")):
        engine_for(base_seed=0).load_weights(sd, policy_version=1)


def test_only_adapter_parameters_require_grad_and_a_step_changes_only_them() -> None:
    trainer = lora_trainer()
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert set(trainer._named) == set(trained)  # the optimizer holds the adapters only
    # 2 layers x 3 targets x (A, B)
    assert len(trained) == 2 * 3 * 2
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for version in range(2):  # B starts at 0, so A moves from the second step on
        trainer.step(on_policy_batch(trainer.model, version), trainer_version=version)
    after = dict(trainer.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed == set(trained)


def test_a_version_is_small_and_the_engine_gives_the_trainer_s_logits() -> None:
    trainer = lora_trainer()
    full_bytes = len(state_dict_to_bytes(model_state_dict(build_model(HF, seed=0))))
    for version in range(2):
        trainer.step(on_policy_batch(trainer.model, version), trainer_version=version)
    payload = state_dict_to_bytes(trainer.policy_state_dict())
    sd = bytes_to_state_dict(payload)  # as it travels through the relay chain
    assert is_adapter(sd) and fingerprint_of(sd) == trainer.fingerprint
    assert len(payload) < full_bytes / 3, (len(payload), full_bytes)
    engine = engine_for(base_seed=0)
    engine.load_weights(sd, policy_version=2)
    ids = torch.tensor([[1, 3, 4, 5, 6, 2], [1, 9, 7, 7, 2, 0]])
    with torch.no_grad():
        want = trainer.model(ids)
        got = engine.model(ids)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # a second version is merged into the base, not on top of the first
    trainer.step(on_policy_batch(trainer.model, 2), trainer_version=2)
    engine.load_weights(trainer.policy_state_dict(), policy_version=3)
    with torch.no_grad():
        assert torch.allclose(engine.model(ids), trainer.model(ids), atol=1e-5)
    # and the engine generates under it
    engine.add("r0", [1, 3, 4])
    while engine.in_flight():
        engine.step()


def test_a_version_of_another_base_is_refused() -> None:
    trainer = lora_trainer(seed=0)
    engine = engine_for(base_seed=1)
    with pytest.raises(EngineError, match="belongs to another base model"):
        engine.load_weights(trainer.policy_state_dict(), policy_version=0)
    plain = TorchEngine(build_model(HF, seed=0), None, max_inflight_seqs=2, max_new_tokens=4, temperature=1.0,
                        seed=0, eos_id=2)
    with pytest.raises(EngineError, match="built without its base weights"):
        plain.load_weights(trainer.policy_state_dict(), policy_version=0)
    with pytest.raises(EngineError, match="holds full weights"):
        engine_for(0).load_weights(model_state_dict(build_model(HF, seed=0)), policy_version=0)


def test_checkpoint_round_trip_continues_with_the_same_adapter() -> None:
    a = lora_trainer()
    a.step(on_policy_batch(a.model, 0), trainer_version=0)
    parts = a.state_parts()
    assert is_adapter(parts["model"]) and not any(".base_layer." in k for k in parts["model"])
    assert parts["optim"] and all(".lora_" in k for k in parts["optim"])
    restored = {name: bytes_to_state_dict(state_dict_to_bytes(p)) for name, p in parts.items()}
    b = lora_trainer()  # a restarted trainer: the same base, fresh adapters
    b.load_state_parts(restored)
    batch = on_policy_batch(a.model, 1)
    ma, mb = a.step(batch, trainer_version=1), b.step(batch, trainer_version=1)
    assert ma.loss == mb.loss and ma.grad_norm == mb.grad_norm
    sa, sb = a.policy_state_dict(), b.policy_state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    with pytest.raises(ConfigError, match="trained on base weights"):
        lora_trainer(seed=1).load_state_parts(restored)


def test_base_weights_travel_through_the_store_checked(tmp_path) -> None:
    from laminar.rl.model import save_pretrained
    from laminar.services.model_files import load_run_base, publish_base_weights
    from laminar.storage import keys
    from laminar.storage.objects import LocalObjectStore

    class _Tok:
        def save(self, path: str) -> None:
            open(path, "w").write("{}")

    base = build_model(HF, seed=0)
    model_dir = save_pretrained(base, _Tok(), tmp_path / "model")
    store = LocalObjectStore(tmp_path / "store")
    publish_base_weights(store, "run-a", model_dir)
    publish_base_weights(store, "run-a", model_dir)  # a restore writes nothing new
    model = build_model(HF, seed=5)
    assert load_base(model, load_run_base(store, "run-a")) == lora_trainer(seed=0).fingerprint
    store.put(keys.model_file("run-a", "base-model.safetensors"), b"garbage")
    with pytest.raises(Exception, match="sha256"):
        load_run_base(store, "run-a")
    with pytest.raises(ConfigError, match="has no base weights"):
        load_run_base(store, "run-b")


def test_merged_weights_and_peft_adapter_export(tmp_path) -> None:
    trainer = lora_trainer()
    for version in range(2):
        trainer.step(on_policy_batch(trainer.model, version), trainer_version=version)
    payload = trainer.policy_state_dict()
    merged = build_model(HF, seed=7)
    with torch.no_grad():
        merged.load_state_dict(merged_state_dict(model_state_dict(build_model(HF, seed=0)), payload), strict=False)
    ids = torch.tensor([[1, 3, 4, 5, 6, 2]])
    with torch.no_grad():
        assert torch.allclose(merged(ids), trainer.model(ids), atol=1e-5)
    out = write_peft_adapter(tmp_path / "adapter", payload)
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, ["q_proj", "up_proj", "v_proj"])
    from safetensors import safe_open

    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        assert f.metadata()["base_fingerprint"] == trainer.fingerprint
        assert all(k.startswith("base_model.model.model.layers.") for k in f.keys())
    assert FINGERPRINT_KEY not in config


def test_fingerprint_is_precision_independent_for_the_same_values() -> None:
    sd = model_state_dict(build_model(HF, seed=0))
    bf = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    assert base_fingerprint(bf) == base_fingerprint({k: v.float() for k, v in bf.items()})
    assert base_fingerprint(sd) != base_fingerprint(bf)


@pytest.mark.slow  # 24 s; make test stays under 15 minutes (the unit tests above stay in it)
def test_laminar_run_with_lora_then_eval_and_export(tmp_path) -> None:
    """A real run with trainer.lora on (dev stack, worker processes, relay chain): it finishes with no group
    consumed twice; its adapter checkpoint evaluates and exports (peft adapter, and merged)."""
    import os
    import subprocess
    import sys

    from tests.fixtures.stack import TEST_OVERRIDES
    from tests.test_cli import _laminar

    home = tmp_path / "home"
    env = {"LAMINAR_HOME": str(home)}
    overrides = [f"--{o}" for o in TEST_OVERRIDES if not o.startswith("run.steps")] + [
        "--task.name=math", "--rollout.max_new_tokens=8"]  # math: a task laminar eval has a held-out split of
    out = _laminar(["run", "examples/tiny.toml", "--steps", "6", "--summary", str(tmp_path / "s.json"),
                    "--run-id", "t-lora-e2e", *overrides, "--trainer.lora={\"r\": 4, \"alpha\": 8}"], env, timeout=420)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["steps"] == 6 and summary["groups_consumed_twice"] == 0 and summary["groups_consumed"] == 12
    store = home / "store" if (home / "store").is_dir() else None
    assert store is None or (store / "runs" / "t-lora-e2e" / "model" / "base.json").exists()
    # laminar eval on the adapter checkpoint (merged into the run's published base); it needs only the store
    cmd = [sys.executable, "-m", "laminar.cli.main"]
    config = tmp_path / "math.toml"
    config.write_text('[task]\nname = "math"\n[rollout]\nmax_new_tokens = 8\n[eval]\nsize = 4\n')
    ev = subprocess.run([*cmd, "eval", str(config), "--checkpoint", "t-lora-e2e@6", "--json"],
                        env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stdout[-2000:] + ev.stderr[-2000:]
    assert json.loads(ev.stdout)["policy_version"] == 6
    for merge in (False, True):
        target = tmp_path / ("merged" if merge else "adapter")
        ex = _laminar(["model", "export", "t-lora-e2e@6", "--out", str(target), *(["--merge"] if merge else [])],
                      env, timeout=300)
        assert ex.returncode == 0, ex.stdout[-2000:] + ex.stderr[-2000:]
        assert ex.stdout.strip().endswith("merged" if merge else "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    from laminar.rl.model import load_pretrained

    model, _, _ = load_pretrained(tmp_path / "merged")  # a plain Hugging Face directory
    assert model is not None


def test_the_transformers_path_trains_and_applies_adapters_too() -> None:
    """rl/hf_model.py (an architecture the built-in model does not cover): peft injects into the transformers model;
    the version's module names are the checkpoint's own, and the engine merges them into the same names."""
    pytest.importorskip("transformers")
    from laminar.rl.hf_model import build_hf_model

    hf = {**HF, "architectures": ["LlamaForCausalLM"], "head_dim": 8, "pad_token_id": 0}
    trainer = LoraTrainer(build_hf_model(hf, seed=0), section(), group_size=3)
    assert all(".lora_" in n for n in trainer._named)
    for version in range(2):
        trainer.step(on_policy_batch(trainer.model, version), trainer_version=version)
    payload = bytes_to_state_dict(state_dict_to_bytes(trainer.policy_state_dict()))
    assert all(k.startswith(("model.layers.", "lora.")) for k in payload)
    model = build_hf_model(hf, seed=3)
    fp = load_base(model, model_state_dict(build_hf_model(hf, seed=0)))
    assert fp == trainer.fingerprint
    engine = TorchEngine(model, None, max_inflight_seqs=2, max_new_tokens=4, temperature=1.0, seed=0, eos_id=2,
                         base_fingerprint=fp)
    engine.load_weights(payload, policy_version=2)
    ids = torch.tensor([[1, 3, 4, 5, 6, 2]])
    with torch.no_grad():
        assert torch.allclose(engine.model(ids), trainer.model(ids), atol=1e-5)


def test_the_single_process_loop_trains_adapters_with_lora_on(tmp_path) -> None:
    """rl/sync_loop.py (`laminar bench overhead`): with trainer.lora its trainer trains adapters and its engine merges
    each version into the base it holds."""
    from laminar.rl.base_model import build_base_model
    from laminar.rl.sync_loop import run_sync_loop

    cfg = RunConfig.load(None, ["--model.pretrain_steps=5", "--task.max_count=8", "--rollout.max_new_tokens=8",
                                "--rollout.group_size=4", "--trainer.groups_per_step=2", '--trainer.lora={"r": 2}'])
    result = run_sync_loop(cfg, build_base_model(cfg, tmp_path / "base"), steps=2)
    assert len(result.metrics) == 2 and all(m.updated for m in result.metrics)


def test_a_full_trainer_refuses_an_adapter_checkpoint() -> None:
    from laminar.rl.trainer import Trainer

    parts = lora_trainer().state_parts()
    with pytest.raises(ConfigError, match="holds a LoRA adapter, not full weights"):
        Trainer(build_model(HF, seed=0), TrainerSection(), group_size=3).load_state_parts(parts)


def test_the_exported_adapter_loads_in_peft_with_the_trainer_s_logits(tmp_path) -> None:
    """`laminar model export` of an adapter checkpoint: peft's own PeftModel.from_pretrained on the base (a
    transformers Llama holding the same weights) computes what the trainer's model computes."""
    pytest.importorskip("transformers")
    from peft import PeftModel

    from laminar.rl.hf_model import build_hf_model

    trainer = lora_trainer()
    for version in range(2):
        trainer.step(on_policy_batch(trainer.model, version), trainer_version=version)
    base = build_hf_model({**HF, "architectures": ["LlamaForCausalLM"], "head_dim": 8}, seed=3)
    load_base(base, model_state_dict(build_model(HF, seed=0)))
    out = write_peft_adapter(tmp_path / "adapter", trainer.policy_state_dict())
    peft_model = PeftModel.from_pretrained(base.hf, str(out)).eval()
    ids = torch.tensor([[1, 3, 4, 5, 6, 2]])
    with torch.no_grad():
        assert torch.allclose(peft_model(input_ids=ids).logits.float(), trainer.model(ids), atol=1e-5)
