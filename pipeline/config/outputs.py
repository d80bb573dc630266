"""The sections of where a run's results go and what its model card says: ``outputs`` and
``card``. Neither changes what a run computes (both are in
:data:`~pipeline.config.sections.RESUME_IRRELEVANT_KEYS`). Each value is checked as its section
is built, the key named in the one-line refusal.
"""

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..layout import METRICS_FILE, STAGE_DIR, TRACES_DIR
from .values import require as _require

__all__ = ["CardConfig", "OutputsConfig", "traces_folder"]


# \Z, not $ (which also matches before a final line break): "en\n" would reach the front matter.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?\Z")
_LANGUAGE = re.compile(r"[a-z]{2,3}(-[A-Za-z0-9]{2,8})*\Z")
_PIPELINE_TAG = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*\Z")


def _strings(values: Any, key: str, pattern: re.Pattern[str] | None = None, what: str = "") -> None:
    _require(
        isinstance(values, list) and all(isinstance(v, str) and v.strip() for v in values),
        key,
        "must be a list of non-empty strings",
    )
    for value in values:
        _require(pattern is None or bool(pattern.match(value)), key, f"holds {value!r}, which is not {what}")


@dataclass(kw_only=True, slots=True)
class CardConfig:
    """What the model card (script 05) says about the model: its front matter is what the Hub
    indexes (search filters, the widget, the evaluation table)."""

    license: str = "apache-2.0"
    """License identifier for the card's front matter."""
    tags: list = field(default_factory=lambda: ["pytorch", "safetensors"])
    """Hub tags."""
    description: str = ""
    """One paragraph describing the model; a default is written when empty."""
    library_name: str = ""
    """The Hub's library field; empty means ``transformers`` for a transformers model, else ``pytorch``."""
    pipeline_tag: str = ""
    """The Hub task, e.g. ``text-generation``; empty leaves it out."""
    language: list = field(default_factory=list)
    """Languages of the data as ISO 639 codes, e.g. ``[en]``."""
    datasets: list = field(default_factory=list)
    """Hub dataset ids the model was trained on, e.g. ``[tiny_shakespeare]``."""
    base_model: str = ""
    """Hub id of the model this one was fine-tuned from; empty for a model trained from scratch."""
    eval_dataset_name: str = ""
    """The evaluation table's dataset name; empty means the first of ``datasets``, else the model's data."""
    eval_dataset_type: str = ""
    """The evaluation table's dataset type (a Hub dataset id links it); empty means the first of ``datasets``."""
    sections: str = ""
    """A Markdown file (UTF-8, relative to the working folder) of your own card sections, such as
    "## Intended use" or "## Limitations", added after the description; empty for none. Its
    text is scanned for secrets and audited with the rest of the stage."""
    allow_leaks: dict = field(default_factory=dict)
    """False positives of the leak scan, per staged file: ``{README.md: [jwt]}`` lets that file hold
    something shaped like a JSON Web Token (kinds in docs/publishing.md). 05 and 06 both apply it."""

    def __post_init__(self) -> None:
        _strings(self.tags, "card.tags")
        _strings(self.language, "card.language", _LANGUAGE, "an ISO 639 code such as 'en' or 'pt-BR'")
        _strings(self.datasets, "card.datasets", _HUB_ID, "a Hub dataset id such as 'user/name'")
        _require(
            not self.base_model or bool(_HUB_ID.match(self.base_model)),
            "card.base_model",
            f"must be a Hub model id such as 'user/name' (got {self.base_model!r})",
        )
        _require(
            not self.pipeline_tag or bool(_PIPELINE_TAG.match(self.pipeline_tag)),
            "card.pipeline_tag",
            f"must be a Hub task such as 'text-generation' (got {self.pipeline_tag!r})",
        )
        _require(
            not self.library_name or bool(_PIPELINE_TAG.match(self.library_name)),
            "card.library_name",
            f"must be a Hub library name such as 'transformers' (got {self.library_name!r})",
        )
        _require(bool(self.license.strip()), "card.license", "must not be empty")
        # The kinds are checked by the leak scan (pipeline.leaks), which this module does not import:
        # the model's shipped code closure includes this module.
        _require(
            isinstance(self.allow_leaks, dict)
            and all(
                isinstance(name, str) and isinstance(kinds, list) and all(isinstance(k, str) for k in kinds)
                for name, kinds in self.allow_leaks.items()
            ),
            "card.allow_leaks",
            "must map a staged file to a list of leak kinds, e.g. {README.md: [jwt]}",
        )


@dataclass(kw_only=True, slots=True)
class OutputsConfig:
    """Where this config's results go, besides its checkpoints (``checkpoint.dir``). Left out
    of a config file, they are derived from the file's name (:func:`derived_outputs`), so
    two configs in one clone never share them."""

    metrics: str = METRICS_FILE
    """The evaluation record script 04 writes and script 05 reads."""
    stage: str = STAGE_DIR
    """The folder script 05 builds and script 06 publishes."""
    traces: str = ""
    """The TensorBoard traces training writes (with the optional ``tensorboard``); empty (the
    default): ``traces/<name>`` beside ``checkpoint.dir``, named after it (:func:`traces_folder`),
    so each run has its own and TensorBoard lists them by name. Training rebuilds it from the
    restored history at every start, so it replaces only a folder it made itself."""

    def __post_init__(self) -> None:
        _require(bool(self.metrics), "outputs.metrics", "must not be empty")
        _require(bool(self.stage), "outputs.stage", "must not be empty")


def traces_folder(traces: str, checkpoint_dir: str) -> Path:
    """Where a run writes its traces: ``outputs.traces`` as given, or, empty, the run's own folder
    ``<parent>/traces/<name>`` of its ``checkpoint.dir`` ``<parent>/<name>`` (``estados_local`` ->
    ``traces/estados_local``, ``runs/ft`` -> ``runs/traces/ft``): two runs, two folders, whatever
    parent they share; ``tensorboard --logdir <parent>/traces`` shows each run by its name."""
    if traces:
        return Path(traces)
    folder = Path(os.path.normpath(checkpoint_dir))
    if folder.name in ("", ".", ".."):  # "." or "..": named after the folder it is
        folder = Path(os.path.abspath(checkpoint_dir))
    return folder.parent / TRACES_DIR / (folder.name or "run")
