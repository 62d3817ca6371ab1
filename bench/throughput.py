"""`laminar bench throughput`: every scheduling mode on the same workload and seed, on the real stack.

One Temporal dev server for the whole command; for each (workload, mode) a run of its own (own run id) with
a fresh set of worker processes (control, trainer, one relay and one rollout worker per simulated host), so no
mode inherits another's process state (the trainer's last step time, the relays' versions, busy slots). The
modes run one after another, never at the same time: they would share the machine's two cores.

The scaled workload (fixed before any result was seen; never tuned to one). With R replicas:

| override | value | why |
| --- | --- | --- |
| `rollout.max_inflight_groups` | 4 | per-rollout concurrency: 4 groups x 8 samples = 32 sequences, below the modelled roofline batch (64) |
| `rollout.group_size` | 8 | GRPO group size of the paper's setup |
| `trainer.groups_per_step` | R x 4 (32 for 8 replicas) | global batch = replicas x per-rollout concurrency, as in the paper's section 8: 8 x 4 x 8 = 256 samples |
| `rollout.max_ready_groups` | 2 x groups_per_step (64) | the least one_step/stream accept (2 batches in flight); laminar's back-pressure at the same bound |
| `run.steps` | `--iterations` (x 4 for stream) | one step per global batch; stream's step is a minibatch |
| `trainer.minibatches` | 4 in `stream` only | stream trains each quarter of a batch (8 groups, 64 samples for 8 replicas) as soon as it is complete; with 1 it would be one_step |
| `rollout.engine`, `trainer.engine` | `--engine` | `modelled` (default): GPU time from the [modelled] section |
| `modelled.workload` | `--workload` | `long_tail` (p99 = 10 x p50), `uniform` (+-20 %) or `tools` (2..6 turns, tool calls p50 2 s / p99 20 s) |
| `modelled.speedup` | 25 (long_tail, tools), 10 (uniform) | keeps the control plane a small share of the shorter uniform iterations (WORKLOAD_SPEEDUP) |

Extra `--section.key=value` arguments override on top (tests shrink the torch model with them).

Metrics, per run (pure functions below, from records to numbers). Time is MODELLED time: wall seconds x
`modelled.speedup` (1 for the torch engine), so a number reads as a GPU-cluster number. The first
`warmup_steps(run.steps)` trainer steps (the first fifth; whole batches in stream too) are a warm-up; the measured window runs from the end of the last warm-up step
(its metric record's `time`) to the end of the last step.

- `tokens_per_s`: the paper's throughput: prompt + response tokens of the global batches trained in the window
  / the window's length (the mean over consecutive trainer-update completions, weighted by their durations).
  Samples the trainer dropped as too stale are not trained and not counted (`samples_dropped_stale`).
- `generation_tokens_per_s`: response tokens of every trajectory (consumed or not) that ended in the window /
  the window's length.
- `kv_utilisation`: the workflow's `status` query is polled every POLL_S; each poll in the window gives the
  mean over replicas of kv_used / kv_capacity (the last report each replica sent); the mean over those polls.
- `slot_utilisation`: as kv_utilisation, with each replica's sequences in flight / its slots
  (max_inflight_groups x group_size).
- `trainer_idle_fraction`: in the window, the trainer's wait between steps / (wait + step).
- `weight_sync_stall_s`: the trainer's publish stall per global batch (its step records' `stall_s` summed over
  the window / the window's batches; stream publishes once per batch of 4 minibatch steps).
- `staleness_histogram`, `staleness_max`: the final status's (whole run): trainer version - sample version.
- `latency_p50_s`, `latency_p99_s`: ended_at - started_at of the consumed trajectories (nearest rank).
- `groups_consumed_twice`: the final status's; must be 0.
- `control_plane_share`: the trainer profile's `wait_control_plane` (time from a batch's last trajectory
  ending to the trainer starting the step on it) / the trainer's iteration time (wait + step), steps 2..n.
- `ratio_to_laminar`: tokens_per_s / laminar's on the same workload.

Which trajectories were consumed is derived, not logged: barrier modes (sync, one_step, stream) train exactly
batch b at step b, so the consumed groups are those of prompt batches below the final step; the others train
the oldest ready groups, and a replica reports a group as it completes, so they are the first
`groups_consumed` groups in order of completion (two groups finishing within a report's round trip of each
other may swap places; their latencies are alike).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, get_args

from laminar import contract
from laminar.client.settings import Settings
from laminar.config import MODES, Engine, RunConfig
from laminar.contract import RunStatus
from laminar.errors import LaminarError
from laminar.logs import get_logger
from laminar.reporting.report import (
    version_intervals,  # per-replica timeline, in modelled s with scale=time_scale
)
from laminar.reporting.summary import build_profile, percentile
from laminar.rl.factory import check_engines, time_modelled
from laminar.rl.factory import time_scale as engine_time_scale
from laminar.storage.objects import ObjectStore
from laminar.storage.records import TrajRow, step_records, trajectory_rows

WORKLOADS = ("long_tail", "uniform", "tools")
WORKLOAD_SETS = {"both": ("long_tail", "uniform"), "all": WORKLOADS}  # --workload names for several workloads
GROUPS_PER_REPLICA = 4  # rollout.max_inflight_groups: per-rollout concurrency (groups)
GROUP_SIZE = 8  # rollout.group_size (samples per prompt)
STREAM_MINIBATCHES = 4  # trainer.minibatches in stream mode: trainer steps per global batch
# Global batches per run. With modelled.speedup 25 (at 100 the control plane was 20-73 % of iteration time),
# sync takes ~18 wall s a batch on the long tail, so 8 batches keep the whole default command (five modes, both
# workloads) inside the 15 minutes it should take on this 2-core machine; the first batch is the warm-up.
DEFAULT_ITERATIONS = 8
# modelled.speedup per workload. The real machinery's wall-clock latency (a report, a workflow task, an activity
# dispatch: tens of ms each) is multiplied by the speedup, so it weighs most where iterations are short. A
# long-tailed iteration lasts ~300 modelled s (its longest trajectory) and 25 keeps the control plane under 5 %
# of it; a uniform iteration lasts ~40 modelled s, and at 25 the share was 5-30 % (stream pays it once per
# minibatch). 10 brings it down by 2.5x, for ~1.5 more wall minutes on the uniform runs. Chosen from the
# control-plane share alone (a fidelity check), never from a throughput ratio; `--modelled.speedup=X` overrides.
# tools: as long_tail (its turns are long-tailed and the tool waits only lengthen an iteration), set before any run.
WORKLOAD_SPEEDUP = {"long_tail": 25.0, "uniform": 10.0, "tools": 25.0}
POLL_S = 0.5  # status poll period for KV occupancy and progress (wall s)
RUN_TIMEOUT_S = 900.0  # one run's wall-clock limit; past it the run is cancelled and reported as failed


# -- configuration -------------------------------------------------------------------------------------

def warmup_steps(iterations: int) -> int:
    """Steps excluded from the time-based metrics: the first fifth, at least 1 (the first step also waits for
    worker start-up and the first weights). iterations=20 -> 4; 3 -> 1."""
    if iterations < 2:
        raise ValueError(f"iterations={iterations} leaves no step after the warm-up; use --iterations 2 or more")
    return max(1, iterations // 5)


def scaled_overrides(mode: str, replicas: int, engine: str, workload: str, iterations: int) -> list[str]:
    """The `section.key=value` overrides of one run (see the module docstring for the choice of numbers)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not a run mode; one of {', '.join(MODES)}")
    if workload not in WORKLOADS:
        raise ValueError(f"workload={workload!r} is not a modelled workload; one of {', '.join(WORKLOADS)}")
    if engine not in get_args(Engine):
        raise ValueError(f"engine={engine!r} is not an engine; use {' or '.join(get_args(Engine))}")
    groups_per_step = replicas * GROUPS_PER_REPLICA
    per_batch = STREAM_MINIBATCHES if mode == "stream" else 1  # trainer steps per global batch
    return [
        f"run.mode={mode}",
        f"run.steps={iterations * per_batch}",
        f"trainer.minibatches={per_batch}",
        f"rollout.replicas={replicas}",
        f"rollout.engine={engine}",
        f"trainer.engine={engine}",
        f"modelled.workload={workload}",
        *([f"modelled.speedup={WORKLOAD_SPEEDUP[workload]:g}"] if time_modelled(engine) else []),
        f"rollout.group_size={GROUP_SIZE}",
        f"rollout.max_inflight_groups={GROUPS_PER_REPLICA}",
        f"trainer.groups_per_step={groups_per_step}",
        f"rollout.max_ready_groups={2 * groups_per_step}",
    ]


