"""What a stage claims is what was computed: metrics bound to the code that computed them, the
recipe as trained on the card, and the best mark checked against the evaluations the marked
checkpoint recorded, kept on a committed step when a resume changes its rule."""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

import pytest
from oprecorder import Recorder
from safetensors.torch import load_file

from pipeline.checkpoint import LoadMode, best_record, load_checkpoint, read_best
from pipeline.errors import CheckpointError
from pipeline.hashing import sha256_file
from pipeline.layout import STATE_FILE
from pipeline.stage.recipe import recipe_rows

from support import REPO, one_line_error, run_python, script_env

CONFIG = REPO / "config.yaml"


def _scripts(folder: Path, *args: str, env: dict[str, str] | None = None):
    """``script(name, *extra)``: ``scripts/<name> --config config.yaml *args *extra`` run in ``folder``."""

    def script(name: str, *extra: str):
        return run_python(
            [REPO / "scripts" / name, "--config", CONFIG, *args, *extra], cwd=folder, env=env or script_env()
        )

    return script


def _evaluations(checkpoint: Path) -> dict[str, list]:
    tensors = load_file(checkpoint / "estado_treino.safetensors")
    return {
        k.removeprefix("evaluation/"): t.tolist() for k, t in tensors.items() if k.startswith("evaluation/")
    }


# -- metrics bound to the code that computed them -------------------------------------------------


