"""Lost Temporal state is a clear error, never a silent restart over the old run's files (issue 31, deliverable 5).

Tried as a new user would, through the real `laminar` entry point against a real dev stack (SQLite-backed
Temporal, local store): a `laminar run --run-id` trains, the dev server is stopped, its SQLite file moved away and
the server started again on a fresh database. Then `laminar run` ends with a one-line error naming the run and
what was lost, `laminar status` says the same, `laminar run --run-id` and `laminar start --run-id` refuse the id
naming the two ways on, and `laminar fork` trains on from the old run's newest committed checkpoint under a new id
that records its parent. The old run's objects are compared byte for byte (sha256 of every object) throughout.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.client import Client

from laminar.contract import RunStatus, workflow_id_for
from laminar.drills.rules import groups_lost
from laminar.storage.objects import LocalObjectStore
from laminar.storage.runs import read_marker
from tests.fixtures.devhome import Dev, own_dev_stack
from tests.fixtures.stack import TEST_OVERRIDES
from tests.fixtures.waiting import async_wait_until

LAMINAR = [sys.executable, "-m", "laminar.cli.main"]
OVERRIDES = [f"--{o}" for o in TEST_OVERRIDES if not o.startswith("run.steps")]  # checkpoint_every=3
RUN = "t-lost"


@pytest.fixture(scope="module")
def dev(tmp_path_factory) -> Iterator[Dev]:
    with own_dev_stack(tmp_path_factory.mktemp("lost-home"), columns=400) as d:
        yield d


def laminar(dev: Dev, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LAMINAR, *args], env=dev.env, capture_output=True, text=True, timeout=timeout)


def one_line(out: subprocess.CompletedProcess[str] | str) -> str:
    text = out if isinstance(out, str) else out.stdout + out.stderr
    return " ".join(text.split())


def hashes(store_root: Path, prefix: str = "") -> dict[str, str]:
    """sha256 of every object under the store's root (LocalObjectStore keeps one file per object)."""
    store = LocalObjectStore(store_root)
    return {k: hashlib.sha256(store.get(k)).hexdigest() for k in store.list(prefix)}


async def _step(client: Client, run_id: str) -> int:
    try:
        st = await client.get_workflow_handle(workflow_id_for(run_id)).query("status", result_type=RunStatus)
    except Exception:
        return -1
    return st.step


def _lose_temporal_database(dev: Dev, moved_to: Path) -> None:
    """Stop the dev server, move its SQLite files away, start it on the same port with a fresh database."""
    dev.stack.down()
    moved_to.mkdir()
    for f in dev.home.glob("temporal.db*"):  # the database and its WAL / shared-memory files
        shutil.move(str(f), moved_to / f.name)
    dev.stack.up(port=dev.port, ui=False)


