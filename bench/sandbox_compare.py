"""`print(1)` through two Python sandboxes side by side: this tree's (envs/tools/sandbox.py) and another
version of the module given by its file (an older sandbox, taken from git), interleaved in one process so
that both see the same machine load.

    git show d286274^:rl/tools/sandbox.py | sed 's/from rl.tools import/from laminar.envs.tools import/' > /tmp/old_sandbox.py
    python -m bench.sandbox_compare --old /tmp/old_sandbox.py --runs 30

`d286274^` is the sandbox before the allow-list root and the per-sandbox cgroups (issue 35): a read-only view
of the host and rlimits. Each sandbox runs once untimed first (the new one probes its interpreter once per
process), then the two alternate, `--runs` times each. Prints the median, p90 and min of each, and the ratio
of the medians (new / old); `--json PATH` writes them too.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

from laminar.envs.tools import sandbox as new_sandbox


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location("old_sandbox", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--old {path}: not a Python module file; write one with `git show` (module docstring)")
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_sandbox"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def timed(name: str, module, code: str) -> float:
    t0 = time.perf_counter()
    result = module.run_python(code, module.SandboxLimits())
    took = time.perf_counter() - t0
    if result.failure or result.output.strip() != "1":
        raise SystemExit(f"{name} sandbox: print(1) gave failure={result.failure!r} output={result.output!r}")
    return took


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"median_s": round(statistics.median(ordered), 4), "p90_s": round(ordered[int(0.9 * (len(ordered) - 1))], 4),
            "min_s": round(ordered[0], 4), "runs": len(ordered)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="file of the older sandbox module")
    parser.add_argument("--runs", type=int, default=30, help="timed runs of each sandbox")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    old = load_module(args.old)
    sandboxes = {"old": old, "new": new_sandbox}
    for name, module in sandboxes.items():
        timed(name, module, "print(1)")
    times: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(args.runs):
        for name, module in sandboxes.items():
            times[name].append(timed(name, module, "print(1)"))
    out = {"old": summary(times["old"]), "new": summary(times["new"]),
           "new_limits": new_sandbox.limits_kind()}
    out["ratio_median"] = round(out["new"]["median_s"] / out["old"]["median_s"], 3)
    print(json.dumps(out, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
