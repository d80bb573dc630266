"""Run the resume proof end to end: plan, legs in their own processes, checks, report.

The orchestrator never trains; it writes each leg's spec, starts the legs with the same
interpreter, and compares what they left behind. Everything goes into one new folder.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from ..checkpoint import step_dir_name
from ..config import Config, launched_as
from ..data import DATASET, load_manifest
from ..durable import utc_now, write_json_atomic
from ..environment import current_environment
from ..errors import ConfigError, PipelineError, ProofIncomplete, describe_os_error
from ..hashing import sha256_bytes, sha256_file
from ..provenance import PACKAGE_ROOT, code_fingerprint, factory_sources, library_versions
from ..run import counted_length, resolve_device
from .checks import (
    after_cut_checks,
    boundary_checks,
    control_verdict,
    exercise_check,
    first_divergent_step,
    judge,
    prefix_checks,
    state_checks,
)
from .compare import Check, checkpoint_bundle, load_snapshot
from .layout import (
    CHECKPOINTS_DIR,
    LOG_FILE,
    REPORT_FILE,
    REPORT_SCHEMA,
    SNAPSHOT_DIR,
    SPEC_FILE,
    SUMMARY_FILE,
)
from .plan import Leg, Plan, leg_env, leg_spec, make_legs, pack, phases, plan_cut, process_command

__all__ = ["verify_resume", "summary_line", "describe"]


def verify_resume(
    config: Config,
    *,
    output: Path,
    steps: int | None = None,
    cut: int | None = None,
    atol: float = 0.0,
    config_path: Path | None = None,
    jobs: int | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Prove that resuming ``config`` at step K reproduces an uninterrupted run; return the report.

    Raises :class:`PipelineError` (exit 2) when the protocol cannot start, and
    :class:`ProofIncomplete` when it cannot complete; the report then says so
    (``completed: false``, ``error``).
    """
    output = Path(output)
    refuse_output(output, config)
    config = launched_as(config, None)  # what the legs' checkpoints record, and so what the report proves
    if not (math.isfinite(atol) and atol >= 0):
        raise ConfigError(f"--atol must be a finite number >= 0 (got {atol})")
    manifest = load_manifest(config)  # unprepared or altered data stops here, before any folder exists
    device = resolve_device(config)
    config = counted_length(config)  # a length in epochs, in steps: what the cut is planned in
    plan = plan_cut(config, steps, cut)
    legs = make_legs(plan, config)
    jobs = jobs or (1 if device.type == "cuda" else len(legs))
    create_output(output)
    # Which process runs which legs, decided once: the report records it, the phases follow it.
    schedule = [(phase, pack(phase, jobs)) for phase in phases(legs)]
    report = _header(config, config_path, manifest, device, plan, legs, schedule, output, atol, jobs)
    for leg in legs:
        leg.folder(output).mkdir()
        write_json_atomic(leg.folder(output) / SPEC_FILE, leg_spec(leg, plan, config, output))
    for phase, processes in schedule:
        _run_phase(phase, processes, output, report, echo)
    try:
        report.update(_evaluate(plan, legs, output, atol))
    except (PipelineError, OSError) as exc:
        _fail(output, report, f"could not compare the legs' results: {exc}")
    report["completed"] = True
    # allow_nan: a measured difference may be infinite (a NaN against a number).
    write_json_atomic(output / REPORT_FILE, report, allow_nan=True)
    return report


def refuse_output(output: Path, config: Config) -> None:
    """Both proofs (this one and :mod:`.distributed`) write only into a new folder outside
    ``checkpoint.dir``: refuse any other before anything is written."""
    if os.path.lexists(output):
        raise PipelineError(
            f"{output} already exists: the proof writes only into a new folder "
            "(nothing was touched); pass another --output"
        )
    checkpoints = Path(config.checkpoint.dir).resolve()
    target = output.resolve()
    if target == checkpoints or checkpoints in target.parents:
        raise PipelineError(
            f"--output {output} is inside checkpoint.dir ({config.checkpoint.dir}); the proof never "
            "writes there: choose a folder outside it"
        )


def create_output(output: Path) -> None:
    """Create the proof's folder; one created meanwhile by someone else is refused."""
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        output.mkdir()  # not exist_ok: a folder created meanwhile by someone else is not ours
    except FileExistsError:
        raise PipelineError(f"{output} already exists: pass another --output") from None


