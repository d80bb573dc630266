"""Where a result came from: code fingerprints and library versions.

What a checkpoint was computed with, file by file (:func:`counted_sources`): the model's
code closure (the files script 05 ships under ``code/``), and the files of ``data.factory``,
``optimizer.factory`` and ``scheduler.factory``. A resume, and the stage of a model that
ships its code, apply one rule (:func:`check_code_unchanged`): every counted file is the one
it was trained with, or the refusal names the first that is not and what to do. Script 04
(evaluate) and 05 (stage) apply it through :func:`check_code_as_trained`: a model that ships
its code is refused, one that ships none (a transformers model) is evaluated or staged with
the changes returned (:func:`code_changes`) for a warning and the record.
"""

from __future__ import annotations

import importlib.util
import platform
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .config import Config
from .errors import CodeChanged
from .hashing import fingerprint_files, fingerprint_table, sha256_file
from .sources import PACKAGE_ROOT, module_file, shipped_sources

if TYPE_CHECKING:
    import torch

__all__ = [
    "PACKAGE_ROOT",
    "code_fingerprint",
    "factory_sources",
    "factories_fingerprint",
    "sources_fingerprint",
    "library_versions",
    "counted_sources",
    "CodeChange",
    "code_changes",
    "code_changed_refusal",
    "check_code_unchanged",
    "check_code_as_trained",
    "is_transformers_model",
]

FACTORY_KEYS = ("data.prepare", "data.factory", "model.factory", "optimizer.factory", "scheduler.factory")


def code_fingerprint(extra_roots: tuple[Path, ...] = ()) -> str:
    """SHA-256 over the package's Python sources (and any extra source folders)."""
    files = sorted(PACKAGE_ROOT.rglob("*.py"))
    root = PACKAGE_ROOT.parent
    for extra in extra_roots:
        files += sorted(Path(extra).resolve().rglob("*.py"))
    return fingerprint_files(files, root=root)


def _version(name: str) -> str | None:
    # importlib.metadata reads installed metadata without importing the package, so
    # training never imports huggingface_hub (no code path to the network).
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def library_versions() -> dict[str, str | None]:
    import numpy
    import torch

    return {
        "python": platform.python_version(),
        "platform": sys.platform,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "safetensors": _version("safetensors"),
        "huggingface_hub": _version("huggingface_hub"),
        "pipeline": _version("exact-resume-pipeline"),
        "cuda": torch.version.cuda,
    }


def _factory_source(path: str) -> dict[str, Any]:
    module = path.partition(":")[0]
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    origin = spec.origin if spec is not None else None
    if origin is None or not Path(origin).is_file():
        return {"factory": path, "file": None, "sha256": None}
    return {"factory": path, "file": origin, "sha256": sha256_file(origin)}


def factory_sources(config: Config) -> dict[str, dict[str, Any]]:
    """The file defining each configured factory, hashed: a user's model code is part of
    what a checkpoint or a proof records, not only this package's."""
    out = {}
    for dotted in FACTORY_KEYS:
        section, _, key = dotted.partition(".")
        out[dotted] = _factory_source(getattr(getattr(config, section), key))
    return out


def factories_fingerprint(config: Config) -> str:
    """One SHA-256 over the configured factory paths and the files defining them."""
    return sources_fingerprint(factory_sources(config))


def sources_fingerprint(sources: dict[str, dict[str, Any]]) -> str:
    """:func:`factories_fingerprint` of a recorded :func:`factory_sources` table (a proof's)."""
    return fingerprint_table(
        {
            f"{key}={entry['factory']}": {"sha256": entry["sha256"] or "missing"}
            for key, entry in sources.items()
        }
    )


# The roles of the counted files, in the order a refusal names them.
_ROLES = {
    "model": "the model's code",
    "data.factory": "the data factory",
    "optimizer.factory": "the optimizer factory",
    "scheduler.factory": "the scheduler factory",
}


def _counted_files(config: Config) -> dict[str, tuple[str, Path]]:
    """``{name under its import path: (role, file)}``, the model's closure first."""
    # Imported here: it needs torch's side of the package (a run or a stage is being built).
    from .factories import importable_working_folder

    files = {
        relative: ("model", origin) for relative, origin in shipped_sources(config, strict=False).items()
    }
    with importable_working_folder():
        for key in ("data.factory", "optimizer.factory", "scheduler.factory"):
            section, _, field = key.partition(".")
            found = module_file(getattr(getattr(config, section), field).partition(":")[0])
            if found is not None:
                files.setdefault(found[0], (key, found[1]))
    return files


def counted_sources(config: Config) -> dict[str, str]:
    """``{file under its import path: SHA-256}`` of every file that counts (module docstring);
    recorded in each checkpoint's ``meta.json`` as ``fingerprints.sources``."""
    return {relative: sha256_file(origin) for relative, (_, origin) in sorted(_counted_files(config).items())}


