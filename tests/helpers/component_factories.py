"""A training-state component of the tests' own (tests/test_components.py): registered
through :func:`pipeline.checkpoint.register_component`, as a user's would be; and a task whose
data object has state of its own (``build_stateful_data``), saved in the ``data`` component.

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
from pipeline.tasks.regression import RegressionData, build_data

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


class StatefulData:
    """The default regression task, its loss weighed by a schedule of its own: the weight
    grows by a sixteenth at every loss computed, so a resume that does not give the task back
    its ``state_dict`` (the count and the weight, a float64 tensor) trains on other losses."""

    def __init__(self, base: RegressionData) -> None:
        self.base = base
        self.train_dataset = base.train_dataset
        self.calls = 0
        self.weight = torch.ones(1, dtype=torch.float64)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        loss = self.base.loss(model, batch) * self.weight
        self.calls += 1
        self.weight = self.weight * 1.0625
        return loss.sum()

    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        return self.base.evaluate(model, device)

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "weight": self.weight.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls, self.weight = state["calls"], state["weight"].clone()


def build_stateful_data(config: Any, data_dir: Path) -> StatefulData:
    return StatefulData(build_data(config, data_dir))
