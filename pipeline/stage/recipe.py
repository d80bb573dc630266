"""The training recipe as the model card states it, and how the staged checkpoint was chosen.

Each fact is a small function of the staged record (``meta.json``) returning one row of the
card's training table, ``(label, value)``, or ``None`` when it does not apply; :data:`RECIPE`
lists them in the card's order, so a new setting is one function and one line there. A key an
older record lacks is read with its default, so every record the stage wrote still renders.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from .card_parts import number

__all__ = ["RECIPE", "Row", "recipe_rows", "selection_phrase"]

Row = tuple[str, str]


def _training(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    return meta["config"]["training"]


def _params(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{key} {value}" for key, value in sorted(params.items()))


def _per_process(rows: int, processes: int) -> str:
    """Rows of one micro-batch on each process: a contiguous slice, some one row longer when
    the batch does not divide (:meth:`pipeline.distributed.world.LaunchWorld.slice`)."""
    low, high = rows // processes, -(-rows // processes)
    return f"{low:,}" if low == high else f"{low:,} or {high:,}"


def effective_batch(meta: Mapping[str, Any]) -> Row:
    """Rows per optimizer step (``data.batch_size`` x ``training.grad_accum_steps``), and how a
    micro-batch splits over the processes of the launch that wrote the weights."""
    rows = meta["config"]["data"]["batch_size"]
    micro = _training(meta).get("grad_accum_steps", 1)
    processes = meta["training"]["launch"]["world_size"]
    text = f"{rows * micro:,} rows per optimizer step"
    if micro > 1:
        text += f" ({micro} micro-batches of {rows:,}, their gradients accumulated)"
    if processes > 1:
        text += (
            f"; each micro-batch split over {processes} processes, {_per_process(rows, processes)} rows each"
        )
    return ("effective batch", text)


def gradient_clipping(meta: Mapping[str, Any]) -> Row:
    clip = _training(meta).get("grad_clip", 0.0)
    return ("gradient clipping", f"total L2 norm clipped to {clip}" if clip else "none")


def precision(meta: Mapping[str, Any]) -> Row:
    training = _training(meta)
    amp = training.get("amp", "none")
    mixed = {
        "none": "no mixed precision",
        "bf16": "autocast to bfloat16",
        "fp16": "autocast to float16, losses scaled by a GradScaler",
    }.get(amp, f"AMP {amp}")
    return ("precision", f"{training['dtype']} parameters, {mixed}")


def optimizer(meta: Mapping[str, Any]) -> Row:
    config = meta["config"]["optimizer"]
    extra = _params(config.get("params", {}))
    return (
        "optimizer",
        f"`{config['factory']}`, lr {config['lr']}, weight decay {config['weight_decay']}"
        + (f", {extra}" if extra else ""),
    )


def schedule(meta: Mapping[str, Any]) -> Row:
    config = meta["config"]["scheduler"]
    extra = _params(config.get("params", {}))
    return (
        "schedule",
        f"`{config['factory']}`{' ' + extra if extra else ''}, stepped once per optimizer step",
    )


def evaluation(meta: Mapping[str, Any]) -> Row:
    every = _training(meta).get("eval_every", 0)
    if not every:
        return ("evaluation", "none during training")
    text = f"every {every:,} optimizer steps and at step {_training(meta)['max_steps']:,}"
    checkpoint = meta["config"].get("checkpoint", {})
    if checkpoint.get("best_metric"):
        text += (
            f"; the best by `{checkpoint['best_metric']}` ({checkpoint.get('best_mode', 'min')}) kept "
            "as `--checkpoint best`"
        )
    return ("evaluation", text)


def early_stopping(meta: Mapping[str, Any]) -> Row | None:
    training = _training(meta)
    patience = training.get("early_stopping_patience", 0)
    if not patience:
        return None
    checkpoint = meta["config"].get("checkpoint", {})
    return (
        "early stopping",
        f"after {patience:,} evaluations without an improvement of `{checkpoint.get('best_metric', '')}` "
        f"({checkpoint.get('best_mode', 'min')}) by more than {training.get('early_stopping_threshold', 0.0)}",
    )


def epochs(meta: Mapping[str, Any]) -> Row | None:
    count = _training(meta).get("epochs", 0)
    return ("epochs", f"{count:,} (`training.epochs`)") if count else None


RECIPE: tuple[Callable[[Mapping[str, Any]], Row | None], ...] = (
    effective_batch,
    gradient_clipping,
    precision,
    optimizer,
    schedule,
    evaluation,
    early_stopping,
    epochs,
)


def recipe_rows(meta: Mapping[str, Any]) -> list[Row]:
    """The recipe's rows for the staged record ``meta``, in :data:`RECIPE` order."""
    return [row for fact in RECIPE if (row := fact(meta)) is not None]


def selection_phrase(meta: Mapping[str, Any]) -> str | None:
    """How the staged checkpoint was chosen, when 05 took it as ``--checkpoint best``: its
    metric, mode and value as the checkpoint's own evaluations recorded them; else ``None``."""
    selected = meta.get("selected_as_best")
    if selected is None:
        return None
    return (
        f"selected as the best by `{selected['metric']}` ({selected['mode']}) = {number(selected['value'])} "
        f"at step {meta['step']:,} of {_training(meta)['max_steps']:,}"
    )
