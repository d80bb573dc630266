"""A user's task gone wrong, plugged in by import path like any user's: the default regression
rows, where the environment makes one sample (or the task's length, its stream, its collate or
its evaluation) misbehave the way real user code does.

``HOSTILE`` names the misbehaviour, ``HOSTILE_AT`` the sample index (or stream record) where it
happens (every one without it), ``HOSTILE_AFTER`` a path that must exist first (a checkpoint folder: the run has
committed something), ``HOSTILE_MARK`` a folder where a worker that starts to stall leaves a
file named by its pid:

- ``raise`` (ValueError), ``exit0`` (``sys.exit(0)``), ``interrupt`` (``KeyboardInterrupt``),
  ``os_exit`` (``os._exit(3)``), ``shape`` (a sample 7 wide where others are 3), ``stall``
  (the sample takes ``HOSTILE_STALL`` seconds, an hour by default; ``HOSTILE_OUTLIVE=1``: its
  worker also drops the order to die with its trainer, as a worker on a platform without it
  would);
- ``len=VALUE``: ``__len__`` returns VALUE (``-3``, ``24.5``, ``2**62``);
- ``evaluate``: ``evaluate()`` raises (script 04); ``loss_exit``: ``loss()`` calls ``sys.exit(0)``.

``build_rows`` gives a map-style ``train_dataset``; ``build_batches`` the same rows through
``get_batch`` (it misbehaves for any batch holding row ``HOSTILE_AT``); ``build_stream`` the same
rows as a plain Python stream with ``state_dict()`` (``HOSTILE=uncopyable``: it holds a lock, which cannot be
copied).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.config import Config
from pipeline.tasks.regression import RegressionData, build_data

__all__ = ["build_rows", "build_batches", "build_stream", "prepare_unrepeatable"]


def _knob() -> tuple[str, int | None]:
    at = os.environ.get("HOSTILE_AT")
    return os.environ.get("HOSTILE", ""), None if at is None else int(at)


def _armed() -> bool:
    # The named checkpoint or a later one (it may be pruned between two looks).
    after = os.environ.get("HOSTILE_AFTER")
    return after is None or any(step.name >= Path(after).name for step in Path(after).parent.glob("step-*"))


def _misbehave(kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "raise":
        raise ValueError("this row is corrupt")
    if kind == "exit0":
        sys.exit(0)
    if kind == "interrupt":
        raise KeyboardInterrupt
    if kind == "os_exit":
        os._exit(3)
    if kind == "shape":
        return torch.zeros(7, dtype=x.dtype)
    if kind == "stall":
        if os.environ.get("HOSTILE_OUTLIVE") == "1" and sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None).prctl(1, 0)  # PR_SET_PDEATHSIG: none
        mark = os.environ.get("HOSTILE_MARK")
        if mark:
            (Path(mark) / str(os.getpid())).touch()
        time.sleep(float(os.environ.get("HOSTILE_STALL", "3600")))
    return x


class HostileRows(torch.utils.data.Dataset):
    def __init__(self, base: RegressionData) -> None:
        self.base = base.train_dataset

    def __len__(self) -> int:
        kind, _ = _knob()
        if kind.startswith("len="):
            return eval(kind[4:])  # noqa: S307 - the test's own literal: -3, 24.5, 2**62
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.base[index]
        kind, at = _knob()
        if at in (None, index) and _armed():
            x = _misbehave(kind, x)
        return x, y


class _Task:
    def __init__(self, base: RegressionData) -> None:
        self.base = base

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if _knob()[0] == "loss_exit" and _armed():
            sys.exit(0)
        return self.base.loss(model, batch)

    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        if _knob()[0] == "evaluate":
            raise RuntimeError("the held-out file is unreadable")
        return self.base.evaluate(model, device)


class RowsTask(_Task):
    def __init__(self, base: RegressionData) -> None:
        super().__init__(base)
        self.train_dataset = HostileRows(base)


def build_rows(config: Config, data_dir: Path) -> RowsTask:
    return RowsTask(build_data(config, data_dir))


class BatchesTask(_Task):
    def __init__(self, base: RegressionData) -> None:
        super().__init__(base)
        self.num_train = len(base.train_x)

    def get_batch(self, indices: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        kind, at = _knob()
        x, y = self.base.train_x[indices], self.base.train_y[indices]
        if at in indices and _armed():
            _misbehave(kind, x[0])
        return x.to(device), y.to(device)


def build_batches(config: Config, data_dir: Path) -> BatchesTask:
    return BatchesTask(build_data(config, data_dir))


class HostileStream:
    """The training rows in order, one pass; its position is the next row."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y, self.position = x, y, 0
        if _knob()[0] == "uncopyable":
            self.lock = threading.Lock()

    def __iter__(self):
        kind, at = _knob()
        while self.position < len(self.x):
            index, self.position = self.position, self.position + 1
            x = self.x[index]
            if at in (None, index) and _armed():
                x = _misbehave(kind, x)
            yield x, self.y[index]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class StreamTask(_Task):
    def __init__(self, base: RegressionData) -> None:
        super().__init__(base)
        self.train_iterable = HostileStream(base.train_x, base.train_y)


def build_stream(config: Config, data_dir: Path) -> StreamTask:
    return StreamTask(build_data(config, data_dir))


def prepare_unrepeatable(config: Config, out_dir: Path) -> None:
    """A ``data.prepare`` that writes other bytes every time (a tokenizer trained on threads)."""
    (out_dir / "vocabulary.bin").write_bytes(os.urandom(32))


def prepare_nothing(config: Config, out_dir: Path) -> None:
    """A ``data.prepare`` that returns without writing a file (a download that found nothing)."""
