"""`laminar report`: the arithmetic behind the plots (worked by hand), and the page it writes, loaded in
headless Chromium (Debian's `chromium`, installed by `make browser`), with every image rendered."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from laminar.errors import ConfigError
from laminar.records import Trajectory
from laminar.reporting.report import PLOTS, ReportData, eval_wall_s, read, write
from laminar.storage import keys
from laminar.storage.objects import open_store
from laminar.storage.records import TrajRow
from laminar.storage.trajectories import TrajectoryStore

ROOT = Path(__file__).resolve().parents[1]

# Two steps. Step 1 ends at t=110 after 2 s busy and 8 s waiting; step 2 ends at 113 after 1 s busy, 2 s waiting
# (its wait began when step 1 ended).
STEPS = [
    {"step": 2, "time": 113.0, "busy_s": 1.0, "wait_s": 2.0, "tokens": 60, "reward_mean": 0.5,
     "staleness": {"1": 2, "3": 6}},
    {"step": 1, "time": 110.0, "busy_s": 2.0, "wait_s": 8.0, "tokens": 100, "reward_mean": 0.25,
     "staleness": {"0": 4, "1": 4}},
]
# (replica, version, started_at, ended_at), as trajectory rows of groups g0..g4 (sample 0, prompt i)
TRAJECTORIES = [TrajRow(f"g{i}", i, 0, replica, version, start, end) for i, (replica, version, start, end) in enumerate([
    ("replica-10", 1, 105.0, 107.0), ("replica-2", 0, 101.0, 104.0), ("replica-2", 0, 103.0, 106.0),
    ("replica-2", 1, 107.0, 109.0), ("replica-2", 0, 108.0, 109.0)])]
DRILL = {"drill_id": "d1", "run_id": "r", "fault": "relay", "target": "host-0", "injected_at": 104.0,
         "detected_at": 106.0, "recovered_at": None, "steps_during_outage": 0, "trainer_stall_s": 0.0,
         "groups_lost": 0, "groups_consumed_twice": 0, "tokens_regenerated": 0, "steps_redone": 0,
         "recovered": False}
EVALS = [{"run_id": "r", "policy_version": v, "prompts": 4, "samples": 1, "accuracy": a, "accuracy_stderr": 0.25}
         for v, a in ((0, 0.25), (2, 0.5))]
SUMMARY = {"mode": "laminar", "steps": 2, "events": [{"kind": "relay_lost", "subject": "host-0", "at": 105.0,
                                                        "count": 0}]}


def test_report_arithmetic_worked_by_hand():
    d = ReportData.from_records("r", STEPS, TRAJECTORIES, [DRILL], SUMMARY)
    # t0: the earliest start: step 1's wait began at 110 - 2 - 8 = 100 (the first trajectory started at 101)
    assert d.t0 == 100.0
    assert d.steps == [1, 2] and d.reward == [0.25, 0.5]
    # tokens / (wait + busy): 100 / (8 + 2) = 10; 60 / (2 + 1) = 20
    assert d.tokens_per_s == [10.0, 20.0]
    # {0: 4, 1: 4} + {1: 2, 3: 6}
    assert d.staleness == {0: 4, 1: 6, 3: 6}
    # busy: step 1 from 110 - 2 = 108 (8 s after t0) for 2 s, step 2 from 113 - 1 = 112 (12 s) for 1 s;
    # waiting: step 1 from 100 (0 s) for 8 s, step 2 from 112 - 2 = 110 (10 s) for 2 s
    assert d.busy == [(8.0, 2.0), (12.0, 1.0)]
    assert d.waiting == [(0.0, 8.0), (10.0, 2.0)]
    # replica-2, version 0: [1, 4] and [3, 6] overlap -> [1, 6]; [8, 9] stays apart; version 1: [7, 9].
    # replica-2 sorts before replica-10 (natural order, not "replica-10" < "replica-2").
    assert list(d.versions) == ["replica-2", "replica-10"]
    assert d.versions["replica-2"] == [(1.0, 6.0, 0), (7.0, 9.0, 1), (8.0, 9.0, 0)]
    assert d.versions["replica-10"] == [(5.0, 7.0, 1)]
    # drill and event times relative to t0; a drill that never recovered keeps None
    assert (d.drills[0]["injected_at"], d.drills[0]["detected_at"], d.drills[0]["recovered_at"]) == (4.0, 6.0, None)
    assert d.events == [{"kind": "relay_lost", "subject": "host-0", "at": 5.0, "count": 0}]


def _store_run(tmp_path: Path, run_id: str):
    """A run's records in a local store, as the trainer, the replicas, a drill and `laminar run` write them."""
    store = open_store((tmp_path / "store").as_uri())
    for r in STEPS:
        store.put(keys.step_metrics(run_id, r["step"]), json.dumps(r).encode())
    rows = [Trajectory(run_id=run_id, prompt_id=t.prompt_id, group_id=t.group_id, sample_index=t.sample_index,
                       prompt_ids=[1], response_ids=[2], logprobs=[-0.1], reward=1.0, policy_version=t.policy_version,
                       replica_id=t.replica_id, started_at=t.started_at, ended_at=t.ended_at, finish_reason="eos")
                  for t in TRAJECTORIES]
    TrajectoryStore(store).write_segment(run_id, "replica-2", "a-000001", rows)
    store.put(keys.drill_report(run_id, "d1"), json.dumps(DRILL).encode())
    store.put(keys.summary(run_id), json.dumps(SUMMARY).encode())
    for e in EVALS:
        store.put(keys.eval_result(run_id, e["policy_version"]), json.dumps({**e, "per_prompt": []}).encode())
    return store


