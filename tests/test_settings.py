"""Deployment settings from LAMINAR_* variables: defaults, overrides, errors, dev.json pickup."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from laminar.client.settings import Settings
from laminar.devstack.record import DevStackInfo
from laminar.errors import ConfigError


def _write_dev_record(home: Path, s3: bool) -> None:
    info = DevStackInfo(
        home=str(home),
        temporal_pid=1,
        temporal_address="127.0.0.1:17999",
        namespace="default",
        ui_url=None,
        db_file=str(home / "temporal.db"),
        temporal_log=str(home / "logs" / "temporal.log"),
        store_url="s3://laminar" if s3 else (home / "store").as_uri(),
        started_at="2026-01-01T00:00:00+00:00",
        s3_pid=2 if s3 else None,
        s3_endpoint="http://127.0.0.1:19000" if s3 else None,
        s3_bucket="laminar" if s3 else None,
    )
    home.mkdir(parents=True, exist_ok=True)
    (home / "dev.json").write_text(json.dumps(asdict(info)))


def test_defaults_without_variables(tmp_path: Path) -> None:
    s = Settings.from_env({}, cwd=tmp_path)
    assert s == Settings(
        home=tmp_path / ".laminar",
        temporal_address="127.0.0.1:7233",
        namespace="default",
        store_url=(tmp_path / ".laminar" / "store").as_uri(),
        s3_endpoint=None,
        host_id="host-0",
        relay_bind="127.0.0.1",
        relay_token=None,
        log_format="console",
        log_level="info",
    )
    assert s.store_url.startswith("file:///")


def test_variables_override_defaults(tmp_path: Path) -> None:
    env = {
        "LAMINAR_HOME": "state",  # relative: resolved against cwd
        "LAMINAR_TEMPORAL_ADDRESS": "temporal.internal:7233",
        "LAMINAR_NAMESPACE": "rl",
        "LAMINAR_STORE": "s3://my-bucket/runs",
        "LAMINAR_S3_ENDPOINT": "http://10.0.0.5:9000/",
        "LAMINAR_HOST_ID": "gpu-node-3",
        "LAMINAR_RELAY_BIND": "0.0.0.0",
        "LAMINAR_LOG_FORMAT": "JSON",
        "LAMINAR_LOG_LEVEL": "Debug",
    }
    s = Settings.from_env(env, cwd=tmp_path)
    assert s.home == tmp_path / "state"
    assert s.temporal_address == "temporal.internal:7233"
    assert s.namespace == "rl"
    assert s.store_url == "s3://my-bucket/runs"
    assert s.s3_endpoint == "http://10.0.0.5:9000"  # trailing slash dropped
    assert (s.host_id, s.relay_bind, s.log_format, s.log_level) == ("gpu-node-3", "0.0.0.0", "json", "debug")


def test_empty_variable_counts_as_unset(tmp_path: Path) -> None:
    s = Settings.from_env({"LAMINAR_S3_ENDPOINT": "", "LAMINAR_NAMESPACE": " "}, cwd=tmp_path)
    assert s.s3_endpoint is None
    assert s.namespace == "default"


def test_to_env_round_trips(tmp_path: Path) -> None:
    s = Settings.from_env(
        {"LAMINAR_HOST_ID": "h1", "LAMINAR_S3_ENDPOINT": "http://127.0.0.1:9000"}, cwd=tmp_path
    )
    env = s.to_env()
    assert all(k.startswith("LAMINAR_") and isinstance(v, str) for k, v in env.items())
    assert Settings.from_env(env, cwd=Path("/")) == s  # absolute home: cwd no longer matters
    no_s3 = Settings.from_env({}, cwd=tmp_path)
    assert "LAMINAR_S3_ENDPOINT" not in no_s3.to_env()
    assert Settings.from_env(no_s3.to_env()) == no_s3


@pytest.mark.parametrize(
    ("name", "value", "fix"),
    [
        ("LAMINAR_TEMPORAL_ADDRESS", "localhost", "host:port"),
        ("LAMINAR_TEMPORAL_ADDRESS", "127.0.0.1:99999", "host:port"),
        ("LAMINAR_NAMESPACE", "bad namespace", "letters"),
        ("LAMINAR_STORE", "/data/store", "file:///abs/path or s3://bucket"),
        ("LAMINAR_STORE", "file://relative/path", "absolute path"),
        ("LAMINAR_STORE", "s3://Bad_Bucket", "bucket name"),
        ("LAMINAR_S3_ENDPOINT", "127.0.0.1:9000", "http(s)://host:port"),
        ("LAMINAR_HOST_ID", "host 0", "letters"),
        ("LAMINAR_RELAY_BIND", "127.0.0.1:5000", "without a port"),
        ("LAMINAR_LOG_FORMAT", "xml", "console, json"),
        ("LAMINAR_LOG_LEVEL", "loud", "debug, info, warning, error, critical"),
    ],
)
def test_invalid_value_names_variable_value_and_fix(tmp_path: Path, name: str, value: str, fix: str) -> None:
    with pytest.raises(ConfigError) as exc:
        Settings.from_env({name: value}, cwd=tmp_path)
    message = str(exc.value)
    assert name in message
    assert value.lower() in message.lower()
    assert fix in message


def test_home_that_is_a_file_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="LAMINAR_HOME.*not a directory"):
        Settings.from_env({"LAMINAR_HOME": str(tmp_path / "afile")})


def test_dev_record_supplies_temporal_address_and_keeps_file_store(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _write_dev_record(home, s3=False)
    s = Settings.from_env({"LAMINAR_HOME": str(home)})
    assert s.temporal_address == "127.0.0.1:17999"
    assert s.store_url == (home / "store").as_uri()
    assert s.s3_endpoint is None


def test_dev_record_with_s3_supplies_store_and_endpoint(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _write_dev_record(home, s3=True)
    s = Settings.from_env({"LAMINAR_HOME": str(home)})
    assert (s.temporal_address, s.store_url, s.s3_endpoint) == (
        "127.0.0.1:17999",
        "s3://laminar",
        "http://127.0.0.1:19000",
    )


def test_variables_win_over_dev_record(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _write_dev_record(home, s3=True)
    env = {
        "LAMINAR_HOME": str(home),
        "LAMINAR_TEMPORAL_ADDRESS": "10.1.1.1:7233",
        "LAMINAR_STORE": "file:///srv/s",
    }
    s = Settings.from_env(env)
    assert (s.temporal_address, s.store_url) == ("10.1.1.1:7233", "file:///srv/s")
    assert s.s3_endpoint == "http://127.0.0.1:19000"  # not overridden: still the dev stack's


def test_corrupt_dev_record_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "dev.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"dev\.json is unreadable.*delete it"):
        Settings.from_env({"LAMINAR_HOME": str(home)})


def test_relay_token_round_trips_and_short_tokens_are_refused(tmp_path):
    env = {"LAMINAR_HOME": str(tmp_path), "LAMINAR_RELAY_TOKEN": "0123456789abcdef0123"}
    s = Settings.from_env(env)
    assert s.relay_token == "0123456789abcdef0123"
    assert Settings.from_env(s.to_env()) == s
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"LAMINAR_HOME": str(tmp_path), "LAMINAR_RELAY_TOKEN": "short"})
    assert "LAMINAR_RELAY_TOKEN" in str(info.value) and "short" not in str(info.value)  # never echo secrets


def test_process_environment_is_read_when_no_mapping_is_given(tmp_path, monkeypatch):
    monkeypatch.setenv("LAMINAR_HOME", str(tmp_path / "h"))
    monkeypatch.setenv("LAMINAR_LOG_LEVEL", "WARNING")
    monkeypatch.setenv("LAMINAR_NAMESPACE", " ")  # blank: unset, as in a mapping
    s = Settings.from_env()
    assert (s.home, s.log_level, s.namespace) == (tmp_path / "h", "warning", "default")
    monkeypatch.setenv("LAMINAR_RELAY_BIND", "bad host")
    with pytest.raises(ConfigError, match="LAMINAR_RELAY_BIND='bad host' is invalid; .*without a port"):
        Settings.from_env()


def test_every_invalid_variable_is_reported_at_once(tmp_path):
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"LAMINAR_HOST_ID": "a b", "LAMINAR_LOG_FORMAT": "xml"}, cwd=tmp_path)
    assert "LAMINAR_HOST_ID='a b'" in str(info.value) and "LAMINAR_LOG_FORMAT='xml'" in str(info.value)


def test_relay_timeouts_default_to_about_a_second_and_bad_ones_name_the_fix(tmp_path):
    from laminar.relay import client

    s = Settings.from_env({"LAMINAR_HOME": str(tmp_path)})
    assert (s.relay_connect_timeout_s, s.relay_io_timeout_s) == (1.0, 2.0)  # not the 30 s of a blocked push
    s = Settings.from_env({"LAMINAR_HOME": str(tmp_path), "LAMINAR_RELAY_CONNECT_TIMEOUT_S": "0.25",
                           "LAMINAR_RELAY_IO_TIMEOUT_S": "5"})
    assert (s.relay_connect_timeout_s, s.relay_io_timeout_s) == (0.25, 5.0)
    assert Settings.from_env(s.to_env()) == s
    with pytest.raises(ConfigError, match=r"LAMINAR_RELAY_CONNECT_TIMEOUT_S='0' is invalid; use seconds between 0.01"):
        Settings.from_env({"LAMINAR_HOME": str(tmp_path), "LAMINAR_RELAY_CONNECT_TIMEOUT_S": "0"})
    with pytest.raises(ConfigError, match=r"LAMINAR_RELAY_IO_TIMEOUT_S='soon' is invalid"):
        Settings.from_env({"LAMINAR_HOME": str(tmp_path), "LAMINAR_RELAY_IO_TIMEOUT_S": "soon"})
    before = client.TIMEOUTS
    try:
        assert client.configure(0.5, 3) == client.Timeouts(0.5, 3.0) == client.TIMEOUTS
        with pytest.raises(ValueError, match=r"relay io_timeout_s=nan: use seconds between 0.01 and 600"):
            client.configure(1.0, float("nan"))
    finally:
        client.TIMEOUTS = before