def time_scale(cfg: RunConfig) -> float:
    """Modelled seconds per wall second: modelled.speedup for the modelled engine, 1 for torch (laminar.rl.factory)."""
    return engine_time_scale(cfg)


# -- records -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KvPoll:
    """One status poll: wall time and each replica's last (kv_used, kv_capacity) report (tokens), and its
    sequences in flight."""

    at: float
    kv: list[tuple[int, int]]
    in_flight: tuple[int, ...] = ()


def trainer_control_plane_s(store: ObjectStore, run_id: str) -> float:
    """Seconds the trainer's profile puts in `wait_control_plane` (summed over its processes)."""
    return float(build_profile(store, run_id, {})["trainer"]["buckets"].get("wait_control_plane", {"s": 0.0})["s"])


# -- metric arithmetic (pure) --------------------------------------------------------------------------

def window(records: list[dict[str, Any]], warmup: int) -> tuple[list[dict[str, Any]], float, float]:
    """(records after the warm-up, window start, window end): from the `time` of step `warmup` (the end of the
    last warm-up step) to the `time` of the last step. Records must be sorted by step."""
    if len(records) <= warmup:
        raise ValueError(f"{len(records)} step records but warm-up is {warmup} steps: nothing to measure; "
                         f"raise --iterations")
    return records[warmup:], records[warmup - 1]["time"], records[-1]["time"]


