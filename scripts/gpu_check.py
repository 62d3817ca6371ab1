"""Steps 3 and 4 of scripts/gpu-check.sh: the torch engine against transformers' generate, and one trainer step
single-process and FSDP2, each beside the device's measured matmul rate. Writes <out>/gpu-check.json after each
part, so a later failure keeps the earlier figures.

    python3 scripts/gpu_check.py OUT CONTRACT_RC [--device cuda|cpu] [--shape qwen0.5b|tiny]

`--device cpu --shape tiny` is the rehearsal (`gpu-check.sh --dry-run`): every step but CUDA, in seconds.
"""

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

# Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B), random weights; `tiny` keeps its structure, shrunk
QWEN = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "initializer_range": 0.02, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151643}
SHAPES = {"qwen0.5b": (QWEN, 16, 128, (1, 8, 64)),
          "tiny": ({**QWEN, "vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2}, 8, 16, (1, 8, 64))}


def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def matmul_tflops(dev, dtype, n: int, reps: int) -> float:
    """Measured rate of an n x n x n matrix product (2 n^3 flops), the mean of `reps` after one warm-up."""
    import torch

    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    a @ b
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(dev)
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def copy_tb_s(dev, n_bytes: int, reps: int) -> float:
    """Measured device memory bandwidth of a copy, counting bytes read and written."""
    import torch

    x = torch.empty(n_bytes // 2, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    sync(dev)
    return 2 * n_bytes * reps / (time.perf_counter() - t0) / 1e12


def main(argv: list[str]) -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("contract_rc", type=int)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shape", default="qwen0.5b", choices=sorted(SHAPES))
    args = ap.parse_args(argv)
    shape, prompt_len, new, batches = SHAPES[args.shape]
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda but torch sees no CUDA device; use --dry-run on a CPU machine")
    out = args.out
    contract = (out / "contract.txt").read_text().strip().splitlines()[-1:] if (out / "contract.txt").exists() else []
    result = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else f"cpu ({platform.processor()})",
              "date": time.strftime("%Y-%m-%d"), "shape": args.shape, "torch": torch.__version__,
              "contract_rc": args.contract_rc, "contract_summary": contract, "python": platform.python_version()}

    def save():
        (out / "gpu-check.json").write_text(json.dumps(result, indent=2))

    big = dev.type == "cuda"
    result["matmul_tflops"] = {"bf16": round(matmul_tflops(dev, torch.bfloat16, 8192 if big else 256, 10), 3),
                               "fp32": round(matmul_tflops(dev, torch.float32, 8192 if big else 256, 10), 3)}
    result["copy_tb_s"] = round(copy_tb_s(dev, (2 << 30) if big else (8 << 20), 10), 3)
    save()
    import transformers

    from laminar.rl.engine import TorchEngine
    from laminar.rl.model import build_model, model_state_dict

    result["transformers"] = transformers.__version__
    ours = build_model(shape, seed=0).to(dev, torch.bfloat16).eval()
    sd = model_state_dict(ours)
    n_params = sum(p.numel() for p in ours.parameters())
    cfg = transformers.AutoConfig.for_model(**shape)
    theirs = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(dev).eval()
    missing, unexpected = theirs.load_state_dict(sd, strict=False)
    result["hf_load"] = {"missing": [m for m in missing if m != "lm_head.weight"], "unexpected": list(unexpected)}
    if result["hf_load"]["missing"] or result["hf_load"]["unexpected"]:
        save()
        raise SystemExit(f"gpu_check: our state dict does not load into transformers' model: {result['hf_load']}")
    result["params_millions"] = round(n_params / 1e6, 3)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1000, shape["vocab_size"] - 1, (max(batches), prompt_len), generator=g)
    with torch.no_grad():  # same weights, same logits (bf16)
        a, b = ours(prompts[:4].to(dev)), theirs(input_ids=prompts[:4].to(dev)).logits.float()
        result["logits_max_abs_diff_bf16"] = float((a - b).abs().max())

    def time_ours(batch):
        engine = TorchEngine(ours, None, max_inflight_seqs=batch, max_new_tokens=new, temperature=1.0, seed=0,
                             eos_id=-1, max_prompt_len=prompt_len)
        engine.load_weights(sd, 0)

        def once():
            for i in range(batch):
                engine.add(f"r{i}", prompts[i].tolist())
            n = 0
            while engine.in_flight():
                n += sum(len(f.response_ids) for f in engine.step())
            return n

        once()  # warm-up
        sync(dev)
        t0 = time.perf_counter()
        n = once()
        sync(dev)
        return n / (time.perf_counter() - t0)

    def time_theirs(batch):
        ids = prompts[:batch].to(dev)
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  pad_token_id=0)
        with torch.no_grad():
            theirs.generate(ids, **kw)  # warm-up
            sync(dev)
            t0 = time.perf_counter()
            gen = theirs.generate(ids, **kw)
            sync(dev)
        return (gen.shape[1] - prompt_len) * batch / (time.perf_counter() - t0)

    # Decode roofline: each step reads every weight once (2 bytes in bf16) for the whole batch, and does
    # 2 * params flops per token; the bound is the slower of the two.
    weight_bytes = 2 * n_params
    result["generate_tokens_per_s"] = {}
    for batch in batches:
        mine, peer = time_ours(batch), time_theirs(batch)
        bound = min(batch * result["copy_tb_s"] * 1e12 / 2 / weight_bytes,  # copy counts read + write
                    result["matmul_tflops"]["bf16"] * 1e12 / (2 * n_params))
        result["generate_tokens_per_s"][str(batch)] = {
            "torch_engine": round(mine), "transformers_generate": round(peer), "ratio": round(mine / peer, 2),
            "roofline": round(bound), "engine_of_roofline": round(mine / bound, 3)}
        print(batch, result["generate_tokens_per_s"][str(batch)], flush=True)
        save()

    # 4. one trainer step, single-process and FSDP2 (one rank: the host has one GPU)
    from laminar.config import TrainerSection
    from laminar.envs.tasks.tokenizer import build_word_tokenizer
    from laminar.records import Trajectory
    from laminar.rl.fsdp import FsdpTrainer
    from laminar.rl.model import save_pretrained
    from laminar.rl.trainer import Trainer

    theirs = None  # its memory goes back
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    rng = random.Random(0)
    batch = [Trajectory(run_id="gpu", prompt_id=i // 8, group_id=f"g{i // 8}", sample_index=i % 8,
                        prompt_ids=prompts[i].tolist(),
                        response_ids=[rng.randrange(1000, shape["vocab_size"] - 1) for _ in range(new)],
                        logprobs=[-10.0] * new, reward=rng.random(), policy_version=0, replica_id="r",
                        started_at=0.0, ended_at=0.0, finish_reason="length") for i in range(16)]
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in batch)
    # (built directly: RunConfig.load's override parser needs pydantic-settings, which the GPU host lacks)
    section = TrainerSection(backend="fsdp", fsdp_procs=1, device=args.device, dtype="bfloat16")
    with tempfile.TemporaryDirectory() as d:
        fp32 = build_model(shape, seed=0).float()
        model_dir = save_pretrained(fp32.to(torch.float32), build_word_tokenizer(["a"]), Path(d) / "qwen")
        single = Trainer(fp32.to(dev), section, group_size=8, compute_dtype=torch.bfloat16)
        sync(dev)
        t0 = time.perf_counter()
        m1 = single.step(batch, 0)
        sync(dev)
        single_s = time.perf_counter() - t0
        del single, fp32
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        fsdp = FsdpTrainer(model_dir, section, group_size=8, procs=1)
        try:
            sync(dev)
            t0 = time.perf_counter()
            m2 = fsdp.step(batch, 0)
            sync(dev)
            fsdp_s = time.perf_counter() - t0
        finally:
            fsdp.close()
    # model flops utilisation: forward + backward is ~6 * params flops per token (the first step, cold)
    peak = result["matmul_tflops"]["bf16"] * 1e12
    result["trainer_step"] = {
        "ranks": 1, "samples": len(batch), "tokens": tokens, "loss_fsdp": m2.loss, "loss_single": m1.loss,
        "grad_norm_fsdp": m2.grad_norm, "grad_norm_single": m1.grad_norm, "step_s_fsdp": round(fsdp_s, 3),
        "step_s_single": round(single_s, 3), "tokens_per_s_single": round(tokens / single_s),
        "tokens_per_s_fsdp": round(tokens / fsdp_s), "mfu_single": round(6 * n_params * tokens / single_s / peak, 4),
        "mfu_fsdp": round(6 * n_params * tokens / fsdp_s / peak, 4)}
    save()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
