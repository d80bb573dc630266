"""Build and audit the Hub stage: exactly the last verified checkpoint, ready to upload.

A stage (``hub_stage/`` by default) holds plain files only::

    modelo.safetensors   the checkpoint's weights, byte for byte (or modelo-0000i-of-0000N
                         shards, or renamed for transformers: see hf_export)
    model.safetensors.index.json   tensor -> file, so from_pretrained finds the weights
    config.json          how to rebuild the model (save_pretrained's for transformers models)
    code/...             the model factory's module and the local modules it imports
    meta.json            the publishable record (schema pipeline.stage/1, see build_stage)
    training_curve.png   loss and learning rate against step
    README.md            the model card
    MANIFEST.sha256      `sha256sum` format over every other file
    (generation_config.json, the factory module's hub_files, verification.json: when present)

:func:`build_stage` verifies the checkpoint, writes everything into a hidden sibling
folder, audits it, and only then swaps it into place, so a half-built or refused stage is
never visible and a refusal leaves the previous stage untouched. :func:`audit_stage`
re-checks an existing stage against its manifest; the publish step calls it right before
uploading and reuses the hashes it returns.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import torch

from ..audit import STAGE_SCHEMA, AuditedFile, audit_stage, stage_lock, stage_marker_problem
from ..checkpoint import (
    LoadMode,
    check_derived_buffers,
    consolidated_metadata,
    pinned_checkpoint,
    read_tensors,
    write_safetensors,
)
from ..config import Config
from ..durable import atomic_folder, fsync_dir, json_bytes, recover
from ..errors import ChecksumMismatch, NonFiniteWeights, StageAuditError, StageError
from ..evaluate import evaluation_config, read_metrics
from ..hashing import CHUNK, HashingWriter, sha256_file
from ..layout import (
    CODE_DIR,
    CONFIG_FILE,
    CURVE_FILE,
    GENERATION_CONFIG_FILE,
    INDEX_FILE,
    MANIFEST_FILE,
    META_FILE,
    METRICS_FILE,
    MODEL_FILE,
    PUBLIC_KEY_FILE,
    README_FILE,
    STAGE_DIR,
    STATE_FILE,
)
from ..leaks import scan_secrets
from ..provenance import PACKAGE_ROOT, factories_fingerprint
from ..run import build_model
from ..signing import ExpectedSigner, StageSigner, card_section, sign_stage, verify_stage
from .card import build_model_card, render_curve
from .code_export import local_sources
from .hf_export import DEFAULT_MAX_SHARD_SIZE, hub_files, index_bytes, inspect_model, parse_size, plan_weights, write_weights
from .proof_report import PROOF_FILE, read_proof
from .redact import public_paths

__all__ = ["StageResult", "build_stage", "find_nonfinite"]

# The repository keeps an empty hub_stage/ in git through this file; it is not stage content.
_GITKEEP = ".gitkeep"


@dataclass(frozen=True, slots=True)
class StageResult:
    """What :func:`build_stage` did. ``files`` is :func:`audit_stage`'s answer for the new
    stage; ``report`` adds the source checkpoint's files, in table order."""

    stage: Path
    step: int
    source: Path
    files: dict[str, AuditedFile]
    report: list[AuditedFile]
    nonfinite: list[str]
    with_metrics: bool


# -- refusals -----------------------------------------------------------------------------

def find_nonfinite(path: str | Path) -> list[str]:
    """Names of floating-point tensors in a safetensors file that hold NaN or ±inf, sorted.
    Memory-mapped: one tensor in memory at a time."""
    bad = []
    tensors = read_tensors(path)
    for name in sorted(tensors):
        tensor = tensors[name]
        if not (tensor.is_floating_point() or tensor.is_complex()):
            continue
        if tensor.is_floating_point() and tensor.element_size() == 1:
            tensor = tensor.float()  # float8 kernels lack isfinite
        if not bool(torch.isfinite(tensor).all()):
            bad.append(name)
    return bad


# -- building -----------------------------------------------------------------------------

