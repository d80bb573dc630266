"""Callbacks: the one extension point of the training loop, which its own features use too.

A callback is any object with some of these methods, a subset of transformers'
``TrainerCallback`` events (docs/training.md#callbacks):

``on_step_end(run, control)``           after every optimizer step (``run.step``, ``run.history``)
``on_evaluate(run, metrics, control)``  after an evaluation: ``{name: float}``, also in
                                        ``run.evaluations`` (several sets: ``"set/metric"``)
``on_save(run, checkpoint, control)``   once a checkpoint is committed (``checkpoint.step``,
                                        ``checkpoint.path``); a background save's at the end of
                                        the first step that finds it committed

``control`` (:class:`Control`) carries what the callbacks ask of the loop after the step:
stop, save, evaluate. A callback with ``state_dict()`` / ``load_state_dict(state)`` has its
state, plain JSON, saved in every checkpoint under its name and restored on resume (a
``check_state(state)`` may refuse a saved one before anything is set); one without is built
afresh by every start. Its name is its import path in ``training.callbacks``.

The built-ins are callbacks of this same interface, heard in this order: ``progress`` (the
report, :mod:`pipeline.progress`), ``schedule`` (the steps ``checkpoint.every`` saves and
``training.eval_every`` evaluates), ``early_stopping`` (:class:`EarlyStopping`), the user's,
then ``best`` (the best mark's save, :mod:`pipeline.evaluating`) and ``traces``
(:mod:`pipeline.traces`). The list, its state and a stop's record are :class:`Callbacks`
(``run.callbacks``); the training state component ``callbacks``
(:mod:`pipeline.checkpoint.components`) saves, checks and restores it.
"""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from .config import Config
from .errors import SEALED_BUT_UNFIT, CallbackFailed, ConfigError, StateMismatch
from .factories import factory_errors, resolve

__all__ = ["EVENTS", "Control", "Callbacks", "Schedule", "EarlyStopping", "build_callbacks"]

EVENTS = ("on_step_end", "on_evaluate", "on_save")
_HINT = "fix the callback; --debug prints the traceback"
_MAX_DEPTH = 32


def _ignore(text: str) -> None:
    pass


@dataclass(slots=True)
class Control:
    """What the callbacks ask of the loop after the current step (transformers'
    ``TrainerControl``). ``should_save`` and ``should_evaluate`` are cleared once the step is
    done; a stop ends the run after it."""

    should_training_stop: bool = False
    """End the run after this step: its checkpoint is committed and the stop recorded in
    meta.json; ``--resume latest`` then trains no further, ``--extend-to N`` does."""
    should_save: bool = False
    """Commit a checkpoint of this step, on the save interval or not."""
    should_evaluate: bool = False
    """Evaluate this step (``on_step_end`` only: the evaluation follows it)."""
    stop_reason: str = ""
    """What the stop's record says; empty: "<callback> asked to stop"."""
    stopped_by: str = ""
    """Set by the loop: the callback that asked to stop."""
    say: Callable[[str], None] = _ignore
    """Print a line in the run's log (the first process's), beside the progress bar."""
    agree: Callable[[list[int]], list[int]] | None = field(default=None, repr=False)
    """Under torchrun with callbacks of the user's: every rank's flags combined (any rank asking
    counts), so every rank saves, evaluates and stops at the same step."""

    def agreed(self) -> None:
        if self.agree is None:
            return
        flags = self.agree([self.should_training_stop, self.should_save, self.should_evaluate])
        self.should_training_stop, self.should_save, self.should_evaluate = map(bool, flags)

    def step_done(self) -> None:
        self.should_save = self.should_evaluate = False


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    callback: Any
    user: bool


