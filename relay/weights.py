"""Tensors straight out of a relay buffer: parse a safetensors file in place, never copy, never unpickle.

Safetensors layout: 8-byte little-endian header length N, an N-byte JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data; offsets
are relative to the start of the data. The tensors returned are views of the buffer (read-only when
the buffer is, e.g. a shared-memory pull); the engine copies them into its own parameters.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
import warnings
from typing import TYPE_CHECKING

import torch

from laminar.errors import RelayError

if TYPE_CHECKING:
    from laminar.relay.client import LocalPull

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)

MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own bound on the JSON header


def load_into(params: dict[str, torch.Tensor], pulled: LocalPull) -> int:
    """Copy every tensor of a local pull straight into `params` (contiguous CPU tensors of the same
    names, dtypes and shapes) with one copy each (LocalPull.readinto); returns the bytes copied."""
    copied = 0
    for name, dtype, shape, begin, end in _layout(pulled.buffer):
        dest = params.get(name)
        if dest is None or dest.dtype != dtype or tuple(dest.shape) != tuple(shape):
            raise RelayError(f"tensor {name!r} ({dtype}, {tuple(shape)}) has no matching parameter "
                             f"({None if dest is None else (dest.dtype, tuple(dest.shape))})")
        if dest.device.type != "cpu" or not dest.is_contiguous():
            raise RelayError(f"parameter {name!r} must be a contiguous CPU tensor to load from shared memory")
        if end > begin:
            target = (ctypes.c_ubyte * (end - begin)).from_address(dest.data_ptr())
            pulled.readinto(memoryview(target).cast("B"), begin)
        copied += end - begin
    return copied


def state_dict_from_buffer(buf: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """{name: tensor} viewing `buf` (a safetensors file) without copying; RelayError if malformed."""
    view = memoryview(buf).cast("B")
    tensors: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for name, dtype, shape, begin, end in _layout(view):
            if end == begin:
                tensors[name] = torch.empty(shape, dtype=dtype)
            else:
                count = math.prod(shape)
                tensors[name] = torch.frombuffer(view, dtype=dtype, count=count, offset=begin).view(shape)
    return tensors


def _layout(buf: memoryview) -> list[tuple[str, torch.dtype, list[int], int, int]]:
    """(name, dtype, shape, begin, end) of every tensor, offsets absolute in `buf`; RelayError if malformed."""
    view = memoryview(buf).cast("B")
    if len(view) < 8:
        raise RelayError(f"weights buffer of {len(view)} bytes is too short for a safetensors header")
    (header_len,) = struct.unpack("<Q", view[:8])
    if header_len > min(MAX_HEADER_BYTES, len(view) - 8):
        raise RelayError(f"safetensors header length {header_len} does not fit a {len(view)}-byte buffer")
    try:
        header = json.loads(bytes(view[8:8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RelayError(f"safetensors header is not valid UTF-8 JSON ({exc})") from None
    if not isinstance(header, dict):
        raise RelayError(f"safetensors header is a JSON {type(header).__name__}, expected an object")
    base = 8 + header_len
    data_len = len(view) - base
    return [_entry(base, data_len, name, info) for name, info in header.items() if name != "__metadata__"]


def _entry(base: int, data_len: int, name: str, info: object) -> tuple[str, torch.dtype, list[int], int, int]:
    if not isinstance(info, dict):
        raise RelayError(f"safetensors entry {name!r} is not an object")
    dtype = _DTYPES.get(info.get("dtype"))
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if dtype is None:
        raise RelayError(f"safetensors tensor {name!r}: dtype {info.get('dtype')!r} is not supported")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise RelayError(f"safetensors tensor {name!r}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise RelayError(f"safetensors tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    count = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not 0 <= begin <= end <= data_len or end - begin != count * itemsize:
        raise RelayError(f"safetensors tensor {name!r}: data_offsets {offsets} do not hold {count} x "
                         f"{itemsize}-byte elements within {data_len} data bytes")
    return name, dtype, shape, base + begin, base + end
