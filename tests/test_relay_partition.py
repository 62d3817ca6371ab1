"""A relay whose port drops every packet (a gray failure: alive, unreachable on its data plane), with real relay
servers, the trainer's real push path (TrainerService._push) and a rollout replica's real poll and fetch
(services/rollout/weights.py), inside a private network namespace (tests/netpart.py).

Before the relay timeouts and breakers, the trainer's push to such a master blocked for the 30 s connect timeout
and every replica poll for 5 s. The scenario runs in a child process in the namespace (`python -m
tests.test_relay_partition`) and prints its measurements as JSON; the test asserts on them.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests import netpart

REPO_ROOT = Path(__file__).resolve().parents[1]
SIZE = 4 << 20  # a 4 MiB version: a push takes milliseconds on loopback, so the timings below are the timeouts'


def scenario() -> dict[str, float | int | None | list | str]:
    from laminar.config import RunConfig
    from laminar.contract import RelayInfo, TrainStepInput
    from laminar.metrics import ReplicaMetrics
    from laminar.policy import policy_for
    from laminar.relay import client
    from laminar.relay.breaker import BREAKERS
    from laminar.relay.server import RelayServer
    from laminar.services.rollout.batch import Counters
    from laminar.services.rollout.weights import Weights
    from laminar.services.trainer import TrainerService
    from laminar.storage.objects import LocalObjectStore

    out: dict[str, float | int | None | list | str] = {"connect_timeout_s": client.TIMEOUTS.connect_s}
    home = Path(tempfile.mkdtemp())
    a, b = RelayServer("host-0"), RelayServer("host-1")
    addr_a, addr_b = a.start(), b.start()
    out["master"] = addr_a
    try:
        trainer = TrainerService(LocalObjectStore(home / "store"), home)
        payload = lambda v: bytes([v]) * SIZE  # noqa: E731
        trainer._push([addr_a, addr_b], "run-p", 1, payload(1))
        port_a = int(addr_a.rsplit(":", 1)[1])
        with netpart.blackhole(port_a):
            # The trainer: one failed attempt at the master, then the next relay takes the version.
            t0 = time.perf_counter()
            stall = trainer._push([addr_a, addr_b], "run-p", 2, payload(2))
            out["push_after_partition_s"] = time.perf_counter() - t0
            out["push_stall_reported_s"] = stall
            out["b_holds_after_push"] = client.latest_version(addr_b, run="run-p")
            t0 = time.perf_counter()
            trainer._push([addr_a, addr_b], "run-p", 3, payload(3))
            out["next_push_s"] = time.perf_counter() - t0
            inp = TrainStepInput(run_id="run-p", config={}, step=3, batch=[], checkpoint=None, replay=[],
                                 relay_chain=[addr_b], relays_out=[addr_a])
            out["trainer_reports"] = trainer._relay_checks(inp)
            # A rollout replica on host-0 (its own relay is the partitioned one), in another process: its own
            # breakers. One failed poll of its relay, then it polls host-1's.
            BREAKERS.clear()
            w = Weights(None, policy_for(RunConfig()), "run-p", "r0", "host-0", None, Counters(),  # type: ignore[arg-type]
                        ReplicaMetrics.of("r0"))
            w.relays = [RelayInfo("host-0", "host-0", addr_a), RelayInfo("host-1", "host-1", addr_b)]
            t0 = time.perf_counter()
            w.poll()
            out["first_poll_s"], out["first_poll_version"] = time.perf_counter() - t0, w.newest_at_relay
            t0 = time.perf_counter()
            w.poll()
            out["second_poll_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = w.fetch(3)
            out["fetch_s"], out["fetch_ok"] = time.perf_counter() - t0, got == payload(3)
        # Healed: the breaker's background probe (1, 2, 4, 8 s backoff) passes again.
        healed_at = time.monotonic()
        while not BREAKERS.passed(addr_a) and time.monotonic() - healed_at < 20:
            w.relay_order()  # a caller that skips addr_a starts its probe when due
            time.sleep(0.05)
        out["passed_after_heal_s"] = time.monotonic() - healed_at
        w.poll()
        out["order_after_heal"] = [x == addr_a for x in w.relay_order()]
    finally:
        a.stop()
        b.stop()
    return out


def test_a_partitioned_master_costs_the_trainer_one_connect_timeout_and_replicas_one_poll():
    why = netpart.unavailable()
    if why:
        pytest.skip(f"partition test: {why}")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = netpart.run_in_netns([sys.executable, "-m", "tests.test_relay_partition"], env=env, timeout_s=120,
                                capture_output=True, text=True, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    m = json.loads(done.stdout.strip().splitlines()[-1])
    print(m)
    timeout = m["connect_timeout_s"]
    assert timeout == 1.0  # the default (relay.client.DEFAULT_CONNECT_TIMEOUT_S), not 30 s
    # The push gives up on the master after one connect timeout (1 s) and hands the version to host-1 at once:
    # 1 s + a 4 MiB loopback push (ms); 2 s leaves room for a loaded machine. Before: 30 s.
    assert timeout <= m["push_after_partition_s"] < 2 * timeout
    assert m["push_stall_reported_s"] >= timeout  # the step's stall counts the failed attempt
    assert m["b_holds_after_push"] == 2
    # The next push skips the master at once (its breaker is open): no connect timeout at all.
    assert m["next_push_s"] < 0.5 * timeout
    # The step reports the master as failing; it is not reported passing while partitioned.
    assert m["trainer_reports"]["relays_failed"] == [m["master"]]
    assert m["trainer_reports"]["relays_passed"] == []
    # A replica: its first poll pays one connect timeout at its own relay, then finds version 3 at host-1; the
    # second skips its relay at once. Before: 5 s for every poll while the partition lasted.
    assert timeout <= m["first_poll_s"] < 2 * timeout and m["first_poll_version"] == 3
    assert m["second_poll_s"] < 0.5 * timeout
    assert m["fetch_ok"] and m["fetch_s"] < 0.5 * timeout
    # After the heal the probe passes within the backoff (at most 8 s, relay.breaker.MAX_BACKOFF_S) plus one probe,
    # and the replica's own relay is first again.
    assert m["passed_after_heal_s"] < 8 + 2 * timeout
    assert m["order_after_heal"] == [True, False]


if __name__ == "__main__":
    print(json.dumps(scenario()))
