"""Placement search and sweeps: per (model, GPU budget, mode) the trainer/rollout split that maximises the
simulated throughput, then the metrics of the paper's Fig. 11 (tokens/s, speedups, scaling efficiency).

The search never hand-sets a placement: sync is colocated (verl's placement, as in the paper); every other mode
tries splits in whole machines: a coarse grid of five splits, then a golden-section search between the best
one's neighbours (throughput is mostly unimodal in the split: too few trainer GPUs and the trainer bounds it, too
few rollout GPUs and generation does), on short runs (`search_iterations`), then runs the chosen split at full
length.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from typing import Any

from laminar.sim import params as P
from laminar.sim.core import REAL_POLICY, PolicyFns, SimResult, simulate
from laminar.sim.paper import table2
from laminar.sim.scenarios import MODES, Placement, RelayLink, placements, sim_config

INVPHI = (math.sqrt(5) - 1) / 2


@dataclass
class SweepSpec:
    model: str = "7b"
    gpus: tuple[int, ...] = ()  # default: the paper's scales for the model (Table 2)
    modes: tuple[str, ...] = MODES
    workload: str = "math"
    repack: bool = True
    iterations: int = 8  # global batches per final run
    warmup: int = 3  # of which excluded from the metrics
    search_iterations: int = 3  # per run during the placement search
    search_warmup: int = 1
    link: RelayLink = field(default_factory=RelayLink)
    failures: tuple[tuple[str, float], ...] = ()
    fns: PolicyFns = REAL_POLICY
    control_plane: str = "off"  # sim/scenarios.py sim_config: one workflow serves every update, at measured costs

    def scales(self) -> tuple[int, ...]:
        return self.gpus or P.MODELS[self.model].gpu_scales


def _run(spec: SweepSpec, mode: str, pl: Placement, iterations: int, warmup: int,
         failures: tuple[tuple[str, float], ...] = ()) -> SimResult:
    m, w = P.MODELS[spec.model], P.WORKLOADS[spec.workload]
    cfg = sim_config(m, w, mode, pl, iterations=iterations, warmup=warmup, repack=spec.repack, link=spec.link,
                     failures=failures, control_plane=spec.control_plane)
    # The warm-up must outlast the pipeline's fill: at the start every replica admits its whole concurrency at
    # once (laminar at 1,024 GPUs: ~5 global batches), and the trainer eats that stock faster than the steady
    # state refills it. Measuring inside it would overstate throughput.
    fill = math.ceil(cfg.replicas * cfg.max_inflight_seqs / (cfg.groups_per_step * cfg.group_size))
    if fill + 1 > cfg.warmup:
        cfg = replace(cfg, warmup=fill + 1, iterations=cfg.iterations + fill + 1 - cfg.warmup)
    t0 = time.perf_counter()
    res = simulate(cfg, spec.fns)
    res.sim_s = time.perf_counter() - t0
    return res


def search(spec: SweepSpec, mode: str, gpus: int) -> tuple[Placement, int]:
    """The placement of `mode` with the most simulated tokens/s at `gpus`; (placement, runs it took)."""
    cands = placements(P.MODELS[spec.model], gpus, mode)
    if len(cands) == 1:
        return cands[0], 0
    memo: dict[int, float] = {}

    def f(i: int) -> float:
        if i not in memo:
            memo[i] = _run(spec, mode, cands[i], spec.search_iterations, spec.search_warmup).tokens_per_s
        return memo[i]

    n = len(cands)
    lo, hi = 0, n - 1
    if n > 12:  # a coarse grid first (throughput can be flat or have a second hump), then narrow around its best
        grid = sorted({round(k * (n - 1) / 6) for k in range(1, 6)})
        best = max(grid, key=lambda i: (f(i), -i))
        k = grid.index(best)
        lo = grid[k - 1] if k > 0 else 0
        hi = grid[k + 1] if k + 1 < len(grid) else n - 1
    # stop narrowing at 1/16 of the range (2 machines of 256 at 1,024 GPUs): the search's own noise is larger
    return cands[golden_max(f, lo, hi, tolerance=max(3, n // 16))], len(memo)


def golden_max(f: Callable[[int], float], lo: int, hi: int, tolerance: int = 3) -> int:
    """argmax of a unimodal f over the integers lo..hi: golden-section search down to a bracket of `tolerance`,
    then the best point evaluated so far inside it, or its middle if none was."""
    seen: dict[int, float] = {}

    def g(i: int) -> float:
        seen[i] = f(i)
        return seen[i]

    while hi - lo > tolerance:
        a = hi - round(INVPHI * (hi - lo))
        b = lo + round(INVPHI * (hi - lo))
        if a >= b:
            a, b = (lo + hi) // 2, (lo + hi) // 2 + 1
        if g(a) < g(b):
            lo = a
        else:
            hi = b
    if tolerance <= 3:
        return max(range(lo, hi + 1), key=lambda i: (g(i), -i))
    inside = [i for i in seen if lo <= i <= hi] or [(lo + hi) // 2]
    return max(inside, key=lambda i: (g(i), -i))


def sweep(spec: SweepSpec, progress: Callable[[str], None] = lambda _: None,
          workers: int | None = None) -> dict[str, Any]:
    """Every (scale, mode): the searched placement and its full-length run's metrics. The cells are independent
    (each its own simulations, seeded alike), so they run on `workers` processes (default: one per core) when the
    spec can be sent to one (a test's policy double defined in a function cannot: then they run here, in turn);
    the rows come back in (scale, mode) order either way, the same numbers."""
    t_start = time.perf_counter()
    cells = [(gpus, mode) for gpus in spec.scales() for mode in spec.modes]
    workers = min(len(cells), workers or os.cpu_count() or 1)
    done: dict[tuple[int, str], dict[str, Any]] = {}
    if workers > 1 and _picklable(spec):
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = {pool.submit(_cell, spec, gpus, mode): (gpus, mode) for gpus, mode in cells}
            for future in as_completed(futures):
                done[futures[future]] = row = future.result()
                progress(_progress_line(spec, row))
    else:
        for gpus, mode in cells:
            done[(gpus, mode)] = row = _cell(spec, gpus, mode)
            progress(_progress_line(spec, row))
    rows = [done[c] for c in cells]
    add_derived(rows)
    return {"rows": rows, "config": {"model": spec.model, "workload": spec.workload, "modes": list(spec.modes),
                                     "gpus": list(spec.scales()), "repack": spec.repack,
                                     "iterations": spec.iterations, "warmup": spec.warmup,
                                     "search_iterations": spec.search_iterations, "relay_link": spec.link.source},
            "wall_s": round(time.perf_counter() - t_start, 2)}


def _cell(spec: SweepSpec, gpus: int, mode: str) -> dict[str, Any]:
    """One (scale, mode): the placement search, then the chosen split's full-length run."""
    t0 = time.perf_counter()
    pl, runs = search(spec, mode, gpus)
    res = _run(spec, mode, pl, spec.iterations, spec.warmup)
    row = {"model": spec.model, "workload": spec.workload, "gpus": gpus, "mode": mode,
           "placement": pl.label(), "train_gpus": pl.train, "rollout_gpus": pl.rollout, "tp": pl.tp,
           "replicas": pl.replicas, "paper_placement": table2(spec.model, gpus, mode),
           "search_runs": runs, "wall_s": round(time.perf_counter() - t0, 2), **res.as_dict()}
    row["staleness_histogram"] = {str(k): v for k, v in res.staleness_histogram.items()}
    return row


def _progress_line(spec: SweepSpec, row: dict[str, Any]) -> str:
    return (f"{spec.model} {row['gpus']} GPUs {row['mode']}: {row['placement']} {row['tokens_per_s']:,.0f} tokens/s "
            f"({row['search_runs']} search runs, {row['wall_s']} s)")


def _picklable(spec: SweepSpec) -> bool:
    try:
        pickle.dumps(spec)
    except (pickle.PicklingError, AttributeError, TypeError):
        return False
    return True


def add_derived(rows: list[dict[str, Any]]) -> None:
    """laminar's speedup over each mode at the same scale; each mode's scaling efficiency (the paper's: the
    throughput ratio of the largest to the smallest scale / the GPU ratio)."""
    lam = {(r["model"], r["gpus"]): r["tokens_per_s"] for r in rows if r["mode"] == "laminar"}
    for r in rows:
        base = lam.get((r["model"], r["gpus"]))
        r["laminar_speedup"] = round(base / r["tokens_per_s"], 3) if base and r["tokens_per_s"] > 0 else None
    by_mode: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        by_mode.setdefault((r["model"], r["mode"]), []).append(r)
    for group in by_mode.values():
        lo, hi = min(group, key=lambda r: r["gpus"]), max(group, key=lambda r: r["gpus"])
        eff = None
        if hi["gpus"] > lo["gpus"] and lo["tokens_per_s"] > 0:
            eff = round(hi["tokens_per_s"] / lo["tokens_per_s"] / (hi["gpus"] / lo["gpus"]), 3)
        for r in group:
            r["scaling_efficiency"] = eff


def speedup_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per baseline: laminar's average and max speedup across scales, and at the largest scale."""
    out: dict[str, dict[str, float]] = {}
    for mode in MODES[1:]:
        s = [r for r in rows if r["mode"] == mode and r.get("laminar_speedup")]
        if not s:
            continue
        top = max(s, key=lambda r: r["gpus"])
        out[mode] = {"average": round(sum(r["laminar_speedup"] for r in s) / len(s), 2),
                     "max": round(max(r["laminar_speedup"] for r in s), 2),
                     "largest_scale": round(top["laminar_speedup"], 2)}
    return out


def plan(model: str, gpus: int, workload: str = "math", modes: tuple[str, ...] = MODES,
         **kw: Any) -> list[dict[str, Any]]:
    """`laminar plan`: the best placement per mode at one GPU budget."""
    return sweep(SweepSpec(model=model, gpus=(gpus,), modes=modes, workload=workload, **kw))["rows"]


def failure_runs(spec: SweepSpec, mode: str, gpus: int, failures: list[tuple[str, float]]) -> list[dict[str, Any]]:
    """Each failure alone at its modelled time on the searched placement of `mode`, against the same run without
    it: how much later the same steps finish (seconds_lost; tokens_lost = that x the undisturbed tokens/s), and the
    time from the failure until the tokens trained over one iteration's length are back to 95 % of the undisturbed
    rate. Runs are lengthened to last 10 iterations past the latest failure."""
    pl, _ = search(spec, mode, gpus)
    probe = _run(spec, mode, pl, spec.iterations, spec.warmup)
    it = probe.iteration_s if math.isfinite(probe.iteration_s) else 0.0
    latest = max(at for _, at in failures)
    iterations = max(spec.iterations, spec.warmup + math.ceil(latest / it) + 10) if it > 0 else spec.iterations
    base = _run(spec, mode, pl, iterations, spec.warmup) if iterations != spec.iterations else probe
    rows = []
    for kind, at in failures:
        hit = _run(spec, mode, pl, iterations, spec.warmup, failures=((kind, at),))
        rate, span = base.tokens_per_s, base.iteration_s
        delay = hit.step_times[-1] - base.step_times[-1]  # the same steps finish this much later
        lost = round(delay * rate)
        restored = None
        for t in hit.step_times:
            if t > at + span and _trained_by(hit, t) - _trained_by(hit, t - span) >= 0.95 * rate * span:
                restored = t - at
                break
        rows.append({"model": spec.model, "gpus": gpus, "mode": mode, "failure": kind, "at_s": at,
                     "placement": pl.label(), "iterations": iterations, "tokens_per_s": base.tokens_per_s,
                     "tokens_per_s_with_failure": hit.tokens_per_s, "tokens_lost": lost,
                     "seconds_lost": round(delay, 1),
                     "restored_after_s": None if restored is None else round(restored, 1)})
    return rows


def _trained_by(res: SimResult, t: float) -> int:
    return sum(n for s, n in zip(res.step_times, res.step_tokens, strict=True) if s <= t)
