"""A distributed save and resume, side by side: ours against torch.distributed.checkpoint's
own writers and readers on the same state in the same launch. A benchmark, not a test.

    python benchmarks/distributed.py [--sizes 0.06,0.6,3] [--reps 3] [--nproc 2] [--mode fsdp2]

One torchrun launch (gloo on CPU, one thread per rank) per size. Each rank builds the
default regression task (float64), its hidden width chosen so that weights + AdamW's two
moments total the size, sharded by ``--mode``; one step makes the optimizer state. Then,
per repetition, in an order rotated by the repetition (``sidebyside``):

- save: ``ours`` = :class:`~pipeline.checkpoint.distributed.DistributedCheckpointer`
  ``save`` (every rank's shards, RNG file, hashes, the sealed meta.json, the atomic commit);
  ``dcp_hf`` = ``dcp.save`` with ``HuggingFaceStorageWriter`` of the same tensors;
  ``dcp_fs`` = ``dcp.save`` with its default ``FileSystemWriter`` (pickle ``.metadata``);
- resume (files dropped from the page cache first): ``ours`` = ``restore_distributed`` on
  every rank, as ``02_train.py --resume`` under torchrun: each rank reads the files it uses
  whole into its memory and hashes them there against the sealed meta.json, every shard
  header parsed and every tensor's coverage checked, DCP's reads served from those bytes;
  ``dcp_hf`` / ``dcp_fs`` = ``dcp.load`` with the matching reader into the live tensors;
- stall: ``async`` = how long ``save`` keeps training waiting with ``checkpoint.async``
  (state dicts, RNG capture, the copy into reused buffers, the thread's start; the commit
  is waited for untimed); ``memcpy`` = this rank's local model and optimizer shards taken
  from torch's state-dict API and copied into preallocated buffers, the floor any snapshot
  through that API pays; ``memcpy_only`` = the copy alone.

Times are rank 0's, barrier to barrier; CPU seconds rank 0's process (all its threads)
over the candidate alone. Files go to ``$BENCH_DIR`` (default: beside the
repository, same disk). Printed: medians per size, then every target (met / borderline /
missed) and the other ratios; ``--out`` gets the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from sidebyside import Ratio, evict, loadavg, ratio, rotated, summary, target_table  # noqa: E402

SAVES = ("save/ours", "save/dcp_hf", "save/dcp_fs")
LOADS = ("resume/ours", "resume/dcp_hf", "resume/dcp_fs")
STALLS = ("stall/async", "stall/memcpy", "stall/memcpy_only")
TARGETS = (
    ("save / dcp.save, HF writer", "save/ours", "save/dcp_hf", 1.15),
    ("save / dcp.save, FileSystemWriter", "save/ours", "save/dcp_fs", 1.5),
    ("async stall / state dicts + memcpy of the local shards", "stall/async", "stall/memcpy", 1.2),
    ("async stall / memcpy of the local shards alone", "stall/async", "stall/memcpy_only", None),
    ("verified resume / dcp.load, HF reader", "resume/ours", "resume/dcp_hf", 1.2),
    ("verified resume / dcp.load, FileSystemReader", "resume/ours", "resume/dcp_fs", None),
)
FEATURES = 1024


def hidden_for(size_gb: float, features: int = FEATURES) -> int:
    """The MLP's hidden width whose float64 weights and two Adam moments (24 bytes per
    parameter) total ``size_gb``: parameters ~ h^2 + (features + 3) h."""
    params = size_gb * 1e9 / 24
    return max(8, round((-(features + 3) + math.sqrt((features + 3) ** 2 + 4 * params)) / 2))


def launch(args: argparse.Namespace, size: str, part: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        __file__,
        "--worker",
        "--mode",
        args.mode,
        "--hidden",
        str(hidden_for(float(size))),
        "--reps",
        str(args.reps),
        "--part",
        str(part),
    ]
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        raise SystemExit(f"the {size} GB launch failed (exit {result.returncode})")
    return json.loads(part.read_text())


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import (
        FileSystemReader,
        FileSystemWriter,
        HuggingFaceStorageReader,
        HuggingFaceStorageWriter,
    )
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from pipeline.checkpoint import CheckpointStore
    from pipeline.checkpoint.dist_restore import restore_distributed
    from pipeline.checkpoint.distributed import DistributedCheckpointer, _model_state, _optimizer_state
    from pipeline.checkpoint.store import read_meta
    from pipeline.checkpoint.weights import model_summary
    from pipeline.config import load_config
    from pipeline.data import load_manifest, prepare_data
    from pipeline.distributed.world import LaunchWorld
    from pipeline.run import build_run, fresh_buffers
    from pipeline.train import run_provenance, train_step

    scratch = Path(os.environ.get("BENCH_DIR") or REPO.parent)
    root = scratch / f".bench-distributed-{args.hidden}"
    overrides = {
        "data.dir": str(root / "data"),
        "checkpoint.dir": str(root / "ours"),
        "training.parallel": args.mode,
        "data.params.num_features": FEATURES,
        "model.params.hidden": args.hidden,
        "checkpoint.keep_last": 1,
    }
    config = load_config(REPO / "config.yaml", overrides)
    world = LaunchWorld.start(config)
    if world.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        prepare_data(config)
    world.barrier()
    summary_: dict = {}

    def wrap(model):
        summary_.update(model_summary(model, fresh_buffers(model)))
        return world.wrap(model, config)

    run = build_run(config, world.device, wrap=wrap, world=world)
    train_step(run, world)  # the optimizer's state exists from the first step on
    store = CheckpointStore(config.checkpoint.dir, keep_last=1)
    if world.rank == 0:
        store.acquire()
    provenance = run_provenance(config, load_manifest(config), world.device, [])
    checkpointer = DistributedCheckpointer(store, world, provenance, summary_)
    background = DistributedCheckpointer(
        CheckpointStore(root / "async", keep_last=1), world, provenance, summary_, background=True
    )
    if world.rank == 0:
        background.store.acquire()

    def tensors():
        return {**_model_state(run, summary_["tensors"]), **_optimizer_state(run)[1]}

    def fresh(name: str) -> Path:
        folder = root / name
        if world.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        world.barrier()
        return folder

    def full_state():
        return {
            "model": get_model_state_dict(run.model),
            "optim": get_optimizer_state_dict(run.model, run.optimizer),
        }

    def resume_ours():
        folder = store.path_for(run.step)
        restore_distributed(run, world, folder, read_meta(folder))

    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors().values()]
    floor = [torch.empty_like(t) for t in local]
    for target, source in zip(floor, local):
        target.copy_(source)  # faulted in: the floor is the steady state

    def memcpy(shards=None):
        shards = shards or [t.to_local() if hasattr(t, "to_local") else t for t in tensors().values()]
        for target, source in zip(floor, shards):
            np.copyto(
                target.reshape(-1).view(torch.uint8).numpy(), source.reshape(-1).view(torch.uint8).numpy()
            )

    candidates = {
        "save/ours": lambda: checkpointer.save(run),
        "save/dcp_hf": lambda: dcp.save(
            tensors(), storage_writer=HuggingFaceStorageWriter(str(fresh("dcp_hf")), save_distributed=True)
        ),
        "save/dcp_fs": lambda: dcp.save(full_state(), storage_writer=FileSystemWriter(str(fresh("dcp_fs")))),
        "resume/ours": resume_ours,
        "resume/dcp_hf": lambda: dcp.load(
            tensors(), storage_reader=HuggingFaceStorageReader(str(root / "dcp_hf"))
        ),
        "resume/dcp_fs": lambda: dcp.load(
            full_state(), storage_reader=FileSystemReader(str(root / "dcp_fs"))
        ),
        "stall/memcpy": memcpy,
        "stall/memcpy_only": lambda: memcpy(local),
        "stall/async": lambda: background.save(run),
    }
    sources = {
        "resume/ours": lambda: store.path_for(run.step),
        "resume/dcp_hf": lambda: root / "dcp_hf",
        "resume/dcp_fs": lambda: root / "dcp_fs",
    }
    times: dict[str, list[float]] = {name: [] for name in candidates}
    cpu: dict[str, list[float]] = {name: [] for name in candidates}
    loads = []
    background.save(run)  # the first background save allocates the buffers: untimed
    background.wait()
    for rep in range(args.reps):
        train_step(run, world)  # untimed: a new step folder per repetition (keep_last 1 prunes the last)
        loads.append(loadavg())
        for phase in (SAVES, LOADS, STALLS):
            for name in rotated(phase, rep):
                if name in sources and world.rank == 0:
                    evict(sources[name]())
                world.barrier()
                started, used = time.perf_counter(), time.process_time()
                candidates[name]()
                spent = time.process_time() - used  # before the barrier, which spins on gloo
                world.barrier()
                times[name].append(time.perf_counter() - started)
                cpu[name].append(spent)
                if name == "stall/async":
                    background.wait()  # untimed: the commit in the background
    background.close()
    if world.rank == 0:
        store.release()
        background.store.release()
        full = tensors()
        state_bytes = sum(t.numel() * t.element_size() for t in full.values())
        Path(args.part).write_text(
            json.dumps(
                {
                    "nproc": world.world_size,
                    "mode": args.mode,
                    "hidden": args.hidden,
                    "params": summary_["num_parameters"],
                    "state_bytes": state_bytes,
                    "loadavg_1min": loads,
                    "seconds": times,
                    "cpu_seconds": cpu,
                },
                indent=1,
            )
            + "\n"
        )
        shutil.rmtree(root, ignore_errors=True)
    world.close()


def report(parts: dict[str, dict], out: Path, command: str) -> None:
    ratios: list[Ratio] = []
    print(f"command: {command}\n")
    for size, part in parts.items():
        scope = f"{part['state_bytes'] / 1e9:.2f} GB"
        load = ", ".join(f"{x:.1f}" for x in part["loadavg_1min"])
        print(
            f"### state {scope} ({size} requested; {part['nproc']} processes, {part['mode']}, "
            f"{part['params'] / 1e6:.1f}M float64 parameters; 1-min load average per repetition: {load})\n"
        )
        print("| candidate | median s [min-max] | CPU s, median |\n| --- | --- | ---: |")
        for name, values in part["seconds"].items():
            spread = summary(values)
            used = summary(part["cpu_seconds"][name])["median"]
            print(
                f"| {name} | {spread['median']:.3f} [{spread['min']:.3f}-{spread['max']:.3f}] | {used:.3f} |"
            )
        print()
        for label, top, bottom, goal in TARGETS:
            ratios.append(ratio(label, scope, part["seconds"][top], part["seconds"][bottom], goal))
        ratios.append(
            ratio(
                "verified resume / dcp.load, HF reader: CPU",
                scope,
                part["cpu_seconds"]["resume/ours"],
                part["cpu_seconds"]["resume/dcp_hf"],
                None,
            )
        )
    print("targets (met: both estimates meet the goal; borderline: one does)\n")
    print(target_table(ratios) + "\n")
    print("other ratios: ratio of medians (median of per-repetition ratios)")
    for r in ratios:
        if r.target is None:
            print(f"  {r.scope:8s} {r.label:48s} {r.of_medians:6.3f} ({r.median_of_ratios:.3f})")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"command": command, "sizes": parts, "ratios": [r.to_dict() for r in ratios]}, indent=1)
        + "\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default="0.06,0.6,3", help="state sizes in GB (weights + Adam), comma-separated"
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--mode", choices=("ddp", "fsdp2"), default="fsdp2")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "distributed.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    parts = {}
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as scratch:
        for size in [s.strip() for s in args.sizes.split(",") if s.strip()]:
            print(f"{size} GB: one launch of {args.nproc} processes ...", file=sys.stderr, flush=True)
            parts[size] = launch(args, size, Path(scratch) / f"{size}.json")
    report(parts, args.out, " ".join(["python", "benchmarks/distributed.py", *sys.argv[1:]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
