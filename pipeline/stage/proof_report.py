"""A resume proof (script 03's ``verification.json``) travels with the model it proves.

:func:`read_proof` accepts a proof only if it proves *this* checkpoint: the same package
code, factory files and data fingerprints, and the same config in every key that changes
what is computed. The staged copy has every machine path made relative to the run's folder
or replaced by its role (:mod:`pipeline.stage.redact`); every SHA-256 of its sources is kept.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..commands import step_command
from ..config import RESUME_IRRELEVANT_KEYS, config_from_dict
from ..errors import ConfigError, FileChanged, ProofMismatch
from ..proof import REPORT_SCHEMA
from ..proof.layout import REPORT_FILE
from ..provenance import sources_fingerprint
from ..safe_read import read_regular
from .redact import public_paths

__all__ = ["PROOF_FILE", "read_proof"]

PROOF_FILE = REPORT_FILE  # staged under the same name: verification.json
_MAX_BYTES = 64 * 1024 * 1024


def _computed(flat: dict[str, Any]) -> dict[str, Any]:
    return {
        key: value
        for key, value in flat.items()
        if key not in RESUME_IRRELEVANT_KEYS and key.split(".")[0] not in RESUME_IRRELEVANT_KEYS
    }


def _load(folder: Path) -> dict[str, Any]:
    path = folder / REPORT_FILE
    # Opened once and read from what was opened: a FIFO in its place would hang 05.
    try:
        raw = read_regular(path, _MAX_BYTES)
    except OSError as exc:
        raise ProofMismatch(f"cannot read the proof {path}: {exc.strerror or exc}") from None
    except FileChanged as changed:
        raise ProofMismatch(f"{path} {changed.reason}: not a proof report") from None
    except ValueError as refusal:
        raise ProofMismatch(f"{path} {refusal}: not a proof report") from None
    try:
        report = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ProofMismatch(f"{path} is not valid JSON") from None
    if not isinstance(report, dict) or report.get("schema") != REPORT_SCHEMA or not report.get("completed"):
        raise ProofMismatch(
            f"{path} is not a completed {REPORT_SCHEMA} report (did "
            f"{step_command('03_verify_resume.py')} finish?)"
        )
    return report


def read_proof(folder: str | Path, meta: dict[str, Any], root: str | Path) -> dict[str, Any]:
    """The proof in ``folder`` (script 03's ``--output``), checked against the checkpoint's
    ``meta`` and scrubbed of machine paths (relative to ``root``). Refuses with one line."""
    folder = Path(folder)
    report = _load(folder)
    where = folder / REPORT_FILE
    try:
        sources = report["sources"]
        fingerprints = meta["fingerprints"]
        proven = {
            "code": sources["package"]["fingerprint"],
            "data": sources["data"]["fingerprint"],
            "factories": sources_fingerprint(sources["factories"]),
        }
        proof_config = config_from_dict(sources["config"]["resolved"], source=str(where))
        saved_config = config_from_dict(meta["config"], source="the checkpoint's meta.json")
    except (KeyError, TypeError, AttributeError):
        raise ProofMismatch(
            f"{where} lacks the sources a proof records (package, data, factories, config)"
        ) from None
    except ConfigError as exc:
        raise ProofMismatch(f"{where}: its config is not valid for this version: {exc}") from None
    for kind in ("code", "factories", "data"):
        if proven[kind] != fingerprints.get(kind):
            raise ProofMismatch(
                f"{where} proves other {kind} than step {meta['step']} was trained with "
                f"({kind} fingerprint {str(proven[kind])[:12]}, checkpoint "
                f"{str(fingerprints.get(kind))[:12]}); rerun {step_command('03_verify_resume.py')}"
            )
    proof_flat, saved_flat = _computed(proof_config.flat()), _computed(saved_config.flat())
    differing = sorted(
        k for k in proof_flat.keys() | saved_flat.keys() if proof_flat.get(k) != saved_flat.get(k)
    )
    if differing:
        key = differing[0]
        raise ProofMismatch(
            f"{where} proves another config than step {meta['step']} was trained with: {key} is "
            f"{proof_flat.get(key)!r} there, {saved_flat.get(key)!r} in the checkpoint; rerun "
            f"{step_command('03_verify_resume.py')} with the training config"
        )
    return public_paths(report, root)