def _why_not_replaceable(stage: Path) -> str | None:
    """``None`` if ``stage`` may be replaced: an earlier stage carrying a valid marker
    (:func:`~pipeline.audit.stage_marker_problem`), or an empty folder / the repository's
    placeholder. A mistyped --stage must never delete someone's folder."""
    if stage.is_symlink() or (stage.exists() and not stage.is_dir()):
        return "it is not a folder"
    if not stage.is_dir() or not {entry.name for entry in stage.iterdir()} - {_GITKEEP}:
        return None
    return stage_marker_problem(stage)


def _built_by_us(stage: Path) -> bool:
    return _why_not_replaceable(stage) is None


def _check_replaceable(stage: Path) -> None:
    problem = _why_not_replaceable(stage) if os.path.lexists(stage) else None
    if problem is not None:
        raise StageError(f"{stage} exists and was not built by scripts/05_stage.py ({problem}); refusing to "
                         "replace it, nothing was touched: move it away or pass another --stage")


def _matching_metrics(path: Path, folder: Path, meta: dict[str, Any], sha: str) -> dict[str, Any]:
    """metrics.json, if and only if it was computed from exactly these weights (``sha``: of the
    staged modelo.safetensors) and data."""
    if not path.exists():
        raise StageError(f"{path} not found: run scripts/04_evaluate.py first, or stage without metrics "
                         "with --no-metrics")
    record = read_metrics(path)
    if record["step"] != meta["step"] or record["modelo_sha256"] != sha:
        raise StageError(f"{path} evaluates step {record['step']} ({MODEL_FILE} {record['modelo_sha256'][:12]}), "
                         f"not the checkpoint being staged, {folder.name} ({sha[:12]}): rerun "
                         f"scripts/04_evaluate.py --checkpoint {folder}, or pass --no-metrics")
    if record["fingerprints"].get("data") != meta["fingerprints"].get("data"):
        raise StageError(f"{path} was computed on other data than {folder.name} was trained on: "
                         "rerun scripts/04_evaluate.py")
    return record


def _copy_verified(source: Path, target: Path, entry: Mapping[str, Any]) -> dict[str, Any]:
    """Copy while hashing, compare with the checkpoint's record, then re-hash the copy
    from disk: both what was read and what landed must be the recorded bytes."""
    with open(source, "rb") as src, HashingWriter(target) as out:
        while chunk := src.read(CHUNK):
            out.write(chunk)
    if out.sha256 != entry["sha256"] or out.size != entry["size"]:
        raise ChecksumMismatch(f"{source} changed while it was copied (SHA-256 differs from its meta.json)")
    if sha256_file(target) != entry["sha256"]:
        raise StageAuditError(f"the copy of {source} reads back with another SHA-256: check the disk")
    return {"sha256": out.sha256, "size": out.size}


def _write_file(path: Path, data: bytes) -> dict[str, Any]:
    with HashingWriter(path) as out:
        out.write(data)
    return {"sha256": out.sha256, "size": out.size}


def _read_history(path: Path) -> dict[str, list]:
    try:
        tensors = read_tensors(path)
        return {key: tensors[f"history/{key}"].tolist() for key in ("step", "loss", "lr")}
    except (KeyError, ValueError) as exc:  # SchemaMismatch is a ValueError
        raise StageError(f"{path} has no readable training history (history/step, loss, lr): {exc}") from None


def _public_config(meta: dict[str, Any], config: Config) -> dict[str, Any]:
    # The card section may be edited after training (it never changes what was computed).
    # Scripts run from the run's folder: paths inside it stay, relative; others become roles.
    return public_paths({**meta["config"], "card": config.to_dict()["card"]}, Path.cwd())


