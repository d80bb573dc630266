"""The model card (``README.md``) and training curve (``training_curve.png``) of a stage.

Both are built only from the staged ``meta.json`` record (plus the training history), so
the card never states anything the record does not. The front matter is produced by
``huggingface_hub.ModelCardData`` and parsed back by ``ModelCard`` before it is returned.
"""

from __future__ import annotations

import io
import math
import re
from typing import Any, Mapping, Sequence

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .layout import CURVE_FILE, META_FILE, MODEL_FILE

__all__ = ["render_curve", "build_model_card"]

LIBRARY_NAME = "pytorch"
_PLACEHOLDER_REPO = "<namespace>/{name}"


def render_curve(history: Mapping[str, Sequence[float]]) -> bytes | None:
    """PNG of loss and learning rate against step, or ``None`` when matplotlib (an optional
    extra: ``pip install 'pipeline[card]'``) is not installed. No timestamps or software
    tag are embedded, so the same history renders to the same bytes with the same matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import LogFormatter
    except ImportError:
        return None

    class _PlainLogFormatter(LogFormatter):
        """Log-axis labels as "0.5", not "5e-01". LogFormatter still decides which ticks
        get a label (it thins minor ones on wide ranges); only the text is changed."""

        def _num_to_string(self, x: float, vmin: float, vmax: float) -> str:
            return f"{x:g}"

    steps, loss, lr = list(history["step"]), list(history["loss"]), list(history["lr"])
    figure = Figure(figsize=(9, 3.4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    loss_axes, lr_axes = figure.subplots(1, 2)
    loss_axes.plot(steps, loss, marker="." if len(steps) <= 50 else None, color="tab:blue")
    # A log scale shows late-training progress, but only exists for positive losses.
    if loss and all(math.isfinite(v) and v > 0 for v in loss):
        loss_axes.set_yscale("log")
        loss_axes.yaxis.set_major_formatter(_PlainLogFormatter())
        loss_axes.yaxis.set_minor_formatter(_PlainLogFormatter(labelOnlyBase=False))
    loss_axes.set(title="training loss", xlabel="step", ylabel="loss")
    lr_axes.plot(steps, lr, drawstyle="steps-post", color="tab:orange")
    lr_axes.set(title="learning rate", xlabel="step", ylabel="lr")
    for axes in (loss_axes, lr_axes):
        axes.grid(True, alpha=0.3)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()


def _fence(text: str, language: str = "") -> str:
    """A code block that ``text`` cannot close early, however many backticks it holds."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}{language}\n{text.rstrip()}\n{ticks}"