def test_eval_points_in_wall_time():
    d = ReportData.from_records("r", STEPS, TRAJECTORIES, [DRILL], SUMMARY, list(reversed(EVALS)))
    assert [e["policy_version"] for e in d.evals] == [0, 2]
    # version 0 is the start (0 s); version 2 is step 2's end: busy from 12 s for 1 s -> 13 s; no step 7 record
    assert (eval_wall_s(d, 0), eval_wall_s(d, 2), eval_wall_s(d, 7)) == (0.0, 13.0, None)


def test_read_takes_every_record_from_the_store(tmp_path):
    store = _store_run(tmp_path, "r")
    d = read(store, "r")
    assert d == ReportData.from_records("r", STEPS, TRAJECTORIES, [DRILL], SUMMARY, EVALS)
    with pytest.raises(ConfigError, match="run 'nope' has no step records"):
        read(store, "nope")


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk (bytes 16-24, big-endian)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def _apt_usable() -> bool:
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium; installed with the project's own `make browser` (apt) when missing. Skips only where
    apt cannot be used (not root, or no apt-get)."""
    found = shutil.which("chromium")
    if found is None and _apt_usable():
        done = subprocess.run(["make", "-s", "browser"], cwd=ROOT, capture_output=True, text=True, timeout=900)
        found = shutil.which("chromium")
        if found is None:
            pytest.fail(f"`make browser` did not install chromium (exit {done.returncode}): {done.stdout[-800:]} "
                        f"{done.stderr[-800:]}")
    if found is None:
        pytest.skip("headless Chromium is not installed and apt-get is not usable here (needs root); "
                    "install Debian's chromium (`make browser` as root) to run this test")
    return found


# Appended to a copy of the page (never to the page itself): once everything loaded, the title lists each
# image's rendered size, 0x0 for one the browser could not decode.
PROBE = """<script>window.addEventListener('load', () => { const imgs = [...document.images];
document.title = 'images ' + imgs.map(i => (i.complete ? i.naturalWidth : 0) + 'x' + (i.complete ? i.naturalHeight : 0)).join(' ');
});</script>"""


def test_page_renders_every_plot_in_headless_chromium(tmp_path, chromium):
    store = _store_run(tmp_path, "r")
    files = write(read(store, "r"), tmp_path / "out")
    pngs, page = files[:-1], files[-1]
    assert page.name == "report.html" and [p.stem for p in pngs] == list(PLOTS)  # a drill ran and evals exist: all six plots
    html = page.read_text()
    assert "src=\"file:" not in html and html.count("data:image/png;base64,") == len(pngs)  # self-contained
    probe = tmp_path / "probe.html"
    probe.write_text(html.replace("</body>", PROBE + "</body>"))
    out = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
                          "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
    title = re.search(r"<title>images ([^<]*)</title>", out.stdout)
    assert title is not None, f"the page did not finish loading in chromium: {out.stderr[-1500:]}"
    rendered = [tuple(int(v) for v in size.split("x")) for size in title.group(1).split()]
    # every image decoded, at the size of the PNG it was made from, in page order
    assert rendered == [_png_size(p) for p in pngs]
    assert all(w > 0 and h > 0 for w, h in rendered)
