"""A distributed save and resume, side by side: ours against torch.distributed.checkpoint's
own writers on the same state in the same launch. A benchmark, not a test.

    python benchmarks/distributed.py [--nproc 2] [--mode fsdp2] [--features 1024] [--hidden 8192] [--reps 3]

Launches itself under torchrun (gloo on CPU). Each rank builds the default regression task
widened to ``--features`` x ``--hidden`` (fp32; AdamW-style state after one step), then,
per repetition, in an order rotated by the repetition:

- ``ours``: :class:`pipeline.checkpoint.distributed.DistributedCheckpointer` ``save`` (DCP
  with the safetensors writer, per-rank RNG files, hashes, sealed meta.json, atomic commit);
- ``dcp_fs``: ``dcp.save`` with ``FileSystemWriter`` (the default, pickle ``.metadata``)
  of the model and optimizer state dicts;
- ``dcp_hf``: ``dcp.save`` with ``HuggingFaceStorageWriter`` of the same tensors ours writes;

and for the resume: ``ours`` = ``load_checkpoint`` (rank 0: hashes, strict headers, shard
coverage) + ``restore_distributed``; ``dcp_fs`` = ``dcp.load`` with ``FileSystemReader``.

The async save (``checkpoint.async``): ``stall/async`` is how long ``save`` keeps training
waiting (state dicts, RNG capture, the copy into the reused CPU buffers, the thread's
start), the commit then runs in the background and is waited for untimed;
``stall/memcpy`` is one copy of this rank's local model and optimizer shards into
preallocated buffers, the floor any snapshot pays.
Files go to ``$BENCH_DIR`` (default: the temporary folder). Rank 0 prints medians and
the ratios, and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def launch(args: argparse.Namespace) -> int:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               __file__, "--worker", "--mode", args.mode, "--features", str(args.features), "--hidden",
               str(args.hidden), "--reps", str(args.reps), "--out", args.out]
    return subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from pipeline.checkpoint import CheckpointStore, LoadMode, load_checkpoint
    from pipeline.checkpoint.distributed import DistributedCheckpointer, _model_state, _optimizer_state, restore_distributed
    from pipeline.checkpoint.store import read_meta
    from pipeline.checkpoint.weights import model_summary
    from pipeline.config import load_config
    from pipeline.data import load_manifest, prepare_data
    from pipeline.distributed.world import World
    from pipeline.run import build_run, fresh_buffers
    from pipeline.train import run_provenance, train_step

    scratch = Path(os.environ.get("BENCH_DIR") or tempfile.gettempdir())
    root = scratch / "bench-distributed"
    overrides = {"data.dir": str(root / "data"), "checkpoint.dir": str(root / "ours"),
                 "training.parallel": args.mode, "data.params.num_features": args.features,
                 "model.params.hidden": args.hidden, "checkpoint.keep_last": 1}
    config = load_config(REPO / "config.yaml", overrides)
    world = World.start(config)
    if world.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        prepare_data(config)
    world.barrier()
    summary: dict = {}

    def wrap(model):
        summary.update(model_summary(model, fresh_buffers(model)))
        return world.wrap(model, config)

    run = build_run(config, world.device, wrap=wrap)
    train_step(run, world)  # the optimizer's state exists from the first step on
    store = CheckpointStore(config.checkpoint.dir, keep_last=1)
    if world.rank == 0:
        store.acquire()
    checkpointer = DistributedCheckpointer(store, world, run_provenance(config, load_manifest(config), world.device,
                                                                        []), summary)
    background = DistributedCheckpointer(CheckpointStore(root / "async", keep_last=1), world,
                                         checkpointer.provenance, summary, background=True)
    if world.rank == 0:
        background.store.acquire()
    times: dict[str, list[float]] = {"save/ours": [], "save/dcp_fs": [], "save/dcp_hf": [], "load/ours": [],
                                     "load/dcp_fs": [], "stall/async": [], "stall/memcpy": []}

    def timed(key, call):
        world.barrier()
        started = time.perf_counter()
        call()
        world.barrier()
        times[key].append(time.perf_counter() - started)

    def fresh(name: str) -> Path:
        folder = root / name
        if world.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        world.barrier()
        return folder

    def save_ours():
        checkpointer.save(run)

    def save_fs():
        state = {"model": get_model_state_dict(run.model), "optim": get_optimizer_state_dict(run.model, run.optimizer)}
        dcp.save(state, storage_writer=FileSystemWriter(str(fresh("dcp_fs"))))

    def save_hf():
        tensors = {**_model_state(run, summary["tensors"]), **_optimizer_state(run)[1]}
        dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(fresh("dcp_hf")), save_distributed=True))

    def load_ours():
        folder = store.path_for(run.step)
        meta = load_checkpoint(folder, mode=LoadMode.VERIFY).meta if world.rank == 0 else None
        restore_distributed(run, world, folder, meta if meta is not None else read_meta(folder), reshard=False)

    def load_fs():
        state = {"model": get_model_state_dict(run.model), "optim": get_optimizer_state_dict(run.model, run.optimizer)}
        dcp.load(state, storage_reader=FileSystemReader(str(root / "dcp_fs")))

    def local_shards() -> list:
        tensors = {**_model_state(run, summary["tensors"]), **_optimizer_state(run)[1]}
        return [t.to_local() if hasattr(t, "to_local") else t for t in tensors.values()]

    floor = [torch.empty_like(t) for t in local_shards()]

    def memcpy():
        for target, source in zip(floor, local_shards()):
            np.copyto(target.reshape(-1).view(torch.uint8).numpy(), source.reshape(-1).view(torch.uint8).numpy())

    saves = [("save/ours", save_ours), ("save/dcp_fs", save_fs), ("save/dcp_hf", save_hf)]
    for rep in range(args.reps):
        train_step(run, world)  # untimed: a new step folder per repetition (keep_last 1 prunes the last)
        for key, call in saves[rep % 3:] + saves[:rep % 3]:
            timed(key, call)
        timed("load/ours", load_ours)
        timed("load/dcp_fs", load_fs)
        timed("stall/memcpy", memcpy)
        timed("stall/async", lambda: background.save(run))
        background.wait()  # untimed: the commit in the background
    background.close()
    if world.rank == 0:
        store.release()
        background.store.release()
        medians = {key: statistics.median(values) for key, values in times.items()}
        state_bytes = sum(t.numel() * t.element_size() for t in _model_state(run, summary["tensors"]).values())
        result = {"nproc": world.world_size, "mode": args.mode, "params": summary["num_parameters"],
                  "model_bytes_full": state_bytes, "reps": args.reps, "seconds": times, "median": medians,
                  "ratios": {"save ours / dcp_hf": medians["save/ours"] / medians["save/dcp_hf"],
                             "save ours / dcp_fs": medians["save/ours"] / medians["save/dcp_fs"],
                             "load ours / dcp_fs": medians["load/ours"] / medians["load/dcp_fs"],
                             "async stall / memcpy": medians["stall/async"] / medians["stall/memcpy"]}}
        for key, value in medians.items():
            print(f"{key:14s} median {value * 1000:8.1f} ms  (min {min(times[key]) * 1000:.1f}, "
                  f"max {max(times[key]) * 1000:.1f})")
        for key, value in result["ratios"].items():
            print(f"{key:22s} {value:.2f}x")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        shutil.rmtree(root, ignore_errors=True)
    world.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--mode", choices=("ddp", "fsdp2"), default="fsdp2")
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "distributed.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
