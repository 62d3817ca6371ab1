"""The run config: defaults, the example file, `--section.key=value` overrides and the messages of
invalid input (each names the field, the value and what is allowed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from laminar.config import RunConfig, parse_overrides
from laminar.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny.toml"


def test_defaults_load_without_a_file() -> None:
    cfg = RunConfig.load(None)
    assert cfg == RunConfig()
    assert (cfg.run.mode, cfg.run.steps, cfg.run.run_id) == ("laminar", 300, "")
    assert (cfg.rollout.replicas, cfg.rollout.group_size) == (2, 8)
    assert (cfg.trainer.groups_per_step, cfg.trainer.lr, cfg.trainer.keep_last) == (4, 2e-3, 3)
    assert cfg.relay.relays == 2


def test_example_tiny_toml_loads() -> None:
    cfg = RunConfig.load(TINY)
    # tiny.toml spells out the defaults, and adds one thing: its learning-rate decay (the toy task's policy turns
    # deterministic and then drifts at a constant rate over thousands of steps; docs/decisions/reward-collapse.md). A decay is
    # not a default for every run: the default is a constant rate.
    decay = {"lr_decay_steps": 1500, "lr_min_ratio": 0.1}
    assert {k: getattr(cfg.trainer, k) for k in decay} == decay
    assert RunConfig().trainer.lr_decay_steps == 0
    assert cfg == RunConfig.load(None, [f"trainer.{k}={v}" for k, v in decay.items()])
    assert cfg.run.history_events_per_segment == 2500 and cfg.run.continue_as_new_every == 0
    assert cfg.model == RunConfig().model
    assert cfg.rollout == RunConfig().rollout
    assert RunConfig.load(ROOT / "laminar" / "defaults" / "tiny.toml") == cfg  # the embedded default is the example


def test_overrides_with_and_without_dashes() -> None:
    cfg = RunConfig.load(TINY, ["--trainer.lr=0.01", "rollout.replicas=3", "--run.run_id=my-run",
                                "--model.path=/models/qwen", "--run.mode=sync", "--rollout.temperature=0.7"])
    assert cfg.trainer.lr == 0.01
    assert cfg.rollout.replicas == 3 and isinstance(cfg.rollout.replicas, int)
    assert cfg.run.run_id == "my-run"  # a bare string
    assert cfg.model.path == "/models/qwen"
    assert cfg.run.mode == "sync"
    assert cfg.rollout.temperature == 0.7
    # the rest of the file is untouched
    assert cfg.run.history_events_per_segment == 2500


def test_later_override_wins_and_empty_value_is_an_empty_string() -> None:
    cfg = RunConfig.load(None, ["trainer.lr=0.5", "trainer.lr=0.25", "model.path="])
    assert cfg.trainer.lr == 0.25
    assert cfg.model.path == ""


def test_bare_string_override_that_looks_like_a_number() -> None:
    assert RunConfig.load(None, ["--run.run_id=123"]).run.run_id == "123"


@pytest.mark.parametrize(("override", "field", "value", "allowed"), [
    ("rollout.group_size=1", "rollout.group_size", "1", "greater than or equal to 2"),
    ("trainer.lr=0", "trainer.lr", "0", "greater than 0"),
    ("trainer.lr=2.5", "trainer.lr", "2.5", "less than or equal to 1"),
    ("run.steps=0", "run.steps", "0", "greater than or equal to 1"),
    ("rollout.replicas=2000", "rollout.replicas", "2000", "less than or equal to 1024"),
    ("run.mode=fast", "run.mode", "fast", "'laminar', 'sync', 'one_step', 'stream' or 'partial_rollout'"),
    ("rollout.replicas=many", "rollout.replicas", "many", "valid integer"),
])
def test_invalid_value_names_field_value_and_range(override: str, field: str, value: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as exc:
        RunConfig.load(None, [override])
    msg = str(exc.value)
    assert f"{field}={value}" in msg
    assert allowed in msg


def test_message_carries_the_field_description() -> None:
    with pytest.raises(ConfigError, match=r"Samples per prompt \(GRPO group size\)"):
        RunConfig.load(None, ["rollout.group_size=1"])


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as exc:
        RunConfig.load(None, ["rollout.group_size=1", "trainer.lr=0"])
    assert "rollout.group_size=1" in str(exc.value) and "trainer.lr=0" in str(exc.value)


def test_unknown_field_is_named() -> None:
    with pytest.raises(ConfigError) as exc:
        RunConfig.load(None, ["--trainer.lrr=0.1"])
    assert "trainer.lrr=0.1" in str(exc.value)
    assert "unknown field" in str(exc.value)


def test_unknown_section_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[optimizer]\nname = "adam"\n')
    with pytest.raises(ConfigError) as exc:
        RunConfig.load(path)
    assert "optimizer=" in str(exc.value) and "unknown field" in str(exc.value)
    with pytest.raises(ConfigError, match="foo.bar=1"):
        RunConfig.load(None, ["foo.bar=1"])


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as exc:
        RunConfig.load(missing)
    assert str(missing) in str(exc.value) and "does not exist" in str(exc.value)
    assert "examples/tiny.toml" in str(exc.value)


def test_bad_toml_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[trainer\nlr = 0.1\n")
    with pytest.raises(ConfigError) as exc:
        RunConfig.load(path)
    assert str(path) in str(exc.value) and "not valid TOML" in str(exc.value)


def test_config_path_that_is_a_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        RunConfig.load(tmp_path)


@pytest.mark.parametrize("item", ["trainer.lr", "lr=0.1", "--lr=0.1", "--trainer.kee=5"])
def test_malformed_or_abbreviated_override_is_rejected(item: str) -> None:
    with pytest.raises(ConfigError, match="--section.key=value"):
        RunConfig.load(None, [item])


def test_a_section_given_a_scalar_is_rejected() -> None:
    with pytest.raises(ConfigError, match="trainer=5: Input should be a valid dictionary"):
        RunConfig.load(None, ["--trainer=5"])


def test_overrides_become_nested_sections_of_text_merged_over_the_file() -> None:
    assert parse_overrides(["--trainer.keep_last=5", "relay.relays=4", "trainer.keep_last=6"]) == {
        "trainer": {"keep_last": "6"}, "relay": {"relays": "4"}}
    cfg = RunConfig.load(TINY, ["--trainer.keep_last=5"])
    assert cfg.trainer.keep_last == 5 and cfg.trainer.lr == RunConfig.load(TINY).trainer.lr  # siblings kept


@pytest.mark.parametrize(("overrides", "text"), [
    (["model.num_kv_heads=3"], "model.num_heads=4 must be a multiple of model.num_kv_heads=3"),
    (["model.num_heads=8", "model.num_kv_heads=16"], "model.num_heads=8 must be a multiple of model.num_kv_heads=16"),
    (["model.hidden_size=60", "model.num_heads=8", "model.num_kv_heads=2"],
     "model.hidden_size=60 must be a multiple of model.num_heads=8"),
])
def test_head_counts_must_divide(overrides: list[str], text: str) -> None:
    with pytest.raises(ConfigError) as exc:
        RunConfig.load(None, overrides)
    assert text in str(exc.value)


def test_head_counts_that_divide_load() -> None:
    # 96 / 8 = 12 per head; 8 heads / 4 kv heads = 2 queries per kv head
    cfg = RunConfig.load(None, ["model.hidden_size=96", "model.num_heads=8", "model.num_kv_heads=4"])
    assert (cfg.model.hidden_size, cfg.model.num_heads, cfg.model.num_kv_heads) == (96, 8, 4)


@pytest.mark.parametrize("data", [[1, 2], 7, None, "[1, 2]"])
def test_from_json_rejects_non_objects(data: object) -> None:
    with pytest.raises(ConfigError, match="must be a JSON object") as exc:
        RunConfig.from_json(data)
    assert "rollout" in str(exc.value)  # it lists the sections it expects


def test_from_json_rejects_bad_json_text() -> None:
    with pytest.raises(ConfigError, match="not valid JSON"):
        RunConfig.from_json("{not json")


def test_from_json_validates_like_load() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.group_size=1"):
        RunConfig.from_json({"rollout": {"group_size": 1}})


def test_json_round_trip() -> None:
    cfg = RunConfig.load(TINY, ["trainer.lr=0.02", "rollout.replicas=5", "run.run_id=r1"])
    data = cfg.to_json()
    assert RunConfig.from_json(data) == cfg
    # through text too, as `temporal workflow start --input` sends it
    assert RunConfig.from_json(json.dumps(data)) == cfg
    assert RunConfig.from_json(json.loads(json.dumps(data))) == cfg


def test_with_run_id_changes_only_the_id() -> None:
    cfg = RunConfig.load(TINY)
    named = cfg.with_run_id("run-7")
    assert named.run.run_id == "run-7" and cfg.run.run_id == ""
    assert named.model_copy(update={"run": cfg.run}) == cfg


def test_config_is_frozen() -> None:
    cfg = RunConfig()
    with pytest.raises(ValueError):
        cfg.trainer.lr = 0.5  # type: ignore[misc]


def test_eval_during_training_is_accepted_and_bad_values_are_named():
    """eval.every_steps/at_start/at_end run eval rounds on the replicas (workflows/evaluation.py); a value out of
    range, a round too large for the workflow's state, or an engine without an eval engine is refused with the
    field, the value and the fix."""
    from laminar.errors import ConfigError
    from laminar.rl.factory import check_engines

    for override in ("eval.every_steps=10", "eval.at_start=true", "eval.at_end=true"):
        assert check_engines(RunConfig.load(None, [override, "rollout.engine=torch"]))
    with pytest.raises(ConfigError, match="every_steps"):
        RunConfig.load(None, ["eval.every_steps=-1"])
    with pytest.raises(ConfigError, match=r"eval.size \* eval.samples = 100 \* 100 = 10000.*laminar eval"):
        RunConfig.load(None, ["eval.at_end=true", "eval.size=100", "eval.samples=100"])
    assert RunConfig.load(None, ["eval.size=100", "eval.samples=100"]).eval.samples == 100, "afterwards: no bound"
    with pytest.raises(ConfigError, match="eval.at_start with rollout.engine='modelled'.*rollout.engine = 'torch'"):
        check_engines(RunConfig.load(None, ["eval.at_start=true", "rollout.engine=modelled",
                                            "trainer.engine=modelled"]))
    assert RunConfig.load(None, ["eval.samples=4"]).eval.samples == 4


def test_a_checkpoint_interval_whose_batches_cannot_cross_temporal_is_refused_with_the_interval_that_fits() -> None:
    with pytest.raises(ConfigError) as e:
        RunConfig.load(None, ["trainer.checkpoint_every=5000", "trainer.groups_per_step=4"])
    msg = str(e.value)
    assert "trainer.checkpoint_every=5000" in msg and "trainer.keep_last=3" in msg and "2,097,152" in msg
    fits = int(msg.split("set trainer.checkpoint_every to at most ")[1].split(" ")[0])
    RunConfig.load(None, [f"trainer.checkpoint_every={fits}", "trainer.groups_per_step=4"])  # the fix loads
    with pytest.raises(ConfigError):
        RunConfig.load(None, [f"trainer.checkpoint_every={fits + 10}", "trainer.groups_per_step=4"])


def test_laminar_run_warns_when_a_step_input_may_pass_the_servers_warning_size() -> None:
    from structlog.testing import capture_logs

    from laminar.cli.run import warn_large_payloads

    with capture_logs() as logs:
        assert warn_large_payloads(RunConfig.load(None, [])) < 256 * 1024  # the defaults stay small
    assert not [e for e in logs if e["event"] == "large_train_step_payloads"]
    with capture_logs() as logs:
        assert warn_large_payloads(RunConfig.load(None, ["trainer.checkpoint_every=1000"])) > 256 * 1024
    (warning,) = [e for e in logs if e["event"] == "large_train_step_payloads"]
    assert warning["checkpoint_every"] == 1000 and "trainer.checkpoint_every" in warning["fix"]


def test_a_quota_above_the_ask_is_refused_naming_both_fields() -> None:
    with pytest.raises(ConfigError, match=r"rollout.quota=3 is above rollout.replicas=2.*set rollout.quota <= 2"):
        RunConfig.load(None, ["rollout.replicas=2", "rollout.quota=3"])
    with pytest.raises(ConfigError, match=r"rollout.quota=-1"):
        RunConfig.load(None, ["rollout.quota=-1"])
