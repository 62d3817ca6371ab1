"""Generated reference pages: an MkDocs hook (mkdocs.yml `hooks:`), so `mkdocs build` regenerates them from the code
every time and they cannot go stale.

A page asks for a generated block with a marker line, `<!-- laminar:NAME -->`; the hook replaces it:

- `config`: every section and field of the run config (`laminar/config.py`): type, default, range, description.
- `cli`: every command of the Typer app (CLI_APP): usage, arguments, options, their help and defaults.
- `summary`: every key `laminar run --summary` writes (`reporting/summary.py`), with its meaning (SUMMARY_MEANINGS).
- `metrics`: every Prometheus metric of `laminar/metrics.py`: name, type, labels, what it measures.

The build fails (strict or not) on an unknown marker, a config field without a description, a summary key without a
meaning (or a meaning of a key the code no longer writes), or a metric missing from the table in laminar/metrics.py's
docstring. `python docs/hooks/reference.py NAME` prints one block, for a look without building the site.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# The Typer app the CLI reference is generated from, as "module:attribute". Empty: the module of pyproject.toml's
# `laminar` script with the attribute `app` (so moving the CLI, e.g. to cli.main:app, needs no change here).
CLI_APP = ""

MARKER = re.compile(r"^<!-- laminar:([a-z-]+) -->$", re.MULTILINE)


class StaleReference(Exception):
    """The code and its reference disagree: the build must fail."""


def _on_path() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def _cell(text: Any) -> str:
    """Text for one markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


# ------------------------------------------------------------------------------------------------ config

def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{json.dumps(a)}`" for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a).strip("`") for a in typing.get_args(annotation))
        return f"`{getattr(origin, '__name__', str(origin))}[{args}]`"
    return f"`{getattr(annotation, '__name__', str(annotation))}`"


def _range(field: Any) -> str:
    bounds = {}
    for m in field.metadata:
        for key in ("ge", "gt", "le", "lt", "min_length", "max_length"):
            if getattr(m, key, None) is not None:
                bounds[key] = getattr(m, key)
    parts = []
    low = ("≥", bounds["ge"]) if "ge" in bounds else (">", bounds["gt"]) if "gt" in bounds else None
    high = ("≤", bounds["le"]) if "le" in bounds else ("<", bounds["lt"]) if "lt" in bounds else None
    if low:
        parts.append(f"{low[0]} {low[1]:,}" if isinstance(low[1], int) else f"{low[0]} {low[1]}")
    if high:
        parts.append(f"{high[0]} {high[1]:,}" if isinstance(high[1], int) else f"{high[0]} {high[1]}")
    if "min_length" in bounds or "max_length" in bounds:
        parts.append(f"length {bounds.get('min_length', 0)}..{bounds.get('max_length', '')}")
    return ", ".join(parts)


def _default(field: Any) -> str:
    value = field.default_factory() if field.default_factory is not None else field.default
    return f"`{json.dumps(value)}`"


def missing_descriptions(config: Any = None) -> list[str]:
    """Config sections without a docstring and fields without a description (`section.field`); config: a model of
    sections like RunConfig (the default)."""
    _on_path()
    if config is None:
        from laminar.config import RunConfig as config

    missing = []
    for name, section in config.model_fields.items():
        cls = section.annotation
        if not (cls.__doc__ or "").strip():
            missing.append(f"[{name}] (a docstring on {cls.__name__})")
        missing += [f"{name}.{f}" for f, info in cls.model_fields.items() if not (info.description or "").strip()]
    return missing


def config_reference() -> str:
    _on_path()
    from laminar.config import RunConfig

    if missing := missing_descriptions():
        raise StaleReference(f"laminar/config.py: no description for {', '.join(missing)}")
    out = []
    for name, section in RunConfig.model_fields.items():
        cls = section.annotation
        out += [f"## `[{name}]`", "", " ".join(cls.__doc__.split()), "",
                "| field | type | default | range | description |", "| --- | --- | --- | --- | --- |"]
        for fname, info in cls.model_fields.items():
            out.append(f"| `{name}.{fname}` | {_type_name(info.annotation)} | {_cell(_default(info))} | "
                       f"{_cell(_range(info))} | {_cell(info.description)} |")
        out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ CLI

def cli_app_path() -> str:
    if CLI_APP:
        return CLI_APP
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    return scripts["laminar"].split(":")[0] + ":app"


def _load_app() -> Any:
    _on_path()
    import importlib

    module, attr = cli_app_path().split(":")
    return getattr(importlib.import_module(module), attr)


SKIPPED_OPTIONS = ("--help", "--install-completion", "--show-completion")  # the same on every command; shell set-up


