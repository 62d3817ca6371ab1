"""`laminar bench control`'s arithmetic: which cells to run (replicas, groups/s) and what each should cost the
control plane, and the numbers of its report. Pure and clock-free (times are passed in); tests/test_bench_control.py.

A cell is the control plane's load at one shape: R replicas, each holding `slots` prompt groups in flight, that
finish `groups_per_s` groups a second between them, and a trainer that takes a step every `step_s` on batches of
`groups_per_step`. The simulator's heaviest cells give these (`laminar simulate --json`: the chosen placement's
replicas and iteration time; sim/params.py's workload: groups per batch, group size, sequences per replica).

A synthetic replica holds each lease for a draw from an exponential with mean `slots / (groups_per_s / R)`
(Little's law: that many groups in flight, finishing at that rate). Exponential because it is memoryless: leases
that start together finish at the steady rate at once, so no warm-up waits for a tail; the control plane sees
the rate, not the shape of the tail.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from laminar.services.rollout.timing import TIMING, ReplicaTiming

# done-when of issue 32 (docs/benchmarks/control.md)
P99_TARGET_S = 0.25
HANDOVER_EVERY_TARGET_S = 300.0


@dataclass(frozen=True)
class Cell:
    label: str
    replicas: int
    groups_per_s: float  # groups finished per second by all replicas together
    slots: int  # groups in flight per replica (rollout.max_inflight_groups)
    group_size: int = 16
    groups_per_step: int = 512  # trainer.groups_per_step
    step_s: float = 0.0  # the trainer stub's time per step (0: at once)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"cell {self.label}: replicas={self.replicas} must be >= 1")
        if not self.groups_per_s > 0:
            raise ValueError(f"cell {self.label}: groups_per_s={self.groups_per_s} must be > 0")
        if self.slots < 1:
            raise ValueError(f"cell {self.label}: slots={self.slots} must be >= 1")
        if self.step_s < 0:
            raise ValueError(f"cell {self.label}: step_s={self.step_s} must be >= 0")

    @property
    def per_replica_groups_per_s(self) -> float:
        return self.groups_per_s / self.replicas

    @property
    def mean_hold_s(self) -> float:
        """Mean time a lease is held (Little's law: slots in flight / the replica's completion rate)."""
        return self.slots / self.per_replica_groups_per_s

    def scaled(self, factor: float) -> Cell:
        """The same shape at `factor` times the load: factor x the replicas, the groups/s and the global batch
        (each replica as busy as before, a trainer step as often and as long as before)."""
        if not factor > 0:
            raise ValueError(f"scale factor {factor} must be > 0")
        return replace(self, label=f"{self.label} x{factor:g}", replicas=max(1, round(self.replicas * factor)),
                       groups_per_s=self.groups_per_s * factor,
                       groups_per_step=max(1, round(self.groups_per_step * factor)))


def cell_from_sim(row: dict[str, Any], prompts_per_batch: int, group_size: int, seqs_per_replica: int) -> Cell:
    """A `laminar simulate --json` row (one model, GPU count, mode) as a cell: its placement's replicas, its
    iteration time (one global batch of `prompts_per_batch` groups), and the trainer busy for the non-idle share
    of it; `seqs_per_replica` sequences in flight per replica (sim/params.py max_inflight_per_replica)."""
    iteration_s = float(row["iteration_s"])
    if not iteration_s > 0:
        raise ValueError(f"simulated row {row.get('model')}/{row.get('gpus')}: iteration_s={iteration_s} must be > 0")
    return Cell(label=f"{row['model']}/{row['gpus']}", replicas=int(row["replicas"]),
                groups_per_s=prompts_per_batch / iteration_s, slots=max(1, seqs_per_replica // group_size),
                group_size=group_size, groups_per_step=prompts_per_batch,
                step_s=iteration_s * (1.0 - float(row.get("trainer_idle_fraction", 0.0))))


def heaviest(cells: Iterable[Cell], timing: ReplicaTiming = TIMING) -> Cell:
    """The cell with the most predicted updates per second."""
    return max(cells, key=lambda c: predicted_updates_per_s(c, timing))


def predicted_updates_per_s(cell: Cell, timing: ReplicaTiming = TIMING) -> float:
    """Updates per second the replicas' cadence (services/rollout/control.py `Contacts`) should send, roughly: a
    busy replica contacts the workflow at least every contact_s, and a finished group goes out within
    report_max_wait_s, together with the groups finishing meanwhile (and the claim that is due: one update).
    With completions Poisson at rate l per replica, the time to the next update is min(contact_s, X + w), X the
    next completion (exponential), w = report_max_wait_s; its mean is w + (1 - exp(-l (c - w))) / l. Past
    report_min_groups completions the report leaves at once: the gap is at most report_min_groups / l."""
    lam = cell.per_replica_groups_per_s
    c, w = timing.contact_s, timing.report_max_wait_s
    gap = min(w + (1.0 - math.exp(-lam * max(0.0, c - w))) / lam, timing.report_min_groups / lam)
    return cell.replicas / gap


def draw_hold_s(rng: random.Random, cell: Cell) -> float:
    """One lease's hold time (exponential with the cell's mean hold)."""
    return rng.expovariate(1.0 / cell.mean_hold_s)


def run_overrides(cell: Cell, updates_per_segment: int | None = None, handover_keep: bool = True,
                  heartbeat_timeout_s: float | None = None) -> list[str]:
    """The run config of a bench run: laminar mode, one relay, no repack (a synthetic replica holds no sequences
    to hand to another), modelled engines (no model files; the workflow reads only their traits), steps enough
    never to finish (the bench stops the run)."""
    out = [
        "run.mode=laminar", "run.steps=1000000",
        f"rollout.replicas={cell.replicas}", f"rollout.group_size={cell.group_size}",
        f"rollout.max_inflight_groups={cell.slots}", "rollout.repack=false",
        "rollout.engine=modelled", "trainer.engine=modelled", "relay.relays=1",
        f"trainer.groups_per_step={cell.groups_per_step}",
        f"rollout.max_ready_groups={4 * cell.groups_per_step}",
    ]
    if updates_per_segment is not None:
        out.append(f"run.updates_per_segment={updates_per_segment}")
    out.append(f"run.handover_keep={'true' if handover_keep else 'false'}")
    if heartbeat_timeout_s is not None:
        out.append(f"rollout.heartbeat_timeout_s={heartbeat_timeout_s:g}")
    return out


# -- the report's numbers ------------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100.0 * len(s)) - 1))
    return s[k]


def latency_summary(samples: Iterable[float]) -> dict[str, float | int | None]:
    """count, p50, p99, max of latencies in seconds (rounded to the ms)."""
    v = list(samples)

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    return {"count": len(v), "p50_s": r(percentile(v, 50)), "p99_s": r(percentile(v, 99)), "max_s": r(max(v, default=None))}


def workflow_task_latencies(events: Iterable[tuple[str, float]]) -> tuple[list[float], list[float]]:
    """From one history's (event type, time) pairs in order: each workflow task's schedule-to-start and
    schedule-to-complete, seconds. Types as the server names them: WORKFLOW_TASK_SCHEDULED / _STARTED /
    _COMPLETED (a task that failed or timed out has no completion: not counted)."""
    to_start, to_complete = [], []
    scheduled = started = None
    for kind, t in events:
        if kind.endswith("WORKFLOW_TASK_SCHEDULED"):
            scheduled, started = t, None
        elif kind.endswith("WORKFLOW_TASK_STARTED") and scheduled is not None:
            started = t
            to_start.append(t - scheduled)
        elif kind.endswith("WORKFLOW_TASK_COMPLETED") and scheduled is not None and started is not None:
            to_complete.append(t - scheduled)
            scheduled = started = None
    return to_start, to_complete


def intervals(times: Sequence[float]) -> list[float]:
    """Gaps between consecutive times (sorted)."""
    s = sorted(times)
    return [b - a for a, b in zip(s, s[1:], strict=False)]


@dataclass(frozen=True)
class Handover:
    """One continue-as-new as the replicas saw it: the first told to hand over, the last to return, the last of the
    next segment's first claims answered, and the groups written out (in flight at the hand-over)."""

    generation: int  # the segment that handed over
    told_at: float
    returned_at: float
    resumed_at: float | None
    groups_written: int

    @property
    def stall_s(self) -> float | None:
        """From the first replica told to the last one working again in the next segment."""
        return None if self.resumed_at is None else self.resumed_at - self.told_at


