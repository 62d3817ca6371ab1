"""The chaos checker: judges a finished run from its durable records, never from live counters.

Records read (gather): the workflow's result (its final RunStatus, from the run's history), every per-step
metric record in the store (one per step; a redone step overwrites its own), every committed checkpoint
(each file's size and sha256 against its manifest), the launcher's process table, and what the nemesis did.
The checks are pure functions of those records, so each is unit-tested with records that must turn it red.

| check | green when |
|-------|------------|
| accounting | every issued prompt group is consumed, waiting, leased, returned for re-lease or dropped with a reason (prompts_issued = generated + failed + leased + returned; generated = consumed + waiting), the step records name exactly the consumed groups, and none twice |
| versions | every group a step trained on came from one policy version |
| checkpoints | every committed checkpoint verifies, and there is one |
| steps | step records 1..N, each once, completed in step order (a redone step rewrites a suffix, so replays keep the order) |
| reward | the reward rose over the run (reporting.summary.reward_rise > 0) |
| processes | after the launcher stopped, no incarnation of its table (pid and start time: a pid the OS gave to a later process is not one) is alive, and no worker of this home runs outside the table |
| faults | every injected fault healed; every preempted worker exited 0; every readonly fault counted the writes it refused |
| tool calls | no tool call ran twice other than by a failure's retry (`tool_calls_rerun` 0, counted from the run's local logs by reporting/tool_calls.py; "not counted" when they are not on this machine) |

The chaos report has a row per fault: injected, healed, detected (the first run event about its target after
injection; at injection for control, store and Temporal, whose work waits in Temporal), recovered (the first
step completed after detection and heal), throughput restored and tokens lost (throughput_restored), and what
the nemesis noted (the ports partitioned, the writes a read-only store refused). A fault the machine could not
inject (a partition without iptables or nft) is a row marked skipped with the reason, and its kind is listed
as skipped in the per-kind table and the verdict's numbers: never silently left out. Skipped faults do not
turn the verdict red; a kind with no fault injected at all is named in the faults check's detail.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from laminar.contract import RunStatus
from laminar.errors import StoreError
from laminar.reporting.summary import reward_rise
from laminar.reporting.tool_calls import ToolCallCount
from laminar.storage import keys
from laminar.storage.checkpoints import CheckpointStore
from laminar.storage.objects import ObjectStore

THROUGHPUT_WINDOW_S = 10.0  # trailing window the restored throughput is measured over
BASELINE_S = 30.0  # the throughput before a fault is measured over this long before it
RESTORED_FRACTION = 0.8  # throughput counts as restored at this share of the baseline
DETECT_WINDOW_S = 30.0  # an event this long after a fault healed is about something else


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Verdict:
    green: bool
    checks: list[Check]
    faults: list[dict] = field(default_factory=list)
    numbers: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


# -- gathering (the store) -------------------------------------------------------------------------------


def read_step_records(store: ObjectStore, run_id: str) -> dict[int, dict]:
    """Every per-step metric record of the run, by the step its key names."""
    out = {}
    for key in store.list(keys.step_metrics_prefix(run_id)):
        try:
            step = int(key.rsplit("/", 1)[1].split(".")[0].removeprefix("step-"))
            out[step] = json.loads(store.get(key))
        except (ValueError, IndexError, StoreError) as e:
            out[-len(out) - 1] = {"unreadable": f"{key}: {e}"}
    return out


def read_workflow_resets(store: ObjectStore, run_id: str) -> list[dict]:
    """The repairer's reset records of the run (services/repair.py), oldest first."""
    found = [json.loads(store.get(k)) for k in store.list(keys.workflow_resets_prefix(run_id))]
    return sorted(found, key=lambda r: r.get("at", 0.0))


def check_resets(resets: list[dict]) -> Check:
    """Every reset of the run's workflow is accounted for: the error, the events and the steps it redid. A reset
    is a repair, not a failure (the run's other checks judge what it cost); one without its facts is red."""
    bad = [r for r in resets if not r.get("error") or not r.get("reset_to") or "step_after" not in r]
    lines = [f"{r['error'][:80]} (events {r['reset_to']}..{r['bad_event_id']}, steps redone "
             f"{max(0, r['step_before'] - r['step_after'])})" for r in resets if r not in bad]
    return Check("workflow resets accounted", not bad,
                 f"{len(resets)} reset(s)" + (": " + "; ".join(lines) if lines else "")
                 + (f"; {len(bad)} without their facts" if bad else ""))


