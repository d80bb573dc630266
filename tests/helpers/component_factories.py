"""A training-state component of the tests' own (tests/test_components.py): registered
through :func:`pipeline.checkpoint.register_component`, as a user's would be.

Its state is the sum of the run's losses so far (a float64 tensor), the step it was taken
at and a label: the same on every rank of a launch. Each restore writes what it was given
to ``component-restored-rank<R>.json`` beside the run's checkpoint folder, so a test sees
what every rank received, in this process or in a torchrun launch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.checkpoint import Component, register_component, unregister_component

NAME = "loss_sum"


def live(run: Any) -> dict[str, Any]:
    return {
        "total": torch.tensor([sum(run.history["loss"])], dtype=torch.float64),
        "step": run.step,
        "label": "dummy",
    }


def restored_path(checkpoint_dir: Path, rank: int) -> Path:
    return Path(checkpoint_dir).parent / f"component-restored-rank{rank}.json"


def restore(run: Any, saved: dict[str, Any]) -> None:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    restored_path(run.config.checkpoint.dir, rank).write_text(
        json.dumps({"total": saved["total"].tolist(), "step": saved["step"], "label": saved["label"]})
    )


def component(**changes: Any) -> Component:
    return Component(**{"name": NAME, "live": live, "restore": restore, **changes})


def register() -> None:
    register_component(component())


def unregister() -> None:
    unregister_component(NAME)
