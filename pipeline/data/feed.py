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

import os
import signal
import threading
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, default_collate

from ..config import Config
from ..distributed.world import World
from ..errors import SEALED_BUT_UNFIT, DataError
from .sampler import Sampler, batch_epoch, clone_sampler
from .seeding import isolated_rng, seed_sample
from .task import input_mode

__all__ = ["Feed", "BatchFeed", "LoaderFeed", "make_feed", "launch_world", "to_device", "dataset_fingerprint"]


def to_device(batch: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor in it (nested in dicts, lists, tuples) on ``device``."""
    return _map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def launch_world(config: Config, device: torch.device) -> World | None:
    """This process's place in a torchrun launch (the default process group), or ``None``."""
    if config.training.parallel == "none" or not (dist.is_available() and dist.is_initialized()):
        return None
    size = dist.get_world_size()
    return World(
        rank=dist.get_rank(),
        world_size=size,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", size)),
        device=device,
        mode=config.training.parallel,
    )


def dataset_fingerprint(data: Any, dataset: Any) -> str | None:
    """The training set's content fingerprint, as the task (or its dataset) names it in a
    ``fingerprint`` string; else none. Files in ``data.dir`` are covered by the manifest's
    SHA-256 anyway; ``datasets``' own cache fingerprint is not used: it changes when the same
    files move or are touched, which would refuse a good resume."""
    for owner in (data, dataset):
        value = getattr(owner, "fingerprint", None)
        if isinstance(value, str) and value:
            return value
    return None


class Feed:
    """The interface the loop and the checkpoint use (see the module docstring)."""

    kind = ""

    def next_batch(self) -> tuple[Any, float]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def check_state(self, saved: Any) -> None:
        """Refuse (:class:`DataError`, one line naming the field) a saved ``source`` record
        that does not belong to this source; nothing is changed."""
        raise NotImplementedError

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Take a checked record's position (the sampler's is restored with the sampler)."""

    def close(self) -> None:
        """Stop what reads ahead (DataLoader workers)."""


class _SamplerFeed(Feed):
    """Order from the run's sampler; the record is the training set's identity."""

    def __init__(
        self,
        data: Any,
        sampler: Sampler,
        config: Config,
        device: torch.device,
        world: World | None,
        num_samples: int,
        fingerprint: str | None,
    ) -> None:
        self.data, self.sampler, self.config, self.device, self.world = data, sampler, config, device, world
        self.num_samples, self.fingerprint = num_samples, fingerprint

    def _next_indices(self) -> tuple[int, list[int], float]:
        """Advance the live sampler by one global batch: (epoch, this rank's indices, scale)."""
        indices, scale = [int(i) for i in self.sampler.next_indices()], 1.0
        if self.world is not None:
            indices, scale = self.world.slice(indices)
        return batch_epoch(self.sampler), indices, scale

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "num_samples": self.num_samples, "fingerprint": self.fingerprint}

    def check_state(self, saved: Any) -> None:
        live = self.state_dict()
        _check_kind(saved, self.kind)
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


def _check_kind(saved: Any, kind: str) -> None:
    found = saved.get("kind") if isinstance(saved, dict) else None
    if found != kind:
        raise DataError(
            f"the checkpoint was trained from a {found!r} source, this run's data.factory gives a {kind!r} "
            "one: resume with the data factory it was trained with"
        )


class BatchFeed(_SamplerFeed):
    """``get_batch(indices, device)`` in the training process."""

    kind = "batches"

    def next_batch(self) -> tuple[Any, float]:
        _, indices, scale = self._next_indices()
        return self.data.get_batch(indices, self.device), scale


class LoaderFeed(_SamplerFeed):
    """A ``DataLoader`` over ``train_dataset`` in the order of a copy of the sampler."""

    kind = "dataset"

    def __init__(
        self,
        data: Any,
        sampler: Sampler,
        generator: np.random.Generator,
        config: Config,
        device: torch.device,
        world: World | None,
    ) -> None:
        dataset = data.train_dataset
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise DataError(
                f"train_dataset is a {type(dataset).__name__}, which has no __len__ and __getitem__: "
                "give a map-style dataset, or a stream as train_iterable"
            )
        super().__init__(
            data, sampler, config, device, world, len(dataset), dataset_fingerprint(data, dataset)
        )
        self.generator = generator
        self.collate = getattr(data, "collate", None) or default_collate
        self._iterator: Any = None

    def _start(self) -> None:
        # Started at the first batch, after any restore: the copy starts at the live position.
        order = _Order(clone_sampler(self.sampler, self.data, self.generator, self.config), self.world)
        workers = self.config.data.num_workers
        loader = DataLoader(
            _SeededSamples(self.data.train_dataset, self.config.training.seed),
            batch_sampler=order,
            num_workers=workers,
            collate_fn=_Collate(self.collate),
            pin_memory=self.device.type == "cuda",
            worker_init_fn=_worker_init if workers else None,
            # torch draws each iterator's worker base seed from this generator; by
            # default it would draw from the training process's torch stream.
            generator=torch.Generator().manual_seed(self.config.training.seed),
        )
        main = threading.current_thread() is threading.main_thread()
        before = signal.getsignal(signal.SIGCHLD) if main else None
        self._iterator = iter(loader)
        if main and before is not None and signal.getsignal(signal.SIGCHLD) is not before:
            # torch's SIGCHLD handler raises wherever the main thread is when a worker dies
            # (mid-step, mid-save: a traceback). Without it the loader notices a dead worker at
            # its next status check, inside next() below, where it becomes one line.
            signal.signal(signal.SIGCHLD, before)

    def next_batch(self) -> tuple[Any, float]:
        if self._iterator is None:
            self._start()
        epoch, indices, scale = self._next_indices()
        died = None
        try:
            fetched = next(self._iterator)
        except RuntimeError as exc:
            if "DataLoader worker" not in str(exc):
                raise
            died = str(exc).strip().splitlines()[0]
        if died is not None:
            # Raised here, outside the except block: the loader's error (whose traceback holds
            # the iterator) is gone, so closing frees the iterator and shuts its workers down.
            self.close()
            raise DataError(
                f"a DataLoader worker died: {died} (killed by the OS? running out of memory is the usual "
                "cause: lower data.num_workers or the memory a sample takes); the last committed checkpoint "
                "is intact: resume with --resume latest"
            )
        if isinstance(fetched, _Failure):
            self.close()
            raise DataError(
                fetched.message() + "; the last committed checkpoint is intact: fix it and resume with "
                "--resume latest"
            )
        expected = [(epoch, i) for i in indices]
        if fetched.keys != expected:
            self.close()
            raise DataError(
                f"the sampler gave other batches when copied from its saved state (epoch, index "
                f"{fetched.keys[:3]} instead of {expected[:3]}): a sampler must be a function of its "
                "state_dict() and the generator it was given"
            )
        return to_device(fetched.batch, self.device, non_blocking=self.device.type == "cuda"), scale

    def close(self) -> None:
        # Dropping the iterator shuts its workers down (torch's iterator does it on deletion).
        self._iterator = None


