"""Several distributed trainings in one torchrun launch (a launch costs seconds here).

    torchrun --standalone --nproc-per-node N tests/helpers/dist_leg.py PLAN.json

PLAN: {"config": path, "results": path, "register": "module:function" (optional: called
on every rank first, to register a training-state component), "runs": [{"overrides": {...}, "resume": ...,
"stop_at": ..., "reshard": ..., "extend_to": ..., "init_from": ..., "progress": ..., "forge": {...}},
...]}. ``forge`` (rank 0, before the run):
copy checkpoint folder ``from`` to ``to`` and set ``meta.json``'s ``key`` (a path of keys)
to ``value``, resealed as a forger would. ``copy`` (rank 0, before the run): copy the
checkpoint folder ``from`` into the folder ``to``, and flip the last byte of its file
``flip`` if given (damage after the seal), or delete its file ``strike`` and strike it from
``meta.json``, resealed, or replace ``old`` by ``new`` (as long) in the files of
``forge_header`` ``{file: [old, new]}``, keeping each original beside the folder; then
``reseal``: every file's ``meta.json`` entry made anew (meta.py's ``entry_of``) with chunks of
``chunk_size`` bytes, or whole-file digests only under ``schema`` (an older writer's form),
resealed.
``reads``: each rank counts the bytes it reads from each file under ``checkpoint.dir`` into
``<to>-rank<R>.json``, rewrites each file whose path starts with one of ``rewrite`` once it
has read it whole, and writes each file of ``restore`` back to its original once its header
was read (tests/helpers/readrecorder.py).
``record``: each rank records its file-system calls under ``checkpoint.dir``
(tests/helpers/oprecorder.py) with the time each completed (null for a call that raised,
such as a mkdir of a folder that exists), into ``<record>-rank<R>.json``, so the test can
merge the ranks' calls and check their order. Rank 0 writes one result per run (step, losses,
checkpoint, or the refusal's type and message; every rank's exit code) to ``results``.
Each rank writes ``<results>-threads-rank<R>.json``: the default process group's gloo threads
(those started by ``init_process_group``, which this harness calls first) as seen before
``LaunchWorld.close`` and as left after it.
"""

import contextlib
import dataclasses
import importlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist
from oprecorder import Recorder
from readrecorder import ReadRecorder

from pipeline.checkpoint.meta import entry_of, file_entry
from pipeline.config import launch_mode, load_config
from pipeline.distributed.world import LaunchWorld
from pipeline.errors import PipelineError
from pipeline.train import train

from support import reseal


def forge(spec: dict) -> None:
    shutil.copytree(spec["from"], spec["to"])
    *parents, last = spec["key"]

    def set_value(meta: dict) -> None:
        node = meta
        for key in parents:
            node = node[key]
        node[last] = spec["value"]

    for meta_path in Path(spec["to"]).glob("step-*/meta.json"):
        reseal(meta_path.parent, set_value)


def copy(spec: dict) -> None:
    source = Path(spec["from"])
    target = Path(spec["to"]) / source.name
    shutil.copytree(source, target)
    if spec.get("flip"):
        damaged = target / spec["flip"]
        data = bytearray(damaged.read_bytes())
        data[-1] ^= 1
        damaged.write_bytes(bytes(data))
    for name, (old, new) in spec.get("forge_header", {}).items():
        # The same length, so the file's size and data offsets stay; kept to be swapped back.
        forged = target / name
        data = forged.read_bytes()
        assert data.count(old.encode()) == 1 and len(old) == len(new), (name, old)
        (Path(spec["to"]) / f"{forged.name}.original").write_bytes(data)
        forged.write_bytes(data.replace(old.encode(), new.encode()))
    if spec.get("strike"):
        (target / spec["strike"]).unlink()
        reseal(target, lambda meta: meta["files"].pop(spec["strike"]))
    if spec.get("reseal"):
        how = spec["reseal"]

        def entries_anew(meta: dict) -> None:
            for name in meta["files"]:
                entry = entry_of((target / name).read_bytes(), how.get("chunk_size"))
                meta["files"][name] = (
                    entry if "chunk_size" in how else file_entry(entry["sha256"], entry["size"])
                )
            meta["schema"] = how.get("schema", meta["schema"])

        reseal(target, entries_anew)


