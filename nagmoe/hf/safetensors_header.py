"""A `model.safetensors` file's header, read and checked without mapping or loading any tensor data.

The format: 8 bytes (little-endian u64) N, then N bytes of JSON `{name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {...}}`, then the data; offsets count from the end of the header. Everything an
importer needs to refuse a file (names, dtypes, shapes, the byte ranges against the file's size) is here, so a
file whose header is self-consistent but describes 4 GiB of tensors the config never asked for is refused
before a byte of it is mapped. Every value shown in a message goes through `errors.shown`."""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

from nagmoe.base.errors import UserError, shown

MAX_HEADER_BYTES = 16 << 20  # ~100 bytes per tensor: room for 150,000 tensors (an export has ~20 per layer)
# dtype name -> bytes per element (the importer decides which dtype each tensor may have)
DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
               "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: str) -> dict[str, TensorEntry]:
    """{name: TensorEntry} of the file at `path`; a UserError naming the file for any malformed header, an
    unknown dtype, a byte range outside the file or not matching dtype x shape, or ranges that overlap or leave
    holes (as the safetensors library requires)."""
    where = shown(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise UserError(f"{where}: not a safetensors file ({size} bytes, shorter than its header length)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise UserError(f"{where}: not a safetensors file (a header of {n:,} bytes in a file of "
                                f"{size:,} bytes; at most {MAX_HEADER_BYTES:,})")
            raw = f.read(n)
    except OSError as e:
        raise UserError(f"{where}: cannot read it ({e.strerror or type(e).__name__})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, RecursionError, ValueError):
        raise UserError(f"{where}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise UserError(f"{where}: not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    entries = {name: _entry(name, spec, where) for name, spec in header.items()}
    _check_ranges(entries, size - 8 - n, where)
    return entries


def _entry(name: str, spec, where: str) -> TensorEntry:
    if not isinstance(spec, dict):
        raise UserError(f"{where}: tensor {shown(name)} has no dtype/shape/data_offsets entry")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise UserError(f"{where}: tensor {shown(name)} has an unknown dtype {shown(dtype, 40)}")
    if not isinstance(shape, list) or len(shape) > 8 or not all(_count(d) for d in shape):
        raise UserError(f"{where}: tensor {shown(name)} has a malformed shape {shown(shape, 80)}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets)
            or offsets[0] > offsets[1]):
        raise UserError(f"{where}: tensor {shown(name)} has malformed data_offsets {shown(offsets, 80)}")
    entry = TensorEntry(dtype, tuple(shape), offsets[0], offsets[1])
    if entry.end - entry.begin != entry.numel * DTYPE_BYTES[dtype]:
        raise UserError(f"{where}: tensor {shown(name)} spans {entry.end - entry.begin:,} bytes, its shape "
                        f"{shown(entry.shape, 80)} and dtype {dtype} need {entry.numel * DTYPE_BYTES[dtype]:,}")
    return entry


def _count(v) -> bool:
    """A non-negative integer below 2**62 (JSON may carry bools, floats or 5,000-digit integers)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2 ** 62


def _check_ranges(entries: dict[str, TensorEntry], data_bytes: int, where: str) -> None:
    at = 0
    for name, e in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if e.begin != at:
            raise UserError(f"{where}: tensor {shown(name)} starts at byte {e.begin:,} of the data, expected "
                            f"{at:,} (overlapping or with a hole)")
        at = e.end
    if at != data_bytes:
        raise UserError(f"{where}: the tensors cover {at:,} bytes, the file holds {data_bytes:,} after its header")


def total_elements(entries: dict[str, TensorEntry]) -> int:
    return sum(e.numel for e in entries.values())