def test_04_refuses_code_changed_since_training_and_05_refuses_metrics_of_another_pipeline(
    data_dir, tmp_path
):
    """A model that ships its code: its module edited after training (Tanh -> ReLU) or its data
    module edited, 04 refuses naming the file, as 05 does; restored, 04 records every counted
    file. Metrics that another version of this package computed (a copy of the tree with one
    file changed) are refused by 05, naming the fix."""
    model = tmp_path / "my_mlp.py"
    source = (
        (REPO / "pipeline" / "tasks" / "mlp.py").read_text().replace("from ..params", "from pipeline.params")
    )
    model.write_text(source)
    data = tmp_path / "my_data.py"
    data.write_text("from pipeline.tasks.regression import build_data, prepare_data  # noqa\n")
    script = _scripts(tmp_path, "--set", f"data.dir={data_dir}", "--set", "model.factory=my_mlp:build_model",
                      "--set", "data.factory=my_data:build_data", "--set", "training.max_steps=4")  # fmt: skip
    assert script("02_train.py", "--quiet").returncode == 0
    trained = sha256_file(model)
    model.write_text(source.replace("torch.nn.Tanh()", "torch.nn.ReLU()", 1))
    edited = sha256_file(model)
    assert one_line_error(script("04_evaluate.py")) == (
        f"error: my_mlp.py (the model's code) changed since step 4 was trained (SHA-256 {trained} then, {edited} "
        "now): the metrics would be computed with other code than the code that built these weights (and that 05 "
        "ships): restore it (git log -p -- my_mlp.py shows its earlier versions), or evaluate a checkpoint trained "
        "with this code"
    )
    assert not (tmp_path / "metrics.json").exists()
    assert "my_mlp.py (the model's code) changed since step 4" in one_line_error(script("05_stage.py"))
    model.write_text(source)
    data.write_text(data.read_text() + "# an edit\n")
    assert "my_data.py (the data factory) changed since step 4" in one_line_error(script("04_evaluate.py"))
    data.write_text(data.read_text().replace("# an edit\n", ""))
    assert script("04_evaluate.py").returncode == 0
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["fingerprints"]["sources"]["my_mlp.py"] == trained
    assert record["fingerprints"]["sources"]["my_data.py"] == sha256_file(data)
    assert record["config"]["model"]["factory"] == "my_mlp:build_model"
    # 04 run by another version of the pipeline: the same files counted, another package.
    tree = tmp_path / "other-version"
    shutil.copytree(REPO / "pipeline", tree / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    card = tree / "pipeline" / "stage" / "card.py"
    card.write_text(card.read_text() + "# another version\n")
    other = script_env(PYTHONPATH=os.pathsep.join([str(tree), str(REPO / "tests" / "helpers")]))
    assert _scripts(tmp_path, "--set", f"data.dir={data_dir}", env=other)("04_evaluate.py").returncode == 0
    line = one_line_error(script("05_stage.py"))
    assert line.startswith("error: metrics.json was computed by another version of this pipeline (code "
                           "fingerprint ") and "now): rerun " in line and line.endswith("04_evaluate.py --config "
                           f"{CONFIG} --set data.dir={data_dir} --set model.factory=my_mlp:build_model --set "
                           "data.factory=my_data:build_data --set training.max_steps=4 --checkpoint "
                           "estados_local/step-00000004"), line  # fmt: skip
    assert not (tmp_path / "hub_stage").exists()
    assert script("04_evaluate.py").returncode == 0
    staged = script("05_stage.py")
    assert staged.returncode == 0, staged.stderr
    metrics = json.loads((tmp_path / "hub_stage" / "meta.json").read_text())["metrics"]["values"]
    assert metrics == json.loads((tmp_path / "metrics.json").read_text())["metrics"]


# -- the recipe as trained on the card ---------------------------------------------------------


RECIPE = ["--set", "training.grad_accum_steps=2", "--set", "training.grad_clip=0.5", "--set", "training.dtype=float32",
          "--set", "training.amp=bf16", "--set", "training.eval_every=3", "--set", "checkpoint.best_metric=mse",
          "--set", "checkpoint.best_mode=max", "--set", "checkpoint.keep_last=1"]  # fmt: skip


def test_the_card_states_the_recipe_as_trained_and_why_a_best_stage_was_chosen(data_dir, tmp_path):
    script = _scripts(tmp_path, "--set", f"data.dir={data_dir}", *RECIPE)
    assert script("02_train.py", "--quiet").returncode == 0
    marked = read_best(tmp_path / "estados_local")
    for name in ("04_evaluate.py", "05_stage.py"):
        ran = script(name, "--checkpoint", "best")
        assert ran.returncode == 0, ran.stderr
    step = marked["step"]
    checkpoint = tmp_path / "estados_local" / f"step-{step:08d}"
    evaluations = _evaluations(checkpoint)
    value = evaluations["mse"][evaluations["step"].index(step)]  # the checkpoint's own record
    staged = json.loads((tmp_path / "hub_stage" / "meta.json").read_text())
    assert staged["selected_as_best"] == {"metric": "mse", "mode": "max", "value": value}
    card = (tmp_path / "hub_stage" / "README.md").read_text()
    assert (
        f"This is step **{step}**, selected as the best by `mse` (max) = {value:.6g} at step {step} of 10; "
        in card
    )
    table = card.split("## Training\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    history = load_file(checkpoint / "estado_treino.safetensors")["history/loss"].tolist()
    assert table == [
        "| | |",
        "| --- | --- |",
        f"| steps | {step} |",
        f"| final training loss | {history[-1]:.6g} |",
        "| effective batch | 8 rows per optimizer step (2 micro-batches of 4, their gradients accumulated) |",
        "| gradient clipping | total L2 norm clipped to 0.5 |",
        "| precision | float32 parameters, autocast to bfloat16 |",
        "| optimizer | `pipeline.factories:adam`, lr 0.01, weight decay 0.0, betas [0.9, 0.999], eps 1e-08 |",
        "| schedule | `pipeline.factories:step_lr` gamma 0.5, step_size 4, stepped once per optimizer step |",
        "| evaluation | every 3 optimizer steps and at step 10; the best by `mse` (max) kept as `--checkpoint best` |",
        "| seed | 0 |",
        "| launch | one process on cpu |",
        "| parameters | 353 |",
    ]
    # Under torchrun each micro-batch is split over the processes (unevenly when it must be);
    # early stopping, when a record has it, is one more row.
    staged["training"]["launch"]["world_size"] = 3
    staged["config"]["data"]["batch_size"] = 16
    staged["config"]["training"].update(early_stopping_patience=4, early_stopping_threshold=0.01)
    rows = dict(recipe_rows(staged))
    assert rows["effective batch"] == (
        "32 rows per optimizer step (2 micro-batches of 16, their gradients accumulated); each micro-batch split "
        "over 3 processes, 5 or 6 rows each"
    )
    assert (
        rows["early stopping"]
        == "after 4 evaluations without an improvement of `mse` (max) by more than 0.01"
    )
    staged["training"]["launch"]["world_size"] = 2
    assert dict(recipe_rows(staged))["effective batch"].endswith("split over 2 processes, 8 rows each")
    # A run that evaluated nothing says so; fp16 AMP is named with its GradScaler.
    staged["config"]["training"].update(eval_every=0, amp="fp16")
    rows = dict(recipe_rows(staged))
    assert rows["evaluation"] == "none during training"
    assert rows["precision"] == "float32 parameters, autocast to float16, losses scaled by a GradScaler"


# -- the best mark, checked wherever it is read ------------------------------------------------


@pytest.fixture(scope="module")
def marked_run(data_dir, tmp_path_factory) -> Path:
    """A run whose best (mse, max: the first evaluation, mse falls) is kept beside the last."""
    folder = tmp_path_factory.mktemp("marked")
    script = _scripts(folder, "--set", f"data.dir={data_dir}", "--set", "training.eval_every=3",
                      "--set", "checkpoint.best_metric=mse", "--set", "checkpoint.best_mode=max")  # fmt: skip
    ran = script("02_train.py", "--quiet")
    assert ran.returncode == 0, ran.stderr
    assert sorted(p.name for p in (folder / "estados_local").glob("step-*")) == [
        "step-00000003",
        "step-00000010",
    ]
    return folder


def _moved(marked_run: Path, tmp_path: Path, **edit) -> Path:
    folder = tmp_path / "run"
    shutil.copytree(marked_run, folder)
    mark = json.loads((folder / "estados_local" / "BEST.json").read_text())
    (folder / "estados_local" / "BEST.json").write_text(json.dumps({**mark, **edit}))
    return folder


def test_a_mark_moved_by_hand_is_refused_by_04_05_and_load_checkpoint(marked_run, data_dir, tmp_path):
    folder = _moved(marked_run, tmp_path, step=10)  # another committed step, the value unchanged
    value = read_best(marked_run / "estados_local")["value"]
    recorded = _evaluations(folder / "estados_local" / "step-00000010")["mse"][-1]
    says = (
        f"estados_local/BEST.json marks step 10 with mse = {value!r}, but that checkpoint recorded mse = "
        f"{recorded!r} at step 10: delete it (the next save marks the best again), or pass --checkpoint latest "
        "or PATH"
    )
    script = _scripts(folder, "--set", f"data.dir={data_dir}")
    for name, extra in (("04_evaluate.py", ()), ("05_stage.py", ("--no-metrics",))):
        assert one_line_error(script(name, "--checkpoint", "best", *extra)) == f"error: {says}", name
    assert not (folder / "metrics.json").exists() and not (folder / "hub_stage").exists()
    for mode in LoadMode:
        with pytest.raises(CheckpointError) as refused:
            load_checkpoint("best", folder / "estados_local", mode=mode)
        assert str(refused.value) == f"{folder}/{says}"


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        # Step 10's own value, but step 3 (committed) recorded a higher mse: not the best by max.
        ({"step": 10, "value": "own"}, "but the committed step 3 was evaluated at mse = "),
        (
            {"metric": "accuracy"},
            "recorded no evaluation of accuracy at its own step (it recorded mse, rmse)",
        ),
        # Step 3's own value and the earliest step, but by min the later step 10 (committed)
        # recorded a lower mse: read in step 10's own evaluations, as step 3 stopped at 3.
        ({"mode": "min"}, "but the committed step 10 was evaluated better, at mse = "),
    ],
    ids=["not-the-best-by-its-mode", "a-metric-never-evaluated", "a-later-step-better-by-its-mode"],
)
def test_a_mark_that_its_rule_does_not_give_is_refused(marked_run, tmp_path, edit, says):
    if edit.get("value") == "own":
        edit = {**edit, "value": _evaluations(marked_run / "estados_local" / "step-00000010")["mse"][-1]}
    folder = _moved(marked_run, tmp_path, **edit)
    with pytest.raises(CheckpointError, match="BEST.json marks step") as refused:
        load_checkpoint("best", folder / "estados_local", mode=LoadMode.VERIFY)
    assert says in str(refused.value) and "\n" not in str(refused.value)
    # The same mark in min mode is the truth: among the committed steps, step 10 has the lowest mse.
    if "value" in edit:
        folder = _moved(marked_run, tmp_path / "min", **edit, mode="min")
        assert load_checkpoint("best", folder / "estados_local", mode=LoadMode.VERIFY).best["step"] == 10


