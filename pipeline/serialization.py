"""State <-> (JSON, tensors) without pickle, and safetensors files hashed as they are written.

Any nested state (an optimizer's ``state_dict()``, RNG states, sampler progress) is split
into a JSON tree and a flat ``{name: tensor}`` table. Tensors and NumPy arrays become
references into the table; tuples and dicts with non-string keys get small markers so the
round trip is exact (``betas`` comes back as a tuple, optimizer state keys as ints).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from safetensors.torch import _remove_duplicate_names

from .hashing import HashingWriter

__all__ = [
    "split_state",
    "join_state",
    "write_safetensors",
    "dedupe_shared_tensors",
    "SAFETENSORS_DTYPES",
]

_TENSOR = "__tensor__"
_NDARRAY = "__ndarray__"
_TUPLE = "__tuple__"
_DICT = "__dict__"
_MARKERS = (_TENSOR, _NDARRAY, _TUPLE, _DICT)

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def split_state(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Return a JSON-able tree for ``obj``; tensors found in it are added to ``tensors``.

    Tensor names are the path to them (``optimizer/state/0/exp_avg``), so a saved file is
    readable by eye with plain ``safetensors``.
    """
    if isinstance(obj, torch.Tensor):
        if prefix in tensors:
            raise ValueError(f"two state entries map to the tensor name {prefix!r}")
        tensors[prefix] = obj.detach()
        return {_TENSOR: prefix}
    if isinstance(obj, np.ndarray):
        raw = np.ascontiguousarray(obj)
        tensors[prefix] = torch.from_numpy(raw.reshape(-1).view(np.uint8).copy())
        return {_NDARRAY: prefix, "dtype": raw.dtype.str, "shape": list(raw.shape)}
    if isinstance(obj, np.generic):
        return split_state(obj.item(), prefix, tensors)
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and k not in _MARKERS for k in obj):
            return {k: split_state(v, f"{prefix}/{k}", tensors) for k, v in obj.items()}
        return {_DICT: [[split_state(k, f"{prefix}/key{i}", tensors), split_state(v, f"{prefix}/{k}", tensors)]
                        for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, tuple):
        return {_TUPLE: [split_state(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [split_state(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        # JSON has no inf/nan; Python's json writes them anyway and reads them back exactly.
        return obj
    raise TypeError(f"cannot save {type(obj).__name__} at {prefix!r}: only tensors, arrays, numbers, "
                    "strings, lists, tuples and dicts are stored (no pickle)")


def join_state(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_state`. Missing tensors raise ``KeyError`` naming them."""
    if isinstance(tree, dict):
        if _TENSOR in tree:
            return tensors[tree[_TENSOR]]
        if _NDARRAY in tree:
            raw = tensors[tree[_NDARRAY]].numpy().tobytes()
            return np.frombuffer(raw, dtype=np.dtype(tree["dtype"])).reshape(tree["shape"]).copy()
        if _TUPLE in tree:
            return tuple(join_state(v, tensors) for v in tree[_TUPLE])
        if _DICT in tree:
            return {_hashable(join_state(k, tensors)): join_state(v, tensors) for k, v in tree[_DICT]}
        return {k: join_state(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [join_state(v, tensors) for v in tree]
    return tree


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def dedupe_shared_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep one name per shared storage (tied weights), the way ``safetensors.torch.save_model`` does.

    Using safetensors' own choice of the kept name means ``safetensors.torch.load_model``
    (strict) loads our file into a fresh model with no project code.
    """
    state_dict = dict(state_dict)
    for kept, removed in _remove_duplicate_names(state_dict).items():
        for name in removed:
            del state_dict[name]
        assert kept in state_dict
    return state_dict


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def write_safetensors(path: str | Path, tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str] | None = None) -> tuple[str, int]:
    """Write a safetensors file tensor by tensor, hashing as bytes go to disk; fsync; return (sha256, size).

    Streaming avoids ``safetensors.torch.save``'s full in-memory copy of the file. The
    layout is the standard one (8-byte little-endian header length, JSON header padded to
    8 bytes, then the tensors back to back), so any safetensors reader loads it.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    ordered = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name]
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        ordered.append(tensor)
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    with HashingWriter(path) as out:
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        for tensor in ordered:
            out.write(_tensor_bytes(tensor))
    assert out.size == 8 + len(encoded) + offset
    return out.sha256, out.size

