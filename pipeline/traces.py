"""TensorBoard traces of a run: a view of the history every checkpoint saves, never a record.

``run.history`` (step, loss and learning rate of every step) and the run's evaluations
(``run.evaluations``: ``{"step": [...], "<metric>": [...]}``) are part of each checkpoint, so
the traces are drawn from them: at every start :func:`open_traces` writes the trace folder
again from the restored history (a resumed run keeps nothing past the checkpoint it resumed
from, and no step is written twice), then :meth:`Traces.update` appends what each step
added. Script 05 stages traces drawn the same way from the staged checkpoint's verified
history (:func:`trace_bytes`): the same history gives the same bytes, with no host, process
or wall-clock time in them, so two identical runs publish identical traces.

Tags: ``train/loss`` and ``train/lr`` at every step that ``training.log_every`` logs,
``eval/<metric>`` at every evaluation. The events are written with tensorboard's own protos
and record writer, one event per step, buffered and flushed every few seconds:
``SummaryWriter`` costs several times more per scalar (the bound is a small share of a
step at ``log_every`` 1) and names its file after the host, the process and the time.
tensorboard is an optional extra; without it training says so in one line and runs as ever.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from .layout import TRACE_FILE, TRACES_MARKER

__all__ = ["LOSS_TAG", "LR_TAG", "EVAL_PREFIX", "INSTALL_HINT", "Traces", "open_traces", "trace_bytes"]

LOSS_TAG = "train/loss"
LR_TAG = "train/lr"
EVAL_PREFIX = "eval/"
INSTALL_HINT = "pip install 'exact-resume-pipeline[traces]'"
# Events reach the disk at most this long after their step (and at the end of the run): a
# flush per step would cost a system call per step, and a lost tail is rebuilt at the next start.
FLUSH_SECONDS = 5.0
_FILE_VERSION = "brain.Event:2"

Point = tuple[int, int, list[tuple[str, float]]]
"""(step, 0 for training values or 1 for an evaluation, [(tag, value), ...])."""


def _tensorboard() -> tuple[Any, Any, Any]:
    """tensorboard's event and summary protos and its record writer; ImportError without it."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    return event_pb2, summary_pb2, RecordWriter


def _points(
    history: Mapping[str, list],
    evaluations: Mapping[str, list],
    log_every: int,
    *,
    history_from: int = 0,
    evaluations_from: int = 0,
) -> list[Point]:
    """The points of ``history`` from entry ``history_from`` on and of ``evaluations`` from entry
    ``evaluations_from`` on, in step order (a step's training values before its evaluation), so
    TensorBoard never sees a step go back, which it reads as a restart and purges."""
    points: list[Point] = []
    steps, losses, lrs = history["step"], history["loss"], history["lr"]
    for index in range(history_from, len(steps)):
        step = int(steps[index])
        if step % log_every == 0:
            points.append((step, 0, [(LOSS_TAG, float(losses[index])), (LR_TAG, float(lrs[index]))]))
    evaluated = evaluations.get("step", [])
    names = sorted(name for name in evaluations if name != "step")
    for index in range(evaluations_from, len(evaluated)):
        values = [(EVAL_PREFIX + name, float(evaluations[name][index])) for name in names]
        points.append((int(evaluated[index]), 1, values))
    points.sort(key=lambda point: point[:2])
    return points


def _event(
    proto: tuple[Any, Any, Any], step: int, values: list[tuple[str, float]], wall_time: float
) -> bytes:
    event_pb2, summary_pb2, _ = proto
    summary = summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag=tag, simple_value=value) for tag, value in values]
    )
    return event_pb2.Event(wall_time=wall_time, step=step, summary=summary).SerializeToString()


def _header(proto: tuple[Any, Any, Any], wall_time: float) -> bytes:
    return proto[0].Event(wall_time=wall_time, file_version=_FILE_VERSION).SerializeToString()


class _Bytes:
    """What tensorboard's record writer writes to, gathered in memory."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def trace_bytes(history: Mapping[str, list], evaluations: Mapping[str, list], log_every: int) -> bytes:
    """One event file of the whole history, every wall time 0: the published traces. The same
    history gives the same bytes. ImportError without tensorboard."""
    proto = _tensorboard()
    out = _Bytes()
    records = proto[2](out)
    records.write(_header(proto, 0.0))
    for step, _, values in _points(history, evaluations, log_every):
        records.write(_event(proto, step, values, 0.0))
    return b"".join(out.parts)


def run_evaluations(run: Any) -> Mapping[str, list]:
    """The run's evaluations so far (``{}`` for a run that keeps none)."""
    return getattr(run, "evaluations", None) or {}


