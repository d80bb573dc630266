"""Build every object a training run consumes, in a fixed order, from the config."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch

from .callbacks import Callbacks, build_callbacks
from .config import Config
from .data import Feed, Sampler, TaskData, batches_per_epoch, load_task_data, make_feed, make_sampler
from .errors import ConfigError
from .factories import factory_errors, resolve
from .rng import seed_everything
from .world import World, resolve_device

__all__ = [
    "TrainingRun",
    "build_run",
    "resolve_device",
    "configure_determinism",
    "build_model",
    "make_sampler",
    "fresh_buffers",
    "with_counted_length",
    "counted_length",
]


@dataclass(kw_only=True, slots=True)
class TrainingRun:
    """Everything the training loop mutates; exactly what a checkpoint must capture."""

    config: Config
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data: TaskData
    sampler: Sampler | None
    """The one source of batch order (``None`` for a stream, whose order is its own)."""
    feed: Feed
    """Hands out each step's batch (:mod:`pipeline.data.feed`)."""
    generator: np.random.Generator
    scaler: torch.amp.GradScaler | None
    autocast_dtype: torch.dtype | None
    fresh_buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    """The persistent buffers as built, before any training or loading (see
    ``pipeline.checkpoint.weights.model_summary``)."""
    step: int = 0
    history: dict[str, list] = field(
        default_factory=lambda: {"step": [], "loss": [], "lr": [], "grad_norm": [], "epoch": []}
    )
    """One value per optimizer step: ``step``, ``loss``, ``lr``, ``grad_norm`` (before clipping, at
    the steps ``training.log_every`` logs; NaN at the others) and ``epoch`` (epochs done,
    fractional; NaN for a stream). Saved in every checkpoint (``history/*``)."""
    evaluations: dict[str, list] = field(default_factory=lambda: {"step": []})
    """``training.eval_every``'s results: the evaluated steps, and one list per metric the task's
    ``evaluate`` returns, in step order (:mod:`pipeline.evaluating`)."""
    callbacks: Callbacks = field(default_factory=Callbacks)
    """The run's callbacks, their state and a stop's record (:mod:`pipeline.callbacks`)."""


def configure_determinism(config: Config) -> None:
    """Ask torch for deterministic kernels. Safe to call more than once."""
    if not config.training.deterministic:
        return
    # cuBLAS needs this before its first use to be deterministic.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(True, warn_only=False)
    else:
        # The public call also imports the torch.compile stack (about 2 s per process) only
        # to set the compiler's own flag; without the compiler loaded, the kernel switch is
        # all there is to set. build_run calls this again after the factories ran, in case
        # one of them brought torch.compile in.
        torch._C._set_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.benchmark = False