def _run_phase(
    legs: list[Leg],
    processes: list[list[Leg]],
    output: Path,
    report: dict[str, Any],
    echo: Callable[[str], None],
) -> None:
    echo(
        f"running {', '.join(leg.name for leg in legs)} ({_count(len(processes), 'process', 'processes')}) ..."
    )
    env = leg_env()
    with ThreadPoolExecutor(max_workers=len(processes)) as pool:
        process_codes = list(pool.map(lambda group: _run_process(group, output, env), processes))
    codes: dict[str, int | None] = {}
    for group, code in zip(processes, process_codes):
        codes.update(zip((leg.name for leg in group), _leg_codes(group, code, output)))
    for name, code in codes.items():
        report["protocol"]["legs"][name]["exit_code"] = code
    failed = [leg for leg in legs if codes[leg.name] not in (0, None)]
    if failed:
        leg = failed[0]
        log = leg.folder(output) / LOG_FILE
        _fail(
            output,
            report,
            f"leg {leg.name} exited with code {codes[leg.name]}: {last_line(log)} (log: {log})",
        )


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _run_process(legs: list[Leg], output: Path, env: dict[str, str]) -> int:
    """One process for ``legs``: its output goes to the first leg's log (the leg module moves
    it to each later leg's own log as that leg starts)."""
    with open(legs[0].folder(output) / LOG_FILE, "xb") as log:
        return subprocess.run(
            process_command(legs, output),
            cwd=os.getcwd(),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        ).returncode


def _leg_codes(legs: list[Leg], code: int, output: Path) -> list[int | None]:
    """Each leg's exit code from its process's: a leg that wrote its summary finished (0); the
    first that did not ended the process with ``code``; the ones after it never ran (None)."""
    codes: list[int | None] = []
    for leg in legs:
        if codes and codes[-1] != 0:
            codes.append(None)
        elif (leg.folder(output) / SUMMARY_FILE).is_file():
            codes.append(0)
        else:
            codes.append(code if code != 0 else 1)  # exit 0 without a summary is a failure too
    return codes


def last_line(path: Path) -> str:
    """The last non-empty line of a leg's or a launch's log: what the failure said."""
    lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


def _fail(output: Path, report: dict[str, Any], message: str) -> None:
    report.update(
        {
            "completed": False,
            "error": message,
            "all_checks_passed": False,
            "positive": False,
            "negative_divergence_detected": False,
        }
    )
    try:
        write_json_atomic(output / REPORT_FILE, report, allow_nan=True)
    except OSError as exc:  # a full disk that stopped a leg stops the report too: say both
        message += f"; the report could not be written either ({describe_os_error(exc)})"
    raise ProofIncomplete(f"the proof could not complete: {message}", report)


# -- evaluation ---------------------------------------------------------------------------


def _evaluate(plan: Plan, legs: list[Leg], output: Path, atol: float) -> dict[str, Any]:
    def summary(name: str) -> dict[str, Any]:
        return json.loads((output / name / SUMMARY_FILE).read_text(encoding="utf-8"))

    def final(name: str, step: int):
        return checkpoint_bundle(output / name / CHECKPOINTS_DIR / step_dir_name(step))

    n, k = plan.steps, plan.cut
    continuous, cut_point = final("continuous", n), final("cut", k)
    runs = {leg.name: summary(leg.name) for leg in legs}
    positive = (
        prefix_checks(continuous, cut_point, runs["continuous"], runs["cut"], k, atol)
        + boundary_checks(
            cut_point, load_snapshot(output / "resume" / SNAPSHOT_DIR), runs["cut"], runs["resume"], atol
        )
        + after_cut_checks(runs["continuous"], runs["resume"], k, atol)
        + state_checks("final", continuous, final("resume", n), atol)
    )
    fresh = load_snapshot(output / "cut" / SNAPSHOT_DIR)
    controls, control_checks = {}, {}
    for leg in legs:
        if not leg.omit:
            continue
        component = leg.omit[0]
        outcome = state_checks("final", continuous, final(leg.name, n), atol) + after_cut_checks(
            runs["continuous"], runs[leg.name], k, atol
        )
        exercise = exercise_check(component, fresh, cut_point)
        first = first_divergent_step(runs["continuous"], runs[leg.name], k, atol)
        controls[component] = control_verdict(component, exercise, outcome, first)
        # The restored state is expected to differ in the omitted part; recorded, not judged.
        boundary = boundary_checks(
            cut_point, load_snapshot(leg.folder(output) / SNAPSHOT_DIR), runs["cut"], runs[leg.name], atol
        )
        control_checks[component] = {
            "exercise": exercise.to_dict(),
            "outcome": [c.to_dict() for c in outcome],
            "boundary_informative": [c.to_dict() for c in boundary],
        }
    controls.setdefault("scaler", _NO_SCALER)
    return _verdict(plan, runs, positive, controls, control_checks)


