"""`laminar report RUN`: a finished (or running) run's plots and one self-contained HTML page.

Everything comes from the object store, so a report can be written from any machine that reaches it, at
any time after the run: the trainer's per-step records (`runs/<id>/metrics/`), the trajectories of the
experience segments (which replica generated what, with which policy version, when), the drill reports
(`runs/<id>/drills/`) and, when `laminar run` wrote one, the summary with the run's last events.

The arithmetic (`ReportData.from_records` and the helpers under it) is pure and clock-free; `write` draws
with matplotlib (Agg) and inlines each PNG into the HTML page as a data URI, so the page needs no other
file. Times on the plots are wall seconds since the run's first recorded activity (the earliest trajectory
start or trainer wait), which for the modelled engine is wall time, not modelled time.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laminar.errors import ConfigError
from laminar.storage import keys, records
from laminar.storage.objects import ObjectStore

PLOTS = ("reward", "staleness", "versions", "trainer", "eval", "drills")  # file stems, in page order


@dataclass
class ReportData:
    """What the plots need, in seconds since t0 (the run's first recorded activity)."""

    run_id: str
    t0: float
    steps: list[int]
    reward: list[float]
    tokens_per_s: list[float]  # per step: its tokens / (its wait + its wall time)
    staleness: dict[int, int]  # trainer version minus sample version -> trained samples, whole run
    busy: list[tuple[float, float]]  # (start, duration) of each train_step
    waiting: list[tuple[float, float]]  # (start, duration) of the trainer's wait before each step
    versions: dict[str, list[tuple[float, float, int]]]  # replica -> (start, end, version), merged per version
    drills: list[dict[str, Any]] = field(default_factory=list)  # drill reports, times relative to t0
    events: list[dict[str, Any]] = field(default_factory=list)  # the summary's last events, times relative to t0
    summary: dict[str, Any] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)  # held-out eval records by version (storage/keys.py)

    @classmethod
    def from_records(cls, run_id: str, steps: list[dict[str, Any]], trajectories: list[records.TrajRow],
                     drills: list[dict[str, Any]], summary: dict[str, Any],
                     evals: list[dict[str, Any]] | None = None) -> ReportData:
        """steps: the trainer's step records, any order; trajectories: laminar.storage.records.trajectory_rows'."""
        steps = sorted(steps, key=lambda r: r["step"])
        busy_abs = [(r["time"] - r.get("busy_s", 0.0), r.get("busy_s", 0.0)) for r in steps]
        wait_abs = [(b - r.get("wait_s", 0.0), r.get("wait_s", 0.0)) for r, (b, _) in zip(steps, busy_abs, strict=True)]
        starts = [s for s, _ in wait_abs] + [t.started_at for t in trajectories]
        t0 = min(starts) if starts else 0.0
        return cls(
            run_id=run_id, t0=t0,
            steps=[r["step"] for r in steps],
            reward=[r["reward_mean"] for r in steps],
            tokens_per_s=[step_tokens_per_s(r) for r in steps],
            staleness=staleness_total(steps),
            busy=[(s - t0, d) for s, d in busy_abs],
            waiting=[(s - t0, d) for s, d in wait_abs if d > 0],
            versions=version_intervals(trajectories, t0),
            drills=[{**d, **{k: (d[k] - t0 if d.get(k) is not None else None)
                            for k in ("injected_at", "detected_at", "recovered_at")}} for d in drills],
            events=[{**e, "at": e["at"] - t0} for e in summary.get("events", [])],
            summary=summary,
            evals=sorted(evals or [], key=lambda e: e["policy_version"]),
        )


def step_tokens_per_s(record: dict[str, Any]) -> float:
    """Response tokens of one step over the time it took from the end of the previous step (wait + busy)."""
    span = record.get("wait_s", 0.0) + record.get("busy_s", 0.0)
    return record["tokens"] / span if span > 0 else 0.0


def staleness_total(steps: list[dict[str, Any]]) -> dict[int, int]:
    """The per-step staleness histograms (gap as a string -> samples) summed, by gap."""
    out: dict[int, int] = {}
    for r in steps:
        for gap, n in r.get("staleness", {}).items():
            out[int(gap)] = out.get(int(gap), 0) + n
    return dict(sorted(out.items()))