def cli_reference() -> str:
    import typer

    root = typer.main.get_command(_load_app())
    context_class = root.context_class
    out: list[str] = []

    def render(cmd: Any, path: list[str], parent: Any, level: int) -> None:
        ctx = context_class(cmd, info_name=path[-1], parent=parent)
        subcommands = getattr(cmd, "commands", None)
        if len(path) > 1:
            out.extend([f"{'#' * level} `{' '.join(path)}`", ""])
        if cmd.help:
            out.extend([cmd.help.strip(), ""])
        out.extend(["```", cmd.get_usage(ctx).strip(), "```", ""])
        rows = [p.get_help_record(ctx) for p in cmd.get_params(ctx)]
        rows = [r for r in rows if r is not None and r[0].split()[0] not in SKIPPED_OPTIONS]
        if rows:
            out.extend(["| argument or option | what |", "| --- | --- |"])
            out.extend(f"| `{_cell(opt)}` | {_cell(text)} |" for opt, text in rows)
            out.append("")
        if subcommands:
            for name in sorted(cmd.list_commands(ctx)):
                sub = cmd.get_command(ctx, name)
                if sub is not None and not sub.hidden:
                    render(sub, path + [name], ctx, min(level + 1, 4) if len(path) > 1 else 2)

    render(root, ["laminar"], None, 2)
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ summary

# What each key of `laminar run --summary PATH` means. The hook fails the build when reporting/summary.py writes a
# key that is not here, or a key here is no longer written.
SUMMARY_MEANINGS: dict[str, str] = {
    "run_id": "the run's id",
    "steps": "trainer steps",
    "reward_per_step": "mean reward of each step's batch",
    "response_len_p50": "median response length of all consumed trajectories (tokens)",
    "response_len_p99": "99th percentile response length of all consumed trajectories (tokens)",
    "tokens_per_s": "response tokens consumed by the trainer per second of run wall time",
    "wall_s": "run wall time from workflow start to result (s)",
    "staleness_histogram": "trainer version minus sample version -> samples",
    "max_versions_in_use": "most distinct policy versions held by rollout replicas at one moment",
    "trainer_wait_fraction": "share of trainer wall time spent waiting for complete groups",
    "groups_generated": "groups the replicas generated (exactly-once accounting)",
    "groups_consumed": "groups the trainer consumed",
    "groups_consumed_twice": "groups the trainer consumed twice (must be 0)",
    "dropped_stale": "samples dropped as staler than the mode's bound",
    "groups_failed": "groups dropped after `task.max_group_retries` failed retries (never trained on; see "
                     "[Tasks](../guides/tasks.md))",
    "groups_failed_recent_reasons": "the reasons of the last 20 failed groups, counted",
    "staleness_max": "the staleness histogram's largest gap",
    "reprefill_tokens": "prompt + prefix tokens prefilled again: partial-rollout interrupts and repack migrations",
    "repacks": "dynamic repack: migrations carried out",
    "repack_groups": "dynamic repack: groups the migrations moved",
    "repack_overhead_s_mean": "dynamic repack: mean wall s per migration (source stop + write, destination read + "
                              "admit); null without a migration",
    "checkpoints": "refs of the committed checkpoints kept",
    "temporal_history_events_max": "largest history of one run segment (continue-as-new bounds it)",
    "continued_as_new": "history segments after the first (`run.history_events_per_segment`, "
                        "`run.updates_per_segment`, or the server's suggestion)",
    "handover_stall_s": "`count`, `p50`, `max`: trainer idle from the last step of a segment to the first step of "
                        "the next",
    "step_wall_s_p50": "median wall time of one `train_step` in the trainer (s)",
    "clip_fraction_mean": "share of response tokens whose PPO clip was active, mean over the steps that updated",
    "is_weight_mean": "importance weight w = pi_trainer / pi_behaviour per token (trainer = its weights at the start "
                      "of the step, before any cap): mean of the per-step means",
    "is_weight_max": "the largest per-step importance weight",
    "is_capped_fraction_mean": "share of tokens with w above `trainer.tis_cap` (truncated by `tis`, dropped by "
                               "`decoupled`)",
    "kl_behaviour_mean": "KL(behaviour || trainer) per token, k3 estimator (w - 1) - log w over the sampled tokens: "
                         "mean per-step value",
    "kl_behaviour_max": "the largest per-step KL(behaviour || trainer)",
    "tool_calls_per_trajectory": "tool calls per trained trajectory ([Tools](../guides/tools.md))",
    "multi_turn_share": "share of trained trajectories with two or more model turns",
    "tool_latency_s": "`calls`, `p50`, `max`: tool call latency (s)",
    "tracker_skipped": "writes a failing experiment tracker dropped, per tracker, as of the last step",
    "tracker_missing": "steps a tracker never received (ranges, per tracker), from the last step's tracker stats",
    "evals": "held-out evals recorded so far (`laminar eval`, and eval rounds during training): policy version, "
             "accuracy, its standard error, prompts, samples, pass@k, failed samples, whether it ran during training",
    "eval_rounds_pending": "eval rounds during training not closed yet: policy version -> prompts not scored",
    "step_end_s": "seconds from the run's start to the end of each step (time to reward)",
    "profile": "where the time went: rollout and trainer buckets, CPU seconds per process "
               "([the run profile](../benchmarks/make-run.md#where-the-time-goes-the-run-profile))",
}


