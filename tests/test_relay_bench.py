"""Smoke run of `laminar bench relay` over loopback: tiny size, relays 1,2, every JSON key present; and SIGTERM
stops every process it started.
Numbers are not asserted (benchmarks are measured, never timed tests)."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from laminar.cli.bench import bench_app, parse_size


def test_bench_relay_smoke_over_loopback_writes_the_json_report(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = CliRunner().invoke(bench_app, ["relay", "--size", "2MiB", "--relays", "1,2", "--reps", "2",
                                            "--json", str(out), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["transport"] == "loopback" and report["memcpy_gbps"] > 0
    assert [r["relays"] for r in report["results"]] == [1, 2]
    assert report["loopback_tcp_bytes_per_s"] > 0
    for row in report["results"]:
        for key in ("relays", "stall_s", "all_relays_s", "single_hop_s", "sequential_s", "storage_s", "model_s",
                    "local_pull_gbps", "local_pull_median_gbps", "memcpy_gbps", "forward_bytes_per_s"):
            assert row[key] is not None and row[key] > 0, key
        # Two rounds, each timing one broadcast per relay count: two stalls per count, the median reported.
        assert len(row["stall_each_s"]) == 2 and row["stall_s"] == statistics.median(row["stall_each_s"])
        # The share of memcpy is taken against the best memcpy timed beside the pulls; the earlier ratio, against
        # the best memcpy of the whole run (its start too), can only be lower, and no lower than against the
        # top line's best of every phase.
        assert row["local_pull_fraction_of_memcpy"] == row["local_pull_gbps"] / row["memcpy_gbps"]
        assert (row["local_pull_gbps"] / report["memcpy_gbps"] <= row["local_pull_fraction_of_best_memcpy"]
                <= row["local_pull_fraction_of_memcpy"])
        assert row["memcpy_gbps"] <= report["memcpy_gbps"] and row["local_pull_median_gbps"] <= row["local_pull_gbps"]
        # CPU time counts in 10 ms clock ticks: 2 MiB may cost less than one, so 0 is a valid reading.
        assert row["tail_cpu_s_per_gib"] >= 0 and row["master_cpu_s_per_gib"] >= 0
    one, two = report["results"]
    # With 1 relay it is the tail and forwards nothing; with 2, relay 1 received and forwarded.
    assert one["relay_cpu_s_per_gib"] is None and two["relay_cpu_s_per_gib"] >= 0
    assert two["relay_cpu_s_per_gib_max"] == two["relay_cpu_s_per_gib"]  # one forwarding relay: mean = max
    assert "relay broadcast of 2 MiB" in result.output


def test_sizes_parse():
    assert parse_size("256MiB") == 268435456
    assert parse_size("1GB") == 10**9
    assert parse_size("65536") == 65536


@pytest.mark.slow  # make test stays under 15 minutes; run with pytest -m slow
def test_sigterm_stops_every_node_process_it_started(tmp_path):
    """`timeout` or a CI runner ends a benchmark with SIGTERM: the relays, agents and the object store it started
    (real processes) must go with it, as with Ctrl-C, instead of outliving it."""
    repo = Path(__file__).resolve().parents[1]
    bench = subprocess.Popen([sys.executable, "-m", "laminar.cli.main", "bench", "relay", "--size", "2MiB", "--relays", "1,2",
                              "--reps", "100000", "--plot", str(tmp_path / "p.png")],
                             cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    nodes: list[psutil.Process] = []
    try:
        seen = []
        for line in bench.stderr:  # progress lines; the timed rounds start after every node answered
            seen.append(line)
            if "round 1/" in line:
                break
        assert any("round 1/" in s for s in seen), "".join(seen)
        nodes = psutil.Process(bench.pid).children(recursive=True)
        # master + 2 relays + trainer agent + 2 readers + moto_server
        assert len(nodes) >= 7, [n.cmdline() for n in nodes]
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) != 0
        _, alive = psutil.wait_procs(nodes, timeout=20)
        assert not alive, [n.cmdline() for n in alive]
    finally:  # nothing outlives the test, whatever failed
        if bench.poll() is None:
            bench.kill()
        for node in nodes:
            try:
                node.kill()
            except psutil.NoSuchProcess:
                pass