def test_a_best_that_is_also_the_last_step_is_carded_as_selected_not_as_the_runs_end(
    marked_run, data_dir, tmp_path
):
    value = _evaluations(marked_run / "estados_local" / "step-00000010")["mse"][-1]
    folder = _moved(marked_run, tmp_path, step=10, value=value, mode="min")  # by min, step 10 is the best
    script = _scripts(folder, "--set", f"data.dir={data_dir}", "--set", "checkpoint.best_mode=min")
    ran = script("05_stage.py", "--checkpoint", "best", "--no-metrics")
    assert ran.returncode == 0, ran.stderr
    card = (folder / "hub_stage" / "README.md").read_text()
    assert (
        f"This is step **10**, selected as the best by `mse` (min) = {value:.6g} at step 10 of 10;" in card
    ), card


def test_a_mark_on_a_committed_step_that_did_not_evaluate_is_refused_in_one_line():
    """A save-only step (checkpoint.every, not eval_every) has no value of its own to mark."""
    from pipeline.checkpoint.best import check_best

    evaluations = {"step": [4, 8], "mse": [0.2, 0.1], "rmse": [0.44, 0.31]}
    mark = {"step": 5, "metric": "mse", "mode": "min", "value": 0.1}
    with pytest.raises(CheckpointError) as refused:
        check_best(mark, evaluations, committed=[5, 8], path="run/BEST.json")
    assert str(refused.value) == (
        "run/BEST.json marks step 5 as the best by mse, but that checkpoint recorded no evaluation of mse at its "
        "own step (it recorded mse, rmse): delete it (the next save marks the best again), or pass --checkpoint "
        "latest or PATH"
    )
    assert check_best({**mark, "step": 8}, evaluations, committed=[5, 8], path="run/BEST.json")["step"] == 8


