"""`laminar eval CONFIG --checkpoint REF|PATH [--prompts FILE]`: evaluate a committed checkpoint (or a Hugging Face
model directory) on held-out prompts in this process (services/evaluate.py), store the record, print the figures.

Exit codes as the rest of the CLI: 0 evaluated, 1 it failed (no such checkpoint), 2 invalid input.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from laminar.cli.options import exit_codes

console = Console()


def eval_command(
    ctx: typer.Context,
    config: Path = typer.Argument(..., help="Run config (TOML): its \\[eval] and \\[task] sections are used."),
    checkpoint: str = typer.Option(..., "--checkpoint", help="RUN_ID@STEP (a committed checkpoint), RUN_ID (its "
                                   "newest), or a Hugging Face model directory."),
    prompts: Path | None = typer.Option(None, "--prompts", help="JSONL or Parquet evaluation prompts (default: "
                                        "eval.prompts, else the task's held-out split)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Evaluate a policy on held-out prompts with the training reward; the record goes to the run's evals/.
    Extra `--section.key=value` arguments override config values (e.g. --eval.samples=4)."""
    from laminar.client.connect import store_for
    from laminar.client.settings import Settings
    from laminar.config import RunConfig
    from laminar.logs import configure_logging
    from laminar.rl.factory import check_engines
    from laminar.services.evaluate import evaluate

    configure_logging("console", level="warning")  # logs on stderr: stdout is the result (--json parses)
    with exit_codes():
        cfg = check_engines(RunConfig.load(config, list(ctx.args)))
        outcome = evaluate(store_for(Settings.from_env()), cfg, checkpoint, str(prompts) if prompts else "")
    s, t = outcome.summary, outcome.target
    if as_json:
        console.print_json(json.dumps({"run_id": t.run_id, "policy_version": t.policy_version, "source": t.source,
                                       "record": outcome.key, **s.__dict__, "wall_s": round(outcome.wall_s, 2)}))
        return
    table = Table(title=f"eval of {t.source} (run {t.run_id}, policy version {t.policy_version})")
    for col in ("prompts", "samples", "accuracy (pass@1)", f"pass@{s.samples}", f"mean@{s.samples}", "mean reward",
                "response len", "failures"):
        table.add_column(col, justify="right")
    table.add_row(str(s.prompts), str(s.samples), f"{s.accuracy:.3f} ± {s.accuracy_stderr:.3f}", f"{s.pass_at_k:.3f}",
                  f"{s.mean_at_k:.3f}", f"{s.mean_reward:.3f}", f"{s.response_len_mean:.1f}", str(s.failures))
    console.print(table)
    console.print(f"record: {outcome.key} ({outcome.wall_s:.1f} s)", highlight=False)

