"""Chaos schedules: which fault hits which target when, and when it heals, as a pure function of a seed.

`plan_schedule(seed, ...)` is clock-free and deterministic: the same seed and parameters give the same
schedule on any machine, so a failing `laminar chaos` run is replayed with its seed or its saved schedule
(`schedule_to_json` / `schedule_from_json`). The nemesis (chaos/nemesis.py) carries a schedule out
against a live run; the checker (chaos/checker.py) judges the run afterwards.

Fault kinds and what healing means for each:

| kind      | target                         | injected by                               | healed by                                   |
|-----------|--------------------------------|-------------------------------------------|---------------------------------------------|
| kill      | a worker process (any role)    | SIGKILL                                   | the launcher restarting it (with backoff)   |
| stop      | a worker process (any role)    | SIGSTOP: alive, silent (a zombie)          | SIGCONT after hold_s: the zombie wakes up   |
| partition | a relay process                | its data-plane port's packets dropped     | the rule removed after hold_s               |
| store     | the store (the dev S3 server)  | the server stopped                        | started again after hold_s                  |
| readonly  | the store (the dev S3 server)  | every write refused (403 AccessDenied)    | writes accepted again after hold_s          |
| temporal  | the Temporal server            | the dev server stopped                    | started again at once (same port, same DB)  |
| preempt   | a worker process (any role)    | SIGTERM: the notice (laminar/notice.py)   | the worker leaves cleanly, exits 0 and the launcher restarts it |

Every fault starts after `warmup_s` and heals (its window ends) by `duration_s - settle_s`, so the run is
seen whole again before the checker runs. A fault's window is [at_s, at_s + max(hold_s, RECOVERY_S[kind])]:
two faults overlap when their windows intersect; the schedule has at least `overlaps` faults that overlap an
earlier one (fewer only when the window cannot hold them). One target never has two faults at once (the store
and readonly kinds share the target `store`: the store is never down and read-only at once).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass

from laminar.errors import ConfigError

KINDS = ("kill", "stop", "partition", "store", "readonly", "temporal", "preempt")
STORE, TEMPORAL = "store", "temporal"  # the targets of the store (and readonly) and temporal kinds
# (min, max) seconds a fault is held before it heals; 0: healed by the run itself (a restart)
HOLD_S = {"kill": (0.0, 0.0), "stop": (2.0, 12.0), "partition": (5.0, 15.0), "store": (2.0, 6.0),
          "readonly": (3.0, 10.0), "temporal": (0.0, 0.0), "preempt": (0.0, 0.0)}
# nominal seconds the run needs to come back after a fault of this kind is healed: a fault's window for overlaps
# (preempt: the worker may take its whole notice, LAMINAR_NOTICE_S = 30 s by default, to leave, then restarts)
RECOVERY_S = {"kill": 10.0, "stop": 5.0, "partition": 5.0, "store": 5.0, "readonly": 5.0, "temporal": 10.0,
              "preempt": 35.0}
SCHEDULE_FORMAT = 1


@dataclass(frozen=True)
class Fault:
    index: int  # position in the schedule (the fault's id in the nemesis log and the chaos report)
    kind: str
    target: str  # a process name of the run's table (control, trainer, relay-host-0, ...), "store" or "temporal"
    at_s: float  # seconds after the chaos run started
    hold_s: float  # seconds until the nemesis heals it (0: healed by a restart)

    @property
    def window(self) -> tuple[float, float]:
        return self.at_s, self.at_s + max(self.hold_s, RECOVERY_S[self.kind])


@dataclass(frozen=True)
class Schedule:
    seed: int
    duration_s: float
    kinds: list[str]
    rate_per_min: float
    overlaps: int
    faults: list[Fault]


def parse_kinds(text: str) -> list[str]:
    """`--faults kill,stop,...` -> kinds in KINDS order; ConfigError naming the unknown one."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ConfigError(f"--faults {text!r}: {bad or 'empty'} not among {', '.join(KINDS)}; "
                          f"give a comma-separated subset, e.g. --faults kill,stop,store")
    return [k for k in KINDS if k in kinds]


def targets_for(kinds: list[str], processes: list[str]) -> dict[str, list[str]]:
    """What each kind can hit, given the run's process names (the launcher's table)."""
    relays = [p for p in processes if p.startswith("relay-")]
    out: dict[str, list[str]] = {}
    for k in kinds:
        out[k] = {"partition": relays, "store": [STORE], "readonly": [STORE], "temporal": [TEMPORAL]}.get(
            k, list(processes))
        if not out[k]:
            raise ConfigError(f"--faults {k}: the run has no process to aim it at (processes: {processes})")
    return out


