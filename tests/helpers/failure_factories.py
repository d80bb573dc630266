"""Factories for the failure tests, plugged in by import path like any user's task.

- ``build_nan_after_data``: the default regression data whose loss turns NaN from the
  third step on (a run that diverges);
- ``prepare_nested``: a ``data.prepare`` that writes files in nested folders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipeline.config import Config
from pipeline.tasks.regression import RegressionData, build_data

__all__ = ["build_inf_after_data", "build_nan_after_data", "prepare_nested"]


class _NanAfter:
    def __init__(self, base: RegressionData, after: int, bad: float = float("nan")) -> None:
        self.base, self.after, self.calls, self.bad = base, after, 0, bad
        self.train_dataset = base.train_dataset

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        self.calls += 1
        loss = self.base.loss(model, batch)
        return loss * self.bad if self.calls > self.after else loss

    def evaluate(self, model, device):
        return self.base.evaluate(model, device)


def build_nan_after_data(config: Config, data_dir: Path) -> _NanAfter:
    return _NanAfter(build_data(config, data_dir), after=2)


def build_inf_after_data(config: Config, data_dir: Path) -> _NanAfter:
    """As ``build_nan_after_data``, the loss infinite instead."""
    return _NanAfter(build_data(config, data_dir), after=2, bad=float("inf"))


def prepare_nested(config: Config, out_dir: Path) -> None:
    (out_dir / "top.bin").write_bytes(b"top")
    (out_dir / "sub" / "deeper").mkdir(parents=True)
    (out_dir / "sub" / "middle.bin").write_bytes(b"middle")
    (out_dir / "sub" / "deeper" / "bottom.bin").write_bytes(b"bottom")
