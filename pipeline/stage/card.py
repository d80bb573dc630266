"""The model card (``README.md``) and training curve (``training_curve.png``) of a stage.

Both are built only from the staged ``meta.json`` record (plus the training history), so
the card never states anything the record does not. The front matter is produced by
``huggingface_hub.ModelCardData`` and parsed back by ``ModelCard`` before it is returned.
"""

from __future__ import annotations

import io
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, Mapping, Sequence

from huggingface_hub import ModelCard

from ..errors import FileChanged, StageError, shown
from ..layout import CURVE_FILE
from ..safe_read import HandedFolder, Seen
from ..traces import INSTALL_HINT
from .card_parts import card_data, code, fence, hash_section, load_section, number, printable, verify_section
from .recipe import recipe_rows, selection_phrase

__all__ = [
    "MAX_SECTIONS",
    "render_curve",
    "build_model_card",
    "read_user_sections",
]

# The largest card-sections file accepted: a card is read by people.
MAX_SECTIONS = 256 * 1024


def read_user_sections(name: str, root: str | Path) -> str | None:
    """The Markdown of the ``card.sections`` file ``name``, or None when it is empty.

    A config may come from anyone, and what this file holds is published: it must be a
    regular file inside ``root`` (the folder the scripts run in), reached without leaving it
    (no ``..`` out, no absolute path elsewhere, no link to a file outside), of at most
    :data:`MAX_SECTIONS` bytes, UTF-8. A device, pipe or folder is refused before it is
    opened, and no more than the limit is ever read. Refusals are one :class:`StageError`."""
    if not name:
        return None
    fix = 'put your sections in a Markdown file inside it and name that file, or set card.sections to ""'
    where = "the folder the scripts run in"
    if "\0" in name:
        # No file name holds a NUL: resolving it would raise ValueError, a traceback.
        raise StageError(f"card.sections: {shown(name)} is no file name (it holds a NUL byte); {fix}")
    inside = Path(os.path.realpath(root))
    path = Path(os.path.abspath(os.path.join(inside, name)))
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(inside):
        linked = path.is_relative_to(inside)
        how = "is a link to a file outside" if linked else "is outside"
        raise StageError(f"card.sections: {shown(name)} {how} {where} ({shown(inside)}); {fix}")
    if real == inside:
        raise StageError(
            f"card.sections: {shown(name)} is not a regular file (a folder, device or pipe); {fix}"
        )
    relative = real.relative_to(inside).as_posix()
    not_found = (
        f"card.sections: {shown(name)} not found (paths are relative to {where}); fix the path or set "
        'card.sections to ""'
    )
    try:
        # Inside the try: a part of the path the system cannot take (too long) is said in one line.
        if not real.parent.is_dir():
            # A file named as a folder on the way ("card.md/more.md"): the walk below would take it
            # for a swap made while reading, and say so on every rerun.
            raise StageError(not_found)
        # Opened from the folder's descriptor, no link followed on the way, checked to be the
        # file just looked at, read within its size: a swap for a link, a pipe or a device since
        # is refused, never followed or waited on (pipeline.safe_read).
        with HandedFolder(inside) as handed:
            found = handed.lstat(relative)
            if not stat.S_ISREG(found.st_mode):
                raise StageError(
                    f"card.sections: {shown(name)} is not a regular file (a folder, device or pipe); {fix}"
                )
            if found.st_size > MAX_SECTIONS:
                raise StageError(
                    f"card.sections: {shown(name)} is {found.st_size:,} bytes, over the {MAX_SECTIONS // 1024} KiB "
                    "a card's own sections may have (a card is read by people): shorten it"
                )
            with handed.open(relative, seen=Seen.of(found)) as file:
                data = file.read()
    except FileChanged:
        raise StageError(f"card.sections: {shown(name)} changed while it was read; run 05 again") from None
    except FileNotFoundError:
        raise StageError(not_found) from None
    except OSError as exc:
        raise StageError(f"card.sections: {shown(name)} cannot be read ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise StageError(f"card.sections: {shown(name)} is not UTF-8 text") from None


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


def _weights_phrase(meta: Mapping[str, Any]) -> str:
    files = meta["export"]["weights"]
    if len(files) == 1:
        return f"`{files[0]}`"
    return f"{len(files)} shards (`{files[0]}` … `{files[-1]}`, listed in `model.safetensors.index.json`)"


def _describe(meta: Mapping[str, Any]) -> str:
    config = meta["config"]
    if config["card"]["description"].strip():
        return config["card"]["description"].strip()
    kind = "transformers" if meta["export"]["transformers"] else "PyTorch"
    return (
        f"`{config['model']['name']}` is a {kind} model with {meta['model']['num_parameters']:,} parameters "
        f"built by `{config['model']['factory']}` and trained for {meta['step']} steps on data prepared by "
        f"`{config['data']['prepare']}`. The weights are stored in {_weights_phrase(meta)} "
        f"({config['training']['dtype']}); `meta.json` records the config, metrics and provenance."
    )


def _progress_line(meta: Mapping[str, Any]) -> str:
    """What the staged checkpoint is, from the record: never the configured run length alone."""
    step, planned = meta["step"], meta["config"]["training"]["max_steps"]
    stopped = meta["training"].get("stopped")
    run = selection_phrase(meta) or (
        "the last step of its run"
        if step >= planned or (stopped is not None and stopped["step"] == step)
        else f"an intermediate checkpoint of a run configured for {planned:,} steps"
    )
    extended = "".join(
        f" The run, planned for {entry['from_max_steps']:,} steps, was extended at step "
        f"{entry['at_step']:,} to {entry['to_max_steps']:,} (optimizer, data order and random "
        "states continued; the learning-rate schedule kept its first length)."
        for entry in meta["training"]["lineage"]
    )
    return (
        f"This is step **{step:,}**, {run}; {meta['model']['num_parameters']:,} parameters in "
        f"{_weights_phrase(meta)}.{extended}{_stopped_early(stopped)}"
    )


def _stopped_early(stopped: Mapping[str, Any] | None) -> str:
    """The sentence of a run a callback stopped (early stopping): where, and why, as meta.json
    records it (``training_state.callbacks.stopped``)."""
    if stopped is None:
        return ""
    # A callback's words, shown as text: one line, no Markdown or HTML of theirs.
    reason, by = (
        re.sub(r"([\\`*_{}\[\]()#+!<>|~])", r"\\\1", " ".join(printable(str(stopped[key])).split()))
        for key in ("reason", "by")
    )
    return f" It stopped early at step {stopped['step']:,}: {reason} ({by})."


def _traces_line(meta: Mapping[str, Any]) -> str:
    traces = meta["training"]["traces"]
    if traces is None:
        return (
            f"\n\nNo TensorBoard traces: tensorboard was not installed where this model was staged "
            f"({INSTALL_HINT})."
        )
    return (
        f"\n\nTensorBoard traces of the same history (`train/loss`, `train/lr`, `train/grad_norm`, "
        f"`train/epoch` and each evaluation as `eval/<metric>`): [`{traces}`]({traces}), shown on the Hub's "
        "*Training metrics* tab, or locally "
        "with `tensorboard --logdir runs`."
    )


def _training_section(meta: Mapping[str, Any], curve_file: str | None) -> str:
    config, training = meta["config"], meta["training"]
    rows = [
        ("steps", str(meta["step"])),
        (
            "final training loss",
            number(training["final_loss"]) if training["final_loss"] is not None else "n/a",
        ),
        *recipe_rows(meta),
        ("seed", str(config["training"]["seed"])),
        ("launch", f"{_launch_phrase(training['launch'])} on {meta['provenance']['device']}"),
        *([("history", history)] if (history := _history(training)) else []),
        ("parameters", f"{meta['model']['num_parameters']:,}"),
    ]
    table = "| | |\n| --- | --- |\n" + "\n".join(f"| {key} | {value} |" for key, value in rows)
    curve = (
        f"\n\n![Training loss and learning rate]({curve_file})"
        if curve_file
        else "\n\nNo training curve: matplotlib was not installed where this model was staged."
    )
    return f"## Training\n\n{table}{curve}{_traces_line(meta)}"


def _launch_phrase(launch: Mapping[str, Any]) -> str:
    """``one process``, ``2 processes (DDP)``: how a launch laid the run out."""
    if launch["world_size"] == 1 and launch["parallel"] == "none":
        return "one process"
    processes = "one process" if launch["world_size"] == 1 else f"{launch['world_size']} processes"
    unused = ", find_unused_parameters" if launch.get("ddp_find_unused_parameters") else ""
    return f"{processes} ({launch['parallel'].upper()}{unused})"


def _history(training: Mapping[str, Any]) -> str:
    """The run's launches, extensions and accepted environment changes, in step order."""
    events: list[tuple[int, str]] = []
    moves = [change for change in training["changes"] if change["item"] == "launch"]
    for change in training["changes"]:
        if change["item"] == "launch":
            events.append(
                (change["step"], f"moved to {_launch_phrase(change['now'])} after step {change['step']:,}")
            )
        else:
            events.append(
                (
                    change["step"],
                    f"{change['item']} changed from {change['recorded']} to {change['now']} after step "
                    f"{change['step']:,}",
                )
            )
    for entry in training["lineage"]:
        events.append(
            (
                entry["at_step"],
                f"extended from {entry['from_max_steps']:,} to {entry['to_max_steps']:,} steps after step "
                f"{entry['at_step']:,}",
            )
        )
    if not events:
        return ""
    first = moves[0]["recorded"] if moves else training["launch"]
    ordered = [text for _, text in sorted(events, key=lambda event: event[0])]
    return "; ".join([f"trained in {_launch_phrase(first)}", *ordered])


def _metrics_section(meta: Mapping[str, Any]) -> str:
    metrics = meta["metrics"]
    if metrics is None:
        return (
            "## Metrics\n\nThis checkpoint was staged without an evaluation "
            "(`scripts/05_stage.py --no-metrics`)."
        )
    rows = "\n".join(f"| {name} | {number(value)} |" for name, value in sorted(metrics["values"].items()))
    return (
        f"## Metrics\n\nOn the held-out split (`{metrics['split']}`) of the prepared data "
        f"(fingerprint `{metrics['data_fingerprint'][:12]}`), evaluated with exactly the weights below "
        f"(step {meta['step']}):\n\n| metric | value |\n| --- | --- |\n{rows}\n\n"
        "Full-precision values are in `meta.json` under `metrics`."
    )


def _proof_section(meta: Mapping[str, Any]) -> str:
    proof = meta.get("proof")
    if proof is None:
        return (
            "## Resume proof\n\nNo resume proof was staged with this checkpoint "
            "(`scripts/05_stage.py --proof DIR` stages the report of `scripts/03_verify_resume.py`)."
        )
    verdict = "**proven**" if proof["all_checks_passed"] else "**not proven**"
    tolerance = proof["tolerance"]
    exactness = (
        "bitwise (tolerance 0)" if tolerance["atol"] == 0 else f"absolute tolerance {tolerance['atol']}"
    )
    controls = ", ".join(f"{name}: {result}" for name, result in sorted(proof["controls"].items()))
    return (
        f"## Resume proof\n\nResuming this training run is {verdict}: a run cut at step {proof['cut']} and "
        f"resumed in a new process matched the uninterrupted run over {proof['steps']} steps in "
        f"{proof['checks_passed']} of {proof['checks']} checks, {exactness}. Negative controls (resumes that "
        f"leave one saved component out, which must diverge): {controls}. The proof was made with this "
        f"checkpoint's config, code and data fingerprints; the full report is [`{proof['file']}`]({proof['file']})."
    )


def _reproduce_section(meta: Mapping[str, Any]) -> str:
    """How anyone trains these weights again, bit for bit, and what must match for that."""
    config, provenance, training = meta["config"], meta["provenance"], meta["training"]
    environment, versions = provenance["environment"], provenance["versions"]
    step, lineage = meta["step"], training["lineage"]
    run = config["training"]
    moves = [change for change in training["changes"] if change["item"] == "launch"]
    launch = moves[0]["recorded"] if moves else training["launch"]
    # A run recorded as DDP or FSDP2 is refused in one process: it trains again under torchrun.
    launcher = (
        ""
        if launch["parallel"] == "none"
        else f"-m torch.distributed.run --standalone --nproc-per-node {launch['world_size']} "
    )
    train = f"python {launcher}scripts/02_train.py --config config.yaml"
    if not lineage:
        commands = [train + (f" --stop-at {step}" if step < run["max_steps"] else "")]
        extended = ""
    else:
        commands = [f"{train} --set training.max_steps={lineage[0]['from_max_steps']}"]
        extended = (
            " This run was extended (`training.lineage` in `meta.json`): after the first command, "
            "continue it with `--resume latest --extend-to N` at each step the lineage lists, "
            f"stopping at step {step}."
        )
    script = "\n".join(
        [
            "python -c \"import json, yaml; yaml.safe_dump(json.load(open('meta.json'))['config'], "
            "open('config.yaml', 'w'))\"",
            "python scripts/01_prepare_data.py --config config.yaml",
            *commands,
        ]
    )
    facts = [
        f"torch {environment['torch']}, NumPy {environment['numpy']}",
        f"device type `{environment['device_type']}`",
        f"dtype `{run['dtype']}`, AMP `{run['amp']}`",
        f"deterministic algorithms {environment['deterministic_algorithms']}, cuDNN deterministic "
        f"{environment['cudnn_deterministic']}, cuDNN benchmark {environment['cudnn_benchmark']}",
        f"{environment['intra_op_threads']} intra-op and {environment['inter_op_threads']} inter-op threads "
        "(`training.threads` pins the first)",
        f"the pipeline's code fingerprint `{provenance['fingerprints']['code']}` and the data fingerprint "
        f"`{provenance['fingerprints']['data']}` (script 01 prepares the data from `data.seed`)",
    ]
    listed = "\n".join(f"- {fact}" for fact in facts)
    libraries = ", ".join(f"{name} {value}" for name, value in sorted(versions.items()) if value is not None)
    traces_clause = (
        "" if meta["training"]["traces"] is None else ", and the TensorBoard traces' events carry wall time 0"
    )
    return (
        "## Reproduce\n\nThe weights are the deterministic result of the recorded config, code and data: "
        "with this pipeline's scripts, in an empty folder holding this repository's `meta.json`, run\n\n"
        + fence(script, "sh")
        + f"\n\non a platform with the same\n\n{listed}\n\n"
        + f"(the libraries recorded: {libraries}).{extended} The checkpoint's weights then have the SHA-256 "
        "listed above, and staging it as this one was (`scripts/04_evaluate.py`, then `scripts/05_stage.py` "
        "with the same flags) gives the same bytes for every file of `MANIFEST.sha256`: nothing staged holds "
        f"a wall-clock time, a host name or a machine path{traces_clause}. Another thread count, device or "
        "library version computes other sums: the weights then "
        "differ in their last bits, and so do the digests."
    )


def _provenance_section(meta: Mapping[str, Any]) -> str:
    provenance, source = meta["provenance"], meta["source_checkpoint"]
    versions = ", ".join(
        f"{name} {value}" for name, value in sorted(provenance["versions"].items()) if value is not None
    )
    rows = [
        ("source checkpoint", f"`{source['folder']}`"),
        *((f"its `{name}`", f"SHA-256 `{digest}`") for name, digest in source["files"].items()),
        ("code fingerprint", f"`{provenance['fingerprints']['code']}`"),
        ("data fingerprint", f"`{provenance['fingerprints']['data']}`"),
        ("libraries", versions),
    ]
    changed = provenance["code_changes"]
    rows += [("code changed since training", _code_change(change)) for change in changed]
    note = (
        " The code that built the model changed after these weights were trained (the rows above): this "
        "repository ships no code, and the weights were checked to fit the model the changed code builds."
        if changed
        else ""
    )
    return (
        "## Provenance\n\n| | |\n| --- | --- |\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n\n"
        "Fingerprints are SHA-256 over the package's Python sources and over the prepared data files." + note
    )


def _code_change(change: Mapping[str, Any]) -> str:
    if change["file"] is None:
        return f"a file of {change['role']} (which one the checkpoint cannot tell)"
    trained, current = (
        f"`{digest}`" if digest else "none" for digest in (change["trained_sha256"], change["current_sha256"])
    )
    return f"`{change['file']}` ({change['role']}): SHA-256 {trained} when trained, {current} when staged"


def build_model_card(
    meta: Mapping[str, Any],
    files: Mapping[str, Mapping[str, Any]],
    *,
    repo_id: str | None = None,
    sample: str | None = None,
    curve_file: str | None = CURVE_FILE,
    signature_section: str | None = None,
    user_sections: str | None = None,
) -> ModelCard:
    """The card for a staged record ``meta`` (the stage's ``meta.json``).

    ``files`` maps each file the card lists to ``{"sha256", "size"}``; ``repo_id`` fills
    the loading snippet (``None``: the card names no repository, so it is right under any
    name); ``sample`` is the task's optional text sample; ``curve_file`` is the embedded
    image (``None`` for none); ``signature_section`` is
    :func:`pipeline.signing.card_section`'s text; ``user_sections`` the Markdown of the
    config's ``card.sections`` file. The card is always UTF-8 text without control
    characters (see :func:`.card_parts.printable`).
    """
    name = meta["config"]["model"]["name"]
    sections = [
        f"# {name}",
        _describe(meta),
        _progress_line(meta),
        *([user_sections.strip()] if user_sections and user_sections.strip() else []),
        load_section(meta, files, repo_id),
        _training_section(meta, curve_file),
        _metrics_section(meta),
    ]
    if sample:
        sections.append(
            "## Sample\n\nOutput of the task's `sample()` with these weights (control characters "
            "written as `\\xNN`):\n\n" + fence(printable(sample), "text")
        )
    if meta["checks"]["nonfinite_tensors"]:
        listed = ", ".join(code(t) for t in meta["checks"]["nonfinite_tensors"])
        sections.append(f"## Warning\n\nThese tensors hold NaN or infinite values: {listed}.")
    if signature_section:
        sections.append(signature_section)
    sections += [
        _proof_section(meta),
        hash_section(files),
        verify_section(),
        _reproduce_section(meta),
        _provenance_section(meta),
    ]
    body = printable("\n\n".join(sections) + "\n")
    content = f"---\n{card_data(meta).to_yaml()}\n---\n\n" + body
    # Parsing it back checks the front matter is valid YAML that the Hub client accepts.
    return ModelCard(content)
