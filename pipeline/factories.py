"""Import-path factories (``package.module:function``) and the built-in optimizers and schedules.

A user's own model plugs in by naming its factories in the config; nothing in the
pipeline needs editing. Signatures:

- ``data.prepare(config, out_dir: Path) -> None`` writes data files (script 01);
- ``data.factory(config, data_dir: Path) -> TaskData`` (see :mod:`pipeline.data`);
- ``model.factory(config) -> torch.nn.Module``;
- ``optimizer.factory(model, config) -> torch.optim.Optimizer``;
- ``scheduler.factory(optimizer, config) -> torch.optim.lr_scheduler.LRScheduler``;
- each of ``training.callbacks``: ``factory(config) -> callback`` (see :mod:`pipeline.callbacks`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from .config import Config
from .errors import ConfigError, FactoryFailed, OutOfMemory, PipelineError, first_line
from .params import read_params  # published model code imports it from pipeline.params

__all__ = [
    "resolve",
    "defining_module",
    "factory_errors",
    "read_params",
    "adam",
    "adamw",
    "step_lr",
    "warmup_cosine",
    "constant",
]


@contextlib.contextmanager
def importable_working_folder() -> Iterator[None]:
    """The working folder on ``sys.path`` for the block only. Scripts run as ``python
    scripts/NN_x.py`` put scripts/ on sys.path, not the folder the user works in, yet a
    factory module beside config.yaml (or examples/...) must import and be found; left on
    sys.path for good, it would shadow modules."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


# A module and attribute path as Python spells them (what import_module and getattr take).
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

# What torch's allocators say when they refuse (CPU: "can't allocate memory", CUDA: "out of memory").
_ALLOCATION_FAILED = re.compile(r"can't allocate memory|out of memory|not enough memory", re.IGNORECASE)
_ALLOCATION_SIZE = re.compile(r"allocate (\d+) bytes")


def _size(text: str) -> str:
    match = _ALLOCATION_SIZE.search(text)
    if not match:
        return ""
    size = int(match.group(1))
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if size >= scale:
            return f" (it asked for {size / scale:.3g} {unit})"
    return f" (it asked for {size} bytes)"


