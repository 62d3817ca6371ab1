"""The GPU check's rehearsal: `scripts/gpu-check.sh --dry-run` runs every step of the GPU host's script on the CPU
with a shrunken model, so that the GPU's minutes go to measuring, not to debugging the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_rehearses_every_step_on_the_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(["bash", "scripts/gpu-check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=420)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    assert result["contract_rc"] == 0 and result["device"].startswith("cpu")
    assert result["matmul_tflops"]["bf16"] > 0 and result["copy_tb_s"] > 0
    assert result["hf_load"] == {"missing": [], "unexpected": []}
    assert result["logits_max_abs_diff_bf16"] < 0.1  # the same weights give the same logits in both models
    assert set(result["generate_tokens_per_s"]) == {"1", "8", "64"}
    for row in result["generate_tokens_per_s"].values():
        assert row["torch_engine"] > 0 and row["transformers_generate"] > 0 and row["roofline"] > 0
    step = result["trainer_step"]
    # one FSDP2 rank computes the single-process step: the same loss to bf16 rounding
    assert abs(step["loss_fsdp"] - step["loss_single"]) < 1e-2 * abs(step["loss_single"])
    assert step["tokens_per_s_single"] > 0 and 0 < step["mfu_single"] < 1
