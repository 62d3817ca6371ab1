"""Scaling a live run: which rollout replicas to start or remove when the operator changes the replica count.

Pure and clock-free (no Temporal, no time, no I/O), like laminar/policy.py and workflows/repack.py: the
training-run workflow's `scale` update calls `plan_scale` with the replicas it runs and the open leases each
holds, and carries out the plan it returns.

Rules (tests/test_scale.py works them through):
- Growing: new replicas take the lowest indices `replica-<k>` that no running or still-leaving replica uses
  (an activity id is reused only once its previous holder has returned).
- Shrinking: remove the replicas that hold the fewest open leases (the least work to give back; ties: the
  highest index first, so a run scaled back down returns to its first replicas' ids).
- A removed replica leaves gracefully: its next claim or report is answered with a hand-over for that replica
  alone; it reports its complete groups, writes its pool and returns. Its open leases then go back to the
  pool (`returned`), the same way a lost replica's do, and any replica regenerates them: the partial pool is
  per replica id, so a group in flight on a removed replica does not resume elsewhere.
- The target is between 1 and MAX_REPLICAS; equal to the current count, the plan is empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_REPLICAS = 1024  # the config's bound on rollout.replicas (laminar/config.py)


@dataclass(frozen=True)
class ScalePlan:
    start: list[str] = field(default_factory=list)  # replica ids to start
    remove: list[str] = field(default_factory=list)  # replica ids to answer with a hand-over and retire
    keep: list[str] = field(default_factory=list)  # running replicas that stay

    @property
    def active(self) -> list[str]:
        """The replica set after the plan, in index order."""
        return sorted(self.keep + self.start, key=replica_index)


def replica_index(replica_id: str) -> int:
    """replica-7 -> 7 (ids the workflow makes; anything else sorts last)."""
    head, _, tail = replica_id.rpartition("-")
    return int(tail) if head and tail.isdigit() else MAX_REPLICAS * 2


def replica_ids(n: int) -> list[str]:
    return [f"replica-{i}" for i in range(n)]


def check_target(replicas: int, least: int = 1) -> None:
    if not least <= replicas <= MAX_REPLICAS:
        raise ValueError(f"scale: replicas={replicas} must be between 1 and {MAX_REPLICAS}; "
                         f"use `laminar stop` to end a run")


def plan_scale(active: list[str], leaving: list[str], held: dict[str, int], target: int,
               least: int = 1) -> ScalePlan:
    """The plan that brings `active` replicas to `target`. `leaving`: removed replicas that have not returned
    yet (their ids are not reused); `held`: open leases per replica id (absent: 0). `least`: the smallest target
    (0 for a slot pool's grant: a run granted no slot runs no replica)."""
    check_target(target, least)
    if target >= len(active):
        taken = set(active) | set(leaving)
        start: list[str] = []
        k = 0
        while len(active) + len(start) < target:
            rid = f"replica-{k}"
            if rid not in taken:
                start.append(rid)
            k += 1
        return ScalePlan(start=start, keep=sorted(active, key=replica_index))
    order = sorted(active, key=lambda r: (held.get(r, 0), -replica_index(r)))
    remove = order[:len(active) - target]
    keep = [r for r in active if r not in set(remove)]
    return ScalePlan(remove=sorted(remove, key=replica_index), keep=sorted(keep, key=replica_index))
