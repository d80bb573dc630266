"""Tasks for the accumulation/evaluation tests: the regression task without evaluate(), or with an odd one."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.config import Config
from pipeline.tasks.regression import build_data


class _WithoutEvaluate:
    """The regression task's data, every attribute but evaluate."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "evaluate":
            raise AttributeError(name)
        return getattr(self._inner, name)


def build_data_without_evaluate(config: Config, data_dir: Path) -> _WithoutEvaluate:
    return _WithoutEvaluate(build_data(config, data_dir))


class _DrawingEvaluate:
    """The regression task's data, whose evaluate draws from every RNG the training uses and
    reports the mode and grad mode it was called in (the regression's own evaluate sets eval
    mode itself)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        noise = random.random() + float(np.random.rand()) + float(torch.rand(1))
        called_in = {"train_mode": float(model.training), "grad_mode": float(torch.is_grad_enabled())}
        return {**self._inner.evaluate(model, device), "noise": noise, **called_in}


def build_data_drawing_evaluate(config: Config, data_dir: Path) -> _DrawingEvaluate:
    return _DrawingEvaluate(build_data(config, data_dir))


class _WobblingEvaluate:
    """The regression task's data, whose evaluate adds ``wobble``: a value in [0, 1) that jumps
    about as the weights change (their sum's digits), so the best of it is rarely the newest
    evaluation (a loss mostly falls): what a change of ``checkpoint.best_mode`` must cope with."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        total = sum(float(parameter.detach().abs().sum()) for parameter in model.parameters())
        return {**self._inner.evaluate(model, device), "wobble": total * 1000.0 % 1.0}


def build_data_wobbling_evaluate(config: Config, data_dir: Path) -> _WobblingEvaluate:
    return _WobblingEvaluate(build_data(config, data_dir))


class _PlateauEvaluate:
    """The regression task's data, whose evaluate adds ``accuracy``: 1/3, 2/3, then 1.0 at
    every later evaluation, an accuracy that saturates: most evaluations only tie the best."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        self._calls += 1
        return {**self._inner.evaluate(model, device), "accuracy": min(self._calls, 3) / 3}


def build_data_plateau_evaluate(config: Config, data_dir: Path) -> _PlateauEvaluate:
    return _PlateauEvaluate(build_data(config, data_dir))


class _BytesSample:
    """The regression task's data, with a sample() that returns bytes, not text."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def sample(self, model: Any, device: Any) -> bytes:
        return b"not text"


def build_data_bytes_sample(config: Config, data_dir: Path) -> _BytesSample:
    return _BytesSample(build_data(config, data_dir))


class _RaisingSample(_BytesSample):
    """The regression task's data, with a sample() that raises."""

    def sample(self, model: Any, device: Any) -> str:
        raise ValueError("no prompt to sample from")


def build_data_raising_sample(config: Config, data_dir: Path) -> _RaisingSample:
    return _RaisingSample(build_data(config, data_dir))


class _ModeBlindEvaluate:
    """The regression task's data, whose evaluate runs the model in whatever mode it is handed
    (as most users' do: putting it in eval mode is the caller's job)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        prediction = model(self._inner.heldout_x.to(device))
        return {"mse": torch.nn.functional.mse_loss(prediction, self._inner.heldout_y.to(device)).item()}


def build_data_mode_blind_evaluate(config: Config, data_dir: Path) -> _ModeBlindEvaluate:
    return _ModeBlindEvaluate(build_data(config, data_dir))
