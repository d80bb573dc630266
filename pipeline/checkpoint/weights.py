"""Model weights as stored: one name per shared storage, strict loading, warm starts.

Tied weights (one storage under two names, such as an embedding and an output layer)
are stored once, under the name safetensors' own ``save_model`` would keep, so
``safetensors.torch.load_model`` loads our ``modelo.safetensors`` into a fresh model with
no project code.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..errors import SEALED_BUT_UNFIT, StateMismatch
from ..layout import MODEL_FILE

__all__ = [
    "dedupe_shared_tensors",
    "stored_layout",
    "check_weights_fit",
    "load_model_weights",
    "warm_start",
    "model_summary",
    "derived_buffer_names",
    "check_derived_buffers",
]


def _storage_key(tensor: torch.Tensor) -> tuple[Any, int, int] | None:
    if tensor.device.type == "meta":
        # No storage: a model built without weights (``build_model(config, "meta")``) ties
        # by sharing one Parameter object, which ``state_dict(keep_vars=True)`` keeps.
        return tensor.device, id(tensor), 0
    storage = tensor.untyped_storage()
    if storage.data_ptr() == 0 or storage.nbytes() == 0:
        return None
    return tensor.device, storage.data_ptr(), storage.nbytes()


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    if tensor.numel() == 0:
        return start, start
    span = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()) if size > 0) + 1
    return start, start + span * tensor.element_size()


def _is_complete(tensor: torch.Tensor) -> bool:
    """The tensor covers its whole storage (a slice of a larger buffer does not)."""
    storage = tensor.untyped_storage()
    return (
        tensor.data_ptr() == storage.data_ptr() and tensor.numel() * tensor.element_size() == storage.nbytes()
    )


def _shared_groups(state_dict: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names whose tensors overlap in memory, grouped; only groups of two or more."""
    by_storage: dict[tuple[Any, int, int], list[str]] = {}
    for name, tensor in state_dict.items():
        key = _storage_key(tensor)
        if key is not None:
            by_storage.setdefault(key, []).append(name)
    groups = []
    for names in by_storage.values():
        # Tensors of one storage that do not overlap (disjoint slices) are not aliases.
        spans = sorted((*_byte_range(state_dict[n]), n) for n in names)
        current: list[str] = []
        end = None
        for start, stop, name in spans:
            if current and end is not None and start < end:
                current.append(name)
                end = max(end, stop)
            else:
                if len(current) > 1:
                    groups.append(current)
                current, end = [name], stop
        if len(current) > 1:
            groups.append(current)
    return groups


def dedupe_shared_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep one name per shared storage, as ``safetensors.torch.save_model`` does: of the
    names that cover the whole storage, the first in sorted order; the aliases are dropped.
    Aliases that each cover only part of a storage cannot be stored once: ``ValueError``."""
    kept = dict(state_dict)
    for group in _shared_groups(state_dict):
        complete = sorted(name for name in group if _is_complete(state_dict[name]))
        if not complete:
            raise ValueError(
                f"tensors {', '.join(sorted(group))} share memory but none covers all of it; "
                "make them contiguous copies before saving"
            )
        for name in group:
            if name != complete[0]:
                del kept[name]
    return kept


def check_derived_buffers(
    model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], derived: Any, *, source: str = MODEL_FILE
) -> None:
    """Before loading: each buffer the checkpoint recorded as derived (still equal to its
    freshly built value when saved) must equal, bit for bit, what this code builds now.
    Otherwise the load would silently put back a value the current code no longer computes."""
    stored = model.state_dict()
    if not isinstance(derived, list) or not all(
        isinstance(name, str) and name in tensors for name in derived
    ):
        raise StateMismatch(
            f"{source}: the derived-buffer list in meta.json is malformed: {SEALED_BUT_UNFIT}"
        )
    for name in derived:
        built, saved = stored.get(name), tensors[name]
        if (
            built is None
            or built.device.type == "meta"
            or built.shape != saved.shape
            or built.dtype != saved.dtype
            # A distributed resume holds the saved values on the run's device (a GPU, say).
            or not torch.equal(built.detach().cpu(), saved.detach().cpu())
        ):
            raise StateMismatch(
                f"{source}: buffer {name} differs from the value this code builds (the code or config "
                "that builds it changed since the checkpoint was saved); restore that code, or start "
                "a new run"
            )


def stored_layout(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's tensors as a checkpoint stores them (one name per shared storage, see
    :func:`dedupe_shared_tensors`) and its tied aliases, ``{alias: stored name}``. Works on a
    model built without weights (parameters on ``meta``) as on a real one."""
    state = model.state_dict(keep_vars=True)
    stored = dedupe_shared_tensors(state)
    tied = {}
    for alias, tensor in state.items():
        if alias not in stored:
            same = [name for name in stored if _storage_key(stored[name]) == _storage_key(tensor)]
            tied[alias] = next(
                (name for name in same if stored[name].data_ptr() == tensor.data_ptr()), same[0]
            )
    return stored, tied


