"""The publishable record of a stage (its ``meta.json``), and what a stage is built from.

The record keeps no optimizer, RNG or sampler internals and no machine paths: the config with
its paths made relative or replaced by their role (:mod:`.redact`), the training's history and
launches, the metrics, the provenance and the checks; a staged proof is summed up by its
verdict (:func:`proof_verdict`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..audit import STAGE_SCHEMA
from ..checkpoint import CheckpointWeights, evaluations_from, history_lists, read_tensors
from ..config import Config
from ..errors import StageError, StateMismatch
from ..provenance import CodeChange
from ..start import Launch
from .proof_report import PROOF_FILE
from .redact import public_paths

__all__ = ["Sources", "proof_verdict", "public_config", "read_progress", "staged_meta"]


@dataclass(frozen=True, slots=True)
class Sources:
    """What a stage is built from, each piece verified by :func:`.build.build_stage`."""

    folder: Path
    """The checkpoint folder."""
    meta: dict[str, Any]
    """Its sealed meta.json."""
    meta_file_sha256: str
    """SHA-256 of the meta.json file."""
    config: Config
    """The user's config (its card section may change after training)."""
    model_config: Config
    """The checkpoint's own config (what built the weights)."""
    model: torch.nn.Module
    """The model it builds, without weights."""
    metrics: dict[str, Any] | None
    """The matching metrics.json record, if staged with metrics."""
    weights: CheckpointWeights
    """The verified weights, read one tensor at a time."""
    user_sections: str | None
    """The Markdown of the config's ``card.sections`` file, if any."""
    code_changes: list[CodeChange]
    """Counted files that changed since training (a stage that ships no code only)."""
    selected_as_best: dict[str, Any] | None = None
    """Staged as ``--checkpoint best``: the mark, checked against the checkpoint's own
    evaluations (metric, mode, and the value it recorded)."""


def read_progress(path: Path) -> tuple[dict[str, list], dict[str, list]]:
    """The run's history and its evaluations (``{}`` for a run that kept none) from the
    checkpoint's training state ``path``."""
    try:
        tensors = read_tensors(path)
        steps = tensors["history/step"].tolist()
        history = history_lists(tensors, len(steps))
    except (KeyError, ValueError) as exc:  # SchemaMismatch is a ValueError
        raise StageError(f"{path} has no readable training history (history/step, loss, lr): {exc}") from None
    last = int(history["step"][-1]) if history["step"] else 0
    try:
        evaluations = evaluations_from(tensors, last)
    except StateMismatch as exc:
        raise StageError(f"{path}: {exc}") from None
    return history, (evaluations if evaluations["step"] else {})


def public_config(meta: dict[str, Any], config: Config) -> dict[str, Any]:
    # The card section may be edited after training (it never changes what was computed).
    # Scripts run from the run's folder: paths inside it stay, relative; others become roles.
    return public_paths({**meta["config"], "card": config.to_dict()["card"]}, Path.cwd())


def staged_meta(
    src: Sources,
    history: dict[str, list],
    files: dict[str, Any],
    export: dict[str, Any],
    nonfinite: list[str],
    repo_id: str | None,
    traces: str | None,
) -> dict[str, Any]:
    """The publishable record: no optimizer, RNG or sampler internals, no machine paths, and
    nothing of the clock or the host, so two identical runs stage the same record (the
    checkpoint's ``created`` time stays beside the checkpoint). ``traces``: the staged
    TensorBoard event file, if any."""
    meta, record = src.meta, src.metrics
    return {
        "schema": STAGE_SCHEMA,
        "step": meta["step"],
        "config": public_config(meta, src.config),
        "model": meta["model"],
        "export": export,
        # The repo the card's snippet names; publishing elsewhere is refused unless forced.
        "repo_id": repo_id,
        "training": {
            "final_loss": history["loss"][-1] if history["loss"] else None,
            "final_lr": history["lr"][-1] if history["lr"] else None,
            "history_points": len(history["step"]),
            # Each --extend-to of the run: max_steps before and after, and the step it happened at.
            "lineage": meta["lineage"],
            # The launch that wrote this checkpoint, and every change accepted on the way: moves to
            # another launch (--reshard) and environment changes (--allow-environment-change).
            "launch": Launch.of_checkpoint(meta).to_dict(),
            "changes": meta["environment"]["changes"],
            "traces": traces,
            # A stop a callback asked for (early stopping): {step, by, reason}, or None.
            "stopped": (meta["training_state"].get("callbacks") or {}).get("stopped"),
        },
        "metrics": None
        if record is None
        else {
            "split": record["split"],
            "values": record["metrics"],
            "data_fingerprint": record["fingerprints"]["data"],
            "device": record["device"],
        },
        "provenance": {
            "fingerprints": meta["fingerprints"],
            "versions": meta["versions"],
            "device": meta["device"],
            # What else decides the numbers (thread counts, determinism switches, torch and NumPy):
            # the platform a re-run must match for the weights' digests to match (the card says so).
            "environment": {key: value for key, value in meta["environment"].items() if key != "changes"},
            # Files of the code that differ from those the weights were trained with (a model
            # that ships no code is staged anyway; its weights still had to fit today's model).
            "code_changes": [change.record() for change in src.code_changes],
        },
        # The checkpoint's files by SHA-256, as its sealed meta.json lists them: not the digest of
        # meta.json itself, which holds the wall-clock time it was written at.
        "source_checkpoint": {
            "folder": src.folder.name,
            "schema": meta["schema"],
            "files": {name: entry["sha256"] for name, entry in sorted(meta["files"].items())},
        },
        "checks": {"nonfinite_tensors": nonfinite},
        # Chosen as --checkpoint best: by which metric and mode, at the value this step recorded.
        "selected_as_best": None
        if src.selected_as_best is None
        else {key: src.selected_as_best[key] for key in ("metric", "mode", "value")},
        "files": files,
    }


def proof_verdict(report: dict[str, Any]) -> dict[str, Any]:
    """What the card says about a staged proof."""
    positive = report["checks"]["positive"]
    return {
        "file": PROOF_FILE,
        "all_checks_passed": report["all_checks_passed"],
        "positive": report["positive"],
        "negative_divergence_detected": report["negative_divergence_detected"],
        "checks": len(positive),
        "checks_passed": sum(bool(check.get("passed")) for check in positive),
        "tolerance": report["protocol"]["tolerance"],
        "steps": report["boundary"]["steps"],
        "cut": report["boundary"]["cut"],
        "controls": {name: control["result"] for name, control in report["components"]["negative"].items()},
    }
