"""Dynamic repack planner: which rollout replicas hand their unfinished trajectories to which others.

Pure and clock-free (no Temporal, no time, no I/O), like laminar/policy.py: the rollout manager calls
`plan_repack` with the replicas' latest load reports and carries out the moves it returns; a simulator or a
test can call it the same way.

Why repack. Decoding is memory-bound: up to a roofline batch B a decode step costs about the same whatever
the batch, so a replica decoding 3 long-tail trajectories is almost as busy (in time per step) as one
decoding 60, yet nearly idle in work done. Near the end of its share of a batch each replica is left with a
few long trajectories. Merging the leftovers of several such replicas onto a few of them barely slows those
trajectories down, and releases the others: a released replica loads the newest policy version and starts
fresh, near on-policy trajectories instead of idling through the tail.

Idleness metric. A replica's KV-cache use climbs to a natural peak and stays there while waiting
trajectories refill the room that finished ones free; it falls only when nothing it may start is left. So
"KV use is below the peak and falling" marks a replica in ramp-down, with no per-workload threshold on
remaining requests to tune. A replica r is a candidate when

    r.kv_used < min(C_max(r), r.kv_prev)   and   0 < r.in_flight < roofline_batch

with C_max(r) = c_max * r.kv_capacity: below the peak, not rising since the previous report, and with fewer
than B trajectories left. `waiting` (prompts leased but not started) is not part of the test: a replica
that drains before loading a newer version ("finish first") holds prompts it will not start until it has
loaded, and releasing it is exactly what lets it start them sooner.

Algorithm (best-fit consolidation, a bin-packing heuristic), run separately for each policy version:

1. S = the candidates of that version, sorted by kv_used ascending (ties: replica_id). The smallest
   workloads are the cheapest to move and the likeliest to fit somewhere.
2. For each s in S that has not been emptied and has not received a move:
   D_s = {d in S : d != s, d not emptied, CanFit(d, s)}, where, with kv_load(d) = d.kv_used + the kv of the
   sources already planned onto d and n_load(d) the same sum of trajectories,
       CanFit(d, s)  <=>  kv_load(d) + s.kv_used <= C_max(d)  and  n_load(d) + s.in_flight <= roofline_batch.
   If D_s is not empty, move s onto d* = argmax over D_s of kv_load(d) (ties: the smaller replica_id) and
   mark s emptied. Choosing the destination that ends up most densely packed keeps the roomier candidates
   free for the larger workloads that come later in the order, which is how best-fit releases many sources
   with few destinations.
3. Cost O(|S|^2) per version; |S| is the number of replicas in ramp-down, small.

Invariants (tests/test_repack.py):
- a move never crosses policy versions (a moved trajectory keeps decoding under the version it started
  with, so no trajectory mixes versions);
- after the plan, every destination holds kv_load <= C_max(d) and n_load <= roofline_batch;
- a replica is a source at most once, and a source is never a destination (nor a destination a source);
- each move goes to the densest destination that can take it at that point of the plan;
- the plan is empty when no replica is in ramp-down or every replica is at or above C_max;
- the plan depends only on the set of loads, not on their order in the input.

Our choice, beyond the algorithm's text: a replica with nothing in flight is neither a source (nothing to
move) nor a destination. It is already released; moving work onto it would only swap which replica is
free, for the price of a migration.

How a move is carried out (transferring KV blocks, or re-prefilling prompt + partial response on the
destination) is the caller's business; `Move.kv_tokens` is what either way has to be rebuilt or sent.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

C_MAX = 0.9
"""Default peak KV-cache fraction (of kv_capacity) for candidates and for CanFit. An assumption: the paper
names "above 99 % of total KVCache" as the example of the natural peak; we pack to 90 % because a moved
trajectory keeps decoding (one more KV token per step), so a destination filled to 99 % would run out of
room and have to preempt soon after the move. Not measured."""

PLAN_EVERY_S = 5.0
"""Seconds between periodic repack checks: the paper's example period (section 5.1). It also plans right
after the trainer finishes a weight update, so that released replicas pick up the new version sooner."""

REPACK_OVERHEAD_S = 0.69
"""Seconds one repack takes end to end, as the paper measured it (32B model, 16 rollouts; section 8.4)."""


@dataclass(frozen=True)
class ReplicaLoad:
    """One rollout replica's load report, as the planner sees it.

    Invariants (checked by plan_repack): kv_used, kv_prev, in_flight, waiting >= 0; kv_capacity > 0;
    replica ids unique within one call.
    """

    replica_id: str
    policy_version: int  # the version its in-flight trajectories decode under
    kv_used: int  # KV-cache tokens in use now (C_used)
    kv_prev: int  # KV-cache tokens in use at the previous report (C_prev)
    kv_capacity: int  # KV-cache capacity (tokens)
    in_flight: int  # trajectories decoding now (N_reqs)
    waiting: int = 0  # prompts leased to it but not started (not used by the idleness test; see module doc)

    def kv_limit(self, c_max: float) -> float:
        """C_max of this replica (tokens): c_max x kv_capacity."""
        return c_max * self.kv_capacity


@dataclass(frozen=True)
class Move:
    """Move every unfinished trajectory of `source` onto `destination` (both on `policy_version`)."""

    source: str
    destination: str
    policy_version: int
    kv_tokens: int  # the source's kv_used: KV tokens to transfer or re-prefill on the destination
    trajectories: int  # the source's in_flight


def is_candidate(r: ReplicaLoad, *, c_max: float, roofline_batch: int) -> bool:
    """In ramp-down (KV below C_max and below the previous report) with 1..B-1 trajectories in flight."""
    return r.kv_used < min(r.kv_limit(c_max), r.kv_prev) and 0 < r.in_flight < roofline_batch


def plan_repack(loads: list[ReplicaLoad], *, c_max: float = C_MAX, roofline_batch: int) -> list[Move]:
    """Best-fit consolidation of ramp-down replicas, per policy version (see the module docstring).

    `c_max` is a fraction of each replica's kv_capacity, in (0, 1]; `roofline_batch` (B, sequences) is the
    decode batch above which decoding turns compute-bound. Returns the moves grouped by policy version
    (ascending), each group in planning order; every source appears once and is released by its move.
    """
    _validate(loads, c_max, roofline_batch)
    by_version: dict[int, list[ReplicaLoad]] = defaultdict(list)
    for r in loads:
        if is_candidate(r, c_max=c_max, roofline_batch=roofline_batch):
            by_version[r.policy_version].append(r)
    plan: list[Move] = []
    for version in sorted(by_version):
        plan.extend(_plan_version(by_version[version], c_max, roofline_batch))
    return plan


def _plan_version(cands: list[ReplicaLoad], c_max: float, roofline_batch: int) -> list[Move]:
    order = sorted(cands, key=lambda r: (r.kv_used, r.replica_id))
    kv_load = {r.replica_id: r.kv_used for r in order}  # d.kv_used + kv planned onto d
    n_load = {r.replica_id: r.in_flight for r in order}  # d.in_flight + trajectories planned onto d
    emptied: set[str] = set()
    received: set[str] = set()
    moves: list[Move] = []
    for s in order:
        if s.replica_id in emptied or s.replica_id in received:
            continue
        fits = [
            d for d in order
            if d.replica_id != s.replica_id and d.replica_id not in emptied
            and kv_load[d.replica_id] + s.kv_used <= d.kv_limit(c_max)
            and n_load[d.replica_id] + s.in_flight <= roofline_batch
        ]
        if not fits:
            continue
        best = min(fits, key=lambda d: (-kv_load[d.replica_id], d.replica_id))  # densest; ties: smaller id
        kv_load[best.replica_id] += s.kv_used
        n_load[best.replica_id] += s.in_flight
        emptied.add(s.replica_id)
        received.add(best.replica_id)
        moves.append(Move(s.replica_id, best.replica_id, s.policy_version, s.kv_used, s.in_flight))
    return moves


def released(plan: list[Move]) -> list[str]:
    """The replicas a plan frees (its sources), in plan order."""
    return [m.source for m in plan]


def _validate(loads: list[ReplicaLoad], c_max: float, roofline_batch: int) -> None:
    if not 0.0 < c_max <= 1.0:
        raise ValueError(f"c_max={c_max!r} must be a fraction of KV capacity in (0, 1]; "
                         f"the default is {C_MAX}")
    if roofline_batch < 1:
        raise ValueError(f"roofline_batch={roofline_batch!r} must be >= 1 (sequences); "
                         "see modelled.roofline_batch")
    seen: set[str] = set()
    for r in loads:
        if r.replica_id in seen:
            raise ValueError(f"replica_id={r.replica_id!r} appears twice in the loads; "
                             "pass one report per replica")
        seen.add(r.replica_id)
        if r.kv_capacity <= 0:
            raise ValueError(f"{r.replica_id}: kv_capacity={r.kv_capacity} must be > 0 (tokens)")
        for field in ("kv_used", "kv_prev", "in_flight", "waiting"):
            value = getattr(r, field)
            if value < 0:
                raise ValueError(f"{r.replica_id}: {field}={value} must be >= 0")
