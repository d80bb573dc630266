"""What every feed is: the interface the training loop and the checkpoint use, and the
small helpers the feeds share (:mod:`~pipeline.data.feed` picks a feed and holds the
map-style ones, :mod:`~pipeline.data.stream` the stream; both build on this)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

from ..errors import DataError

__all__ = ["Feed", "to_device", "map_tensors", "dataset_fingerprint"]


def to_device(batch: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor in it (nested in dicts, lists, tuples) on ``device``."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def dataset_fingerprint(data: Any, dataset: Any) -> str | None:
    """The training set's content fingerprint, as the task (or its dataset) names it in a
    ``fingerprint`` string; else none. Files in ``data.dir`` are covered by the manifest's
    SHA-256 anyway; ``datasets``' own cache fingerprint is not used: it changes when the same
    files move or are touched, which would refuse a good resume."""
    for owner in (data, dataset):
        value = getattr(owner, "fingerprint", None)
        if isinstance(value, str) and value:
            return value
    return None


class Feed:
    """The interface the loop and the checkpoint use (:mod:`pipeline.data.feed` and :mod:`pipeline.data.stream`
    implement it)."""

    kind = ""
    rows = 0
    """Rows of the global batch :meth:`next_batch` handed out last (what gradient accumulation
    weighs it by; a short last batch of an epoch has fewer)."""

    def next_batch(self) -> tuple[Any, float]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def check_state(self, saved: Any) -> None:
        """Refuse (:class:`DataError`, one line naming the field) a saved ``source`` record
        that does not belong to this source; nothing is changed."""
        raise NotImplementedError

    def check_kind(self, saved: Any) -> None:
        """Refuse a saved ``source`` record of another input form than this feed's (``kind``)."""
        found = saved.get("kind") if isinstance(saved, dict) else None
        if found != self.kind:
            raise DataError(
                f"the checkpoint was trained from a {found!r} source, this run's data.factory gives a "
                f"{self.kind!r} one: resume with the data factory it was trained with"
            )

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Take a checked record's position (the sampler's is restored with the sampler)."""

    def close(self) -> None:
        """Stop what reads ahead (DataLoader workers)."""