def _not_ours(folder: Path) -> str | None:
    """Why ``folder`` may not be replaced (``None``: absent, empty, or marked as written by
    training). A mistyped ``outputs.traces`` must never delete someone's folder."""
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        return "is not a folder"
    names = {entry.name for entry in folder.iterdir()} if folder.is_dir() else set()
    if names and not (folder / TRACES_MARKER).is_file():
        return f"holds files training did not write (no {TRACES_MARKER})"
    # A marked folder may have gained files of someone's since (notes, other runs' events).
    others = sorted(names - {TRACES_MARKER, TRACE_FILE})
    if others:
        return f"holds files training did not write ({others[0]})"
    return None


class Traces:
    """The live trace file of one training process, appended as the history grows."""

    def __init__(self, folder: Path, log_every: int, say: Callable[[str], None]) -> None:
        self.folder = folder
        self._proto = _tensorboard()
        self._log_every = log_every
        self._say = say
        self._file = open(folder / TRACE_FILE, "wb")  # open until close()
        self._records = self._proto[2](self._file)
        self._records.write(_header(self._proto, time.time()))
        self._history = 0
        self._evaluations = 0
        self._flushed = time.monotonic()

    # The callback's events (pipeline.callbacks): what the run added, appended.
    def on_step_end(self, run: Any, control: Any) -> None:
        self.update(run)

    def on_evaluate(self, run: Any, metrics: Mapping[str, float], control: Any) -> None:
        self.update(run)

    def update(self, run: Any) -> None:
        """Append the steps and evaluations ``run`` added since the last call."""
        if self._file is None:
            return
        history, evaluations = run.history, run_evaluations(run)
        seen, evaluated = len(history["step"]), len(evaluations.get("step", ()))
        try:
            if seen != self._history or evaluated != self._evaluations:
                now = time.time()
                points = _points(
                    history,
                    evaluations,
                    self._log_every,
                    history_from=self._history,
                    evaluations_from=self._evaluations,
                )
                for step, _, values in points:
                    self._records.write(_event(self._proto, step, values, now))
                self._history, self._evaluations = seen, evaluated
            if time.monotonic() - self._flushed >= FLUSH_SECONDS:
                self._file.flush()
                self._flushed = time.monotonic()
        except OSError as exc:
            self._off(exc)

    def close(self, run: Any) -> None:
        """Append what is left and close the file."""
        self.update(run)
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                self._off(exc)
            self._file = None

    def _off(self, exc: OSError) -> None:
        """A full or failing disk stops the traces, never the training they describe."""
        self._say(
            f"TensorBoard traces are off from here: writing {self.folder / TRACE_FILE} failed "
            f"({exc.strerror or exc}); the next start writes them again from the checkpoint"
        )
        file, self._file = self._file, None
        try:
            file.close()
        except OSError:
            pass


def open_traces(
    folder: str | Path, run: Any, *, log_every: int, say: Callable[[str], None], data_dir: str | Path
) -> Traces | None:
    """The trace folder written again from ``run``'s restored history, open for appending; or
    ``None`` after one line saying why there are no traces (no tensorboard, a folder training
    did not write, one inside ``data_dir``, an unwritable one). Training goes on either way."""
    folder = Path(folder)
    data = Path(data_dir).resolve()
    if folder.resolve() == data or data in folder.resolve().parents:
        # The data folder is fingerprinted file by file: a trace file there fails the next start.
        say(
            f"TensorBoard traces are off: {folder} is inside data.dir ({data_dir}), whose every file "
            "is fingerprinted; set outputs.traces to a folder outside it"
        )
        return None
    try:
        _tensorboard()
    except ImportError:
        say(
            f"TensorBoard traces are off: tensorboard is not installed ({INSTALL_HINT} writes them to {folder})"
        )
        return None
    problem = _not_ours(folder)
    if problem is not None:
        say(
            f"TensorBoard traces are off: {folder} {problem}, and training only replaces a traces folder "
            "it wrote; move it away or set outputs.traces to another folder"
        )
        return None
    try:
        if folder.is_dir():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        # Marks the folder as training's own: the next start deletes and rebuilds it.
        (folder / TRACES_MARKER).write_text(
            "Written by training, and rebuilt from the checkpoint's history at every start.\n",
            encoding="utf-8",
        )
        traces = Traces(folder, log_every, say)
    except OSError as exc:
        say(f"TensorBoard traces are off: {folder} cannot be written ({exc.strerror or exc})")
        return None
    traces.update(run)
    return traces