def test_a_mark_whose_value_was_edited_by_a_hair_is_refused_in_one_line():
    """The mark's value must be the checkpoint's own, exactly: one a hair off was not recorded."""
    from pipeline.checkpoint.best import check_best

    evaluations = {"step": [4, 8], "mse": [0.2, 0.1], "rmse": [0.44, 0.31]}
    mark = {"step": 8, "metric": "mse", "mode": "min", "value": 0.1}
    assert check_best(mark, evaluations, committed=[4, 8], path="run/BEST.json") == mark
    edited = 0.1 * (1 + 1e-9)
    with pytest.raises(CheckpointError) as refused:
        check_best({**mark, "value": edited}, evaluations, committed=[4, 8], path="run/BEST.json")
    assert str(refused.value) == (
        f"run/BEST.json marks step 8 with mse = {edited!r}, but that checkpoint recorded mse = 0.1 at step 8: "
        "delete it (the next save marks the best again), or pass --checkpoint latest or PATH"
    )


def test_an_earlier_better_evaluation_counts_against_a_mark_only_when_its_step_was_saved():
    """Step 3 evaluated better but was never saved (eval_every, not checkpoint.every): the best
    of the committed steps is 5, and the mark on it stands; had step 3 been committed, it would
    not. A save's rule keeps the evaluations as they were at that save."""
    from pipeline.checkpoint.best import BestRule, best_record, check_best

    evaluations = {"step": [3, 5, 10], "mse": [0.1, 0.2, 0.3]}
    mark = {"step": 5, "metric": "mse", "mode": "min", "value": 0.2}
    rule = BestRule.of(evaluations, "mse", "min")
    evaluations["step"].append(12)
    evaluations["mse"].append(0.05)
    assert rule.among([5, 10, 12]) == mark and best_record(evaluations, "mse", "min", among=[]) is None
    assert BestRule.of(evaluations, "", "min") is None
    assert check_best(mark, evaluations, committed=[5, 10], path="run/BEST.json") == mark
    with pytest.raises(CheckpointError) as refused:
        check_best(mark, evaluations, committed=[3, 5, 10], path="run/BEST.json")
    fix = "delete it (the next save marks the best again), or pass --checkpoint latest or PATH"
    assert str(refused.value) == (
        "run/BEST.json marks step 5 (mse = 0.2) as the best (min), but the committed step 3 was evaluated at "
        f"mse = 0.1, as good or better: {fix}"
    )
    with pytest.raises(CheckpointError) as refused:
        check_best(mark, {"step": []}, committed=[5], path="run/BEST.json")
    assert str(refused.value) == (
        "run/BEST.json marks step 5 as the best by mse, but that checkpoint recorded no evaluation of mse at its "
        f"own step (it recorded nothing): {fix}"
    )


def test_a_mark_whose_metric_is_no_metric_name_is_refused_in_one_inert_line(marked_run, tmp_path):
    """A metric read from the mark is printed in the refusal: one that is no metric name (a line
    break, a terminal escape) is refused as such, so no line of the mark's reaches the terminal."""
    for metric in ("mse\nerror: a second line", "\x1b[2J\x1b[31mmse", "mse\rok"):
        folder = _moved(marked_run, tmp_path / str(len(metric)), metric=metric)
        with pytest.raises(CheckpointError) as refused:
            load_checkpoint("best", folder / "estados_local", mode=LoadMode.VERIFY)
        assert str(refused.value) == (
            f"{folder}/estados_local/BEST.json does not hold exactly step, a metric name, mode and a finite "
            "value: delete it; the next save writes it again"
        )


