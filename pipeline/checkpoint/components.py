"""The components of a run's training state besides its weights and its progress: one
table, which the single-process and the distributed checkpointers capture and restore from,
the validator checks, and the resume proof (script 03) runs a negative control for.

==============  =========================================================================
``rng``         Python, NumPy (the run's Generator and the legacy state), torch CPU and CUDA;
                restored last. Under torchrun each rank's own, in ``rng/rank-R``
``optimizer``   ``optimizer.state_dict()``; under torchrun each rank's shard, through DCP
``scheduler``   the learning-rate schedule's position
``data``        the sampler's position, the task data's own state, and the feed's
                ``source`` record (its size and fingerprint, or a stream's positions)
``scaler``      the AMP GradScaler (``training.amp`` fp16 only; else ``None``)
``callbacks``   each callback's own state (``state_dict``, plain JSON) and the record of a
                stop a callback asked for (:mod:`pipeline.callbacks`)
==============  =========================================================================

A component more (an EMA of the weights, a state of the task's own...) is one
:class:`Component` given to :func:`register_component`: it is then saved in every checkpoint (under
torchrun once, by rank 0, with the state every rank shares), checked against the freshly
built run before anything is set, restored on resume, left out by
``TrainingHooks(skip_restore=...)`` and proved to matter by script 03's ``omit-NAME``
control. Its tensors are stored under ``NAME/...``; its state must be the same on every
rank of a launch.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch

from ..config import Config
from ..data import make_sampler
from ..errors import SEALED_BUT_UNFIT, StateMismatch, first_line
from ..rng import RNG_FAMILIES, capture_rng, restore_rng
from ..run import TrainingRun
from .codec import join_state, split_state

__all__ = [
    "Component",
    "register_component",
    "unregister_component",
    "components",
    "component_names",
    "fail",
    "like",
    "capture_data",
    "restore_order",
]


def _always(config: Config) -> bool:
    return True


@dataclass(frozen=True, kw_only=True, slots=True)
class Component:
    """One part of the training state (see the module docstring)."""

    name: str
    """Its key in meta.json's ``training_state``, the prefix of its tensors, and what
    ``skip_restore`` and script 03's ``omit-NAME`` control call it."""
    live: Callable[[TrainingRun], Any]
    """The run's current state of it: nested dicts, lists, tuples, numbers, strings,
    tensors and NumPy arrays (no other objects: nothing is pickled); ``None`` for none.
    The resume proof compares it before and after a control."""
    restore: Callable[[TrainingRun, Any], None]
    """Set a state :attr:`check` accepted (as :attr:`live` gave it) into the run."""
    check: Callable[[TrainingRun, Any, int], None] | None = None
    """``(run, saved state, the checkpoint's step)``: raise :class:`StateMismatch` (use
    :func:`fail`) for a saved state that does not fit the freshly built run; nothing is set
    yet. By default the saved state must have the structure and types of :attr:`live`'s on
    the fresh run (:func:`like`)."""
    capture: Callable[[TrainingRun, dict[str, torch.Tensor]], Any] | None = None
    """``(run, tensor table)``: the JSON tree to save, its tensors added to the table. By
    default :attr:`live` split under ``NAME/`` (:func:`pipeline.checkpoint.codec.split_state`)."""
    join: Callable[[Any, Mapping[str, torch.Tensor], set[str]], Any] | None = None
    """``(tree, tensor table, names used)``: the saved state back from its tree (the inverse
    of :attr:`capture`). By default :func:`pipeline.checkpoint.codec.join_state`."""
    proved: Callable[[Config], bool] = _always
    """Whether script 03 runs its ``omit-NAME`` control for a run of this config (a
    component the run does not have cannot be left out)."""
    restored_last: bool = False
    """Restored after every other component (the RNGs: anything set after them might draw)."""
    per_rank: bool = False
    """Under torchrun each rank saves its own (the optimizer's shard, the RNGs), by the
    distributed checkpointer's own means; the others are saved once, by rank 0."""
    absent: Callable[[], Any] | None = None
    """A built-in component added after checkpoints without it were written: the saved state
    such a checkpoint stands for (``None``: a checkpoint without it is refused)."""

    def captured(self, run: TrainingRun, tensors: dict[str, torch.Tensor]) -> Any:
        if self.capture is not None:
            return self.capture(run, tensors)
        state = self.live(run)
        return None if state is None else split_state(state, self.name, tensors)

    def joined(self, tree: Any, tensors: Mapping[str, torch.Tensor], used: set[str]) -> Any:
        if self.join is not None:
            return self.join(tree, tensors, used)
        return join_state(tree, tensors, used, self.name)

    def checked(self, run: TrainingRun, saved: Any, step: int) -> None:
        if self.check is not None:
            self.check(run, saved, step)
        else:
            like(saved, self.live(run), self.name)


