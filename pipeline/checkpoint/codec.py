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
        # JSON has no inf/nan: a marker keeps the tree strict JSON (repr gives "inf", "nan").
        return obj if math.isfinite(obj) else {_FLOAT: repr(obj)}
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
        if _FLOAT in tree:
            return _NONFINITE[tree[_FLOAT]]
        if _DICT in tree:
            return {_hashable(join_state(k, tensors)): join_state(v, tensors) for k, v in tree[_DICT]}
        return {k: join_state(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [join_state(v, tensors) for v in tree]
    return tree


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key