def mean_prompt_tokens(trajs: Iterable[TrajRow]) -> float:
    """Mean prompt length (tokens); the step records carry response lengths only."""
    lengths = [t.prompt_tokens for t in trajs]
    return sum(lengths) / len(lengths) if lengths else 0.0


def batch_tokens(record: dict[str, Any], prompt_tokens: float) -> float:
    """Prompt + response tokens one step trained on: samples x prompt length + its response tokens (`samples`
    and `tokens` of the step record count what was trained, without samples dropped as too stale)."""
    return record["samples"] * prompt_tokens + record["tokens"]


def tokens_per_s(records: list[dict[str, Any]], warmup: int, prompt_tokens: float, scale: float) -> float:
    """The paper's throughput: batch tokens trained in the window / the window's length in modelled s."""
    measured, t_from, t_to = window(records, warmup)
    span = (t_to - t_from) * scale
    return sum(batch_tokens(r, prompt_tokens) for r in measured) / span if span > 0 else 0.0


def generation_tokens_per_s(trajs: Iterable[TrajRow], t_from: float, t_to: float, scale: float) -> float:
    """Response tokens of trajectories that ended in (t_from, t_to] / (t_to - t_from) in modelled s."""
    span = (t_to - t_from) * scale
    tokens = sum(t.response_tokens for t in trajs if t_from < t.ended_at <= t_to)
    return tokens / span if span > 0 else 0.0


def kv_utilisation(polls: Iterable[KvPoll], t_from: float, t_to: float) -> float | None:
    """Mean over polls in [t_from, t_to] of the mean over reporting replicas (capacity > 0) of used / capacity;
    None when no poll in the window has a report."""
    per_poll = []
    for p in polls:
        shares = [used / cap for used, cap in p.kv if cap > 0]
        if t_from <= p.at <= t_to and shares:
            per_poll.append(sum(shares) / len(shares))
    return sum(per_poll) / len(per_poll) if per_poll else None


def slot_utilisation(polls: Iterable[KvPoll], t_from: float, t_to: float, slots: int) -> float | None:
    """Mean over polls in [t_from, t_to] of the mean over replicas of in-flight sequences / `slots` (the
    replica's concurrency, rollout.max_inflight_groups x group_size); None when no poll has a report. With the
    modelled H800's KV capacity far above 32 sequences, this is the utilisation that moves between modes."""
    per_poll = [sum(p.in_flight) / (len(p.in_flight) * slots) for p in polls
                if t_from <= p.at <= t_to and p.in_flight and slots > 0]
    return sum(per_poll) / len(per_poll) if per_poll else None


def trainer_idle_fraction(records: list[dict[str, Any]], warmup: int) -> float:
    """In the window: sum of the trainer's waits before each step / sum of (wait + step busy time)."""
    measured, _, _ = window(records, warmup)
    wait = sum(r["wait_s"] for r in measured)
    total = wait + sum(r["busy_s"] for r in measured)
    return wait / total if total > 0 else 0.0


def weight_sync_stall_s(records: list[dict[str, Any]], warmup: int, scale: float, steps_per_batch: int = 1) -> float:
    """Trainer publish stall per global batch (= per version published) in the window, modelled s: the stalls
    summed over the window's steps / its batches (stream publishes once per `steps_per_batch` minibatch steps)."""
    measured, _, _ = window(records, warmup)
    return scale * sum(r.get("stall_s") or 0.0 for r in measured) * steps_per_batch / len(measured)