def handovers(told: Iterable[tuple[int, float, int]], resumed: Iterable[tuple[int, float]]) -> list[Handover]:
    """told: (generation handing over, when a replica returned, groups it wrote out), one per replica incarnation;
    resumed: (generation, when a replica's first claim in it was answered). A hand-over of generation g ends when
    the last replica resumed in generation g + 1."""
    by_gen: dict[int, list[tuple[float, int]]] = {}
    for gen, at, groups in told:
        by_gen.setdefault(gen, []).append((at, groups))
    first_claims: dict[int, list[float]] = {}
    for gen, at in resumed:
        first_claims.setdefault(gen, []).append(at)
    out = []
    for gen, rows in sorted(by_gen.items()):
        nxt = first_claims.get(gen + 1)
        out.append(Handover(generation=gen, told_at=min(t for t, _ in rows), returned_at=max(t for t, _ in rows),
                            resumed_at=max(nxt) if nxt else None, groups_written=sum(g for _, g in rows)))
    return out


def replica_stalls(parked: Iterable[tuple[str, int, float]], resumed: Iterable[tuple[str, int, float]]) -> list[float]:
    """Each kept replica's own stall at a hand-over: from its park in generation g (replica, g, when it parked) to its
    first claim answered in generation g + 1 (replica, g + 1, when). The time it generated nothing, which is what
    the simulator charges a replica per continue-as-new (sim/params.py CONTROL_KEEP_STALL_S). A replica parked and
    never resumed (the run stopped, or it was started afresh) has no stall here."""
    first: dict[tuple[str, int], float] = {}
    for rid, gen, at in resumed:
        first[(rid, gen)] = min(at, first.get((rid, gen), at))
    return [first[(rid, gen + 1)] - at for rid, gen, at in parked if (rid, gen + 1) in first]


def done_when(cell_result: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """Issue 32's done-when on one cell's result: (what, holds, the value)."""
    p99 = max((u["p99_s"] or 0.0 for u in cell_result["updates"].values()), default=0.0)
    every = cell_result["continue_as_new"]["interval_s"]["p50_s"]
    written = cell_result["continue_as_new"]["groups_written_total"]
    checks = [
        ("update p99 <= 0.25 s", p99 <= P99_TARGET_S, f"{p99:.3f} s"),
        ("groups lost = 0", cell_result["groups_lost"] == 0, str(cell_result["groups_lost"])),
        ("groups consumed twice = 0", cell_result["groups_consumed_twice"] == 0,
         str(cell_result["groups_consumed_twice"])),
    ]
    if written and every is not None:
        checks.append(("hand-overs that write groups out at most every 5 min", every >= HANDOVER_EVERY_TARGET_S,
                       f"every {every:.0f} s"))
    elif written:
        checks.append(("hand-overs that write groups out at most every 5 min", True, "one hand-over in the run"))
    return checks