def _staged_meta(meta: dict[str, Any], config: Config, folder: Path, meta_file_sha256: str,
                 history: dict[str, list], record: dict[str, Any] | None, nonfinite: list[str], files: dict[str, Any],
                 export: dict[str, Any], repo_id: str | None) -> dict[str, Any]:
    """The publishable record: no optimizer, RNG or sampler internals, no machine paths."""
    return {
        "schema": STAGE_SCHEMA,
        "step": meta["step"],
        "config": _public_config(meta, config),
        "model": meta["model"],
        "export": export,
        # The repo the card's snippet names; publishing elsewhere is refused unless forced.
        "repo_id": repo_id,
        "training": {
            "created": meta["created"],
            "final_loss": history["loss"][-1] if history["loss"] else None,
            "final_lr": history["lr"][-1] if history["lr"] else None,
            "history_points": len(history["step"]),
            # Each --extend-to of the run: max_steps before and after, and the step it happened at.
            "lineage": meta["lineage"],
        },
        "metrics": None if record is None else {
            "split": record["split"],
            "values": record["metrics"],
            "data_fingerprint": record["fingerprints"]["data"],
            "device": record["device"],
        },
        "provenance": {"fingerprints": meta["fingerprints"], "versions": meta["versions"], "device": meta["device"]},
        # The SHA-256 of the checkpoint's meta.json file (not its seal, meta.json's own meta_sha256).
        "source_checkpoint": {"folder": folder.name, "schema": meta["schema"], "meta_file_sha256": meta_file_sha256},
        "checks": {"nonfinite_tensors": nonfinite},
        "files": files,
    }


def _manifest_bytes(files: Mapping[str, Mapping[str, Any]]) -> bytes:
    return "".join(f"{files[name]['sha256']}  {name}\n" for name in sorted(files)).encode("utf-8")


def _write_weights(built: Path, weights: Path, entry: Mapping[str, Any], plan: Any) -> dict[str, Any]:
    """The checkpoint's weights as planned: a byte-for-byte copy when nothing is renamed or
    split, else rewritten tensor by tensor from the verified file and compared on read-back."""
    if plan.copies_source:
        return {MODEL_FILE: _copy_verified(weights, built / MODEL_FILE, entry)}
    if sha256_file(weights) != entry["sha256"]:
        raise ChecksumMismatch(f"{weights} changed after it was verified (SHA-256 differs from its meta.json)")
    return write_weights(built, weights, plan)


def _write_code(built: Path, config: Config, meta: dict[str, Any]) -> dict[str, Any]:
    """The model factory's module and the local modules it imports, under ``code/``, if
    they are still the files the checkpoint fingerprinted."""
    if factories_fingerprint(config) != meta["fingerprints"].get("factories"):
        raise StageError(f"the factory code ({config.model.factory}, ...) changed since step {meta['step']} was trained "
                         "(meta.json fingerprints.factories differs): the staged code would not be the code that "
                         "built these weights; restore it, or retrain")
    files = {}
    for relative, source in local_sources(config.model.factory, (Path.cwd(), PACKAGE_ROOT)).items():
        target = built / CODE_DIR / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        files[f"{CODE_DIR}/{relative}"] = _write_file(target, source.read_bytes())
    for folder in sorted({p.parent for p in (built / CODE_DIR).rglob("*.py")}, reverse=True):
        fsync_dir(folder)
    return files


def _proof_verdict(report: dict[str, Any]) -> dict[str, Any]:
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