@pytest.mark.slow  # about 3 minutes on 2 cores: two `laminar run`s with their workers
@pytest.mark.timeout(600)
async def test_lost_temporal_database_is_a_clear_error_and_the_fork_trains_on(dev, tmp_path):
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        run = subprocess.Popen([*LAMINAR, "run", "examples/tiny.toml", "--run-id", RUN, "--steps", "1000",
                                *OVERRIDES], env=dev.env, stdout=out, stderr=subprocess.STDOUT)
    try:
        client = await dev.client()
        await async_wait_until(lambda: _stepped(client, RUN, 4), 240, "step 4 (past the checkpoint at 3)",
                               interval_s=1.0)
        _lose_temporal_database(dev, tmp_path / "old-db")
        code = run.wait(timeout=180)
    finally:
        if run.poll() is None:
            run.terminate()
            run.wait(timeout=60)
    text = log.read_text()
    # 1. The running `laminar run`: one line, no traceback, naming the run and what was lost; its workers stopped.
    assert code == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    said = one_line(text)
    assert f"run {RUN}: while `laminar run` watched it: Temporal at 127.0.0.1:{dev.port}" in said, said[-2000:]
    assert f"no longer has its workflow run/{RUN}" in said and "was lost" in said
    assert f"`laminar fork {RUN}`" in said
    store_root = dev.home / "store"
    before = hashes(store_root)
    old = {k: v for k, v in before.items() if k.startswith(f"runs/{RUN}/")}
    assert f"runs/{RUN}/run.json" in old and f"runs/{RUN}/checkpoints/step-00000003/manifest.json" in old
    marker = read_marker(LocalObjectStore(store_root), RUN)
    assert marker is not None and marker.parent == "" and marker.started_by.startswith("laminar run")
    # 2. The workers said it too: a rollout replica's update found no workflow, and no run either.
    worker_logs = " ".join(p.read_text() for p in (dev.home / "logs" / RUN).glob("rollout-*.log"))
    assert "run_lost" in worker_logs and f"Temporal no longer has its workflow run/{RUN}" in worker_logs

    # 3. `laminar status` names the run, what was lost, what the store keeps and the way on.
    status = laminar(dev, "status", RUN)
    assert status.returncode == 1, one_line(status)
    assert "Traceback" not in status.stderr
    assert f"run {RUN}: status: Temporal at" in one_line(status) and "was lost" in one_line(status)
    assert f"runs/{RUN}/:" in one_line(status) and f"`laminar fork {RUN}`" in one_line(status)

    # 4. A new run under the old id is refused, naming the two ways on; nothing is written.
    newest = max(int(k.split("step-")[1][:8]) for k in old if k.endswith("/manifest.json"))
    for args in (["run", "examples/tiny.toml"], ["start", "examples/tiny.toml"]):
        refused = laminar(dev, *args, "--run-id", RUN, "--steps", "20", *OVERRIDES)
        said = one_line(refused)
        assert refused.returncode == 1, said[-2000:]
        assert f"run id '{RUN}' is taken" in said and "Temporal's state of that run was lost" in said, said[-2000:]
        assert f"`laminar fork {RUN}` starts a new run" in said and f"from step {newest}" in said
        assert "start afresh under another id: --run-id <new id>" in said
        assert "Traceback" not in refused.stderr
        assert hashes(store_root) == before, f"`laminar {args[0]} --run-id {RUN}` wrote to the store"

    # 5. The documented way on: a new run from the newest committed checkpoint, recording its parent.
    fork_id = f"{RUN}-fork-s{newest}"
    summary = tmp_path / "fork-summary.json"
    forked = laminar(dev, "fork", RUN, "--steps", "3", "--summary", str(summary), timeout=420)
    assert forked.returncode == 0, one_line(forked)[-3000:]
    assert f"fork of run {RUN} from its checkpoint at step {newest}: new run {fork_id}, 3 steps" in one_line(forked)
    store = LocalObjectStore(store_root)
    fork_marker = read_marker(store, fork_id)
    assert fork_marker is not None and (fork_marker.parent, fork_marker.parent_step) == (RUN, newest)
    cfg = json.loads(store.get(f"runs/{fork_id}/config.json"))
    assert (cfg["run"]["parent"], cfg["run"]["parent_step"], cfg["run"]["steps"]) == (RUN, newest, 3)
    trainer_log = (dev.home / "logs" / fork_id / "trainer.log").read_text()
    assert "parent_checkpoint_loaded" in trainer_log and f"parent_step={newest}" in trainer_log.replace('"', "")
    client = await dev.client()
    final: RunStatus = await client.get_workflow_handle(workflow_id_for(fork_id), result_type=RunStatus).result()
    assert final.phase == "finished" and final.step == 3
    assert groups_lost(final) == 0 and final.groups_consumed_twice == 0
    assert json.loads(summary.read_text())["groups_consumed_twice"] == 0

    # 6. The old run's store is untouched byte for byte; everything the fork wrote is under its own prefix.
    after = hashes(store_root)
    assert {k: v for k, v in after.items() if k.startswith(f"runs/{RUN}/")} == old
    changed = {k for k in after if before.get(k) != after[k]} | {k for k in before if k not in after}
    assert changed and all(k.startswith(f"runs/{fork_id}/") for k in changed), sorted(changed)[:20]


async def _stepped(client: Client, run_id: str, n: int) -> bool:
    return await _step(client, run_id) >= n


