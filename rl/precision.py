"""Whether this CPU computes in bfloat16 natively: the check behind `trainer.dtype` and `rollout.dtype` on CPU.

Without the avx512_bf16 or amx_bf16 instructions torch emulates bfloat16 matmuls, slower than float32, so a
bfloat16 run there is refused rather than silently slow.
"""

from __future__ import annotations

from pathlib import Path

import torch

from laminar.errors import ConfigError

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_bf16_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The bfloat16 instruction flags this CPU reports (empty where /proc/cpuinfo is absent or has none)."""
    try:
        words = set(cpuinfo.read_text().split())
    except OSError:
        words = set()
    return words & set(BF16_FLAGS)


def check_cpu_dtype(field: str, device: torch.device | str, dtype: torch.dtype | None,
                    flags: set[str]) -> None:
    """ConfigError when `<field>` asks for bfloat16 on a CPU whose `flags` have no bfloat16 instructions."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or flags & set(BF16_FLAGS):
        return
    raise ConfigError(
        f"{field}='bfloat16' on a CPU without bfloat16 instructions (no {' or '.join(BF16_FLAGS)} in its flags): "
        f"torch would emulate it, slower than float32; set {field} = 'float32', or run this worker on a CPU with "
        "avx512_bf16/amx_bf16 or on a GPU")
