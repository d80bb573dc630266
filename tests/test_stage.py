"""Script 05 stages exactly the last verified checkpoint, or refuses and changes nothing."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from huggingface_hub import ModelCard
from matplotlib.image import imread
from safetensors.torch import load_file, save_file
from test_leaks import SAMPLES

from pipeline.audit import AuditedFile, audit_stage
from pipeline.checkpoint import load_model_weights
from pipeline.checkpoint.meta import entry_of
from pipeline.config import config_from_dict, load_config
from pipeline.data import load_task_data
from pipeline.errors import (
    CheckpointError,
    ConfigError,
    NonFiniteWeights,
    SecretInStage,
    StageAuditError,
    StageError,
)
from pipeline.layout import staged_by_file
from pipeline.run import build_model
from pipeline.stage import StageBuild, build_stage
from pipeline.stage.card import render_curve

from support import REPO, reseal

CONFIG = Path(__file__).resolve().parents[1] / "config.yaml"
STAGED = {
    "modelo.safetensors",
    "meta.json",
    "README.md",
    "training_curve.png",
    "MANIFEST.sha256",
    "config.json",
    "model.safetensors.index.json",
    "runs/events.out.tfevents.pipeline",
}
# The default model's factory module, shipped under code/ with the local modules it imports.
FACTORY_SOURCE = "code/pipeline/tasks/mlp.py"


def staged_files(stage: Path) -> set[str]:
    """Every file of a stage, as a relative path."""
    return {p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file()}


# Built by concatenation so this file itself never holds a token-shaped string.
FAKE_TOKEN = "hf_" + "Zq7" * 12


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def leftovers(run) -> list[str]:
    """Hidden temporary or set-aside stages next to hub_stage/ (not its lock, nor the record of
    the command that built it)."""
    kept = {".hub_stage.lock", staged_by_file("hub_stage")}
    return sorted(
        p.name for p in run.root.iterdir() if p.name.startswith(".hub_stage") and p.name not in kept
    )


def staged_meta(run) -> dict:
    return json.loads((run.stage / "meta.json").read_text())


def in_process_config(run, **overrides):
    return load_config(CONFIG, {**run.overrides, **overrides})


def poison_weights(checkpoint: Path, count: int = 1) -> list[str]:
    """Put a NaN in the first ``count`` tensors and record the new file's hash, as a real save would."""
    path = checkpoint / "modelo.safetensors"
    tensors = load_file(path)
    names = sorted(tensors)[:count]
    for name in names:
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(path), metadata={"format": "pt"})
    entry = entry_of(path.read_bytes())
    reseal(checkpoint, lambda meta: meta["files"].update({"modelo.safetensors": entry}))
    return names


# -- the stage --------------------------------------------------------------------------