# Without fp16 AMP there is no GradScaler, so no leg is run for it.
_NO_SCALER = {
    "component": "scaler",
    "leg": None,
    "result": "not exercised",
    "exercised": False,
    "omission_detected": False,
    "why_exercised": "training.amp is not fp16: the run has no GradScaler to restore",
    "diverged_checks": {},
    "first_divergent_loss_step": None,
}


def _verdict(
    plan: Plan,
    runs: dict[str, Any],
    positive: list[Check],
    controls: dict[str, Any],
    control_checks: dict[str, Any],
) -> dict[str, Any]:
    cut_summary = runs["cut"]
    return {
        **judge(positive, controls),
        "boundary": {
            **plan.to_dict(),
            "checkpoint": f"cut/{CHECKPOINTS_DIR}/{step_dir_name(plan.cut)}",
            "sampler_at_cut": cut_summary["end"]["sampler"],
        },
        "final_metrics": {name: run["end"]["metric"] for name, run in runs.items()},
        "checks": {"positive": [check.to_dict() for check in positive], "negative": control_checks},
    }


# -- provenance ---------------------------------------------------------------------------


def _header(
    config: Config,
    config_path: Path | None,
    manifest: dict[str, Any],
    device: torch.device,
    plan: Plan,
    legs: list[Leg],
    schedule: list[tuple[list[Leg], list[list[Leg]]]],
    output: Path,
    atol: float,
    jobs: int,
) -> dict[str, Any]:
    versions = library_versions()
    # Legs sharing a process share its command (the specs it runs, in order).
    commands = {
        leg.name: process_command(group, output)
        for _, processes in schedule
        for group in processes
        for leg in group
    }
    return {
        "schema": REPORT_SCHEMA,
        "created": utc_now(),
        "completed": False,
        "device": str(device),
        "environment": {
            "device": str(device),
            "python": versions["python"],
            "torch": versions["torch"],
            "numpy": versions["numpy"],
            "versions": versions,
            "platform": platform.platform(),
            "executable": sys.executable,
            "cpu_count": os.cpu_count(),
            # What each leg pins and records in its checkpoints (pipeline.environment).
            "reproduced": {
                **current_environment(device),
                "intra_op_threads": config.training.threads,
                "deterministic_algorithms": config.training.deterministic,
            },
        },
        "sources": _sources(config, config_path, manifest),
        "protocol": {
            "steps": plan.steps,
            "cut": plan.cut,
            "data": plan.data,
            "precision": {
                "dtype": config.training.dtype,
                "amp": config.training.amp,
                "deterministic": config.training.deterministic,
                "device": config.training.device,
            },
            "tolerance": {
                "atol": atol,
                "rtol": 0.0,
                "mode": "bitwise"
                if atol == 0
                else "absolute (floating values only; integers, RNG states and indices stay exact)",
            },
            "cwd": os.getcwd(),
            "env": {"PYTHONPATH": leg_env()["PYTHONPATH"]},
            "parallel_legs": jobs,
            "legs": {
                leg.name: {
                    "command": commands[leg.name],
                    "spec": f"{leg.name}/{SPEC_FILE}",
                    "log": f"{leg.name}/{LOG_FILE}",
                    "summary": f"{leg.name}/{SUMMARY_FILE}",
                    "resume_from": f"cut/{CHECKPOINTS_DIR}/{step_dir_name(plan.cut)}" if leg.resume else None,
                    "stop_at": leg.stop_at,
                    "omit": list(leg.omit),
                    "exit_code": None,
                }
                for leg in legs
            },
        },
    }


