"""Callbacks and tasks of the tests' own (tests/test_callbacks.py), plugged in by import path in
``training.callbacks`` as a user's would be. Their settings come from the environment (a factory
sees the config only): ``STOP_AT`` (and ``STOP_RANK``), ``FAIL_IN``."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pipeline.config import Config
from pipeline.tasks.regression import build_data


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class LossSum:
    """State: the steps it heard and the float64 sum of their losses (order-sensitive bits), and
    every evaluation's metric names it heard."""

    def __init__(self) -> None:
        self.steps, self.total, self.evaluated, self.saved = 0, 0.0, [], []

    def on_step_end(self, run: Any, control: Any) -> None:
        self.steps += 1
        self.total += run.history["loss"][-1]

    def on_evaluate(self, run: Any, metrics: dict[str, float], control: Any) -> None:
        self.evaluated.append(sorted(metrics))

    def on_save(self, run: Any, checkpoint: Any, control: Any) -> None:
        self.saved.append(checkpoint.step)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "total": self.total, "evaluated": self.evaluated, "saved": self.saved}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.total = state["steps"], state["total"]
        self.evaluated, self.saved = state["evaluated"], state["saved"]


def loss_sum(config: Config) -> LossSum:
    return LossSum()


class StopAt:
    """Asks the run to stop after step ``STOP_AT`` (on rank ``STOP_RANK`` only, if set)."""

    def __init__(self) -> None:
        self.at = int(os.environ.get("STOP_AT", "0"))
        self.rank = os.environ.get("STOP_RANK")

    def on_step_end(self, run: Any, control: Any) -> None:
        if run.step == self.at and (self.rank is None or int(self.rank) == _rank()):
            control.should_training_stop = True
            control.stop_reason = f"asked to stop at step {self.at}"


def stop_at(config: Config) -> StopAt:
    return StopAt()


class Failing:
    """Raises in the event ``FAIL_IN`` names, at step 3."""

    def __init__(self) -> None:
        self.event = os.environ.get("FAIL_IN", "on_step_end")

    def on_step_end(self, run: Any, control: Any) -> None:
        if self.event == "on_step_end" and run.step == 3:
            raise RuntimeError("the callback's own bug")

    def on_save(self, run: Any, checkpoint: Any, control: Any) -> None:
        if self.event == "on_save":
            raise RuntimeError("the callback's own bug")


def failing(config: Config) -> Failing:
    return Failing()


class TupleState:
    def on_step_end(self, run: Any, control: Any) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"pair": (1, 2)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def tuple_state(config: Config) -> TupleState:
    return TupleState()


class SavesOnly:
    def state_dict(self) -> dict[str, Any]:
        return {}

    def on_save(self, run: Any, checkpoint: Any, control: Any) -> None:
        pass


def saves_only(config: Config) -> SavesOnly:
    return SavesOnly()


class Listener:
    """Hears each committed checkpoint: ``heard`` holds [the step it was heard at, its step]. Each
    step takes a tenth of a second (work of its own), so a background commit has time to end
    between two saves."""

    def __init__(self) -> None:
        self.heard: list[list[int]] = []

    def on_step_end(self, run: Any, control: Any) -> None:
        time.sleep(0.1)

    def on_save(self, run: Any, checkpoint: Any, control: Any) -> None:
        self.heard.append([run.step, checkpoint.step])

    def state_dict(self) -> dict[str, Any]:
        return {"heard": self.heard}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.heard = state["heard"]


def listener(config: Config) -> Listener:
    return Listener()


class ModeWatcher:
    """Hears whether the model is in training mode after each step and each evaluation:
    ``heard`` holds [hook, step, 1 for training mode, 0 for eval mode]."""

    def __init__(self) -> None:
        self.heard: list[list[Any]] = []

    def on_step_end(self, run: Any, control: Any) -> None:
        self.heard.append(["step_end", run.step, int(run.model.training)])

    def on_evaluate(self, run: Any, metrics: dict[str, float], control: Any) -> None:
        self.heard.append(["evaluate", run.step, int(run.model.training)])

    def state_dict(self) -> dict[str, Any]:
        return {"heard": self.heard}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.heard = state["heard"]


