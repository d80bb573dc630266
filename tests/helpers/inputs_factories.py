"""Data factories for the input-pipeline tests, plugged in by import path like any user's task.

- ``build_noisy_rows``: the default regression rows as a map-style dataset whose
  ``__getitem__`` draws noise from torch, NumPy's global state and Python's ``random``.
  Environment knobs play the failures a real dataset meets: ``INPUTS_FAIL_AT`` (that index
  raises), ``INPUTS_KILL_AT`` (the worker fetching that index is SIGKILLed, as the OOM killer
  would, once ``INPUTS_KILL_AFTER`` exists), ``INPUTS_ROWS`` (the set has that many rows: its
  length changed), ``INPUTS_FINGERPRINT`` (the task's fingerprint of its content);
- ``prepare_stream`` / ``build_stream``: the same rows as JSON-lines files read back as a
  ``datasets.IterableDataset`` (two shards), per-sample noise added by a ``map``;
  ``build_buffered_stream`` adds a shuffle buffer (refused), ``build_mapped_stream`` another
  map (another source, for a foreign saved state), ``build_stateful_stream`` a task with a
  ``state_dict`` of its own.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.config import Config
from pipeline.tasks.regression import RegressionData, build_data, prepare_data

__all__ = [
    "build_noisy_rows",
    "prepare_stream",
    "build_stream",
    "build_buffered_stream",
    "build_mapped_stream",
    "build_stateful_stream",
]


class NoisyRows(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y
        self.rows = int(os.environ.get("INPUTS_ROWS", len(x)))
        self.fail_at = int(os.environ.get("INPUTS_FAIL_AT", -1))
        self.kill_at = int(os.environ.get("INPUTS_KILL_AT", -1))

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index == self.fail_at:
            raise ValueError(f"row {index} is corrupt")
        if index == self.kill_at and torch.utils.data.get_worker_info() is not None:
            # Once the run has committed the named checkpoint (or a later one: it may be pruned
            # between two polls): a worker's queue dies with it, and batches it had finished but
            # not yet handed over must not include that step's.
            after = Path(os.environ.get("INPUTS_KILL_AFTER", "/"))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not any(
                step.name >= after.name for step in after.parent.glob("step-*")
            ):
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        noise = (
            torch.randn(self.x.shape[1], dtype=self.x.dtype) * 0.01
            + torch.from_numpy(np.random.standard_normal(self.x.shape[1])) * 0.01
            + random.gauss(0.0, 0.01)
        )
        return self.x[index % len(self.x)] + noise, self.y[index % len(self.x)].clone()


class _Task:
    def __init__(self, base: RegressionData) -> None:
        self.base = base

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return self.base.loss(model, batch)

    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        return self.base.evaluate(model, device)


class NoisyTask(_Task):
    def __init__(self, base: RegressionData) -> None:
        super().__init__(base)
        self.train_dataset = NoisyRows(base.train_x, base.train_y)
        self.fingerprint = os.environ.get("INPUTS_FINGERPRINT")  # the set's content, as the task names it


def build_noisy_rows(config: Config, data_dir: Path) -> NoisyTask:
    return NoisyTask(build_data(config, data_dir))


def prepare_stream(config: Config, out_dir: Path) -> None:
    """The regression files, plus their training rows as two JSON-lines shards."""
    prepare_data(config, out_dir)
    base = build_data(config, out_dir)
    rows = [{"x": x.tolist(), "y": y.tolist()} for x, y in zip(base.train_x, base.train_y)]
    half = len(rows) // 2
    for shard, part in enumerate((rows[:half], rows[half:])):
        (out_dir / f"stream-{shard}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))


def _augment(example: dict[str, Any]) -> dict[str, Any]:
    return {"x": [value + random.gauss(0.0, 0.01) for value in example["x"]]}


def _collate(samples: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor([s["x"] for s in samples], dtype=torch.float64),
        torch.tensor([s["y"] for s in samples], dtype=torch.float64),
    )


class StreamTask(_Task):
    def __init__(self, base: RegressionData, stream: Any) -> None:
        super().__init__(base)
        self.train_iterable = stream

    def collate(self, samples: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        return _collate(samples)


def _stream(data_dir: Path):
    import datasets

    files = sorted(str(path) for path in data_dir.glob("stream-*.jsonl"))
    return datasets.load_dataset("json", data_files=files, split="train", streaming=True).map(_augment)


def build_stream(config: Config, data_dir: Path) -> StreamTask:
    return StreamTask(build_data(config, data_dir), _stream(data_dir))


def build_buffered_stream(config: Config, data_dir: Path) -> StreamTask:
    return StreamTask(build_data(config, data_dir), _stream(data_dir).shuffle(seed=0, buffer_size=8))


def build_mapped_stream(config: Config, data_dir: Path) -> StreamTask:
    return StreamTask(build_data(config, data_dir), _stream(data_dir).map(lambda example: example))


class StatefulStream(StreamTask):
    """The stream task, its loss weighed by a schedule of its own: the weight grows by a
    sixteenth at every loss computed, so a resume that does not give the task back its
    ``state_dict`` (the count and the weight, a float64 tensor) trains on other losses."""

    def __init__(self, base: RegressionData, stream: Any) -> None:
        super().__init__(base, stream)
        self.calls = 0
        self.weight = torch.ones(1, dtype=torch.float64)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        loss = super().loss(model, batch) * self.weight
        self.calls += 1
        self.weight = self.weight * 1.0625
        return loss.sum()

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "weight": self.weight.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls, self.weight = state["calls"], state["weight"].clone()


def build_stateful_stream(config: Config, data_dir: Path) -> StatefulStream:
    return StatefulStream(build_data(config, data_dir), _stream(data_dir))