@contextlib.contextmanager
def factory_errors(
    key: str, path: str, *, hint: str | None = None, error: type[FactoryFailed] = FactoryFailed
) -> Iterator[None]:
    """What the block raises becomes one line naming the config ``key`` and the factory
    ``path``: a failed allocation :class:`OutOfMemory`, anything else ``error``
    (:class:`FactoryFailed`; the original exception as its ``__cause__``; ``hint`` ends the line,
    by default a pointer to the key's section's ``params``), and so does a ``SystemExit`` or
    another ``BaseException`` (never a Ctrl-C). The pipeline's own errors and OS errors (which
    name their path) pass through."""
    try:
        yield
    except (PipelineError, OSError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # a SystemExit too: a factory that exits ends nothing well
        text = str(exc).strip()
        params = key.partition(".")[0] + ".params"
        if isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or (
            isinstance(exc, RuntimeError) and _ALLOCATION_FAILED.search(text)
        ):
            raise OutOfMemory(
                f"out of memory in {key} {path}{_size(text)}: check the sizes in {params} "
                "(and data.batch_size)"
            ) from exc
        hint = hint or f"check {params}; --debug prints the traceback"
        raise error(f"{key} {path} failed: {first_line(exc, named=True)} ({hint})") from exc


# How each configured factory is called, for the refusal of one that cannot be.
_CALLS = {
    "data.prepare": "config, out_dir",
    "data.factory": "config, data_dir",
    "model.factory": "config",
    "optimizer.factory": "model, config",
    "scheduler.factory": "optimizer, config",
    "training.callbacks": "config",
}
_TYPE_NAMES = {
    torch.nn.Module: "torch.nn.Module",
    torch.optim.Optimizer: "torch.optim.Optimizer",
    torch.optim.lr_scheduler.LRScheduler: "torch.optim.lr_scheduler.LRScheduler",
}


class _Factory:
    """A configured factory: a call the function cannot take, what it raises (see
    :func:`factory_errors`) and a result of the wrong type are one line naming its key."""

    __slots__ = ("target", "path", "key", "returns")

    def __init__(self, target: Callable[..., Any], path: str, key: str, returns: type | None) -> None:
        self.target, self.path, self.key, self.returns = target, path, key, returns

    def __call__(self, *args: Any) -> Any:
        try:
            inspect.signature(self.target).bind(*args)
        except TypeError as exc:
            call = _CALLS.get(self.key, ", ".join(["..."] * len(args)))
            raise ConfigError(
                f"{self.key}: {self.path} cannot be called as f({call}) ({exc}): name a function "
                "with that signature"
            ) from None
        except ValueError:  # no signature to check (some built-ins): the call tells
            pass
        with factory_errors(self.key, self.path):
            result = self.target(*args)
        if self.returns is not None and not isinstance(result, self.returns):
            wanted = _TYPE_NAMES.get(self.returns, f"{self.returns.__module__}.{self.returns.__qualname__}")
            raise ConfigError(f"{self.key}: {self.path} returned {type(result).__name__}, not a {wanted}")
        return result


def defining_module(path: str, key: str) -> str:
    """The module that defines the function ``path`` names (a re-exported factory names the
    module it comes from): where the model's code starts."""
    return getattr(resolve(path, key).target, "__module__", None) or path.partition(":")[0]


def resolve(path: str, key: str, *, returns: type | None = None) -> Callable[..., Any]:
    """Import ``module:attr``; errors name the config key that held the path. The callable
    returned checks its arguments against the function's signature, turns what the function
    raises into one line naming ``key`` (see :class:`_Factory`) and, with ``returns``, checks
    the type of its result."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}: {path!r} must look like 'package.module:function'")
    if not _DOTTED.fullmatch(module_name) or not _DOTTED.fullmatch(attr) or module_name.endswith(".py"):
        stem = Path(module_name).name.removesuffix(".py")
        stem = stem if stem.isidentifier() else "module"
        raise ConfigError(
            f"{key}: {path!r} is not an import path: write 'package.module:function' with dotted names "
            f"(no file path, no '..', no '.py'), e.g. '{stem}:function' for {stem}.py in the folder the "
            "scripts run in or on PYTHONPATH"
        )
    try:
        with importable_working_folder():
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and missing != module_name and not module_name.startswith(missing + "."):
            raise ConfigError(
                f"{key}: module {module_name!r} imports {missing!r}, which is not installed here ({exc})"
            ) from exc
        raise ConfigError(
            f"{key}: cannot import module {module_name!r} ({exc}); is it on PYTHONPATH?"
        ) from None
    except (KeyboardInterrupt, PipelineError):
        raise
    except BaseException as exc:  # the module's own code failed as it was imported (any error, or an exit)
        raise ConfigError(
            f"{key}: importing module {module_name!r} raised {first_line(exc, named=True)} "
            "(--debug prints the traceback)"
        ) from exc
    target = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(f"{key}: module {module_name!r} has no attribute {attr!r}")
    if not callable(target):
        raise ConfigError(f"{key}: {path!r} is not callable")
    return _Factory(target, path, key, returns)


def _optimizer_kwargs(config: Config) -> dict[str, Any]:
    params = read_params(
        config.optimizer.params, "optimizer.params", {"betas": (list, [0.9, 0.999]), "eps": (float, 1e-8)}
    )
    betas = params["betas"]
    if len(betas) != 2 or not all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas
    ):
        raise ConfigError(f"optimizer.params.betas must be two numbers in [0, 1), got {betas}")
    if not 0 < params["eps"] < math.inf:
        raise ConfigError(f"optimizer.params.eps must be a finite number > 0 (got {params['eps']})")
    return {
        "lr": config.optimizer.lr,
        "betas": tuple(float(b) for b in params["betas"]),
        "eps": params["eps"],
    }


def adam(model: torch.nn.Module, config: Config) -> torch.optim.Optimizer:
    """Adam over every parameter, with L2 weight decay if configured."""
    return torch.optim.Adam(
        model.parameters(), weight_decay=config.optimizer.weight_decay, **_optimizer_kwargs(config)
    )


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
    params = read_params(
        config.scheduler.params, "scheduler.params", {"step_size": (int, 4), "gamma": (float, 0.5)}
    )
    if params["step_size"] < 1:
        raise ConfigError(f"scheduler.params.step_size must be >= 1 (got {params['step_size']})")
    if not 0 < params["gamma"] < math.inf:
        raise ConfigError(f"scheduler.params.gamma must be a finite number > 0 (got {params['gamma']})")
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=params["step_size"], gamma=params["gamma"])


def constant(optimizer: torch.optim.Optimizer, config: Config) -> torch.optim.lr_scheduler.LRScheduler:
    """Keep the base learning rate."""
    read_params(config.scheduler.params, "scheduler.params", {})
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def warmup_cosine(optimizer: torch.optim.Optimizer, config: Config) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_ratio`` of the base rate
    at ``training.max_steps`` (an extended run's first length), held after it."""
    params = read_params(
        config.scheduler.params, "scheduler.params", {"warmup_steps": (int, 10), "min_ratio": (float, 0.1)}
    )
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