def mode_watcher(config: Config) -> ModeWatcher:
    return ModeWatcher()


def nothing(config: Config) -> None:
    return None


def a_function(config: Config) -> Any:
    """A callable, but not a callback: it has none of the events the loop calls."""

    def on_step_end(run: Any, control: Any) -> None:
        control.should_stop = True

    return on_step_end


class AsksEvaluation:
    """Asks for an evaluation of step 2 (a user's own schedule, not training.eval_every)."""

    def on_step_end(self, run: Any, control: Any) -> None:
        control.should_evaluate = run.step == 2


def asks_evaluation(config: Config) -> AsksEvaluation:
    return AsksEvaluation()


class _Sets:
    """The regression task, evaluated on two sets (its held-out rows, split in halves)."""

    def __init__(self, inner: Any, extra_from: int | None = None) -> None:
        self._inner, self._extra_from, self._calls = inner, extra_from, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def evaluate(self, model: Any, device: Any) -> dict[str, Any]:
        import torch

        self._calls += 1
        x, y = self._inner.heldout_x.to(device), self._inner.heldout_y.to(device)
        half = len(x) // 2
        with torch.no_grad():
            first = torch.nn.functional.mse_loss(model(x[:half]), y[:half]).item()
            second = torch.nn.functional.mse_loss(model(x[half:]), y[half:]).item()
        sets = {"validation": {"mse": first}, "test": {"mse": second}}
        if self._extra_from is not None and self._calls >= self._extra_from:
            sets["validation"]["mae"] = first  # a metric that appears later
        return sets


def build_data_two_sets(config: Config, data_dir: Path) -> _Sets:
    return _Sets(build_data(config, data_dir))


def build_data_metric_added_later(config: Config, data_dir: Path) -> _Sets:
    """Two sets; from its third evaluation in this process on, one metric more."""
    return _Sets(build_data(config, data_dir), extra_from=int(os.environ.get("EXTRA_FROM", "3")))


class LoadsOnly:
    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def on_save(self, run: Any, checkpoint: Any, control: Any) -> None:
        pass


def loads_only(config: Config) -> LoadsOnly:
    return LoadsOnly()


class _StepMetric(_Sets):
    """The regression task, whose evaluate also returns a metric named ``step``."""

    def evaluate(self, model: Any, device: Any) -> dict[str, Any]:
        return {"mse": super().evaluate(model, device)["validation"]["mse"], "step": 7.0}


def build_data_metric_named_step(config: Config, data_dir: Path) -> _StepMetric:
    return _StepMetric(build_data(config, data_dir))


class _Unsorted(_Sets):
    """The regression task, whose evaluate returns three metrics out of alphabetical order, one
    capitalised (``zeta, alpha, Mid``: sorted, ``Mid, alpha, zeta``); ``alpha`` jumps about
    with the weights, so its best is rarely the newest evaluation. From its ``RENAMED_FROM``-th
    evaluation in this process on, ``alpha`` and ``Mid`` are gone and ``beta``, ``Alpha`` new."""

    def evaluate(self, model: Any, device: Any) -> dict[str, Any]:
        mse = super().evaluate(model, device)["validation"]["mse"]
        total = sum(float(parameter.detach().abs().sum()) for parameter in model.parameters())
        if self._calls >= int(os.environ.get("RENAMED_FROM", "99")):
            return {"zeta": mse, "beta": total, "Alpha": mse / 2}
        return {"zeta": mse, "alpha": total * 1000.0 % 1.0, "Mid": mse / 2}


def build_data_unsorted_metrics(config: Config, data_dir: Path) -> _Unsorted:
    return _Unsorted(build_data(config, data_dir))
