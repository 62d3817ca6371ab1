"""The project's own files are private (laminar/private.py): the state directory and a local store's root are
owner-only (0700) when laminar makes them, an existing one open to others is narrowed, and a stored object is a
0600 file. Real directories under tmp_path; modes read back with stat."""

from __future__ import annotations

import stat

from laminar.client.settings import Settings
from laminar.devstack.stack import DevStack
from laminar.storage.objects import LocalObjectStore


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_state_directory_is_made_owner_only(tmp_path):
    home = tmp_path / "project" / ".laminar"
    settings = Settings.from_env({}, cwd=tmp_path / "project")  # LAMINAR_HOME unset: .laminar under cwd
    assert settings.home == home and _mode(home) == 0o700
    assert settings.store_url == (home / "store").as_uri()


def test_an_existing_state_directory_open_to_others_is_narrowed(tmp_path):
    home = tmp_path / "state"
    home.mkdir(mode=0o755)
    home.chmod(0o755)  # as a home made before the rule: group and others could list it
    (home / "temporal.db").write_text("db")
    Settings.from_env({"LAMINAR_HOME": str(home)}, cwd=tmp_path)
    assert _mode(home) == 0o700


def test_the_dev_stack_home_and_a_local_store_are_owner_only(tmp_path):
    stack = DevStack(tmp_path / "dev-home")
    with stack._lock():  # the first thing `laminar dev up` does in its home
        pass
    assert _mode(tmp_path / "dev-home") == 0o700
    store = LocalObjectStore(tmp_path / "elsewhere" / "store")
    assert _mode(tmp_path / "elsewhere" / "store") == 0o700
    store.put("runs/r/checkpoints/step-10/model.safetensors", b"weights")
    # a stored object (checkpoint part, trajectory segment) is a mkstemp file: 0600
    assert _mode(tmp_path / "elsewhere/store/runs/r/checkpoints/step-10/model.safetensors") == 0o600
