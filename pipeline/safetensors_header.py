"""THE strict safetensors header parser, with no torch imported: the checkpoint reader
(:mod:`pipeline.checkpoint.tensorfile`) views tensors through it, and the leak scan
(:mod:`pipeline.leaks`), which runs on the torch-free publish side, reads weights files'
headers with it.

:func:`parse_header` refuses what safetensors' own reader refuses (header over 100 MB or
past the end, not starting with ``{``, not UTF-8 JSON, non-string ``__metadata__``
values, unknown dtypes, sizes that overflow, offsets that disagree with dtype and shape,
tensors that do not tile the data from byte 0 to the end) and also a key twice (after
decoding escapes), a tensor named ``__metadata__``, a tensor name that is not printable
ASCII (:func:`check_tensor_name`), booleans or floats as offsets or dims, extra fields,
and nesting too deep. Every refusal is a ``ValueError`` naming the rule.
"""

from __future__ import annotations

import math
from typing import Any

from .durable import json_loads_strict

__all__ = ["DTYPE_SIZES", "MAX_HEADER", "check_tensor_name", "header_span", "parse_header"]

# The reference implementation's bound: a larger header is not a safetensors file.
MAX_HEADER = 100 * 1024 * 1024
# Bytes per element of each dtype the project reads and writes (tensorfile maps them to torch's).
DTYPE_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
# A tensor's byte count must fit a signed 64-bit size (torch's and the reference's bound).
_MAX_BYTES = 2**63 - 1
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})


def header_span(first: bytes | bytearray | memoryview, size: int) -> int | None:
    """Where the JSON header of a file of ``size`` bytes starting with ``first`` (8 bytes
    or more) ends, if the file is shaped like safetensors (a length in bounds, then ``{``);
    else None. Says nothing about whether the header is valid: :func:`parse_header` does."""
    if len(first) < 9 or size < 10:
        return None
    length = int.from_bytes(first[:8], "little")
    if not 2 <= length <= min(MAX_HEADER, size - 8) or first[8:9] != b"{":
        return None
    return 8 + length


def parse_header(buffer: Any, *, size: int | None = None) -> tuple[dict[str, Any], int]:
    """(header dict, offset of the first data byte), every rule of the module docstring
    checked; ``ValueError`` naming the rule otherwise. ``header["__metadata__"]``, if present,
    maps str to str; every other entry is a tensor whose dtype, shape and offsets agree.
    ``buffer`` (bytes, a map): the file, or its first bytes (length and header) with
    ``size`` the file's."""
    size = len(buffer) if size is None else size
    if size < 8:
        raise ValueError("shorter than the 8-byte header length")
    length = int.from_bytes(buffer[:8], "little")
    if length > MAX_HEADER:
        raise ValueError(f"header length {length} is over the {MAX_HEADER}-byte limit")
    if length > size - 8:
        raise ValueError(f"header length {length} runs past the end of the file")
    raw = bytes(buffer[8 : 8 + length])
    if not raw.startswith(b"{"):
        raise ValueError("the header does not start with '{'")
    try:
        header = json_loads_strict(raw)
    except ValueError as exc:
        raise ValueError(f"the header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    metadata = header.get("__metadata__")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(value, str) for value in metadata.values())
    ):
        raise ValueError("__metadata__ must map strings to strings (no tensor may be named __metadata__)")
    spans = []
    for name, entry in header.items():
        if name != "__metadata__":
            check_tensor_name(name)
            spans.append((*_check_entry(name, entry), name))
    position, data_size = 0, size - 8 - length
    for begin, end, name in sorted(spans):
        if begin != position:
            what = (
                "overlaps the tensor before it"
                if begin < position
                else ("leaves a hole before it" if position else "does not start the data at byte 0")
            )
            raise ValueError(f"tensor {name!r} at data bytes {begin}..{end} {what}")
        position = end
    if position != data_size:
        what = "trailing bytes after the last tensor" if position < data_size else "tensors run past the end"
        raise ValueError(f"{what} (tensors end at data byte {position}, the file holds {data_size})")
    return header, 8 + length


def check_tensor_name(name: str) -> None:
    """A tensor name is non-empty printable ASCII (space to ``~``): no control, invisible or
    bidirectional character can make a published name read as another. ``ValueError`` else."""
    if not name or not all(" " <= char <= "~" for char in name):
        raise ValueError(
            f"tensor name {name!r} is not printable ASCII (letters, digits, punctuation, spaces)"
        )


def _check_entry(name: str, entry: Any) -> tuple[int, int]:
    """A tensor entry's (begin, end) data offsets, once its dtype, shape and size agree."""
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        raise ValueError(f"tensor {name!r} must have exactly dtype, shape and data_offsets")
    itemsize = DTYPE_SIZES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if itemsize is None:
        raise ValueError(f"tensor {name!r} has unknown dtype {entry['dtype']!r}")
    shape, offsets = entry["shape"], entry["data_offsets"]
    # type() is int: JSON true/false decode to bools, which are ints to isinstance.
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"tensor {name!r}: shape must be a list of non-negative integers, not {shape!r}")
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
    ):
        raise ValueError(f"tensor {name!r}: data_offsets must be two non-negative integers, not {offsets!r}")
    # Zero dims make the tensor empty, but the others must still fit: [0, 2**62, 4] is not a shape.
    bound = itemsize
    for dim in shape:
        bound *= max(dim, 1)
        if bound > _MAX_BYTES:
            raise ValueError(f"tensor {name!r}: shape {shape} overflows a 64-bit size")
    begin, end = offsets
    nbytes = math.prod(shape) * itemsize
    if end < begin or end - begin != nbytes:
        raise ValueError(
            f"tensor {name!r}: data offsets {offsets} do not hold a {entry['dtype']} tensor of "
            f"shape {shape} ({nbytes} bytes)"
        )
    return begin, end
