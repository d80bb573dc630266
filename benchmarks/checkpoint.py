"""Checkpoint save and resume, side by side: ours (sync, async, the verified resume) against
what users would otherwise pick, torch.distributed.checkpoint as a peer, the disk's limit
and the in-memory copy. A benchmark, not a test.

    python benchmarks/checkpoint.py [--sizes 0.06,0.6,3] [--reps 3] [--memory all|targets|none]

State: an MLP of three square fp32 Linear layers sized so weights + AdamW state total each
``--sizes`` GB (0.6 GB is ~50M parameters). Every repetition is a fresh worker process per
size that builds the state once and runs every candidate in an order rotated by the
repetition (``sidebyside``: medians, paired ratios, targets). Peak memory is measured
separately: one fresh process per candidate and size (see ``memory_worker``). Files go to
a temporary folder beside the repository (same disk), removed at the end. Printed: one
table per size, then every target (met / borderline / missed), then the other ratios.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import types
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sidebyside import Ratio, evict, fsync_tree, loadavg, ratio, rotated, summary, target_table  # noqa: E402

from pipeline.checkpoint import (  # noqa: E402
    Checkpointer,
    CheckpointStore,
    checkpoint_meta,
    load_checkpoint,
    read_tensors,
)
from pipeline.checkpoint.tensorfile import WRITE_CHUNK, WRITEBACK_WINDOW  # noqa: E402
from pipeline.config import Config  # noqa: E402
from pipeline.data import EpochSampler  # noqa: E402
from pipeline.data.feed import BatchFeed  # noqa: E402
from pipeline.environment import current_environment  # noqa: E402
from pipeline.layout import MODEL_FILE, STATE_FILE  # noqa: E402
from pipeline.provenance import library_versions  # noqa: E402
from pipeline.rng import seed_everything  # noqa: E402
from pipeline.run import TrainingRun  # noqa: E402
from pipeline.world import World  # noqa: E402

__all__ = ["main"]

SAVES = (
    "ours_sync",
    "ours_async",
    "torch_save",
    "safetensors_save_file",
    "accelerate_save_state",
    "dcp_save_hf",
    "raw_write",
    "raw_write_streamed",
    "memcopy",
    "memcopy_torch",
)
LOADS = (
    "ours_resume",
    "ours_load_mapped",
    "torch_load",
    "torch_load_into",
    "safetensors_load_file",
    "accelerate_load_state",
    "dcp_load_hf",
    "dcp_resume_hf",
    "sha256_floor",
    "sha256_all_cores",
    "copy_hash_floor",
)
TARGETED = ("ours_sync", "ours_async")  # the candidates with a peak-memory target
LABELS = {
    "ours_sync": "ours, sync (SHA-256, fsync, atomic rename)",
    "ours_async": "ours, async (stall = snapshot; wall = commit)",
    "ours_async_first": "ours, async, first save (allocates buffers)",
    "torch_save": "torch.save(model+optim) + fsync",
    "safetensors_save_file": "safetensors save_file(weights) + fsync",
    "accelerate_save_state": "accelerate save_state + fsync",
    "dcp_save_hf": "dcp.save, HuggingFaceStorageWriter",
    "raw_write": "raw write + fsync (same bytes)",
    "raw_write_streamed": "raw write + fsync, streamed writeback",
    "memcopy": "in-memory copy into reused buffers (memcpy)",
    "memcopy_torch": "in-memory copy into reused buffers (Tensor.copy_)",
    "ours_resume": "ours: verified resume, as 02 --resume (every byte hashed)",
    "ours_load_mapped": "ours: read_tensors (mapped, no verification)",
    "torch_load": "torch.load(weights_only=True)",
    "torch_load_into": "torch.load + load_state_dict (model, optimizer)",
    "safetensors_load_file": "safetensors load_file(weights)",
    "accelerate_load_state": "accelerate load_state (into model)",
    "dcp_load_hf": "dcp.load, HuggingFaceStorageReader (into model, optimizer)",
    "dcp_resume_hf": "dcp.load as a resume runs it (a fresh optimizer's state built first)",
    "sha256_floor": "hashing floor: file bytes / (cores x one core's SHA-256 rate)",
    "sha256_all_cores": "the same bytes hashed by a thread per core at once (measured, not divided)",
    "copy_hash_floor": "copy + hash floor: the bytes copied where a resume puts them, and hashed, / cores",
}
# The targets of a checkpoint (per size): (label, numerator, denominator, goal).
TARGETS = (
    ("verified resume / torch.load(weights_only=True)", ("ours_resume", "wall"), ("torch_load", "wall"), 1.1),
    ("verified resume / dcp.load, HF reader", ("ours_resume", "wall"), ("dcp_load_hf", "wall"), 1.2),
    (
        "verified resume / dcp.load as a resume runs it",
        ("ours_resume", "wall"),
        ("dcp_resume_hf", "wall"),
        None,
    ),
    ("verified resume / hashing floor", ("ours_resume", "wall"), ("sha256_floor", "wall"), None),
    ("verified resume / copy + hash floor", ("ours_resume", "wall"), ("copy_hash_floor", "wall"), None),
    (
        "hashing on every core at once / hashing floor",
        ("sha256_all_cores", "wall"),
        ("sha256_floor", "wall"),
        None,
    ),
    ("sync save / raw write + fsync, streamed", ("ours_sync", "wall"), ("raw_write_streamed", "wall"), 1.1),
    ("async stall / in-memory copy (memcpy)", ("ours_async", "stall"), ("memcopy", "wall"), 1.2),
    ("sync save / torch.save + fsync", ("ours_sync", "wall"), ("torch_save", "wall"), 1.0),
    ("sync save / dcp.save, HF writer", ("ours_sync", "wall"), ("dcp_save_hf", "wall"), None),
    (
        "verified resume / torch.load + load_state_dict",
        ("ours_resume", "wall"),
        ("torch_load_into", "wall"),
        None,
    ),
    ("mapped, unverified load / torch.load", ("ours_load_mapped", "wall"), ("torch_load", "wall"), None),
    ("async wall (to commit) / sync save", ("ours_async", "wall"), ("ours_sync", "wall"), None),
    ("raw write + fsync / streamed", ("raw_write", "wall"), ("raw_write_streamed", "wall"), None),
)
# Verified resume / the hashing floor, when the files are in memory (tmpfs): reading costs
# a copy at memory speed, so what remains is hashing, which should use every core.
TMPFS_FLOOR_GOAL = 1.3
# Extra peak RSS / state: (candidate, goal).
MEMORY_TARGETS = (("ours_sync", 0.05), ("ours_async", 1.05))
# Time per GB at the largest size / at 0.6 GB (goal 1.2): what grows faster than the state.
GROWTH = (
    ("sync save", "ours_sync", "wall"),
    ("async stall", "ours_async", "stall"),
    ("verified resume", "ours_resume", "wall"),
)
GROWTH_GOAL = 1.2
# glibc otherwise keeps freed tensors of a few MB in its heap, where the next candidate
# reuses them without growing RSS; a fixed threshold makes every tensor its own mapping,
# returned on free, so each candidate's peak shows what it allocated.
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
# dcp warns that it runs without a process group: that is the single-process peer.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


# -- the state ------------------------------------------------------------------------------
def build_run(size_gb: float) -> TrainingRun:
    """Weights + AdamW's two moments = 12 bytes per parameter; three square layers."""
    width = round(math.sqrt(size_gb * 1e9 / 12 / 3))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, width)).square().mean().backward()
    optimizer.step()  # materializes exp_avg / exp_avg_sq
    optimizer.zero_grad(set_to_none=True)
    generator = seed_everything(0)
    history = {"step": list(range(1, 1001)), "loss": [1.0] * 1000, "lr": [1e-4] * 1000}
    data, sampler = types.SimpleNamespace(num_train=64), EpochSampler(64, 8, generator)
    return TrainingRun(
        config=Config(),
        device=torch.device("cpu"),
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0),
        data=data,
        sampler=sampler,
        feed=BatchFeed(
            data, sampler, Config(), torch.device("cpu"), World(device=torch.device("cpu")), 64, None
        ),
        generator=generator,
        scaler=None,
        autocast_dtype=None,
        step=1000,
        history=history,
    )


