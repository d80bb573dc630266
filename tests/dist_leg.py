"""Several distributed trainings in one torchrun launch (a launch costs seconds here).

    torchrun --standalone --nproc-per-node N tests/dist_leg.py PLAN.json

PLAN: {"config": path, "results": path, "runs": [{"overrides": {...}, "resume": ...,
"stop_at": ..., "reshard": ..., "forge": {...}}, ...]}. ``forge`` (rank 0, before the run):
copy checkpoint folder ``from`` to ``to`` and set ``meta.json``'s ``key`` (a path of keys)
to ``value``, resealed as a forger would. Rank 0 writes one result per run (step, losses,
checkpoint, or the refusal's type and message) to ``results``.
"""

import dataclasses
import json
import shutil
import sys
from pathlib import Path

from pipeline.checkpoint.store import meta_sha256
from pipeline.config import load_config
from pipeline.distributed.training import train_distributed
from pipeline.distributed.world import World
from pipeline.durable import json_bytes
from pipeline.errors import PipelineError


def forge(spec: dict) -> None:
    shutil.copytree(spec["from"], spec["to"])
    for meta_path in Path(spec["to"]).glob("step-*/meta.json"):
        meta = json.loads(meta_path.read_text())
        *parents, last = spec["key"]
        node = meta
        for key in parents:
            node = node[key]
        node[last] = spec["value"]
        meta["meta_sha256"] = meta_sha256(meta)
        meta_path.write_bytes(json_bytes(meta))


def main(plan_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    world = World.start(load_config(plan["config"], plan["runs"][0]["overrides"]))
    results = []
    try:
        for run in plan["runs"]:
            config = load_config(plan["config"], run["overrides"])
            if "forge" in run and world.rank == 0:
                forge(run["forge"])
            world.barrier()
            try:
                result = train_distributed(config, world=dataclasses.replace(world, mode=config.training.parallel),
                                           resume=run.get("resume"), stop_at=run.get("stop_at"), progress=False,
                                           reshard=run.get("reshard", False))
                results.append({"step": result.step, "loss": result.history["loss"],
                                "checkpoint": str(result.checkpoint)})
            except PipelineError as exc:
                results.append({"error": type(exc).__name__, "message": str(exc)})
    finally:
        world.close()
    if world.rank == 0:
        Path(plan["results"]).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