def check_tool_calls(calls: ToolCallCount | None) -> Check:
    """No tool call ran a second time other than by a failure's retry (which regenerates on purpose). None: the
    run's logs were not on this machine, so nothing was counted (green, and said so)."""
    if calls is None:
        return Check("tool calls run once", True, "not counted: the run's logs are not on this machine")
    return Check("tool calls run once", calls.rerun == 0,
                 f"{calls.executions:,} runs of {calls.keys:,} calls; {calls.rerun} run again; "
                 f"{calls.rerun_after_failure} run again by a failure's retry")


def verify_checkpoints(store: ObjectStore, run_id: str) -> dict[int, str | None]:
    cs = CheckpointStore(store)
    return {step: cs.verify(run_id, step) for step in cs.list_committed(run_id)}


# -- checks (pure) ---------------------------------------------------------------------------------------


def check_accounting(final: RunStatus, steps: dict[int, dict]) -> Check:
    issued = final.prompts_issued
    lost = issued - (final.groups_generated + final.groups_failed + final.open_leases + final.returned_leases)
    unconsumed = final.groups_generated - final.groups_consumed - final.ready_groups
    seen: dict[str, int] = {}
    for _step, r in sorted(steps.items()):
        for g in r.get("groups", {}):
            seen[g] = seen.get(g, 0) + 1
    twice = sorted(g for g, n in seen.items() if n > 1)
    trainer_twice = sum(int(r.get("consumed_twice", 0)) for r in steps.values())
    problems = []
    if lost:
        problems.append(f"{lost} group(s) issued but neither generated, failed, leased nor returned")
    if unconsumed:
        problems.append(f"{unconsumed} generated group(s) neither consumed nor waiting")
    if twice or final.groups_consumed_twice or trainer_twice:
        problems.append(f"consumed twice: {twice[:5]} in step records, {final.groups_consumed_twice} by the ledger, "
                        f"{trainer_twice} by the trainer")
    if len(seen) != final.groups_consumed:
        problems.append(f"the step records name {len(seen)} groups, the ledger counts {final.groups_consumed} consumed")
    reasons = sorted({f.reason for f in final.failures}) if final.failures else []
    detail = (f"issued {issued}: consumed {final.groups_consumed}, waiting {final.ready_groups}, leased "
              f"{final.open_leases}, returned {final.returned_leases}, dropped {final.groups_failed}"
              + (f" ({'; '.join(reasons)[:200]})" if reasons else ""))
    return Check("accounting", not problems, "; ".join([*problems, detail]))


def check_versions(steps: dict[int, dict]) -> Check:
    mixed = {g: v for r in steps.values() for g, v in r.get("groups", {}).items() if len(v) != 1}
    groups = sum(len(r.get("groups", {})) for r in steps.values())
    if not groups:
        return Check("versions", False, "no step record names its groups: nothing to check")
    return Check("versions", not mixed, f"{len(mixed)} of {groups} trained groups mix policy versions"
                 + (f": {dict(list(mixed.items())[:3])}" if mixed else ""))


def check_checkpoints(verified: dict[int, str | None]) -> Check:
    bad = {s: p for s, p in verified.items() if p is not None}
    if not verified:
        return Check("checkpoints", False, "no committed checkpoint")
    return Check("checkpoints", not bad, f"{len(verified) - len(bad)} of {len(verified)} committed checkpoints "
                 f"verify (steps {sorted(verified)})" + (f"; {list(bad.values())[:2]}" if bad else ""))


def check_steps(steps: dict[int, dict], final_step: int) -> Check:
    problems = []
    unreadable = [r["unreadable"] for s, r in steps.items() if s < 0]
    numbered = {s: r for s, r in steps.items() if s > 0}
    missing = sorted(set(range(1, final_step + 1)) - set(numbered))
    extra = sorted(set(numbered) - set(range(1, final_step + 1)))
    wrong = sorted(s for s, r in numbered.items() if r.get("step") != s)
    times = [(s, float(numbered[s]["time"])) for s in sorted(numbered) if "time" in numbered[s]]
    out_of_order = [a[0] for a, b in zip(times, times[1:], strict=False) if b[1] < a[1]]
    if unreadable:
        problems.append(f"unreadable: {unreadable[:2]}")
    if missing:
        problems.append(f"gap: steps {missing[:10]} have no record")
    if extra:
        problems.append(f"steps {extra[:10]} beyond the final step {final_step}")
    if wrong:
        problems.append(f"records {wrong[:5]} name another step")
    if out_of_order:
        problems.append(f"repeat: steps {out_of_order[:5]} were written again after a later step")
    return Check("steps", not problems, "; ".join(problems) or f"steps 1..{final_step}, each once, in order")


