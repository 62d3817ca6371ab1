"""Start a run and watch it with the Python client.

Needs a running stack: `laminar dev up` and the workers (`laminar worker control|trainer|relay|rollout`,
see README), or any Temporal address and store given by LAMINAR_* settings.

    python examples/start_and_watch.py examples/tiny.toml --steps 20
"""

from __future__ import annotations

import argparse
import asyncio

from temporalio.client import Client

from laminar.config import RunConfig
from laminar.messages import CONTROL_QUEUE, RunStatus, workflow_id_for
from workers.run_control import new_run_id
from workers.settings import Settings
from workflows.state import TrainingRunInput


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value (repeatable)")
    args = parser.parse_args()

    overrides = [*args.set, *([f"run.steps={args.steps}"] if args.steps else [])]
    cfg = RunConfig.load(args.config, overrides).with_run_id(new_run_id())  # validated before anything starts
    settings = Settings.from_env()
    client = await Client.connect(settings.temporal_address, namespace=settings.namespace)
    handle = await client.start_workflow(
        "TrainingRunWorkflow",
        TrainingRunInput(config=cfg.to_json()),
        id=workflow_id_for(cfg.run.run_id),
        task_queue=CONTROL_QUEUE,
        result_type=RunStatus,
    )
    print(f"run_id={cfg.run.run_id}")
    result = asyncio.ensure_future(handle.result())
    while not result.done():
        st: RunStatus = await handle.query("status", result_type=RunStatus)
        reward = f"{st.reward_recent[-1]:.3f}" if st.reward_recent else "-"
        print(f"step {st.step}/{st.total_steps} phase={st.phase} reward={reward} versions={st.versions_in_use}")
        await asyncio.wait({result}, timeout=2.0)
    final = result.result()
    print(f"finished: steps={final.step} groups_consumed={final.groups_consumed} "
          f"consumed_twice={final.groups_consumed_twice} staleness={final.staleness_histogram}")


if __name__ == "__main__":
    asyncio.run(main())
