"""From (model, GPU budget, mode, placement, workload) to a SimConfig, with sim/params.py's numbers."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from laminar.config import RunConfig
from laminar.rl.costs import CostModel, chain_broadcast_s
from laminar.sim import params as P
from laminar.sim.control import ControlPlaneCost
from laminar.sim.core import ControlTiming, Lengths, SimConfig

MODES = ("laminar", "sync", "one_step", "stream", "partial_rollout")
DISAGGREGATED = ("laminar", "one_step", "stream", "partial_rollout")  # sync is colocated (verl)


@dataclass(frozen=True)
class Placement:
    """Where the GPUs go: `train` trainer GPUs and `rollout` rollout GPUs (colocated: both are all GPUs)."""

    gpus: int
    train: int
    rollout: int
    tp: int
    colocated: bool = False

    @property
    def replicas(self) -> int:
        return self.rollout // self.tp

    def label(self) -> str:
        return "colocated" if self.colocated else f"{self.train}/{self.rollout}"


@dataclass(frozen=True)
class RelayLink:
    """The relay chain's link: bandwidth and per-message start-up (paper Appendix D), and the local pull."""

    bytes_per_s: float = P.RELAY_LINK_BYTES_S
    t_start_s: float = P.RELAY_T_START_S
    local_pull_bytes_s: float | None = None  # per GPU; None: sim/params.py PCIE_BYTES_S
    source: str = "sim/params.py (paper section 8.3, Fig. 18, Appendix D)"

    @classmethod
    def from_bench(cls, path: Path) -> RelayLink:
        """The bandwidths `laminar bench relay` measured (its --json report, e.g. docs/benchmarks/data/relay-bench.json)."""
        try:
            data = json.loads(Path(path).read_text())
            link = data["link"]
            pulls = [r["local_pull_gbps"] for r in data.get("results", []) if r.get("local_pull_gbps")]
            return cls(float(link["bytes_per_s"]), float(link["t_start_s"]),
                       max(pulls) * 1e9 if pulls else None, f"measured: {path}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--relay-bench {path}: not a `laminar bench relay --json` report ({e!r}); "
                             f"run `laminar bench relay --json {path}` or leave the option out") from None


def tp_of(model: P.ModelParams, mode: str) -> int:
    return model.tp_laminar if mode in ("laminar", "partial_rollout") else model.tp_baseline


