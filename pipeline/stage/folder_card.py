"""The model card of a folder another tool wrote (05 ``--from-folder``).

It states what is known and nothing more: the architecture ``config.json`` names, the
parameter count of the weights, the SHA-256 of every file read from the folder and of every
staged file, the files left out, and metrics only when the publisher supplied them (marked
as such). How the model was trained is not known here, so there is no training section and
no resume proof. The card's common parts (front matter, loading snippet of a transformers
model, the hash table, how to verify) are :mod:`.card`'s.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from huggingface_hub import ModelCard

from ..layout import CONFIG_FILE, INDEX_FILE
from .card_parts import (
    card_data,
    code,
    fence,
    hash_section,
    load_section,
    number,
    printable,
    snippet,
    verify_section,
)

__all__ = ["build_folder_card"]


# A title shown as it is; any other name (a folder's, which may hold anything) as code.
_PLAIN_TITLE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _title(name: str) -> str:
    return f"# {name}" if _PLAIN_TITLE.fullmatch(name) else f"# {code(name)}"


def _weights_phrase(export: Mapping[str, Any]) -> str:
    files = export["weights"]
    if len(files) == 1:
        return f"`{files[0]}`"
    return f"{len(files)} shards (`{files[0]}` … `{files[-1]}`, listed in `{INDEX_FILE}`)"


def _describe(meta: Mapping[str, Any]) -> str:
    card, export = meta["config"]["card"], meta["export"]
    if card["description"].strip():
        return card["description"].strip()
    kind = f"transformers `{export['architecture']}`" if export["transformers"] else "PyTorch"
    return (
        f"{code(meta['config']['model']['name'])} is a {kind} model with "
        f"{meta['model']['num_parameters']:,} parameters in {_weights_phrase(export)}. It was trained with "
        "another tool; its files were checked and staged by `scripts/05_stage.py --from-folder`, which knows "
        "what they hold, not how they were made."
    )


def _plainload_section(files: Mapping[str, Any], repo_id: str | None) -> str:
    body = (
        f'config = json.loads((folder / "{CONFIG_FILE}").read_text())\n'
        "state_dict = {}\n"
        f'for name in sorted(set(json.loads((folder / "{INDEX_FILE}").read_text())["weight_map"].values())):\n'
        "    state_dict.update(load_file(folder / name))\n"
        "# With your model's class: a PyTorchModelHubMixin one loads with YourModel.from_pretrained(repo_id);\n"
        "# otherwise model = YourModel(**config); model.load_state_dict(state_dict)"
    )
    code = snippet(["import json"], ["from safetensors.torch import load_file"], repo_id, files, body)
    return (
        "## How to load it\n\nThe weights and `config.json` of a PyTorch model; this repository holds no code, "
        "so the model is built with its own class. The snippet first checks every file against this card.\n\n"
        + fence(code, "python")
    )


def _metrics_section(meta: Mapping[str, Any]) -> str:
    metrics = meta["metrics"]
    if metrics is None:
        return "## Metrics\n\nNone were supplied with these weights, and none were computed when they were staged."
    rows = "\n".join(f"| {code(name)} | {number(value)} |" for name, value in metrics["values"].items())
    return (
        f"## Metrics\n\nAs supplied by the publisher in {code(metrics['supplied'])}, for these weights; "
        f"this pipeline did not compute them.\n\n| metric | value |\n| --- | --- |\n{rows}"
    )


def _source_section(meta: Mapping[str, Any]) -> str:
    source = meta["source_checkpoint"]
    seal = (
        "Its seal (`meta.json`, written by `SealedCheckpoints` or `seal_checkpoint`) verified: every file the "
        "trainer wrote was there, byte for byte."
        if source["sealed"]
        else "It carried no seal, so nothing shows the folder was complete beyond what was checked here."
    )
    rows = "\n".join(
        f"| {code(name)} | {entry['size']:,} | `{entry['sha256']}` |"
        for name, entry in source["files"].items()
    )
    left_out = ", ".join(code(name) for name in source["left_out"]) or "nothing"
    step = f" It holds training step {meta['step']:,}." if meta["step"] is not None else ""
    return (
        f"## Source\n\nStaged from the folder {code(source['folder'])}.{step} {seal} The weights were parsed "
        "strictly as safetensors and scanned for NaN and infinite values. Files read from it:\n\n"
        f"| file | bytes | SHA-256 |\n| --- | ---: | --- |\n{rows}\n\n"
        f"Left out, never opened: {left_out}. No resume proof goes with these weights: how they were trained "
        "was not checked."
    )


def build_folder_card(
    meta: Mapping[str, Any],
    files: Mapping[str, Mapping[str, Any]],
    *,
    repo_id: str | None = None,
    signature_section: str | None = None,
    user_sections: str | None = None,
) -> ModelCard:
    """The card for the staged record ``meta`` of a folder (see :func:`.card.build_model_card`
    for ``files``, ``repo_id``, ``signature_section`` and ``user_sections``)."""
    load = (
        load_section(meta, files, repo_id)
        if meta["export"]["transformers"]
        else _plainload_section(files, repo_id)
    )
    sections = [
        _title(meta["config"]["model"]["name"]),
        _describe(meta),
        *([user_sections.strip()] if user_sections and user_sections.strip() else []),
        load,
        _metrics_section(meta),
    ]
    if meta["checks"]["nonfinite_tensors"]:
        listed = ", ".join(code(t) for t in meta["checks"]["nonfinite_tensors"])
        sections.append(f"## Warning\n\nThese tensors hold NaN or infinite values: {listed}.")
    if signature_section:
        sections.append(signature_section)
    sections += [_source_section(meta), hash_section(files), verify_section()]
    body = printable("\n\n".join(sections) + "\n")
    content = f"---\n{card_data(meta).to_yaml()}\n---\n\n" + body
    return ModelCard(content)