def fail(where: str, why: str) -> StateMismatch:
    return StateMismatch(f"training_state.{where} {why}: {SEALED_BUT_UNFIT}")


def like(saved: Any, live: Any, where: str) -> None:
    """``saved`` has the structure and types of ``live`` (a freshly built object's state).
    Floats are finite unless the live value is not (a scheduler's ``best = inf``)."""
    if live is None:
        return  # set later in a run (say, a scheduler's last metric): any plain value
    if isinstance(live, bool) or isinstance(live, str):
        if type(saved) is not type(live):
            raise fail(where, f"is {saved!r}, expected a {type(live).__name__}")
    elif isinstance(live, int):
        if type(saved) is not int:
            raise fail(where, f"is {saved!r}, expected an integer")
    elif isinstance(live, float):
        if type(saved) is not float or (math.isfinite(live) and not math.isfinite(saved)):
            raise fail(where, f"is {saved!r}, expected a finite number")
    elif isinstance(live, (list, tuple)):
        if type(saved) is not type(live) or len(saved) != len(live):
            raise fail(where, f"is not a {type(live).__name__} of {len(live)} items")
        for index, (s, v) in enumerate(zip(saved, live)):
            like(s, v, f"{where}[{index}]")
    elif isinstance(live, dict):
        if not isinstance(saved, dict) or set(saved) != set(live):
            odd = sorted(map(str, set(saved) ^ set(live))) if isinstance(saved, dict) else []
            raise fail(where, f"does not have the expected fields{f' (differs at {odd[:3]})' if odd else ''}")
        for key in live:
            like(saved[key], live[key], f"{where}.{key}")
    elif isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.dtype != live.dtype or saved.shape != live.shape:
            raise fail(where, f"is not a {live.dtype} tensor of shape {tuple(live.shape)}")


