"""Import-path factories (``package.module:function``) and the built-in optimizers and schedules.

A user's own model plugs in by naming its factories in the config; nothing in the
pipeline needs editing. Signatures:

- ``data.prepare(config, out_dir: Path) -> None`` writes data files (script 01);
- ``data.factory(config, data_dir: Path) -> TaskData`` (see :mod:`pipeline.data`);
- ``model.factory(config) -> torch.nn.Module``;
- ``optimizer.factory(model, config) -> torch.optim.Optimizer``;
- ``scheduler.factory(optimizer, config) -> torch.optim.lr_scheduler.LRScheduler``.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from typing import Any, Callable

import torch

from .config import Config
from .errors import ConfigError
from .params import read_params  # published model code imports it from pipeline.params

__all__ = ["resolve", "read_params", "adam", "adamw", "step_lr", "warmup_cosine", "constant"]


def resolve(path: str, key: str) -> Callable[..., Any]:
    """Import ``module:attr``; errors name the config key that held the path."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}: {path!r} must look like 'package.module:function'")
    # Scripts run as `python scripts/NN_x.py` put scripts/ on sys.path, not the folder the
    # user works in; a factory module beside config.yaml (or examples/...) must still import.
    # Only for this import: a working folder left on sys.path would shadow modules for good.
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}: cannot import module {module_name!r} ({exc}); is it on PYTHONPATH?") from None
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    target = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(f"{key}: module {module_name!r} has no attribute {attr!r}")
    if not callable(target):
        raise ConfigError(f"{key}: {path!r} is not callable")
    return target


def _optimizer_kwargs(config: Config) -> dict[str, Any]:
    params = read_params(config.optimizer.params, "optimizer.params",
                         {"betas": (list, [0.9, 0.999]), "eps": (float, 1e-8)})
    if len(params["betas"]) != 2 or not all(0 <= b < 1 for b in params["betas"]):
        raise ConfigError(f"optimizer.params.betas must be two numbers in [0, 1), got {params['betas']}")
    return {"lr": config.optimizer.lr, "betas": tuple(float(b) for b in params["betas"]), "eps": params["eps"]}


def adam(model: torch.nn.Module, config: Config) -> torch.optim.Optimizer:
    """Adam over every parameter, with L2 weight decay if configured."""
    return torch.optim.Adam(model.parameters(), weight_decay=config.optimizer.weight_decay,
                            **_optimizer_kwargs(config))


def adamw(model: torch.nn.Module, config: Config) -> torch.optim.Optimizer:
    """AdamW with two groups: matrices decay; biases, norms and other vectors do not.

    Tied parameters appear once (``named_parameters`` deduplicates them).
    """
    decay, no_decay = [], []
    for _, parameter in model.named_parameters():
        if parameter.requires_grad:
            (decay if parameter.ndim >= 2 else no_decay).append(parameter)
    groups = [
        {"params": decay, "weight_decay": config.optimizer.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, **_optimizer_kwargs(config))


def step_lr(optimizer: torch.optim.Optimizer, config: Config) -> torch.optim.lr_scheduler.LRScheduler:
    """Multiply the learning rate by ``gamma`` every ``step_size`` steps."""
    params = read_params(config.scheduler.params, "scheduler.params",
                         {"step_size": (int, 4), "gamma": (float, 0.5)})
    if params["step_size"] < 1:
        raise ConfigError(f"scheduler.params.step_size must be >= 1 (got {params['step_size']})")
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=params["step_size"], gamma=params["gamma"])


def constant(optimizer: torch.optim.Optimizer, config: Config) -> torch.optim.lr_scheduler.LRScheduler:
    """Keep the base learning rate."""
    read_params(config.scheduler.params, "scheduler.params", {})
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def warmup_cosine(optimizer: torch.optim.Optimizer, config: Config) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_ratio`` of the base rate
    at ``training.max_steps`` (an extended run's first length), held after it."""
    params = read_params(config.scheduler.params, "scheduler.params",
                         {"warmup_steps": (int, 10), "min_ratio": (float, 0.1)})
    warmup, floor, total = params["warmup_steps"], params["min_ratio"], config.training.max_steps
    if warmup < 0:
        raise ConfigError(f"scheduler.params.warmup_steps must be >= 0 (got {warmup})")
    if not 0 <= floor <= 1:
        raise ConfigError(f"scheduler.params.min_ratio must be in [0, 1] (got {floor})")

    # A plain closure: LambdaLR saves nothing of a function, so the state stays JSON.
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
