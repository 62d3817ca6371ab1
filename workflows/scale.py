"""Scaling a live run: which rollout replicas to start or remove when the operator changes the replica count.

Pure and clock-free (no Temporal, no time, no I/O), like laminar/policy.py and workflows/repack.py: the
training-run workflow's `scale` update calls `plan_scale` with the replicas it runs and the open leases each
holds, and carries out the plan it returns.

Rules (tests/test_scale.py works them through):
- Growing: new replicas take the lowest indices `replica-<k>` that no running or still-leaving replica uses
  (an activity id is reused only once its previous holder has returned).
- Shrinking: remove the replicas that hold the fewest open leases (the least work to give back; ties: the
  highest index first, so a run scaled back down returns to its first replicas' ids).
- A removed replica leaves gracefully: its next claim or report is answered with `leave`; it reports its
  complete groups, stops the rest and hands them over as one segment (laminar.contract.Departure), which the
  workflow moves to a replica of their version or returns to the pool with their prefixes
  (workflows/migrations.py `depart`), and it returns. Whatever it still holds when its activity has returned
  (it died first) goes back to the pool, the same way a lost replica's does.
- The target is between 1 and MAX_REPLICAS; equal to the current count, the plan is empty.
- Relays (`plan_relays`), one per host `host-<i>`: growing starts the lowest free ids (the host's relay worker joins
  the chain when it polls its queue); shrinking takes the highest ids out of the chain at once (the trainer
  republishes to the chain that remains), so the master, the first relay, stays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_REPLICAS = 1024  # the config's bound on rollout.replicas (laminar/config.py)
MAX_RELAYS = 1024  # ... and on relay.relays


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


def relay_ids(n: int) -> list[str]:
    return [f"host-{i}" for i in range(n)]


def plan_relays(active: list[str], target: int) -> tuple[list[str], list[str]]:
    """(start, remove) that bring the relay set to `target`: growing adds the lowest free `host-<i>` ids (a new
    host's relay joins the chain); shrinking removes the highest ids, so the master (the first relay) stays."""
    if not 1 <= target <= MAX_RELAYS:
        raise ValueError(f"scale: relays={target} must be between 1 and {MAX_RELAYS}")
    if target >= len(active):
        taken, start, k = set(active), [], 0
        while len(active) + len(start) < target:
            if f"host-{k}" not in taken:
                start.append(f"host-{k}")
            k += 1
        return start, []
    order = sorted(active, key=replica_index)
    return [], order[target:]