def _params(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{key} {value}" for key, value in sorted(params.items()))


def _number(value: float) -> str:
    return f"{value:.6g}"


def _card_data(meta: Mapping[str, Any]) -> ModelCardData:
    config = meta["config"]
    metrics = meta["metrics"]
    eval_results = None
    if metrics is not None:
        eval_results = [
            EvalResult(task_type="other", task_name="held-out evaluation", dataset_type="pipeline-prepared",
                       dataset_name=f"{config['data']['prepare']} ({metrics['split']} split)",
                       dataset_split=metrics["split"], metric_type=name, metric_name=name, metric_value=value)
            for name, value in metrics["values"].items()
        ]
    return ModelCardData(
        library_name=LIBRARY_NAME,
        license=config["card"]["license"],
        tags=list(config["card"]["tags"]),
        model_name=config["model"]["name"],
        metrics=sorted(metrics["values"]) if metrics is not None else None,
        eval_results=eval_results,
    )


def _describe(meta: Mapping[str, Any]) -> str:
    config = meta["config"]
    if config["card"]["description"].strip():
        return config["card"]["description"].strip()
    return (f"`{config['model']['name']}` is a PyTorch model with {meta['model']['num_parameters']:,} parameters "
            f"built by `{config['model']['factory']}` and trained for {meta['step']} steps on data prepared by "
            f"`{config['data']['prepare']}`. The weights are stored in `{MODEL_FILE}` "
            f"({config['training']['dtype']}); `meta.json` records the config, metrics and provenance.")


def _load_section(meta: Mapping[str, Any], repo_id: str) -> str:
    sha = meta["files"][MODEL_FILE]["sha256"]
    code = f'''import hashlib, json
from huggingface_hub import hf_hub_download
from safetensors.torch import load_file

repo = "{repo_id}"
weights = hf_hub_download(repo, "{MODEL_FILE}")
with open(weights, "rb") as f:
    assert hashlib.sha256(f.read()).hexdigest() == "{sha}"
state_dict = load_file(weights)  # plain tensors; no pickle, no code runs on load

# Rebuild the architecture from the recorded config (needs the `pipeline` package):
from pipeline import build_model, config_from_dict, load_model_weights

meta = json.load(open(hf_hub_download(repo, "{META_FILE}")))
model = build_model(config_from_dict(meta["config"]))
load_model_weights(model, state_dict)  # strict: names, shapes and dtypes must match
model.eval()'''
    return ("## How to load it\n\n"
            "The weights are a plain [safetensors](https://huggingface.co/docs/safetensors) file. "
            "Pin `revision=` to a commit for reproducible downloads.\n\n" + _fence(code, "python"))


def _training_section(meta: Mapping[str, Any], curve_file: str | None) -> str:
    config, training = meta["config"], meta["training"]
    rows = [
        ("steps", str(meta["step"])),
        ("final training loss", _number(training["final_loss"]) if training["final_loss"] is not None else "n/a"),
        ("optimizer", f"`{config['optimizer']['factory']}`, lr {config['optimizer']['lr']}, "
                      f"weight decay {config['optimizer']['weight_decay']}"),
        ("schedule", f"`{config['scheduler']['factory']}` {_params(config['scheduler']['params'])}".rstrip()),
        ("batch size", str(config["data"]["batch_size"])),
        ("seed", str(config["training"]["seed"])),
        ("dtype / AMP", f"{config['training']['dtype']} / {config['training']['amp']}"),
        ("device", str(meta["provenance"]["device"])),
        ("parameters", f"{meta['model']['num_parameters']:,}"),
    ]
    table = "| | |\n| --- | --- |\n" + "\n".join(f"| {key} | {value} |" for key, value in rows)
    curve = (f"\n\n![Training loss and learning rate]({curve_file})" if curve_file else
             "\n\nNo training curve: matplotlib was not installed where this model was staged.")
    return f"## Training\n\n{table}{curve}"


def _metrics_section(meta: Mapping[str, Any]) -> str:
    metrics = meta["metrics"]
    if metrics is None:
        return ("## Metrics\n\nThis checkpoint was staged without an evaluation "
                "(`scripts/05_stage.py --no-metrics`).")
    rows = "\n".join(f"| {name} | {_number(value)} |" for name, value in sorted(metrics["values"].items()))
    return (f"## Metrics\n\nOn the held-out split (`{metrics['split']}`) of the prepared data "
            f"(fingerprint `{metrics['data_fingerprint'][:12]}`), evaluated with exactly the weights below "
            f"(step {meta['step']}):\n\n| metric | value |\n| --- | --- |\n{rows}\n\n"
            "Full-precision values are in `meta.json` under `metrics`.")


def _hash_section(files: Mapping[str, Mapping[str, Any]]) -> str:
    rows = "\n".join(f"| `{name}` | {entry['size']:,} | `{entry['sha256']}` |" for name, entry in sorted(files.items()))
    return ("## Files and SHA-256\n\n| file | bytes | SHA-256 |\n| --- | ---: | --- |\n" + rows + "\n\n"
            "`MANIFEST.sha256` lists every file of this repository except itself (this card included).")


def _verify_section() -> str:
    return ("## Verify\n\n" + _fence("sha256sum -c MANIFEST.sha256", "sh") + "\n\n"
            "A matching hash shows the files were not modified after staging. It does not show who published "
            "them: compare the hashes with ones you obtained through a channel you trust, and pin a revision.")


def _provenance_section(meta: Mapping[str, Any]) -> str:
    provenance, source = meta["provenance"], meta["source_checkpoint"]
    versions = ", ".join(f"{name} {value}" for name, value in sorted(provenance["versions"].items())
                         if value is not None)
    rows = [
        ("source checkpoint", f"`{source['folder']}` (its `meta.json` SHA-256 `{source['meta_sha256']}`)"),
        ("checkpoint written", str(meta["training"]["created"])),
        ("code fingerprint", f"`{provenance['fingerprints']['code']}`"),
        ("data fingerprint", f"`{provenance['fingerprints']['data']}`"),
        ("libraries", versions),
    ]
    return ("## Provenance\n\n| | |\n| --- | --- |\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n\n"
            "Fingerprints are SHA-256 over the package's Python sources and over the prepared data files.")


def build_model_card(meta: Mapping[str, Any], files: Mapping[str, Mapping[str, Any]], *, repo_id: str | None = None,
                     sample: str | None = None, curve_file: str | None = CURVE_FILE,
                     signature_section: str | None = None) -> ModelCard:
    """The card for a staged record ``meta`` (the stage's ``meta.json``).

    ``files`` maps each file the card lists to ``{"sha256", "size"}``; ``repo_id`` fills
    the loading snippet (a placeholder when ``None``); ``sample`` is the task's optional
    text sample; ``curve_file`` is the embedded image (``None`` for none);
    ``signature_section`` is :func:`pipeline.signing.card_section`'s text.
    """
    name = meta["config"]["model"]["name"]
    repo = repo_id or _PLACEHOLDER_REPO.format(name=name)
    sections = [
        f"# {name}",
        _describe(meta),
        f"Step **{meta['step']}**; `{MODEL_FILE}` SHA-256 `{meta['files'][MODEL_FILE]['sha256']}`.",
        _load_section(meta, repo),
        _training_section(meta, curve_file),
        _metrics_section(meta),
    ]
    if sample:
        sections.append("## Sample\n\nOutput of the task's `sample()` with these weights:\n\n" + _fence(sample, "text"))
    if meta["checks"]["nonfinite_tensors"]:
        listed = ", ".join(f"`{t}`" for t in meta["checks"]["nonfinite_tensors"])
        sections.append(f"## Warning\n\nThese tensors hold NaN or infinite values: {listed}.")
    if signature_section:
        sections.append(signature_section)
    sections += [_hash_section(files), _verify_section(), _provenance_section(meta)]
    content = f"---\n{_card_data(meta).to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n"
    # Parsing it back checks the front matter is valid YAML that the Hub client accepts.
    return ModelCard(content)