def _names(names: list[str]) -> str:
    return f"{len(names)} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"


def _described(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """``{name: {"dtype", "shape"}}`` as meta.json's model record writes it (:func:`model_summary`)."""
    return {
        name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        for name, t in sorted(tensors.items())
    }


def check_weights_fit(
    model: torch.nn.Module,
    tensors: Mapping[str, torch.Tensor],
    *,
    record: Any = None,
    source: str = MODEL_FILE,
) -> dict[str, str]:
    """THE check that stored weights fit the model built from their config, used by every
    reader (resume, evaluate, stage, the proof): the same names (tied weights stored once,
    under the name :func:`dedupe_shared_tensors` keeps), dtypes and shapes; with ``record``
    (meta.json's ``model``), also that the record describes exactly these tensors and ties.
    ``tensors`` may be ``meta`` tensors (dtype and shape only), ``model`` may be built
    without weights. Returns the tied aliases ``{alias: stored name}``; raises
    :class:`~pipeline.errors.StateMismatch` naming the first difference."""
    expected, tied = stored_layout(model)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        parts = ([f"missing {_names(missing)}"] if missing else []) + (
            [f"unexpected {_names(unexpected)}"] if unexpected else []
        )
        raise StateMismatch(f"{source} does not fit the configured model: {'; '.join(parts)}")
    for name, current in expected.items():
        saved = tensors[name]
        if saved.shape != current.shape or saved.dtype != current.dtype:
            raise StateMismatch(
                f"{source}: tensor {name} is {saved.dtype} {tuple(saved.shape)}, the model expects "
                f"{current.dtype} {tuple(current.shape)}"
            )
    if record is not None:
        if not (
            isinstance(record, dict)
            and isinstance(record.get("tensors"), dict)
            and isinstance(record.get("tied"), list)
        ):
            raise StateMismatch(f"{source}: the model record in meta.json is malformed: {SEALED_BUT_UNFIT}")
        described = _described(tensors)
        if record["tensors"] != described:
            name = next(
                n
                for n in sorted({*described, *record["tensors"]})
                if described.get(n) != record["tensors"].get(n)
            )
            raise StateMismatch(
                f"{source} does not fit the model recorded in meta.json (tensor {name}): the "
                "checkpoint is damaged or was edited"
            )
        if record["tied"] != sorted(tied):
            raise StateMismatch(
                f"{source} does not fit the model recorded in meta.json (tied weights "
                f"{record['tied']}, the model ties {sorted(tied)}): the checkpoint is damaged or was "
                "edited"
            )
    return tied


def load_model_weights(
    model: torch.nn.Module,
    tensors: Mapping[str, torch.Tensor],
    *,
    source: str = MODEL_FILE,
    derived: Any = (),
    record: Any = None,
) -> None:
    """Strict load, once :func:`check_weights_fit` passed (with ``record``: meta.json's
    ``model``, checked too) and the ``derived`` buffers :func:`check_derived_buffers`."""
    tied = check_weights_fit(model, tensors, record=record, source=source)
    check_derived_buffers(model, tensors, list(derived), source=source)
    # Tied aliases point at the kept tensor so a strict load_state_dict accepts them.
    full = {**tensors, **{alias: tensors[kept] for alias, kept in tied.items()}}
    model.load_state_dict(full, strict=True)


def warm_start(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
    """Shape-tolerant weight copy for ``--init-from``: report loaded / skipped / new names."""
    own = dedupe_shared_tensors(model.state_dict())
    report: dict[str, list[str]] = {"loaded": [], "skipped": [], "new": []}
    with torch.no_grad():
        for name, target in own.items():
            source = tensors.get(name)
            if source is None:
                report["new"].append(name)
            elif source.shape != target.shape:
                report["skipped"].append(f"{name} (shape {tuple(source.shape)} vs {tuple(target.shape)})")
            else:
                target.copy_(source.to(dtype=target.dtype, device=target.device))
                report["loaded"].append(name)
    report["skipped"] += [f"{name} (not in the model)" for name in sorted(set(tensors) - set(own))]
    return report


def derived_buffer_names(stored: Mapping[str, torch.Tensor], fresh: Mapping[str, torch.Tensor]) -> list[str]:
    """The stored buffers still equal to their ``fresh`` value (see :func:`model_summary`)."""
    return sorted(
        name
        for name, value in fresh.items()
        if name in stored and torch.equal(stored[name].detach().cpu(), value.cpu())
    )


def model_summary(model: torch.nn.Module, fresh: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Names, dtypes and shapes of the stored weights, recorded in meta.json, and the
    ``derived_buffers``: stored buffers that still equal their ``fresh`` value (built from
    code and config, not trained; a BatchNorm's statistics move, so they are not)."""
    stored = dedupe_shared_tensors(model.state_dict())
    full = model.state_dict()
    return {
        "derived_buffers": derived_buffer_names(stored, fresh),
        "tensors": _described(stored),
        "tied": sorted(name for name in full if name not in stored),
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