def version_intervals(trajectories: Iterable[records.TrajRow], t0: float,
                      scale: float = 1.0) -> dict[str, list[tuple[float, float, int]]]:
    """Per replica, (start, end, version) in s since t0 x scale (modelled s per wall s): each trajectory's
    [started_at, ended_at], overlapping or touching intervals of the same version merged (before scaling: merging
    does not depend on the unit); replicas in natural order (replica-2 before replica-10)."""
    by_key: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for t in trajectories:
        by_key.setdefault((t.replica_id, t.policy_version), []).append((t.started_at - t0, t.ended_at - t0))
    out: dict[str, list[tuple[float, float, int]]] = {}
    for (replica, version), spans in by_key.items():
        spans.sort()
        merged = [list(spans[0])]
        for s, e in spans[1:]:
            if s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        out.setdefault(replica, []).extend((s * scale, e * scale, version) for s, e in merged)
    return {r: sorted(v) for r, v in sorted(out.items(), key=lambda kv: _natural(kv[0]))}


def _natural(name: str) -> tuple[str, int]:
    head, _, tail = name.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (name, -1)


# -- reading the store ---------------------------------------------------------------------------------

def read(store: ObjectStore, run_id: str) -> ReportData:
    """The run's records from the store (storage/records.py); ConfigError naming the run when it has no step
    record. A run started with `laminar start`, or still running, has no summary yet."""
    steps = records.step_records(store, run_id)
    if not steps:
        raise ConfigError(f"run {run_id!r} has no step records under {keys.step_metrics_prefix(run_id)} in this store; "
                          "check the run id (`laminar list`) and LAMINAR_STORE, or wait for its first step")
    return ReportData.from_records(run_id, steps, records.trajectory_rows(store, run_id, token_counts=False),
                                   records.drill_reports(store, run_id), records.summary(store, run_id) or {},
                                   eval_records(store, run_id))


def eval_records(store: ObjectStore, run_id: str) -> list[dict[str, Any]]:
    """The run's held-out eval records (`laminar eval`, eval rounds), by policy version, without per-prompt rows."""
    import json

    out = []
    for key in store.list(keys.evals_prefix(run_id)):
        if key.endswith(".json"):
            record = json.loads(store.get(key))
            record.pop("per_prompt", None)
            out.append(record)
    return sorted(out, key=lambda r: r["policy_version"])


# -- drawing -------------------------------------------------------------------------------------------

