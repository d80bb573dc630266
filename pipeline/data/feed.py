"""How the training loop gets each batch, and what a checkpoint records of where it came from.

A feed hands out one batch per optimizer step (:meth:`next_batch`), this rank's slice of the
global batch under torchrun, with the factor that makes the ranks' mean loss the global
batch's. Its :meth:`state_dict` is the ``source`` record of the checkpoint's data state:
the kind of source, the training set's size and fingerprint (a map-style set), or each
rank's stream position. Three feeds, one per form of :class:`~pipeline.data.task.TaskData`:

- :class:`BatchFeed`: ``get_batch(indices, device)`` in the training process, as before;
- :class:`LoaderFeed`: a ``torch.utils.data.DataLoader`` over a ``train_dataset``. Its batch
  order comes from a copy of the run's sampler (:func:`~pipeline.data.sampler.clone_sampler`),
  which may run ahead by the prefetched batches; the live sampler advances once per trained
  batch, and each batch is checked to be the one it names. A checkpoint stores the live
  position, so what was prefetched and not trained is fetched again after a resume: nothing
  counted twice, nothing lost;
- :class:`~pipeline.data.stream.StreamFeed`: a ``train_iterable``.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate

from ..config import Config
from ..errors import (
    SEALED_BUT_UNFIT,
    DataError,
    InputFailed,
    MachineLimit,
    WorkerExited,
    first_line,
    out_of_tasks,
)
from ..world import World
from .failures import catchable, collate_failure, sample_deadline, user_error
from .feed_base import Feed, dataset_fingerprint, map_tensors, to_device
from .sampler import Sampler, batch_epoch, clone_sampler, dataset_length
from .seeding import isolated_rng, seed_sample
from .task import BATCHES, DATASET, STREAM, input_mode

__all__ = ["BatchFeed", "LoaderFeed", "make_feed"]


# How long a failed handover waits for the kernel to report the worker's end.
_EXIT_NOTICE_SECONDS = 1.0


class _SamplerFeed(Feed):
    """Order from the run's sampler; the record is the training set's identity."""

    def __init__(
        self,
        data: Any,
        sampler: Sampler,
        config: Config,
        device: torch.device,
        world: World,
        num_samples: int,
        fingerprint: str | None,
    ) -> None:
        self.data, self.sampler, self.config, self.device, self.world = data, sampler, config, device, world
        self.num_samples, self.fingerprint = num_samples, fingerprint

    def _next_indices(self) -> tuple[int, list[int], float]:
        """Advance the live sampler by one global batch: (epoch, this rank's indices, scale)."""
        indices = [int(i) for i in self.sampler.next_indices()]
        self.rows = len(indices)
        indices, scale = self.world.slice(indices)
        return batch_epoch(self.sampler), indices, scale

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "num_samples": self.num_samples, "fingerprint": self.fingerprint}

    def check_state(self, saved: Any) -> None:
        live = self.state_dict()
        self.check_kind(saved)
        if set(saved) != set(live):
            raise DataError(
                f"training_state.data.source does not hold exactly {', '.join(live)}: {SEALED_BUT_UNFIT}"
            )
        if type(saved["num_samples"]) is not int or saved["num_samples"] != self.num_samples:
            raise DataError(
                f"the training set had {saved['num_samples']!r} samples when the checkpoint was saved and "
                f"has {self.num_samples} now: restore the data it was trained on, or start a new run "
                "(another --checkpoint-dir)"
            )
        if saved["fingerprint"] != self.fingerprint:
            raise DataError(
                f"the training set's fingerprint is {self.fingerprint!r}, the checkpoint's "
                f"{saved['fingerprint']!r}: its content changed since the checkpoint; restore it, or start "
                "a new run (another --checkpoint-dir)"
            )