def test_stage_verifies_with_sha256sum_c(staged_run):
    result = subprocess.run(
        ["sha256sum", "--check", "--strict", "MANIFEST.sha256"],
        cwd=staged_run.stage,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    files = staged_files(staged_run.stage)
    assert sorted(result.stdout.splitlines()) == sorted(f"{name}: OK" for name in files - {"MANIFEST.sha256"})
    assert STAGED <= files and FACTORY_SOURCE in files
    assert all(name.startswith("code/") for name in files - STAGED)


def test_stage_holds_the_committed_checkpoint_weights_byte_for_byte(staged_run):
    checkpoint = staged_run.checkpoint
    assert (staged_run.stage / "modelo.safetensors").read_bytes() == (
        checkpoint / "modelo.safetensors"
    ).read_bytes()
    source = json.loads((checkpoint / "meta.json").read_text())
    meta = staged_meta(staged_run)
    assert meta["step"] == source["step"] == 10
    entry = source["files"]["modelo.safetensors"]  # the stage keeps the whole-file digest, not the chunks
    assert meta["files"]["modelo.safetensors"] == {"sha256": entry["sha256"], "size": entry["size"]}
    assert meta["source_checkpoint"] == {
        "folder": "step-00000010",
        "schema": source["schema"],
        "files": {name: entry["sha256"] for name, entry in source["files"].items()},
    }
    assert meta["provenance"]["fingerprints"] == source["fingerprints"]
    assert meta["provenance"]["versions"] == source["versions"]
    assert meta["metrics"]["values"] == json.loads(staged_run.metrics.read_text())["metrics"]


def test_staged_record_carries_no_optimizer_or_rng_internals(staged_run):
    meta = staged_meta(staged_run)
    assert set(meta) == {
        "schema",
        "step",
        "config",
        "model",
        "export",
        "repo_id",
        "training",
        "metrics",
        "provenance",
        "source_checkpoint",
        "checks",
        "files",
        "proof",
        "selected_as_best",
    }
    assert meta["selected_as_best"] is None  # staged as the newest, not chosen as the best
    text = (staged_run.stage / "meta.json").read_text()
    for internal in ("training_state", "exp_avg", "torch_cpu", "numpy_generator", "permutation"):
        assert internal not in text
    assert meta["files"]["training_curve.png"]["sha256"] == sha256(staged_run.stage / "training_curve.png")
    # What it tells of the training: the checkpoint's last history point (the schedule halved the
    # learning rate on the way, so its first and last values tell apart).
    history = load_file(staged_run.checkpoint / "estado_treino.safetensors")
    loss, lr = history["history/loss"].tolist(), history["history/lr"].tolist()
    assert lr[0] != lr[-1] and meta["step"] == int(staged_run.checkpoint.name.removeprefix("step-"))
    assert (
        meta["training"]["final_loss"],
        meta["training"]["final_lr"],
        meta["training"]["history_points"],
    ) == (
        loss[-1],
        lr[-1],
        len(loss),
    )


def test_model_card_parses_and_names_step_sha256_metrics_and_curve(staged_run):
    card = ModelCard.load(staged_run.stage / "README.md")
    config = load_config(CONFIG)
    assert card.data.library_name == "pytorch"
    assert card.data.license == config.card.license
    assert card.data.tags == config.card.tags
    metrics = json.loads(staged_run.metrics.read_text())["metrics"]
    assert {r.metric_type: r.metric_value for r in card.data.eval_results} == metrics
    modelo_sha = sha256(staged_run.stage / "modelo.safetensors")
    assert "step **10**, the last step of its run" in card.text and modelo_sha in card.text
    for name in ("meta.json", "training_curve.png"):
        assert sha256(staged_run.stage / name) in card.text
    assert "](training_curve.png)" in card.text
    # Staged without --repo-id: the card names no repository, so it is right under any name.
    assert "model = load_model(folder)" in card.text and "hf download <its id> --local-dir model" in card.text
    assert "snapshot_download" not in card.text and "<namespace>" not in card.text
    assert "sha256sum -c MANIFEST.sha256" in card.text
    height, width, _ = imread(staged_run.stage / "training_curve.png").shape
    assert height > 100 and width > 100


def test_a_card_staged_without_repo_id_names_no_repo_and_loads_from_any_download_folder(staged_run, tmp_path):
    """Whatever name 06 publishes it under, the card is right: it loads from the folder the
    reader downloaded the repo into, without this project, in one line after the hash check."""
    from support import first_python_block, run_as_hub_user

    card = (staged_run.stage / "README.md").read_text(encoding="utf-8")
    assert "repo_id" not in first_python_block(card)
    download = (
        f"import shutil\nshutil.copytree({str(staged_run.stage)!r}, 'model')\n"  # what `hf download` leaves
    )
    check = (
        "\nimport torch\nfrom safetensors.torch import load_file\n"
        "assert all(torch.equal(t, model.state_dict()[n]) for n, t in load_file('model/modelo.safetensors').items())\n"
        "print('LOADED', type(model).__name__)\n"
    )
    result = run_as_hub_user(
        download + first_python_block(card) + check, tmp_path / "reader", "http://127.0.0.1:9", "x"
    )
    assert result.returncode == 0 and "LOADED MLP" in result.stdout, result.stdout + result.stderr


def test_staged_weights_reproduce_the_recorded_metric_exactly(staged_run):
    meta = staged_meta(staged_run)
    config = config_from_dict(
        {**meta["config"], "data": {**meta["config"]["data"], "dir": str(staged_run.data_dir)}}
    )
    model = build_model(config)
    load_model_weights(model, load_file(staged_run.stage / "modelo.safetensors"))
    metrics = load_task_data(config).evaluate(model, torch.device("cpu"))
    assert metrics == json.loads(staged_run.metrics.read_text())["metrics"]


def test_05s_table_says_weights_were_copied_byte_for_byte_and_resharded_ones_rewritten(staged_run, run_copy):
    run = run_copy(staged_run)
    entry = json.loads((run.checkpoint / "meta.json").read_text())["files"]["modelo.safetensors"]
    config = in_process_config(run)

    def staged_weights(result) -> list[AuditedFile]:
        # The table's staged rows; the source checkpoint's rows are named by their full path.
        return [row for row in result.report if row.name.endswith(".safetensors") and "/" not in row.name]

    copied = build_stage(config, stage_dir=run.root / "copied", with_metrics=False)
    assert staged_weights(copied) == [
        AuditedFile(
            "modelo.safetensors",
            entry["size"],
            entry["sha256"],
            "checkpoint meta.json, re-hash after copy, MANIFEST.sha256",
        )
    ]
    resharded = build_stage(
        config, stage_dir=run.root / "resharded", with_metrics=False, max_shard_size="500"
    )
    shards = staged_weights(resharded)
    assert [(row.name, row.verified_against) for row in shards] == [
        (
            f"modelo-0000{i}-of-00005.safetensors",
            "checkpoint tensors, re-hashed from disk after writing, MANIFEST.sha256",
        )
        for i in range(1, 6)
    ]
    assert entry["sha256"] not in {row.sha256 for row in shards}


@pytest.mark.parametrize("before", ["a-placeholder-folder", "a-killed-05"])
def test_restaging_gives_byte_identical_files_and_no_sibling_of_ours(staged_run, run_copy, before):
    """A killed 05 left its full copy .tmp-hub_stage-<hex> and the stage moved aside as
    .old-hub_stage-<hex>: the rerun puts it back, removes the copy, and stages anew."""
    run = run_copy(staged_run)
    siblings = sorted(p.name for p in run.root.iterdir())
    if before == "a-placeholder-folder":
        shutil.rmtree(run.stage)
        run.stage.mkdir()
        (run.stage / ".gitkeep").touch()
    else:
        shutil.copytree(run.stage, run.root / ".tmp-hub_stage-0badf00d")
        run.stage.rename(run.root / ".old-hub_stage-1234abcd")
    build_stage(in_process_config(run), stage_dir=run.stage, metrics=run.metrics)
    assert snapshot(run.stage) == snapshot(staged_run.stage)
    assert leftovers(run) == [] and sorted(p.name for p in run.root.iterdir()) == siblings


def test_without_matplotlib_the_stage_has_no_curve_and_the_card_says_so(staged_run, run_copy, monkeypatch):
    run = run_copy(staged_run)
    for name in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)  # any matplotlib import now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    build_stage(in_process_config(run), stage_dir=run.stage, metrics=run.metrics)
    assert not (run.stage / "training_curve.png").exists()
    card = (run.stage / "README.md").read_text()
    assert "No training curve: matplotlib was not installed" in card and "training_curve.png" not in card
    files = staged_files(run.stage)
    assert set(audit_stage(run.stage)) == files and STAGED - {"training_curve.png"} <= files
    assert leftovers(run) == []