def _dict_keys(node: ast.AST, functions: dict[str, ast.FunctionDef]) -> list[str]:
    """String keys of a dict display, following `**helper(...)` into the helper's returned dict and
    `**({...} if ... else {})` into both branches."""
    if isinstance(node, ast.IfExp):
        return _dict_keys(node.body, functions) + _dict_keys(node.orelse, functions)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions:
        return _returned_keys(functions[node.func.id], functions)
    if not isinstance(node, ast.Dict):
        return []
    keys = []
    for key, value in zip(node.keys, node.values, strict=True):
        if key is None:
            keys += _dict_keys(value, functions)
        elif isinstance(key, ast.Constant) and isinstance(key.value, str):
            keys.append(key.value)
    return keys


def _returned_keys(fn: ast.FunctionDef, functions: dict[str, ast.FunctionDef]) -> list[str]:
    keys: list[str] = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Return) and node.value is not None:
            keys += [k for k in _dict_keys(node.value, functions) if k not in keys]
    return keys


def summary_keys() -> list[str]:
    """The keys `build_summary` (reporting/summary.py) returns, in its order, read from the source."""
    tree = ast.parse((ROOT / "reporting" / "summary.py").read_text())
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    return _returned_keys(functions["build_summary"], functions)


def summary_reference() -> str:
    keys = summary_keys()
    if missing := [k for k in keys if k not in SUMMARY_MEANINGS]:
        raise StaleReference(f"reporting/summary.py writes {missing}: add their meaning to SUMMARY_MEANINGS in "
                             f"docs/hooks/reference.py")
    if gone := [k for k in SUMMARY_MEANINGS if k not in keys]:
        raise StaleReference(f"SUMMARY_MEANINGS in docs/hooks/reference.py explains {gone}, which "
                             f"reporting/summary.py no longer writes")
    rows = [f"| `{k}` | {_cell(SUMMARY_MEANINGS[k])} |" for k in keys]
    return "\n".join(["| key | meaning |", "| --- | --- |", *rows, ""])


# ------------------------------------------------------------------------------------------------ metrics

def _docstring_table(doc: str) -> dict[str, str]:
    """`| name | type | labels | what |` rows of a module docstring: name -> what."""
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("laminar_"):
            rows[cells[0]] = cells[3]
    return rows


def metrics_reference() -> str:
    _on_path()
    from prometheus_client.metrics import MetricWrapperBase

    import laminar.metrics as metrics

    documented = _docstring_table(metrics.__doc__ or "")
    rows, names = [], []
    for obj in vars(metrics).values():
        if not isinstance(obj, MetricWrapperBase) or obj._type == "info":
            continue
        name = obj._name + ("_total" if obj._type == "counter" else "")
        names.append(name)
        what = documented.get(name) or obj._documentation
        rows.append(f"| `{name}` | {obj._type} | {', '.join(obj._labelnames)} | {_cell(what)} |")
    if missing := [n for n in names if n not in documented]:
        raise StaleReference(f"laminar/metrics.py defines {missing}, which its docstring's table does not list")
    if gone := [n for n in documented if n not in names]:
        raise StaleReference(f"laminar/metrics.py's docstring lists {gone}, which it no longer defines")
    return "\n".join(["| metric | type | labels | what |", "| --- | --- | --- | --- |", *rows, ""])


# ------------------------------------------------------------------------------------------------ the hook

GENERATORS = {"config": config_reference, "cli": cli_reference, "summary": summary_reference,
              "metrics": metrics_reference}


def render(markdown: str, where: str = "") -> str:
    def block(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise StaleReference(f"{where}: unknown generated block {name!r} (known: {sorted(GENERATORS)})")
        return GENERATORS[name]()

    return MARKER.sub(block, markdown)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """MkDocs event: fill every `<!-- laminar:NAME -->` marker of the page."""
    from mkdocs.exceptions import PluginError

    try:
        return render(markdown, page.file.src_uri)
    except StaleReference as e:
        raise PluginError(str(e)) from None


if __name__ == "__main__":
    print(GENERATORS[sys.argv[1]]())
