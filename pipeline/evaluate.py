"""Evaluate a verified checkpoint on held-out data and record the result in ``metrics.json``.

The model is rebuilt from the config saved in the checkpoint's own ``meta.json`` (not
from today's ``config.yaml``), its weights are loaded strictly, and the prepared data
must carry the fingerprint the checkpoint was trained on. The code that builds and evaluates
the model must be the code it was trained with (:func:`~pipeline.provenance.check_code_as_trained`,
the rule 05 applies: a model that ships its code is refused, a transformers model evaluated
with a warning). ``metrics.json`` names the checkpoint's step and the SHA-256 of its
``modelo.safetensors``, the SHA-256 of every code file that counts (``fingerprints.sources``)
and of this package (``fingerprints.code``), and the config it evaluated under, so script 05
can refuse to put one checkpoint's metrics, or metrics another code computed, on a card.

A distributed (torchrun) checkpoint is evaluated the same way, in one process: the load
consolidates its verified shards into the weights a single process would have saved, and
``modelo_sha256`` is the hash of the ``modelo.safetensors`` script 05 writes from them. The
metrics are therefore those of the published weights, whatever launch trained them.

``metrics.json`` lives outside the checkpoint folder on purpose: checkpoint folders are
immutable and verified against an exact file list.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from .checkpoint import CheckpointWeights, LoadMode, open_weights, pinned_checkpoint
from .config import RESUME_IRRELEVANT_KEYS, Config, config_from_dict
from .data import load_manifest, load_task_data
from .durable import scratch_folder, utc_now, write_json_atomic
from .errors import ConfigError, ConfigMismatch, DataError, FileChanged, MetricsError
from .factories import factory_errors
from .hashing import sha256_file
from .layout import META_FILE, METRICS_FILE
from .provenance import check_code_as_trained, code_fingerprint, counted_sources
from .rng import seed_everything
from .run import build_model, configure_determinism, resolve_device
from .safe_read import read_regular

__all__ = ["evaluation_config", "evaluate_checkpoint", "check_metrics", "write_metrics", "read_metrics"]

_log = logging.getLogger(__name__)

# 2: the code files (fingerprints.sources) and the config it evaluated under.
METRICS_SCHEMA = "pipeline.metrics/2"
HELDOUT_SPLIT = "heldout"
METRICS_KEYS = frozenset(
    {
        "schema",
        "step",
        "checkpoint",
        "modelo_sha256",
        "meta_file_sha256",
        "split",
        "metrics",
        "sample",
        "fingerprints",
        "config",
        "device",
        "created",
    }
)
# metrics.json is small; the bound keeps a stray huge file from being parsed.
_MAX_METRICS_BYTES = 16 * 1024 * 1024


def evaluation_config(meta: dict[str, Any], config: Config, *, source: str) -> Config:
    """The checkpoint's own config, with only *where* things are taken from ``config``.

    The architecture, dtype and data recipe must be those the weights were trained with;
    the data folder and the device are properties of this machine.
    """
    raw = meta["config"]
    if (
        not isinstance(raw, dict)
        or not isinstance(raw.get("data"), dict)
        or not isinstance(raw.get("training"), dict)
    ):
        raise ConfigMismatch(f"{source} has no usable config section")
    _note_unused_overrides(raw, config, source)
    raw = {
        **raw,
        "data": {**raw["data"], "dir": config.data.dir},
        "training": {**raw["training"], "device": config.training.device},
    }
    try:
        # The command line it came with too: a printed command repeats the user's config flags.
        return dataclasses.replace(config_from_dict(raw, source=source), command_args=config.command_args)
    except ConfigError as exc:
        raise ConfigMismatch(f"the checkpoint's config is not valid for this version: {exc}") from None


# What 04 and 05 take from the command line rather than from the checkpoint: where things are,
# the device, and the keys that never change what a checkpoint computes.
_FROM_COMMAND_LINE = RESUME_IRRELEVANT_KEYS | {"training.device"}


def _note_unused_overrides(saved: dict[str, Any], config: Config, source: str) -> None:
    """Say, in one warning line, which ``--set`` values this checkpoint's own config overrules:
    the keys it decides, given another value than its own (an extended run's first
    ``training.max_steps``, a model size that belongs to another run)."""
    args = list(config.command_args)
    keys = [args[i + 1].partition("=")[0] for i, arg in enumerate(args[:-1]) if arg == "--set"]
    current = config.to_dict()
    unused = []
    for key in keys:
        if key in _FROM_COMMAND_LINE or key.partition(".")[0] in _FROM_COMMAND_LINE:
            continue
        mine, theirs = current, saved
        for part in key.split("."):
            mine = mine.get(part) if isinstance(mine, dict) else None
            theirs = theirs.get(part) if isinstance(theirs, dict) else None
        if mine != theirs:
            unused.append(f"--set {key}={json.dumps(mine)} (it has {json.dumps(theirs)})")
    if unused:
        _log.warning(
            "warning: not used: %s: a checkpoint is evaluated and staged with the config it was trained with "
            "(%s)",
            ", ".join(unused),
            source,
        )


def check_metrics(metrics: Any, where: str) -> dict[str, float]:
    """``{name: finite float}`` or an error naming ``where`` the metrics came from. Several
    evaluation sets, ``{set: {metric: number}}``, come out as ``{"set/metric": float}``."""
    if not isinstance(metrics, dict) or not metrics:
        raise MetricsError(f"{where}: metrics must be a non-empty mapping of name to number")
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(name, str) and isinstance(value, dict):  # one of several evaluation sets
            if not value:
                raise MetricsError(f"{where}: evaluation set {name!r} holds no metric")
            named = [
                (f"{name}/{metric}" if isinstance(metric, str) else metric, number)
                for metric, number in value.items()
            ]
        else:
            named = [(name, value)]
        for flat, number in named:
            if not isinstance(flat, str) or isinstance(number, bool) or not isinstance(number, (int, float)):
                raise MetricsError(
                    f"{where}: metric {flat!r} is {number!r}; metrics must map str to a number (or a set's "
                    "name to such a mapping)"
                )
            if not math.isfinite(number):
                # JSON has no NaN, and a card must not advertise one: the model is broken.
                raise MetricsError(
                    f"{where}: held-out metric {flat} is {number}: the checkpoint's weights are not usable"
                )
            if flat in out:
                raise MetricsError(f"{where}: metric {flat!r} is named twice")
            out[flat] = float(number)
    return out


def evaluate_checkpoint(config: Config, checkpoint: str | Path = "latest") -> dict[str, Any]:
    """Evaluate ``checkpoint`` (``"latest"`` in ``checkpoint.dir``, or a step folder) on the
    held-out split; return the record that :func:`write_metrics` saves.

    Every file of the checkpoint is verified against its ``meta.json`` first, and the data
    folder against both its manifest and the checkpoint's data fingerprint.
    """
    # Pinned while every file is verified and the weights copied: a trainer running beside
    # us cannot prune it away. Then read from that private copy, one tensor at a time.
    with contextlib.ExitStack() as scratch:
        with pinned_checkpoint(
            checkpoint, config.checkpoint.dir, mode=LoadMode.VERIFY, committed=True
        ) as loaded:
            folder, meta = loaded.folder, loaded.meta
            meta_file_sha256 = sha256_file(folder / META_FILE)
            # Beside the metrics it will write (a RAM-backed /tmp would hold the whole copy in memory).
            beside = Path(os.path.abspath(config.outputs.metrics)).parent
            beside.mkdir(parents=True, exist_ok=True)
            work = scratch.enter_context(scratch_folder(beside, "evaluate-weights"))
            weights = scratch.enter_context(contextlib.closing(open_weights(folder, meta, work)))
        return _evaluate(config, folder, meta, meta_file_sha256, weights)


def _evaluate(
    config: Config, folder: Path, meta: dict[str, Any], meta_file_sha256: str, weights: CheckpointWeights
) -> dict[str, Any]:
    eval_config = evaluation_config(meta, config, source=f"{folder / META_FILE}")
    manifest = load_manifest(eval_config, trained=folder.name)
    trained_on = meta["fingerprints"].get("data")
    if manifest["fingerprint"] != trained_on:
        raise DataError(
            f"{eval_config.data.dir}/ holds data with fingerprint {manifest['fingerprint'][:12]}, but "
            f"{folder.name} was trained on {str(trained_on)[:12]}: its held-out split is not this one; "
            "point data.dir at the data the checkpoint was trained with"
        )
    device = resolve_device(eval_config)
    configure_determinism(eval_config)
    # Seeded so that a stochastic evaluate() or sample() gives the same record every time.
    seed_everything(eval_config.training.seed)
    model = build_model(eval_config, device)
    for change in check_code_as_trained(meta, eval_config, model, use="evaluate"):
        _log.warning(
            "warning: %s; evaluated anyway, since this model ships no code and its weights must fit the "
            "model the code builds now (metrics.json records the files evaluated with)",
            change.describe(),
        )
    sources = counted_sources(eval_config)
    weights.load_into(model)
    # The bytes evaluated, by the name 05 checks: a distributed checkpoint's weights as
    # the one file 05 stages from them (hashed, not written).
    weights_sha256 = weights.sha256()
    model.eval()
    data = load_task_data(eval_config)
    with factory_errors("data.factory", f"{eval_config.data.factory} evaluate()"):
        evaluated = data.evaluate(model, device)
    metrics = check_metrics(evaluated, f"{eval_config.data.factory} evaluate()")
    sample = getattr(data, "sample", None)
    with factory_errors("data.factory", f"{eval_config.data.factory} sample()"):
        text = sample(model, device) if sample is not None else None
    if text is not None and not isinstance(text, str):
        raise MetricsError(
            f"{eval_config.data.factory}: sample() must return a str, got {type(text).__name__}"
        )
    return {
        "schema": METRICS_SCHEMA,
        "step": meta["step"],
        "checkpoint": str(folder),
        # Verified as they were copied: these are the bytes that were evaluated.
        "modelo_sha256": weights_sha256,
        "meta_file_sha256": meta_file_sha256,
        "split": HELDOUT_SPLIT,
        "metrics": metrics,
        "sample": text,
        "fingerprints": {"data": manifest["fingerprint"], "code": code_fingerprint(), "sources": sources},
        "config": eval_config.to_dict(),
        "device": str(device),
        "created": utc_now(),
    }


def write_metrics(record: dict[str, Any], config: Config, path: str | Path | None = None) -> Path:
    """Write ``record`` atomically (temporary file, fsync, rename) to ``path``, by default
    ``config``'s ``outputs.metrics``: where script 05 of that config reads it, so evaluating
    one config never replaces another config's record."""
    path = Path(config.outputs.metrics if path is None else path)
    if path.is_dir():
        raise MetricsError(f"--output {path} is a folder; give a file path such as {path / METRICS_FILE}")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, record)
    return path


