"""What both model cards are made of: the checkpoint's (:mod:`.card`) and a folder's
(:mod:`.folder_card`). The front matter the Hub indexes, code blocks, the loading snippets
(each first checks every file against the SHA-256s the card lists), the files table and how
to verify it, and text made printable (the Hub refuses a README holding NUL bytes).
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any, Mapping

from huggingface_hub import EvalResult, ModelCardData

from ..errors import shown
from ..layout import CODE_DIR

__all__ = [
    "LOADER_MODULE",
    "card_data",
    "code",
    "fence",
    "hash_section",
    "load_section",
    "number",
    "printable",
    "snippet",
    "verify_section",
]

LIBRARY_NAME = "pytorch"
TRANSFORMERS_LIBRARY = "transformers"
# The module of code/ that loads a model that is not a transformers one (pipeline/stage/hub_loader.py).
LOADER_MODULE = "hub_loader"


def fence(text: str, language: str = "") -> str:
    """A code block that ``text`` cannot close early, however many backticks it holds."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}{language}\n{text.rstrip()}\n{ticks}"


def code(name: str) -> str:
    """A name from a user's folder (a file, a tensor, a metric) as a card shows it: inert text
    in a code span, on one line, that no Markdown or HTML in it can escape (:func:`shown`
    writes line breaks, backticks and table bars as ``\\xNN``)."""
    return f"`{shown(name)}`"


def number(value: float) -> str:
    return f"{value:.6g}"


def printable(text: str) -> str:
    """``text`` with every control character but newline and tab written as ``\\xNN`` (or
    ``\\uNNNN``), and lone surrogates as ``\\uNNNN``: the Hub refuses a README holding NUL
    bytes, and other controls garble it. Printable text is returned unchanged."""
    out = []
    for char in text:
        code = ord(char)
        if char in "\n\t" or unicodedata.category(char) not in ("Cc", "Cs"):
            out.append(char)
        else:
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
    return "".join(out)


def _eval_dataset(card: Mapping[str, Any], model_name: str) -> tuple[str, str]:
    """(name, type) of the evaluation table's dataset: set in the card section, else the
    first training dataset, else a name saying what it is (a type that links nowhere)."""
    first = card["datasets"][0] if card["datasets"] else ""
    name = card["eval_dataset_name"] or first or f"{model_name} held-out data"
    return name, card["eval_dataset_type"] or first or "custom"


def card_data(meta: Mapping[str, Any]) -> ModelCardData:
    config = meta["config"]
    card = config["card"]
    metrics = meta["metrics"]
    eval_results = None
    if metrics is not None:
        dataset_name, dataset_type = _eval_dataset(card, shown(config["model"]["name"]))
        eval_results = [
            EvalResult(
                task_type=card["pipeline_tag"] or "other",
                task_name="held-out evaluation",
                dataset_type=dataset_type,
                dataset_name=dataset_name,
                dataset_split=metrics["split"],
                metric_type=name,
                metric_name=name,
                metric_value=value,
            )
            for name, value in metrics["values"].items()
        ]
    default_library = TRANSFORMERS_LIBRARY if meta["export"]["transformers"] else LIBRARY_NAME
    return ModelCardData(
        library_name=card["library_name"] or default_library,
        pipeline_tag=card["pipeline_tag"] or None,
        language=list(card["language"]) or None,
        datasets=list(card["datasets"]) or None,
        base_model=card["base_model"] or None,
        license=card["license"],
        tags=list(card["tags"]),
        model_name=shown(config["model"]["name"]),  # the config's own name: inert text too
        metrics=sorted(metrics["values"]) if metrics is not None else None,
        eval_results=eval_results,
    )


def _check_hashes_code(files: Mapping[str, Mapping[str, Any]]) -> str:
    expected = "\n".join(f'    "{name}": "{entry["sha256"]}",' for name, entry in sorted(files.items()))
    return (
        f"expected = {{  # SHA-256 of every file, as listed on this card\n{expected}\n}}\n"
        "for name, sha256 in expected.items():\n"
        '    assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == sha256, f"{name} differs from the card"'
    )


# Where the snippets find the repository: downloaded by name, or (a stage built without
# --repo-id, whose card names no repository) a folder the reader downloaded first.
_LOCAL_FOLDER = "model"


def _download_code(repo_id: str | None) -> tuple[list[str], str]:
    """(imports, lines that set ``folder``) of a snippet."""
    if repo_id is None:
        return [], (
            f'folder = Path("{_LOCAL_FOLDER}")  # this repository, downloaded: '
            f"hf download <its id> --local-dir {_LOCAL_FOLDER}"
        )
    return ["from huggingface_hub import snapshot_download"], (
        f'repo_id = "{repo_id}"\n'
        'revision = "main"  # pin a commit id or tag, e.g. revision="<commit sha>", for a reproducible download\n'
        "folder = Path(snapshot_download(repo_id, revision=revision))"
    )


