"""What ``data.factory(config, data_dir)`` returns: the task data, in one of three forms."""

from __future__ import annotations

from typing import Any, Final, Literal, Protocol

import torch

from ..errors import DataError

__all__ = ["InputForm", "BATCHES", "DATASET", "STREAM", "TaskData", "input_mode", "describe_inputs"]

InputForm = Literal["batches", "dataset", "stream"]
"""The three forms of a task's training inputs (:class:`TaskData`): ``get_batch``, a map-style
``train_dataset``, or a ``train_iterable``. A feed's saved state names it (its ``kind``), and
the resume proof's report (``data.mode``)."""

BATCHES: Final = "batches"
"""``num_train`` and ``get_batch(indices, device)``, called in the training process."""
DATASET: Final = "dataset"
"""A map-style ``train_dataset``, read by a ``DataLoader``."""
STREAM: Final = "stream"
"""A ``train_iterable`` with ``state_dict()`` / ``load_state_dict()``."""


class TaskData(Protocol):
    """The training inputs, the loss and the evaluation of a task.

    Required: ``loss(model, batch)`` and ``evaluate(model, device) -> {metric: float}``,
    and the training inputs as exactly one of:

    - ``num_train`` and ``get_batch(indices, device)``: batches built in the training process;
    - ``train_dataset``: anything with ``__len__`` and ``__getitem__`` (a
      ``torch.utils.data.Dataset``, a ``datasets.Dataset``), read by a ``DataLoader`` with
      ``data.num_workers`` workers, each sample seeded by (seed, epoch, index)
      (:mod:`pipeline.data.seeding`); optional ``collate(samples) -> batch`` (default:
      torch's ``default_collate``);
    - ``train_iterable``: a stream with ``state_dict()`` / ``load_state_dict()`` (a
      ``datasets.IterableDataset``), batched by ``data.batch_size``; optional ``collate``.

    Optional: ``make_sampler(generator, config) -> Sampler`` to replace the
    :class:`~pipeline.data.sampler.EpochSampler` (not for streams); ``state_dict()`` /
    ``load_state_dict(state)`` for state of its own (augmentation schedules, curriculum
    position); ``fingerprint``, a string that changes when the training set's content does
    (a ``datasets.Dataset`` has one); ``sample(model, device) -> str`` for the model card.
    """

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor: ...

    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]: ...


def input_mode(data: Any) -> InputForm:
    """Which of the three forms (:data:`InputForm`) ``data`` takes, refused in one line when it
    is none, or more than one."""
    forms: list[InputForm] = [
        name
        for name, present in (
            (BATCHES, callable(getattr(data, "get_batch", None))),
            (DATASET, getattr(data, "train_dataset", None) is not None),
            (STREAM, getattr(data, "train_iterable", None) is not None),
        )
        if present
    ]
    if len(forms) != 1:
        found = " and ".join(forms) if forms else "none of them"
        raise DataError(
            f"data.factory returned a {type(data).__name__} with {found}: give exactly one of get_batch "
            "(with num_train), train_dataset or train_iterable (docs/data.md)"
        )
    return forms[0]


def describe_inputs(data: Any, config: Any) -> dict[str, Any]:
    """What the resume proof's report says about the inputs it proved."""
    mode = input_mode(data)
    source = {
        BATCHES: data,
        DATASET: getattr(data, "train_dataset", None),
        STREAM: getattr(data, "train_iterable", None),
    }[mode]
    return {
        "mode": mode,
        "source": f"{type(source).__module__}.{type(source).__qualname__}",
        "num_workers": config.data.num_workers if mode == DATASET else 0,
        "stream_split": config.data.stream_split if mode == STREAM else None,
    }
