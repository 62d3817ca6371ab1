"""vLLM serving a pretrained model's LoRA versions, against vLLM loading full versions and the torch engine merging.

    .venv-vllm/bin/python scripts/vllm_lora.py MODEL_DIR [--r 16] [--versions 5] [--seqs 32] [--json OUT]

MODEL_DIR is a model directory (config.json and model.safetensors, e.g. `laminar model import-gguf --out DIR` for
SmolLM2-135M-Instruct). In one process, with the run's own code (rl/vllm_engine.py, rl/lora.py):

1. a LoRA trainer on the model (r, alpha = 2 r, every linear module but the head); its adapters are drawn at random
   (std 0.02 for A and B) so that a version moves the log-probs as a trained one does;
2. a LoRA vLLM engine (the base loaded once from the directory), then `--versions` adapter versions loaded one after
   another, each timed, and `--seqs` sequences of 64 new tokens generated under the last one, twice (the second is
   timed: tokens/s); the engine's
   recorded log-probs against the LoRA trainer's (peft, unmerged) on the same tokens: the gap per token;
3. the same with the adapter merged into vLLM's weights on each load (rollout.lora_apply = "merge");
4. the same vLLM engine shape without LoRA, `--versions` full versions loaded (the trainer's merged weights), the
   same generation: tokens/s and the gap against the merged weights;
5. the torch engine holding the base, merging each adapter version into it (rl/lora.py AdapterMerge), the same
   generation (the LoRA engine the run uses on CPU by default).

Wall seconds on this machine; run it alone. It prints a table and writes the figures as JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

MAX_NEW, MAX_PROMPT, TEMPERATURE, SEED = 64, 32, 1.0, 0


def _lora_trainer(model_dir: Path, r: int):
    from laminar.config import TrainerSection
    from laminar.rl.lora import LoraTrainer
    from laminar.rl.model import load_pretrained

    model, _, _ = load_pretrained(model_dir)
    spec = {"r": r, "alpha": 2.0 * r, "target_modules": ["all-linear"]}
    trainer = LoraTrainer(model, TrainerSection(lora=spec), group_size=2, temperature=TEMPERATURE)
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return trainer


def _generate(engine, prompts: list[list[int]]) -> tuple[list, float]:
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add(f"g{i:08d}/0", p)
    out = []
    while engine.in_flight():
        out += engine.step()
    return out, time.perf_counter() - t0


def _gap(trainer, finished) -> tuple[float, float]:
    from laminar.records import Trajectory

    rows = trainer.response_logprobs([
        Trajectory(run_id="bench", prompt_id=0, group_id=f.request_id, sample_index=0, prompt_ids=f.prompt_ids,
                   response_ids=f.response_ids, logprobs=f.logprobs, reward=0.0, policy_version=0, replica_id="r",
                   started_at=0.0, ended_at=0.0, finish_reason=f.finish_reason) for f in finished])
    gaps = [abs(t - e) for f, row in zip(finished, rows, strict=True) for t, e in zip(row, f.logprobs, strict=True)]
    return max(gaps), sum(gaps) / len(gaps)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)

    from safetensors.torch import load_file

    from laminar.config import TrainerSection
    from laminar.rl.model import state_dict_to_bytes
    from laminar.rl.trainer import Trainer
    from laminar.rl.vllm_engine import VllmEngine

    hf = json.loads((a.model_dir / "config.json").read_text())
    base = load_file(str(a.model_dir / "model.safetensors"))
    trainer = _lora_trainer(a.model_dir, a.r)
    payload = trainer.policy_state_dict()
    g = torch.Generator().manual_seed(SEED + 1)
    prompts = [torch.randint(10, int(hf["vocab_size"]) - 10, (MAX_PROMPT,), generator=g).tolist()
               for _ in range(a.seqs)]
    shape = dict(max_inflight_seqs=a.seqs, max_new_tokens=MAX_NEW, max_prompt_len=MAX_PROMPT,
                 temperature=TEMPERATURE, seed=SEED, eos_id=int(hf.get("eos_token_id") or 2), dtype="float32")
    out: dict = {"model_dir": str(a.model_dir), "r": a.r, "seqs": a.seqs, "max_new_tokens": MAX_NEW,
                 "bytes_per_version": {"lora": len(state_dict_to_bytes(payload))}}

    merged = _merged(trainer)
    out["bytes_per_version"]["full"] = len(state_dict_to_bytes(merged))
    full_trainer = Trainer(_plain(a.model_dir, merged), TrainerSection(), group_size=2, temperature=TEMPERATURE)

    def torch_engine():
        from laminar.rl.engine import TorchEngine
        from laminar.rl.lora import load_base
        from laminar.rl.model import build_model

        model = build_model(hf, seed=0)
        fp = load_base(model, base)
        kw = {k: v for k, v in shape.items() if k != "dtype"}
        return TorchEngine(model, None, base_fingerprint=fp, **kw)

    variants = {  # name: (build the engine, the version it loads, the trainer that judges its log-probs)
        "vllm_lora": (lambda: VllmEngine(hf, base=base, lora_rank=a.r, **shape), payload, trainer),
        "vllm_merge": (lambda: VllmEngine(hf, base=base, lora_rank=a.r, lora_merge=True, **shape), payload, trainer),
        "vllm_full": (lambda: VllmEngine(hf, **shape), merged, full_trainer),
        "torch_merge": (torch_engine, payload, trainer),
    }
    for name, (build, version, judge) in variants.items():
        t0 = time.perf_counter()
        engine = build()
        start_s = time.perf_counter() - t0  # the engine's start and (LoRA) the base's one load
        loads = []
        for v in range(a.versions):
            t0 = time.perf_counter()
            engine.load_weights(version, v)
            loads.append(time.perf_counter() - t0)
        _generate(engine, prompts)  # warm-up: the same batch once (shapes, caches)
        finished, wall = _generate(engine, prompts)
        tokens = sum(len(f.response_ids) for f in finished)
        out[name] = {"start_s": start_s, "load_s": loads, "load_s_median": statistics.median(loads),
                     "tokens": tokens, "generate_s": wall, "tokens_per_s": tokens / wall,
                     "gap_max_mean": _gap(judge, finished)}
        engine.close()

    print(f"{a.model_dir.name}, {a.seqs} sequences x {MAX_NEW} new tokens, float32, r={a.r}, torch threads "
          f"{torch.get_num_threads()}")
    names = list(variants)
    print(f"{'':34}" + "".join(f"{n:>14}" for n in names))
    size = out["bytes_per_version"]  # measured once per kind of version, above
    rows = [("bytes per version", lambda n: f"{size['full' if variants[n][1] is merged else 'lora']:,}"),
            ("engine start (s)", lambda n: f"{out[n]['start_s']:.2f}"),
            ("load per version, median (s)", lambda n: f"{out[n]['load_s_median']:.3f}"),
            ("generation (tokens/s)", lambda n: f"{out[n]['tokens_per_s']:.1f}"),
            ("max |trainer - engine| log-prob", lambda n: f"{out[n]['gap_max_mean'][0]:.2e}"),
            ("mean |trainer - engine| log-prob", lambda n: f"{out[n]['gap_max_mean'][1]:.2e}")]
    for label, cell in rows:
        print(f"{label:34}" + "".join(f"{cell(n):>14}" for n in names))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return out


def _merged(trainer) -> dict[str, torch.Tensor]:
    """The full weights a LoRA trainer's version stands for: its base with every adapter merged (rl/lora.py)."""
    from laminar.rl.lora import merged_state_dict
    from laminar.rl.model import model_state_dict

    base = {k.replace("base_layer.", ""): v for k, v in model_state_dict(trainer.model).items() if ".lora_" not in k}
    return merged_state_dict(base, trainer.policy_state_dict())


def _plain(model_dir: Path, weights: dict[str, torch.Tensor]):
    from laminar.rl.model import load_model_state, load_pretrained

    model, _, _ = load_pretrained(model_dir)
    load_model_state(model, weights)
    return model


if __name__ == "__main__":
    main()