def _build_into(built: Path, folder: Path, meta: dict[str, Any], meta_file_sha256: str, config: Config,
                record: dict[str, Any] | None, *, allow_nonfinite: bool, repo_id: str | None,
                max_shard_size: int, proof: Path | None, signer: StageSigner | None,
                weights: Path, weights_entry: Mapping[str, Any]) -> list[str]:
    """Write every stage file into ``built``; returns the non-finite tensor names.
    ``weights``: the verified modelo.safetensors (the checkpoint's, or consolidated from a
    distributed checkpoint's shards) and ``weights_entry`` its SHA-256 and size."""
    public_config = _public_config(meta, config)
    model_config = evaluation_config(meta, config, source=f"{folder / META_FILE}")
    export = inspect_model(model_config, public_config)
    plan = plan_weights(weights, export.renames, max_shard_size)
    files = _write_weights(built, weights, weights_entry, plan)
    nonfinite = sorted({plan.renames.get(name, name) for name in find_nonfinite(weights)})
    if nonfinite and not allow_nonfinite:
        more = f" (and {len(nonfinite) - 1} more)" if len(nonfinite) > 1 else ""
        raise NonFiniteWeights(f"{folder / MODEL_FILE}: tensor {nonfinite[0]}{more} holds NaN or infinite values; "
                               "refusing to stage it (pass --allow-nonfinite to stage it anyway)")
    files.update(_write_code(built, model_config, meta))
    files[INDEX_FILE] = _write_file(built / INDEX_FILE, index_bytes(plan))
    files[CONFIG_FILE] = _write_file(built / CONFIG_FILE, export.config_json)
    if export.generation_config_json is not None:
        files[GENERATION_CONFIG_FILE] = _write_file(built / GENERATION_CONFIG_FILE, export.generation_config_json)
    reserved = {*files, *plan.files, CODE_DIR, INDEX_FILE, CONFIG_FILE, GENERATION_CONFIG_FILE, CURVE_FILE,
                META_FILE, README_FILE, MANIFEST_FILE}
    for name, data in hub_files(model_config, reserved).items():
        files[name] = _write_file(built / name, data)
    verdict = None
    if proof is not None:
        report = read_proof(proof, meta, Path.cwd())
        files[PROOF_FILE] = _write_file(built / PROOF_FILE, json_bytes(report))
        verdict = _proof_verdict(report)
    history = _read_history(folder / STATE_FILE)
    curve = render_curve(history)  # None without the optional matplotlib: the card says so
    if curve is not None:
        files[CURVE_FILE] = _write_file(built / CURVE_FILE, curve)
    described = {"transformers": export.is_transformers, "architecture": export.architecture,
                 "weights": list(plan.files), "renamed": plan.renames, "total_size": plan.total_size}
    staged = _staged_meta(meta, config, folder, meta_file_sha256, history, record, nonfinite, dict(files),
                          described, repo_id)
    staged["proof"] = verdict
    listed = {**files, META_FILE: _write_file(built / META_FILE, json_bytes(staged))}
    if signer is not None and signer.public_pem is not None:
        listed[PUBLIC_KEY_FILE] = _write_file(built / PUBLIC_KEY_FILE, signer.public_pem)
    card = build_model_card(staged, listed, repo_id=repo_id, sample=record["sample"] if record else None,
                            curve_file=CURVE_FILE if curve is not None else None,
                            signature_section=card_section(signer, repo_id))
    listed[README_FILE] = _write_file(built / README_FILE, str(card).encode("utf-8"))
    _write_file(built / MANIFEST_FILE, _manifest_bytes(listed))
    fsync_dir(built)
    return nonfinite


def _report(folder: Path, meta: dict[str, Any], meta_file_sha256: str, audited: dict[str, AuditedFile],
            weights_entry: Mapping[str, Any]) -> tuple[list[AuditedFile], dict[str, AuditedFile]]:
    """Table rows (source files, then staged ones) and the staged files with their notes."""
    source = [
        AuditedFile(f"{folder}/{META_FILE}", (folder / META_FILE).stat().st_size, meta_file_sha256,
                    "schema, exact file list"),
        *(AuditedFile(f"{folder}/{name}", entry["size"], entry["sha256"], "checkpoint meta.json")
          for name, entry in sorted(meta["files"].items())),
    ]
    copied = MODEL_FILE in audited and audited[MODEL_FILE].sha256 == weights_entry["sha256"]
    written = "checkpoint tensors, compared bit for bit after writing, MANIFEST.sha256"
    notes = {
        **{name: written for name in audited if name.startswith(MODEL_FILE.removesuffix(".safetensors"))},
        MODEL_FILE: "checkpoint meta.json, re-hash after copy, MANIFEST.sha256" if copied else written,
        META_FILE: "MANIFEST.sha256, its own files table",
        MANIFEST_FILE: "lists every other staged file",
    }
    order = (MODEL_FILE, CURVE_FILE, META_FILE, README_FILE)  # the order they were written in
    names = sorted(audited, key=lambda name: (order.index(name) if name in order else len(order), name))
    staged = {name: replace(audited[name], verified_against=notes.get(name, audited[name].verified_against))
              for name in names}
    return source + list(staged.values()), staged


