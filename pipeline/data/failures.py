"""What the task's code did wrong while a batch was read, in one line: the failure's first line,
its traceback kept for ``--debug`` (as text when it was raised in a DataLoader worker), which
samples of a batch differ in shape, and the ``data.sample_timeout`` deadline for batches read
in the training process. Shared by the feeds (:mod:`pipeline.data.feed`,
:mod:`pipeline.data.stream`)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Mapping
from typing import Any, Iterator

import numpy as np
import torch

from ..errors import CapturedTraceback, InputFailed, PipelineError, SampleDeadlinePassed, first_line

__all__ = ["user_error", "sample_deadline", "collate_failure", "catchable"]


def user_error(message: str, trace: str) -> InputFailed:
    """:class:`InputFailed` with ``message``, the traceback ``trace`` (text, possibly from a
    worker process) as its cause for ``--debug``."""
    error = InputFailed(message)
    error.__cause__ = CapturedTraceback(trace)
    return error


@contextlib.contextmanager
def sample_deadline(seconds: float, what: str) -> Iterator[None]:
    """``data.sample_timeout`` for a batch read in this process (no workers, a stream, a
    ``get_batch``): past ``seconds``, :class:`InputFailed` naming ``what``. A timer signal
    interrupts the task's code wherever it waits (``SampleDeadlinePassed`` is no ``Exception``, so a
    broad ``except`` in that code does not swallow it); only the main thread can take signals,
    so elsewhere, or with 0, there is no deadline."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return
    armed = [True]

    def expire(signum: int, frame: Any) -> None:
        if armed[0]:
            raise SampleDeadlinePassed()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
        armed[0] = False  # inside the try: an expiry right here is still caught below
    except SampleDeadlinePassed:
        raise InputFailed(
            f"{what} took more than data.sample_timeout={seconds:g} s (a sample stuck reading, or waiting "
            "for something that never comes); raise data.sample_timeout if it is only slow"
        ) from None
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _shape_leaves(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, shape)`` of every tensor or array in a sample, and ``(path, ("len", n))`` of
    every list or tuple (default_collate zips them), in order."""
    if isinstance(obj, torch.Tensor) or (isinstance(obj, np.ndarray) and obj.dtype != object):
        yield path, list(obj.shape)
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _shape_leaves(value, f"{path}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        yield path, ("len", len(obj))
        for index, value in enumerate(obj):
            yield from _shape_leaves(value, f"{path}[{index}]")


def collate_failure(names: list[str], samples: list[Any], exc: BaseException, default: bool) -> str:
    """What a failed collate says: where the samples differ in shape (``names[i]`` names
    ``samples[i]``), which default_collate cannot stack, with the fix (a padding collate);
    else the exception's first line. Found from the samples themselves, so the message is
    the same in a DataLoader worker (where torch's own says "Trying to resize storage that is
    not resizable") and in the training process ("stack expects each tensor to be equal size")."""
    try:
        first = dict(_shape_leaves(samples[0]))
        for name, sample in zip(names[1:], samples[1:]):
            for path, shape in _shape_leaves(sample):
                if path in first and first[path] != shape:
                    if isinstance(shape, tuple):  # lists or tuples of other lengths
                        what = "length"
                        found = f"{names[0]}{path} has {first[path][1]} items, {name}{path} {shape[1]}"
                    else:
                        what = "shape"
                        found = f"{names[0]}{path} is {first[path]}, {name}{path} {shape}"
                    if not default:
                        return f"raised {first_line(exc, named=True)} (the samples differ in {what}: {found})"
                    return (
                        f"failed: the samples differ in {what} ({found}), and default_collate stacks samples "
                        f"of one {what} only: give data.factory a collate(samples) that pads them (docs/data.md)"
                    )
    except Exception:  # noqa: BLE001 - a sample we cannot walk: the exception says what it can
        pass
    return f"raised {first_line(exc, named=True)}"


def _in_worker() -> bool:
    return torch.utils.data.get_worker_info() is not None


def catchable(exc: BaseException) -> bool:
    """Whether the task's code raising ``exc`` is reported as its failure: anything, even
    ``SystemExit``, except the sample deadline, the pipeline's own errors (already one line)
    and, in the training process, a Ctrl-C."""
    return not isinstance(exc, (PipelineError, SampleDeadlinePassed)) and (
        _in_worker() or not isinstance(exc, KeyboardInterrupt)
    )