def gloo_threads(among: set[int]) -> list[str]:
    """The names of the threads ``among`` (ids) that are alive and named by gloo (Linux)."""
    names = []
    for tid in sorted(among):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:  # ended
            continue
        if name.startswith(("gloo", "pt_gloo")):
            names.append(name)
    return names


def main(plan_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    if "register" in plan:  # "module:function" that registers a training-state component
        module, function = plan["register"].split(":")
        getattr(importlib.import_module(module), function)()
    # The default group alone first (LaunchWorld.start joins it), so its threads are known.
    dist.init_process_group("gloo")
    default_group = {int(tid) for tid in os.listdir("/proc/self/task")} - {threading.get_native_id()}
    world = LaunchWorld.start(load_config(plan["config"], plan["runs"][0]["overrides"]))
    results = []
    try:
        for run in plan["runs"]:
            config = load_config(plan["config"], run["overrides"])
            if "forge" in run and world.rank == 0:
                forge(run["forge"])
            if "copy" in run and world.rank == 0:
                copy(run["copy"])
            world.barrier()
            done: dict[int, int] = {}  # op index -> completion time (a call that raised has none)
            recorder = (
                Recorder(
                    config.checkpoint.dir,
                    after=lambda op: done.setdefault(len(recorder.ops) - 1, time.monotonic_ns()),
                )
                if "record" in run
                else contextlib.nullcontext()
            )
            reads = (
                ReadRecorder(
                    config.checkpoint.dir,
                    rewrite=True,
                    only=tuple(run["reads"].get("rewrite", [])),
                    restore={
                        name: (Path(config.checkpoint.dir) / f"{Path(name).name}.original").read_bytes()
                        for name in run["reads"].get("restore", [])
                    },
                )
                if "reads" in run
                else contextlib.nullcontext()
            )
            try:
                with recorder, reads:
                    result = train(
                        config,
                        world=dataclasses.replace(
                            world, mode=launch_mode(config.training.parallel, world.world_size)
                        ),
                        resume=run.get("resume"),
                        stop_at=run.get("stop_at"),
                        progress=run.get("progress", False),
                        reshard=run.get("reshard", False),
                        extend_to=run.get("extend_to"),
                        init_from=run.get("init_from"),
                    )
                outcome = {
                    "step": result.step,
                    "loss": result.history["loss"],
                    "grad_norm": result.history["grad_norm"],
                    "checkpoint": str(result.checkpoint),
                }
            except (PipelineError, OSError) as exc:
                # An OSError is exit 2 in a script (pipeline.cli.run_main).
                outcome = {
                    "error": type(exc).__name__,
                    "message": str(exc),
                    "exit_code": getattr(exc, "exit_code", 2),
                }
            # Every rank's exit code: a refusal must end every rank, with the same code.
            codes = [json.loads(text) for text in world.gather_text(json.dumps(outcome.get("exit_code", 0)))]
            results.append({**outcome, "exit_codes": codes})
            if "reads" in run:
                Path(f"{run['reads']['to']}-rank{world.rank}.json").write_text(
                    json.dumps({"read": reads.read, "rewritten": reads.rewritten})
                )
            if "record" in run:
                Path(f"{run['record']}-rank{world.rank}.json").write_text(
                    json.dumps(
                        {
                            "ops": [op.to_dict() for op in recorder.ops],
                            "done": [done.get(i) for i in range(len(recorder.ops))],
                        }
                    )
                )
    finally:
        seen = gloo_threads(default_group)
        world.close()
    Path(f"{plan['results']}-threads-rank{world.rank}.json").write_text(
        json.dumps({"before_close": seen, "after_close": gloo_threads(default_group)})
    )
    if world.rank == 0:
        Path(plan["results"]).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