def placements(model: P.ModelParams, gpus: int, mode: str) -> list[Placement]:
    """Every placement the search may choose: sync colocated (verl); the others split in whole machines
    (8 GPUs; 8-GPU halves below 2 machines) with at least one replica and one trainer machine."""
    tp = tp_of(model, mode)
    if mode == "sync":
        return [Placement(gpus, gpus, gpus, tp, colocated=True)]
    unit = P.GPUS_PER_MACHINE if gpus >= 2 * P.GPUS_PER_MACHINE else max(tp, gpus // 2)
    out = []
    for train in range(unit, gpus, unit):
        rollout = gpus - train
        if rollout >= tp:
            out.append(Placement(gpus, train, rollout, tp))
    if not out:
        raise ValueError(f"{gpus} GPUs cannot hold a trainer and one rollout replica of tp={tp} for model "
                         f"{model.name}; use at least {2 * tp}")
    return out


CONTROL_PLANE = ControlPlaneCost(task_s=P.CONTROL_TASK_S, rtt_s=P.CONTROL_RTT_S, dispatch_s=P.CONTROL_DISPATCH_S,
                                 updates_per_segment=P.UPDATES_PER_SEGMENT,
                                 continue_as_new_s=P.CONTROL_CONTINUE_AS_NEW_S, handover_s=P.CONTROL_KEEP_STALL_S)


# on: as the stack ships (run.handover_keep: a replica parks across a continue-as-new and keeps its groups);
# write: run.handover_keep = false (each replica writes its groups out and prefills them again in the new run);
# no-handover: a continue-as-new nobody feels; off: a control plane that answers at once, for free.
CONTROL_PLANES = ("on", "write", "no-handover", "off")


def control_plane_cost(control_plane: str) -> ControlPlaneCost | None:
    """The measured costs of one CONTROL_PLANES setting (None for off), in wall seconds."""
    if control_plane not in CONTROL_PLANES:
        raise ValueError(f"control_plane={control_plane!r}: use one of {', '.join(CONTROL_PLANES)}")
    if control_plane == "off":
        return None
    if control_plane == "write":
        return replace(CONTROL_PLANE, handover_s=P.CONTROL_HANDOVER_S, writes_out=True)
    if control_plane == "no-handover":
        return replace(CONTROL_PLANE, handover_s=0.0, updates_per_segment=10**9)
    return CONTROL_PLANE


def control_timing() -> ControlTiming:
    """The real replica loop's intervals (services/rollout/timing.py ReplicaTiming), in seconds."""
    from laminar.services.rollout.timing import TIMING as t

    return ControlTiming(t.version_poll_s, t.version_wait_poll_s, t.claim_poll_s, t.idle_claim_max_s,
                         t.claim_min_groups, t.report_min_groups, t.report_max_wait_s, t.contact_s)


def sim_config(model: P.ModelParams, workload: P.WorkloadParams, mode: str, placement: Placement, *,
               iterations: int = 8, warmup: int = 3, repack: bool = True, link: RelayLink = RelayLink(),
               failures: tuple[tuple[str, float], ...] = (), control_plane: str = "off") -> SimConfig:
    """The run of `mode` on this placement, with every number from sim/params.py. control_plane (CONTROL_PLANES):
    "on": the replicas claim and report as services/rollout/ does (its intervals) through one workflow that serves
    one update at a time (sim/control.py), which continues as new, each replica parked across it (as shipped);
    "write": the same with every replica writing its groups out at each continue-as-new (run.handover_keep =
    false); "no-handover": a continue-as-new that replicas do not feel; "off": a control plane that answers at once,
    for free."""
    cost = control_plane_cost(control_plane)
    on = cost is not None
    tp = placement.tp
    costs = model.costs(tp, placement.train)
    if link.local_pull_bytes_s is not None:
        costs = replace(costs, pcie_gbytes_s=tp * link.local_pull_bytes_s / 1e9)
    replicas = placement.replicas
    G = workload.group_size
    if mode in ("laminar", "partial_rollout"):
        seqs = workload.max_inflight_per_replica
    else:  # the baselines' global rollout batch (8192) spread over the replicas
        seqs = math.ceil(workload.prompts_per_batch / replicas) * G
    seqs = max(G, seqs // G * G)
    global_sync = mode != "laminar"
    if global_sync:
        load_s = costs.load_s(global_sync=True)
        relay_delay = 0.0
    else:  # the chain to every rollout machine's relay, then the local pull of each GPU's shard
        hosts = math.ceil(placement.rollout / P.GPUS_PER_MACHINE)
        relay_delay = chain_broadcast_s(hosts + 1, model.weight_bytes, link.bytes_per_s, link.t_start_s)
        load_s = model.weight_bytes / (costs.pcie_gbytes_s * 1e9)
    lengths = Lengths(workload.response_p50_tokens, workload.max_response_tokens, workload.long_tail,
                      workload.turns_max, workload.env_p50_s, workload.env_tail_ratio, workload.seed)
    return SimConfig(
        mode=mode, replicas=replicas, costs=costs, kv_capacity=model.kv_capacity_tokens(tp),
        max_inflight_seqs=seqs, groups_per_step=workload.prompts_per_batch, group_size=G,
        prompt_tokens=workload.prompt_tokens, lengths=lengths, iterations=iterations, warmup=warmup,
        repack=repack, stream_minibatches=workload.stream_minibatches,
        max_ready_groups=workload.max_ready_batches * workload.prompts_per_batch,
        relay_delay_s=relay_delay, load_s=load_s, tool_output_tokens=workload.tool_output_tokens,
        replicas_per_machine=max(1, P.GPUS_PER_MACHINE // tp), failures=failures,
        control=control_timing() if on else None,
        control_plane=cost if on else None,
        failure_costs={
            "rollout_detect_s": P.ROLLOUT_DETECT_S, "rollout_restart_s": P.ROLLOUT_RESTART_S + P.ENGINE_START_S,
            "relay_detect_s": P.RELAY_DETECT_S, "relay_rebuild_s": P.RELAY_REBUILD_S,
            "trainer_detect_s": P.TRAINER_DETECT_S, "trainer_restart_s": P.TRAINER_RESTART_S,
            "checkpoint_load_s": model.checkpoint_load_s(placement.train), "checkpoint_every": P.CHECKPOINT_EVERY,
            "machine_replace_s": P.MACHINE_REPLACE_S,
        },
    )


def with_replica_loop(costs: CostModel, share: float) -> CostModel:
    """The engine's costs as a replica loop that spends `share` of its wall outside the engine sees them: every
    decode and prefill second takes 1 / (1 - share) (P.REPLICA_LOOP_SHARE: the real stack's, measured)."""
    if not 0 <= share < 1:
        raise ValueError(f"share={share!r}: the replica loop's share outside the engine is in [0, 1)")
    k = 1 / (1 - share)
    return replace(costs, step_floor_s=costs.step_floor_s * k, kv_read_s_per_token=costs.kv_read_s_per_token * k,
                   compute_s_per_seq=costs.compute_s_per_seq * k, prefill_s_per_token=costs.prefill_s_per_token * k)


def from_run_config(cfg: RunConfig, *, iterations: int, warmup: int) -> SimConfig:
    """The simulator's twin of one modelled run on the real stack (`laminar bench throughput`'s run config): the
    [modelled] section's costs (CostModel.from_modelled, the engine's own), its response lengths (rl/modelled.py
    response_length, the same function of seed, prompt and sample), the rollout and trainer sections' sizes.
    Weight loads as the modelled engine charges them; relays deliver at once (the real relays' milliseconds)."""
    from laminar.rl.modelled import response_length

    m = cfg.modelled
    costs = CostModel.from_modelled(m)
    global_sync = cfg.run.mode != "laminar"
    seed = cfg.run.seed
    lengths = Lengths(m.response_p50_tokens, m.max_response_tokens, m.workload == "long_tail", seed=seed,
                      exact=lambda p, s: response_length(m, seed, p, s))
    return SimConfig(
        mode=cfg.run.mode, replicas=cfg.rollout.replicas, costs=costs, kv_capacity=m.kv_capacity_tokens,
        max_inflight_seqs=cfg.rollout.max_inflight_groups * cfg.rollout.group_size,
        groups_per_step=cfg.trainer.groups_per_step, group_size=cfg.rollout.group_size,
        prompt_tokens=m.prompt_tokens, lengths=lengths, iterations=iterations, warmup=warmup,
        repack=cfg.rollout.repack, stream_minibatches=cfg.trainer.minibatches,
        max_ready_groups=cfg.rollout.max_ready_groups, max_staleness=cfg.trainer.max_staleness,
        load_s=costs.load_s(global_sync=global_sync), publish_stall_s=costs.publish_stall_s(global_sync),
        finish_quantum_steps=0,  # exact: these runs are small
        preempt=True,  # the modelled engine preempts the newest at a full cache, as vLLM and the simulator do
    )
