"""One launch of the distributed resume proof (internal; started by scripts/03 with
``--nproc-per-node``; see :mod:`pipeline.proof.distributed`).

    torchrun --standalone --nproc-per-node N -m pipeline.proof.dist_leg OUTPUT/LAUNCH/spec.json

Runs the spec's trainings one after the other in one process group. Right after each
restore every rank copies its live state of each component
(:func:`pipeline.checkpoint.dist_restore.live_components`); a control's copy is compared with
the first run's (the full resume) for the component it leaves out, and the ranks' checks go
to rank 0, which writes one result per run: the step reached and that "exercise" check
(an omission's: the first rank whose restored values differ; the RNG swap's: the first rank
whose streams did not change; else rank 0's).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from ..checkpoint import live_components
from ..cli import run_main
from ..config import config_from_dict, launch_mode
from ..distributed.world import LaunchWorld
from ..durable import write_json_atomic
from ..train import TrainingHooks, train
from .compare import compare


def run_launch(spec_path: Path) -> None:
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    runs = spec["runs"]
    first = config_from_dict(runs[0]["config"], source=str(spec_path))
    world = LaunchWorld.start(first)
    results: list[dict[str, Any]] = []
    baseline: dict[str, Any] | None = None
    try:
        for run in runs:
            config = config_from_dict(run["config"], source=str(spec_path))
            seen: dict[str, Any] = {}
            hooks = TrainingHooks(
                skip_restore=tuple(run["omit"]),
                swap_rng=run["swap_rng"],
                on_start=lambda live: seen.update(live_components(live)),
            )
            result = train(
                config,
                world=dataclasses.replace(
                    world, mode=launch_mode(config.training.parallel, world.world_size)
                ),
                resume=run["resume"],
                stop_at=run["stop_at"],
                progress=False,
                hooks=hooks,
            )
            entry: dict[str, Any] = {"name": run["name"], "step": result.step}
            if baseline is None:
                baseline = seen
            else:
                component = run["omit"][0] if run["omit"] else "rng"
                check = compare(f"exercise.{component}", component, baseline[component], seen[component], 0.0)
                ranks = [json.loads(text) for text in world.gather_text(json.dumps(check.to_dict()))]
                entry["exercise"] = reported_exercise(ranks, swap=run["swap_rng"])
            results.append(entry)
    finally:
        world.close()
    lead = world.rank == 0
    if lead:
        write_json_atomic(Path(spec["results"]), results, allow_nan=True)


def reported_exercise(ranks: list[dict[str, Any]], *, swap: bool) -> dict[str, Any]:
    """The one exercise check a control reports, of every rank's (in rank order)."""
    # An omission shows on any rank that holds the component; a swap must reach every rank,
    # so the one to report is a rank it left with its own streams.
    telling = [check for check in ranks if check["passed"] == swap]
    return (telling or ranks)[0]


def main() -> int:
    if len(sys.argv) != 2:
        print(
            "usage: torchrun ... -m pipeline.proof.dist_leg SPEC.json (internal to scripts/03_verify_resume.py)",
            file=sys.stderr,
        )
        return 2
    run_launch(Path(sys.argv[1]))
    return 0


if __name__ == "__main__":
    run_main(main)