def _sources(config: Config, config_path: Path | None, manifest: dict[str, Any]) -> dict[str, Any]:
    root = PACKAGE_ROOT.parent
    package = {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(PACKAGE_ROOT.rglob("*.py"))}
    scripts_dir = root / "scripts"
    scripts = (
        {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(scripts_dir.glob("*.py"))}
        if scripts_dir.is_dir()
        else {}
    )
    resolved = json.dumps(config.to_dict(), sort_keys=True).encode()
    return {
        "package": {"fingerprint": code_fingerprint(), "files": package},
        "scripts": scripts,
        "config": {
            "path": str(config_path) if config_path is not None else None,
            "sha256": sha256_file(config_path)
            if config_path is not None and Path(config_path).is_file()
            else None,
            "resolved_sha256": sha256_bytes(resolved),
            "resolved": config.to_dict(),
        },
        "data": {"dir": config.data.dir, "fingerprint": manifest["fingerprint"], "files": manifest["files"]},
        "factories": factory_sources(config),
    }


# -- output -------------------------------------------------------------------------------


def summary_line(report: dict[str, Any], output: Path) -> dict[str, Any]:
    """The one-line JSON printed last."""
    line = {
        "device": report["device"],
        "all_checks_passed": report["all_checks_passed"],
        "positive": report["positive"],
        "negative_divergence_detected": report["negative_divergence_detected"],
        "failed_components": report.get("failed_components", []),
        "report": str(Path(output) / REPORT_FILE),
    }
    if not report["completed"]:
        line["error"] = report["error"]
    return line


def describe(report: dict[str, Any]) -> list[str]:
    """A short human reading of the report."""
    boundary, tolerance = report["boundary"], report["protocol"]["tolerance"]
    lines = [
        f"resume proof: {boundary['steps']} steps, tolerance "
        f"{'0 (bitwise)' if tolerance['atol'] == 0 else tolerance['atol']}; cut at step {boundary['cut']}, "
        f"{boundary['reason']}"
    ]
    data = report["protocol"].get("data")
    if data:
        workers = f", {data['num_workers']} DataLoader workers" if data["mode"] == DATASET else ""
        lines.append(f"inputs: {data['mode']} ({data['source']}{workers})")
    positive = report["checks"]["positive"]
    worst = [c["max_abs_diff"] for c in positive if c["max_abs_diff"] is not None]
    lines.append(
        f"positive: {sum(c['passed'] for c in positive)}/{len(positive)} checks match, "
        f"largest |difference| {max(worst, default=0.0):.3g}"
    )
    for check in positive:
        if not check["passed"]:
            size = (
                "values not comparable (their structure differs)"
                if check["max_abs_diff"] is None
                else f"max |diff| {check['max_abs_diff']:.3g}"
            )
            first = f", first at {check['first_difference']}" if check["first_difference"] else ""
            lines.append(f"  DIFFERS {check['name']}: {size}{first} {check['note']}".rstrip())
    lines.append("negative controls (resume without one component):")
    for name, control in report["components"]["negative"].items():
        diverged = control["diverged_checks"]
        detail = control["why_exercised"]
        if diverged:
            step = control["first_divergent_loss_step"]
            loss = (
                f"the loss first differs at step {step}"
                if step is not None
                else "the loss stays equal to the last step"
            )
            detail = f"diverged in {_count(len(diverged), 'check', 'checks')}; {loss}"
        lines.append(f"  {name:<10} {control['result']:<14} {detail}")
    diverged = [name for name, state in report["components"]["positive"].items() if state == "diverged"]
    if diverged:
        first = next(c for c in positive if not c["passed"])
        lines.append(
            f"FAILED: the resume is not exact; first difference in {first['component']} ({first['name']}), "
            f"diverged overall: {', '.join(report['failed_components'][: len(diverged)])}"
        )
    undetected = [
        name for name, c in report["components"]["negative"].items() if c["result"] == "not detected"
    ]
    if undetected:
        lines.append(
            f"FAILED: leaving out {', '.join(undetected)} changed nothing observable although the run "
            "exercises it"
        )
    if any(c["result"] == "not swapped" for c in report["components"]["negative"].values()):
        lines.append("FAILED: the swap of the ranks' RNG streams left a rank its own, so it proves nothing")
    return lines