def plan_schedule(seed: int, duration_s: float, kinds: list[str], targets: dict[str, list[str]],
                  rate_per_min: float = 4.0, overlaps: int = 2, warmup_s: float | None = None,
                  settle_s: float | None = None) -> Schedule:
    """The seeded schedule. Fault count: rate_per_min over the active window, at least one of each kind.
    Kinds are dealt round-robin in a seeded order so every kind appears; times are uniform in the active
    window; then faults are moved into the window of an earlier one until `overlaps` of them overlap."""
    if duration_s <= 0 or rate_per_min <= 0 or overlaps < 0:
        raise ConfigError(f"chaos schedule: duration_s={duration_s}, rate_per_min={rate_per_min}, "
                          f"overlaps={overlaps}: duration and rate must be > 0, overlaps >= 0")
    for k in kinds:
        if k not in KINDS or not targets.get(k):
            raise ConfigError(f"chaos schedule: kind {k!r} needs one of {KINDS} and a target list, got {targets.get(k)}")
    warmup = min(30.0, 0.15 * duration_s) if warmup_s is None else warmup_s
    settle = min(60.0, 0.2 * duration_s) if settle_s is None else settle_s
    last_start = duration_s - settle - max(max(HOLD_S[k][1], RECOVERY_S[k]) for k in kinds)
    if last_start <= warmup:
        raise ConfigError(f"--duration {duration_s:.0f}s leaves no room for faults after a {warmup:.0f}s warm-up "
                          f"and a {settle:.0f}s settle; give a longer duration (at least {warmup + settle + 30:.0f}s)")
    rng = random.Random(seed)
    count = max(len(kinds), round(rate_per_min * (last_start - warmup) / 60.0))
    order = list(kinds)
    rng.shuffle(order)
    picks = [order[i % len(order)] for i in range(count)]
    rng.shuffle(picks)
    times = sorted(rng.uniform(warmup, last_start) for _ in picks)
    faults: list[Fault] = []
    for kind, at in zip(picks, times, strict=True):
        lo, hi = HOLD_S[kind]
        faults.append(Fault(len(faults), kind, "", round(at, 2), round(rng.uniform(lo, hi), 2)))
    faults = _force_overlaps(faults, overlaps, rng)
    return Schedule(seed, duration_s, list(kinds), rate_per_min, overlaps, _assign_targets(faults, targets, rng))


def _force_overlaps(faults: list[Fault], want: int, rng: random.Random) -> list[Fault]:
    """Move faults (kept in time order) into the window of the fault before them until `want` overlap one."""
    out = sorted(faults, key=lambda f: f.at_s)
    candidates = [i for i in range(1, len(out)) if not _overlaps_earlier(out, i)]
    rng.shuffle(candidates)
    while overlapping(out) < want and candidates:
        i = candidates.pop()
        prev = out[i - 1]
        start, end = prev.window
        at = round(start + rng.uniform(0.2, 0.8) * (end - start), 2)
        if at <= out[i].at_s:  # moving earlier keeps the order (later faults cannot lose their overlap)
            out[i] = Fault(out[i].index, out[i].kind, "", at, out[i].hold_s)
    return [Fault(i, f.kind, f.target, f.at_s, f.hold_s) for i, f in enumerate(sorted(out, key=lambda f: f.at_s))]


def _assign_targets(faults: list[Fault], targets: dict[str, list[str]], rng: random.Random) -> list[Fault]:
    """A random target per fault, never one that another fault holds at that moment (the same target twice
    at once is one fault, not two); a kind whose every target is busy takes the one freed first."""
    busy: dict[str, float] = {}  # target -> end of the window of the fault holding it
    out = []
    for f in faults:
        free = [t for t in targets[f.kind] if busy.get(t, -1.0) <= f.at_s]
        target = rng.choice(free) if free else min(targets[f.kind], key=lambda t: busy[t])
        placed = Fault(f.index, f.kind, target, max(f.at_s, busy.get(target, f.at_s)), f.hold_s)
        busy[target] = placed.window[1]
        out.append(placed)
    # a fault delayed until its target was free may now start after the next one: back in time order
    return [Fault(i, f.kind, f.target, f.at_s, f.hold_s) for i, f in enumerate(sorted(out, key=lambda f: f.at_s))]


def _overlaps_earlier(faults: list[Fault], i: int) -> bool:
    return any(faults[j].window[1] > faults[i].at_s for j in range(i))


def overlapping(faults: list[Fault]) -> int:
    """Faults whose window intersects that of an earlier fault."""
    ordered = sorted(faults, key=lambda f: f.at_s)
    return sum(_overlaps_earlier(ordered, i) for i in range(len(ordered)))


def schedule_to_json(s: Schedule) -> str:
    return json.dumps({"format": SCHEDULE_FORMAT, **asdict(s)}, indent=2)


def schedule_from_json(text: str, where: str = "schedule") -> Schedule:
    """A saved schedule (`--replay FILE`); ConfigError naming what is wrong."""
    try:
        raw = json.loads(text)
        if raw.get("format") != SCHEDULE_FORMAT:
            raise ConfigError(f"{where}: format {raw.get('format')!r}, this version reads {SCHEDULE_FORMAT}")
        faults = [Fault(**f) for f in raw["faults"]]
        bad = [f for f in faults if f.kind not in KINDS or f.at_s < 0 or f.hold_s < 0]
        if bad:
            raise ConfigError(f"{where}: faults {bad} have an unknown kind or a negative time")
        return Schedule(int(raw["seed"]), float(raw["duration_s"]), list(raw["kinds"]), float(raw["rate_per_min"]),
                        int(raw["overlaps"]), faults)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{where}: not a chaos schedule written by `laminar chaos` ({e})") from None


def format_schedule(s: Schedule) -> str:
    lines = [f"chaos schedule seed={s.seed} duration={s.duration_s:.0f}s faults={len(s.faults)} "
             f"kinds={','.join(sorted({f.kind for f in s.faults}))} overlapping={overlapping(s.faults)}"]
    lines += [f"  #{f.index:<3} +{f.at_s:7.2f}s {f.kind:<9} {f.target:<16} hold {f.hold_s:5.2f}s" for f in s.faults]
    return "\n".join(lines)