class BatchFeed(_SamplerFeed):
    """``get_batch(indices, device)`` in the training process."""

    kind = BATCHES

    def next_batch(self) -> tuple[Any, float]:
        epoch, indices, scale = self._next_indices()
        where = f"get_batch of rows {indices[:4]}{' ...' if len(indices) > 4 else ''} (epoch {epoch})"
        try:
            with sample_deadline(self.config.data.sample_timeout, where):
                return self.data.get_batch(indices, self.device), scale
        except BaseException as exc:
            if not catchable(exc):
                raise
            raise InputFailed(f"{where} raised {first_line(exc, named=True)}") from exc


class LoaderFeed(_SamplerFeed):
    """A ``DataLoader`` over ``train_dataset`` in the order of a copy of the sampler."""

    kind = DATASET

    def __init__(
        self,
        data: Any,
        sampler: Sampler,
        generator: np.random.Generator,
        config: Config,
        device: torch.device,
        world: World,
    ) -> None:
        dataset = data.train_dataset
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise DataError(
                f"train_dataset is a {type(dataset).__name__}, which has no __len__ and __getitem__: "
                "give a map-style dataset, or a stream as train_iterable"
            )
        super().__init__(
            data,
            sampler,
            config,
            device,
            world,
            dataset_length(dataset, "train_dataset"),
            dataset_fingerprint(data, dataset),
        )
        self.generator = generator
        self.collate = getattr(data, "collate", None) or default_collate
        self._iterator: Any = None
        self._processes: set[Any] = set()  # the loader's worker processes (multiprocessing.Process)
        self._workers: set[int] = set()  # and their pids
        self._exits: dict[int, tuple[int, int]] = {}  # worker pid -> (si_code, si_status) at its exit
        self._sigchld: Any = None  # the SIGCHLD handler before ours, while ours is installed
        self._fetching = False  # waiting for a batch: a worker's end interrupts the wait

    def _start(self) -> None:
        # Started at the first batch, after any restore: the copy starts at the live position.
        order = _Order(clone_sampler(self.sampler, self.data, self.generator, self.config), self.world)
        workers = self.config.data.num_workers
        loader = DataLoader(
            _SeededSamples(self.data.train_dataset, self.config.training.seed),
            batch_sampler=order,
            num_workers=workers,
            collate_fn=_Collate(self.collate, default=self.collate is default_collate),
            pin_memory=self.device.type == "cuda",
            timeout=self.config.data.sample_timeout if workers else 0,
            worker_init_fn=functools.partial(_worker_init, os.getpid()) if workers else None,
            # torch draws each iterator's worker base seed from this generator; by
            # default it would draw from the training process's torch stream.
            generator=torch.Generator().manual_seed(self.config.training.seed),
        )
        main = threading.current_thread() is threading.main_thread()
        before = signal.getsignal(signal.SIGCHLD) if main else None
        running = set(multiprocessing.active_children())
        failure = None
        try:
            self._iterator = iter(loader)
            self._processes = set(multiprocessing.active_children()) - running
            self._workers = {process.pid for process in self._processes}
            if main and before is not None and workers:
                # torch's SIGCHLD handler raises wherever the main thread is when a worker dies
                # (mid-step, mid-save: a traceback). Ours notes how a worker ended, without
                # reaping it, and interrupts only a wait for a batch (:meth:`next_batch`).
                self._sigchld = before
                signal.signal(signal.SIGCHLD, self._note_exit)
        except Exception as exc:  # a worker that died while the iterator started its workers
            out = out_of_tasks(exc)
            if out is not None:
                self._give_up_starting(exc, set(multiprocessing.active_children()) - running, before)
                raise MachineLimit(f"the DataLoader's workers (data.num_workers={workers}): {out}") from None
            failure = self._loader_failure(exc)
            if failure is None:
                raise
        if failure is not None:
            self._abandon()
            raise InputFailed(failure)

    def _give_up_starting(self, exc: BaseException, started: set[Any], sigchld: Any) -> None:
        """After torch's iterator failed to start a worker or a thread (the machine out of
        them): end the workers it did start (torch's SIGCHLD handler, which would raise at
        their end, replaced by ``sigchld``, the one before), and let the half-built iterator go
        quietly (its ``__del__`` would fail on what it never set up, "Exception ignored")."""
        if sigchld is not None:
            signal.signal(signal.SIGCHLD, sigchld)
        for process in started:
            process.kill()
        for process in started:
            process.join(timeout=5)
        quiet, sys.unraisablehook = sys.unraisablehook, lambda unraisable: None
        try:
            exc.__traceback__ = None  # its frames held the iterator
            gc.collect()
        finally:
            sys.unraisablehook = quiet

    def _note_exit(self, signum: int, frame: Any) -> None:
        ended = None
        for pid in self._workers - set(self._exits):
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                continue  # reaped already (by the loader, which then reports it)
            if info is not None:
                self._exits[pid] = (info.si_code, info.si_status)
                ended = pid
        if callable(self._sigchld):
            self._sigchld(signum, frame)
        if ended is not None and self._fetching:
            raise WorkerExited(ended)  # else the loader would notice only at its next status check, 5 s on

    def _loader_failure(self, exc: BaseException) -> str | None:
        """What the DataLoader's own error means, in one line; ``None`` for an error that is
        neither a worker's end nor the sample deadline (a bug: its traceback is wanted)."""
        text = str(exc).strip()
        if isinstance(exc, RuntimeError) and text.startswith("DataLoader timed out after"):
            return (
                f"no batch came from the DataLoader workers in data.sample_timeout="
                f"{self.config.data.sample_timeout:g} s (a sample stuck reading, or waiting for something "
                "that never comes); raise data.sample_timeout if it is only slow"
            )
        died = re.search(r"DataLoader worker \(pid\(s\) ([\d, ]+)\) exited unexpectedly", text)
        if died is not None:
            pids = [int(pid) for pid in died.group(1).split(",")]
            return "; ".join(self._worker_end(pid) for pid in pids)
        # torch's own SIGCHLD handler, set during the first iterator's start only.
        died = re.search(
            r"DataLoader worker \(pid (\d+)\) (is killed by signal: (\w+)|exited unexpectedly with exit code (\d+))",
            text,
        )
        if died is not None:
            pid = int(died.group(1))
            if pid not in self._exits:
                killed = died.group(3)
                self._exits[pid] = (
                    (os.CLD_KILLED, signal.SIGKILL if killed == "Killed" else 0)
                    if killed
                    else (os.CLD_EXITED, int(died.group(4)))
                )
            return self._worker_end(pid)
        if isinstance(exc, (EOFError, ConnectionError)):
            # A worker ended while it handed a batch's shared memory over (its socket closed
            # before the kernel reported its end: give our SIGCHLD handler a moment to note it).
            deadline = time.monotonic() + _EXIT_NOTICE_SECONDS
            while not self._exits and self._sigchld is not None and time.monotonic() < deadline:
                time.sleep(0.01)
            if self._exits:
                return "; ".join(self._worker_end(pid) for pid in self._exits) + " while handing over a batch"
            return (
                f"a DataLoader worker ended while handing over a batch ({first_line(exc, named=True)}): killed (the "
                "out-of-memory killer?) or ended by the dataset's code"
            )
        return None

    def _worker_end(self, pid: int) -> str:
        code, status = self._exits.get(pid, (None, None))
        if code in (os.CLD_KILLED, os.CLD_DUMPED):
            name = signal.Signals(status).name if status in signal.Signals._value2member_map_ else status
            cause = (
                " (the out-of-memory killer sends it: lower data.num_workers or the memory a sample takes)"
                if status == signal.SIGKILL
                else ""
            )
            return f"a DataLoader worker (pid {pid}) was killed by {name}{cause}"
        if code == os.CLD_EXITED:
            return (
                f"a DataLoader worker (pid {pid}) exited with code {status} before handing over its batch "
                "(the dataset's code ended the process: os._exit?)"
            )
        return (
            f"a DataLoader worker (pid {pid}) ended unexpectedly (killed, or the dataset's code ended "
            "the process)"
        )

    def next_batch(self) -> tuple[Any, float]:
        if self._iterator is None:
            self._start()
        epoch, indices, scale = self._next_indices()
        failure = None
        try:
            with sample_deadline(
                0 if self.config.data.num_workers else self.config.data.sample_timeout,
                f"the batch of train_dataset[{indices[0] if indices else '?'}] (epoch {epoch})",
            ):
                self._fetching = True
                # A worker's end raised while a finalizer runs (a batch's shared memory let go)
                # is lost there, and Python would print it with a traceback: dropped instead,
                # since the loader then reports that end itself, as one line.
                printing = sys.unraisablehook
                sys.unraisablehook = _unless_a_worker_exit(printing)
                try:
                    for pid in self._exits:  # ended while the step trained: its batches never come
                        raise WorkerExited(pid)
                    fetched = next(self._iterator)
                finally:
                    self._fetching = False
                    sys.unraisablehook = printing
        except WorkerExited as exc:
            self._fetching = False
            failure = self._worker_end(exc.pid)
        except Exception as exc:
            failure = self._loader_failure(exc)
            if failure is None:
                raise
        if failure is not None:
            # Raised here, outside the except block: the loader's error (whose traceback holds
            # the iterator) is gone, so closing frees the iterator and shuts its workers down.
            self._abandon()
            raise InputFailed(failure)
        if isinstance(fetched, _Failure):
            self.close()
            raise user_error(fetched.message, fetched.trace)
        expected = [(epoch, i) for i in indices]
        if fetched.keys != expected:
            self.close()
            raise DataError(
                f"the sampler gave other batches when copied from its saved state (epoch, index "
                f"{fetched.keys[:3]} instead of {expected[:3]}): a sampler must be a function of its "
                "state_dict() and the generator it was given"
            )
        return to_device(fetched.batch, self.device, non_blocking=self.device.type == "cuda"), scale

    def _abandon(self) -> None:
        """Close after a worker ended or the deadline passed: the workers left may be stuck in a
        sample, which torch would wait for 5 s before ending them. Killed through their process
        objects, which signal only a process not yet reaped (never a reused pid)."""
        for process in self._processes:
            process.kill()
        self.close()

    def close(self) -> None:
        # Dropping the iterator shuts its workers down (torch's iterator does it on deletion);
        # our SIGCHLD handler goes once they have been joined.
        self._iterator = None
        self._processes = set()
        if self._sigchld is not None:
            signal.signal(signal.SIGCHLD, self._sigchld)
            self._sigchld = None