def state_tensors(run: TrainingRun) -> list[torch.Tensor]:
    tensors = list(run.model.state_dict().values())
    for entry in run.optimizer.state.values():
        tensors += [t for t in entry.values() if isinstance(t, torch.Tensor)]
    return tensors


def _provenance() -> dict[str, Any]:
    return {
        "config": Config().to_dict(),
        "fingerprints": {"data": "bench", "code": "bench"},
        "versions": library_versions(),
        "device": "cpu",
        "environment": {**current_environment(torch.device("cpu")), "changes": []},
        "lineage": [],
    }


# -- helpers --------------------------------------------------------------------------------
def _bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def _touch(tensors) -> int:
    """Read every byte (a reduction over each tensor's bytes), as training would."""
    return sum(int(t.detach().reshape(-1).view(torch.uint8).max()) for t in tensors if t.numel())


def _size(root: Path) -> int:
    return (
        root.stat().st_size
        if root.is_file()
        else sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    )


def _accelerator(run: TrainingRun):
    try:
        from accelerate import Accelerator
    except ImportError:
        return None
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(run.model, run.optimizer)
    return accelerator


def _flat_optimizer(run: TrainingRun) -> dict[str, torch.Tensor]:
    """The optimizer's tensors under flat names: what a DCP safetensors checkpoint stores."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    flat = get_optimizer_state_dict(
        run.model, run.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    return {f"optim.{name}": t for name, t in flat.items() if isinstance(t, torch.Tensor)}


# -- candidates -----------------------------------------------------------------------------
class Bench:
    """One worker's state, output folder and candidates; each returns (wall, stall, bytes)."""

    def __init__(self, size_gb: float, folder: Path, *, with_accelerate: bool = True) -> None:
        self.run = build_run(size_gb)
        self.folder = folder
        self.tensors = state_tensors(self.run)
        self.state_bytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.provenance = _provenance()  # built once per run by train.py too
        self.accelerator = _accelerator(self.run) if with_accelerate else None
        self.async_checkpointer: Checkpointer | None = None
        self.async_store: CheckpointStore | None = None
        self.copies: list[torch.Tensor] | None = None
        self.outputs: dict[str, Path] = {}

    def _timed(self, name: str, action: Callable[[], Path]) -> tuple[float, float, int]:
        """Time ``action``, a save. Its previous output is deleted first and the deletion
        synced, untimed, so that every writer, ours included, writes new files on a disk in
        the same state: none pays for freeing its old files, and none writes into space
        freed just before while another does not (on this VM's disk the second is about
        1.7× faster, which decided the ratios). Ours prunes behind training anyway."""
        previous = self.outputs.pop(name, None)
        if previous is not None and previous.exists():
            shutil.rmtree(previous) if previous.is_dir() else previous.unlink()
        os.sync()
        start = time.perf_counter()
        path = action()
        wall = time.perf_counter() - start
        self.outputs[name] = path
        return wall, wall, _size(path)

    def ours_sync(self):
        store = CheckpointStore(self.folder / "ours_sync")
        with store:
            self.run.step += 1
            checkpointer = Checkpointer(store, self.provenance)
            return self._timed("ours_sync", lambda: checkpointer.save(self.run).path)

    def first_async_save(self):
        """The first async save allocates the buffers (page faults): reported on its own."""
        self.async_store = CheckpointStore(self.folder / "ours_async", keep_last=2)
        self.async_store.acquire()
        self.async_checkpointer = Checkpointer(self.async_store, self.provenance, background=True)
        return self.ours_async()

    def ours_async(self):
        """Steady state: the buffers exist from a first save; the stall is save() returning."""
        if self.async_checkpointer is None:
            return self.first_async_save()
        self.run.step += 1
        start = time.perf_counter()
        pending = self.async_checkpointer.save(self.run)
        stall = time.perf_counter() - start
        saved = pending.result()
        wall = time.perf_counter() - start
        self.async_store.wait_for_prune()  # behind training; not the next candidate's cost
        self.outputs["ours_async"] = saved.path
        return wall, stall, _size(saved.path)

    def torch_save(self):
        path = self.folder / "torch_save.pt"

        def save() -> Path:
            torch.save(
                {"model": self.run.model.state_dict(), "optimizer": self.run.optimizer.state_dict()}, path
            )
            fsync_tree(path)
            return path

        return self._timed("torch_save", save)

    def safetensors_save_file(self):
        from safetensors.torch import save_file

        path = self.folder / "weights.safetensors"

        def save() -> Path:
            save_file(self.run.model.state_dict(), str(path))
            fsync_tree(path)
            return path

        return self._timed("safetensors_save_file", save)

    def accelerate_save_state(self):
        if self.accelerator is None:
            return None
        path = self.folder / "accelerate"

        def save() -> Path:
            self.accelerator.save_state(str(path))
            fsync_tree(path)
            return path

        return self._timed("accelerate_save_state", save)

    def dcp_save_hf(self):
        """torch.distributed.checkpoint with the safetensors writer, in one process: the
        model's and the optimizer's tensors (DCP's writer fsyncs each file itself)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        path = self.folder / "dcp_hf"

        def save() -> Path:
            dcp.save(
                {**self.run.model.state_dict(), **_flat_optimizer(self.run)},
                storage_writer=HuggingFaceStorageWriter(str(path)),
            )
            return path

        return self._timed("dcp_save_hf", save)

    def _raw(self, name: str, streamed: bool):
        path = self.folder / f"{name}.bin"

        def write() -> Path:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                written = flushed = 0
                for tensor in self.tensors:
                    view = memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())
                    for start in range(0, len(view), WRITE_CHUNK):
                        chunk = view[start : start + WRITE_CHUNK]
                        while chunk:
                            chunk = chunk[os.write(fd, chunk) :]
                        written += len(view[start : start + WRITE_CHUNK])
                        if streamed and written - flushed >= WRITEBACK_WINDOW:
                            os.posix_fadvise(fd, flushed, written - flushed, os.POSIX_FADV_DONTNEED)
                            flushed = written
                os.fsync(fd)
            finally:
                os.close(fd)
            return path

        return self._timed(name, write)

    def raw_write(self):
        return self._raw("raw_write", streamed=False)

    def raw_write_streamed(self):
        """The writeback hint our writer uses (``posix_fadvise(DONTNEED)`` every 8 MiB starts
        writeback early, so the final fsync waits for little): the disk's limit for it."""
        return self._raw("raw_write_streamed", streamed=True)

    def _memcopy(self, copy_one: Callable[[torch.Tensor, torch.Tensor], Any]):
        if self.copies is None:
            self.copies = [torch.empty_like(t) for t in self.tensors]
            for copy, tensor in zip(self.copies, self.tensors):
                copy.copy_(tensor)  # fault the pages in: the floor is the steady state
        start = time.perf_counter()
        for copy, tensor in zip(self.copies, self.tensors):
            copy_one(copy, tensor)
        wall = time.perf_counter() - start
        return wall, wall, self.state_bytes

    def memcopy(self):
        """The floor: one plain memcpy per tensor (the primitive the snapshot uses)."""
        return self._memcopy(lambda copy, tensor: np.copyto(_bytes(copy), _bytes(tensor)))

    def memcopy_torch(self):
        """What ``Tensor.copy_`` does (OpenMP-parallel per tensor), for reference."""
        return self._memcopy(lambda copy, tensor: copy.copy_(tensor))

    # loads: every file was fsynced by its save and is evicted from the page cache first
    def _load(self, source: str, load: Callable[[Path], Any]):
        path = self.outputs.get(source)
        if path is None:
            return None
        evict(path)
        gc.collect()
        start = time.perf_counter()
        _touch(load(path))
        wall = time.perf_counter() - start
        return wall, wall, _size(path)

    def ours_resume(self):
        """What ``02_train.py --resume`` does: meta.json first (to build the run), then every
        byte of both files verified as it is read: the weights into the live model's
        parameters, the training state into memory of this process."""

        def load(folder: Path):
            folder, _ = checkpoint_meta(folder)
            loaded = load_checkpoint(folder, into=self.run.model)
            return [*loaded.model_tensors.values(), *loaded.state_tensors.values()]

        return self._load("ours_sync", load)

    def ours_load_mapped(self):
        return self._load(
            "ours_sync",
            lambda folder: [
                *read_tensors(folder / MODEL_FILE).values(),
                *read_tensors(folder / STATE_FILE).values(),
            ],
        )

    def torch_load(self):
        def load(path: Path):
            state = torch.load(path, weights_only=True)
            tensors = list(state["model"].values())
            for entry in state["optimizer"]["state"].values():
                tensors += [t for t in entry.values() if isinstance(t, torch.Tensor)]
            return tensors

        return self._load("torch_save", load)

    def torch_load_into(self):
        """A torch user's resume: torch.load, then both ``load_state_dict``."""

        def load(path: Path):
            state = torch.load(path, weights_only=True)
            self.run.model.load_state_dict(state["model"])
            self.run.optimizer.load_state_dict(state["optimizer"])
            return state_tensors(self.run)

        return self._load("torch_save", load)

    def safetensors_load_file(self):
        from safetensors.torch import load_file

        return self._load("safetensors_save_file", lambda path: list(load_file(str(path)).values()))

    def accelerate_load_state(self):
        if self.accelerator is None:
            return None

        def load(path: Path):
            self.accelerator.load_state(str(path))  # copies into the live model and optimizer
            return state_tensors(self.run)

        return self._load("accelerate_save_state", load)

    def dcp_load_hf(self):
        """dcp.load into the live tensors (the model's, the optimizer's), in one process."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        def load(path: Path):
            template = {**self.run.model.state_dict(), **_flat_optimizer(self.run)}
            dcp.load(template, storage_reader=HuggingFaceStorageReader(str(path)))
            return list(template.values())

        return self._load("dcp_save_hf", load)

    def dcp_resume_hf(self):
        """dcp.load as a resume runs it: the optimizer is new (no state), so its state is built
        first by torch's state-dict API (zeros in fresh pages, as our resume's training-state
        tensors are fresh), then everything is loaded into the model and that state."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        def load(path: Path):
            optimizer = torch.optim.AdamW(self.run.model.parameters(), lr=self.run.optimizer.defaults["lr"])
            fresh = types.SimpleNamespace(model=self.run.model, optimizer=optimizer)
            template = {**self.run.model.state_dict(), **_flat_optimizer(fresh)}
            dcp.load(template, storage_reader=HuggingFaceStorageReader(str(path)))
            return list(template.values())

        return self._load("dcp_save_hf", load)

    def sha256_floor(self):
        """What verifying costs at the least: the checkpoint's bytes hashed from memory by one
        thread, timed here, divided by the cores (as if every core hashed a share, with
        nothing else to do)."""
        folder = self.outputs.get("ours_sync")
        if folder is None:
            return None
        data = [(folder / name).read_bytes() for name in (MODEL_FILE, STATE_FILE)]
        start = time.perf_counter()
        for raw in data:
            hashlib.sha256(raw).digest()
        wall = (time.perf_counter() - start) / (os.cpu_count() or 1)
        return wall, wall, sum(len(raw) for raw in data)

    def sha256_all_cores(self):
        """The hashing floor's bytes hashed by a thread per core at once, each thread a share
        of 64 MiB pieces: what the cores deliver together, which the floor assumes is
        ``cores`` times one core (on a VM whose vCPUs share physical cores, it is not)."""
        folder = self.outputs.get("ours_sync")
        if folder is None:
            return None
        data = [memoryview((folder / name).read_bytes()) for name in (MODEL_FILE, STATE_FILE)]
        pieces = [
            raw[at : at + 64 * 1024 * 1024] for raw in data for at in range(0, len(raw), 64 * 1024 * 1024)
        ]
        cores = os.cpu_count() or 1
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=cores) as pool:
            list(pool.map(lambda piece: hashlib.sha256(piece).digest(), pieces))
        wall = time.perf_counter() - start
        return wall, wall, sum(len(raw) for raw in data)

    def copy_hash_floor(self):
        """What a verified load costs at the least when the used bytes must be the hashed ones:
        the checkpoint's bytes, already in memory, copied by one thread where a resume puts
        them (the weights into existing tensors, the training state into fresh ones, whose
        pages are faulted in on first touch) and hashed, the time divided by the cores."""
        folder = self.outputs.get("ours_sync")
        if folder is None:
            return None
        weights, state = [(folder / name).read_bytes() for name in (MODEL_FILE, STATE_FILE)]
        existing = torch.empty(len(weights), dtype=torch.uint8)
        existing.fill_(0)  # the live model's parameters: faulted in long before a resume
        start = time.perf_counter()
        np.copyto(existing.numpy(), np.frombuffer(weights, dtype=np.uint8))
        fresh = torch.empty(len(state), dtype=torch.uint8)
        np.copyto(fresh.numpy(), np.frombuffer(state, dtype=np.uint8))
        for raw in (existing.numpy(), fresh.numpy()):
            hashlib.sha256(raw).digest()
        wall = (time.perf_counter() - start) / (os.cpu_count() or 1)
        return wall, wall, len(weights) + len(state)

    def close(self) -> None:
        if self.async_checkpointer is not None:
            self.async_checkpointer.close()
            self.async_store.release()
            self.async_checkpointer = None


