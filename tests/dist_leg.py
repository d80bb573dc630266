"""Several distributed trainings in one torchrun launch (a launch costs seconds here).

    torchrun --standalone --nproc-per-node N tests/dist_leg.py PLAN.json

PLAN: {"config": path, "results": path, "runs": [{"overrides": {...}, "resume": ...,
"stop_at": ..., "reshard": ...}, ...]}. Rank 0 writes one result per run (step, losses,
checkpoint, or the refusal's type and message) to ``results``.
"""

import dataclasses
import json
import sys
from pathlib import Path

from pipeline.config import load_config
from pipeline.distributed.training import train_distributed
from pipeline.distributed.world import World
from pipeline.errors import PipelineError


def main(plan_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    world = World.start(load_config(plan["config"], plan["runs"][0]["overrides"]))
    results = []
    try:
        for run in plan["runs"]:
            config = load_config(plan["config"], run["overrides"])
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
