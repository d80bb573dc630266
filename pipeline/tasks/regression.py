"""The default task: a small float64 regression built to exercise every source of state.

- 24 training rows in batches of 4, so epochs end mid-run and the order is reshuffled
  (NumPy ``Generator(PCG64)`` via the sampler);
- a map-style ``train_dataset`` whose input noise augmentation is drawn from Python's
  ``random`` in ``__getitem__``, seeded per sample (``pipeline.data.seeding``), so the noise
  is the same with any number of workers or processes;
- an MLP with Dropout (torch's CPU generator, per rank under torchrun);
- Adam and a step schedule (optimizer and scheduler state).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint import read_tensors, write_safetensors
from ..config import Config
from ..errors import ConfigError
from ..factories import read_params
from .mlp import MLP, NUM_FEATURES, build_model  # the model, kept apart so the stage ships it alone

__all__ = ["prepare_data", "build_data", "build_model", "RegressionData", "AugmentedRows", "MLP"]

_DATA_SPEC = {
    "num_train": (int, 24),
    "num_heldout": (int, 16),
    "num_features": (int, NUM_FEATURES),
    "noise": (float, 0.05),
    "augment_std": (float, 0.01),
}


def _data_params(config: Config) -> dict[str, Any]:
    params = read_params(config.data.params, "data.params", _DATA_SPEC)
    for key in ("num_train", "num_heldout", "num_features"):
        if params[key] < 1:
            raise ConfigError(f"data.params.{key} must be >= 1 (got {params[key]})")
    return params


def prepare_data(config: Config, out_dir: Path) -> None:
    """Write ``train.safetensors`` and ``heldout.safetensors``: y = sin(x·w) + x·v + noise."""
    params = _data_params(config)
    rng = np.random.Generator(np.random.PCG64(config.data.seed))
    features = params["num_features"]
    w = rng.standard_normal(features)
    v = rng.standard_normal(features) * 0.5
    total = params["num_train"] + params["num_heldout"]
    x = rng.uniform(-1.0, 1.0, size=(total, features))
    y = np.sin(x @ w) + x @ v + params["noise"] * rng.standard_normal(total)
    x_t = torch.from_numpy(x).to(torch.float64)
    y_t = torch.from_numpy(y).to(torch.float64).unsqueeze(1)
    split = params["num_train"]
    write_safetensors(
        out_dir / "train.safetensors", {"x": x_t[:split].contiguous(), "y": y_t[:split].contiguous()}
    )
    write_safetensors(
        out_dir / "heldout.safetensors", {"x": x_t[split:].contiguous(), "y": y_t[split:].contiguous()}
    )


class AugmentedRows(torch.utils.data.Dataset):
    """Training rows ``(x + noise, y)``; the noise comes from Python's ``random``, which the
    pipeline seeds for each sample from (seed, epoch, index) before this runs."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, augment_std: float) -> None:
        self.x, self.y, self.augment_std = x, y, augment_std

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = (
            [random.gauss(0.0, self.augment_std) for _ in range(self.x.shape[1])]
            if self.augment_std
            else None
        )
        x = self.x[index] + torch.tensor(noise, dtype=self.x.dtype) if noise else self.x[index].clone()
        return x, self.y[index].clone()


class RegressionData:
    """A map-style training set with per-sample input noise, and an untouched held-out split."""

    def __init__(
        self,
        train: dict[str, torch.Tensor],
        heldout: dict[str, torch.Tensor],
        augment_std: float,
        dtype: torch.dtype,
    ) -> None:
        self.train_x, self.train_y = train["x"].to(dtype), train["y"].to(dtype)
        self.heldout_x, self.heldout_y = heldout["x"].to(dtype), heldout["y"].to(dtype)
        self.train_dataset = AugmentedRows(self.train_x, self.train_y, augment_std)

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        was_training = model.training
        model.eval()
        try:
            prediction = model(self.heldout_x.to(device))
            mse = torch.nn.functional.mse_loss(prediction, self.heldout_y.to(device)).item()
        finally:
            model.train(was_training)
        return {"mse": mse, "rmse": math.sqrt(mse)}


def build_data(config: Config, data_dir: Path) -> RegressionData:
    params = _data_params(config)
    dtype = getattr(torch, config.training.dtype)
    return RegressionData(
        read_tensors(data_dir / "train.safetensors"),
        read_tensors(data_dir / "heldout.safetensors"),
        params["augment_std"],
        dtype,
    )