def test_a_fork_config_needs_a_committed_checkpoint_and_records_its_parent(tmp_path):
    """fork_config on a real local store: the parent's config, its newest verified checkpoint, a free id."""
    from laminar.client.fork import fork_config
    from laminar.config import RunConfig
    from laminar.errors import LaminarError
    from laminar.storage import keys
    from laminar.storage.checkpoints import CheckpointStore

    torch = pytest.importorskip("torch")
    store = LocalObjectStore(tmp_path / "store")
    with pytest.raises(LaminarError, match="holds no runs/p/config.json"):
        fork_config(store, "p", None, [], None)
    parent = RunConfig.load(None, ["run.steps=50"]).with_run_id("p")
    store.put(keys.config("p"), parent.model_dump_json().encode())
    with pytest.raises(LaminarError, match="no committed checkpoint .* verifies"):
        fork_config(store, "p", None, [], None)
    ckpts = CheckpointStore(store)
    ckpts.save("p", 10, {"model": {"w": torch.zeros(2)}}, {"step": 10}, policy_version=10)
    ckpts.save("p", 20, {"model": {"w": torch.ones(2)}}, {"step": 20}, policy_version=20)
    store.put(keys.checkpoint_part("p", 20, "model"), b"corrupt")  # the newest no longer verifies: step 10 is used
    cfg = fork_config(store, "p", None, ["rollout.replicas=3"], None)
    # 50 steps asked of the parent, 10 done at its checkpoint: 40 left
    assert (cfg.run.run_id, cfg.run.parent, cfg.run.parent_step, cfg.run.steps) == ("p-fork-s10", "p", 10, 40)
    assert cfg.rollout.replicas == 3
    store.put(keys.run_marker("p-fork-s10"), b"{}")  # that id is taken now: the next fork gets the next one
    assert fork_config(store, "p", None, [], 5).run.run_id == "p-fork-s10-2"
    with pytest.raises(LaminarError, match="set by `laminar fork`"):
        fork_config(store, "p", "q", ["run.parent_step=3"], None)


def test_stored_run_says_what_the_store_holds_and_the_ways_on(tmp_path):
    """What a refusal and a lost-run error quote: objects, the last metrics step, committed checkpoints."""
    from laminar.client.fork import ways_on
    from laminar.storage import keys
    from laminar.storage.runs import RunMarker, stored_run, write_marker

    store = LocalObjectStore(tmp_path / "store")
    assert stored_run(store, "r") is None  # nothing under runs/r/: the id is free
    store.put(keys.step_metrics("r", 7), b"{}")
    store.put(keys.checkpoint_manifest("r", 6), b"{}")  # committed (its parts are not verified here)
    store.put(keys.checkpoint_trainer("r", 9), b"{}")  # step 9 never committed: no manifest
    found = stored_run(store, "r")
    assert found is not None and found.marker is None  # a run from before markers still takes its id
    assert found.describe() == "runs/r/: 3 objects, step metrics up to step 7, committed checkpoints at steps 6"
    assert "`laminar fork r` starts a new run" in ways_on(found) and "from step 6" in ways_on(found)
    write_marker(store, RunMarker(run_id="r", started_at="t", started_by="laminar run (pid 1 on h)", temporal="a/ns"))
    assert stored_run(store, "r").marker.started_by == "laminar run (pid 1 on h)"
    store.put(keys.config("s"), b"{}")  # a run with no checkpoint: only afresh
    assert ways_on(stored_run(store, "s")) == ("It has no committed checkpoint to continue from; start afresh under "
                                               "another id: --run-id <new id>.")


def test_laminar_fork_checks_the_forked_config_as_laminar_run_does(tmp_path):
    """A fork whose config names a model directory that is not there fails with exit 2 and the field, before a dev
    stack or a worker starts (the same check as `laminar run`)."""
    import os
    import subprocess
    import sys

    from laminar.config import RunConfig
    from laminar.storage import keys
    from laminar.storage.checkpoints import CheckpointStore

    torch = pytest.importorskip("torch")
    home = tmp_path / "home"
    store = LocalObjectStore(home / "store")
    store.put(keys.config("p"), RunConfig.load(None, ["run.steps=50"]).with_run_id("p").model_dump_json().encode())
    CheckpointStore(store).save("p", 10, {"model": {"w": torch.zeros(2)}}, {"step": 10}, policy_version=10)
    out = subprocess.run([sys.executable, "-m", "laminar.cli.main", "fork", "p", f"--model.path={tmp_path / 'nowhere'}"],
                         env={**os.environ, "LAMINAR_HOME": str(home)}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "model.path=" in out.stderr and "is not a directory" in out.stderr, out.stderr
    assert not (home / "dev.json").exists()  # no dev stack was started
    assert not store.exists(keys.run_marker("p-fork-s10"))  # nothing of the fork was written