@pytest.mark.parametrize(
    "text",
    [
        '{"step": 0, "metric": "mse", "mode": "max", "value": 0.5}',
        '{"step": 3.0, "metric": "mse", "mode": "max", "value": 0.5}',
        '{"step": true, "metric": "mse", "mode": "max", "value": 0.5}',
        '{"step": 3, "metric": 3, "mode": "max", "value": 0.5}',
        '{"step": 3, "metric": "mse", "mode": "best", "value": 0.5}',
        '{"step": 3, "metric": "mse", "mode": "max", "value": true}',
        '{"step": 3, "metric": "mse", "mode": "max", "value": 1e999}',
        '{"step": 3, "metric": "mse", "mode": "max", "value": "0.5"}',
        '{"step": 3, "metric": "mse", "mode": "max", "value": 0.5, "note": "x"}',
        '{"step": 3, "metric": "mse", "mode": "max"}',
    ],
    ids=["step-0", "float-step", "bool-step", "number-metric", "unknown-mode", "bool-value", "overflowing-value",
         "text-value", "a-key-more", "no-value"],
)  # fmt: skip
def test_a_mark_that_is_not_exactly_step_metric_mode_and_a_finite_value_is_refused(tmp_path, text):
    """BEST.json is read by 04, 05 and every load of --checkpoint best: anything but the four
    fields the store writes, each of its type, is refused in one line naming the file."""
    (tmp_path / "BEST.json").write_text('{"step": 3, "metric": "mse", "mode": "max", "value": 0.5}')
    assert read_best(tmp_path) == {"step": 3, "metric": "mse", "mode": "max", "value": 0.5}
    (tmp_path / "BEST.json").write_text(text)
    with pytest.raises(CheckpointError) as refused:
        read_best(tmp_path)
    assert str(refused.value) == (
        f"{tmp_path}/BEST.json does not hold exactly step, a metric name, mode and a finite value: delete it; "
        "the next save writes it again"
    )


def test_a_mark_larger_than_any_mark_is_not_read(tmp_path):
    """The store writes a few dozen bytes: a larger BEST.json is no mark, even one whose first
    4 KiB are a valid mark followed by blanks; one of exactly 4 KiB is read."""
    text = '{"step": 3, "metric": "mse", "mode": "max", "value": 0.5}'
    (tmp_path / "BEST.json").write_text(text + " " * (4096 - len(text)))
    assert read_best(tmp_path) == {"step": 3, "metric": "mse", "mode": "max", "value": 0.5}
    (tmp_path / "BEST.json").write_text(
        '{"step": 3, "metric": "mse", "mode": "max", "value": 0.5}' + " " * 4096
    )
    with pytest.raises(CheckpointError) as refused:
        read_best(tmp_path)
    assert str(refused.value) == (
        f"{tmp_path}/BEST.json is not a best-checkpoint mark: delete it; the next save writes it again"
    )


def test_a_later_committed_step_that_only_ties_the_earliest_best_leaves_the_mark_believed():
    """The mark names the earliest of equal values: a later committed step evaluated at the
    same value is not better, and the mark stands (by min and by max)."""
    from pipeline.checkpoint.best import check_best

    for mode, values in (("min", [0.5, 0.25, 0.25]), ("max", [0.25, 0.5, 0.5])):
        evaluations = {"step": [2, 4, 6], "loss": values}
        mark = {"step": 4, "metric": "loss", "mode": mode, "value": values[1]}
        assert check_best(mark, evaluations, [2, 4, 6], "BEST.json", newest=evaluations) == mark
        better = {**evaluations, "loss": [*values[:2], 0.125 if mode == "min" else 0.75]}
        with pytest.raises(CheckpointError, match="the committed step 6 was evaluated better"):
            check_best(mark, evaluations, [2, 4, 6], "BEST.json", newest=better)


def test_a_mark_one_save_behind_is_refused_with_the_resume_that_marks_the_best_again():
    """A later committed step evaluated better: the mark is one save behind (a run stopped
    between that save and the mark's move). On a run's last save no next save moves it, so the
    refusal names the fix that does: ``--resume latest`` (or the step folder), not "delete it,
    the next save marks it again"."""
    from pipeline.checkpoint.best import check_best

    evaluations = {"step": [2, 4], "loss": [0.5, 0.25]}
    mark = {"step": 2, "metric": "loss", "mode": "min", "value": 0.5}
    with pytest.raises(CheckpointError) as refused:
        check_best(mark, evaluations, [2, 4], "BEST.json", newest=evaluations)
    message = str(refused.value)
    assert "the committed step 4 was evaluated better" in message, message
    assert "resume the run with --resume latest" in message and "the next save marks" not in message, message


