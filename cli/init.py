"""`laminar init [DIR]`: a starter run config and a prompts file to edit (laminar/defaults/starter.toml).

Writes DIR/laminar.toml (the file task, the tiny model) and DIR/prompts.jsonl (copy-the-words prompts with their
answers, one JSON object a line: the columns of envs/tasks/prompt_file.py). The config names the prompts file by its
absolute path, so `laminar run DIR/laminar.toml` works from any directory. Existing files are kept unless --force.
"""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

import typer
from rich.console import Console

from laminar.errors import ConfigError

console = Console()
err = Console(stderr=True)
CONFIG_NAME = "laminar.toml"
PROMPTS_NAME = "prompts.jsonl"
PROMPTS_LINE = 'prompts = "prompts.jsonl"'  # the line of starter.toml that init points at the written file
WORDS = ("red", "green", "blue", "black", "white", "grey", "gold", "pink")


def starter_prompts(rows: int = 64, seed: int = 0) -> list[dict]:
    """Copy the words after "copy :": an exact-match task the tiny model learns in a few minutes on CPU."""
    rng = random.Random(seed)
    out = []
    for i in range(rows):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
        out.append({"id": f"copy-{i:03d}", "prompt": f"copy : {words}", "answer": words})
    return out


def starter_config(prompts: Path) -> str:
    text = resources.files("laminar").joinpath("defaults", "starter.toml").read_text()
    if PROMPTS_LINE not in text:
        raise ConfigError(f"the packaged starter config has no line {PROMPTS_LINE!r}")  # a broken package
    return text.replace(PROMPTS_LINE, f"prompts = {json.dumps(str(prompts))}", 1)


def write_starter(directory: Path, force: bool = False) -> tuple[Path, Path]:
    """Write DIR/laminar.toml and DIR/prompts.jsonl; ConfigError when either exists (unless force)."""
    directory = directory.expanduser().resolve()
    config, prompts = directory / CONFIG_NAME, directory / PROMPTS_NAME
    existing = [str(p) for p in (config, prompts) if p.exists()]
    if existing and not force:
        raise ConfigError(f"{' and '.join(existing)} already exist; edit them, pick another directory, or pass "
                          "--force to overwrite")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        prompts.write_text("".join(json.dumps(row) + "\n" for row in starter_prompts()))
        config.write_text(starter_config(prompts))
    except OSError as e:
        raise ConfigError(f"cannot write the starter files in {directory} ({e.strerror}); pick a writable "
                          "directory") from None
    return config, prompts


def init_command(
    directory: Path = typer.Argument(Path("."), help="Directory to write laminar.toml and prompts.jsonl in "
                                     "(created if missing)."),
    force: bool = typer.Option(False, "--force", help="Overwrite laminar.toml and prompts.jsonl if they exist."),
) -> None:
    """Write a starter run config (laminar.toml) and a prompts file (prompts.jsonl) to edit, then `laminar run` it."""
    try:
        config, prompts = write_starter(directory, force)
    except ConfigError as e:
        err.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
        raise typer.Exit(2) from None
    console.print(f"wrote {config}\nwrote {prompts}\nedit them, then: laminar run {config}", highlight=False,
                  soft_wrap=True)
