"""The local launcher's process plan: one control and one trainer worker, and per simulated host one relay
worker and one rollout worker carrying that host's share of the replica slots."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from laminar.client.settings import Settings
from laminar.config import RunConfig
from laminar.workers.launcher import ManagedProcess, plan_processes

BASE = [sys.executable, "-m", "laminar.cli.main", "worker"]


def _plan(tmp_path: Path, relays: int, replicas: int, spare_slots: int = 0) -> list[ManagedProcess]:
    cfg = RunConfig.load(None, [f"relay.relays={relays}", f"rollout.replicas={replicas}"])
    settings = Settings.from_env({"LAMINAR_HOME": str(tmp_path)})
    return plan_processes(cfg, settings, tmp_path / "logs", spare_slots=spare_slots)


def test_two_hosts_three_replicas(tmp_path: Path) -> None:
    procs = _plan(tmp_path, relays=2, replicas=3)
    # 3 replicas over 2 hosts: 3 // 2 = 1 each, and the remainder 3 % 2 = 1 goes to host-0 -> slots 2, 1
    assert [(p.name, p.argv[len(BASE):]) for p in procs] == [
        ("control", ["control"]),
        ("trainer", ["trainer"]),
        ("relay-host-0", ["relay"]),
        ("rollout-host-0", ["rollout", "--slots", "2"]),
        ("relay-host-1", ["relay"]),
        ("rollout-host-1", ["rollout", "--slots", "1"]),
    ]
    assert all(p.argv[: len(BASE)] == BASE for p in procs)
    host = {p.name: p.env["LAMINAR_HOST_ID"] for p in procs}
    assert host["relay-host-0"] == host["rollout-host-0"] == "host-0"
    assert host["relay-host-1"] == host["rollout-host-1"] == "host-1"
    assert {p.name: p.log_path for p in procs} == {p.name: tmp_path / "logs" / f"{p.name}.log" for p in procs}
    assert all(p.proc is None and p.pid is None and p.restarts == 0 for p in procs)


def test_children_get_the_settings(tmp_path: Path) -> None:
    settings = Settings.from_env({"LAMINAR_HOME": str(tmp_path)})
    for p in _plan(tmp_path, relays=2, replicas=3):
        child = Settings.from_env(p.env)
        # every child sees the same deployment; only the host id differs per host
        assert child.home == settings.home == tmp_path.resolve()
        assert child.store_url == settings.store_url == (tmp_path.resolve() / "store").as_uri()
        assert child.temporal_address == settings.temporal_address
        expected_host = p.name.split("-", 1)[1] if p.name.startswith(("relay-", "rollout-")) else settings.host_id
        assert child.host_id == expected_host


@pytest.mark.parametrize(("relays", "replicas", "slots"), [
    (3, 1, {"rollout-host-0": "1"}),  # 1 // 3 = 0, remainder 1 -> host-0 only
    (4, 2, {"rollout-host-0": "1", "rollout-host-1": "1"}),  # 2 // 4 = 0, remainder 2 -> hosts 0 and 1
    (1, 5, {"rollout-host-0": "5"}),  # one host takes all
    (2, 4, {"rollout-host-0": "2", "rollout-host-1": "2"}),  # 4 // 2 = 2, no remainder
    (3, 7, {"rollout-host-0": "3", "rollout-host-1": "2", "rollout-host-2": "2"}),  # 7 // 3 = 2, remainder 1
])
def test_replica_slots_per_host(tmp_path: Path, relays: int, replicas: int, slots: dict[str, str]) -> None:
    procs = _plan(tmp_path, relays=relays, replicas=replicas)
    names = [p.name for p in procs]
    # every host has a relay, whether or not it runs replicas
    assert [n for n in names if n.startswith("relay-")] == [f"relay-host-{i}" for i in range(relays)]
    rollout = {p.name: p.argv[-1] for p in procs if p.name.startswith("rollout-")}
    assert rollout == slots
    assert sum(int(s) for s in rollout.values()) == replicas
    # each rollout worker follows its host's relay
    for name in rollout:
        assert names.index(name) == names.index(name.replace("rollout-", "relay-")) + 1


def test_spare_slots_are_named_so_the_worker_polls_with_them_late(tmp_path: Path) -> None:
    """The default run (2 replicas, 2 hosts, the torch engine's 1 spare): each rollout worker has its replica's slot
    and a spare, which it polls with only after a wait (workers/rollout_slots.py), so one replica runs on each."""
    rollout = {p.name: p.argv[len(BASE):] for p in _plan(tmp_path, relays=2, replicas=2, spare_slots=1)
               if p.name.startswith("rollout")}
    assert rollout == {"rollout-host-0": ["rollout", "--slots", "2", "--spare", "1"],
                       "rollout-host-1": ["rollout", "--slots", "2", "--spare", "1"]}