def test_a_mark_that_is_a_socket_or_not_json_is_refused_in_one_line(tmp_path, monkeypatch):
    """A socket's file named BEST.json cannot be opened (ENXIO): no mark, not the disk's error;
    a mark cut short says where the parser stopped."""
    import socket

    monkeypatch.chdir(tmp_path)  # bound by its short name: AF_UNIX paths are short
    with socket.socket(socket.AF_UNIX) as server:
        server.bind("BEST.json")
    with pytest.raises(CheckpointError) as refused:
        read_best(tmp_path)
    assert str(refused.value) == (
        f"{tmp_path}/BEST.json is not a best-checkpoint mark: delete it; the next save writes it again"
    )
    (tmp_path / "BEST.json").unlink()
    (tmp_path / "BEST.json").write_text('{"step": 3, ')
    with pytest.raises(CheckpointError) as refused:
        read_best(tmp_path)
    assert str(refused.value) == (
        f"{tmp_path}/BEST.json is not valid JSON (Expecting property name enclosed in double quotes: line 1 "
        "column 13 (char 12)): delete it; the next save writes it again"
    )


def test_a_mark_that_cannot_be_opened_is_the_disks_error_not_a_verdict_on_the_mark(tmp_path):
    """checkpoint.dir naming a file: BEST.json under it cannot be opened, which says nothing of
    a mark (not "no mark", which sends --checkpoint best to train again; not "delete it", of a
    file that is not there): the OS error reaches the caller, to be told in its words."""
    import errno

    (tmp_path / "checkpoints").write_text("")
    with pytest.raises(OSError) as failed:
        read_best(tmp_path / "checkpoints")
    assert (type(failed.value), failed.value.errno, failed.value.filename) == (
        NotADirectoryError,
        errno.ENOTDIR,
        str(tmp_path / "checkpoints" / "BEST.json"),
    )


def test_a_mark_swapped_for_a_fifo_or_a_link_after_a_look_at_its_name_is_refused_without_blocking(
    marked_run, tmp_path, monkeypatch
):
    """The mark is read from the descriptor it was opened as: renamed over it between a look at
    its name and the open, a FIFO would block the reader for ever, a link would be followed to a
    file outside the folder. Every look at the name here sees the regular mark the run wrote."""
    import pathlib
    import threading

    from pipeline.checkpoint.best import read_best as read_mark

    folder = _moved(marked_run, tmp_path)
    mark = folder / "estados_local" / "BEST.json"
    outside = tmp_path / "outside.json"
    outside.write_bytes(mark.read_bytes())
    is_file, is_symlink = pathlib.Path.is_file, pathlib.Path.is_symlink
    monkeypatch.setattr(pathlib.Path, "is_file", lambda path: path == mark or is_file(path))
    monkeypatch.setattr(pathlib.Path, "is_symlink", lambda path: path != mark and is_symlink(path))
    for swap in (os.mkfifo, lambda path: os.symlink(outside, path)):
        mark.unlink()
        swap(mark)
        outcome: list[BaseException | dict | None] = []

        def read() -> None:
            try:
                outcome.append(read_mark(mark.parent))
            except BaseException as exc:  # noqa: BLE001 (the outcome is asserted below)
                outcome.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout=20)
        assert not reader.is_alive(), "read_best blocked on a FIFO renamed over the mark"
        assert isinstance(outcome[0], CheckpointError), outcome
        assert (
            str(outcome[0])
            == f"{mark} is not a best-checkpoint mark: delete it; the next save writes it again"
        )


def test_a_mark_is_not_believed_when_the_newest_checkpoint_it_is_checked_against_is_damaged(
    marked_run, tmp_path
):
    folder = _moved(marked_run, tmp_path)  # the mark as the run wrote it: step 3
    state = folder / "estados_local" / "step-00000010" / STATE_FILE
    data = bytearray(state.read_bytes())
    data[-1] ^= 0xFF
    state.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint("best", folder / "estados_local", mode=LoadMode.VERIFY)
    says = str(refused.value)
    assert says.startswith(f"{folder}/estados_local/BEST.json is not checked: the newest checkpoint")
    assert f"{state} SHA-256 differs from meta.json" in says and says.endswith(": pass --checkpoint PATH")
    marked = folder / "estados_local" / "step-00000003"
    assert load_checkpoint(marked, folder / "estados_local", mode=LoadMode.VERIFY).folder == marked


