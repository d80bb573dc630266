"""Check a restored training state before any of it touches a live object.

``meta.json`` is sealed and the tensors hashed, but a sealed file can still be hostile or
written by a buggy version, so :func:`validated_state` joins every component (each tensor
referenced once), then checks each against the objects just built from the config:
types per field, finite hyperparameters, optimizer state shaped like the parameters it
belongs to, a sane integer step matching the history, sampler positions and RNG states
that a scratch object accepts, a data source record that belongs to this run's inputs.
Any failure is one :class:`~pipeline.errors.StateMismatch` (a source that changed: a
:class:`~pipeline.errors.DataError`) naming the field; nothing live has been changed by then.
"""

from __future__ import annotations

import math
import random
from typing import Any, Mapping

import numpy as np
import torch

from ..data import make_sampler
from ..errors import SEALED_BUT_UNFIT, StateMismatch
from ..rng import RNG_FAMILIES
from ..run import TrainingRun
from .codec import join_state
from .evaluations import PREFIX, evaluations_from

__all__ = ["HISTORY", "validated_state"]

HISTORY = ("step", "loss", "lr")
_STATE_KEYS = {"optimizer", "scheduler", "data", "rng", "scaler", "progress"}


def _fail(where: str, why: str) -> StateMismatch:
    return StateMismatch(f"training_state.{where} {why}: {SEALED_BUT_UNFIT}")


def _like(saved: Any, live: Any, where: str) -> None:
    """``saved`` has the structure and types of ``live`` (a freshly built object's state).
    Floats are finite unless the live value is not (a scheduler's ``best = inf``)."""
    if live is None:
        return  # set later in a run (say, a scheduler's last metric): any plain value
    if isinstance(live, bool) or isinstance(live, str):
        if type(saved) is not type(live):
            raise _fail(where, f"is {saved!r}, expected a {type(live).__name__}")
    elif isinstance(live, int):
        if type(saved) is not int:
            raise _fail(where, f"is {saved!r}, expected an integer")
    elif isinstance(live, float):
        if type(saved) is not float or (math.isfinite(live) and not math.isfinite(saved)):
            raise _fail(where, f"is {saved!r}, expected a finite number")
    elif isinstance(live, (list, tuple)):
        if type(saved) is not type(live) or len(saved) != len(live):
            raise _fail(where, f"is not a {type(live).__name__} of {len(live)} items")
        for index, (s, v) in enumerate(zip(saved, live)):
            _like(s, v, f"{where}[{index}]")
    elif isinstance(live, dict):
        if not isinstance(saved, dict) or set(saved) != set(live):
            odd = sorted(map(str, set(saved) ^ set(live))) if isinstance(saved, dict) else []
            raise _fail(
                where, f"does not have the expected fields{f' (differs at {odd[:3]})' if odd else ''}"
            )
        for key in live:
            _like(saved[key], live[key], f"{where}.{key}")
    elif isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.dtype != live.dtype or saved.shape != live.shape:
            raise _fail(where, f"is not a {live.dtype} tensor of shape {tuple(live.shape)}")