def snippet(
    stdlib: list[str],
    imports: list[str],
    repo_id: str | None,
    files: Mapping[str, Mapping[str, Any]],
    body: str,
) -> str:
    downloads, folder = _download_code(repo_id)
    head = "\n".join(["import hashlib", *stdlib, "from pathlib import Path"])
    return (
        f"{head}\n\n"
        + "\n".join([*downloads, *imports])
        + f"\n\n{folder}\n{_check_hashes_code(files)}\n\n{body}"
    )


def _is_causal_lm(meta: Mapping[str, Any]) -> bool:
    return meta["export"]["architecture"].endswith("ForCausalLM")


def _transformers_load_code(
    meta: Mapping[str, Any], files: Mapping[str, Mapping[str, Any]], repo_id: str | None
) -> str:
    strict = (
        "# Strict: every tensor of the model came from the files, and every file tensor was used.\n"
        'assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info'
    )
    if _is_causal_lm(meta):
        tokenizer = any(name in files for name in ("tokenizer.json", "tokenizer_config.json"))
        names = "AutoModelForCausalLM, AutoTokenizer, pipeline" if tokenizer else "AutoModelForCausalLM"
        body = (
            f"model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)\n{strict}"
        )
        if tokenizer:
            body = (
                f"tokenizer = AutoTokenizer.from_pretrained(folder)\n{body}\n"
                'generator = pipeline("text-generation", model=model, tokenizer=tokenizer)\n'
                'print(generator("Hello", max_new_tokens=20)[0]["generated_text"])'
            )
        return snippet([], [f"from transformers import {names}"], repo_id, files, body)
    architecture = meta["export"]["architecture"].rpartition(".")[2]
    body = f"model, info = {architecture}.from_pretrained(folder, output_loading_info=True)\n{strict}\nmodel.eval()"
    return snippet([], [f"from transformers import {architecture}"], repo_id, files, body)


def _code_load_code(
    meta: Mapping[str, Any], files: Mapping[str, Mapping[str, Any]], repo_id: str | None
) -> str:
    body = (
        f"# This imports and runs the Python files under {CODE_DIR}/ of this repository: read them first.\n"
        f'sys.path.insert(0, str(folder / "{CODE_DIR}"))\n'
        f"from {LOADER_MODULE} import load_model  # {CODE_DIR}/{LOADER_MODULE}.py: factory, config, strict load\n"
        "model = load_model(folder)"
    )
    return snippet(["import sys"], [], repo_id, files, body)


def load_section(meta: Mapping[str, Any], files: Mapping[str, Mapping[str, Any]], repo_id: str | None) -> str:
    if meta["export"]["transformers"]:
        code = _transformers_load_code(meta, files, repo_id)
        intro = (
            "A transformers model: `config.json` is the model's own config and "
            "`model.safetensors.index.json` maps every tensor to its file, so `from_pretrained` loads it "
            "with no code from this repository. The snippet first checks every file against this card."
        )
    else:
        code = _code_load_code(meta, files, repo_id)
        intro = (
            "This needs only `torch`, `safetensors` and `huggingface_hub`. **Loading runs this repository's "
            f"Python code**: the model's own modules are under `{CODE_DIR}/` (listed with their SHA-256 below) "
            f"with `{CODE_DIR}/{LOADER_MODULE}.py`, which rebuilds the model with the factory and config that "
            "`config.json` names and loads the weights strictly. The snippet checks every file against this "
            "card before importing anything."
        )
    if repo_id is None:
        intro += (
            f" Download this repository first (`hf download <its id> --local-dir {_LOCAL_FOLDER}`, its id "
            f"shown at the top of its page), then run this beside the `{_LOCAL_FOLDER}` folder."
        )
    else:
        intro += " Pin `revision=` to a commit id (or a tag) so that what you load cannot change under you."
    return f"## How to load it\n\n{intro}\n\n" + fence(code, "python")


def hash_section(files: Mapping[str, Mapping[str, Any]]) -> str:
    rows = "\n".join(
        f"| {code(name)} | {entry['size']:,} | `{entry['sha256']}` |" for name, entry in sorted(files.items())
    )
    return (
        "## Files and SHA-256\n\n| file | bytes | SHA-256 |\n| --- | ---: | --- |\n" + rows + "\n\n"
        "`MANIFEST.sha256` lists every file of this repository except itself (this card included)."
    )


def verify_section() -> str:
    return (
        "## Verify\n\n" + fence("sha256sum -c MANIFEST.sha256", "sh") + "\n\n"
        "A matching hash shows the files were not modified after staging. It does not show who published "
        "them: compare the hashes with ones you obtained through a channel you trust, and pin a revision."
    )