def check_reward(rewards: list[float]) -> Check:
    rise = reward_rise(rewards)
    return Check("reward", rise > 0, f"reward rise {rise:+.3f} over {len(rewards)} steps (last fifth minus first tenth)"
                 + ("; fewer than 10 steps" if len(rewards) < 10 else ""))


def check_processes(table: dict, alive: set[int], strays: list[int]) -> Check:
    """table: the launcher's process table; alive: the pids of its incarnations that still run (the same pid and
    start time: chaos/command.py `alive`); strays: worker processes of this home that the table does not list."""
    if not table.get("processes"):
        return Check("processes", False, "no process table")
    pids = {pid: r["name"] for r in table["processes"] for pid in r.get("pids", [])}
    leaked = sorted(f"{name} (pid {pid})" for pid, name in pids.items() if pid in alive)
    problems = []
    if not table.get("stopped"):
        problems.append("the launcher never recorded that it stopped")
    if leaked:
        problems.append(f"alive after the launcher stopped: {leaked}")
    if strays:
        problems.append(f"workers outside the table: pids {sorted(strays)}")
    return Check("processes", not problems, "; ".join(problems) or
                 f"{len(pids)} incarnations of {len(table['processes'])} processes, none left")


def skipped_kinds(faults: list[dict]) -> list[str]:
    """Kinds the schedule holds that were never injected: every fault of theirs was skipped."""
    injected = {f["kind"] for f in faults if f.get("injected_at") is not None}
    return sorted({f["kind"] for f in faults if f.get("skipped")} - injected)


def check_faults(faults: list[dict], exit_codes: dict[int, int]) -> Check:
    injected = [f for f in faults if f.get("injected_at") is not None]
    unhealed = [f"#{f['index']} {f['kind']} {f['target']}" for f in injected if f.get("healed_at") is None]
    unclean = [f"#{f['index']} {f['target']} pid {f['pid']} exit {exit_codes.get(f['pid'])}"
               for f in injected if f["kind"] == "preempt" and exit_codes.get(f["pid"]) != 0]
    skipped = [f"#{f['index']} {f['kind']}: {f.get('detail', '')}" for f in faults if f.get("skipped")]
    uncounted = [f"#{f['index']}" for f in injected if f["kind"] == "readonly" and f.get("refused") is None]
    problems = []
    if unhealed:
        problems.append(f"not healed: {unhealed}")
    if unclean:
        problems.append(f"preempted workers that did not exit 0: {unclean}")
    if uncounted:
        problems.append(f"readonly faults without a count of the writes refused: {uncounted}")
    kinds = sorted({f["kind"] for f in injected})
    never = skipped_kinds(faults)
    refused = sum(f.get("refused") or 0 for f in injected if f["kind"] == "readonly")
    detail = (f"{len(injected)} injected ({', '.join(kinds)}), {len(skipped)} skipped"
              + (f": {skipped[:3]}" if skipped else "")
              + (f"; kinds never injected (skipped): {', '.join(never)}" if never else "")
              + (f"; {refused} write(s) refused by a read-only store" if "readonly" in kinds else ""))
    return Check("faults", not problems and bool(injected), "; ".join([*problems, detail]))


# -- the chaos report (pure) -----------------------------------------------------------------------------


def throughput_restored(points: list[tuple[float, int]], injected: float, healed: float,
                        window_s: float = THROUGHPUT_WINDOW_S, baseline_s: float = BASELINE_S,
                        fraction: float = RESTORED_FRACTION) -> tuple[float | None, int | None]:
    """(throughput_restored_at, tokens_lost) from the run's step completions [(time, tokens trained)].

    Baseline: tokens per second over the `baseline_s` before injection. Restored: the first step completion
    at or after the heal whose trailing `window_s` trained at least `fraction` of the baseline. Tokens lost:
    what the baseline rate would have trained from injection to restoration, less what was trained then
    (never below 0). (None, None) without a baseline (no step before the fault); (None, lost so far) when
    throughput never came back."""
    pts = sorted(points)
    base = sum(n for t, n in pts if injected - baseline_s <= t < injected)
    first = min((t for t, _ in pts), default=injected)
    span = min(baseline_s, injected - first)
    if base <= 0 or span <= 0:
        return None, None
    rate = base / span
    restored = None
    for t, _ in pts:
        if t < max(healed, injected + window_s):
            continue
        if sum(n for u, n in pts if t - window_s < u <= t) / window_s >= fraction * rate:
            restored = t
            break
    end = restored if restored is not None else (pts[-1][0] if pts else injected)
    trained = sum(n for t, n in pts if injected < t <= end)
    return restored, max(0, round(rate * (end - injected) - trained))