def _optimizer(saved: Any, optimizer: torch.optim.Optimizer) -> None:
    live = optimizer.state_dict()
    if not isinstance(saved, dict) or set(saved) != {"state", "param_groups"}:
        raise _fail("optimizer", "is not an optimizer state (state, param_groups)")
    groups = saved["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(live["param_groups"]):
        raise _fail("optimizer.param_groups", f"does not hold {len(live['param_groups'])} groups")
    for index, (group, fresh) in enumerate(zip(groups, live["param_groups"])):
        if not isinstance(group, dict) or group.get("params") != fresh["params"]:
            raise _fail(f"optimizer.param_groups[{index}].params", "differ from this model's parameters")
        _like(
            {k: v for k, v in group.items() if k != "params"},
            {k: v for k, v in fresh.items() if k != "params"},
            f"optimizer.param_groups[{index}]",
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = saved["state"]
    if not isinstance(state, dict):
        raise _fail("optimizer.state", "is not a mapping")
    for key, entry in state.items():
        if type(key) is not int or not 0 <= key < len(params):
            raise _fail("optimizer.state", f"names parameter {key!r}, this model has {len(params)}")
        if not isinstance(entry, dict):
            raise _fail(f"optimizer.state[{key}]", "is not a mapping")
        for name, value in entry.items():
            where = f"optimizer.state[{key}].{name}"
            if isinstance(value, torch.Tensor):
                if value.numel() == 1 and value.dim() <= 1:
                    if value.is_floating_point() and not math.isfinite(float(value)):
                        raise _fail(where, f"is {float(value)}")
                elif value.shape != params[key].shape:
                    raise _fail(
                        where, f"has shape {tuple(value.shape)}, the parameter {tuple(params[key].shape)}"
                    )
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise _fail(where, f"is {value!r}, expected a tensor or a finite number")


def _progress(
    state: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], run: TrainingRun, step: int | None
) -> int:
    progress = state["progress"]
    if not isinstance(progress, dict) or set(progress) != {"step"}:
        raise _fail("progress", "is not {step}")
    value = progress["step"]
    if type(value) is not int or value < 0:
        raise _fail("progress.step", f"is {value!r}, expected an integer >= 0")
    if step is not None and value != step:
        raise _fail("progress.step", f"is {value}, the checkpoint is step {step}")
    if value > run.config.training.max_steps:
        raise _fail("progress.step", f"is {value}, past training.max_steps {run.config.training.max_steps}")
    history = {key: tensors.get(f"history/{key}") for key in HISTORY}
    expected = {"step": torch.int64, "loss": torch.float64, "lr": torch.float64}
    for key, tensor in history.items():
        if tensor is None or tensor.dtype != expected[key] or tensor.shape != (value,):
            raise _fail(f"history/{key}", f"is not {value} {expected[key]} values")
    if not torch.equal(history["step"], torch.arange(1, value + 1, dtype=torch.int64)):
        raise _fail("history/step", "does not count 1, 2, ... step")
    return value


def _scratch_rng(rng: Any, generator: np.random.Generator) -> None:
    """Load each family into a throwaway generator: what they accept, the live ones will."""
    if not isinstance(rng, dict) or set(rng) != set(RNG_FAMILIES):
        raise _fail("rng", f"does not hold exactly {', '.join(RNG_FAMILIES)}")
    checks = {
        "python": lambda s: random.Random().setstate(s),
        "numpy_generator": lambda s: setattr(type(generator.bit_generator)(), "state", s),
        "numpy_legacy": lambda s: np.random.RandomState().set_state(s),
        "torch_cpu": lambda s: torch.Generator().set_state(s),
    }
    for family, check in checks.items():
        try:
            check(rng[family])
        except (TypeError, ValueError, KeyError, RuntimeError, OverflowError) as exc:
            raise _fail(f"rng.{family}", f"is not a valid state ({type(exc).__name__})") from None
    if not isinstance(rng["torch_cuda"], list) or not all(
        isinstance(t, torch.Tensor) for t in rng["torch_cuda"]
    ):
        raise _fail("rng.torch_cuda", "is not a list of byte tensors")


def validated_state(
    run: TrainingRun,
    state: Any,
    tensors: Mapping[str, torch.Tensor],
    *,
    step: int | None = None,
    optimizer: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Join and check every component of ``state`` against ``run`` (nothing is loaded):
    ``{"optimizer", "scheduler", "sampler", "task", "scaler", "rng", "step"}``.

    ``optimizer``: for a torchrun run, this rank's live optimizer state in
    ``torch.distributed.checkpoint``'s flattened form (what its checkpoints hold); the
    saved one must have its structure and types (default: torch's ``state_dict`` form)."""
    if not isinstance(state, dict) or set(state) != _STATE_KEYS:
        raise _fail("", "does not hold exactly optimizer, scheduler, data, rng, scaler, progress")
    data = state["data"]
    if not isinstance(data, dict) or set(data) != {"sampler", "task", "source"}:
        raise _fail("data", "does not hold exactly sampler, task, source")
    used: set[str] = set()
    try:
        joined = {
            "optimizer": join_state(state["optimizer"], tensors, used, "optimizer"),
            "scheduler": join_state(state["scheduler"], tensors, used, "scheduler"),
            "sampler": join_state(data["sampler"], tensors, used, "data/sampler"),
            "task": join_state(data["task"], tensors, used, "data/task"),
            "scaler": join_state(state["scaler"], tensors, used, "scaler"),
            "rng": join_state(state["rng"], tensors, used, "rng"),
        }
    except KeyError as exc:
        raise _fail("", f"references tensor {exc.args[0]!r}, which the state file lacks") from None
    except ValueError as exc:
        raise _fail("", f"is malformed: {exc}") from None
    except RecursionError:
        raise _fail("", "is nested too deeply") from None
    unused = sorted(
        set(tensors)
        - used
        - {f"history/{key}" for key in HISTORY}
        - {k for k in tensors if k.startswith(PREFIX)}
    )
    if unused:
        raise _fail("", f"does not reference tensor {unused[0]!r} of the state file")
    joined["source"] = data["source"]  # plain JSON, checked by the feed below
    joined["step"] = _progress(state, tensors, run, step)
    joined["evaluations"] = evaluations_from(tensors, joined["step"])
    if optimizer is None:
        _optimizer(joined["optimizer"], run.optimizer)
    else:
        _like(joined["optimizer"], dict(optimizer), "optimizer")
    _like(joined["scheduler"], run.scheduler.state_dict(), "scheduler")
    last_epoch = joined["scheduler"].get("last_epoch")
    if last_epoch is not None and last_epoch != joined["step"]:
        # train_step steps the scheduler once per optimizer step, from 0 after construction.
        raise _fail("scheduler.last_epoch", f"is {last_epoch}, the run is at step {joined['step']}")
    if (joined["scaler"] is None) != (run.scaler is None):
        raise StateMismatch("the checkpoint and this run disagree on AMP GradScaler use (training.amp)")
    if run.scaler is not None:
        _like(joined["scaler"], run.scaler.state_dict(), "scaler")
    _scratch_rng(joined["rng"], run.generator)
    _data(joined, run)
    return joined


def _data(joined: dict[str, Any], run: TrainingRun) -> None:
    """The sampler's position loads into a scratch sampler; the source record belongs to this
    run's feed (same kind, size and fingerprint, or a stream position of this very source:
    :meth:`pipeline.data.Feed.check_state`, one line naming what differs)."""
    run.feed.check_state(joined["source"])
    scratch = make_sampler(run.data, np.random.Generator(np.random.PCG64(0)), run.config)
    if scratch is None or joined["sampler"] is None:
        if (scratch is None) != (joined["sampler"] is None):
            raise _fail(
                "data.sampler", "is missing" if scratch is not None else "is set, but a stream has no sampler"
            )
        return
    try:
        scratch.load_state_dict(joined["sampler"])
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise _fail(
            "data.sampler", f"does not fit this data ({str(exc).splitlines()[0] if str(exc) else exc!r})"
        ) from None
