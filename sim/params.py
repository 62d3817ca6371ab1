"""Every parameter of the simulator, in one place, each with its source beside it.

Fixed before the first sweep was looked at and not tuned to the paper's results afterwards. Sources:
"datasheet" = NVIDIA H100/H800 SXM datasheet figures (the H800 has the H100's HBM3 and tensor cores);
"Qwen2.5 config" = the model's published config.json (layers, KV heads, head size, parameters); "paper" = the
Laminar paper (Sheng et al., EuroSys 2026) with its section; "measured" = this project's own measurement
(docs/benchmarks/ tables, docs/benchmarks/data/relay-bench.json); "assumed" = our estimate, named as such.

The cost functions that use these numbers are rl/costs.py's (`CostModel`), the same code the modelled engine
runs on the real stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from laminar.rl.costs import CostModel

# -- the GPU and the cluster (paper section 8.1: 128 machines x 8 H800-80GB) -------------------------------

GPU_HBM_BYTES = 80e9  # datasheet: H800 SXM 80 GB HBM3
GPU_HBM_BYTES_S = 3.35e12  # datasheet: H100/H800 SXM HBM3 bandwidth 3.35 TB/s
GPU_BF16_FLOPS = 989e12  # datasheet: H100/H800 SXM dense bf16 tensor throughput 989 TFLOP/s
GPUS_PER_MACHINE = 8  # paper 8.1: 8 GPUs per machine (placements move in whole machines)
HBM_EFFICIENCY = 0.8  # assumed: fraction of peak HBM bandwidth a decode kernel sustains
DECODE_MFU = 0.5  # assumed: fraction of peak bf16 a compute-bound decode step sustains
PREFILL_MFU = 0.4  # assumed (as [modelled].prefill_s_per_token): prefill is a large matmul
TRAIN_MFU = 0.4  # assumed (as [modelled].trainer_s_per_token): FSDP training of a dense LLM
TRAIN_FLOPS_PER_PARAM_TOKEN = 10.0  # 6 (forward + backward) + 2 (old log-probs) + 2 (reference log-probs)
STEP_OVERHEAD_S = 2e-3  # assumed: per decode step scheduling and launch cost of an engine with CUDA graphs
ALLREDUCE_S = 8e-6  # assumed: one small-message NVLink all-reduce (TP > 1: two per layer per decode step)
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default gpu_memory_utilization (its documented default)
ACTIVATION_RESERVE_BYTES = 2e9  # assumed: activations and CUDA graphs per GPU, outside the KV cache

# -- weights in motion --------------------------------------------------------------------------------------

RELAY_PUSH_BYTES_S = 100e9  # paper 8.3: actor stall 0.64 s for 32B (64 GB) and 1.40 s for 72B (145 GB)
RELAY_LINK_BYTES_S = 100e9  # paper Fig. 18: < 1.6 s for 72B (145 GB) to 127 relays, so M/bandwidth < 1.6 s
RELAY_T_START_S = 5e-6  # paper Appendix D: T_start of a few microseconds on RDMA (5 us in its example)
PCIE_BYTES_S = 50e9  # PCIe 5.0 x16 (64 GB/s raw) pinned copies, as [modelled].pcie_gbytes_s; per GPU
BROADCAST_BYTES_S = 31.5e9  # as [modelled].broadcast_gbytes_s: the paper's relay pull cuts rollout waiting by
# up to 37 % against the global NCCL sync (section 8.3), so 0.63 x the local pull's bandwidth, per GPU

# -- failures: detection and restore costs --------------------------------------------------------------------
# Measured by this project's recovery drills on the real stack (docs/benchmarks/drills.md, laminar mode, the
# default example); wall seconds of the control plane, which do not shrink on a GPU cluster.
ROLLOUT_DETECT_S = 4.00  # measured: rollout drill detected after 4.00 s (3.2-4.8 s across runs)
ROLLOUT_RESTART_S = 0.12  # measured: recovered 4.12 s - detected 4.00 s (a new replica claimed and resumed)
RELAY_DETECT_S = 2.70  # measured: relay drill detected after 2.70 s, recovered 2.81 s
RELAY_REBUILD_S = 0.11  # measured: 2.81 - 2.70 s (the chain rebuilt from the healthy relays)
TRAINER_DETECT_S = 12.80  # measured: trainer drill detected after 12.80 s (10 s heartbeat timeout + poll)
TRAINER_RESTART_S = 0.17  # measured: recovered 12.97 s - detected 12.80 s (restore from the checkpoint)
CHECKPOINT_EVERY = 10  # trainer.checkpoint_every's default: a restored trainer redoes the steps since
CHECKPOINT_LOAD_BYTES_S = 10e9  # assumed: checkpoint read (weights + optimizer) per trainer machine
MACHINE_REPLACE_S = 252.0  # paper 8.5: full recovery in about 252 s after a two-replica machine was killed
ENGINE_START_S = 60.0  # assumed: a rollout engine's restart on its GPUs (process, CUDA graphs) at scale


# -- the real stack's replica loop (the validation only: `laminar simulate --validate`) --------------------------
# Between engine steps a replica's loop flushes its partial pool, polls its relay, heartbeats and records finished
# samples; the engine waits meanwhile. Measured: `py-spy record --idle` on one rollout host (5 replica loops) for 30 s
# inside the window of `laminar bench throughput --modes laminar --workload long_tail` (commit 28ccf73, quiet 2-core
# machine, 2026-12-03): 93.6 % of the loops' wall in the engine's step, 6.4 % outside it (pool flush 2.4, relay poll
# 1.2, heartbeat hand-off 0.8, recording 0.6, weight loads 0.3). At modelled.speedup 10 each of those wall seconds is
# ten modelled ones, so the validation's twin charges it (sim/scenarios.py with_replica_loop); the paper-scale runs
# do not (on a GPU the same wall time is a different share, unmeasured).
REPLICA_LOOP_SHARE = 0.064

# -- the control plane: one run's workflow serves every claim and report (sim/control.py) ----------------------
# Measured on the default example on a 2-core machine, nothing else running (`laminar bench overhead
# examples/tiny.toml`, 2026-12-02, then `python -m bench.trainer_gaps RUN_ID` on its history): a dev server with
# SQLite, on the same 2 cores as the run. A production server (its own machines, a database cluster) answers a
# single workflow's tasks no faster in series: a workflow's tasks are one at a time whatever the cluster.
CONTROL_TASK_S = 0.010  # measured: a workflow task 10.0 ms mean (p50 8.8 ms, p99 21.2 ms) on the control worker
CONTROL_RTT_S = 0.004  # measured: an update's way to its workflow task 3.8 ms mean (server + queue)
CONTROL_DISPATCH_S = 0.0195  # measured: trainer activity schedule-to-start 9.8 ms + the trainer's head 9.7 ms
CONTROL_CONTINUE_AS_NEW_S = 0.29  # measured: the trainer's stall across a continue-as-new, p50 0.286 s (summary)
CONTROL_HANDOVER_S = 0.29  # run.handover_keep = false ("write"), assumed equal: a replica writes its pool, its
# activity starts again in the new run; a lower bound at scale: `laminar bench control --handover write` measured
# 2.4-6.6 s stalls at 10-20 synthetic replicas on a loaded machine (docs/benchmarks/control.md)
CONTROL_KEEP_STALL_S = 0.58  # measured: as shipped (run.handover_keep), each replica's park to its first claim
# answered in the next segment, p50 0.58 s at 10 synthetic replicas (p99 1.14 s), quiet 2-core machine (`laminar
# bench control --scale 0.125 --updates-per-segment 300`, 2026-12-03: docs/benchmarks/control.md); at 20-160 replicas
# 0.76-2.32 s, the growth being the first claims queued behind each other, which the FIFO above charges by itself
UPDATES_PER_SEGMENT = 1500  # run.updates_per_segment's default (laminar/config.py)


@dataclass(frozen=True)
class ModelParams:
    """One model size: the architecture (Qwen2.5 config) and the paper's parallelism (section 8.1)."""

    name: str
    params: float  # parameters (Qwen2.5 config)
    layers: int  # Qwen2.5 config: num_hidden_layers
    kv_heads: int  # Qwen2.5 config: num_key_value_heads
    head_dim: int  # Qwen2.5 config: hidden_size / num_attention_heads
    tp_laminar: int  # paper 8.1: rollout TP of Laminar and AReaL
    tp_baseline: int  # paper 8.1: rollout TP of verl, one-step and stream generation
    gpu_scales: tuple[int, ...]  # paper Table 2: the GPU counts it ran
    bytes_per_param: float = 2.0  # bf16

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V, every layer, bf16: layers x kv_heads x head_dim x 2 x 2 B (the whole replica, all TP ranks)."""
        return self.layers * self.kv_heads * self.head_dim * 2 * 2

    def kv_capacity_tokens(self, tp: int) -> int:
        """KV-cache tokens one replica of `tp` GPUs holds: vLLM's share of HBM, less weights and activations."""
        free = tp * (GPU_HBM_BYTES * GPU_MEMORY_UTILIZATION - ACTIVATION_RESERVE_BYTES) - self.weight_bytes
        if free <= 0:
            raise ValueError(f"model {self.name} does not fit a replica of tp={tp} GPUs ({self.weight_bytes / 1e9:.0f} "
                             f"GB of weights); use a larger tp")
        return int(free // self.kv_bytes_per_token)

    def costs(self, tp: int, train_gpus: int) -> CostModel:
        """rl/costs.py's cost model for one replica of `tp` GPUs and a trainer of `train_gpus` GPUs."""
        hbm = tp * GPU_HBM_BYTES_S * HBM_EFFICIENCY
        overhead = STEP_OVERHEAD_S + (2 * self.layers * ALLREDUCE_S if tp > 1 else 0.0)
        return CostModel(
            step_floor_s=self.weight_bytes / hbm + overhead,
            kv_read_s_per_token=self.kv_bytes_per_token / hbm,
            compute_s_per_seq=2 * self.params / (tp * GPU_BF16_FLOPS * DECODE_MFU),
            prefill_s_per_token=2 * self.params / (tp * GPU_BF16_FLOPS * PREFILL_MFU),
            trainer_s_per_token=TRAIN_FLOPS_PER_PARAM_TOKEN * self.params / (max(1, train_gpus) * GPU_BF16_FLOPS * TRAIN_MFU),
            # each of a replica's tp GPUs loads its own shard in parallel: the replica moves weight_bytes / tp
            # per GPU, so its bandwidths scale with tp
            weight_bytes=self.weight_bytes,
            relay_gbytes_s=RELAY_PUSH_BYTES_S / 1e9,
            pcie_gbytes_s=tp * PCIE_BYTES_S / 1e9,
            broadcast_gbytes_s=tp * BROADCAST_BYTES_S / 1e9,
        )

    def checkpoint_load_s(self, train_gpus: int) -> float:
        """Reading weights + Adam state (16 B per parameter: bf16 weights, fp32 master, two fp32 moments, less
        the bf16 copy) spread over the trainer's machines."""
        machines = max(1, math.ceil(train_gpus / GPUS_PER_MACHINE))
        return 16 * self.params / (machines * CHECKPOINT_LOAD_BYTES_S)


MODELS: dict[str, ModelParams] = {
    # Qwen2.5-7B: 28 layers, 4 KV heads, head_dim 128, 7.62B parameters; rollout TP 1 (Laminar, AReaL), 2 (others)
    "7b": ModelParams("7b", 7.62e9, 28, 4, 128, 1, 2, (16, 32, 64, 128, 256)),
    # Qwen2.5-32B: 64 layers, 8 KV heads, head_dim 128, 32.8B parameters; rollout TP 4 for every system
    "32b": ModelParams("32b", 32.8e9, 64, 8, 128, 4, 4, (32, 64, 128, 256, 512)),
    # Qwen2.5-72B: 80 layers, 8 KV heads, head_dim 128, 72.7B parameters; rollout TP 8 for every system
    "72b": ModelParams("72b", 72.7e9, 80, 8, 128, 8, 8, (64, 128, 256, 512, 1024)),
}


@dataclass(frozen=True)
class WorkloadParams:
    """What one global batch asks for (paper 8.1 unless marked)."""

    name: str
    prompts_per_batch: int = 512  # paper 8.1: global batch 8192 = 512 prompts x 16 responses
    group_size: int = 16  # paper 8.1
    prompt_tokens: int = 256  # assumed (the paper's max input is 2K; DAPO-Math prompts are short)
    response_p50_tokens: int = 2048  # assumed: a mid-training reasoning length; Fig. 2 gives the shape only
    max_response_tokens: int = 16384  # paper 8.1: max output 16K
    long_tail: bool = True  # lognormal with p99 = 10 x p50 (paper Fig. 2); False: uniform +-20 % of p50
    # multi-turn tool calling (paper 8.1: up to 8 tool calls in a code sandbox)
    turns_max: int = 1  # generation segments per trajectory: 1 + tool calls, drawn uniformly in 1..turns_max
    tool_output_tokens: int = 128  # assumed: sandbox output appended (and prefilled) after each call
    env_p50_s: float = 2.0  # assumed: median sandbox latency of one tool call
    env_tail_ratio: float = 10.0  # assumed: p99 / p50 of the sandbox latency (paper Fig. 2: a wide tail)
    max_inflight_per_replica: int = 1024  # paper 8.1: Laminar and AReaL run up to 1,024 trajectories a replica
    stream_minibatches: int = 4  # as `laminar bench throughput`: stream trains each quarter batch when complete
    max_ready_batches: int = 2  # rollout.max_ready_groups = 2 batches, as `laminar bench throughput`
    seed: int = 0


WORKLOADS: dict[str, WorkloadParams] = {
    "math": WorkloadParams("math"),
    "uniform": WorkloadParams("uniform", long_tail=False),
    # ReTool-style tool calling: up to 8 calls, so 1..9 segments; each segment a quarter of the math length
    "tool": WorkloadParams("tool", response_p50_tokens=512, turns_max=9),
}
