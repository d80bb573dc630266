"""Streams: a ``train_iterable`` with ``state_dict()`` / ``load_state_dict()`` (a
``datasets.IterableDataset`` streamed from local files), batched by ``data.batch_size``.

Under torchrun, ``data.stream_split`` decides how the ranks share the stream:

- ``examples`` (the default): every rank reads the whole stream in order and keeps its
  slice of each global batch, as for a map-style dataset. Global batch ``k`` is records
  ``kB .. kB + B - 1``, each seeded by its position in the pass: the same samples at any
  world size, and one position for all ranks, so a stream resumes on another number of
  processes (``--reshard``). The price: each rank reads and maps every record (as
  ``split_dataset_by_node(strategy="examples")`` does, which is also why it is not used: its
  skipped records would draw from the kept ones' seeds);
- ``shards``: each rank reads only its files (``datasets.distributed.split_dataset_by_node``
  with ``strategy="shards"``; ``num_shards`` a multiple of the world size) and takes
  ``B / W`` samples per step; rank ``r``'s sample ``k`` is seeded as position ``kW + r``. The
  global order depends on the world size, and each rank's position is its own: such a
  stream resumes on the same number of processes only.

A checkpoint stores the position as JSON (the pass, the records read in it, and the
source's own ``state_dict()``); nothing is read ahead, so the saved position is exactly the
trained one. When the stream ends a new pass starts (``set_epoch(pass)`` where the source
has it). A source whose saved state does not resume it exactly (a shuffle buffer:
``datasets`` does not save the buffer's contents) is refused before the first step; see
docs/data.md.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import default_collate

from ..config import Config
from ..errors import SEALED_BUT_UNFIT, DataError, InputFailed, first_line
from ..hashing import sha256_bytes
from ..world import World
from .failures import catchable, collate_failure, sample_deadline
from .feed_base import Feed, dataset_fingerprint, to_device
from .seeding import isolated_rng, seed_sample
from .task import STREAM

__all__ = ["StreamFeed"]

_PROBE = 3  # samples read, then compared after a save and load, by the exactness probe


def _json_copy(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise DataError(
            f"{what} is not plain JSON ({exc}): a checkpoint stores a stream's state as JSON, never pickle"
        ) from None


class StreamFeed(Feed):
    """One rank's reader of a ``train_iterable`` (see the module docstring)."""

    kind = STREAM

    def __init__(self, data: Any, config: Config, device: torch.device, world: World) -> None:
        source = data.train_iterable
        if not (
            callable(getattr(source, "state_dict", None))
            and callable(getattr(source, "load_state_dict", None))
        ):
            raise DataError(
                f"train_iterable is a {type(source).__name__} without state_dict() and load_state_dict(): "
                "a stream must save its position to resume exactly (a datasets.IterableDataset does)"
            )
        if config.data.num_workers:
            raise DataError(
                f"{config.source}: data.num_workers is {config.data.num_workers}, but a stream is read in the "
                "training process (its saved position is exact only there): set data.num_workers: 0, or "
                "give a map-style train_dataset"
            )
        self.config, self.device, self.world = config, device, world
        self.seed = config.training.seed
        self.rank, self.world_size = world.rank, world.world_size
        self.split = config.data.stream_split
        self.sharded = self.split == "shards" and self.world_size > 1
        batch = config.data.batch_size
        self.rows = batch  # a stream's batches are all full
        if self.sharded:
            if batch % self.world_size:
                raise DataError(
                    f"data.batch_size {batch} does not divide over {self.world_size} processes: with "
                    "data.stream_split 'shards' each rank reads the same number of samples per step"
                )
            self.reads, self.keep, self.scale = (
                batch // self.world_size,
                list(range(batch // self.world_size)),
                1.0,
            )
            self.stride, self.offset = self.world_size, self.rank  # rank r's k-th sample is position kW + r
        else:
            self.reads, self.stride, self.offset = batch, 1, 0
            self.keep, self.scale = world.slice(list(range(batch)))
        self.collate = getattr(data, "collate", None) or default_collate
        self.identity = self._identity(data, source)
        self.source = self._split(source)
        self.initial = _json_copy(self.source.state_dict(), "train_iterable.state_dict()")
        self.pass_ = 0
        self.consumed = 0
        self._pending: dict[str, Any] | None = None  # a restored state, loaded when the pass begins
        self._iterator: Iterator[Any] | None = None
        self._probed = False

    def _identity(self, data: Any, source: Any) -> str:
        """What a saved state must have been taken from: the source's type, its fresh state's
        structure (the chain of readers and maps), its shards, features and fingerprint."""
        record = {
            "type": f"{type(source).__module__}.{type(source).__qualname__}",
            "state": _json_copy(source.state_dict(), "train_iterable.state_dict()"),
            "num_shards": getattr(source, "num_shards", None),
            "features": str(getattr(source, "features", None)),
            "fingerprint": dataset_fingerprint(data, source),
        }
        return sha256_bytes(json.dumps(record, sort_keys=True).encode("utf-8"))

    def _split(self, source: Any) -> Any:
        if not self.sharded:
            return source
        datasets = sys.modules.get("datasets")
        if datasets is None or not isinstance(source, datasets.IterableDataset):
            raise DataError(
                f"train_iterable is a {type(source).__name__}: under torchrun a stream is split with "
                "datasets.distributed.split_dataset_by_node, so it must be a datasets.IterableDataset"
            )
        from datasets.distributed import split_dataset_by_node

        shards = getattr(source, "num_shards", 1)
        if shards % self.world_size:
            raise DataError(
                f"data.stream_split is 'shards' but the stream has {shards} shards, not a multiple of "
                f"{self.world_size} processes: use 'examples', or split the files evenly"
            )
        return split_dataset_by_node(source, rank=self.rank, world_size=self.world_size, strategy=self.split)

    # -- reading -------------------------------------------------------------------------
    def _begin_pass(self) -> None:
        if callable(getattr(self.source, "set_epoch", None)):
            self.source.set_epoch(self.pass_)
        if self._pending is not None:
            self.source.load_state_dict(copy.deepcopy(self._pending))
            self._pending = None
        elif self.pass_ and not callable(getattr(self.source, "set_epoch", None)):
            self.source.load_state_dict(copy.deepcopy(self.initial))  # a source without epochs restarts here
        self._iterator = iter(self.source)

    def _next_sample(self) -> Any:
        while True:
            if self._iterator is None:
                self._begin_pass()
            seed_sample(self.seed, self.pass_, self.consumed * self.stride + self.offset)
            try:
                sample = next(self._iterator)
            except StopIteration:
                if self.consumed == 0:
                    raise DataError(
                        f"the stream gave no sample in pass {self.pass_}"
                        f"{f' on rank {self.rank}' if self.sharded else ''}: train_iterable is empty"
                    ) from None
                self.pass_, self.consumed, self._iterator = self.pass_ + 1, 0, None
                continue
            except BaseException as exc:  # the stream's own code, even a SystemExit
                if not catchable(exc):
                    raise
                raise InputFailed(
                    f"{self._name(self.consumed)} raised {first_line(exc, named=True)}"
                ) from exc
            self.consumed += 1
            return sample

    def _name(self, position: int) -> str:
        """How a message names the stream's record ``position`` of the current pass."""
        rank = f" on rank {self.rank}" if self.sharded else ""
        return f"train_iterable's record {position} of pass {self.pass_}{rank}"

    def next_batch(self) -> tuple[Any, float]:
        where = f"the stream's batch from record {self.consumed} of pass {self.pass_}"
        with sample_deadline(self.config.data.sample_timeout, where):
            if not self._probed:
                self._probe()
            first = self.consumed
            with isolated_rng():
                samples = [self._next_sample() for _ in range(self.reads)]
            kept = [samples[i] for i in self.keep]
            try:
                batch = self.collate(kept)
            except BaseException as exc:
                if not catchable(exc):
                    raise
                names = [f"record {first + i}" for i in self.keep]
                what = collate_failure(names, kept, exc, self.collate is default_collate)
                where = f"collate of the stream's {names[0]} to {names[-1]} of pass {self.pass_}"
                raise InputFailed(f"{where} {what}") from exc
        return to_device(batch, self.device), self.scale

    def _probe(self) -> None:
        """Before the first step: read a few samples from a copy of the source, save its state,
        load it into another copy and compare what both read next. A source whose state does
        not carry everything (a shuffle buffer) reads otherwise, and is refused now rather
        than after a resume that silently trained on other samples."""
        self._probed = True
        with isolated_rng():
            try:
                first, second = copy.deepcopy(self.source), copy.deepcopy(self.source)
            except Exception as exc:
                raise DataError(
                    f"train_iterable cannot be copied ({first_line(exc, named=True)}): the pipeline reads a copy to check, "
                    "before the first step, that the stream resumes exactly from its state_dict(); keep "
                    "what cannot be copied (open files, locks, generators) out of the object, or open it in "
                    "__iter__ (a datasets.IterableDataset can be copied)"
                ) from exc
            try:
                reader = iter(first)
                for position in range(_PROBE):
                    self._read_seeded(reader, position)
                state = _json_copy(first.state_dict(), "train_iterable.state_dict()")
                expected = [self._read_seeded(reader, position) for position in range(_PROBE, 2 * _PROBE)]
                second.load_state_dict(state)
                reader = iter(second)
                got = [self._read_seeded(reader, position) for position in range(_PROBE, 2 * _PROBE)]
            except StopIteration:
                return  # too short to tell; a stream that short resumes by re-reading anyway
            except BaseException as exc:  # the stream's own code, read here first
                if not catchable(exc):
                    raise
                raise InputFailed(
                    f"train_iterable, read from a copy before the first step (to check that it resumes "
                    f"exactly), raised {first_line(exc, named=True)}"
                ) from exc
        if not _same(expected, got):
            raise DataError(
                "train_iterable does not resume exactly from its own state_dict(): after a save and load it "
                "reads other samples (a shuffle buffer? datasets does not save its contents). Shuffle the "
                "files instead (or use a map-style train_dataset, shuffled by the sampler): docs/data.md"
            )

    def _read_seeded(self, reader: Iterator[Any], position: int) -> Any:
        seed_sample(self.seed, 0, position * self.stride + self.offset)
        return next(reader)

    # -- state ---------------------------------------------------------------------------
    def _own_record(self) -> dict[str, Any]:
        if self._iterator is None and self._pending is not None:
            state = self._pending
        elif self._iterator is None and self.consumed == 0:
            state = None  # the start of a pass
        else:
            state = _json_copy(self.source.state_dict(), "train_iterable.state_dict()")
        return {"pass": self.pass_, "consumed": self.consumed, "state": state}

    def state_dict(self) -> dict[str, Any]:
        """The position: one for all ranks, or (``shards``) every rank's, gathered (every rank
        calls this together)."""
        own = self._own_record()
        ranks = (
            [json.loads(text) for text in self.world.gather_text(json.dumps(own, allow_nan=False))]
            if self.sharded
            else [own]
        )
        return {
            "kind": self.kind,
            "identity": self.identity,
            "split": self.split,
            "world_size": self.world_size if self.sharded else None,
            "ranks": ranks,
        }

    def check_state(self, saved: Any) -> None:
        where = "training_state.data.source"
        self.check_kind(saved)
        if set(saved) != {"kind", "identity", "split", "world_size", "ranks"}:
            raise DataError(
                f"{where} does not hold exactly kind, identity, split, world_size, ranks: {SEALED_BUT_UNFIT}"
            )
        if saved["identity"] != self.identity:
            raise DataError(
                f"{where}: the saved stream position belongs to another source (identity "
                f"{str(saved['identity'])[:12]}, this train_iterable's {self.identity[:12]}): resume with "
                "the stream it was trained on"
            )
        if saved["split"] != self.split:
            raise DataError(f"{where}.split is {saved['split']!r}, data.stream_split is {self.split!r}")
        expected = self.world_size if self.sharded else None
        if saved["world_size"] != expected:
            raise DataError(
                f"the stream's position was saved by {saved['world_size']!r} processes reading their own "
                f"shards, this launch has {self.world_size}: with data.stream_split 'shards' each process "
                f"holds its own position, so the run resumes on {saved['world_size']!r} processes only"
            )
        ranks = saved["ranks"]
        count = self.world_size if self.sharded else 1
        if not isinstance(ranks, list) or len(ranks) != count:
            raise DataError(f"{where}.ranks does not hold {count} position(s): {SEALED_BUT_UNFIT}")
        for rank, record in enumerate(ranks):
            at = f"{where}.ranks[{rank}]"
            if not isinstance(record, dict) or set(record) != {"pass", "consumed", "state"}:
                raise DataError(f"{at} does not hold exactly pass, consumed, state: {SEALED_BUT_UNFIT}")
            for key in ("pass", "consumed"):
                if type(record[key]) is not int or record[key] < 0:
                    raise DataError(
                        f"{at}.{key} is {record[key]!r}, expected an integer >= 0: {SEALED_BUT_UNFIT}"
                    )
            if record["state"] is not None:
                _shaped_like(record["state"], self.initial, f"{at}.state")

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        own = saved["ranks"][self.rank if self.sharded else 0]
        self.pass_, self.consumed = own["pass"], own["consumed"]
        self._pending = copy.deepcopy(own["state"])
        self._iterator = None


def _shaped_like(saved: Any, fresh: Any, where: str) -> None:
    """``saved`` could have been taken from the source whose fresh state is ``fresh``: the same
    keys, the same names of its readers (the strings), counters as integers >= 0. Where the
    fresh state holds ``None`` (a position not reached yet) any JSON value is accepted; the
    source itself then reads it (and a failure there is one line)."""
    why = None
    if fresh is None:
        return
    if isinstance(fresh, dict):
        if not isinstance(saved, dict) or set(saved) != set(fresh):
            why = "has other fields"
        else:
            for key in fresh:
                _shaped_like(saved[key], fresh[key], f"{where}.{key}")
    elif isinstance(fresh, list):
        if not isinstance(saved, list) or len(saved) != len(fresh):
            why = f"is not a list of {len(fresh)}"
        else:
            for index, (s, f) in enumerate(zip(saved, fresh)):
                _shaped_like(s, f, f"{where}[{index}]")
    elif isinstance(fresh, bool):
        why = None if isinstance(saved, bool) else "is not a boolean"
    elif isinstance(fresh, int):
        why = None if type(saved) is int and saved >= 0 else "is not an integer >= 0"
    elif isinstance(fresh, str):
        why = None if saved == fresh else f"is {saved!r}, this source's is {fresh!r}"
    elif type(saved) is not type(fresh):
        why = f"is not a {type(fresh).__name__}"
    if why is not None:
        raise DataError(
            f"{where} {why}: the saved stream position does not belong to this train_iterable; resume with "
            "the stream it was trained on"
        )


def _same(a: Any, b: Any) -> bool:
    """Equal samples, whatever they hold (tensors, arrays, nested containers)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if hasattr(a, "__array__") and not isinstance(a, (str, bytes, dict, list, tuple)):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b