class _Order:
    """The DataLoader's batch sampler: (epoch, index) keys of this rank's slice of each batch."""

    def __init__(self, sampler: Sampler, world: World | None) -> None:
        self.sampler, self.world = sampler, world

    def __iter__(self):
        while True:
            indices = [int(i) for i in self.sampler.next_indices()]
            if self.world is not None:
                indices, _ = self.world.slice(indices)
            epoch = batch_epoch(self.sampler)
            yield [(epoch, i) for i in indices]


class _Fetched:
    """A batch with the keys it was built from (checked against the live sampler)."""

    def __init__(self, keys: list[tuple[int, int]], batch: Any) -> None:
        self.keys, self.batch = keys, batch

    def pin_memory(self) -> "_Fetched":  # called by the DataLoader's pinning thread
        return _Fetched(self.keys, _map_tensors(self.batch, lambda t: t.pin_memory()))


class _Failure:
    """A sample or collate error, carried back as plain text: a worker's exception object may
    not survive the trip, and its traceback is not the user's message."""

    def __init__(self, where: str, exc: BaseException) -> None:
        self.where = where
        text = str(exc).strip()
        self.what = f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__

    def message(self) -> str:
        return f"{self.where} raised {self.what}"


class _SeededSamples(torch.utils.data.Dataset):
    """``dataset[index]`` for each (epoch, index) key, each seeded by its key; the caller's
    generators are put back after the batch (the training process's streams)."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])

    def __getitems__(self, keys: list[tuple[int, int]]) -> Any:
        samples = []
        with isolated_rng():
            for epoch, index in keys:
                seed_sample(self.seed, epoch, index)
                try:
                    samples.append(self.dataset[index])
                except Exception as exc:  # any user error: reported with the sample it came from
                    return _Failure(f"train_dataset[{index}] (epoch {epoch})", exc)
        return _Fetched(list(keys), samples)


class _Collate:
    def __init__(self, collate: Callable[[list], Any]) -> None:
        self.collate = collate

    def __call__(self, fetched: Any) -> Any:
        if isinstance(fetched, _Failure):
            return fetched
        try:
            return _Fetched(fetched.keys, self.collate(fetched.batch))
        except Exception as exc:
            first = fetched.keys[0][1] if fetched.keys else "?"
            return _Failure(f"collate of the batch starting at sample {first}", exc)


def _worker_init(worker_id: int) -> None:
    # Out of the launching process group: a terminal's Ctrl-C (or a SIGTERM sent to the
    # group) reaches the training process, which stops gracefully, saves, and then shuts its
    # workers down; a worker killed first would end the run with an error instead. A worker
    # whose training process died exits by itself (torch's watchdog).
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def make_feed(
    data: Any, sampler: Sampler | None, generator: np.random.Generator, config: Config, device: torch.device
) -> Feed:
    """The feed for ``data``'s form (:func:`~pipeline.data.task.input_mode`)."""
    mode = input_mode(data)
    world = launch_world(config, device)
    if mode == "stream":
        from .stream import StreamFeed

        return StreamFeed(data, config, device, world)
    if config.data.num_workers and mode == "batches":
        raise DataError(
            f"{config.source}: data.num_workers is {config.data.num_workers}, but data.factory gives "
            "get_batch, which runs in the training process: give a train_dataset to use workers, or set "
            "data.num_workers: 0"
        )
    if sampler is None:
        raise DataError("data.factory's make_sampler returned None")
    if mode == "batches":
        return BatchFeed(
            data, sampler, config, device, world, data.num_train, getattr(data, "fingerprint", None)
        )
    return LoaderFeed(data, sampler, generator, config, device, world)