@dataclass(frozen=True, slots=True)
class CodeChange:
    """A file that counts for a checkpoint and differs from the one it was trained with."""

    file: str | None
    """Under its import path (``examples/charlm/model.py``); None for a checkpoint that predates
    per-file fingerprints, whose one hash cannot tell which file changed."""
    role: str
    """What the file is to the run: the model's code, the data factory, ..."""
    trained: str | None
    """Its SHA-256 when the checkpoint was trained (None: it is new to the run since)."""
    current: str | None
    """Its SHA-256 now (None: it no longer counts)."""
    step: int

    def describe(self) -> str:
        """One phrase naming the file, its role and both full SHA-256s."""
        if self.file is None:
            return (
                f"a factory file ({self.role}) changed since step {self.step} was trained (this checkpoint "
                "predates per-file fingerprints, so which one cannot be told)"
            )
        if self.trained is None:
            return f"{self.file} is new in {self.role} since step {self.step} was trained (SHA-256 {self.current})"
        if self.current is None:
            return (
                f"{self.file} counted for step {self.step} ({self.role}) and is no longer part of it "
                f"(SHA-256 {self.trained} then)"
            )
        return (
            f"{self.file} ({self.role}) changed since step {self.step} was trained (SHA-256 {self.trained} "
            f"then, {self.current} now)"
        )

    def record(self) -> dict[str, Any]:
        """What a stage records of it (meta.json ``provenance.code_changes``)."""
        return {
            "file": self.file,
            "role": self.role,
            "trained_sha256": self.trained,
            "current_sha256": self.current,
        }


def code_changes(meta: dict[str, Any], config: Config) -> list[CodeChange]:
    """Every file that counts for the checkpoint of ``meta`` and differs from the one it was
    trained with, the model's code first. A checkpoint written before per-file fingerprints
    is held to its one hash over the factory files (``fingerprints.factories``)."""
    step = meta["step"]
    fingerprints = meta["fingerprints"]
    recorded = fingerprints.get("sources") if isinstance(fingerprints, dict) else None
    if not isinstance(recorded, dict):
        if fingerprints.get("factories") not in (None, factories_fingerprint(config)):
            return [CodeChange(file=None, role=", ".join(_ROLES), trained=None, current=None, step=step)]
        return []
    current = _counted_files(config)
    roles = list(_ROLES)

    def rank(relative: str) -> tuple[int, str]:
        return (roles.index(current[relative][0]) if relative in current else len(roles), relative)

    changes = []
    for relative in sorted(set(recorded) | set(current), key=rank):
        before = recorded.get(relative)
        now = sha256_file(current[relative][1]) if relative in current else None
        if before != now:
            role = _ROLES[current[relative][0]] if relative in current else "its model or factory code"
            changes.append(CodeChange(file=relative, role=role, trained=before, current=now, step=step))
    return changes


def code_changed_refusal(change: CodeChange, *, use: Literal["resume", "evaluate", "stage"]) -> CodeChanged:
    """The refusal of a resume, an evaluation or a stage over ``change``, with what to do."""
    # git keeps the bytes the checkpoint was trained with: this shows them, commit by commit.
    history = f" (git log -p -- {change.file} shows its earlier versions)" if change.file else ""
    if use == "resume":
        fix = (
            f"restore it{history} to resume exactly, or pass --allow-environment-change to continue the run "
            "with the new code (its next checkpoints record it)"
        )
    elif use == "evaluate":
        fix = (
            "the metrics would be computed with other code than the code that built these weights (and "
            f"that 05 ships): restore it{history}, or evaluate a checkpoint trained with this code"
        )
    else:
        fix = (
            "the stage would ship other code than the code that built these weights: restore it"
            f"{history}, or stage a checkpoint trained with this code"
        )
    return CodeChanged(f"{change.describe()}: {fix}")


def check_code_unchanged(meta: dict[str, Any], config: Config, *, use: Literal["resume", "stage"]) -> None:
    """Refuse (:class:`CodeChanged`) when a file that counts for the checkpoint of ``meta``
    differs from the one it was trained with (:func:`code_changes`), naming the first."""
    changes = code_changes(meta, config)
    if changes:
        raise code_changed_refusal(changes[0], use=use)


def is_transformers_model(model: torch.nn.Module) -> bool:
    """A transformers ``PreTrainedModel``: its repo loads with ``from_pretrained`` and ships no code."""
    module = sys.modules.get("transformers")
    return module is not None and isinstance(model, module.PreTrainedModel)


def check_code_as_trained(
    meta: dict[str, Any], config: Config, model: torch.nn.Module, *, use: Literal["evaluate", "stage"]
) -> list[CodeChange]:
    """The rule of 04 and 05 for the code that built ``model`` (from ``config``) against the
    code the checkpoint of ``meta`` was trained with: a model that ships its code is refused
    (:class:`CodeChanged`, naming the first changed file) if any counted file changed; a
    transformers model, which ships none, goes on, the changes returned for a warning and the
    record (its weights must still fit the model the code builds now)."""
    changes = code_changes(meta, config)
    if changes and not is_transformers_model(model):
        raise code_changed_refusal(changes[0], use=use)
    return changes
