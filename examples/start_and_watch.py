"""Start a run and watch it with the Python client.

Needs a running stack: `laminar dev up` and the workers (`laminar worker control|trainer|relay|rollout`,
see docs/guides/deployment.md), or any Temporal address and store given by LAMINAR_* settings.

    python examples/start_and_watch.py examples/tiny.toml --steps 20 --set trainer.lr=0.001
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer

from laminar.client.connect import connect
from laminar.client.exit import run_then_exit
from laminar.client.run_control import new_run_id, start_workflow
from laminar.client.settings import Settings
from laminar.client.watch import RunProgress, watch_run
from laminar.config import RunConfig
from laminar.rl.factory import check_engines


def main(
    config: Path,
    steps: int | None = typer.Option(None, help="Trainer steps (overrides run.steps)."),
    set_: list[str] = typer.Option([], "--set", metavar="SECTION.KEY=VALUE",
                                   help="Override a config value (repeatable)."),
) -> None:
    """Start a run from CONFIG and print its progress until it ends."""
    overrides = [*set_, *([f"run.steps={steps}"] if steps else [])]
    cfg = check_engines(RunConfig.load(config, overrides)).with_run_id(new_run_id())  # validated before anything starts
    asyncio.run(watch(cfg))


async def watch(cfg: RunConfig) -> None:
    client = await connect(Settings.from_env())  # TLS and API key from LAMINAR_TEMPORAL_* as every process
    handle = await start_workflow(client, cfg)  # the TrainingRunWorkflow on the control queue, id run/<run_id>
    print(f"run_id={cfg.run.run_id}")

    def show(p: RunProgress | None, note: str) -> None:  # each describe of the run, or why there was no answer
        if p is None:
            print(note)
            return
        reward = f"{p.reward:.3f}" if p.reward is not None else "-"
        print(f"step {p.step}/{cfg.run.steps} phase={p.phase or p.execution} reward={reward} version={p.policy_version}")

    final = await watch_run(handle, show, poll_s=2.0)  # the final status; Ctrl-C cancels the run
    print(f"finished: steps={final.step} groups_consumed={final.groups_consumed} "
          f"consumed_twice={final.groups_consumed_twice} staleness={final.staleness_histogram}")


if __name__ == "__main__":
    # A process that used a Temporal client can be aborted while the interpreter finalises (an SDK issue):
    # run_then_exit keeps the exit status and skips finalisation, as the `laminar` CLI does.
    run_then_exit(lambda: typer.run(main))
