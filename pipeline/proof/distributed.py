"""The resume proof at a torchrun world size (``03_verify_resume.py --nproc-per-node N``).

Two launches of ``torchrun --standalone --nproc-per-node N -m pipeline.proof.dist_leg``,
real subprocesses like a user's (each launch costs seconds, so there are two, not one per
leg):

1. ``reference``: N uninterrupted steps, saving every K steps (``checkpoint.every = K``;
   saving draws no randomness and changes no number), so step K is the cut checkpoint and
   step N the reference's end.
2. ``resume`` and the controls, one after the other in one process group: ``resume``
   continues from step K to N (first, in fresh processes: exactly a user's relaunch); then
   once per control, a resume from the same checkpoint that leaves one component
   unrestored (``omit-rng``: every rank's RNG streams as a fresh run derives them,
   ``omit-optimizer``, ``omit-scheduler``, ``omit-data``) or restores each rank's RNG
   streams from the next rank's file (``swap-rng``).

Why the controls may share a launch: every training in it builds a new model, DDP/FSDP2
wrapper, optimizer, scheduler, sampler and data generator, and restores (or, for the
omitted component, re-derives as a fresh run) every RNG family each rank has, so nothing a
previous training left in the process reaches the next one's numbers; DDP rebuilds its
buckets per wrapper, not per process. The process group carries no state between
trainings (its collectives are stateless sums and broadcasts). A control's result
therefore equals what a launch of its own would give, and the positive resume, which
matters most, runs first in fresh processes anyway.

The orchestrator (this module, one plain process) then compares the final checkpoints
(consolidated weights and optimizer state, scheduler, data position, every rank's RNG
files, and the loss / learning-rate history of every step) bit for bit (or within
``--atol``), with the single-process proof's comparisons and verdict
(:mod:`.compare`, :mod:`.checks`). Whether a control was exercised (leaving the
component out restores other values than the resume did) is measured in the leg, on
every rank, right after the restore.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from ..checkpoint import step_dir_name
from ..config import Config, launch_mode, launched_as
from ..data import load_manifest
from ..durable import utc_now, write_json_atomic
from ..errors import ConfigError, PipelineError, ProofIncomplete
from ..run import counted_length, resolve_device
from .checks import control_verdict, first_divergent_step, judge, state_checks
from .compare import Bundle, Check
from .layout import CHECKPOINTS_DIR, LOG_FILE, REPORT_FILE, REPORT_SCHEMA, SPEC_FILE
from .plan import controls, leg_env, plan_cut
from .protocol import create_output, last_line, refuse_output

__all__ = ["verify_resume_distributed", "dist_controls", "DIST_LEG_MODULE", "dist_bundle"]

DIST_LEG_MODULE = "pipeline.proof.dist_leg"
RESULTS_FILE = "results.json"


def verify_resume_distributed(
    config: Config,
    *,
    output: Path,
    nproc: int,
    steps: int | None = None,
    cut: int | None = None,
    atol: float = 0.0,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Prove that a ``training.parallel`` run at world size ``nproc`` resumes exactly;
    return the report. Refusals and failures as :func:`pipeline.proof.verify_resume`."""
    output = Path(output)
    refuse_output(output, config)
    parallel = launch_mode(config.training.parallel, nproc)
    if parallel == "none":
        raise ConfigError(
            f"{config.source}: --nproc-per-node needs training.parallel auto, ddp or fsdp2 "
            "(--set training.parallel=auto)"
        )
    if nproc < 2:
        raise ConfigError(
            f"--nproc-per-node must be >= 2 to prove a distributed resume (got {nproc}); "
            "one process is the plain proof (leave --nproc-per-node out)"
        )
    config = launched_as(config, nproc)  # what the legs' checkpoints record, and so what the report proves
    if not (math.isfinite(atol) and atol >= 0):
        raise ConfigError(f"--atol must be a finite number >= 0 (got {atol})")
    if config.training.amp == "fp16":
        raise ConfigError(f"{config.source}: training.amp 'fp16' is not supported under torchrun")
    load_manifest(config)  # unprepared or altered data stops here, before any folder exists
    config = counted_length(config)  # a length in epochs, in steps: what the cut is planned in
    plan = plan_cut(config, steps, cut)
    n, k = plan.steps, plan.cut
    create_output(output)
    cut_folder = output.resolve() / "reference" / CHECKPOINTS_DIR / step_dir_name(k)

    def run(name: str, every: int, **extra: Any) -> dict[str, Any]:
        raw = config.to_dict()
        raw["checkpoint"] = {
            **raw["checkpoint"],
            "dir": str(output.resolve() / name / CHECKPOINTS_DIR),
            "every": every,
            "keep_last": n,
        }
        raw["outputs"] = {**raw["outputs"], "traces": str(output.resolve() / name / "traces")}
        return {
            "name": name,
            "config": raw,
            "stop_at": n,
            "resume": None,
            "omit": [],
            "swap_rng": False,
            **extra,
        }

    launches = {
        "reference": [run("reference", k)],
        "resume-and-controls": [run("resume", n, resume=str(cut_folder))]
        + [
            run(leg, n, resume=str(cut_folder), omit=list(omit), swap_rng=swap)
            for leg, _, omit, swap in dist_controls(config)
        ],
    }
    report: dict[str, Any] = {
        "schema": REPORT_SCHEMA,
        "created": utc_now(),
        "completed": False,
        "device": str(resolve_device(config)),
        "protocol": {
            "steps": n,
            "cut": k,
            "data": plan.data,
            "nproc_per_node": nproc,
            "parallel": parallel,
            "tolerance": {"atol": atol, "rtol": 0.0, "mode": "bitwise" if atol == 0 else "absolute"},
            "launches": {},
        },
        "boundary": {**plan.to_dict(), "checkpoint": f"reference/{CHECKPOINTS_DIR}/{step_dir_name(k)}"},
    }
    results: dict[str, dict[str, Any]] = {}
    for name, runs in launches.items():
        folder = output / name
        folder.mkdir()
        for spec_run in runs:
            (output / spec_run["name"]).mkdir(exist_ok=True)
        write_json_atomic(folder / SPEC_FILE, {"runs": runs, "results": str(folder.resolve() / RESULTS_FILE)})
        command = [
            sys.executable,
            "-B",
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            DIST_LEG_MODULE,
            str(folder.resolve() / SPEC_FILE),
        ]
        echo(f"running {', '.join(r['name'] for r in runs)} ({nproc} processes) ...")
        with open(folder / LOG_FILE, "xb") as log:
            code = subprocess.run(
                command,
                cwd=os.getcwd(),
                env=leg_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            ).returncode
        report["protocol"]["launches"][name] = {
            "command": command,
            "log": f"{name}/{LOG_FILE}",
            "exit_code": code,
        }
        if code != 0:
            _incomplete(
                output,
                report,
                f"launch {name} exited with code {code}: {last_line(folder / LOG_FILE)} "
                f"(log: {folder / LOG_FILE})",
            )
        results.update(
            {r["name"]: r for r in json.loads((folder / RESULTS_FILE).read_text(encoding="utf-8"))}
        )
    try:
        report.update(_evaluate(output, n, k, atol, results, dist_controls(config)))
    except (PipelineError, OSError, KeyError, ValueError) as exc:
        _incomplete(output, report, f"could not compare the launches' results: {exc}")
    report["completed"] = True
    write_json_atomic(output / REPORT_FILE, report, allow_nan=True)
    return report


