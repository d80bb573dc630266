"""Nested state <-> (JSON tree, flat tensor table), exactly and without pickle.

Any nested state (an optimizer's ``state_dict()``, RNG states, sampler progress) is split
into a JSON tree and a flat ``{name: tensor}`` table. Tensors and NumPy arrays become
references into the table; tuples and dicts with non-string keys get small markers so the
round trip is exact (``betas`` comes back as a tuple, optimizer state keys as ints).
Non-finite floats (a scheduler's ``best = inf``) get a marker too, so the tree is strict
JSON and ``meta.json`` can be sealed by a digest of its canonical form.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import torch

__all__ = ["split_state", "join_state"]

_TENSOR = "__tensor__"
_NDARRAY = "__ndarray__"
_TUPLE = "__tuple__"
_DICT = "__dict__"
_FLOAT = "__float__"
_MARKERS = (_TENSOR, _NDARRAY, _TUPLE, _DICT, _FLOAT)
_NONFINITE = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}
# Stored as they are (bool is a subclass of int, but type() tells them apart).
_PLAIN = frozenset({int, str, bool, type(None)})
_MARKER_FIELDS = {
    _TENSOR: {_TENSOR},
    _NDARRAY: {_NDARRAY, "dtype", "shape"},
    _TUPLE: {_TUPLE},
    _DICT: {_DICT},
    _FLOAT: {_FLOAT},
}


def split_state(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Return a JSON-able tree for ``obj``; tensors found in it are added to ``tensors``.

    Tensor names are the path to them (``optimizer/state/0/exp_avg``), so a saved file is
    readable by eye with plain ``safetensors``. The tree shares no container with ``obj``
    (a background save hands it to another thread without copying it).
    """
    # Plain scalars first: Python's RNG state alone is 625 ints, and the Mapping check
    # below is an ABC lookup; this order keeps a save's capture well under a millisecond.
    kind = type(obj)
    if kind in _PLAIN:
        return obj
    if kind is float:
        return obj if math.isfinite(obj) else {_FLOAT: repr(obj)}
    if (kind is tuple or kind is list) and all(type(v) in _PLAIN for v in obj):
        return {_TUPLE: list(obj)} if kind is tuple else list(obj)
    if isinstance(obj, torch.Tensor):
        if prefix in tensors:
            raise ValueError(f"two state entries map to the tensor name {prefix!r}")
        tensors[prefix] = obj.detach()
        return {_TENSOR: prefix}
    if isinstance(obj, np.ndarray):
        if prefix in tensors:
            raise ValueError(f"two state entries map to the tensor name {prefix!r}")
        raw = np.ascontiguousarray(obj)
        tensors[prefix] = torch.from_numpy(raw.reshape(-1).view(np.uint8).copy())
        return {_NDARRAY: prefix, "dtype": raw.dtype.str, "shape": list(raw.shape)}
    if isinstance(obj, np.generic):
        return split_state(obj.item(), prefix, tensors)
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and k not in _MARKERS for k in obj):
            return {k: split_state(v, f"{prefix}/{k}", tensors) for k, v in obj.items()}
        return {
            _DICT: [
                [split_state(k, f"{prefix}/key{i}", tensors), split_state(v, f"{prefix}/{k}", tensors)]
                for i, (k, v) in enumerate(obj.items())
            ]
        }
    if isinstance(obj, tuple):
        return {_TUPLE: [split_state(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [split_state(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        # JSON has no inf/nan: a marker keeps the tree strict JSON (repr gives "inf", "nan").
        return obj if math.isfinite(obj) else {_FLOAT: repr(obj)}
    raise TypeError(
        f"cannot save {type(obj).__name__} at {prefix!r}: only tensors, arrays, numbers, "
        "strings, lists, tuples and dicts are stored (no pickle)"
    )


def join_state(
    tree: Any, tensors: Mapping[str, torch.Tensor], used: set[str] | None = None, where: str = "state"
) -> Any:
    """Inverse of :func:`split_state`, strict: the tree may be hostile.

    Every marker must have exactly its fields; a tensor must exist and, when the caller
    passes ``used`` (the names already taken), be referenced once only, so no two saved
    buffers come back sharing memory. Raises ``ValueError`` naming the path in the tree.
    """
    if isinstance(tree, list):
        return [join_state(v, tensors, used, f"{where}/{i}") for i, v in enumerate(tree)]
    if not isinstance(tree, dict):
        if tree is None or isinstance(tree, (bool, int, float, str)):
            return tree
        raise ValueError(f"{where} holds a {type(tree).__name__}")
    markers = [m for m in _MARKERS if m in tree]
    if not markers:
        return {k: join_state(v, tensors, used, f"{where}/{k}") for k, v in tree.items()}
    fields = _MARKER_FIELDS[markers[0]]
    if len(markers) > 1 or set(tree) != fields:
        raise ValueError(f"{where} is a malformed {markers[0]} record (fields {sorted(tree)})")
    if _TENSOR in tree:
        return _take(tree[_TENSOR], tensors, used, where)
    if _NDARRAY in tree:
        return _ndarray(tree, _take(tree[_NDARRAY], tensors, used, where), where)
    if _FLOAT in tree:
        if tree[_FLOAT] not in _NONFINITE:
            raise ValueError(f"{where} holds {tree[_FLOAT]!r}, not one of {sorted(_NONFINITE)}")
        return _NONFINITE[tree[_FLOAT]]
    items = tree[_TUPLE] if _TUPLE in tree else tree[_DICT]
    if not isinstance(items, list):
        raise ValueError(f"{where}: {markers[0]} must hold a list")
    if _TUPLE in tree:
        return tuple(join_state(v, tensors, used, f"{where}/{i}") for i, v in enumerate(items))
    if not all(isinstance(pair, list) and len(pair) == 2 for pair in items):
        raise ValueError(f"{where}: {_DICT} must hold [key, value] pairs")
    joined = {
        _hashable(join_state(k, tensors, used, f"{where}/key{i}")): join_state(
            v, tensors, used, f"{where}/{i}"
        )
        for i, (k, v) in enumerate(items)
    }
    if len(joined) != len(items):
        raise ValueError(f"{where}: a key appears twice")
    return joined


def _take(name: Any, tensors: Mapping[str, torch.Tensor], used: set[str] | None, where: str) -> torch.Tensor:
    if not isinstance(name, str) or name not in tensors:
        raise KeyError(name if isinstance(name, str) else where)
    if used is not None:
        if name in used:
            raise ValueError(f"{where}: tensor {name!r} is referenced twice (two buffers would share memory)")
        used.add(name)
    return tensors[name]


def _ndarray(tree: dict[str, Any], tensor: torch.Tensor, where: str) -> np.ndarray:
    shape = tree["shape"]
    if (
        not isinstance(tree["dtype"], str)
        or not isinstance(shape, list)
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise ValueError(f"{where}: malformed array dtype or shape")
    try:
        dtype = np.dtype(tree["dtype"])
    except TypeError:
        raise ValueError(f"{where}: unknown array dtype {tree['dtype']!r}") from None
    if dtype.kind not in "biuf" or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise ValueError(f"{where}: arrays hold plain numbers as bytes, not {tree['dtype']!r}")
    if math.prod(shape) * dtype.itemsize != tensor.numel():
        raise ValueError(
            f"{where}: {tensor.numel()} bytes do not hold a {tree['dtype']} array of shape {shape}"
        )
    return np.frombuffer(tensor.numpy().tobytes(), dtype=dtype).reshape(shape).copy()


def _hashable(key: Any) -> Any:
    key = tuple(key) if isinstance(key, list) else key
    try:
        hash(key)
    except TypeError:
        raise ValueError(f"a {type(key).__name__} cannot be a key") from None
    return key
