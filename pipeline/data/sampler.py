"""The one source of training order: a sampler yields each global batch's row indices and
saves its position (epoch, permutation, cursor), so a resume continues mid-epoch without
replaying batches. Loaders that run ahead (DataLoader workers) read a copy of it
(:func:`clone_sampler`); the live one advances exactly once per trained batch."""

from __future__ import annotations

import math
import os
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..config import Config
from ..errors import DataError, first_line

__all__ = [
    "Sampler",
    "EpochSampler",
    "make_sampler",
    "clone_sampler",
    "batch_epoch",
    "batches_per_epoch",
    "epochs_done",
    "dataset_length",
]


def dataset_length(source: Any, what: str) -> int:
    """The number of training rows the task gives: ``train_dataset.__len__()``, or its
    ``num_train`` (``what`` names which). Anything but an integer >= 0 (a float, a negative
    count, an error in ``__len__``) is refused in one line naming it."""
    if what == "num_train":
        rows, shown = getattr(source, "num_train", None), "num_train"
    else:
        shown = f"{what}.__len__()"
        try:
            rows = source.__len__()
        except Exception as exc:
            raise DataError(f"{shown} raised {first_line(exc, named=True)}") from exc
    if type(rows) is not int or rows < 0:
        raise DataError(f"{shown} is {rows!r}: the number of training rows must be an integer >= 0")
    return rows


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _size(count: float) -> str:
    for unit, scale in (("EB", 1e18), ("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count:.0f} bytes"


@runtime_checkable
class Sampler(Protocol):
    """Yields the row indices of each batch and saves/restores its position."""

    def next_indices(self) -> list[int]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class EpochSampler:
    """Batches over a fresh permutation each epoch, drawn from the run's NumPy Generator."""

    def __init__(
        self,
        num_rows: int,
        batch_size: int,
        generator: np.random.Generator,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if num_rows < 1:
            raise DataError("the training set is empty")
        memory = _memory_bytes()
        if memory is not None and num_rows * 8 > memory:
            raise DataError(
                f"the training set has {num_rows} rows: a permutation of them (8 bytes a row, "
                f"{_size(num_rows * 8)}) does not fit in this machine's {_size(memory)} of memory; is the "
                "task's length right? (a set that large needs a make_sampler of its own: docs/data.md)"
            )
        if drop_last and batch_size > num_rows:
            raise DataError(f"batch size {batch_size} exceeds the {num_rows} training rows with drop_last")
        self.num_rows = num_rows
        self.batch_size = batch_size
        self.generator = generator
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.cursor = 0
        self.samples_seen = 0
        self.permutation: np.ndarray | None = None

    def __len__(self) -> int:
        """Batches in one epoch: the last short one counts, unless ``drop_last``."""
        return self.num_rows // self.batch_size if self.drop_last else -(-self.num_rows // self.batch_size)

    def _epoch_exhausted(self) -> bool:
        remaining = self.num_rows - self.cursor
        return remaining <= 0 or (self.drop_last and remaining < self.batch_size)

    def next_indices(self) -> list[int]:
        if self.permutation is None or self._epoch_exhausted():
            if self.permutation is not None:
                self.epoch += 1
            # Drawn lazily at the first batch of an epoch, so saving never draws.
            self.permutation = (
                self.generator.permutation(self.num_rows) if self.shuffle else np.arange(self.num_rows)
            )
            self.cursor = 0
        batch = self.permutation[self.cursor : self.cursor + self.batch_size]
        self.cursor += len(batch)
        self.samples_seen += len(batch)
        return batch.tolist()

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "samples_seen": self.samples_seen,
            "num_rows": self.num_rows,
            "permutation": None if self.permutation is None else self.permutation.astype(np.int64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Checked before anything is set: a hostile checkpoint must not yield indices
        outside the data, or a position no run could have reached."""
        if not isinstance(state, dict) or set(state) != {
            "epoch",
            "cursor",
            "samples_seen",
            "num_rows",
            "permutation",
        }:
            raise DataError(
                "checkpoint's sampler state does not hold epoch, cursor, samples_seen, num_rows, permutation"
            )
        if state["num_rows"] != self.num_rows:
            raise DataError(
                f"checkpoint's sampler covers {state['num_rows']} rows, the data has {self.num_rows}"
            )
        for key in ("epoch", "cursor", "samples_seen"):
            if type(state[key]) is not int or state[key] < 0:
                raise DataError(f"checkpoint's sampler {key} is {state[key]!r}, expected an integer >= 0")
        permutation = state["permutation"]
        if permutation is not None and not (
            isinstance(permutation, np.ndarray)
            and permutation.dtype == np.int64
            and permutation.shape == (self.num_rows,)
            and np.array_equal(np.sort(permutation), np.arange(self.num_rows))
        ):
            raise DataError(
                f"checkpoint's sampler permutation is not a permutation of the {self.num_rows} rows"
            )
        if state["cursor"] > (self.num_rows if permutation is not None else 0):
            raise DataError(f"checkpoint's sampler cursor {state['cursor']} is past the data")
        self.epoch = state["epoch"]
        self.cursor = state["cursor"]
        self.samples_seen = state["samples_seen"]
        self.permutation = None if permutation is None else permutation.copy()


def make_sampler(data: Any, generator: np.random.Generator, config: Config) -> Sampler | None:
    """The task's own sampler if it has one, else an :class:`EpochSampler` over its rows
    (``num_train``, or the length of ``train_dataset``); ``None`` for a stream, whose order
    is its own."""
    custom = getattr(data, "make_sampler", None)
    if custom is not None:
        return custom(generator, config)
    if getattr(data, "train_iterable", None) is not None:
        return None
    dataset = getattr(data, "train_dataset", None)
    rows = (
        dataset_length(dataset, "train_dataset") if dataset is not None else dataset_length(data, "num_train")
    )
    return EpochSampler(
        rows, config.data.batch_size, generator, shuffle=config.data.shuffle, drop_last=config.data.drop_last
    )


def clone_sampler(sampler: Sampler, data: Any, generator: np.random.Generator, config: Config) -> Sampler:
    """A new sampler at ``sampler``'s position, drawing from a copy of ``generator``: it yields
    the same batches without touching the live sampler or the run's generator."""
    copy = np.random.Generator(type(generator.bit_generator)())
    copy.bit_generator.state = generator.bit_generator.state
    clone = make_sampler(data, copy, config)
    if clone is None:
        raise DataError("a stream has no sampler to copy")
    clone.load_state_dict(sampler.state_dict())
    return clone


def batches_per_epoch(sampler: Sampler) -> int | None:
    """How many batches one epoch of ``sampler`` has (its ``__len__``); ``None`` when it does not
    say, or says something that is not a count >= 1."""
    try:
        count = len(sampler)  # type: ignore[arg-type]
    except Exception:  # no __len__, or one that fails: not a count
        return None
    return count if type(count) is int and count >= 1 else None


def epochs_done(sampler: Sampler | None) -> float:
    """Passes over the training set so far, fractional (2.5: half of the third epoch trained):
    an :class:`EpochSampler`'s epoch and cursor, another sampler's integer ``epoch``; NaN when
    there is none (a stream)."""
    if isinstance(sampler, EpochSampler):
        rows = len(sampler) * sampler.batch_size if sampler.drop_last else sampler.num_rows
        return sampler.epoch + sampler.cursor / rows
    epoch = getattr(sampler, "epoch", None)
    return float(epoch) if type(epoch) is int and epoch >= 0 else math.nan


def batch_epoch(sampler: Sampler) -> int:
    """The epoch of the batch ``sampler`` just yielded (its ``epoch`` attribute; 0 for a
    sampler without one): the per-sample seeds' epoch."""
    epoch = getattr(sampler, "epoch", 0)
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0 else 0
