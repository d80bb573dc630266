"""One optimizer step's gradients from ``training.grad_accum_steps`` micro-batches, clipped.

The step's micro-batches are read first, so each can be weighed by its rows before any
backward: micro-batch ``i`` of ``n_i`` rows (the global micro-batch's, whatever this rank's
share) enters the step's loss as ``mean_i * n_i / sum(n)``, which makes the loss the mean over
every row of the step, a short last batch of an epoch included (docs/training.md). Under
torchrun each rank's loss also carries the feed's ``scale`` (the ranks' mean of it is the
global micro-batch's), and the micro-batches before the last skip the gradient reduce.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch

from .run import TrainingRun
from .world import World

__all__ = ["accumulate_gradients", "clip_gradients", "effective_batch"]


def effective_batch(run: TrainingRun, world: World) -> str | None:
    """The line a run prints at its start: rows per optimizer step, and how they are made;
    ``None`` when that is simply ``data.batch_size`` in one process (nothing to say)."""
    rows, steps = run.config.data.batch_size, run.config.training.grad_accum_steps
    if steps == 1 and world.world_size == 1:
        return None
    line = f"effective batch: {rows * steps} rows per optimizer step ({steps} micro-batch"
    line += f"{'es' if steps > 1 else ''} of {rows}"
    if world.world_size > 1:
        line += f", each split over {world.world_size} processes"
    return line + ")"


def accumulate_gradients(run: TrainingRun, world: World) -> torch.Tensor:
    """Zero the gradients, then forward and backward every micro-batch of the next step (through
    the GradScaler, if any); return the step's loss as this rank's detached weighted sum (one
    process: the step's mean loss; :meth:`World.global_loss` of it is, under torchrun too)."""
    steps = run.config.training.grad_accum_steps
    # Every batch of the step before any backward: their rows weigh them (module docstring).
    fetched = [(*run.feed.next_batch(), run.feed.rows) for _ in range(steps)]
    total = sum(rows for _, _, rows in fetched)

    def forward(batch: Any, scale: float, rows: int) -> torch.Tensor:
        with torch.autocast(
            run.device.type, dtype=run.autocast_dtype, enabled=run.autocast_dtype is not None
        ):
            loss = world.scaled_loss(run.data.loss(run.model, batch), scale)
        return loss if steps == 1 else loss * (rows / total)

    world.settle_buckets(run, lambda: forward(*fetched[0]))  # DDP's, before a process's first step
    run.optimizer.zero_grad(set_to_none=True)
    losses = []
    for index, (batch, scale, rows) in enumerate(fetched):
        with _gradient_sync(run.model, world, index == steps - 1):
            loss = forward(batch, scale, rows)
            (run.scaler.scale(loss) if run.scaler is not None else loss).backward()
        losses.append(loss.detach())
    summed = losses[0]
    for loss in losses[1:]:
        summed = summed + loss
    return summed


def clip_gradients(run: TrainingRun, *, logged: bool) -> float:
    """Clip the gradients to ``training.grad_clip`` (if set); return their norm before clipping at
    a step ``training.log_every`` logs, NaN at the others. Clipping computes the norm anyway;
    without it the norm costs one pass over the gradients, made at logged steps only, which
    reads them and changes nothing the step computes. Under fp16 AMP the norm is of the
    unscaled gradients."""
    clip = run.config.training.grad_clip
    if clip:
        if run.scaler is not None:
            run.scaler.unscale_(run.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), clip)
    elif logged:
        norm = torch.nn.utils.get_total_norm([p.grad for p in run.model.parameters() if p.grad is not None])
        if run.scaler is not None:  # still scaled: the GradScaler unscales them in its step
            norm = norm / run.scaler.get_scale()
    if not logged:
        return math.nan
    full = getattr(norm, "full_tensor", None)  # FSDP2's sharded gradients give a DTensor
    return float(full() if full is not None else norm)


@contextlib.contextmanager
def _gradient_sync(model: torch.nn.Module, world: World, sync: bool) -> Iterator[None]:
    """The gradient reduce of DDP and FSDP2 on (``sync``: the step's last micro-batch) or
    off: gradients then add up locally, reduced once with the last one's."""
    if sync or world.mode not in ("ddp", "fsdp2"):
        yield
    elif world.mode == "ddp":
        with model.no_sync():
            yield
    else:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
