"""Script 05 ``--from-folder``: stage a model folder that another tool wrote.

Accepted: a ``save_pretrained`` folder (transformers, or huggingface_hub's
``PyTorchModelHubMixin``), a Trainer ``checkpoint-N``, or safetensors weights beside a
``config.json`` (docs/other-trainers.md). :mod:`.folder_source` reads it strictly (pickles
never opened, a seal verified, every file hashed as read). Then it is what 05 does for a
checkpoint, with the same pieces: the weights written into the stage one tensor at a time and
scanned for NaN/inf by the checkpoint stage's own writer (:mod:`.weights`), under the names
``save_pretrained`` uses (``model.safetensors``, ``model-0000i-of-0000N.safetensors``) so that
``PyTorchModelHubMixin.from_pretrained`` finds them too; ``config.json``, tokenizer and
generation files byte for byte; the record, the card (:mod:`.folder_card`: what is known, no
metrics unless supplied), the manifest, audit, leak scan, signing, and the atomic swap that
leaves the previous stage untouched on any refusal. Nothing is ever written into the folder.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..audit import STAGE_SCHEMA, AuditedFile, audit_stage, stage_lock
from ..config import Config, apply_overrides, config_from_dict
from ..durable import atomic_folder, fsync_dir, json_bytes, recover, scratch_folder
from ..errors import NonFiniteWeights, StageError, shown
from ..layout import (
    HUB_MODEL_FILE,
    INDEX_FILE,
    MANIFEST_FILE,
    META_FILE,
    PUBLIC_KEY_FILE,
    README_FILE,
    hub_shard_name,
)
from ..leaks import scan_secrets
from ..repo_ids import hub_repo_id
from ..safe_read import read_regular
from ..signing import ExpectedSigner, StageSigner, card_section, sign_stage, verify_stage
from .build import StageResult
from .card import read_user_sections
from .files import (
    build_privately,
    built_by_us,
    check_file_sizes,
    check_replaceable,
    manifest_bytes,
    modes_from_sources,
    write_file,
)
from .folder_card import build_folder_card
from .folder_source import FolderSource, json_object, read_folder, survey_folder
from .redact import public_paths
from .weights import DEFAULT_MAX_SHARD_SIZE, WeightsPlan, index_bytes, parse_size, plan_weights, write_weights

__all__ = ["FolderStage", "folder_config", "stage_folder"]

_MAX_METRICS = 1024 * 1024
_NOT_IN_A_NAME = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(kw_only=True, slots=True)
class FolderStage:
    """One stage of a folder another tool wrote (script 05 ``--from-folder``'s options)."""

    folder: str | Path
    """The folder: a ``save_pretrained`` folder, a Trainer ``checkpoint-N``, or safetensors
    weights beside a ``config.json``."""
    stage_dir: str | Path | None = None
    """The stage folder (``None``: the config's ``outputs.stage``); an existing one is replaced
    only if script 05 built it."""
    metrics: str | Path | None = None
    """A JSON object of metric name to number (what ``Trainer.evaluate()`` returns), shown on
    the card as supplied by the publisher; ``None``: the card states none."""
    allow_nonfinite: bool = False
    """Stage weights that hold NaN or ±inf (the card warns) instead of refusing them."""
    repo_id: str | None = None
    """The repository the card's snippets download from; ``None``: the card names none."""
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
    """Split the weights into files of at most this size (``"5GB"``, bytes)."""
    signer: StageSigner | None = None
    """Sign the stage (:mod:`pipeline.signing`); ``None`` leaves it unsigned, as the card says."""


def _supplied_metrics(path: Path) -> dict[str, float]:
    try:
        values = json_object(read_regular(path, _MAX_METRICS), path)
    except FileNotFoundError:
        raise StageError(f"--metrics {shown(path)} not found") from None
    except ValueError as exc:  # a FIFO, a device, too large: refused before it is read
        raise StageError(f"--metrics {shown(path)} {exc}") from None
    for name, value in values.items():
        if not (name and name.isprintable() and len(name) <= 100) or type(value) not in (int, float):
            raise StageError(
                f"--metrics {shown(path)}: '{shown(name)}' must be a short metric name with a number, as "
                "Trainer.evaluate() returns them"
            )
    return dict(sorted(values.items()))


def model_name(folder: str) -> str:
    """The model's name in the card's title and front matter (the Hub shows it in its widgets)
    when no --repo-id names it: the folder's name as a repository's name is written, every run
    of other characters a hyphen. The folder's name as it is may hold anything (a line break, a
    bidi override, HTML); the card shows it only as inert text, in its Source section."""
    return _NOT_IN_A_NAME.sub("-", folder).strip("-.") or "model"


def _hub_names(plan: WeightsPlan) -> WeightsPlan:
    """The plan with save_pretrained's file names (what PyTorchModelHubMixin looks for)."""
    count = len(plan.files)
    names = {
        old: HUB_MODEL_FILE if count == 1 else hub_shard_name(i + 1, count)
        for i, old in enumerate(plan.files)
    }
    return replace(
        plan,
        files=tuple(names[file] for file in plan.files),
        weight_map={tensor: names[file] for tensor, file in plan.weight_map.items()},
    )


# -- building ----------------------------------------------------------------------------------


def _staged_meta(
    read: FolderSource,
    config: Config,
    build: FolderStage,
    plan: WeightsPlan,
    files: dict[str, Any],
    nonfinite: list[str],
) -> dict[str, Any]:
    inventory = read.inventory
    name = build.repo_id.rpartition("/")[2] if build.repo_id else model_name(inventory.folder.name)
    metrics = None
    if build.metrics is not None:
        metrics = {
            "split": None,
            "values": _supplied_metrics(Path(build.metrics)),
            "supplied": Path(build.metrics).name,
        }
    return {
        "schema": STAGE_SCHEMA,
        # Known only from a seal: the Trainer step its callback recorded.
        "step": read.seal["step"] if read.seal is not None else None,
        "config": {"card": public_paths(config.to_dict()["card"], Path.cwd()), "model": {"name": name}},
        "model": {"num_parameters": sum(spec.numel() for spec in read.weights.specs.values())},
        "export": {
            "transformers": read.transformers,
            "architecture": read.architecture,
            "weights": list(plan.files),
            "renamed": {},
            "total_size": plan.total_size,
        },
        "repo_id": build.repo_id,
        "metrics": metrics,
        "source_checkpoint": {
            "folder": inventory.folder.name,
            "kind": "folder",
            "sealed": read.seal is not None,
            "files": dict(sorted(read.sources.items())),
            "left_out": list(read.left_out),
        },
        "checks": {"nonfinite_tensors": nonfinite},
        "files": files,
        "proof": None,
    }


def _build_into(
    built: Path, read: FolderSource, config: Config, build: FolderStage, user_sections: str | None
) -> tuple[list[str], dict[str, int]]:
    plan = _hub_names(plan_weights(read.weights.specs, {}, parse_size(build.max_shard_size)))
    files, nonfinite = write_weights(built, read.weights, plan)
    if nonfinite and not build.allow_nonfinite:
        more = f" (and {len(nonfinite) - 1} more)" if len(nonfinite) > 1 else ""
        raise NonFiniteWeights(
            f"{read.weights.origin}: tensor {nonfinite[0]}{more} holds NaN or infinite values; refusing to "
            "stage it (pass --allow-nonfinite to stage it anyway)"
        )
    files[INDEX_FILE] = write_file(built / INDEX_FILE, index_bytes(plan))
    for name, data in read.small.items():
        files[name] = write_file(built / name, data)
    staged = _staged_meta(read, config, build, plan, dict(files), nonfinite)
    listed = {**files, META_FILE: write_file(built / META_FILE, json_bytes(staged))}
    signer = build.signer
    if signer is not None and signer.public_pem is not None:
        listed[PUBLIC_KEY_FILE] = write_file(built / PUBLIC_KEY_FILE, signer.public_pem)
    card = build_folder_card(
        staged,
        listed,
        repo_id=build.repo_id,
        signature_section=card_section(signer, build.repo_id),
        user_sections=user_sections,
    )
    listed[README_FILE] = write_file(built / README_FILE, str(card).encode("utf-8"))
    write_file(built / MANIFEST_FILE, manifest_bytes(listed))
    check_file_sizes(built)
    fsync_dir(built)
    return nonfinite, _source_modes(read, plan)


def _source_modes(read: FolderSource, plan: WeightsPlan) -> dict[str, int]:
    """Staged name -> the permissions of what it was made from: the weights files, all of
    their sources' (the least of them); each carried file, its own."""
    weights = 0o777
    for name in read.sources:
        if name.endswith(".safetensors"):
            weights &= read.modes[name]
    return {**{file: weights for file in plan.files}, **{name: read.modes[name] for name in read.small}}


def _report(read: FolderSource, audited: dict[str, AuditedFile]) -> list[AuditedFile]:
    """Table rows: the files read from the folder, then the staged ones."""
    folder = read.inventory.folder
    how = "its seal, re-hashed while copied" if read.seal is not None else "hashed while copied (no seal)"
    source = [
        AuditedFile(shown(f"{folder}/{name}"), entry["size"], entry["sha256"], how)
        for name, entry in sorted(read.sources.items())
    ]
    notes = {
        META_FILE: "MANIFEST.sha256, its own files table",
        MANIFEST_FILE: "lists every other staged file",
    }
    return source + [
        replace(row, verified_against=notes.get(name, row.verified_against)) for name, row in audited.items()
    ]


def _check_apart(folder: Path, stage: Path) -> None:
    source, target = Path(os.path.realpath(folder)), Path(os.path.realpath(stage))
    if source == target or source.is_relative_to(target) or target.is_relative_to(source):
        raise StageError(
            f"the stage {shown(stage)} and the folder {shown(folder)} overlap: pass a --stage outside it; "
            "nothing was staged"
        )


def folder_config(overrides: dict[str, Any]) -> Config:
    """The config of a folder staged without ``--config``: the defaults and ``--set`` items
    (a folder another tool wrote comes with no config of ours; only ``card`` and
    ``outputs.stage`` matter to it)."""
    return config_from_dict(apply_overrides({}, overrides), source="<defaults>")


def stage_folder(config: Config, build: FolderStage) -> StageResult:
    """Stage ``build.folder`` as :class:`FolderStage` says. Only ``config.card`` and
    ``config.outputs.stage`` are used (the folder's model was not built from the config).
    Any refusal raises a :class:`~pipeline.errors.PipelineError` and leaves the previous
    stage as it was; nothing is ever written into the folder."""
    if build.repo_id is not None:  # the card's snippets download from it: 06's rule, and a namespace
        build = replace(build, repo_id=hub_repo_id(build.repo_id))
    folder = Path(os.path.realpath(build.folder))
    stage_dir = config.outputs.stage if build.stage_dir is None else build.stage_dir
    stage = Path(os.path.abspath(stage_dir))
    parse_size(build.max_shard_size)
    if build.metrics is not None:
        _supplied_metrics(Path(build.metrics))  # refused before any work
    user_sections = read_user_sections(config.card.sections, Path.cwd())
    inventory = survey_folder(folder)
    _check_apart(folder, stage)
    with stage_lock(stage), contextlib.ExitStack() as scratch:
        recover(stage)
        check_replaceable(stage)
        read = read_folder(inventory, scratch.enter_context(scratch_folder(stage.parent, "stage-weights")))
        scratch.callback(read.weights.close)
        with atomic_folder(stage, owned=built_by_us) as built:
            mode = build_privately(built)
            nonfinite, sources = _build_into(built, read, config, build, user_sections)
            signer = build.signer
            if signer is not None:
                sign_stage(built, signer)
            audited = audit_stage(built)
            scan_secrets(built, allow=config.card.allow_leaks)
            if signer is not None and signer.key_path is not None and not signer.certificate:
                verify_stage(built, ExpectedSigner(sign_key=signer.key_path))
            modes_from_sources(built, mode, sources)
    return StageResult(
        stage=Path(stage_dir),
        step=read.seal["step"] if read.seal is not None else None,
        source=folder,
        files=audited,
        report=_report(read, audited),
        nonfinite=nonfinite,
        with_metrics=build.metrics is not None,
        warnings=list(read.warnings),
    )