def _unless_a_worker_exit(hook: Callable[[Any], None]) -> Callable[[Any], None]:
    """``hook``, except for the :class:`WorkerExited` our SIGCHLD handler raised into a finalizer."""

    def unraisable(record: Any) -> None:
        if not isinstance(record.exc_value, WorkerExited):
            hook(record)

    return unraisable


class _Order:
    """The DataLoader's batch sampler: (epoch, index) keys of this rank's slice of each batch."""

    def __init__(self, sampler: Sampler, world: World) -> None:
        self.sampler, self.world = sampler, world

    def __iter__(self):
        while True:
            indices = [int(i) for i in self.sampler.next_indices()]
            indices, _ = self.world.slice(indices)
            epoch = batch_epoch(self.sampler)
            yield [(epoch, i) for i in indices]


class _Fetched:
    """A batch with the keys it was built from (checked against the live sampler)."""

    def __init__(self, keys: list[tuple[int, int]], batch: Any) -> None:
        self.keys, self.batch = keys, batch

    def pin_memory(self) -> "_Fetched":  # called by the DataLoader's pinning thread
        return _Fetched(self.keys, map_tensors(self.batch, lambda t: t.pin_memory()))


class _Failure:
    """A sample or collate error, carried back as text: a worker's exception object may not
    survive the trip (nor its traceback, which ``--debug`` prints)."""

    def __init__(self, where: str, exc: BaseException, what: str | None = None) -> None:
        self.message = f"{where} {what or 'raised ' + first_line(exc, named=True)}"
        self.trace = "".join(traceback.format_exception(exc))


