"""What the Laminar paper (Sheng et al., EuroSys 2026) reports, for printing beside the simulator's numbers.

Only values stated in the paper's text; per-scale throughputs and speedups other than these appear only in its
plots and are not reproduced here.
"""

from __future__ import annotations

# Fig. 11 / section 8.1 (single-turn math): Laminar's speedup over each baseline, (average, max) across scales
FIG11_SPEEDUP = {
    "sync": (2.56, 5.49),  # verl
    "one_step": (1.98, 4.09),
    "stream": (1.93, 4.06),
    "partial_rollout": (1.39, 1.81),  # AReaL
}
FIG11_LARGEST_SCALE_AVERAGE = 3.34  # average speedup at each model's largest scale, across baselines and sizes
SMALL_SCALE_AVERAGE = 1.41  # Appendix B: <= 64 GPUs
SCALING_EFFICIENCY = {"laminar": 0.537, "partial_rollout": 0.336}  # section 8.1, math; laminar 32B: 0.682

# Table 2: trainer / rollout GPUs per system and scale ("colocated" for verl). The two 72B Laminar cells at 512
# and 1,024 GPUs do not add up in the text (192/192, 256/256) and are left out.
TABLE2 = {
    "7b": {
        16: {"one_step": "8/8", "stream": "8/8", "partial_rollout": "8/8", "laminar": "8/8"},
        32: {"one_step": "8/24", "stream": "8/24", "partial_rollout": "16/16", "laminar": "24/8"},
        64: {"one_step": "16/48", "stream": "16/48", "partial_rollout": "32/32", "laminar": "40/24"},
        128: {"one_step": "32/96", "stream": "32/96", "partial_rollout": "64/64", "laminar": "80/48"},
        256: {"one_step": "40/216", "stream": "40/216", "partial_rollout": "128/128", "laminar": "192/64"},
    },
    "32b": {
        32: {"one_step": "16/16", "stream": "16/16", "partial_rollout": "16/16", "laminar": "16/16"},
        64: {"one_step": "32/32", "stream": "32/32", "partial_rollout": "32/32", "laminar": "32/32"},
        128: {"one_step": "48/80", "stream": "48/80", "partial_rollout": "64/64", "laminar": "64/64"},
        256: {"one_step": "64/192", "stream": "64/192", "partial_rollout": "128/128", "laminar": "128/128"},
        512: {"one_step": "80/432", "stream": "80/432", "partial_rollout": "256/256", "laminar": "256/256"},
    },
    "72b": {
        64: {"one_step": "32/32", "stream": "32/32", "partial_rollout": "32/32", "laminar": "32/32"},
        128: {"one_step": "64/64", "stream": "64/64", "partial_rollout": "64/64", "laminar": "64/64"},
        256: {"one_step": "96/160", "stream": "96/160", "partial_rollout": "128/128", "laminar": "128/128"},
        512: {"one_step": "192/320", "stream": "192/320", "partial_rollout": "320/192"},
        1024: {"one_step": "256/768", "stream": "256/768", "partial_rollout": "640/384"},
    },
}


def table2(model: str, gpus: int, mode: str) -> str:
    if mode == "sync":
        return "colocated"
    return TABLE2.get(model, {}).get(gpus, {}).get(mode, "-")