def read_metrics(path: str | Path, *, rerun: str = "python scripts/04_evaluate.py") -> dict[str, Any]:
    """Parse and check a ``metrics.json`` written by :func:`write_metrics`; a refusal tells to
    run ``rerun`` (the command that writes this record)."""
    path = Path(path)
    try:
        # Opened once: a FIFO or device swapped in is refused, not waited on or read forever.
        data = read_regular(path, _MAX_METRICS_BYTES)
    except FileNotFoundError:
        raise MetricsError(f"{path} not found: run {rerun} first") from None
    except ValueError as refusal:
        raise MetricsError(f"{path} {refusal}: not a metrics file; rerun {rerun}") from None
    except FileChanged as changed:
        raise MetricsError(f"{path} changed while it was read ({changed.reason}): rerun {rerun}") from None
    except OSError as failure:
        raise MetricsError(
            f"{path} could not be read ({failure.strerror or failure}): rerun {rerun}"
        ) from None
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise MetricsError(f"{path} is not valid JSON: rerun {rerun}") from None
    if not isinstance(record, dict) or record.get("schema") != METRICS_SCHEMA or set(record) != METRICS_KEYS:
        # An older schema records no code files: it cannot show which code computed it.
        raise MetricsError(f"{path} is not a {METRICS_SCHEMA} record: rerun {rerun}")
    if not isinstance(record["step"], int) or not isinstance(record["modelo_sha256"], str):
        raise MetricsError(f"{path} has a malformed step or modelo_sha256: rerun {rerun}")
    fingerprints = record["fingerprints"]
    if (
        not isinstance(fingerprints, dict)
        or not isinstance(fingerprints.get("code"), str)
        or not isinstance(fingerprints.get("sources"), dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in fingerprints["sources"].items())
        or not isinstance(record["config"], dict)
    ):
        raise MetricsError(f"{path} has malformed fingerprints or config: rerun {rerun}")
    try:
        check_metrics(record["metrics"], str(path))
    except MetricsError as refusal:  # 04 refuses such values: the record was written or edited elsewhere
        raise MetricsError(f"{refusal}; rerun {rerun}") from None
    return record