def test_a_mark_is_the_earliest_of_equal_values_among_the_committed_steps():
    from pipeline.checkpoint.best import check_best

    evaluations = {"step": [2, 4, 6], "loss": [0.5, 0.25, 0.25]}
    mark = {"step": 6, "metric": "loss", "mode": "min", "value": 0.25}
    with pytest.raises(
        CheckpointError, match="the committed step 4 was evaluated at loss = 0.25, as good or better"
    ):
        check_best(mark, evaluations, [4, 6], "BEST.json")
    assert check_best(mark, evaluations, [2, 6], "BEST.json") == mark  # step 4 was pruned: 6 is the best kept
    # By max too: an earlier committed step that only ties the marked value is as good.
    highest = {"step": [2, 4, 6], "acc": [0.25, 0.5, 0.5]}
    with pytest.raises(CheckpointError) as refused:
        check_best({"step": 6, "metric": "acc", "mode": "max", "value": 0.5}, highest, [4, 6], "BEST.json")
    assert str(refused.value) == (
        "BEST.json marks step 6 (acc = 0.5) as the best (max), but the committed step 4 was evaluated at acc = 0.5, "
        "as good or better: delete it (the next save marks the best again), or pass --checkpoint latest or PATH"
    )
    assert best_record(evaluations, "loss", "min", among={2, 4, 6})["step"] == 4
    assert best_record(evaluations, "loss", "min", among={2, 6})["step"] == 6
    assert best_record(evaluations, "loss", "max", among={4, 6})["step"] == 4
    assert best_record(evaluations, "loss", "min", among=set()) is None
    # A later step evaluated better that has no checkpoint (never saved, or gone) is no better
    # checkpoint: the mark on the best kept one stands.
    evaluations = {"step": [2, 4, 6, 8], "loss": [0.5, 0.25, 0.125, 0.375]}
    mark = {"step": 4, "metric": "loss", "mode": "min", "value": 0.25}
    assert check_best(mark, evaluations, [2, 4, 8], "BEST.json", newest=evaluations) == mark
    # A mark written with an int where the checkpoint recorded a float: the recorded value is
    # the one checked and handed on (a staged meta.json records it).
    checked = check_best({**mark, "value": 0}, {"step": [4], "loss": [0.0]}, [4], "BEST.json")
    assert json.dumps(checked) == '{"step": 4, "metric": "loss", "mode": "min", "value": 0.0}'


def test_the_checked_mark_reads_only_the_evaluations_of_the_training_state(marked_run):
    loaded = load_checkpoint("best", marked_run / "estados_local", mode=LoadMode.WEIGHTS)
    assert loaded.folder.name == "step-00000003" and loaded.state_tensors == {}
    assert loaded.best == read_best(marked_run / "estados_local")


def test_a_resume_from_the_best_beside_later_checkpoints_names_a_fork_that_runs_as_printed(
    marked_run, data_dir, tmp_path
):
    """``02 --resume best`` in the run's own folder is refused (later checkpoints are there). Its
    fix names the marked step's folder: ``--resume best`` with another ``--checkpoint-dir``
    would look for a mark in that new, empty folder and fail a second time."""
    folder = tmp_path / "run"
    shutil.copytree(marked_run, folder)
    script = _scripts(folder, "--set", f"data.dir={data_dir}", "--set", "training.eval_every=3",
                      "--set", "checkpoint.best_metric=mse", "--set", "checkpoint.best_mode=max")  # fmt: skip
    line = one_line_error(script("02_train.py", "--resume", "best", "--quiet"))
    assert line == (
        "error: estados_local/ holds step 10, newer than the resume point 3: resume from latest, or continue "
        "step 3 in a new folder with --resume estados_local/step-00000003 --checkpoint-dir DIR"
    )
    fork = shlex.split(line.split(" in a new folder with ", 1)[1].replace("DIR", "runs/fork"))
    ran = script("02_train.py", *fork, "--quiet")
    assert ran.returncode == 0, ran.stderr
    assert "trained to step 10/10" in ran.stdout and "checkpoint runs/fork/step-00000010" in ran.stdout


def test_a_run_stopped_between_its_last_commit_and_the_marks_move_is_marked_again_by_its_resume(
    data_dir, tmp_path
):
    """A stop between a save's commit and the mark's move leaves the old best marked (crash
    safety), and ``--checkpoint best`` refuses the mark one save behind. On the run's last save
    no next save moves it: ``--resume latest`` of the finished run, which trains nothing, marks
    the best again (pruning nothing). Resumed under another rule, the mark stays for the first
    save to move."""
    script = _scripts(tmp_path, "--set", f"data.dir={data_dir}", "--set", "training.eval_every=3",
                      "--set", "checkpoint.best_metric=mse", "--set", "checkpoint.keep_last=2")  # fmt: skip
    assert script("02_train.py", "--quiet").returncode == 0
    root = tmp_path / "estados_local"
    marked = read_best(root)
    assert _committed(root) == [9, 10] and marked["step"] == 10  # mse falls: by min, the last is the best
    # The stop between step 10's commit and the mark's move: step 9's mark, written at its save.
    evaluations = _evaluations(root / "step-00000010")
    behind = {
        "step": 9,
        "metric": "mse",
        "mode": "min",
        "value": evaluations["mse"][evaluations["step"].index(9)],
    }
    (root / "BEST.json").write_text(json.dumps(behind))
    assert "but the committed step 10 was evaluated better" in one_line_error(
        script("04_evaluate.py", "--checkpoint", "best")
    )
    other_rule = script("02_train.py", "--quiet", "--resume", "latest", "--set", "checkpoint.best_mode=max")
    assert other_rule.returncode == 0, other_rule.stderr
    assert read_best(root) == behind
    resumed = script("02_train.py", "--quiet", "--resume", "latest")
    assert resumed.returncode == 0 and "trained to step 10/10" in resumed.stdout, resumed.stderr
    assert read_best(root) == marked and _committed(root) == [9, 10]
    evaluated = script("04_evaluate.py", "--checkpoint", "best")
    assert evaluated.returncode == 0 and "evaluated estados_local/step-00000010 (step 10)" in evaluated.stdout


