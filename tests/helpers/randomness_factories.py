"""Data factories whose samples say what they drew, plugged in by import path like any user's task.

Every sample draws once from each of the three global generators the pipeline seeds per
sample (Python's ``random``, NumPy's legacy state, torch's CPU generator), adds the draws to
its input as augmentation noise, and carries them. The task's ``collate`` appends one JSON
line per batch to the file named by ``RANDOMNESS_LOG`` (if set): ``[[record, [random, numpy,
torch]], ...]`` for the samples of the batch, in order (``record``: the row's index in the
training set).

- ``build_recording_rows``: the default regression rows as a map-style ``train_dataset``;
- ``prepare_recording_stream`` / ``build_recording_stream``: the same rows as two JSON-lines
  shards (rows 0-11 and 12-23, each with its ``record`` number) read back as a
  ``datasets.IterableDataset``, the draws made by a ``map``; ``prepare_uneven_recording_stream``
  splits them 16 and 8, so two ranks reading one file each are at different places.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.config import Config
from pipeline.tasks.regression import RegressionData, build_data, prepare_data

__all__ = [
    "build_recording_rows",
    "prepare_recording_stream",
    "prepare_uneven_recording_stream",
    "build_recording_stream",
]


def _draws() -> list[float]:
    return [random.random(), float(np.random.random()), float(torch.rand(()).item())]


class RecordingRows(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, Any]:
        draws = _draws()
        return {"record": index, "draws": draws, "x": (self.x[index] + 0.01 * sum(draws)).tolist()}


class RecordingTask:
    """Batches of ``(x, y)``: ``y`` looked up by record, so the targets are never augmented."""

    def __init__(self, base: RegressionData) -> None:
        self.base = base

    def collate(self, samples: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        if "RANDOMNESS_LOG" in os.environ:
            with open(os.environ["RANDOMNESS_LOG"], "a", encoding="utf-8") as log:
                log.write(json.dumps([[s["record"], s["draws"]] for s in samples]) + "\n")
        return (
            torch.tensor([s["x"] for s in samples], dtype=self.base.train_x.dtype),
            torch.stack([self.base.train_y[s["record"]] for s in samples]),
        )

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return self.base.loss(model, batch)

    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        return self.base.evaluate(model, device)


class RecordingRowsTask(RecordingTask):
    def __init__(self, base: RegressionData) -> None:
        super().__init__(base)
        self.train_dataset = RecordingRows(base.train_x, base.train_y)


def build_recording_rows(config: Config, data_dir: Path) -> RecordingRowsTask:
    return RecordingRowsTask(build_data(config, data_dir))


def _prepare_stream(config: Config, out_dir: Path, first: int) -> None:
    """The regression files, plus their training rows as two JSON-lines shards, ``first`` rows in the first."""
    prepare_data(config, out_dir)
    base = build_data(config, out_dir)
    rows = [{"record": i, "x": x.tolist()} for i, x in enumerate(base.train_x)]
    for shard, part in enumerate((rows[:first], rows[first:])):
        (out_dir / f"stream-{shard}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))


def prepare_recording_stream(config: Config, out_dir: Path) -> None:
    _prepare_stream(config, out_dir, 12)


def prepare_uneven_recording_stream(config: Config, out_dir: Path) -> None:
    _prepare_stream(config, out_dir, 16)


def _augment(example: dict[str, Any]) -> dict[str, Any]:
    draws = _draws()
    return {"draws": draws, "x": [value + 0.01 * sum(draws) for value in example["x"]]}


class RecordingStreamTask(RecordingTask):
    def __init__(self, base: RegressionData, stream: Any) -> None:
        super().__init__(base)
        self.train_iterable = stream


def build_recording_stream(config: Config, data_dir: Path) -> RecordingStreamTask:
    import datasets

    files = sorted(str(path) for path in data_dir.glob("stream-*.jsonl"))
    stream = datasets.load_dataset("json", data_files=files, split="train", streaming=True).map(_augment)
    return RecordingStreamTask(build_data(config, data_dir), stream)
