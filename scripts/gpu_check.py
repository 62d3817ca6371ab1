"""Steps 3 and 4 of scripts/gpu-check.sh (its header says what each does), run there as
`python3 scripts/gpu_check.py <out dir> <contract exit code>` with the repository on PYTHONPATH: the torch engine
against transformers' generate on a randomly initialised model of Qwen2.5-0.5B's shape, then one FSDP2 step beside
the single-process step. Writes <out dir>/gpu-check.json after each part, so a later failure keeps the earlier
figures.
"""

import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

# Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B), random weights
QWEN = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "initializer_range": 0.02, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151643}
PROMPT, NEW = 16, 128


def main() -> None:
    import torch

    out, contract_rc = Path(sys.argv[1]), int(sys.argv[2])
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "contract_rc": contract_rc,
              "contract_summary": (out / "contract.txt").read_text().strip().splitlines()[-1:],
              "python": platform.python_version()}

    def save():
        (out / "gpu-check.json").write_text(json.dumps(result, indent=2))

    save()
    import transformers

    from laminar.rl.engine import TorchEngine
    from laminar.rl.model import build_model, model_state_dict

    result["transformers"] = transformers.__version__
    dev = torch.device("cuda")
    ours = build_model(QWEN, seed=0).to(dev, torch.bfloat16).eval()
    sd = model_state_dict(ours)
    cfg = transformers.AutoConfig.for_model(**QWEN)
    theirs = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(dev).eval()
    missing, unexpected = theirs.load_state_dict(sd, strict=False)
    result["hf_load"] = {"missing": [m for m in missing if m != "lm_head.weight"], "unexpected": list(unexpected)}
    result["params_millions"] = round(sum(p.numel() for p in ours.parameters()) / 1e6, 1)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1000, 100000, (64, PROMPT), generator=g)
    with torch.no_grad():  # same weights, same logits (bf16)
        a, b = ours(prompts[:4].to(dev)), theirs(input_ids=prompts[:4].to(dev)).logits.float()
        result["logits_max_abs_diff_bf16"] = float((a - b).abs().max())

    def time_ours(batch):
        engine = TorchEngine(ours, None, max_inflight_seqs=batch, max_new_tokens=NEW, temperature=1.0, seed=0,
                             eos_id=-1, max_prompt_len=PROMPT)
        engine.load_weights(sd, 0)

        def once():
            for i in range(batch):
                engine.add(f"r{i}", prompts[i].tolist())
            n = 0
            while engine.in_flight():
                n += sum(len(f.response_ids) for f in engine.step())
            return n

        once()  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = once()
        torch.cuda.synchronize()
        return n / (time.perf_counter() - t0)

    def time_theirs(batch):
        ids = prompts[:batch].to(dev)
        kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  pad_token_id=0)
        with torch.no_grad():
            theirs.generate(ids, **kw)  # warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            gen = theirs.generate(ids, **kw)
            torch.cuda.synchronize()
        return (gen.shape[1] - PROMPT) * batch / (time.perf_counter() - t0)

    result["generate_tokens_per_s"] = {}
    for batch in (1, 8, 64):
        mine, peer = time_ours(batch), time_theirs(batch)
        result["generate_tokens_per_s"][str(batch)] = {"torch_engine": round(mine),
                                                       "transformers_generate": round(peer),
                                                       "ratio": round(mine / peer, 2)}
        print(batch, result["generate_tokens_per_s"][str(batch)], flush=True)
        save()

    # 4. one FSDP2 step on the GPU (one rank: this host has one GPU) beside the single-process trainer
    from laminar.config import TrainerSection
    from laminar.envs.tasks.tokenizer import build_word_tokenizer
    from laminar.records import Trajectory
    from laminar.rl.fsdp import FsdpTrainer
    from laminar.rl.model import save_pretrained
    from laminar.rl.trainer import Trainer

    theirs = None  # its GPU memory goes back
    torch.cuda.empty_cache()
    rng = random.Random(0)
    batch = [Trajectory(run_id="gpu", prompt_id=i // 8, group_id=f"g{i // 8}", sample_index=i % 8,
                        prompt_ids=prompts[i].tolist(),
                        response_ids=[rng.randrange(1000, 100000) for _ in range(NEW)], logprobs=[-10.0] * NEW,
                        reward=rng.random(), policy_version=0, replica_id="r", started_at=0.0, ended_at=0.0,
                        finish_reason="length") for i in range(16)]
    # (RunConfig.load's override parser needs pydantic-settings, which is not carried: the section is built directly)
    section = TrainerSection(backend="fsdp", fsdp_procs=1, device="cuda", dtype="bfloat16")
    with tempfile.TemporaryDirectory() as d:
        fp32 = build_model(QWEN, seed=0).float()
        model_dir = save_pretrained(fp32.to(torch.float32), build_word_tokenizer(["a"]), Path(d) / "qwen")
        single = Trainer(fp32.to(dev), section, group_size=8, compute_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m1 = single.step(batch, 0)
        torch.cuda.synchronize()
        single_s = time.perf_counter() - t0
        del single, fp32
        torch.cuda.empty_cache()
        fsdp = FsdpTrainer(model_dir, section, group_size=8, procs=1)
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            m2 = fsdp.step(batch, 0)
            torch.cuda.synchronize()
            fsdp_s = time.perf_counter() - t0
        finally:
            fsdp.close()
    result["fsdp_step"] = {"ranks": 1, "samples": 16, "tokens": m2.tokens, "loss_fsdp": m2.loss,
                           "loss_single": m1.loss, "grad_norm_fsdp": m2.grad_norm, "grad_norm_single": m1.grad_norm,
                           "step_s_fsdp": round(fsdp_s, 3), "step_s_single": round(single_s, 3)}
    save()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