def _optimizer(saved: Any, optimizer: torch.optim.Optimizer) -> None:
    live = optimizer.state_dict()
    if not isinstance(saved, dict) or set(saved) != {"state", "param_groups"}:
        raise fail("optimizer", "is not an optimizer state (state, param_groups)")
    groups = saved["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(live["param_groups"]):
        raise fail("optimizer.param_groups", f"does not hold {len(live['param_groups'])} groups")
    for index, (group, fresh) in enumerate(zip(groups, live["param_groups"])):
        if not isinstance(group, dict) or group.get("params") != fresh["params"]:
            raise fail(f"optimizer.param_groups[{index}].params", "differ from this model's parameters")
        like(
            {k: v for k, v in group.items() if k != "params"},
            {k: v for k, v in fresh.items() if k != "params"},
            f"optimizer.param_groups[{index}]",
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = saved["state"]
    if not isinstance(state, dict):
        raise fail("optimizer.state", "is not a mapping")
    for key, entry in state.items():
        if type(key) is not int or not 0 <= key < len(params):
            raise fail("optimizer.state", f"names parameter {key!r}, this model has {len(params)}")
        if not isinstance(entry, dict):
            raise fail(f"optimizer.state[{key}]", "is not a mapping")
        for name, value in entry.items():
            where = f"optimizer.state[{key}].{name}"
            if isinstance(value, torch.Tensor):
                if value.numel() == 1 and value.dim() <= 1:
                    if value.is_floating_point() and not math.isfinite(float(value)):
                        raise fail(where, f"is {float(value)}")
                elif value.shape != params[key].shape:
                    raise fail(
                        where, f"has shape {tuple(value.shape)}, the parameter {tuple(params[key].shape)}"
                    )
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise fail(where, f"is {value!r}, expected a tensor or a finite number")


def _scheduler(run: TrainingRun, saved: Any, step: int) -> None:
    like(saved, run.scheduler.state_dict(), "scheduler")
    last_epoch = saved.get("last_epoch")
    if last_epoch is not None and last_epoch != step:
        # train_step steps the scheduler once per optimizer step, from 0 after construction.
        raise fail("scheduler.last_epoch", f"is {last_epoch}, the run is at step {step}")


def _scaler(run: TrainingRun, saved: Any, step: int) -> None:
    if (saved is None) != (run.scaler is None):
        raise StateMismatch("the checkpoint and this run disagree on AMP GradScaler use (training.amp)")
    if run.scaler is not None:
        like(saved, run.scaler.state_dict(), "scaler")


def _scratch_rng(rng: Any, generator: np.random.Generator) -> None:
    """Load each family into a throwaway generator: what they accept, the live ones will."""
    if not isinstance(rng, dict) or set(rng) != set(RNG_FAMILIES):
        raise fail("rng", f"does not hold exactly {', '.join(RNG_FAMILIES)}")
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
            raise fail(f"rng.{family}", f"is not a valid state ({type(exc).__name__})") from None
    if not isinstance(rng["torch_cuda"], list) or not all(
        isinstance(t, torch.Tensor) for t in rng["torch_cuda"]
    ):
        raise fail("rng.torch_cuda", "is not a list of byte tensors")


def capture_data(run: TrainingRun, tensors: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """The ``data`` component: the sampler's position, the task's own state, and the feed's
    ``source`` record (JSON). With ``tensors``, split for a checkpoint (tensors added there);
    without, the live values (copies of the sampler's and task's, for comparisons). Under
    torchrun a stream's record gathers every rank's position: every rank calls this together."""
    task_state = getattr(run.data, "state_dict", None)
    sampler = run.sampler.state_dict() if run.sampler is not None else None
    task = task_state() if task_state else None
    if tensors is None:
        return copy.deepcopy({"sampler": sampler, "task": task, "source": run.feed.state_dict()})
    return {
        "sampler": split_state(sampler, "data/sampler", tensors) if sampler is not None else None,
        "task": split_state(task, "data/task", tensors) if task_state else None,
        "source": run.feed.state_dict(),
    }


def _join_data(data: Any, tensors: Mapping[str, torch.Tensor], used: set[str]) -> dict[str, Any]:
    if not isinstance(data, dict) or set(data) != {"sampler", "task", "source"}:
        raise fail("data", "does not hold exactly sampler, task, source")
    return {
        "sampler": join_state(data["sampler"], tensors, used, "data/sampler"),
        "task": join_state(data["task"], tensors, used, "data/task"),
        "source": data["source"],  # plain JSON, checked by the feed (_data)
    }


def _restore_data(run: TrainingRun, saved: dict[str, Any]) -> None:
    """The sampler, then the task's own state."""
    if run.sampler is not None:
        run.sampler.load_state_dict(saved["sampler"])
    run.feed.load_state_dict(saved["source"])
    if saved["task"] is not None:
        run.data.load_state_dict(saved["task"])


def _data(run: TrainingRun, joined: dict[str, Any], step: int) -> None:
    """The sampler's position loads into a scratch sampler; the source record belongs to this
    run's feed (same kind, size and fingerprint, or a stream position of this very source:
    :meth:`pipeline.data.Feed.check_state`, one line naming what differs)."""
    run.feed.check_state(joined["source"])
    scratch = make_sampler(run.data, np.random.Generator(np.random.PCG64(0)), run.config)
    if scratch is None or joined["sampler"] is None:
        if (scratch is None) != (joined["sampler"] is None):
            raise fail(
                "data.sampler", "is missing" if scratch is not None else "is set, but a stream has no sampler"
            )
        return
    try:
        scratch.load_state_dict(joined["sampler"])
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise fail("data.sampler", f"does not fit this data ({first_line(exc, limit=None)})") from None


def _no_callbacks() -> dict[str, Any]:
    return {"stopped": None, "states": {}}


def _restore_scaler(run: TrainingRun, saved: Any) -> None:
    if run.scaler is not None:
        run.scaler.load_state_dict(saved)


# In script 03's report order; restored in this order too, the RNGs last.
_TABLE: list[Component] = [
    Component(
        name="rng",
        live=lambda run: capture_rng(run.generator),
        restore=lambda run, saved: restore_rng(saved, run.generator, need_cuda=run.device.type == "cuda"),
        check=lambda run, saved, step: _scratch_rng(saved, run.generator),
        restored_last=True,
        per_rank=True,
    ),
    Component(
        name="optimizer",
        live=lambda run: run.optimizer.state_dict(),
        restore=lambda run, saved: run.optimizer.load_state_dict(saved),
        check=lambda run, saved, step: _optimizer(saved, run.optimizer),
        per_rank=True,
    ),
    Component(
        name="scheduler",
        live=lambda run: run.scheduler.state_dict(),
        restore=lambda run, saved: run.scheduler.load_state_dict(saved),
        check=_scheduler,
    ),
    Component(
        name="data",
        live=lambda run: capture_data(run, None),
        restore=_restore_data,
        check=_data,
        capture=capture_data,
        join=_join_data,
    ),
    Component(
        name="scaler",
        live=lambda run: run.scaler.state_dict() if run.scaler is not None else None,
        restore=_restore_scaler,
        check=_scaler,
        proved=lambda config: config.training.amp == "fp16",
    ),
    Component(
        name="callbacks",
        live=lambda run: run.callbacks.state(),
        restore=lambda run, saved: run.callbacks.load(saved),
        check=lambda run, saved, step: run.callbacks.check(saved, step),
        # Plain JSON, in meta.json: no tensor is ever looked up for it.
        capture=lambda run, tensors: run.callbacks.state(),
        join=lambda tree, tensors, used: tree,
        proved=lambda config: bool(config.training.early_stopping_patience or config.training.callbacks),
        absent=_no_callbacks,
    ),
]
_BUILT_IN = frozenset(component.name for component in _TABLE)
# Not components: the weights (their own files) and the progress (step and history).
_RESERVED = frozenset({"model", "progress", "history"})


def register_component(component: Component) -> None:
    """Add ``component`` to every run's training state from now on (in this process: a
    torchrun launch registers it on every rank, a resume proof in each leg's process too,
    for instance in the module of the task's factory)."""
    if component.name in _RESERVED or any(c.name == component.name for c in _TABLE):
        raise ValueError(f"a training-state component named {component.name!r} exists already")
    if component.per_rank:
        raise ValueError(
            f"component {component.name!r}: per_rank is the distributed checkpointer's own (optimizer "
            "shards, RNG files); a registered component is the same on every rank"
        )
    if not component.name.isidentifier():
        raise ValueError(f"a component's name is a plain identifier (got {component.name!r})")
    _TABLE.append(component)


def unregister_component(name: str) -> None:
    """Remove a registered component (a built-in one stays)."""
    if name in _BUILT_IN:
        raise ValueError(f"{name!r} is a built-in component of the training state")
    _TABLE[:] = [c for c in _TABLE if c.name != name]


def components() -> tuple[Component, ...]:
    """Every component, in report order (restore: :func:`restore_order`)."""
    return tuple(_TABLE)


def restore_order() -> tuple[Component, ...]:
    """Every component in the order a resume sets them: the RNGs last."""
    return tuple(sorted(_TABLE, key=lambda c: c.restored_last))


def component_names() -> tuple[str, ...]:
    """What ``TrainingHooks.skip_restore`` may name."""
    return tuple(c.name for c in _TABLE)
