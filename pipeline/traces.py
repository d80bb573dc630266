"""TensorBoard traces of a run: a view of the history every checkpoint saves, never a record.

``run.history`` (step, loss, learning rate, gradient norm and epoch of every step) and the run's
evaluations (``run.evaluations``: ``{"step": [...], "<metric>": [...]}``) are part of each
checkpoint, so the traces are drawn from them: at every start :func:`open_traces` writes the
trace folder again from the restored history (a resumed run keeps nothing past the checkpoint
it resumed from, and no step is written twice), then :class:`Traces`, a callback of the loop
(:mod:`pipeline.callbacks`), appends what each step added. Script 05 stages traces drawn the
same way from the staged checkpoint's verified history (:func:`trace_bytes`): the same history
gives the same bytes, with no host, process or wall-clock time in them, so two identical runs
publish identical traces.

Tags, at every step that ``training.log_every`` logs: ``train/loss``, ``train/lr``,
``train/grad_norm`` (before clipping), ``train/epoch``, and, in the live traces only,
``train/samples_per_second`` (a measure of this process's wall clock, part of no bitwise claim:
it is in no checkpoint, so neither rebuilt at a start nor staged); ``eval/<metric>`` at every
evaluation. The events are written with tensorboard's own protos and record writer, one event
per step, buffered and flushed every few seconds: ``SummaryWriter`` costs several times more
per scalar (the bound is a small share of a step at ``log_every`` 1) and names its file after
the host, the process and the time. tensorboard is an optional extra; without it training says
so in one line and runs as ever.

The folder is replaced only while it holds exactly what training writes there: its marker (a
regular file with training's text) and its event file (a regular file, empty or starting with
training's header). Anything else (a folder inside, a link, an empty marker, a file of the
user's) turns the traces off with one line, and nothing is deleted; even then only those two
names are ever removed. A write, flush or close that fails turns the traces off with one line:
training goes on.
"""

from __future__ import annotations

import errno
import math
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from .layout import TRACE_FILE, TRACES_MARKER

__all__ = [
    "LOSS_TAG",
    "LR_TAG",
    "GRAD_NORM_TAG",
    "EPOCH_TAG",
    "SPEED_TAG",
    "EVAL_PREFIX",
    "INSTALL_HINT",
    "Traces",
    "open_traces",
    "trace_bytes",
]

LOSS_TAG = "train/loss"
LR_TAG = "train/lr"
GRAD_NORM_TAG = "train/grad_norm"
EPOCH_TAG = "train/epoch"
SPEED_TAG = "train/samples_per_second"
EVAL_PREFIX = "eval/"
# The history's lists traced at each logged step, a value that is not there (NaN: a gradient
# norm not measured, the epoch of a stream) left out.
_TRAINING_TAGS = (("loss", LOSS_TAG), ("lr", LR_TAG), ("grad_norm", GRAD_NORM_TAG), ("epoch", EPOCH_TAG))
_MARKER_TEXT = b"Written by training, and rebuilt from the checkpoint's history at every start.\n"
# A header record (length, its CRC, the event, its CRC) is about 40 bytes; the bound keeps a
# stray file from being read to decide whether it is ours.
_HEADER_MAX = 256
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
    live: Mapping[int, list[tuple[str, float]]] | None = None,
) -> list[Point]:
    """The points of ``history`` from entry ``history_from`` on and of ``evaluations`` from entry
    ``evaluations_from`` on, in step order (a step's training values before its evaluation), so
    TensorBoard never sees a step go back, which it reads as a restart and purges. ``live``:
    values of a step known only to this process (``train/samples_per_second``)."""
    points: list[Point] = []
    steps = history["step"]
    lists = [(history[key], tag) for key, tag in _TRAINING_TAGS if key in history]
    for index in range(history_from, len(steps)):
        step = int(steps[index])
        if step % log_every == 0:
            values = [(tag, float(values[index])) for values, tag in lists if not math.isnan(values[index])]
            points.append((step, 0, values + list((live or {}).get(step, ()))))
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


def _entry_is_ours(folder_fd: int, entry: os.DirEntry) -> bool:
    """``entry`` is what training writes under its name: a regular file (no link), the marker
    with training's text, the event file empty or starting with training's header."""
    if (
        entry.name not in (TRACES_MARKER, TRACE_FILE)
        or entry.is_symlink()
        or not entry.is_file(follow_symlinks=False)
    ):
        return False
    try:
        fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder_fd)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        data = os.read(fd, _HEADER_MAX)
    except OSError:
        return False
    finally:
        os.close(fd)
    if entry.name == TRACES_MARKER:
        return data == _MARKER_TEXT
    return data == b"" or _starts_with_header(data)