# -- a resume that changes the rule ---------------------------------------------------------------


WOBBLE = ["--set", "data.factory=trainer_factories:build_data_wobbling_evaluate", "--set", "training.max_steps=12",
          "--set", "training.eval_every=1", "--set", "checkpoint.best_metric=wobble",
          "--set", "checkpoint.keep_last=1"]  # fmt: skip


def _committed(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "meta.json").is_file())


def test_a_resume_that_changes_best_mode_marks_the_best_kept_checkpoint_before_the_old_best_goes(
    data_dir, tmp_path
):
    """Trained to step 6 keeping the highest ``wobble`` (a metric that jumps about), then resumed
    keeping the lowest: at every save the mark names the best committed step under the new rule
    (the run's lowest may have no checkpoint), and the old best is pruned only once the new mark
    is written and its folder fsynced."""
    from pipeline.config import load_config, parse_set_overrides
    from pipeline.train import train as train_in_process

    root = tmp_path / "estados_local"
    first = _scripts(tmp_path, "--set", f"data.dir={data_dir}", *WOBBLE, "--set", "checkpoint.best_mode=max",
                     "--set", "checkpoint.every=3")("02_train.py", "--quiet", "--stop-at", "6")  # fmt: skip
    assert first.returncode == 0, first.stderr
    old_best = read_best(root)
    assert old_best["mode"] == "max" and old_best["step"] in _committed(root)
    events: list[tuple[str, int | None, list[int], dict | None]] = []

    def after(op) -> None:
        if op.kind == "rename" and op.target == str(root / "BEST.json"):
            events.append(("marked", None, _committed(root), read_best(root)))
        elif op.kind == "rename" and Path(op.target).name.startswith(".deleting-step-"):
            events.append(("pruned", int(Path(op.path).name[5:]), _committed(root), read_best(root)))
        elif op.kind == "fsync" and op.is_dir and op.path == str(root):
            events.append(("synced", None, [], None))

    overrides = {
        **parse_set_overrides(WOBBLE[1::2]),
        "data.dir": str(data_dir),
        "checkpoint.dir": str(root),
        "checkpoint.every": 2,
        "checkpoint.best_mode": "min",
    }
    with Recorder(root, after=after):
        result = train_in_process(load_config(CONFIG, overrides), resume="latest", progress=False)
    evaluations = result.evaluations
    pruned = [(step, committed, mark) for kind, step, committed, mark in events if kind == "pruned"]
    assert old_best["step"] in [step for step, _, _ in pruned], "the old best was never pruned"
    for step, committed, mark in pruned:
        assert mark["mode"] == "min" and mark["step"] != step and mark["step"] in committed, (step, mark)
    kinds = [kind for kind, *_ in events]
    for index, kind in enumerate(kinds):
        if kind == "pruned":
            last_mark = max(i for i in range(index) if kinds[i] == "marked")
            assert "synced" in kinds[last_mark:index], "a prune before the new mark was durable"
    marks = [(committed, mark) for kind, _, committed, mark in events if kind == "marked"]
    assert marks, "the resumed run never marked a best"
    for committed, mark in marks:
        assert mark == best_record(evaluations, "wobble", "min", among=set(committed)), (committed, mark)
    # Not vacuous: a mark was written while the run's lowest had no checkpoint.
    assert any(mark != best_record(evaluations, "wobble", "min", among=set(range(1, max(committed) + 1)))
               for committed, mark in marks), marks  # fmt: skip
    # The end: the mark names a committed step, and every reader accepts it.
    assert read_best(root)["step"] in _committed(root)
    assert load_checkpoint("best", root, mode=LoadMode.VERIFY).best == read_best(root)
