"""Sharing one worker set's rollout slots between the live runs (docs/architecture/handover.md, 'One worker set, several
runs').

Pure and clock-free (no Temporal, no time, no I/O), like laminar/policy.py: the slot pool workflow
(workflows/pool.py) calls `allocate` whenever the slot count or a run's ask changes, and signals each run its grant.

Rules (tests/test_fairshare.py works them through and checks them as properties):
- A run asks for `replicas` slots (rollout.replicas, or its `laminar scale` target) and may hold a quota
  (rollout.quota): a guaranteed minimum of min(replicas, quota) slots. A quota is a floor, not a weight: above the
  floors, slots are shared max-min fairly, so a run with a quota never gets more than it would without one unless
  its quota says so.
- Floors first. When the floors together fit in the slots, every run gets its floor; when they do not (quotas
  overcommitted), the slots are shared max-min fairly over the floors instead (nobody's floor above the others').
- Then max-min fair over the asks: the largest level L such that every run gets max(floor, min(replicas, L)) and
  the sum fits; the few slots left below L + 1 go one each to the runs still short, oldest registration first
  (then run id): deterministic, and a newcomer never takes the odd slot from a run that was there first.
- Never more than asked, never more than `slots` in all, and no slot idle while a run is short
  (work-conserving).
- A run whose engine the pool's workers do not serve gets nothing: its replicas would reach a worker that cannot
  run them.
- Slots unknown (None: no worker set has reported any, e.g. workers started one by one with `laminar worker`, or
  the `laminar run` that attached to the run): every run gets its ask, and Temporal hands out whatever slots
  there are, as without a pool.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SLOTS = 1_000_000  # a bound on reported slots, so a bad report cannot make the level search loop long


@dataclass(frozen=True)
class Ask:
    run_id: str
    replicas: int  # what the run wants (>= 0)
    quota: int = 0  # guaranteed minimum (0: fair share only)
    seq: int = 0  # registration order: ties go to the older run
    engine: str = ""  # rollout.engine ("" : any worker serves it)


@dataclass(frozen=True)
class Grant:
    run_id: str
    granted: int
    note: str = ""  # why it is less than asked ("" when the run got its ask)


def _floors(slots: int, caps: list[int]) -> list[int]:
    """Max-min fair split of `slots` over demands `caps` (each gets at most its cap); leftovers by position."""
    return _water_fill(slots, [0] * len(caps), caps)


def _water_fill(slots: int, base: list[int], caps: list[int]) -> list[int]:
    """Each run i gets max(base[i], min(caps[i], L)) for the largest level L whose total fits in `slots`, then one
    more slot each, in list order, to the runs still below their cap at level L while slots remain. Assumes
    base[i] <= caps[i] and sum(base) <= slots."""
    def total(level: int) -> int:
        return sum(max(b, min(c, level)) for b, c in zip(base, caps, strict=True))

    top = max(caps, default=0)
    lo, hi = 0, top  # total(lo) <= slots holds (sum(base) <= slots); find the largest such level
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if total(mid) <= slots:
            lo = mid
        else:
            hi = mid - 1
    out = [max(b, min(c, lo)) for b, c in zip(base, caps, strict=True)]
    left = slots - sum(out)
    for i, (b, c) in enumerate(zip(base, caps, strict=True)):
        if left <= 0:
            break
        if b <= lo < c:  # at the level and still short of its cap: one more
            out[i] += 1
            left -= 1
    return out


def allocate(slots: int | None, asks: list[Ask], engines: frozenset[str] | None = None) -> dict[str, Grant]:
    """Each run's grant of `slots` rollout slots (None: not known, so not limited). `engines`: the rollout engines
    the pool's workers serve (None: any). Deterministic in its inputs, whatever the order of `asks`."""
    if slots is None:
        slots = sum(max(0, a.replicas) for a in asks)
        engines = None
    if not 0 <= slots <= MAX_SLOTS:
        raise ValueError(f"fairshare: slots={slots} must be between 0 and {MAX_SLOTS}")
    for a in asks:
        if a.replicas < 0 or a.quota < 0:
            raise ValueError(f"fairshare: run {a.run_id} asks replicas={a.replicas}, quota={a.quota}; both must "
                             ">= 0")
    if len({a.run_id for a in asks}) != len(asks):
        raise ValueError("fairshare: a run asks twice")
    order = sorted(asks, key=lambda a: (a.seq, a.run_id))
    served = [a for a in order if engines is None or not a.engine or a.engine in engines]
    caps = [a.replicas for a in served]
    floors = [min(a.replicas, a.quota) for a in served]
    overcommitted = sum(floors) > slots
    if overcommitted:
        floors = _floors(slots, floors)
    granted = _water_fill(slots, floors, caps)
    grants = {a.run_id: Grant(a.run_id, g) for a, g in zip(served, granted, strict=True)}
    for a in order:
        if a.run_id not in grants:
            grants[a.run_id] = Grant(a.run_id, 0, f"granted 0 of {a.replicas} asked: no worker in this pool serves "
                                                  f"rollout.engine={a.engine!r} (served: {', '.join(sorted(engines or []))})")
    return {a.run_id: _explained(grants[a.run_id], a, slots, order, overcommitted) for a in order}


def _explained(g: Grant, a: Ask, slots: int, order: list[Ask], overcommitted: bool) -> Grant:
    if g.note or g.granted >= a.replicas:
        return g
    live = [x for x in order if x.replicas > 0]
    if slots == 0:
        why = "the pool has no rollout slots (no `laminar workers` reported any)"
    else:
        why = f"{len(live)} runs share {slots} slots"
        if overcommitted:
            why += f" and their quotas ({sum(min(x.replicas, x.quota) for x in live)}) exceed them"
        elif a.quota and g.granted >= min(a.quota, a.replicas):
            why += f" (quota {a.quota} met)"
        elif held := sum(min(x.replicas, x.quota) for x in live if x.run_id != a.run_id):
            why += f", {held} held by other runs' quotas"
    return Grant(g.run_id, g.granted, f"granted {g.granted} of {a.replicas} asked: {why}")
