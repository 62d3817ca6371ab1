"""`laminar drain WORKER` names workers as the launchers do (workers/drain.py); the integration test that drains a
real rollout worker mid-run is in tests/test_scale_integration.py."""

from __future__ import annotations

import pytest

from laminar.errors import ConfigError
from laminar.workers.drain import drain, worker_name

PY = ["/usr/bin/python3", "-m", "laminar.cli.main", "worker"]


@pytest.mark.parametrize(("argv", "env", "name"), [
    ([*PY, "control"], {}, "control"),
    ([*PY, "--allow-faults", "trainer"], {}, "trainer"),
    ([*PY, "relay"], {"LAMINAR_HOST_ID": "host-3"}, "relay-host-3"),
    ([*PY, "--allow-faults", "rollout", "--slots", "3"], {"LAMINAR_HOST_ID": "gpu-7"}, "rollout-gpu-7"),
    ([*PY, "rollout"], {}, "rollout-host-0"),  # LAMINAR_HOST_ID's default
    (["/usr/bin/python3", "-m", "laminar.cli.main", "run", "examples/tiny.toml"], {}, None),  # not a worker
    (["nginx", "-g", "daemon off;"], {}, None),
])
def test_worker_names_follow_the_launchers(argv, env, name):
    assert worker_name(argv, env) == name


def test_draining_a_worker_that_does_not_run_names_the_ones_that_do(tmp_path):
    with pytest.raises(ConfigError, match=r"no worker named 'rollout-host-9' runs under LAMINAR_HOME=.*running: none"):
        drain(tmp_path, "rollout-host-9", wait_s=1.0)