def _starts_with_header(data: bytes) -> bool:
    """A TFRecord whose event is training's header (a ``file_version``, nothing else)."""
    length = int.from_bytes(data[:8], "little")
    if len(data) < 12 + length:
        return False
    try:
        event = _tensorboard()[0].Event.FromString(data[12 : 12 + length])
    except Exception:  # not an event at all: not ours
        return False
    return event.file_version == _FILE_VERSION and not event.HasField("summary")


def _open_folder(folder: Path) -> tuple[int | None, str | None]:
    """``folder`` opened (created if absent), if training may replace what it holds: ``(its
    descriptor, None)``; else ``(None, why)``. A mistyped ``outputs.traces`` must never lose
    anyone's files: only a folder holding exactly what training writes is training's."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            fd = os.open(folder, flags)
        except FileNotFoundError:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder, flags)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a link (to a folder too), or a file
            return None, "is not a folder"
        raise
    try:
        with os.scandir(fd) as entries:
            listed = list(entries)
        names = {entry.name for entry in listed}
        if names and TRACES_MARKER not in names:
            return _closed(fd, f"holds files training did not write (no {TRACES_MARKER})")
        # A marked folder may have gained files of someone's since (notes, other runs' events).
        foreign = sorted(entry.name for entry in listed if not _entry_is_ours(fd, entry))
        if foreign:
            return _closed(fd, f"holds files training did not write ({foreign[0]})")
    except BaseException:
        os.close(fd)
        raise
    return fd, None


def _closed(fd: int, why: str) -> tuple[None, str]:
    os.close(fd)
    return None, why


def _create(folder_fd: int, name: str) -> int:
    """A new file ``name`` in the folder, created here (never a path someone else put there)."""
    return os.open(
        name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=folder_fd
    )


class Traces:
    """The live trace file of one training process, appended as the history grows; a callback
    of the loop (``on_step_end``, ``on_evaluate``)."""

    def __init__(self, folder: Path, folder_fd: int, log_every: int, say: Callable[[str], None]) -> None:
        self.folder = folder
        self._proto = _tensorboard()
        self._log_every = log_every
        self._say = say
        self._file = os.fdopen(_create(folder_fd, TRACE_FILE), "wb")  # open until close()
        self._records = self._proto[2](self._file)
        self._history = 0
        self._evaluations = 0
        self._flushed = time.monotonic()
        self._clock: tuple[float, int] | None = None
        self._live: dict[int, list[tuple[str, float]]] = {}
        try:
            self._records.write(_header(self._proto, time.time()))
        except OSError as exc:
            self._off(exc)

    # The callback's events (pipeline.callbacks): what the run added, appended.
    def on_step_end(self, run: Any, control: Any) -> None:
        self._measure(run)
        self.update(run)

    def on_evaluate(self, run: Any, metrics: Mapping[str, float], control: Any) -> None:
        self.update(run)

    def _measure(self, run: Any) -> None:
        """Samples per second over the steps since the last logged one, at each logged step."""
        now, seen = time.monotonic(), _samples_seen(run)
        logged = run.step % self._log_every == 0
        if logged and self._clock is not None and now > self._clock[0]:
            self._live[run.step] = [(SPEED_TAG, (seen - self._clock[1]) / (now - self._clock[0]))]
        if logged or self._clock is None:
            self._clock = (now, seen)

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
                    live=self._live,
                )
                for step, _, values in points:
                    self._records.write(_event(self._proto, step, values, now))
                self._history, self._evaluations = seen, evaluated
                self._live.clear()
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


def _samples_seen(run: Any) -> int:
    """Training rows drawn so far: the sampler's count, or, for a stream, the nominal rows of
    the steps trained (``data.batch_size`` x ``grad_accum_steps``)."""
    seen = getattr(run.sampler, "samples_seen", None)
    if type(seen) is int:
        return seen
    return run.step * run.config.data.batch_size * run.config.training.grad_accum_steps


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
    try:
        fd, problem = _open_folder(folder)
        if fd is None:
            say(
                f"TensorBoard traces are off: {folder} {problem}, and training only replaces a traces folder "
                "it wrote; move it away or set outputs.traces to another folder"
            )
            return None
        try:
            # Only training's own two files go (a file someone adds meanwhile stays), then come back.
            for name in (TRACE_FILE, TRACES_MARKER):
                try:
                    os.unlink(name, dir_fd=fd)
                except FileNotFoundError:
                    pass
            # Marks the folder as training's own: the next start deletes and rebuilds it.
            with os.fdopen(_create(fd, TRACES_MARKER), "wb") as marker:
                marker.write(_MARKER_TEXT)
            traces = Traces(folder, fd, log_every, say)
        finally:
            os.close(fd)
    except OSError as exc:
        say(f"TensorBoard traces are off: {folder} cannot be written ({exc.strerror or exc})")
        return None
    traces.update(run)
    return traces