class Callbacks:
    """A run's callbacks, in the order they hear each event; their saved state; the record of a
    stop (``stopped``: ``{"step", "by", "reason"}``, or ``None``)."""

    def __init__(self) -> None:
        self._entries: list[_Entry] = []
        self._events: dict[str, list[tuple[_Entry, Callable[..., Any]]]] = {event: [] for event in EVENTS}
        self.stopped: dict[str, Any] | None = None
        self.notes: list[str] = []
        """What the last :meth:`load` has to say (a callback without saved state, a saved state
        no callback claims)."""

    def add(self, name: str, callback: Any, *, user: bool = False, first: bool = False) -> None:
        """``callback`` hears each event after those added before it (``first``: before them)."""
        entry = _Entry(name, callback, user)
        self._entries.insert(0 if first else len(self._entries), entry)
        for event in EVENTS:
            method = getattr(callback, event, None)
            if callable(method):
                self._events[event].insert(0 if first else len(self._events[event]), (entry, method))

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return ((entry.name, entry.callback) for entry in self._entries)

    def listen(self, event: str) -> bool:
        """Whether any callback has ``event``."""
        return bool(self._events[event])

    @property
    def of_user(self) -> bool:
        """Whether any callback is the user's (their decisions are agreed between ranks)."""
        return any(entry.user for entry in self._entries)

    # -- events ------------------------------------------------------------------------
    def on_step_end(self, run: Any, control: Control) -> None:
        self._dispatch("on_step_end", control, run, control)

    def on_evaluate(self, run: Any, metrics: dict[str, float], control: Control) -> None:
        self._dispatch("on_evaluate", control, run, metrics, control)

    def on_save(self, run: Any, checkpoint: Any, control: Control) -> None:
        self._dispatch("on_save", control, run, checkpoint, control)

    def _dispatch(self, event: str, control: Control, *args: Any) -> None:
        for entry, method in self._events[event]:
            asked = control.should_training_stop
            if entry.user:
                with factory_errors(
                    "training.callbacks", f"{entry.name} {event}()", hint=_HINT, error=CallbackFailed
                ):
                    method(*args)
            else:
                method(*args)
            if asked and not control.should_training_stop:
                # A stop withdrawn: who asked it and why must not name a later stop.
                control.stopped_by = control.stop_reason = ""
            elif control.should_training_stop and not asked:
                control.stopped_by = control.stopped_by or entry.name
        control.agreed()

    def record_stop(
        self, step: int, control: Control, gather: Callable[[str], list[str]] | None = None
    ) -> dict[str, Any]:
        """The record of a stop asked at ``step``, kept in every later checkpoint. ``gather``
        (under torchrun with callbacks of the user's, whose stop may have been asked on one rank
        only, its flag agreed): every rank's text, so that the first rank that asked names it."""
        if gather is not None:
            asked = [
                json.loads(text) for text in gather(json.dumps([control.stopped_by, control.stop_reason]))
            ]
            control.stopped_by, control.stop_reason = next(
                (entry for entry in asked if entry[0]), [control.stopped_by, control.stop_reason]
            )
        by = control.stopped_by or "a callback"
        self.stopped = {"step": step, "by": by, "reason": control.stop_reason or f"{by} asked to stop"}
        return self.stopped

    # -- state -------------------------------------------------------------------------
    def _stateful(self) -> list[_Entry]:
        return [entry for entry in self._entries if callable(getattr(entry.callback, "state_dict", None))]

    def state(self) -> dict[str, Any]:
        """The ``callbacks`` component: the stop's record and each stateful callback's state, as
        plain JSON copies (a callback may keep changing the objects it returned)."""
        states = {}
        for entry in self._stateful():
            with self._calling(entry, "state_dict()"):
                value = entry.callback.state_dict()
            try:
                states[entry.name] = plain_json(value, f"the state_dict() of callback {entry.name}")
            except TypeError as exc:
                raise CallbackFailed(f"training.callbacks: {exc}") from None
        return {"stopped": copy.deepcopy(self.stopped), "states": states}

    def check(self, saved: Any, step: int) -> None:
        """Refuse a saved ``callbacks`` component that no run could have written; nothing is set."""
        if not isinstance(saved, dict) or set(saved) != {"stopped", "states"}:
            raise _fail("", "does not hold exactly stopped, states")
        stopped = saved["stopped"]
        if stopped is not None and not (
            isinstance(stopped, dict)
            and set(stopped) == {"step", "by", "reason"}
            and stopped["step"] == step
            and type(stopped["step"]) is int
            and isinstance(stopped["by"], str)
            and isinstance(stopped["reason"], str)
        ):
            raise _fail(".stopped", f"is not the record of a stop at step {step} (step, by, reason)")
        states = saved["states"]
        if not isinstance(states, dict) or not all(isinstance(name, str) for name in states):
            raise _fail(".states", "is not a mapping of callback names to their state")
        for entry in self._stateful():
            if entry.name not in states:
                continue
            try:
                plain_json(states[entry.name], entry.name)
            except TypeError as exc:
                raise _fail(f".states.{entry.name}", f"is not plain JSON ({exc})") from None
            check = getattr(entry.callback, "check_state", None)
            if callable(check):
                # The refusal is caught inside the guard of the user's code, which would
                # otherwise report it as the callback's failure rather than the checkpoint's.
                with self._calling(entry, "check_state()"):
                    try:
                        check(states[entry.name])
                    except (ValueError, TypeError) as exc:
                        raise _fail(f".states.{entry.name}", str(exc)) from None

    def load(self, saved: dict[str, Any]) -> None:
        """Set a state :meth:`check` accepted: the stop's record, and each callback's own state
        (a callback without one in the checkpoint keeps its fresh state: :attr:`notes`)."""
        self.stopped = copy.deepcopy(saved["stopped"])
        states, names, self.notes = saved["states"], set(), []
        for entry in self._stateful():
            names.add(entry.name)
            if entry.name not in states:
                self.notes.append(f"callback {entry.name} has no state in the checkpoint: it starts afresh")
                continue
            with self._calling(entry, "load_state_dict()"):
                entry.callback.load_state_dict(copy.deepcopy(states[entry.name]))
        for name in sorted(set(states) - names):
            self.notes.append(f"the checkpoint's state of callback {name} is left out: no such callback runs")

    @staticmethod
    def _calling(entry: _Entry, what: str) -> Any:
        if not entry.user:
            return contextlib.nullcontext()
        return factory_errors("training.callbacks", f"{entry.name} {what}", hint=_HINT, error=CallbackFailed)


