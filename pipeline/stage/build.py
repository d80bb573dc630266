"""Build and audit the Hub stage: exactly the last verified checkpoint, ready to upload.

A stage (``hub_stage/`` by default) holds plain files only (docs/stage.md)::

    modelo.safetensors   the checkpoint's weights, byte for byte (or modelo-0000i-of-0000N
                         shards, or renamed for transformers: see weights and hf_export)
    model.safetensors.index.json   tensor -> file, so from_pretrained finds the weights
    config.json          how to rebuild the model (save_pretrained's for transformers models)
    code/...             a non-transformers model's own modules and code/hub_loader.py
    meta.json            the publishable record (schema pipeline.stage/1, see build_stage)
    training_curve.png   loss and learning rate against step
    runs/events.out.tfevents.pipeline   TensorBoard traces of the same history (with tensorboard)
    README.md            the model card
    MANIFEST.sha256      `sha256sum` format over every other file
    (generation_config.json, the factory module's hub_files, verification.json: when present)

:func:`build_stage` verifies the checkpoint and checks that its weights fit the model its
config builds (built without weights: any size), writes everything into a hidden sibling
folder, audits it, and only then swaps it into place, so a half-built or refused stage is
never visible and a refusal leaves the previous stage untouched. The weights pass through
one tensor at a time (:mod:`.weights`). :func:`audit_stage` re-checks an existing stage
against its manifest; the publish step calls it right before uploading.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..audit import AuditedFile, audit_stage, stage_lock
from ..checkpoint import (
    LoadMode,
    is_distributed,
    open_weights,
    pinned_checkpoint,
)
from ..commands import script_command
from ..config import Config
from ..durable import atomic_folder, fsync_dir, json_bytes, recover, scratch_folder
from ..errors import NonFiniteWeights, StageError
from ..evaluate import evaluation_config, read_metrics
from ..hashing import sha256_file
from ..layout import (
    CODE_DIR,
    CONFIG_FILE,
    CURVE_FILE,
    DIST_MODEL_DIR,
    GENERATION_CONFIG_FILE,
    INDEX_FILE,
    MANIFEST_FILE,
    META_FILE,
    MODEL_FILE,
    PUBLIC_KEY_FILE,
    README_FILE,
    STAGED_TRACES_DIR,
    STATE_FILE,
    TRACE_FILE,
)
from ..leaks import scan_secrets
from ..provenance import CodeChange, check_code_as_trained, code_changes, code_fingerprint
from ..repo_ids import hub_repo_id
from ..run import build_model
from ..signing import ExpectedSigner, StageSigner, card_section, sign_stage, verify_stage
from ..sources import shipped_sources
from ..traces import trace_bytes
from .card import build_model_card, read_user_sections, render_curve
from .card_parts import LOADER_MODULE
from .files import (
    build_privately,
    built_by_us,
    check_file_sizes,
    check_replaceable,
    manifest_bytes,
    modes_from_sources,
    write_file,
)
from .hf_export import hub_files, inspect_model
from .proof_report import PROOF_FILE, read_proof
from .record import Sources, proof_verdict, public_config, read_progress, staged_meta
from .weights import (
    DEFAULT_MAX_SHARD_SIZE,
    index_bytes,
    parse_size,
    plan_weights,
    write_weights,
)

__all__ = ["StageBuild", "StageResult", "build_stage"]

_HUB_LOADER = Path(__file__).with_name("hub_loader.py")


@dataclass(kw_only=True, slots=True)
class StageBuild:
    """One build of a stage: what to stage, where, and how (script 05's options)."""

    checkpoint: str | Path = "latest"
    """``"latest"`` (the newest committed checkpoint in ``checkpoint.dir``) or a ``step-…`` folder."""
    stage_dir: str | Path | None = None
    """The stage folder (``None``: the config's ``outputs.stage``); an existing one is replaced
    only if script 05 built it."""
    with_metrics: bool = True
    """Stage the evaluation of script 04 (which must name these weights); False stages
    without metrics, and the card says so."""
    metrics: str | Path | None = None
    """The metrics file to stage (``None``: the config's ``outputs.metrics``)."""
    allow_nonfinite: bool = False
    """Stage weights that hold NaN or ±inf (the card warns) instead of refusing them."""
    repo_id: str | None = None
    """The repository the card's snippets download from, ``namespace/name`` (or its page's
    address, ``https://huggingface.co/namespace/name``); ``None``: the card names none."""
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
    """Split the weights into files of at most this size (``"5GB"``, bytes); the Hub takes 50 GB at most."""
    proof: str | Path | None = None
    """A resume proof folder (script 03 ``--output``), staged if it proves this checkpoint."""
    signer: StageSigner | None = None
    """Sign the stage (:mod:`pipeline.signing`); ``None`` leaves it unsigned, as the card says."""


@dataclass(frozen=True, slots=True)
class StageResult:
    """What :func:`build_stage` did. ``files`` is :func:`audit_stage`'s answer for the new
    stage; ``report`` adds the source checkpoint's files, in table order."""

    stage: Path
    step: int | None
    """The checkpoint's step; a folder another tool wrote (``--from-folder``): its seal's, or None."""
    source: Path
    files: dict[str, AuditedFile]
    report: list[AuditedFile]
    nonfinite: list[str]
    with_metrics: bool
    code_changes: list[CodeChange] = field(default_factory=list)
    """Files of the model's code (or its factories) changed since training, staged anyway
    because the stage ships no code (a transformers model); recorded in its meta.json."""
    warnings: list[str] = field(default_factory=list)
    """What the user should know of a stage built anyway (05 prints each as a ``warning:``
    line): a folder another tool wrote that looks like a checkpoint but has no seal, a file
    staged from it with other hard links."""


# -- refusals -----------------------------------------------------------------------------


def _matching_metrics(
    path: Path, folder: Path, meta: dict[str, Any], sha: str, config: Config, model_config: Config
) -> dict[str, Any]:
    """metrics.json, if and only if it was computed from exactly these weights (``sha``: of the
    checkpoint's weights as one modelo.safetensors) and data, by the code this stage ships and
    stages with (``model_config``'s counted files, and this package)."""
    # The command that writes the record this stage reads, for this config, as printed.
    output = (
        () if os.path.abspath(path) == os.path.abspath(config.outputs.metrics) else ("--output", str(path))
    )
    evaluate = script_command(config, "04_evaluate.py", "--checkpoint", str(folder), *output)
    if not path.exists():
        raise StageError(
            f"{path} not found: run {evaluate} first, or stage without metrics with --no-metrics"
        )
    record = read_metrics(path, rerun=evaluate)
    if record["step"] != meta["step"] or record["modelo_sha256"] != sha:
        raise StageError(
            f"{path} evaluates step {record['step']} ({MODEL_FILE} {record['modelo_sha256'][:12]}), "
            f"not the checkpoint being staged, {folder.name} ({sha[:12]}): rerun {evaluate}, or pass "
            "--no-metrics"
        )
    if record["fingerprints"].get("data") != meta["fingerprints"].get("data"):
        raise StageError(
            f"{path} was computed on other data than {folder.name} was trained on: rerun {evaluate}"
        )
    evaluated = {"step": record["step"], "fingerprints": {"sources": record["fingerprints"]["sources"]}}
    for change in code_changes(evaluated, model_config)[:1]:
        raise StageError(
            f"{path} was computed under other code than this stage ships: {_since_04(change)}: rerun {evaluate}"
        )
    if record["fingerprints"]["code"] != code_fingerprint():
        raise StageError(
            f"{path} was computed by another version of this pipeline (code fingerprint "
            f"{record['fingerprints']['code'][:12]}, {code_fingerprint()[:12]} now): rerun {evaluate}"
        )
    return record


def _since_04(change: CodeChange) -> str:
    """``change`` between the code 04 evaluated with (``trained``) and the code now."""
    if change.trained is None:
        return f"{change.file} ({change.role}) was not part of the code 04 evaluated with"
    if change.current is None:
        return f"{change.file} was part of the code 04 evaluated with and no longer is (SHA-256 {change.trained})"
    return (
        f"{change.file} ({change.role}) differs from the file 04 evaluated with (SHA-256 {change.trained} "
        f"then, {change.current} now)"
    )


# -- building -----------------------------------------------------------------------------


def _write_code(built: Path, config: Config, meta: dict[str, Any]) -> dict[str, Any]:
    """What rebuilds a model that is not a transformers one: the module defining its factory
    and the modules it needs (:func:`pipeline.sources.shipped_sources`; :func:`build_stage` checked
    they are the files the checkpoint fingerprinted), and the loader the card's snippet calls."""
    sources = shipped_sources(config)
    sources[f"{LOADER_MODULE}.py"] = _HUB_LOADER
    files = {}
    for relative, source in sources.items():
        target = built / CODE_DIR / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        files[f"{CODE_DIR}/{relative}"] = write_file(target, source.read_bytes())
    for folder in sorted({p.parent for p in (built / CODE_DIR).rglob("*.py")}, reverse=True):
        fsync_dir(folder)
    return files


def _write_traces(
    built: Path, history: dict[str, list], evaluations: dict[str, list], log_every: int
) -> tuple[str, dict[str, Any]] | None:
    """The TensorBoard traces of the verified checkpoint's history, where the Hub's Training
    metrics tab finds them; drawn again here rather than copied from the training's own
    folder, so they hold exactly the staged step's history and the same bytes for the same
    history. ``None`` without the optional tensorboard: the card says so."""
    try:
        data = trace_bytes(history, evaluations, log_every)
    except ImportError:
        return None
    name = f"{STAGED_TRACES_DIR}/{TRACE_FILE}"
    (built / STAGED_TRACES_DIR).mkdir()
    entry = write_file(built / name, data)
    fsync_dir(built / STAGED_TRACES_DIR)
    return name, entry


def _weights_mode(folder: Path, meta: dict[str, Any]) -> int:
    """The permissions the checkpoint's stored weights grant (the least of its weights files')."""
    paths = (
        sorted(path for path in (folder / DIST_MODEL_DIR).iterdir() if path.is_file())
        if is_distributed(meta)
        else [folder / MODEL_FILE]
    )
    allowed = 0o777
    for path in paths:
        allowed &= stat.S_IMODE(os.lstat(path).st_mode)
    return allowed


def _build_into(built: Path, src: Sources, build: StageBuild) -> tuple[list[str], tuple[str, ...]]:
    """Write every stage file into ``built``; returns the non-finite tensor names and the
    staged weights files."""
    export = inspect_model(src.model, src.model_config, public_config(src.meta, src.config))
    plan = plan_weights(src.weights.specs, export.renames, parse_size(build.max_shard_size))
    files, nonfinite = write_weights(built, src.weights, plan)
    if nonfinite and not build.allow_nonfinite:
        more = f" (and {len(nonfinite) - 1} more)" if len(nonfinite) > 1 else ""
        raise NonFiniteWeights(
            f"{src.folder / MODEL_FILE}: tensor {nonfinite[0]}{more} holds NaN or infinite values; "
            "refusing to stage it (pass --allow-nonfinite to stage it anyway)"
        )
    if not export.is_transformers:  # from_pretrained needs no code from the repository
        files.update(_write_code(built, src.model_config, src.meta))
    files[INDEX_FILE] = write_file(built / INDEX_FILE, index_bytes(plan))
    files[CONFIG_FILE] = write_file(built / CONFIG_FILE, export.config_json)
    if export.generation_config_json is not None:
        files[GENERATION_CONFIG_FILE] = write_file(
            built / GENERATION_CONFIG_FILE, export.generation_config_json
        )
    reserved = {
        *files,
        *plan.files,
        CODE_DIR,
        INDEX_FILE,
        CONFIG_FILE,
        GENERATION_CONFIG_FILE,
        CURVE_FILE,
        STAGED_TRACES_DIR,
        META_FILE,
        README_FILE,
        MANIFEST_FILE,
    }
    for name, data in hub_files(src.model_config, reserved).items():
        files[name] = write_file(built / name, data)
    verdict = None
    if build.proof is not None:
        report = read_proof(Path(build.proof), src.meta, Path.cwd())
        files[PROOF_FILE] = write_file(built / PROOF_FILE, json_bytes(report))
        verdict = proof_verdict(report)
    history, evaluations = read_progress(src.folder / STATE_FILE)
    curve = render_curve(history)  # None without the optional matplotlib: the card says so
    if curve is not None:
        files[CURVE_FILE] = write_file(built / CURVE_FILE, curve)
    traces = _write_traces(built, history, evaluations, src.meta["config"]["training"]["log_every"])
    if traces is not None:
        files[traces[0]] = traces[1]
    described = {
        "transformers": export.is_transformers,
        "architecture": export.architecture,
        "weights": list(plan.files),
        "renamed": plan.renames,
        "total_size": plan.total_size,
    }
    staged = staged_meta(
        src, history, dict(files), described, nonfinite, build.repo_id, traces[0] if traces else None
    )
    staged["proof"] = verdict
    listed = {**files, META_FILE: write_file(built / META_FILE, json_bytes(staged))}
    signer = build.signer
    if signer is not None and signer.public_pem is not None:
        listed[PUBLIC_KEY_FILE] = write_file(built / PUBLIC_KEY_FILE, signer.public_pem)
    card = build_model_card(
        staged,
        listed,
        repo_id=build.repo_id,
        sample=src.metrics["sample"] if src.metrics else None,
        curve_file=CURVE_FILE if curve is not None else None,
        signature_section=card_section(signer, build.repo_id),
        user_sections=src.user_sections,
    )
    listed[README_FILE] = write_file(built / README_FILE, str(card).encode("utf-8"))
    write_file(built / MANIFEST_FILE, manifest_bytes(listed))
    check_file_sizes(built)
    fsync_dir(built)
    return nonfinite, plan.files


def _report(
    src: Sources, audited: dict[str, AuditedFile]
) -> tuple[list[AuditedFile], dict[str, AuditedFile]]:
    """Table rows (source files, then staged ones) and the staged files with their notes."""
    folder, meta = src.folder, src.meta
    source = [
        AuditedFile(
            f"{folder}/{META_FILE}",
            (folder / META_FILE).stat().st_size,
            src.meta_file_sha256,
            "schema, exact file list",
        ),
        *(
            AuditedFile(f"{folder}/{name}", entry["size"], entry["sha256"], "checkpoint meta.json")
            for name, entry in sorted(meta["files"].items())
        ),
    ]
    entry = src.weights.entry
    copied = entry is not None and MODEL_FILE in audited and audited[MODEL_FILE].sha256 == entry["sha256"]
    written = "checkpoint tensors, re-hashed from disk after writing, MANIFEST.sha256"
    notes = {
        **{name: written for name in audited if name.startswith(MODEL_FILE.removesuffix(".safetensors"))},
        MODEL_FILE: "checkpoint meta.json, re-hash after copy, MANIFEST.sha256" if copied else written,
        META_FILE: "MANIFEST.sha256, its own files table",
        MANIFEST_FILE: "lists every other staged file",
    }
    order = (MODEL_FILE, CURVE_FILE, META_FILE, README_FILE)  # the order they were written in
    names = sorted(audited, key=lambda name: (order.index(name) if name in order else len(order), name))
    staged = {
        name: replace(audited[name], verified_against=notes.get(name, audited[name].verified_against))
        for name in names
    }
    return source + list(staged.values()), staged


def build_stage(config: Config, build: StageBuild | None = None, /, **options: Any) -> StageResult:
    """Build a stage as ``build`` says (a :class:`StageBuild`, or its fields as keywords).

    Order: check ``build.repo_id`` (:func:`~pipeline.repo_ids.hub_repo_id`); verify every
    checkpoint file against its meta.json; build the model without weights and refuse code
    changed since training if the stage ships it (a transformers model's changes are
    recorded); require the metrics file to name this step and these weights; copy the
    weights into a scratch folder, hashing
    (:func:`.weights.open_weights`); check they fit the model the checkpoint's config
    builds; write them (NaN/inf refused unless ``allow_nonfinite``), code, curve,
    ``meta.json``, card and manifest into a hidden sibling folder; sign it with
    ``build.signer``; audit it, scan it for leaks (:mod:`pipeline.leaks`) and check the
    signature; swap it into place. Any refusal raises a
    :class:`~pipeline.errors.PipelineError` and leaves the previous stage as it was.

    The staged ``meta.json`` holds ``schema, step, config, model, export, repo_id, training,
    metrics, provenance, source_checkpoint, checks, files, proof`` (``files``: every staged
    file but README.md and the manifest, which embed or list meta.json's own hash, with
    ``sha256`` and ``size``).
    """
    if build is not None and options:
        raise TypeError("build_stage takes a StageBuild or its fields as keywords, not both")
    build = build if build is not None else StageBuild(**options)
    if build.repo_id is not None:  # the card's snippets download from it: 06's rule, and a namespace
        build = replace(build, repo_id=hub_repo_id(build.repo_id))
    stage_dir = config.outputs.stage if build.stage_dir is None else build.stage_dir
    metrics = (
        None
        if not build.with_metrics
        else Path(config.outputs.metrics if build.metrics is None else build.metrics)
    )
    # Absolute and normalized, so "." or "x/.." cannot make the folder's own name empty.
    stage = Path(os.path.abspath(stage_dir))
    parse_size(build.max_shard_size)  # a bad size or sections file is refused before any work
    user_sections = read_user_sections(config.card.sections, Path.cwd())
    # Pinned until copied: a trainer running beside us cannot prune it away.
    with (
        pinned_checkpoint(
            build.checkpoint, config.checkpoint.dir, mode=LoadMode.VERIFY, committed=True
        ) as loaded,
        stage_lock(stage),
        contextlib.ExitStack() as scratch,
    ):
        folder, meta = loaded.folder, loaded.meta
        model_config = evaluation_config(meta, config, source=str(folder / META_FILE))
        # Built without weights (parameters on meta: no memory, any size) by today's code.
        model = build_model(model_config, "meta")
        # This stage ships the model's code: the code these weights were trained with (the rule
        # a resume and 04 apply). A transformers repo ships none: its change is recorded.
        changes = check_code_as_trained(meta, model_config, model, use="stage")
        # A stale record is refused before the weights are copied; a distributed checkpoint's
        # weights have a hash as one file only once they are read.
        single = not is_distributed(meta)
        record = None
        if metrics is not None and single:
            record = _matching_metrics(
                metrics, folder, meta, meta["files"][MODEL_FILE]["sha256"], config, model_config
            )
        meta_file_sha256 = sha256_file(folder / META_FILE)
        recover(stage)
        check_replaceable(stage)
        work = scratch.enter_context(scratch_folder(stage.parent, "stage-weights"))
        weights = open_weights(folder, meta, work)
        scratch.callback(weights.close)
        if metrics is not None and not single:
            record = _matching_metrics(metrics, folder, meta, weights.sha256(), config, model_config)
        # The weights are published for this code: they must fit the model it builds.
        weights.check_fit(model)
        src = Sources(
            folder=folder,
            meta=meta,
            meta_file_sha256=meta_file_sha256,
            config=config,
            model_config=model_config,
            model=model,
            metrics=record,
            weights=weights,
            user_sections=user_sections,
            code_changes=changes,
            selected_as_best=loaded.best,
        )
        with atomic_folder(stage, owned=built_by_us) as built:
            mode = build_privately(built)
            nonfinite, weights_files = _build_into(built, src, build)
            signer = build.signer
            if signer is not None:
                sign_stage(built, signer)
            audited = audit_stage(built)
            scan_secrets(built, allow=config.card.allow_leaks)
            # A certificate signature needs the consumer's trusted root to verify; 06 checks it.
            if signer is not None and signer.key_path is not None and not signer.certificate:
                verify_stage(built, ExpectedSigner(sign_key=signer.key_path))
            allowed = _weights_mode(folder, meta)
            modes_from_sources(built, mode, {name: allowed for name in weights_files})
        report, staged = _report(src, audited)
    return StageResult(
        stage=Path(stage_dir),
        step=meta["step"],
        source=folder,
        files=staged,
        report=report,
        nonfinite=nonfinite,
        with_metrics=record is not None,
        code_changes=changes,
    )