def detected_at(fault: dict, final: RunStatus) -> float | None:
    """The first run event about the fault's target from injection until DETECT_WINDOW_S after the heal;
    injection itself for the control worker, the store and Temporal (their work waits in Temporal, noticed at
    once by whoever calls). None: the run absorbed the fault unnoticed (e.g. a SIGSTOP shorter than the
    heartbeat timeout)."""
    inj, target = fault["injected_at"], fault["target"]
    until = (fault.get("healed_at") or inj) + DETECT_WINDOW_S
    if target in ("control", "store", "temporal"):
        return inj
    if target == "trainer":
        kinds, subjects = ("trainer_restored",), None
    elif target.startswith("relay-"):
        kinds, subjects = ("relay_lost", "relay_joined"), {target.removeprefix("relay-")}
    else:  # rollout-host-i[-k]: any replica of that host
        host = "-".join(target.removeprefix("rollout-").split("-")[:2])
        kinds = ("replica_rejoined", "replica_recovered", "replica_left")
        subjects = {r.replica_id for r in final.replicas if getattr(r, "host_id", "") == host} or None
    times = [t for key, ts in final.event_times.items() for t in ts
             if key.split("/", 1)[0] in kinds and (subjects is None or key.split("/", 1)[1] in subjects) and inj <= t <= until]
    return min(times, default=None)


def fault_rows(faults: list[dict], final: RunStatus, points: list[tuple[float, int]], t0: float) -> list[dict]:
    rows = []
    step_times = sorted(t for t, _ in points)
    for f in faults:
        if f.get("injected_at") is None:
            rows.append({**_base(f), "skipped": f.get("detail", "")})
            continue
        inj, healed = f["injected_at"], f.get("healed_at") or f["injected_at"]
        det = detected_at(f, final)
        after = max(healed, det or inj)
        recovered = next((t for t in step_times if t > after), None)
        restored, lost = throughput_restored(points, inj, healed)
        rel = lambda t: None if t is None else round(t - t0, 2)  # noqa: E731 - seconds since the chaos start
        rows.append({**_base(f), "injected_s": rel(inj), "healed_s": rel(healed), "detected_s": rel(det),
                     "recovered_s": rel(recovered), "throughput_restored_s": rel(restored), "tokens_lost": lost,
                     "overlaps": _overlapping(f, faults), "note": f.get("detail", "")})
    return rows


def _base(f: dict) -> dict:
    return {"index": f["index"], "kind": f["kind"], "target": f["target"], "hold_s": f["hold_s"]}


def _overlapping(f: dict, faults: list[dict]) -> list[int]:
    """Other injected faults whose [injected, healed] span meets this one's."""
    a0, a1 = f["injected_at"], f.get("healed_at") or f["injected_at"]
    return [g["index"] for g in faults if g is not f and g.get("injected_at") is not None
            and g["injected_at"] <= a1 and (g.get("healed_at") or g["injected_at"]) >= a0]


def judge(final: RunStatus | None, steps: dict[int, dict], checkpoints: dict[int, str | None], table: dict,
          alive: set[int], strays: list[int], faults: list[dict], exit_codes: dict[int, int], t0: float,
          stop_error: str = "", resets: list[dict] | None = None, tool_calls: ToolCallCount | None = None) -> Verdict:
    """All checks. final None: the run did not end (stop_error says why): red, and the checks that need the
    workflow's result are judged against the step records alone."""
    numbered = [steps[s] for s in sorted(steps) if s > 0]
    rewards = [float(r["reward_mean"]) for r in numbered if "reward_mean" in r]
    points = [(float(r["time"]), int(r.get("tokens", 0))) for r in numbered if "time" in r]
    ended = Check("run ended", final is not None, stop_error or "the workflow returned its final status")
    last = final.step if final is not None else max((s for s in steps if s > 0), default=0)
    checks = [ended, check_accounting(final, steps) if final is not None else
              Check("accounting", False, "no final status to account against"),
              check_versions(steps), check_checkpoints(checkpoints), check_steps(steps, last), check_reward(rewards),
              check_processes(table, alive, strays), check_faults(faults, exit_codes), check_resets(resets or []),
              check_tool_calls(tool_calls)]
    final = final if final is not None else RunStatus(
        run_id="", phase="unknown", step=last, total_steps=0, policy_version=0, ready_groups=0, open_leases=0,
        groups_generated=0, groups_consumed=0, groups_consumed_twice=0, tokens_consumed=0, reward_recent=[],
        versions_in_use=[], max_versions_in_use=0, staleness_histogram={}, trainer_wait_fraction=0.0,
        history_events=0, history_events_max=0, continued_as_new=0, checkpoints=[], relays=[], replicas=[],
        started_at=0.0)
    rows = fault_rows(faults, final, points, t0)
    injected = [r for r in rows if "injected_s" in r]
    numbers = {"steps": last, "groups_consumed": final.groups_consumed,
               "groups_consumed_twice": final.groups_consumed_twice, "faults_injected": len(injected),
               "fault_kinds": sorted({r["kind"] for r in injected}), "fault_kinds_skipped": skipped_kinds(faults),
               "faults_skipped": sum(1 for f in faults if f.get("skipped")),
               "writes_refused": sum(f.get("refused") or 0 for f in faults if f.get("injected_at") is not None),
               "faults_overlapping": sum(1 for r in injected if r["overlaps"]),
               "workflow_resets": len(resets or []),
               "tool_calls_rerun": None if tool_calls is None else tool_calls.rerun,
               "tool_calls_executed": None if tool_calls is None else tool_calls.executions,
               "tool_calls_rerun_after_failure": None if tool_calls is None else tool_calls.rerun_after_failure,
               "reward_rise": round(reward_rise(rewards), 3), "tokens_lost": sum(r["tokens_lost"] or 0 for r in injected)}
    return Verdict(all(c.ok for c in checks), checks, rows, numbers)


