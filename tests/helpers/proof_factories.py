"""Data factories for the resume-proof tests, plugged in by import path like any user's task.

Both wrap the default regression data (same prepared files), changing one thing each:

- ``build_quiet_data``: no input-noise augmentation (with dropout 0 and shuffle off, no RNG
  family of the training process is consumed at all);
- ``build_forgetful_data``: a sampler that saves its position but ignores it on load, the
  classic "resume restarts the epoch" bug the proof must name;
- ``build_lookup_data``: a sampler of fixed batches in order whose saved position is the next
  batch's index, looked up in its batch list on load (one past the end, an epoch's end, is an
  ``IndexError``).

- ``build_once_per_process_data``: the default data, refused at a second build in one process
  (a task holding a process-wide resource): the leg after the first in a shared process fails.

And one scheduler, ``settling_scheduler``: a constant learning rate whose saved state (a
counter that stops at 2) differs from a fresh one at any cut after step 2, yet converges
again two steps after a resume that forgets it, so leaving it out changes nothing the
proof can observe: its negative control must come out "not detected".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.config import Config
from pipeline.data import EpochSampler
from pipeline.errors import DataError
from pipeline.tasks.regression import AugmentedRows, RegressionData, build_data

__all__ = [
    "build_quiet_data",
    "build_forgetful_data",
    "build_lookup_data",
    "build_once_per_process_data",
    "ForgetfulSampler",
    "settling_scheduler",
]

_BUILDS_IN_THIS_PROCESS = []


class _Wrapped:
    def __init__(self, base: RegressionData) -> None:
        self.base = base
        self.train_dataset = base.train_dataset

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return self.base.loss(model, batch)

    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        return self.base.evaluate(model, device)


class QuietData(_Wrapped):
    def __init__(self, base: RegressionData) -> None:
        super().__init__(base)
        self.train_dataset = AugmentedRows(base.train_x, base.train_y, 0.0)


class ForgetfulSampler(EpochSampler):
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Deliberately broken: the saved position is dropped."""


class ForgetfulData(_Wrapped):
    def make_sampler(self, generator: np.random.Generator, config: Config) -> ForgetfulSampler:
        return ForgetfulSampler(
            len(self.train_dataset),
            config.data.batch_size,
            generator,
            shuffle=config.data.shuffle,
            drop_last=config.data.drop_last,
        )


class LookupSampler:
    def __init__(self, num_rows: int, batch_size: int) -> None:
        self.batches = [
            list(range(row, min(row + batch_size, num_rows))) for row in range(0, num_rows, batch_size)
        ]
        self.position = 0

    def __len__(self) -> int:
        return len(self.batches)

    def next_indices(self) -> list[int]:
        batch = self.batches[self.position % len(self.batches)]
        self.position = self.position % len(self.batches) + 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches[state["position"]]  # the batch it resumes at
        self.position = state["position"]


class LookupData(_Wrapped):
    def make_sampler(self, generator: np.random.Generator, config: Config) -> LookupSampler:
        return LookupSampler(len(self.train_dataset), config.data.batch_size)


def build_quiet_data(config: Config, data_dir: Path) -> QuietData:
    return QuietData(build_data(config, data_dir))


def build_forgetful_data(config: Config, data_dir: Path) -> ForgetfulData:
    return ForgetfulData(build_data(config, data_dir))


def build_lookup_data(config: Config, data_dir: Path) -> LookupData:
    return LookupData(build_data(config, data_dir))


def build_once_per_process_data(config: Config, data_dir: Path) -> RegressionData:
    _BUILDS_IN_THIS_PROCESS.append(data_dir)
    if len(_BUILDS_IN_THIS_PROCESS) > 1:
        raise DataError("this task's data can be built once per process")
    return build_data(config, data_dir)


class SettlingConstantLR(torch.optim.lr_scheduler.LambdaLR):
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer, lambda step: 1.0)

    def state_dict(self) -> dict[str, Any]:
        return {"settled": min(self.last_epoch, 2)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_epoch = state["settled"]


def settling_scheduler(optimizer: torch.optim.Optimizer, config: Config) -> SettlingConstantLR:
    return SettlingConstantLR(optimizer)