def test_a_loss_curve_with_no_positive_value_is_drawn_flat_on_a_linear_axis():
    """A log axis has no place for a loss of 0 or below: on one, the curve would vanish."""
    png = render_curve({"step": [1, 2, 3], "loss": [0.0, 0.0, 0.0], "lr": [0.1, 0.1, 0.05]})
    image = imread(io.BytesIO(png))[..., :3]
    loss_line = np.all(np.abs(image - np.array([0x1F, 0x77, 0xB4]) / 255) < 0.02, axis=-1)  # tab:blue
    rows, columns = np.nonzero(loss_line)
    # One flat line across the loss plot (the left half), from step 1 to step 3.
    assert image.shape == (340, 900, 3) and columns.max() < 450 and columns.max() - columns.min() > 300
    assert rows.max() - rows.min() < 12


def test_build_stage_takes_a_stagebuild_or_its_fields_as_keywords_not_both(tmp_path):
    build = StageBuild(checkpoint=tmp_path / "none", stage_dir=tmp_path / "stage")
    with pytest.raises(TypeError) as caught:
        build_stage(load_config(CONFIG), build, stage_dir=tmp_path / "other")
    assert str(caught.value) == "build_stage takes a StageBuild or its fields as keywords, not both"
    assert list(tmp_path.iterdir()) == []


