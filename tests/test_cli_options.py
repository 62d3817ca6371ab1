"""One voice on the command line (cli/options.py, cli/main.py): durations written one way (`30s`, `5m`, `1h`, plain
seconds) by one parser, old seconds-only spellings still accepted with a deprecation warning on stderr, help texts
that say what the commands do, the packaged default config, `laminar init`, and `laminar start` checking a config
exactly as `laminar run` does. In process (typer's CliRunner): nothing here starts a server."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from laminar.cli.init import starter_prompts, write_starter
from laminar.cli.main import app
from laminar.cli.options import default_config, duration, parse_duration
from laminar.cli.sim import parse_failure
from laminar.config import RunConfig
from laminar.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _invoke(args: list[str], home: Path) -> tuple[int, str, str]:
    """Exit code, stdout and stderr (whitespace folded: rich wraps long lines) of `laminar ARGS`."""
    res = CliRunner().invoke(app, args, env={"LAMINAR_HOME": str(home), "COLUMNS": "200"})
    return res.exit_code, " ".join(res.stdout.split()), " ".join(res.stderr.split())


# -- durations ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "seconds"), [
    ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0), ("45", 45.0), ("2.5", 2.5), (" 10M ", 600.0), ("0.5h", 1800.0),
    (90, 90.0),
])
def test_a_duration_is_a_number_with_an_optional_unit(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["soon", "", "-5", "0", "0s", "5x", "m", "inf", "nan", "1d"])
def test_anything_else_is_refused_naming_the_flag_and_the_fix(text):
    with pytest.raises(ConfigError, match=r"--timeout .*30s, 5m or 1h"):
        parse_duration(text, "--timeout")


def test_a_point_in_time_may_be_zero():
    assert parse_duration("0", allow_zero=True) == 0.0
    assert parse_failure("rollout@10m") == ("rollout", 600.0)
    assert parse_failure("trainer@600") == ("trainer", 600.0) and parse_failure("relay@0") == ("relay", 0.0)
    with pytest.raises(typer.BadParameter, match="KIND@TIME"):
        parse_failure("rollout@soon")


def test_an_old_spelling_gives_its_seconds_with_a_warning_on_stderr(capsys):
    assert duration("5m", "--timeout", None, "--timeout-s") == 300.0
    assert capsys.readouterr().err == ""
    assert duration(None, "--timeout", 300.0, "--timeout-s") == 300.0
    assert "--timeout-s 300 is deprecated; use --timeout 300s" in capsys.readouterr().err
    assert duration(None, "--timeout", None, "--timeout-s", default="5m") == 300.0
    assert duration(None, "--timeout", None, "--timeout-s") is None
    with pytest.raises(ConfigError, match="give only --timeout"):
        duration("5m", "--timeout", 300.0, "--timeout-s")


@pytest.mark.parametrize(("new", "old", "warned"), [
    (["--timeout", "5m"], ["--timeout-s", "300"], "--timeout-s 300 is deprecated; use --timeout 300s"),
    (["--outage", "3s"], ["--outage-s", "3"], "--outage-s 3 is deprecated; use --outage 3s"),
])
def test_drill_takes_durations_and_its_old_seconds_flags(tmp_path, new, old, warned):
    # an unknown fault fails before anything connects: what is left to see is how the flags were read
    base = ["drill", "r1", "--fault", "bogus"]
    code, _, err = _invoke([*base, *new], tmp_path)
    assert code == 2 and "bogus" in err and "deprecated" not in err
    code, _, err = _invoke([*base, *old], tmp_path)
    assert code == 2 and "bogus" in err and warned in err
    code, _, err = _invoke([*base, new[0], "soon"], tmp_path)
    assert code == 2 and f"{new[0]} 'soon'" in err


def test_drain_takes_a_timeout_and_its_old_wait(tmp_path):
    code, _, err = _invoke(["drain", "trainer", "--timeout", "30s"], tmp_path)
    assert code == 2 and "no worker named 'trainer'" in err and "deprecated" not in err
    code, _, err = _invoke(["drain", "trainer", "--wait", "30"], tmp_path)
    assert code == 2 and "--wait 30 is deprecated; use --timeout 30s" in err


def test_bench_heartbeats_takes_a_window_and_its_old_window_s(tmp_path):
    code, _, err = _invoke(["bench", "heartbeats", "--window", "2s"], tmp_path)
    assert code == 2 and "at least 5s" in err and "deprecated" not in err
    code, _, err = _invoke(["bench", "heartbeats", "--window-s", "2"], tmp_path)
    assert code == 2 and "at least 5s" in err and "--window-s 2 is deprecated; use --window 2s" in err


def test_chaos_reads_its_duration_with_the_same_parser(tmp_path):
    code, _, err = _invoke(["chaos", "--duration", "soon"], tmp_path)
    assert code == 2 and "--duration 'soon'" in err and "30s, 5m or 1h" in err


def test_old_spellings_stay_out_of_help(tmp_path):
    for args, old in ((["drill"], "--timeout-s"), (["drill"], "--outage-s"), (["drain"], "--wait"),
                      (["bench", "heartbeats"], "--window-s")):
        code, out, _ = _invoke([*args, "--help"], tmp_path)
        assert code == 0 and old not in out and "30s, 5m, 1h" in out


# -- help texts -----------------------------------------------------------------------------------------------


def _commands(group: typer.Typer, prefix: list[str]) -> list[list[str]]:
    out = [[*prefix, c.name or c.callback.__name__] for c in group.registered_commands]
    for sub in group.registered_groups:
        out += _commands(sub.typer_instance, [*prefix, sub.name])
    return out


def test_every_command_has_help_and_it_renders(tmp_path):
    commands = _commands(app, [])
    names = {" ".join(c) for c in commands}
    assert {"run", "init", "start", "workers", "worker", "drill", "drain", "chaos", "eval", "simulate", "plan",
            "dev up", "bench relay", "bench heartbeats", "bench overhead", "bench throughput",
            "model import-gguf"} <= names
    for command in commands:
        code, out, _ = _invoke([*command, "--help"], tmp_path)
        assert code == 0, command
        assert "examples/tiny.toml" not in out.replace("the same as examples/tiny.toml", ""), command


def test_no_help_text_loses_a_bracketed_word_to_rich_markup():
    # rich reads `[eval]` as a style tag and prints nothing: a TOML section in a help text is written `\\[eval]`
    import re

    import click

    def walk(cmd: click.Command, path: str):
        yield path, cmd.help or "", cmd
        for p in cmd.params:
            yield f"{path} {p.name}", getattr(p, "help", None) or "", cmd
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, f"{path} {name}")

    swallowed = [(where, text) for where, text, _ in walk(typer.main.get_command(app), "laminar")
                 if re.search(r"(?<!\\)\[[a-z][a-z_.]*\]", text)]
    assert not swallowed, swallowed


def test_bench_help_names_its_four_benchmarks(tmp_path):
    code, out, _ = _invoke(["--help"], tmp_path)
    assert code == 0
    bench_line = out[out.index("bench"):][:200]
    for what in ("relay broadcast", "heartbeat", "overhead", "throughput"):
        assert what in bench_line, bench_line
    code, out, _ = _invoke(["bench", "--help"], tmp_path)
    for name in ("relay", "heartbeats", "overhead", "throughput"):
        assert name in out


# -- the default config and `laminar init` --------------------------------------------------------------------


def test_the_packaged_default_config_is_examples_tiny():
    assert default_config().read_text() == (ROOT / "examples" / "tiny.toml").read_text()
    assert RunConfig.load(default_config()) == RunConfig.load(ROOT / "examples" / "tiny.toml")


def test_init_writes_a_config_that_loads_and_a_prompts_file_it_names(tmp_path, monkeypatch):
    from laminar.envs.tasks.loader import build_task, check_task

    monkeypatch.chdir(tmp_path)  # the config names the prompts by absolute path: any directory works
    code, out, _ = _invoke(["init", "starter"], tmp_path / "home")
    assert code == 0 and "laminar run" in out
    config, prompts = tmp_path / "starter" / "laminar.toml", tmp_path / "starter" / "prompts.jsonl"
    cfg = RunConfig.load(config)
    assert cfg.task.name == "file" and Path(cfg.task.prompts) == prompts.resolve()
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert rows == starter_prompts() and all(r["prompt"] == f"copy : {r['answer']}" for r in rows)
    check_task(cfg.task)
    task = build_task(cfg.task, seed=0)
    assert task.prompt(0).answer_meta["answer"] in {r["answer"] for r in rows}
    # its fields are those of the packaged tiny config where it does not say otherwise
    assert set(tomllib.loads(config.read_text())) <= set(tomllib.loads(default_config().read_text()))
    # a second init keeps the user's edits
    code, _, err = _invoke(["init", "starter"], tmp_path / "home")
    assert code == 2 and "already exist" in err and "--force" in err
    write_starter(tmp_path / "starter", force=True)


# -- `laminar start` checks what `laminar run` checks ---------------------------------------------------------


@pytest.mark.parametrize(("overrides", "env", "said"), [
    (["--model.path=/nonexistent/model"], {}, "/nonexistent/model"),
    (["--task.name=no_such_task"], {}, "no_such_task"),
    (["--task.name=file", "--task.prompts=/nonexistent/prompts.jsonl"], {}, "/nonexistent/prompts.jsonl"),
    (["--task.params={\"nope\": 1}"], {}, "nope"),
    ([], {"LAMINAR_METRICS_BIND": "0.0.0.0"}, "LAMINAR_METRICS_TOKEN"),
])
def test_start_refuses_a_bad_config_exactly_as_run_does(tmp_path, monkeypatch, overrides, env, said):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LAMINAR_METRICS_TOKEN", raising=False)
    monkeypatch.delenv("LAMINAR_INSECURE", raising=False)
    home = tmp_path / "home"
    run = _invoke(["run", *overrides], home)
    start = _invoke(["start", *overrides], home)
    assert run[0] == start[0] == 2, (run, start)
    assert said in run[2] and run[2] == start[2]
    assert not (home / "dev.json").exists()  # nothing started
