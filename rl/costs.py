"""The modelled GPU's cost functions: one copy, used by the modelled engine and trainer (rl/modelled.py, which
`laminar bench throughput` runs on the real stack) and by the discrete-event simulator (sim/, `laminar
simulate`). Pure arithmetic on a frozen `CostModel`; no clock, no state.

Decode step (one token for every active sequence of a replica):

    step_s(batch, kv_tokens) = step_floor_s + kv_tokens x kv_read_s_per_token,   memory-bound, or
                               batch x compute_s_per_seq,                         compute-bound,

whichever is larger. `step_floor_s` is the weight read (plus fixed per-step overheads), `kv_read_s_per_token`
the attention's read of one cached token, `compute_s_per_seq` one sequence's share of the matrix work. The
decode batch at which the two meet with an empty cache is the roofline batch (step_floor_s /
compute_s_per_seq). The modelled engine's historic model (flat `decode_step_s` up to `roofline_batch`,
linear above; `CostModel.from_modelled`) is the special case kv_read_s_per_token = 0 and compute_s_per_seq =
decode_step_s / roofline_batch.

Weights: a laminar replica pulls from its host's relay (one chain hop charged to the puller, conservatively,
plus the local PCIe pull; a second hop when its own relay is gone); the global-sync modes pay one NCCL
broadcast. The trainer's publish stall is the push to the master relay, or the broadcast. The chain broadcast
itself follows the paper's Appendix D model (`chain_broadcast_s`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type-only import: laminar.config does not import rl
    from laminar.config import ModelledSection


@dataclass(frozen=True)
class CostModel:
    """Every time the modelled GPU charges, in modelled seconds per unit."""

    step_floor_s: float  # one decode step at an empty cache, memory-bound (weight read + fixed overheads)
    kv_read_s_per_token: float  # extra decode-step time per cached token (attention's KV read)
    compute_s_per_seq: float  # compute-bound decode step time per active sequence
    prefill_s_per_token: float  # prefill (and re-prefill) per prompt or prefix token
    trainer_s_per_token: float  # trainer time per batch token (prompt + response) on the whole trainer
    weight_bytes: float  # one policy version (B)
    relay_gbytes_s: float  # trainer -> master relay push, relay -> relay hop (GB/s)
    pcie_gbytes_s: float  # local pull, relay shared memory -> GPU (GB/s)
    broadcast_gbytes_s: float  # global NCCL weight sync (GB/s)

    @classmethod
    def from_modelled(cls, m: ModelledSection) -> CostModel:
        """The [modelled] section's engine: flat decode_step_s up to roofline_batch, linear above, no KV term."""
        return cls(
            step_floor_s=m.decode_step_s,
            kv_read_s_per_token=0.0,
            compute_s_per_seq=m.decode_step_s / m.roofline_batch,
            prefill_s_per_token=m.prefill_s_per_token,
            trainer_s_per_token=m.trainer_s_per_token,
            weight_bytes=m.weight_bytes(),
            relay_gbytes_s=m.relay_gbytes_s,
            pcie_gbytes_s=m.pcie_gbytes_s,
            broadcast_gbytes_s=m.broadcast_gbytes_s,
        )

    # -- rollout -------------------------------------------------------------------------------------------

    def decode_step_s(self, batch: int, kv_tokens: float = 0.0) -> float:
        """One decode step over `batch` active sequences with `kv_tokens` cached (module docstring)."""
        return max(self.step_floor_s + kv_tokens * self.kv_read_s_per_token, batch * self.compute_s_per_seq)

    def decode_steps_s(self, batch: int, kv_tokens: float, steps: int) -> float:
        """`steps` decode steps over `batch` sequences whose cache starts at `kv_tokens` and grows by `batch`
        tokens a step: the memory-bound sum (an arithmetic series) or the compute-bound one, whichever is larger
        (exact when one regime holds for all the steps; at a crossing it slightly under-counts)."""
        if steps <= 0 or batch <= 0:
            return 0.0
        memory = steps * (self.step_floor_s + kv_tokens * self.kv_read_s_per_token) \
            + self.kv_read_s_per_token * batch * steps * (steps - 1) / 2
        return max(memory, steps * batch * self.compute_s_per_seq)

    def steps_within(self, batch: int, kv_tokens: float, seconds: float) -> int:
        """The most whole decode steps that `decode_steps_s` fits in `seconds` (the inverse, rounded down)."""
        if seconds <= 0 or batch <= 0:
            return 0
        a = self.step_floor_s + kv_tokens * self.kv_read_s_per_token
        b = self.kv_read_s_per_token * batch / 2
        compute = batch * self.compute_s_per_seq
        # memory: b s^2 + (a - b) s <= seconds
        if b > 0:
            s_mem = (-(a - b) + math.sqrt((a - b) ** 2 + 4 * b * seconds)) / (2 * b)
        else:
            s_mem = seconds / a
        s_cmp = seconds / compute if compute > 0 else math.inf
        s = int(min(s_mem, s_cmp) + 1e-9)
        while s > 0 and self.decode_steps_s(batch, kv_tokens, s) > seconds * (1 + 1e-12):
            s -= 1
        return s

    def roofline_batch(self) -> int:
        """The decode batch at which a step turns compute-bound with an empty cache (>= 1)."""
        return max(1, round(self.step_floor_s / self.compute_s_per_seq))

    def prefill_s(self, tokens: float) -> float:
        return tokens * self.prefill_s_per_token

    # -- weights -------------------------------------------------------------------------------------------

    def load_s(self, *, global_sync: bool, local_pull: bool = True, weight_bytes: float | None = None) -> float:
        """One weight load on a replica: a global NCCL broadcast, or one chain hop (two without a live local
        relay) plus the local PCIe pull. `weight_bytes`: the bytes this replica loads (default: the model)."""
        wb = self.weight_bytes if weight_bytes is None else weight_bytes
        if global_sync:
            return wb / (self.broadcast_gbytes_s * 1e9)
        hops = 1 if local_pull else 2
        return hops * wb / (self.relay_gbytes_s * 1e9) + wb / (self.pcie_gbytes_s * 1e9)

    def publish_stall_s(self, global_sync: bool) -> float:
        """The trainer's stall publishing a version: the push to the master relay, or a global broadcast."""
        gbytes_s = self.broadcast_gbytes_s if global_sync else self.relay_gbytes_s
        return self.weight_bytes / (gbytes_s * 1e9)

    # -- trainer -------------------------------------------------------------------------------------------

    def train_s(self, batch_tokens: float) -> float:
        """One trainer step over `batch_tokens` prompt + response tokens."""
        return batch_tokens * self.trainer_s_per_token