def _incomplete(output: Path, report: dict[str, Any], message: str) -> None:
    report.update(
        {
            "completed": False,
            "error": message,
            "all_checks_passed": False,
            "positive": False,
            "negative_divergence_detected": False,
        }
    )
    write_json_atomic(output / REPORT_FILE, report, allow_nan=True)
    raise ProofIncomplete(f"the proof could not complete: {message}", report)


def dist_bundle(folder: Path) -> Bundle:
    """A distributed checkpoint as one comparable whole (see ``read_full_state``)."""
    from ..checkpoint import read_full_state  # torch.distributed only where it is used

    return Bundle(*read_full_state(folder))


def _steps(bundle: Bundle) -> dict[str, Any]:
    """The per-step records :func:`~.checks.first_divergent_step` reads, from the history."""
    return {
        "steps": [
            {"step": int(step), "loss": float(loss)}
            for step, loss in zip(bundle.history("step").tolist(), bundle.history("loss").tolist())
        ]
    }


def dist_controls(config: Config) -> tuple[tuple[str, str, tuple[str, ...], bool], ...]:
    """(leg, component, omitted, swap_rng): the saved components
    (:func:`~pipeline.proof.plan.controls`), then the per-rank RNG swap."""
    omitted = tuple((f"omit-{name}", name, (name,), False) for name in controls(config))
    return omitted + (("swap-rng", "rank_rng", (), True),)


def _evaluate(
    output: Path,
    n: int,
    k: int,
    atol: float,
    results: dict[str, dict[str, Any]],
    legs: tuple[tuple[str, str, tuple[str, ...], bool], ...],
) -> dict[str, Any]:
    def final(name: str) -> Bundle:
        return dist_bundle(output / name / CHECKPOINTS_DIR / step_dir_name(n))

    reference = final("reference")
    positive = state_checks("final", reference, final("resume"), atol)
    controls, control_checks = {}, {}
    for leg, component, _, swap in legs:
        candidate = final(leg)
        outcome = state_checks("final", reference, candidate, atol)
        exercise = Check(**results[leg]["exercise"])
        first = first_divergent_step(_steps(reference), _steps(candidate), k, atol)
        controls[component] = {**control_verdict(component, exercise, outcome, first, swap=swap), "leg": leg}
        control_checks[component] = {
            "exercise": exercise.to_dict(),
            "outcome": [c.to_dict() for c in outcome],
        }
    return {
        **judge(positive, controls),
        "checks": {"positive": [check.to_dict() for check in positive], "negative": control_checks},
    }