def staleness(histogram: dict[str, int]) -> tuple[dict[int, int], int]:
    """(version gap -> samples, gaps with samples only, sorted; the largest gap, 0 when empty)."""
    hist = {int(k): v for k, v in sorted(histogram.items(), key=lambda kv: int(kv[0])) if v > 0}
    return hist, max(hist, default=0)


def consumed_group_ids(trajs: Iterable[TrajRow], whole_batches: bool, groups_per_step: int,
                       groups_consumed: int) -> set[str]:
    """The groups the trainer consumed (see the module docstring); a group completes when its last sample ends.
    whole_batches: batches are consumed in order, so the n = groups_consumed // groups_per_step whole batches
    (prompts below n x groups_per_step), plus, when the run ended inside batch n (stream trains a batch in
    minibatches, each taking groups as they complete), its first groups_consumed % groups_per_step groups to
    complete. Otherwise: the first `groups_consumed` groups to complete."""
    completed: dict[str, float] = {}
    prompt: dict[str, int] = {}
    for t in trajs:
        completed[t.group_id] = max(completed.get(t.group_id, t.ended_at), t.ended_at)
        prompt[t.group_id] = t.prompt_id
    by_completion = sorted(completed, key=lambda g: (completed[g], g))
    if not whole_batches:
        return set(by_completion[:groups_consumed])
    batches, rest = divmod(groups_consumed, groups_per_step)
    whole = {g for g, p in prompt.items() if p // groups_per_step < batches}
    started = [g for g in by_completion if prompt[g] // groups_per_step == batches]
    return whole | set(started[:rest])


def latency_percentiles(trajs: Iterable[TrajRow], consumed: set[str], scale: float) -> tuple[float, float]:
    """(p50, p99) of ended_at - started_at over the consumed groups' trajectories, modelled s, nearest rank."""
    lat = sorted((t.ended_at - t.started_at) * scale for t in trajs if t.group_id in consumed)
    return percentile(lat, 50), percentile(lat, 99)


def control_plane_share(wait_control_plane_s: float, records: list[dict[str, Any]]) -> float:
    """Control-plane wait / iteration time over steps 2..n (the first step has no previous step to wait from;
    the trainer profile's wait_control_plane covers exactly those steps)."""
    total = sum(r["wait_s"] + r["busy_s"] for r in records[1:])
    return wait_control_plane_s / total if total > 0 else 0.0


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Set each result's ratio_to_laminar: its tokens_per_s / laminar's on the same workload (None without);
    laminar with repack when both were run (the default config repacks)."""
    base: dict[str, float] = {}
    for r in sorted(results, key=lambda r: bool(r.get("repack"))):  # repack on last: it wins
        if r["mode"] == "laminar" and r.get("tokens_per_s"):
            base[r["workload"]] = r["tokens_per_s"]
    for r in results:
        b = base.get(r["workload"])
        r["ratio_to_laminar"] = round(r["tokens_per_s"] / b, 3) if b and r.get("tokens_per_s") is not None else None


# -- one run's result ----------------------------------------------------------------------------------

@dataclass
class RunData:
    """What one run left behind: the final status, the KV polls, the run's wall start and its records."""

    cfg: RunConfig
    final: RunStatus
    started_at: float
    polls: list[KvPoll]
    records: list[dict[str, Any]] = field(default_factory=list)
    trajectories: list[TrajRow] = field(default_factory=list)
    control_plane_s: float = 0.0
    migrations: list[tuple[float, str, str, int]] = field(default_factory=list)  # (wall at, source, dest, groups)


def repack_events(statuses: Iterable[RunStatus]) -> list[tuple[float, str, str, int]]:
    """The carried-out migrations (`repack_moved` events) seen in any of these statuses, once each, in time order:
    (workflow time, source, destination, groups moved; -1 when the bounded recent-events list had dropped it)."""
    times: set[tuple[float, str]] = set()
    counts: dict[tuple[float, str], int] = {}
    for st in statuses:
        for e in st.events:
            if e.kind == "repack_moved":
                counts[(e.at, e.subject)] = e.count
        for key, at_times in st.event_times.items():
            kind, _, subject = key.partition("/")
            if kind == "repack_moved":
                times.update((at, subject) for at in at_times)
    return [(at, *subject.split("->", 1), counts.get((at, subject), -1)) for at, subject in sorted(times)]


def measure(data: RunData) -> dict[str, Any]:
    """The result row of one run (see the module docstring for each metric)."""
    from laminar.policy import policy_for

    cfg, final = data.cfg, data.final
    scale = time_scale(cfg)
    policy = policy_for(cfg)
    per_batch = policy.steps_per_version  # stream: minibatch steps per global batch
    warm = warmup_steps(cfg.run.steps // per_batch) * per_batch  # whole batches
    _, t_from, t_to = window(data.records, warm)
    consumed = consumed_group_ids(data.trajectories, policy.whole_batches, cfg.trainer.groups_per_step,
                                  final.groups_consumed)
    hist, gap_max = staleness(final.staleness_histogram)
    p50, p99 = latency_percentiles(data.trajectories, consumed, scale)
    kv = kv_utilisation(data.polls, t_from, t_to)
    slots = slot_utilisation(data.polls, t_from, t_to, cfg.rollout.max_inflight_groups * cfg.rollout.group_size)
    return {
        "mode": cfg.run.mode,
        "workload": cfg.modelled.workload,
        "run_id": cfg.run.run_id,
        "tokens_per_s": round(tokens_per_s(data.records, warm, mean_prompt_tokens(data.trajectories), scale), 1),
        "generation_tokens_per_s": round(generation_tokens_per_s(data.trajectories, t_from, t_to, scale), 1),
        "kv_utilisation": None if kv is None else round(kv, 4),
        "slot_utilisation": None if slots is None else round(slots, 4),
        "trainer_idle_fraction": round(trainer_idle_fraction(data.records, warm), 4),
        "weight_sync_stall_s": round(weight_sync_stall_s(data.records, warm, scale, per_batch), 4),
        "staleness_max": gap_max,
        "staleness_histogram": {str(k): v for k, v in hist.items()},
        "latency_p50_s": round(p50, 3),
        "latency_p99_s": round(p99, 3),
        "groups_consumed_twice": final.groups_consumed_twice,
        "reprefill_tokens": final.reprefill_tokens,  # partial rollout's interrupts, repack's migrations
        "repack": policy.repacks,
        "repacks": final.repacks,
        "repack_groups": final.repack_groups,
        # per migration, wall s: the source's stop + segment write and the destination's read + admission (the
        # destination's re-prefill is modelled engine time, inside the throughput figures)
        "repack_overhead_s": round(final.repack_overhead_s / final.repacks, 4) if final.repacks else None,
        "samples_dropped_stale": sum(r.get("dropped_stale", 0) for r in data.records),
        "control_plane_share": round(control_plane_share(data.control_plane_s, data.records), 4),
        "time_scale": scale,  # modelled s per wall s of this run (WORKLOAD_SPEEDUP; 1 for torch)
        "ratio_to_laminar": None,
        "iterations": final.policy_version,  # global batches trained (= trainer steps except in stream)
        "trainer_steps": final.step,
        "warmup_steps": warm,
        "window_s": round((t_to - t_from) * scale, 2),
        "wall_s": round(t_to - data.started_at, 2),
        "time_unit": "modelled s" if scale != 1.0 else "wall s",
    }


# -- driving the runs ----------------------------------------------------------------------------------

Progress = Callable[[str, RunStatus | None, str], None]  # (label, latest status or None, note)
# Starts a run's worker processes, returns what stops them; the CLI passes its launcher in (docs/decisions/layers.md).
LaunchWorkers = Callable[[RunConfig, Settings, Path], Callable[[], None]]


@dataclass(frozen=True)
class BenchSpec:
    """What `laminar bench throughput` was asked for."""

    modes: tuple[str, ...]
    workloads: tuple[str, ...]
    replicas: int = 8
    engine: str = "modelled"
    iterations: int = DEFAULT_ITERATIONS
    config_path: Path | None = None
    extra_overrides: tuple[str, ...] = ()
    run_timeout_s: float = RUN_TIMEOUT_S
    repack: tuple[bool, ...] = (True,)  # laminar runs with repack on, off or both (--repack on,off)
    owner: str = "laminar bench throughput"  # the command its runs' memo names (`laminar list`)

    def runs(self) -> list[tuple[str, str, bool]]:
        """(workload, mode, repack) of every run, in order: laminar once per repack setting, the others once."""
        return [(w, m, r) for w in self.workloads for m in self.modes
                for r in (self.repack if m == "laminar" else (False,))]

    def run_config(self, mode: str, workload: str, stamp: str, repack: bool = True) -> RunConfig:
        overrides = [*scaled_overrides(mode, self.replicas, self.engine, workload, self.iterations),
                     f"rollout.repack={str(repack and mode == 'laminar').lower()}", *self.extra_overrides]
        cfg = check_engines(RunConfig.load(self.config_path, overrides))
        suffix = "-norepack" if mode == "laminar" and not repack else ""
        return cfg.with_run_id(f"bench-{stamp}-{workload.replace('_', '')}-{mode.replace('_', '')}{suffix}")


def run_bench(spec: BenchSpec, progress: Progress, launch: LaunchWorkers) -> dict[str, Any]:
    """Start (or reuse) the dev stack, run every (workload, mode) one after another, return the report."""
    from laminar.devstack.stack import DevStack

    for workload, mode, repack in spec.runs():  # fail on a bad mode or override before anything starts
        spec.run_config(mode, workload, "check", repack)
    warmup_steps(spec.iterations)
    home = Settings.from_env().home
    stack = DevStack(home)
    info, started_stack = stack.ensure_up(ui=False)
    started: list[str] = []  # the runs this benchmark started: none may outlive it
    try:
        settings = Settings.from_env().with_relay_token()
        progress("dev stack", None, f"temporal={info.temporal_address} store={settings.store_url}")
        try:
            results = asyncio.run(_run_all(spec, settings, progress, launch, started))
        except BaseException:  # interrupted (SIGTERM, Ctrl-C) or failed: end what it started, then go
            from laminar.client.run_control import end_runs_now

            end_runs_now(settings, started, f"{spec.owner} was interrupted or failed",
                         say=lambda m: progress("dev stack", None, m))
            raise
    finally:
        if started_stack:
            stack.down()
    add_ratios(results)
    first = spec.run_config(spec.modes[0], spec.workloads[0], "cfg")
    return {
        "results": results,
        "config": {
            "modes": list(spec.modes), "workloads": list(spec.workloads), "replicas": spec.replicas,
            "repack": list(spec.repack),
            "engine": spec.engine, "iterations": spec.iterations, "warmup_steps": warmup_steps(spec.iterations),
            "overrides": [o for o in scaled_overrides("laminar", spec.replicas, spec.engine, spec.workloads[0],
                                                      spec.iterations)
                          if not o.startswith(("run.mode=", "modelled.workload=", "run.steps=", "trainer.minibatches=",
                                               "rollout.repack=", "modelled.speedup="))] + list(spec.extra_overrides),
            "groups_per_step": first.trainer.groups_per_step, "group_size": first.rollout.group_size,
            "stream_minibatches": STREAM_MINIBATCHES,
            "relays": first.relay.relays, "seed": first.run.seed, "time_scale": time_scale(first),
            "time_scale_by_workload": {w: time_scale(spec.run_config(spec.modes[0], w, "cfg")) for w in spec.workloads},
            "modelled": first.modelled.model_dump(mode="json") if time_modelled(spec.engine) else None,
            "cpus": os.cpu_count(), "config_file": str(spec.config_path) if spec.config_path else None,
        },
    }


async def _run_all(spec: BenchSpec, settings: Settings, progress: Progress,
                   launch: LaunchWorkers, started: list[str]) -> list[dict[str, Any]]:
    from laminar.client.connect import connect, store_for

    client = await connect(settings, core_logs=False)
    store = store_for(settings)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    results = []
    for workload, mode, repack in spec.runs():
        cfg = spec.run_config(mode, workload, stamp, repack)
        label = f"{mode}{'' if mode != 'laminar' or len(spec.repack) < 2 else ' +repack' if repack else ' -repack'} ({workload})"
        try:
            data = await _run_one(client, store, settings, cfg, label, progress, spec, launch, started)
            row = measure(data)
            scale = time_scale(cfg)
            row["timeline"] = {r: [[round(s, 2), round(e, 2), v] for s, e, v in iv]
                               for r, iv in version_intervals(data.trajectories, data.started_at, scale).items()}
            row["migrations"] = [[round((at - data.started_at) * scale, 2), src, dst, n]
                                 for at, src, dst, n in data.migrations]
        except Exception as exc:  # noqa: BLE001 - one failed run (or a Temporal outage) must not lose the others
            progress(label, None, f"failed: {exc}")
            row = {"mode": mode, "workload": workload, "run_id": cfg.run.run_id, "error": str(exc),
                   "tokens_per_s": None, "iterations": 0, "repack": repack and mode == "laminar"}
        results.append(row)
    return results


async def _run_one(client, store: ObjectStore, settings: Settings, cfg: RunConfig, label: str, progress: Progress,
                   spec: BenchSpec, launch: LaunchWorkers, started: list[str]) -> RunData:
    """One run on its own workers. Whatever ends it early (a timeout, a failure, an interrupt) terminates its
    workflow before its workers stop: a run left Running would be served by the next run's workers."""
    from temporalio.client import WorkflowFailureError

    from laminar.client.run_control import start_stored_run
    from laminar.client.watch import watch_run

    polls: list[KvPoll] = []
    statuses: list[RunStatus] = []  # for the repack events (bounded windows: polled often enough not to miss one)

    async def sample(handle) -> None:
        """The benchmark's KV and slot occupancy and repack events: the status query every POLL_S. The one
        periodic workflow query left (docs/decisions/no-periodic-queries.md): only a status has these, and a bench run has its own dev
        stack with no Temporal restart, so no query waits for a control worker with no poll open."""
        while True:
            try:
                st = await handle.query(contract.STATUS, result_type=RunStatus, rpc_timeout=timedelta(seconds=5))
            except Exception:  # the control worker (re)starting: the next poll
                pass
            else:
                polls.append(KvPoll(time.time(), [(r.kv_used, r.kv_capacity) for r in st.replicas],
                                    tuple(r.in_flight for r in st.replicas)))
                statuses.append(st)
                progress(label, st, "")
            await asyncio.sleep(POLL_S)

    def record(_p, note: str) -> None:  # the watch's describe: only its notes (an outage) are shown
        if note:
            progress(label, None, note)

    log_dir = settings.home / "logs" / cfg.run.run_id
    stop_workers = launch(cfg, settings, log_dir)
    handle, timeout_s, sampler = None, spec.run_timeout_s, None
    try:
        handle = await start_stored_run(client, store, cfg, owner=spec.owner)
        started.append(cfg.run.run_id)
        t0 = time.time()
        progress(label, None, f"run {cfg.run.run_id} started; logs in {log_dir}")
        sampler = asyncio.create_task(sample(handle))
        async with asyncio.timeout(timeout_s):  # past it, watch_run cancels the run
            final = await watch_run(handle, record, POLL_S)
        progress(label, final, "finished")
    except TimeoutError:
        await _end(handle, f"{spec.owner}: {label} timed out")
        raise LaminarError(f"{label}: run {cfg.run.run_id} did not finish within {timeout_s:.0f} s; "
                           f"see the worker logs in {log_dir}") from None
    except WorkflowFailureError as exc:
        raise LaminarError(f"{label}: run {cfg.run.run_id} failed: {exc.cause or exc}") from None
    except BaseException:  # an interrupt (SIGTERM, Ctrl-C: cancelled or KeyboardInterrupt) or any failure
        await _end(handle, f"{spec.owner}: {label} was interrupted or failed")
        raise
    finally:
        if sampler is not None:
            sampler.cancel()
        stop_workers()
    return RunData(cfg=cfg, final=final, started_at=t0, polls=polls,
                   records=step_records(store, cfg.run.run_id),
                   trajectories=trajectory_rows(store, cfg.run.run_id),
                   control_plane_s=trainer_control_plane_s(store, cfg.run.run_id),
                   migrations=repack_events([*statuses, final]))


async def _end(handle, reason: str) -> None:
    """Terminate a run that ended early, unless it is closed already (through the server: no worker needed)."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.service import RPCError

    if handle is None:  # not started
        return
    try:
        if (await handle.describe()).status == WorkflowExecutionStatus.RUNNING:
            await handle.terminate(reason=reason)
    except RPCError as e:  # run_bench's end_runs_now tries again, and says so if it cannot
        get_logger(__name__).warning("bench_run_not_ended", workflow_id=handle.id, error=str(e))


# -- output --------------------------------------------------------------------------------------------

def fmt_num(v: float) -> str:
    """3 significant digits at most, thousands separated: 12345.6 -> '12,346', 41.23 -> '41.2', 0.0123 -> '0.0123'."""
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}"


COLUMNS = [  # (key, header, format: a format string or a function)
    ("mode", "mode", "{}"), ("workload", "workload", "{}"), ("tokens_per_s", "tokens/s", fmt_num),
    ("ratio_to_laminar", "vs laminar", "{:.2f}x"), ("generation_tokens_per_s", "gen tokens/s", fmt_num),
    ("kv_utilisation", "KV use", "{:.0%}"), ("slot_utilisation", "slots used", "{:.0%}"),
    ("trainer_idle_fraction", "trainer idle", "{:.0%}"),
    ("weight_sync_stall_s", "sync stall s", fmt_num), ("staleness_max", "stale max", "{}"),
    ("latency_p50_s", "lat p50 s", fmt_num), ("latency_p99_s", "lat p99 s", fmt_num),
    ("groups_consumed_twice", "twice", "{}"), ("control_plane_share", "ctrl plane", "{:.1%}"),
    ("repacks", "repacks", "{}"), ("iterations", "iters", "{}"),
]


def run_label(r: dict[str, Any]) -> str:
    """The mode, marked +repack / -repack for a laminar run when the report has both."""
    if r["mode"] != "laminar" or "repack" not in r:
        return r["mode"]
    return "laminar +repack" if r["repack"] else "laminar -repack"


def table_rows(report: dict[str, Any]) -> list[list[str]]:
    """Formatted cells per result ('-' for a missing value, the error for a failed run)."""
    rows = []
    for r in report["results"]:
        cells = []
        for key, _, fmt in COLUMNS:
            v = run_label(r) if key == "mode" and len(report["config"].get("repack", [])) > 1 else r.get(key)
            cells.append("-" if v is None else fmt(v) if callable(fmt) else fmt.format(v))
        if r.get("error"):
            cells[2] = f"failed: {r['error'][:60]}"
        rows.append(cells)
    return rows


def plot(report: dict[str, Any], path: Path) -> None:
    """Throughput bars per mode and workload, then per run a per-replica timeline of the policy version each
    replica generated with (x: modelled time since the run's start; the paper's Fig. 3 from measured data)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import colormaps

    results = [r for r in report["results"] if r.get("tokens_per_s") is not None]
    both = len(report["config"].get("repack", [])) > 1
    label = run_label if both else (lambda r: r["mode"])
    modes = list(dict.fromkeys(label(r) for r in report["results"]))
    workloads = list(dict.fromkeys(r["workload"] for r in report["results"]))
    fig = plt.figure(figsize=(7 * len(workloads), 3.2 + 2.4 * len(modes)))
    grid = fig.add_gridspec(1 + len(modes), len(workloads), height_ratios=[1.4] + [1] * len(modes))
    bars = fig.add_subplot(grid[0, :])
    width = 0.8 / max(1, len(workloads))
    for j, w in enumerate(workloads):
        ys = [next((r["tokens_per_s"] for r in results if label(r) == m and r["workload"] == w), 0) for m in modes]
        xs = [i + (j - (len(workloads) - 1) / 2) * width for i in range(len(modes))]
        drawn = bars.bar(xs, ys, width, label=w)
        bars.bar_label(drawn, fmt="{:,.0f}", fontsize=7)
    unit = results[0]["time_unit"] if results else "s"
    bars.set(xticks=range(len(modes)), xticklabels=modes, ylabel=f"tokens / {unit}",
             title=f"Throughput (prompt + response tokens per {unit}), {report['config']['replicas']} replicas, "
                   f"{report['config']['engine']} engine, {report['config']['iterations']} steps")
    bars.title.set_fontsize(10)
    bars.legend()
    bars.grid(axis="y", alpha=0.3)
    cmap = colormaps["viridis"]
    for i, m in enumerate(modes):
        for j, w in enumerate(workloads):
            ax = fig.add_subplot(grid[1 + i, j])
            r = next((r for r in results if label(r) == m and r["workload"] == w), None)
            ax.set_title(f"{m} ({w}): policy version per replica", fontsize=9)
            if r is None:
                ax.text(0.5, 0.5, "no result", ha="center", va="center", transform=ax.transAxes)
                continue
            timeline = r.get("timeline", {})
            top = max((v for iv in timeline.values() for _, _, v in iv), default=0)
            ends = [e for iv in timeline.values() for _, e, _ in iv]
            starts = [st for iv in timeline.values() for st, _, _ in iv]
            span = max(ends) - min(starts) if ends else 1.0
            for y, intervals in enumerate(timeline.values()):
                for s, e, v in intervals:
                    ax.broken_barh([(s, e - s)], (y - 0.4, 0.8), color=cmap(v / max(1, top)))
                    if e - s > span / 40:
                        ax.text((s + e) / 2, y, str(v), ha="center", va="center", fontsize=6, color="white")
            rows = {replica: y for y, replica in enumerate(timeline)}
            for at, src, dst, _ in r.get("migrations", []):  # repack: an arrow from source to destination
                if src in rows and dst in rows:
                    ax.annotate("", xy=(at, rows[dst]), xytext=(at, rows[src]),
                                arrowprops={"arrowstyle": "->", "color": "red", "lw": 0.8})
            if r.get("migrations"):
                ax.set_title(f"{m} ({w}): policy version per replica; red arrows: repack migrations", fontsize=9)
            ax.set(yticks=range(len(timeline)), yticklabels=list(timeline), xlabel=unit)
            ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def dump_json(report: dict[str, Any], path: Path) -> None:
    """The report as indented JSON; each result keeps its `timeline` ({replica: [[start, end, version]]},
    modelled s), so `plot` can redraw the figure from the file."""
    path.write_text(json.dumps(report, indent=2) + "\n")