def chain_broadcast_s(nodes: int, message_bytes: float, bytes_per_s: float, t_start_s: float) -> float:
    """Pipelined chain broadcast from a master to nodes - 1 relays at the optimal chunk count (the Laminar paper,
    Sheng et al., EuroSys 2026, Appendix D): T* = M T_byte + (p - 2) T_start + 2 sqrt((p - 2) M T_byte T_start);
    one plain hop (M T_byte + T_start) when p <= 2."""
    if nodes < 2:
        return 0.0
    m_t = message_bytes / bytes_per_s
    if nodes == 2:
        return m_t + t_start_s
    return m_t + (nodes - 2) * t_start_s + 2 * math.sqrt((nodes - 2) * m_t * t_start_s)


# -- multi-turn tool calling (the `tools` workload) ------------------------------------------------------------
# A ReTool-style trajectory (the Laminar paper, section 8.1: code-sandbox tool calls) alternates model turns and
# tool calls. The numbers below are our assumptions, the same as the simulator's tool workload (sim/params.py
# WorkloadParams: env_p50_s, env_tail_ratio, tool_output_tokens); the paper gives no sandbox latency figures.
TOOL_LATENCY_P50_S = 2.0  # assumed: median sandbox latency of one tool call (modelled s)
TOOL_LATENCY_TAIL_RATIO = 10.0  # assumed: p99 / p50 (a wide tail, as the paper's Fig. 2 lengths): p99 = 20 s
TOOL_OUTPUT_TOKENS = 128  # assumed: sandbox output appended to the context (prefilled) after each call


def tool_latency_s(z: float, p50_s: float = TOOL_LATENCY_P50_S, tail_ratio: float = TOOL_LATENCY_TAIL_RATIO) -> float:
    """One tool call's latency (modelled s) from a standard normal draw `z`: lognormal with median `p50_s` and
    p99 = tail_ratio x p50 (sigma = ln(tail_ratio) / 2.326, z_0.99 = 2.326). z = 0 -> p50_s; z = 2.326 -> p99."""
    return p50_s * math.exp(z * math.log(tail_ratio) / 2.326)