def _on_tmpfs(path: Path) -> bool:
    """Whether ``path`` lies on a tmpfs (its files are in memory: nothing to evict)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        where = fields[1]
        if str(path.resolve()).startswith(where.rstrip("/") + "/") and len(where) > len(best):
            best, kind = where, fields[2]
    return kind == "tmpfs"


def timing_worker(size_gb: float, rep: int, folder: Path, only: str | None = None) -> dict[str, Any]:
    chosen = set(only.split(",")) if only else None
    bench = Bench(size_gb, folder, with_accelerate=chosen is None or bool(chosen & {"accelerate_save_state"}))
    # Other jobs on the machine show up here; the report keeps them next to the figures.
    results: dict[str, Any] = {
        "state_bytes": bench.state_bytes,
        "loadavg": loadavg(),
        "tmpfs": _on_tmpfs(folder),
    }
    try:
        if chosen is None or "ours_async" in chosen:
            results["ours_async_first"] = bench.first_async_save()
        for phase in (SAVES, LOADS):
            for name in rotated([n for n in phase if chosen is None or n in chosen], rep):
                gc.collect()
                results[name] = getattr(bench, name)()
            bench.close()  # the loads run without the snapshot buffers and copies (3 GB each at 3 GB)
            bench.copies = None
    finally:
        bench.close()
    return results


# -- peak memory ----------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


LOAD_SOURCE = {
    "ours_resume": "ours_sync",
    "ours_load_mapped": "ours_sync",
    "torch_load": "torch_save",
    "torch_load_into": "torch_save",
    "safetensors_load_file": "safetensors_save_file",
    "accelerate_load_state": "accelerate_save_state",
    "dcp_load_hf": "dcp_save_hf",
    "dcp_resume_hf": "dcp_save_hf",
}


def memory_worker(size_gb: float, candidate: str, folder: Path) -> dict[str, Any]:
    """Extra resident memory of one candidate: VmHWM (peak RSS) is reset through
    /proc/self/clear_refs just before it runs; extra = peak - RSS at that moment.

    Loads first run their format's save, unmeasured. The async candidate is its first
    save on a new checkpointer, so its persistent snapshot buffers are counted. RSS counts
    mapped file pages too: a memory-mapped load shows the pages it touched.
    """
    bench = Bench(size_gb, folder, with_accelerate=candidate.startswith("accelerate"))
    try:
        source = LOAD_SOURCE.get(candidate)
        if source is not None and getattr(bench, source)() is None:
            return {"skipped": True}
        if candidate.startswith("memcopy"):
            bench.copies = None  # allocate inside the measurement, like a first snapshot
        measured = bench.first_async_save if candidate == "ours_async" else getattr(bench, candidate)
        gc.collect()
        before = _status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        result = measured()
        peak = _status_kib("VmHWM")
        return {
            "skipped": result is None,
            "extra_bytes": (peak - before) * 1024,
            "peak_bytes": peak * 1024,
            "state_bytes": bench.state_bytes,
        }
    finally:
        bench.close()


# -- driver ---------------------------------------------------------------------------------
def _spawn(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", *args]
    result = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    if result.returncode != 0:
        raise RuntimeError(f"worker {' '.join(args)} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "state_bytes": runs[0]["state_bytes"],
        "loadavg_1min": [r["loadavg"] for r in runs],
        "tmpfs": runs[0]["tmpfs"],
        "candidates": {},
    }
    for name in ("ours_async_first", *SAVES, *LOADS):
        measured = [r[name] for r in runs if r.get(name) is not None]
        if len(measured) == len(runs):
            out["candidates"][name] = {
                "wall": summary([m[0] for m in measured]),
                "stall": summary([m[1] for m in measured]),
                "bytes": measured[0][2],
            }
    return out


def _ratios(sizes: dict[str, dict[str, Any]]) -> list[Ratio]:
    rows = []
    for size, result in sizes.items():
        scope = f"{result['state_bytes'] / 1e9:.2f} GB"
        cands = result["candidates"]
        for label, (top, top_kind), (bottom, bottom_kind), goal in TARGETS:
            if (top, bottom) == ("ours_resume", "sha256_floor") and result.get("tmpfs"):
                goal = TMPFS_FLOOR_GOAL
            if top in cands and bottom in cands:
                rows.append(
                    ratio(
                        label,
                        scope,
                        cands[top][top_kind]["values"],
                        cands[bottom][bottom_kind]["values"],
                        goal,
                    )
                )
        for name, goal in MEMORY_TARGETS:
            memory = result.get("memory", {}).get(name)
            if memory and not memory.get("skipped"):
                share = memory["extra_bytes"] / result["state_bytes"]
                rows.append(
                    Ratio(f"{LABELS[name].split(' (')[0]}: extra peak RSS / state", scope, share, None, goal)
                )
    small = next((s for s, r in sizes.items() if abs(r["state_bytes"] / 1e9 - 0.6) < 0.1), None)
    large = max(sizes, key=lambda s: sizes[s]["state_bytes"])
    if small is not None and sizes[large]["state_bytes"] > 2 * sizes[small]["state_bytes"]:
        low, high = sizes[small], sizes[large]
        scope = f"{high['state_bytes'] / 1e9:.2f} vs {low['state_bytes'] / 1e9:.2f} GB"
        for label, name, kind in GROWTH:
            if name in low["candidates"] and name in high["candidates"]:
                per_gb = [
                    [value / result["state_bytes"] for value in result["candidates"][name][kind]["values"]]
                    for result in (high, low)
                ]
                rows.append(ratio(f"{label}: time per GB", scope, *per_gb, GROWTH_GOAL))
    return rows


def _fmt_span(summary_: dict[str, Any]) -> str:
    return f"{summary_['median']:7.3f} [{summary_['min']:.3f}-{summary_['max']:.3f}]"


def _table(size: str, result: dict[str, Any]) -> str:
    state_gb = result["state_bytes"] / 1e9
    load = ", ".join(f"{x:.1f}" for x in result["loadavg_1min"])
    where = "tmpfs" if result.get("tmpfs") else "disk"
    lines = [
        f"### state {state_gb:.3f} GB ({size} requested, on {where}; 1-min load average per repetition: {load})",
        "",
        "| candidate | bytes | wall s, median [min-max] | training stall s | GB/s | extra peak RSS |",
        "| --- | ---: | --- | --- | ---: | ---: |",
    ]
    memory = result.get("memory", {})
    for name, cand in result["candidates"].items():
        mem = memory.get(name, {})
        rss = f"{mem['extra_bytes'] / 1e9:.3f} GB" if "extra_bytes" in mem and not mem.get("skipped") else "-"
        stall = _fmt_span(cand["stall"]) if name == "ours_async_first" or name in SAVES else "-"
        lines.append(
            f"| {LABELS[name]} | {cand['bytes'] / 1e6:,.0f} MB | {_fmt_span(cand['wall'])} | {stall} | "
            f"{cand['bytes'] / 1e9 / cand['wall']['median']:.2f} | {rss} |"
        )
    return "\n".join(lines)


def _machine() -> dict[str, Any]:
    try:
        accelerate = importlib.metadata.version("accelerate")
    except importlib.metadata.PackageNotFoundError:
        accelerate = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "versions": {**library_versions(), "accelerate": accelerate},
    }


def drive(
    sizes: list[str], reps: int, out: Path, memory: str, folder_parent: Path, only: str | None = None
) -> dict[str, Any]:
    folder_root = Path(tempfile.mkdtemp(prefix=".checkpoint-bench-", dir=folder_parent))
    timings: dict[str, list[dict[str, Any]]] = {size: [] for size in sizes}
    try:
        for rep in range(reps):
            for size in rotated(sizes, rep):
                folder = folder_root / f"{size}-rep{rep}"
                folder.mkdir()
                print(f"rep {rep + 1}/{reps}, {size} GB ...", file=sys.stderr, flush=True)
                timings[size].append(
                    _spawn(
                        ["timing", "--size", size, "--rep", str(rep), "--dir", str(folder)]
                        + (["--only", only] if only else [])
                    )
                )
                shutil.rmtree(folder)
        results = {size: _aggregate(runs) for size, runs in timings.items()}
        candidates = {"all": (*SAVES, *LOADS), "targets": TARGETED, "none": ()}[memory]
        for size in sizes:
            results[size]["memory"] = {}
            for name in candidates:
                folder = folder_root / f"{size}-memory-{name}"
                folder.mkdir()
                print(f"peak memory, {size} GB, {name} ...", file=sys.stderr, flush=True)
                results[size]["memory"][name] = _spawn(
                    ["memory", "--size", size, "--candidate", name, "--dir", str(folder)], env=MEMORY_ENV
                )
                shutil.rmtree(folder)
    finally:
        shutil.rmtree(folder_root, ignore_errors=True)
    report = {
        "command": " ".join(["python", "benchmarks/checkpoint.py", *sys.argv[1:]]),
        "reps": reps,
        "machine": _machine(),
        "sizes": results,
        "ratios": [r.to_dict() for r in _ratios(results)],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def _print_report(report: dict[str, Any], out: Path) -> None:
    print(f"command: {report['command']}  ({report['reps']} interleaved repetitions; JSON: {out})\n")
    for size, result in report["sizes"].items():
        print(_table(size, result) + "\n")
    ratios = [
        Ratio(r["label"], r["scope"], r["of_medians"], r["median_of_ratios"], r["target"])
        for r in report["ratios"]
    ]
    print("targets (met: both estimates meet the goal; borderline: one does)\n")
    print(target_table(ratios) + "\n")
    print("other ratios: ratio of medians (median of per-repetition ratios)")
    for r in ratios:
        if r.target is None:
            paired = f" ({r.median_of_ratios:.3f})" if r.median_of_ratios is not None else ""
            print(f"  {r.scope:8s} {r.label:48s} {r.of_medians:6.3f}{paired}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="0.06,0.6,3", help="state sizes in GB, comma-separated")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (>= 1)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "checkpoint.json")
    parser.add_argument(
        "--memory",
        choices=("all", "targets", "none"),
        default="all",
        help="which candidates get a peak-RSS process (targets: ours, sync and async)",
    )
    parser.add_argument(
        "--tmp-parent",
        type=Path,
        default=REPO.parent,
        help="where the temporary folder goes (default: beside the repository, same disk)",
    )
    parser.add_argument(
        "--only",
        help="time only these candidates (comma-separated names, e.g. ours_sync,ours_resume,torch_load; "
        "a load needs the save whose output it reads)",
    )
    parser.add_argument("--worker", choices=("timing", "memory"), help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--candidate", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "timing":
        print(json.dumps(timing_worker(float(args.size), args.rep, args.dir, args.only)))
        return 0
    if args.worker == "memory":
        print(json.dumps(memory_worker(float(args.size), args.candidate, args.dir)))
        return 0
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    report = drive(sizes, max(1, args.reps), args.out, args.memory, args.tmp_parent, args.only)
    _print_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