class _SeededSamples(torch.utils.data.Dataset):
    """``dataset[index]`` for each (epoch, index) key, each seeded by its key; the caller's
    generators are put back after the batch (the training process's streams)."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return dataset_length(self.dataset, "train_dataset")

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])

    def __getitems__(self, keys: list[tuple[int, int]]) -> Any:
        samples = []
        with isolated_rng():
            for epoch, index in keys:
                seed_sample(self.seed, epoch, index)
                try:
                    samples.append(self.dataset[index])
                except BaseException as exc:  # any user error: reported with the sample it came from
                    if not catchable(exc):
                        raise
                    return _Failure(f"train_dataset[{index}] (epoch {epoch})", exc)
        return _Fetched(list(keys), samples)


class _Collate:
    def __init__(self, collate: Callable[[list], Any], *, default: bool) -> None:
        self.collate, self.default = collate, default

    def __call__(self, fetched: Any) -> Any:
        if isinstance(fetched, _Failure):
            return fetched
        try:
            return _Fetched(fetched.keys, self.collate(fetched.batch))
        except BaseException as exc:
            if not catchable(exc):
                raise
            names = [f"train_dataset[{index}]" for _, index in fetched.keys]
            epoch = fetched.keys[0][0] if fetched.keys else 0
            what = collate_failure(names, fetched.batch, exc, self.default)
            return _Failure(
                f"collate of the batch of {', '.join(names[:4])}{' ...' if len(names) > 4 else ''} "
                f"(epoch {epoch})",
                exc,
                what,
            )


def _worker_init(trainer: int, worker_id: int) -> None:
    # Out of the launching process group: a terminal's Ctrl-C (or a SIGTERM sent to the
    # group) reaches the training process, which stops gracefully, saves, and then shuts its
    # workers down; a worker killed first would end the run with an error instead.
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Ended with the training process, even in the middle of a sample (torch's watchdog looks
    # only between samples: a worker stuck in one would outlive a SIGKILLed trainer for good).
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != trainer:  # it died before the line above
        os._exit(0)

    # multiprocessing's resource sharer, the worker's thread that hands a batch's shared memory
    # over, prints the traceback of a connection the training process dropped (it died, or shut
    # the loader down mid-transfer) into the user's terminal: the training process reports its
    # own side in one line, so the worker says nothing of it.
    def quiet_when_the_trainer_hung_up(kind: type, value: BaseException, trace: Any) -> None:
        if not isinstance(value, (ConnectionError, EOFError)):
            sys.__excepthook__(kind, value, trace)

    sys.excepthook = quiet_when_the_trainer_hung_up


def make_feed(
    data: Any,
    sampler: Sampler | None,
    generator: np.random.Generator,
    config: Config,
    device: torch.device,
    world: World | None = None,
) -> Feed:
    """The feed for ``data``'s form (:func:`~pipeline.data.task.input_mode`), for this rank of
    ``world`` (by default, this process alone)."""
    mode = input_mode(data)
    world = world or World(device=device)
    if mode == STREAM:
        from .stream import StreamFeed

        return StreamFeed(data, config, device, world)
    if config.data.num_workers and mode == BATCHES:
        raise DataError(
            f"{config.source}: data.num_workers is {config.data.num_workers}, but data.factory gives "
            "get_batch, which runs in the training process: give a train_dataset to use workers, or set "
            "data.num_workers: 0"
        )
    if sampler is None:
        raise DataError("data.factory's make_sampler returned None")
    if mode == BATCHES:
        return BatchFeed(
            data,
            sampler,
            config,
            device,
            world,
            dataset_length(data, "num_train"),
            getattr(data, "fingerprint", None),
        )
    return LoaderFeed(data, sampler, generator, config, device, world)