def kind_summary(rows: list[dict]) -> list[dict]:
    """Per fault kind: how many were injected and how many skipped (not injectable here), how many the run
    noticed, the median seconds from injection to detection, to recovery and to restored throughput, and the
    tokens lost in all."""
    def median(xs: list[float]) -> float | None:
        xs = sorted(xs)
        return None if not xs else round(xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2, 2)

    out = []
    for kind in sorted({r["kind"] for r in rows}):
        mine = [r for r in rows if r["kind"] == kind and "injected_s" in r]
        skipped = sum(1 for r in rows if r["kind"] == kind and "injected_s" not in r)

        def since(col: str, mine: list[dict] = mine) -> list[float]:
            return [r[col] - r["injected_s"] for r in mine if r[col] is not None]

        out.append({"kind": kind, "faults": len(mine), "skipped": skipped, "detected": len(since("detected_s")),
                    "detect_s_p50": median(since("detected_s")), "recover_s_p50": median(since("recovered_s")),
                    "restored": len(since("throughput_restored_s")),
                    "restore_s_p50": median(since("throughput_restored_s")),
                    "tokens_lost": sum(r["tokens_lost"] or 0 for r in mine)})
    return out


def format_verdict(v: Verdict) -> str:
    """Markdown: the checks, then the fault table (as in docs/benchmarks/chaos.md)."""
    lines = [f"chaos verdict: {'GREEN' if v.green else 'RED'}", "", "| check | ok | detail |", "| --- | --- | --- |"]
    lines += [f"| {c.name} | {'yes' if c.ok else 'NO'} | {c.detail} |" for c in v.checks]
    def s(x) -> str:
        return "-" if x is None else (f"+{x:.1f}s" if isinstance(x, float) else f"{x:,}" if isinstance(x, int) else str(x))

    def n(x) -> str:
        return "-" if x is None else str(x)

    lines += ["", "| kind | faults | skipped | detected | detect p50 (s) | recovered p50 (s) | throughput restored "
              "| restore p50 (s) | tokens lost |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {k['kind']} | {k['faults']} | {k['skipped']} | {k['detected']} | {n(k['detect_s_p50'])} | "
              f"{n(k['recover_s_p50'])} | {k['restored']} | {n(k['restore_s_p50'])} | {k['tokens_lost']:,} |"
              for k in kind_summary(v.faults)]
    lines += ["", "| # | fault | target | hold (s) | injected | healed | detected | recovered | throughput restored "
              "| tokens lost | overlaps | note |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    for r in v.faults:
        if "injected_s" not in r:
            lines.append(f"| {r['index']} | {r['kind']} | {r['target']} | {r['hold_s']} | skipped | | | | | | "
                         f"| {r['skipped']} |")
            continue
        lines.append(f"| {r['index']} | {r['kind']} | {r['target']} | {r['hold_s']} | {s(r['injected_s'])} | "
                     f"{s(r['healed_s'])} | {s(r['detected_s'])} | {s(r['recovered_s'])} | "
                     f"{s(r['throughput_restored_s'])} | {s(r['tokens_lost'])} | "
                     f"{','.join(map(str, r['overlaps'])) or '-'} | {r.get('note', '')} |")
    return "\n".join(lines)