def _fail(where: str, why: str) -> StateMismatch:
    return StateMismatch(f"training_state.callbacks{where} {why}: {SEALED_BUT_UNFIT}")


def plain_json(value: Any, what: str, depth: int = 0) -> Any:
    """A copy of ``value`` if it is plain JSON (mappings with string keys, lists, strings,
    numbers, booleans, null), else ``TypeError`` naming ``what``: a callback's state is saved in
    meta.json and must come back as it was (a tuple would come back a list)."""
    if depth > _MAX_DEPTH:
        raise TypeError(f"{what} is nested deeper than {_MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, list):
        return [plain_json(item, what, depth + 1) for item in value]
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise TypeError(f"{what} has a key that is not a string")
        return {key: plain_json(item, what, depth + 1) for key, item in value.items()}
    raise TypeError(
        f"{what} holds a {type(value).__name__}: a callback's state is plain JSON (dict, list, str, "
        "int, float, bool, None)"
    )


class Schedule:
    """The steps the loop saves (``checkpoint.every`` and the run's last) and evaluates
    (``training.eval_every`` and the last): transformers' ``DefaultFlowCallback``."""

    def on_step_end(self, run: Any, control: Control) -> None:
        step, last = run.step, run.config.training.max_steps
        if step % run.config.checkpoint.every == 0 or step == last:
            control.should_save = True
        every = run.config.training.eval_every
        if every and (step % every == 0 or step == last):
            control.should_evaluate = True


class EarlyStopping:
    """``training.early_stopping_patience`` with transformers' ``EarlyStoppingCallback``
    semantics on ``checkpoint.best_metric``: an evaluation improves when it beats the best
    earlier value by more than ``training.early_stopping_threshold``; after ``patience``
    evaluations in a row without one, the run stops. The count is its state: a run cut between
    two evaluations and resumed stops at the step the uninterrupted run stops at."""

    def __init__(self, metric: str, mode: str, patience: int, threshold: float) -> None:
        self.metric, self.mode, self.patience, self.threshold = metric, mode, patience, threshold
        self.waiting = 0

    def on_evaluate(self, run: Any, metrics: dict[str, float], control: Control) -> None:
        if self.metric not in metrics:  # the evaluation's own refusal names the metrics
            return
        value, earlier = metrics[self.metric], run.evaluations[self.metric][:-1]
        if earlier:
            best = min(earlier) if self.mode == "min" else max(earlier)
            better = value < best if self.mode == "min" else value > best
            improved = better and abs(value - best) > self.threshold
        else:
            improved = True
        self.waiting = 0 if improved else self.waiting + 1
        if self.waiting >= self.patience:
            control.should_training_stop = True
            control.stop_reason = (
                f"{self.metric} did not improve by more than {self.threshold:g} for {self.patience} "
                f"evaluation{'s' if self.patience > 1 else ''}"
            )

    def state_dict(self) -> dict[str, int]:
        return {"waiting": self.waiting}

    def check_state(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) != {"waiting"}:
            raise ValueError("is not {waiting}")
        if type(state["waiting"]) is not int or state["waiting"] < 0:
            raise ValueError(f"waiting is {state['waiting']!r}, expected an integer >= 0")

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.check_state(state)
        self.waiting = state["waiting"]


def build_callbacks(config: Config, data: Any = None) -> Callbacks:
    """The callbacks a run of ``config`` has from its start: the built-in ``schedule`` (its
    evaluations refused before the first step for a task ``data`` without ``evaluate``) and
    ``early_stopping``, then each of ``training.callbacks`` from its factory (``factory(config)``)."""
    training = config.training
    if training.eval_every and data is not None and not callable(getattr(data, "evaluate", None)):
        raise ConfigError(
            f"{config.source}: training.eval_every is {training.eval_every}, but the task "
            f"({config.data.factory}) has no evaluate(model, device): set training.eval_every: 0, or give "
            "the task an evaluate method"
        )
    callbacks = Callbacks()
    callbacks.add("schedule", Schedule())
    if training.early_stopping_patience:
        callbacks.add(
            "early_stopping",
            EarlyStopping(
                config.checkpoint.best_metric,
                config.checkpoint.best_mode,
                training.early_stopping_patience,
                training.early_stopping_threshold,
            ),
        )
    for path in training.callbacks:
        callback = resolve(path, "training.callbacks")(config)
        _check_callback(callback, path)
        callbacks.add(path, callback, user=True)
    return callbacks


def _check_callback(callback: Any, path: str) -> None:
    """A factory's result has an event, and its state both ways or neither."""
    events = [event for event in EVENTS if callable(getattr(callback, event, None))]
    saves, loads = (callable(getattr(callback, name, None)) for name in ("state_dict", "load_state_dict"))
    if not events:
        raise ConfigError(
            f"training.callbacks: {path} returned {type(callback).__name__}, which has none of "
            f"{', '.join(EVENTS)}: return a callback object (docs/training.md#callbacks)"
        )
    if saves != loads:
        has, lacks = ("state_dict", "load_state_dict") if saves else ("load_state_dict", "state_dict")
        raise ConfigError(
            f"training.callbacks: {path}'s callback has {has} but no {lacks}: a state saved is a state "
            "restored, so give it both, or neither"
        )