def test_reevaluating_the_same_weights_then_restaging_changes_no_byte(staged_run, run_copy):
    """So a rerun of 04 → 05 → 06 on unchanged weights publishes nothing new."""
    run = run_copy(staged_run)
    run.metrics.unlink()
    run.ok("04_evaluate.py")
    build_stage(in_process_config(run), stage_dir=run.stage, metrics=run.metrics)
    assert snapshot(run.stage) == snapshot(staged_run.stage)


# -- refusals ---------------------------------------------------------------------------


def flip_a_weight_byte(run):
    path = run.checkpoint / "modelo.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    return [], "modelo.safetensors SHA-256 differs"


def token_in_the_card(run):
    # The description is repeated in three staged files: each is named once.
    return (
        ["--set", f"card.description=Ask {FAKE_TOKEN} for access"],
        "error: README.md, config.json and meta.json hold an hf_ token; nothing was staged.",
    )


@pytest.mark.parametrize("damage", [flip_a_weight_byte, token_in_the_card])
def test_05_exits_2_with_one_line_and_leaves_the_previous_stage_untouched(staged_run, run_copy, damage):
    run = run_copy(staged_run)
    before = snapshot(run.stage)
    args, expected = damage(run)
    result = run.script("05_stage.py", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert expected in result.stderr
    assert FAKE_TOKEN not in result.stdout + result.stderr
    assert snapshot(run.stage) == before
    assert leftovers(run) == []


def test_nan_weights_are_refused_unless_allowed_and_then_the_card_warns(staged_run, run_copy, tmp_path):
    run = run_copy(staged_run)
    before = snapshot(run.stage)
    [name] = poison_weights(run.checkpoint)
    with pytest.raises(NonFiniteWeights, match=f"tensor {name} holds NaN"):
        build_stage(in_process_config(run), stage_dir=run.stage, with_metrics=False)
    assert snapshot(run.stage) == before
    assert leftovers(run) == []
    result = build_stage(
        in_process_config(run), stage_dir=tmp_path / "stage", with_metrics=False, allow_nonfinite=True
    )
    assert result.nonfinite == [name]
    assert "NaN or infinite" in (tmp_path / "stage" / "README.md").read_text()


def test_a_refusal_of_several_non_finite_tensors_names_the_first_and_counts_the_others(staged_run, run_copy):
    run = run_copy(staged_run)
    first, second = poison_weights(run.checkpoint, count=2)
    with pytest.raises(NonFiniteWeights) as refused:
        build_stage(in_process_config(run), stage_dir=run.stage, with_metrics=False)
    assert str(refused.value) in (
        f"{run.checkpoint / 'modelo.safetensors'}: tensor {named} (and 1 more) holds NaN or infinite values; "
        "refusing to stage it (pass --allow-nonfinite to stage it anyway)"
        for named in (first, second)
    ), str(refused.value)


def test_value_of_hf_token_is_refused_without_being_shown(staged_run, run_copy, monkeypatch):
    run = run_copy(staged_run)
    secret = "not-an-hf-shaped-secret-1234"
    monkeypatch.setenv("HF_TOKEN", secret)
    before = snapshot(run.stage)
    with pytest.raises(SecretInStage, match="the value of HF_TOKEN") as refused:
        build_stage(
            in_process_config(run, **{"card.description": f"internal key {secret}"}),
            stage_dir=run.stage,
            metrics=run.metrics,
        )
    assert secret not in str(refused.value)
    assert snapshot(run.stage) == before


# Secrets planted where 05 takes the stage's text from, each in a form the scan must see through
# (the full matrix of kinds and encodings is in test_leaks.py; this is 05 itself).
def stripe_in_the_description(run, monkeypatch):
    return {"card.description": f"Billing: {SAMPLES['stripe-key'][1]}"}, (
        "README.md, config.json and meta.json hold a Stripe secret key; nothing was staged."
    )


def url_encoded_token_in_the_card_sections(run, monkeypatch):
    (run.root / "card.md").write_text(f"## Access\n\nhttps://example.com/?t=hf%5F{FAKE_TOKEN[3:]}\n")
    monkeypatch.chdir(run.root)
    return {"card.sections": "card.md"}, "README.md holds an hf_ token (URL-encoded); nothing was staged."


def escaped_token_in_a_hub_files_tokenizer(run, monkeypatch):
    import pipeline.tasks.regression as factory_module

    escaped = "\\u0068" + FAKE_TOKEN[1:]
    tokenizer = '{"added_tokens":[{"id":0,"content":"' + escaped + '"}],"model":{"vocab":{"a":0}}}'
    monkeypatch.setattr(
        factory_module, "hub_files", lambda config: {"tokenizer.json": tokenizer.encode()}, raising=False
    )
    return {}, "tokenizer.json holds an hf_ token (escaped); nothing was staged."


def github_token_in_the_weights_header(run, monkeypatch):
    path = run.checkpoint / "modelo.safetensors"
    save_file(load_file(path), str(path), metadata={"format": "pt", "pushed_by": SAMPLES["github-token"][1]})
    entry = entry_of(path.read_bytes())
    reseal(run.checkpoint, lambda meta: meta["files"].update({"modelo.safetensors": entry}))
    return {}, "modelo.safetensors holds a GitHub token; nothing was staged."


@pytest.mark.parametrize(
    "plant",
    [
        stripe_in_the_description,
        url_encoded_token_in_the_card_sections,
        escaped_token_in_a_hub_files_tokenizer,
        github_token_in_the_weights_header,
    ],
)
def test_05_refuses_a_secret_in_the_card_its_sections_a_hub_file_or_a_weights_header(
    staged_run, run_copy, monkeypatch, plant
):
    run = run_copy(staged_run)
    before = snapshot(run.stage)
    overrides, expected = plant(run, monkeypatch)
    with pytest.raises(SecretInStage) as refused:
        build_stage(
            in_process_config(run, **overrides), stage_dir=run.stage, metrics=run.metrics, with_metrics=False
        )
    assert str(refused.value).startswith(expected), str(refused.value)
    assert FAKE_TOKEN[3:] not in str(refused.value)
    assert snapshot(run.stage) == before
    assert leftovers(run) == []


@pytest.mark.parametrize("other", [{"step": 5, "modelo_sha256": "0" * 64}, {"modelo_sha256": "0" * 64}])
def test_metrics_of_other_weights_are_refused(evaluated_run, run_copy, other):
    run = run_copy(evaluated_run)
    record = json.loads(run.metrics.read_text())
    record.update(other)  # another step, or the same step of other weights
    run.metrics.write_text(json.dumps(record))
    with pytest.raises(
        StageError, match=r"rerun \S+ scripts/04_evaluate\.py .*--checkpoint \S+step-00000010"
    ):
        build_stage(in_process_config(run), stage_dir=run.stage, metrics=run.metrics)
    assert not run.stage.exists()


def test_metrics_of_the_same_weights_on_other_data_are_refused(evaluated_run, run_copy):
    """A record of these very weights, computed on other held-out data (another data.dir given to
    04), is not a claim about the data the model was trained with: 05 sends the user back to 04."""
    run = run_copy(evaluated_run)
    record = json.loads(run.metrics.read_text())
    assert record["fingerprints"]["data"], record["fingerprints"]
    record["fingerprints"]["data"] = "0" * 64
    run.metrics.write_text(json.dumps(record))
    with pytest.raises(StageError) as refused:
        build_stage(in_process_config(run), stage_dir=run.stage, metrics=run.metrics)
    line = str(refused.value)
    prefix = f"{run.metrics} was computed on other data than step-00000010 was trained on: rerun "
    assert line.startswith(prefix) and "\n" not in line, line
    assert line.endswith(f" scripts/04_evaluate.py --set data.dir={run.data_dir} --set checkpoint.dir="
                         f"{run.checkpoint_dir} --checkpoint {run.checkpoint} --output {run.metrics}"), line  # fmt: skip
    assert not run.stage.exists()


def _drop_the_first_source(sources):
    sources.pop("pipeline/__init__.py")
    return "pipeline/__init__.py (the model's code) was not part of the code 04 evaluated with"


def _add_a_source(sources):
    sources["pipeline/tasks/extra.py"] = "1" * 64
    return f"pipeline/tasks/extra.py was part of the code 04 evaluated with and no longer is (SHA-256 {'1' * 64})"


def _change_a_source(sources):
    now, sources["pipeline/tasks/mlp.py"] = sources["pipeline/tasks/mlp.py"], "2" * 64
    return (
        f"pipeline/tasks/mlp.py (the model's code) differs from the file 04 evaluated with (SHA-256 {'2' * 64} "
        f"then, {now} now)"
    )


@pytest.mark.parametrize("edit", [_drop_the_first_source, _add_a_source, _change_a_source])
def test_metrics_computed_under_other_code_are_refused_naming_the_file_in_one_line(
    evaluated_run, run_copy, edit
):
    run = run_copy(evaluated_run)
    record = json.loads(run.metrics.read_text())
    says = edit(record["fingerprints"]["sources"])
    run.metrics.write_text(json.dumps(record))
    with pytest.raises(StageError) as refused:
        build_stage(in_process_config(run), stage_dir=run.stage, metrics=run.metrics)
    line = str(refused.value)
    assert line.startswith(
        f"{run.metrics} was computed under other code than this stage ships: {says}: rerun "
    ), line
    assert line.endswith(f" scripts/04_evaluate.py --set data.dir={run.data_dir} --set checkpoint.dir="
                         f"{run.checkpoint_dir} --checkpoint {run.checkpoint} --output {run.metrics}"), line  # fmt: skip
    assert not run.stage.exists()


def test_latest_is_the_newest_committed_checkpoint_never_a_temporary_folder(evaluated_run, run_copy):
    run = run_copy(evaluated_run)
    # A newer, complete-looking save that was never renamed into place.
    temporary = run.checkpoint_dir / ".tmp-step-00000099-0badc0de"
    shutil.copytree(run.checkpoint, temporary)
    reseal(temporary, lambda meta: meta.update(step=99))
    poison_weights(temporary)
    result = build_stage(in_process_config(run), stage_dir=run.stage, metrics=run.metrics)
    assert result.step == 10 and result.source.name == "step-00000010"
    assert (run.stage / "modelo.safetensors").read_bytes() == (
        run.checkpoint / "modelo.safetensors"
    ).read_bytes()
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        build_stage(
            in_process_config(run), checkpoint=temporary, stage_dir=run.root / "other", with_metrics=False
        )


def test_a_folder_not_built_by_05_is_never_replaced(evaluated_run, run_copy):
    run = run_copy(evaluated_run)
    run.stage.mkdir()
    (run.stage / "notes.txt").write_text("mine")
    with pytest.raises(StageError, match="refusing to replace"):
        build_stage(in_process_config(run), stage_dir=run.stage, metrics=run.metrics)
    assert snapshot(run.stage) == {"notes.txt": b"mine"}


# -- audit ------------------------------------------------------------------------------


def test_audit_returns_the_verified_sha256_and_size_of_every_file_to_upload(staged_run):
    audited = audit_stage(staged_run.stage)
    assert set(audited) == staged_files(staged_run.stage)
    for name, entry in audited.items():
        path = staged_run.stage / name
        assert (entry.name, entry.size, entry.sha256) == (name, path.stat().st_size, sha256(path))


def add_file(stage):
    (stage / "notes.txt").write_text("extra")
    return "notes.txt"


def change_card(stage):
    with open(stage / "README.md", "ab") as handle:
        handle.write(b"\n")
    return "README.md"


def remove_curve(stage):
    (stage / "training_curve.png").unlink()
    return "training_curve.png"


def add_link(stage):
    os.symlink("modelo.safetensors", stage / "weights.bin")
    return "weights.bin"


def add_folder(stage):
    (stage / "extra").mkdir()
    return "extra"


def disagree_with_meta(stage):
    """meta.json's own files table is edited and the manifest updated to match it."""
    meta = json.loads((stage / "meta.json").read_text())
    meta["files"]["modelo.safetensors"]["sha256"] = "0" * 64
    (stage / "meta.json").write_text(json.dumps(meta))
    lines = [
        line
        for line in (stage / "MANIFEST.sha256").read_text().splitlines()
        if not line.endswith("meta.json")
    ]
    lines.append(f"{sha256(stage / 'meta.json')}  meta.json")
    (stage / "MANIFEST.sha256").write_text("\n".join(lines) + "\n")
    return "meta.json records a different SHA-256"


def binary_mode_manifest_line(stage):
    text = (stage / "MANIFEST.sha256").read_text()
    (stage / "MANIFEST.sha256").write_text(text.replace("  README.md", " *README.md"))
    return "line"


@pytest.mark.parametrize(
    "tamper",
    [
        add_file,
        change_card,
        remove_curve,
        add_link,
        add_folder,
        disagree_with_meta,
        binary_mode_manifest_line,
    ],
)
def test_audit_rejects_a_stage_changed_after_it_was_built(staged_run, tmp_path, tamper):
    stage = tmp_path / "hub_stage"
    shutil.copytree(staged_run.stage, stage)
    named = tamper(stage)
    with pytest.raises(StageAuditError, match=named):
        audit_stage(stage)


def _same_size_edit(path: Path) -> None:
    """Change one byte, keeping the size (and, for meta.json, valid JSON: a metric's digit)."""
    data = bytearray(path.read_bytes())
    if path.name == "meta.json":
        at = data.index(b'"mse": ') + len(b'"mse": ') + 3  # a digit after "0.9"
        data[at] = ord("1") if data[at] != ord("1") else ord("2")
        json.loads(bytes(data))
    elif path.name == "MANIFEST.sha256":
        data[0] = ord("a") if data[0] != ord("a") else ord("b")
    else:
        data[-1] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", sorted(STAGED))
def test_audit_refuses_a_same_size_edit_of_each_staged_file(staged_run, tmp_path, name):
    stage = tmp_path / "hub_stage"
    shutil.copytree(staged_run.stage, stage)
    named = (
        sorted(STAGED - {"MANIFEST.sha256"})[0] if name == "MANIFEST.sha256" else name
    )  # its first line's file
    _same_size_edit(stage / name)
    assert (stage / name).stat().st_size == (staged_run.stage / name).stat().st_size
    with pytest.raises(StageAuditError, match=named):
        audit_stage(stage)


def test_a_proof_report_of_another_schema_or_unfinished_is_refused_in_one_line(tmp_path):
    from pipeline.errors import ProofMismatch
    from pipeline.proof import REPORT_SCHEMA
    from pipeline.stage.proof_report import read_proof

    report = tmp_path / "verification.json"
    for written in (
        {"schema": "pipeline.resume-proof/0", "completed": True},
        {"schema": REPORT_SCHEMA, "completed": False},
        [REPORT_SCHEMA],
    ):
        report.write_text(json.dumps(written))
        with pytest.raises(ProofMismatch) as refused:
            read_proof(tmp_path, {}, tmp_path)
        assert f"{report} is not a completed pipeline.resume-proof/1 report" in str(refused.value)
        assert "03_verify_resume.py finish?" in str(refused.value)  # names the step to run
    # A FIFO or a folder in its place is one line, not a hang or a traceback.
    report.unlink()
    os.mkfifo(report)
    with pytest.raises(ProofMismatch, match="is a FIFO, not a regular file: not a proof report"):
        read_proof(tmp_path, {}, tmp_path)
    report.unlink()
    report.mkdir()
    with pytest.raises(ProofMismatch, match="is a folder, not a regular file: not a proof report"):
        read_proof(tmp_path, {}, tmp_path)
    report.rmdir()
    # What 03 writes passes this check and is held to the next one: the sources it proves.
    report.write_text(json.dumps({"schema": REPORT_SCHEMA, "completed": True}))
    with pytest.raises(ProofMismatch, match="lacks the sources a proof records"):
        read_proof(tmp_path, {}, tmp_path)


@pytest.mark.parametrize(
    ("files", "refusal"),
    [
        ({"tok.json\n": b"x"}, " returned the file name 'tok.json\\n': use a plain name"),
        ({"README.md": b"x"}, " returned the file name 'README.md': use a plain name"),
        ({"../x": b"x"}, " returned the file name '../x': use a plain name"),
        ({".hidden": b"x"}, " returned the file name '.hidden': use a plain name"),
        ({3: b"x"}, " returned the file name 3: use a plain name"),
        ({"t.json": "x"}, ": t.json must be bytes, got str"),
        ([("t.json", b"x")], " must return a dict of file name to bytes, got list"),
    ],
)
def test_a_hub_files_hook_handing_over_no_plain_file_is_refused_in_one_line(
    tmp_path, monkeypatch, files, refusal
):
    """The model module's ``hub_files(config)`` adds files beside the weights: each a plain
    name (no folder, no dot file, no final line break) that no stage file uses, bytes as value."""
    from pipeline.stage.hf_export import hub_files

    (tmp_path / "hooked.py").write_text(
        "FILES = {}\n\n\ndef build_model(config):\n    raise AssertionError\n\n\ndef hub_files(config):\n    return FILES\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import hooked

    config = load_config(REPO / "config.yaml", {"model.factory": "hooked:build_model"})
    monkeypatch.setattr(hooked, "FILES", {"tokenizer.json": b"{}", "vocab.txt": b"a\n"})
    assert hub_files(config, {"README.md", "meta.json"}) == {"tokenizer.json": b"{}", "vocab.txt": b"a\n"}
    monkeypatch.setattr(hooked, "FILES", files)
    with pytest.raises(ConfigError) as refused:
        hub_files(config, {"README.md", "meta.json"})
    reserved = (
        " that is not one of the stage's own files (README.md, meta.json)" if "plain name" in refusal else ""
    )
    assert str(refused.value) == f"hooked.hub_files(){refusal}{reserved}"