def build_model(config: Config, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model alone, in the configured dtype (for evaluation and loading published weights).

    ``device="meta"`` builds it without weights: every parameter on ``meta`` (names, dtypes,
    shapes and ties, no memory), buffers computed on the CPU as usual, so the stage can check
    a checkpoint against a model of any size (accelerate's ``init_empty_weights`` does the same)."""
    factory = resolve(config.model.factory, "model.factory", returns=torch.nn.Module)
    empty = torch.device(device).type == "meta"
    with _parameters_on_meta() if empty else contextlib.nullcontext():
        model = factory(config)
    dtype = getattr(torch, config.training.dtype)
    if empty:
        return model.to(dtype=dtype)
    # Moving the model allocates it again, on the device and in the dtype: named the same way.
    with factory_errors(
        "model.factory", f"{config.model.factory} (its model moved to {device}, {config.training.dtype})"
    ):
        return model.to(device=torch.device(device), dtype=dtype)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Each parameter registered while the block runs moves to ``meta`` (its CPU memory freed
    at once); one already there is kept as is, so ``b.weight = a.weight`` still ties."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def fresh_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the persistent buffers of a model just built (positions, masks, tables, and
    still-untrained statistics), so a save can tell derived buffers from trained ones."""
    stored = model.state_dict()
    return {name: buffer.detach().clone() for name, buffer in model.named_buffers() if name in stored}


def build_run(
    config: Config,
    device: torch.device,
    *,
    schedule_steps: int | None = None,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    world: World | None = None,
) -> TrainingRun:
    """Seed, then construct model, optimizer, data and sampler, then the scheduler (which may
    need the run's length counted from the sampler: ``training.epochs``), the feed and the
    callbacks, in that order.

    Construction consumes randomness (weight init); on resume the saved RNG states are
    restored after this, so the order here only has to be the same in every process.
    ``schedule_steps``: the ``training.max_steps`` the scheduler factory sees, when it is not
    the run's (an extended run keeps the schedule of its first length; see ``train``).
    ``wrap`` (DDP, FSDP2) is applied to the model before the optimizer takes its parameters.
    ``world``: the processes the run trains in, whose rank the data feed reads for (by
    default, this process alone).
    """
    generator = seed_everything(config.training.seed)
    model = build_model(config, device)
    fresh = fresh_buffers(model)  # under the plain module's names, before a wrapper prefixes them
    if wrap is not None:
        model = wrap(model)
    optimizer = resolve(config.optimizer.factory, "optimizer.factory", returns=torch.optim.Optimizer)(
        model, config
    )
    data = load_task_data(config)
    sampler = make_sampler(data, generator, config)
    config = with_counted_length(config, sampler, schedule_steps)
    schedule_config = (
        config
        if schedule_steps is None
        else dataclasses.replace(
            config, training=dataclasses.replace(config.training, max_steps=schedule_steps)
        )
    )
    scheduler = resolve(
        config.scheduler.factory, "scheduler.factory", returns=torch.optim.lr_scheduler.LRScheduler
    )(optimizer, schedule_config)
    feed = make_feed(data, sampler, generator, config, device, world)
    configure_determinism(config)
    amp = config.training.amp
    scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None
    autocast_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(amp)
    callbacks = build_callbacks(config, data)
    return TrainingRun(
        config=config,
        device=device,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        data=data,
        sampler=sampler,
        feed=feed,
        generator=generator,
        scaler=scaler,
        autocast_dtype=autocast_dtype,
        fresh_buffers=fresh,
        callbacks=callbacks,
    )


def with_counted_length(config: Config, sampler: Sampler | None, first_length: int | None = None) -> Config:
    """``config`` with ``training.max_steps`` counted from ``training.epochs`` when that is how its
    length is given: the batches of ``epochs`` passes (:func:`~pipeline.data.batches_per_epoch`)
    over ``grad_accum_steps``, rounded up, so every batch of those epochs is trained. A length in
    steps is kept as it is. Both keys (a checkpoint records both; a file made from its
    ``meta.json`` holds both): the run's first length (``first_length``, an extended run's; else
    ``max_steps``) must be the count, or the pair is refused in one line."""
    training = config.training
    if not training.epochs:
        return config
    if sampler is None:
        raise ConfigError(
            f"{config.source}: training.epochs is {training.epochs}, but the task's training inputs are a "
            "stream, whose length is not known: give the run's length as training.max_steps"
        )
    batches = batches_per_epoch(sampler)
    if batches is None:
        raise ConfigError(
            f"{config.source}: training.epochs is {training.epochs}, but the task's sampler "
            f"({type(sampler).__name__}) does not say how many batches an epoch has (its __len__): give "
            "the run's length as training.max_steps, or give the sampler a __len__"
        )
    steps = -(-training.epochs * batches // training.grad_accum_steps)
    if training.max_steps is None:
        return dataclasses.replace(config, training=dataclasses.replace(training, max_steps=steps))
    if (first_length or training.max_steps) != steps:
        raise ConfigError(
            f"{config.source}: training.max_steps is {first_length or training.max_steps}, but training.epochs "
            f"{training.epochs} counts {steps} steps ({batches} batches an epoch, {training.grad_accum_steps} a "
            "step): give one of the two"
        )
    return config


def counted_length(config: Config) -> Config:
    """``config`` with its length in steps, counted from the task's data if ``training.epochs``
    gives it (a throwaway sampler: nothing of a run is built): for tools that plan a run before
    it trains (script 03)."""
    if not config.training.epochs:
        return config
    data = load_task_data(config)
    return with_counted_length(config, make_sampler(data, np.random.Generator(np.random.PCG64(0)), config))