def check_matplotlib() -> None:
    """ConfigError saying how to install matplotlib when it is missing (the report draws with it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("`laminar report` draws with matplotlib, which is not installed; install it with "
                          "`pip install 'laminar[bench]'` (or `pip install matplotlib==3.11.2`)") from None


def write(data: ReportData, out_dir: Path) -> list[Path]:
    """The PNGs and `report.html` under out_dir (created); returns the files written, the page last."""
    check_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    drawn: list[tuple[str, str, Path]] = []
    for stem, title, draw in _figures(data):
        fig = draw(plt)
        path = out_dir / f"{stem}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        drawn.append((stem, title, path))
    page = out_dir / "report.html"
    page.write_text(render_html(data, [(title, p.read_bytes()) for _, title, p in drawn]))
    return [p for _, _, p in drawn] + [page]


def _figures(data: ReportData):
    yield "reward", "Reward and trainer tokens/s per step", lambda plt: _reward(plt, data)
    yield "staleness", "Staleness of the trained samples", lambda plt: _staleness(plt, data)
    yield "versions", "Policy version each replica generated with", lambda plt: _versions(plt, data)
    yield "trainer", "Trainer busy and waiting", lambda plt: _trainer(plt, data)
    if data.evals:
        yield "eval", "Held-out accuracy against step and wall time", lambda plt: _eval(plt, data)
    if data.drills:
        yield "drills", "Drills: injected, detected, recovered", lambda plt: _drills(plt, data)


def _reward(plt, data: ReportData):
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    window = max(1, len(data.reward) // 20)
    for axis, values, colour in ((ax, data.reward, "tab:blue"), (ax2, data.tokens_per_s, "tab:green")):
        axis.plot(data.steps, values, lw=0.8, color=colour, alpha=0.5, label="step")
        if window > 1:
            axis.plot(data.steps[window - 1:], moving_mean(values, window), lw=1.8, color=colour,
                      label=f"mean of {window} steps")
        axis.legend(fontsize=8)
    ax.set(ylabel="mean reward", title=f"run {data.run_id}: reward and tokens/s per step")
    ax.grid(alpha=0.3)
    ax2.set(xlabel="trainer step", ylabel="trained tokens / s")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def eval_wall_s(data: ReportData, policy_version: int) -> float | None:
    """Seconds from t0 to the end of the step that made the version (0: t0); None when that step has no record."""
    if policy_version == 0:
        return 0.0
    ends = {step: start + busy for step, (start, busy) in zip(data.steps, data.busy, strict=True)}
    return ends.get(policy_version)


def _eval(plt, data: ReportData):
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    v = [e["policy_version"] for e in data.evals]
    acc = [e["accuracy"] for e in data.evals]
    err = [e.get("accuracy_stderr", 0.0) for e in data.evals]
    ax.errorbar(v, acc, yerr=err, marker="o", capsize=3)
    ax.set(xlabel="policy version (trainer step)", ylabel="held-out accuracy (pass@1)",
           title=f"{data.evals[-1]['prompts']} prompts, +- 1 standard error")
    timed = [(t, a, e) for t, a, e in ((eval_wall_s(data, x), a, e) for x, a, e in zip(v, acc, err, strict=True))
             if t is not None]
    if timed:
        ax2.errorbar([t for t, _, _ in timed], [a for _, a, _ in timed], yerr=[e for _, _, e in timed], marker="o",
                     capsize=3, color="tab:orange")
    ax2.set(xlabel="wall time of the version (s since start)")
    for axis in (ax, ax2):
        axis.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def moving_mean(values: list[float], window: int) -> list[float]:
    """Mean of each run of `window` consecutive values (len(values) - window + 1 of them)."""
    return [sum(values[i - window + 1:i + 1]) / window for i in range(window - 1, len(values))]


def _staleness(plt, data: ReportData):
    fig, ax = plt.subplots(figsize=(8, 3.2))
    gaps, counts = list(data.staleness), list(data.staleness.values())
    bars = ax.bar(gaps, counts, color="tab:purple")
    ax.bar_label(bars, fontsize=7)
    ax.set(xlabel="staleness (trainer version - sample version)", ylabel="trained samples",
           title=f"run {data.run_id}: staleness histogram", xticks=gaps)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def _versions(plt, data: ReportData):
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    cmap = colormaps["viridis"]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.5 * max(1, len(data.versions))))
    top = max((v for iv in data.versions.values() for _, _, v in iv), default=0)
    span = max((e for iv in data.versions.values() for _, e, _ in iv), default=1.0)
    for y, intervals in enumerate(data.versions.values()):
        for s, e, v in intervals:
            ax.broken_barh([(s, e - s)], (y - 0.4, 0.8), color=cmap(v / max(1, top)))
            if e - s > span / 60:
                ax.text((s + e) / 2, y, str(v), ha="center", va="center", fontsize=6, color="white")
    fig.colorbar(ScalarMappable(Normalize(0, max(1, top)), cmap), ax=ax, label="policy version", pad=0.01)
    ax.set(yticks=range(len(data.versions)), yticklabels=list(data.versions), xlabel="s since start",
           title=f"run {data.run_id}: policy version per replica over time (each bar: trajectories of one version)")
    ax.title.set_fontsize(9)
    fig.tight_layout()
    return fig


def _trainer(plt, data: ReportData):
    fig, ax = plt.subplots(figsize=(10, 2.0))
    ax.broken_barh(data.busy, (0.6, 0.8), color="tab:blue")
    ax.broken_barh(data.waiting, (-0.4, 0.8), color="tab:orange")
    busy, wait = sum(d for _, d in data.busy), sum(d for _, d in data.waiting)
    ax.set(yticks=[0, 1], yticklabels=[f"waiting {wait:.0f} s", f"busy {busy:.0f} s"], xlabel="s since start",
           title=f"run {data.run_id}: trainer timeline ({len(data.busy)} steps)")
    ax.title.set_fontsize(9)
    fig.tight_layout()
    return fig


def _drills(plt, data: ReportData):
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.5 * len(data.drills)))
    for y, d in enumerate(data.drills):
        inj, det, rec = d["injected_at"], d.get("detected_at"), d.get("recovered_at")
        if rec is not None:
            ax.broken_barh([(inj, rec - inj)], (y - 0.15, 0.3), color="tab:red", alpha=0.3)
        ax.plot([inj], [y], "v", color="tab:red", label="injected" if y == 0 else None)
        if det is not None:
            ax.plot([det], [y], "o", color="tab:orange", label="detected" if y == 0 else None)
        if rec is not None:
            ax.plot([rec], [y], "^", color="tab:green", label="recovered" if y == 0 else None)
    step_ends = [s + d for s, d in data.busy]
    ax.plot(step_ends, [-0.6] * len(step_ends), "|", color="gray", ms=6, label="trainer step")
    ax.set(yticks=range(len(data.drills)), yticklabels=[f"{d['fault']} {d['target']}" for d in data.drills],
           xlabel="s since start", title=f"run {data.run_id}: drills")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7, loc="upper left", ncols=4)
    fig.tight_layout()
    return fig


# -- the page --------------------------------------------------------------------------------------------

SUMMARY_KEYS = ("mode", "steps", "wall_s", "tokens_per_s", "max_versions_in_use", "trainer_wait_fraction",
                "groups_generated", "groups_consumed", "groups_consumed_twice", "continued_as_new")


def render_html(data: ReportData, images: list[tuple[str, bytes]]) -> str:
    """One page: the summary's headline numbers, each image inlined as a PNG data URI, drills and events."""
    esc = html.escape
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(str(data.summary[k]))}</td></tr>"
                   for k in SUMMARY_KEYS if k in data.summary)
    if data.reward:
        rows += f"<tr><th>reward first / last step</th><td>{data.reward[0]:.3f} / {data.reward[-1]:.3f}</td></tr>"
    figures = "".join(
        f'<figure><img alt="{esc(title)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        f"<figcaption>{esc(title)}</figcaption></figure>" for title, png in images)
    drills = "".join(
        f"<tr><td>{esc(d['drill_id'])}</td><td>{esc(d['fault'])}</td><td>{esc(d['target'])}</td>"
        f"<td>{_s(d['injected_at'])}</td><td>{_s(d.get('detected_at'))}</td><td>{_s(d.get('recovered_at'))}</td>"
        f"<td>{d['groups_lost']}</td><td>{d['groups_consumed_twice']}</td></tr>" for d in data.drills)
    events = "".join(f"<tr><td>{_s(e['at'])}</td><td>{esc(e['kind'])}</td><td>{esc(str(e['subject']))}</td></tr>"
                     for e in data.events)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>laminar run {esc(data.run_id)}</title>
<style>body{{font-family:sans-serif;max-width:1050px;margin:1em auto}}table{{border-collapse:collapse}}
th,td{{border:1px solid #ccc;padding:2px 8px;text-align:left}}img{{max-width:100%}}</style></head>
<body><h1>Run {esc(data.run_id)}</h1>
<table>{rows}</table>
{figures}
<h2>Drills</h2>
{f"<table><tr><th>drill</th><th>fault</th><th>target</th><th>injected s</th><th>detected s</th><th>recovered s</th><th>groups lost</th><th>consumed twice</th></tr>{drills}</table>" if drills else "<p>No drill ran against this run.</p>"}
<h2>Events</h2>
{f"<table><tr><th>s</th><th>kind</th><th>subject</th></tr>{events}</table>" if events else "<p>No events recorded (a summary carries the run's last events).</p>"}
<p>Times are seconds since the run's first recorded activity.</p>
</body></html>
"""


def _s(t: float | None) -> str:
    return "-" if t is None else f"{t:.1f}"