def build_stage(config: Config, *, checkpoint: str | Path = "latest", stage_dir: str | Path = STAGE_DIR,
                metrics: str | Path | None = METRICS_FILE, allow_nonfinite: bool = False,
                repo_id: str | None = None, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                proof: str | Path | None = None, signer: StageSigner | None = None) -> StageResult:
    """Build ``stage_dir`` from ``checkpoint`` (``"latest"`` committed in
    ``checkpoint.dir``, or a ``step-…`` folder).

    Order: verify every checkpoint file against its meta.json; require ``metrics`` (a
    metrics.json from script 04) to name this step and these weights (``None`` stages
    without metrics); copy and re-hash the weights; refuse NaN/inf tensors unless
    ``allow_nonfinite``; write curve, ``meta.json``, card and manifest into a hidden
    sibling folder; sign it with ``signer`` (:mod:`pipeline.signing`; the card says whether
    it is signed); audit it, scan it for leaks (:mod:`pipeline.leaks`) and check the
    signature; swap it into place. Any refusal
    raises a :class:`~pipeline.errors.PipelineError` and leaves the previous stage as it was.

    The staged ``meta.json`` holds ``schema, step, config, model, export, repo_id, training,
    metrics, provenance, source_checkpoint, checks, files, proof`` (``files``: every staged
    file but README.md and the manifest, which embed or list meta.json's own hash, with
    ``sha256`` and ``size``). ``max_shard_size`` splits the weights above that size;
    ``proof`` stages a resume proof folder's report if it proves this checkpoint.
    """
    # Absolute and normalized, so "." or "x/.." cannot make the folder's own name empty.
    stage = Path(os.path.abspath(stage_dir))
    shard_bytes = parse_size(max_shard_size)
    # Pinned until copied: a trainer running beside us cannot prune it away.
    with pinned_checkpoint(checkpoint, config.checkpoint.dir, mode=LoadMode.WEIGHTS, committed=True) as loaded, \
            stage_lock(stage), contextlib.ExitStack() as scratch:
        folder, meta = loaded.folder, loaded.meta
        # The weights are published for this code: a derived buffer it no longer builds is refused.
        model = build_model(evaluation_config(meta, config, source=str(folder / META_FILE)))
        check_derived_buffers(model, loaded.model_tensors, loaded.derived_buffers)
        del model
        single = MODEL_FILE in meta["files"]
        record = _matching_metrics(Path(metrics), folder, meta, meta["files"][MODEL_FILE]["sha256"]) \
            if metrics is not None and single else None
        meta_file_sha256 = sha256_file(folder / META_FILE)
        recover(stage)
        _check_replaceable(stage)
        if single:
            weights, weights_entry = folder / MODEL_FILE, meta["files"][MODEL_FILE]
        else:  # distributed: the shards, verified and consolidated by the load, written beside the stage
            weights = Path(scratch.enter_context(tempfile.TemporaryDirectory(dir=stage.parent))) / MODEL_FILE
            sha256, size = write_safetensors(weights, loaded.model_tensors, metadata=consolidated_metadata(meta["step"]))
            weights_entry = {"sha256": sha256, "size": size}
            if metrics is not None:
                record = _matching_metrics(Path(metrics), folder, meta, sha256)
        with atomic_folder(stage, owned=_built_by_us) as built:
            nonfinite = _build_into(built, folder, meta, meta_file_sha256, config, record,
                                    allow_nonfinite=allow_nonfinite, repo_id=repo_id, max_shard_size=shard_bytes,
                                    proof=None if proof is None else Path(proof), signer=signer,
                                    weights=weights, weights_entry=weights_entry)
            if signer is not None:
                sign_stage(built, signer)
            audited = audit_stage(built)
            scan_secrets(built)
            # A certificate signature needs the consumer's trusted root to verify; 06 checks it.
            if signer is not None and signer.key_path is not None and not signer.certificate:
                verify_stage(built, ExpectedSigner(sign_key=signer.key_path))
    report, staged = _report(folder, meta, meta_file_sha256, audited, weights_entry)
    return StageResult(stage=Path(stage_dir), step=meta["step"], source=folder, files=staged, report=report,
                       nonfinite=nonfinite, with_metrics=record is not None)
