"""Gradient accumulation, evaluation during training, the best checkpoint, float32 by default."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from pipeline.checkpoint import CheckpointStore, best_record, read_best

from support import (
    PYTHON,
    REPO,
    ScriptRun,
    assert_checkpoints_bitwise_equal,
    data_args,
    one_line_error,
    run_python,
    run_script,
    script_env,
    start_script,
    train,
    verify_checkpoint,
)

NO_DROPOUT = ["--set", "model.params.dropout=0.0"]
EVAL = ["--set", "training.eval_every=3", "--set", "checkpoint.best_metric=mse"]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "modelo.safetensors")


def _state(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "estado_treino.safetensors")


def _close(a: Path, b: Path, atol: float) -> None:
    left, right = _weights(a), _weights(b)
    assert left.keys() == right.keys()
    for name in left:
        assert torch.allclose(left[name], right[name], rtol=0, atol=atol), name


@pytest.mark.parametrize(
    ("micro", "steps", "whole"),
    [(2, 4, 8), (5, 5, 24)],  # 5 x 5 is one epoch of 24 rows: its last micro-batch has 4
    ids=["equal-micro-batches", "short-last-batch"],
)
def test_micro_batches_train_like_one_batch_of_their_rows(data_dir, tmp_path, micro, steps, whole):
    accumulated, single = tmp_path / "accumulated", tmp_path / "single"
    common = [*NO_DROPOUT, "--max-steps", "6"]  # augmentation stays: seeded per sample
    ran = train(
        data_dir,
        accumulated,
        *common,
        "--set",
        f"data.batch_size={micro}",
        "--set",
        f"training.grad_accum_steps={steps}",
    )
    assert ran.returncode == 0, ran.stderr
    ran = train(data_dir, single, *common, "--set", f"data.batch_size={whole}")
    assert ran.returncode == 0, ran.stderr
    _close(accumulated / "step-00000006", single / "step-00000006", 1e-10)
    losses = (
        _state(accumulated / "step-00000006")["history/loss"],
        _state(single / "step-00000006")["history/loss"],
    )
    assert torch.allclose(*losses, rtol=0, atol=1e-10)


def test_the_effective_batch_is_printed(data_dir, tmp_path):
    ran = run_script("02_train.py", *data_args(data_dir), "--checkpoint-dir", str(tmp_path / "b"),
                     "--max-steps", "1", "--set", "training.grad_accum_steps=3")  # fmt: skip
    assert "effective batch: 12 rows per optimizer step (3 micro-batches of 4)" in ran.stderr + ran.stdout


def test_the_effective_batch_line_says_how_a_step_is_made_in_every_shape():
    """One process without accumulation says nothing; a launch says how each batch is split,
    with or without accumulation (one micro-batch is not "micro-batches")."""
    from types import SimpleNamespace

    from pipeline.accumulation import effective_batch
    from pipeline.world import World

    def line(steps: int, processes: int) -> str | None:
        config = SimpleNamespace(
            data=SimpleNamespace(batch_size=4), training=SimpleNamespace(grad_accum_steps=steps)
        )
        world = World(
            device=torch.device("cpu"), world_size=processes, mode="none" if processes == 1 else "ddp"
        )
        return effective_batch(SimpleNamespace(config=config), world)

    assert line(1, 1) is None
    assert line(3, 1) == "effective batch: 12 rows per optimizer step (3 micro-batches of 4)"
    assert (
        line(1, 2)
        == "effective batch: 4 rows per optimizer step (1 micro-batch of 4, each split over 2 processes)"
    )
    assert (
        line(2, 2)
        == "effective batch: 8 rows per optimizer step (2 micro-batches of 4, each split over 2 processes)"
    )


@pytest.fixture(scope="module")
def accumulated_reference(data_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("accumulated")
    ran = train(data_dir, folder, "--max-steps", "10", "--set", "training.grad_accum_steps=3", *EVAL)
    assert ran.returncode == 0, ran.stderr
    return folder


def test_an_accumulated_evaluated_run_cut_and_resumed_is_bitwise_the_uninterrupted_one(
    data_dir, accumulated_reference, tmp_path
):
    accumulated = ["--set", "training.grad_accum_steps=3", *EVAL]
    first = train(data_dir, tmp_path, "--max-steps", "10", "--stop-at", "4", *accumulated)
    assert first.returncode == 0, first.stderr
    second = train(data_dir, tmp_path, "--max-steps", "10", "--resume", "latest", *accumulated)
    assert second.returncode == 0, second.stderr
    assert_checkpoints_bitwise_equal(accumulated_reference / "step-00000010", tmp_path / "step-00000010")
    state = _state(tmp_path / "step-00000010")
    assert state["evaluation/step"].tolist() == [3, 6, 9, 10]
    assert set(k for k in state if k.startswith("evaluation/")) == {
        "evaluation/step",
        "evaluation/mse",
        "evaluation/rmse",
    }


def test_evaluating_does_not_change_the_weights(data_dir, accumulated_reference, tmp_path):
    ran = train(data_dir, tmp_path, "--max-steps", "10", "--set", "training.grad_accum_steps=3")
    assert ran.returncode == 0, ran.stderr
    plain, evaluated = _state(tmp_path / "step-00000010"), _state(accumulated_reference / "step-00000010")
    assert not any(k.startswith("evaluation/") for k in plain)
    assert {k: v for k, v in evaluated.items() if not k.startswith("evaluation/")}.keys() == plain.keys()
    for key, tensor in plain.items():
        assert torch.equal(tensor, evaluated[key]), key
    for name, tensor in _weights(tmp_path / "step-00000010").items():
        assert torch.equal(tensor, _weights(accumulated_reference / "step-00000010")[name]), name


def test_the_run_object_holds_the_evaluations(data_dir, tmp_path, capsys):
    from pipeline.config import load_config
    from pipeline.train import train as train_in_process

    overrides = {
        "data.dir": str(data_dir),
        "checkpoint.dir": str(tmp_path),
        "training.max_steps": 5,
        "training.eval_every": 2,
    }
    result = train_in_process(load_config(REPO / "config.yaml", overrides), progress=True)
    assert result.evaluations["step"] == [2, 4, 5]
    assert set(result.evaluations) == {"step", "mse", "rmse"}
    assert all(len(v) == 3 for v in result.evaluations.values())
    assert result.evaluations["rmse"][0] == pytest.approx(result.evaluations["mse"][0] ** 0.5)
    # Each evaluation is said in the run's log, 6 significant digits a value.
    said = [line for line in capsys.readouterr().err.splitlines() if " evaluation: " in line]
    assert said == [
        f"step {step} evaluation: mse {mse:.6g}, rmse {rmse:.6g}"
        for step, mse, rmse in zip(*(result.evaluations[name] for name in ("step", "mse", "rmse")))
    ]
    # The rate each step trained with (step_lr halves it every 4 steps), not the next step's.
    assert result.history["lr"] == [0.01, 0.01, 0.01, 0.01, 0.005]


def test_under_fp16_amp_grad_clip_bounds_the_unscaled_gradients(data_dir, tmp_path):
    """``training.grad_clip`` bounds the gradient norm, the one traced as ``train/grad_norm``:
    under fp16 AMP that is the norm of the gradients once unscaled, never of the ones the
    GradScaler multiplied (65536 at first). A bound ten times the largest norm the run
    traces is never reached: it trains the very weights of the run without clipping. A bound
    below every norm does clip (it is on)."""
    from pipeline.config import load_config
    from pipeline.train import train as train_in_process

    def run(clip: float):
        overrides = {
            "data.dir": str(data_dir),
            "checkpoint.dir": str(tmp_path / f"clip{clip}"),
            "training.amp": "fp16",
            "training.dtype": "float32",
            "training.grad_clip": clip,
        }
        result = train_in_process(load_config(REPO / "config.yaml", overrides), progress=False)
        return result.history["grad_norm"], _weights(result.checkpoint)

    norms, unclipped = run(0.0)
    finite = [n for n in norms if math.isfinite(n)]
    assert len(finite) >= 3, norms
    _, unreached = run(10 * max(finite))
    _, clipped = run(min(finite) / 2)
    for name, tensor in unclipped.items():
        assert torch.equal(unreached[name], tensor), name
    assert any(not torch.equal(clipped[name], tensor) for name, tensor in unclipped.items())


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (["training.grad_accum_steps=0"], "training.grad_accum_steps must be >= 1"),
        (["training.eval_every=-1"], "training.eval_every must be >= 0"),
        (["checkpoint.best_mode=median"], "checkpoint.best_mode must be one of ('min', 'max')"),
        (["checkpoint.best_metric=mse"], "checkpoint.best_metric needs evaluations"),
        (
            ["training.eval_every=2", "data.factory=trainer_factories:build_data_without_evaluate"],
            # before the first step: named for the key, not found at the first evaluation
            "training.eval_every is 2, but the task (trainer_factories:build_data_without_evaluate) has no evaluate",
        ),
        (["training.eval_every=2", "checkpoint.best_metric=accuracy"], "evaluate returned mse, rmse"),
    ],
    ids=["accum-0", "eval-negative", "best-mode", "best-without-eval", "no-evaluate", "unknown-metric"],
)
def test_bad_input_is_one_line_and_exit_2(data_dir, tmp_path, sets, says):
    args = [arg for one in sets for arg in ("--set", one)]
    ran = train(data_dir, tmp_path, "--max-steps", "4", *args)
    assert ran.returncode == 2, ran.stderr
    assert says in one_line_error(ran)


def test_an_unknown_best_metric_stops_at_the_first_evaluation_with_its_checkpoint(data_dir, tmp_path):
    """A misspelt name stops the run at its first evaluation, that step committed; the printed
    resume command sets the closest name the task returns in place of the bad ``--set``, and
    continues the run as it is."""
    ran = train(data_dir, tmp_path, "--max-steps", "10", "--set", "training.eval_every=2",
                "--set", "checkpoint.best_metric=rmsee")  # fmt: skip
    assert ran.returncode == 2
    refusal, _, command = one_line_error(ran).partition("; step 2 is committed: resume with ")
    assert refusal.endswith(
        "checkpoint.best_metric is 'rmsee', but the task's evaluate returned mse, rmse: set "
        "checkpoint.best_metric to one of them"
    )
    assert CheckpointStore(tmp_path).committed_steps() == [2]
    argv = shlex.split(command)
    assert argv[-4:] == ["--set", "checkpoint.best_metric=rmse", "--resume", "latest"]
    assert "checkpoint.best_metric=rmsee" not in argv
    # Run as printed, forked from the zygote: the printed interpreter is this one.
    assert Path(argv[0]).resolve() == Path(PYTHON).resolve(), argv
    again = run_python(argv[1:], cwd=Path.cwd(), env=script_env())
    assert again.returncode == 0, again.stderr
    assert read_best(tmp_path)["metric"] == "rmse"


def test_the_resume_command_of_a_refusal_sets_the_fix_in_place_of_the_bad_value():
    from pipeline.commands import with_set

    for given in (["--set", "checkpoint.best_metric=msee"], ["--set=checkpoint.best_metric=msee"], []):
        command = shlex.join(
            ["python", "02_train.py", "--set", "a=1", *given, "--quiet", "--resume", "latest"]
        )
        assert shlex.split(with_set(command, "checkpoint.best_metric=mse")) == [
            "python", "02_train.py", "--set", "a=1", "--quiet", "--set", "checkpoint.best_metric=mse",
            "--resume", "latest",
        ]  # fmt: skip


def test_a_config_built_in_code_is_checked_like_a_file():
    from pipeline.config import CheckpointConfig, TrainingConfig

    with pytest.raises(ValueError, match="checkpoint.best_mode must be one of"):
        CheckpointConfig(best_mode="median")
    with pytest.raises(ValueError, match="training.grad_accum_steps must be >= 1"):
        TrainingConfig(grad_accum_steps=0)


def _best_steps(folder: Path, mode: str) -> int:
    evaluations = {
        key.removeprefix("evaluation/"): t.tolist()
        for key, t in _state(folder).items()
        if key.startswith("evaluation/")
    }
    return best_record(evaluations, "mse", mode)["step"]


def test_the_best_survives_keep_last_1_and_is_selected_by_checkpoint_best(data_dir, tmp_path):
    # mse falls while training: 'max' makes an early step the best, kept beside the last.
    best = ["--set", "checkpoint.best_mode=max", "--keep-last", "1", "--checkpoint-every", "2"]
    ran = train(data_dir, tmp_path, "--max-steps", "10", *EVAL, *best)
    assert ran.returncode == 0, ran.stderr
    marked = read_best(tmp_path)
    assert marked["step"] == _best_steps(tmp_path / "step-00000010", "max") == 3  # saved though not every 2
    assert CheckpointStore(tmp_path).committed_steps() == [3, 10]
    from pipeline.checkpoint import LoadMode, load_checkpoint

    assert load_checkpoint("best", tmp_path, mode=LoadMode.VERIFY).folder.name == "step-00000003"
    assert load_checkpoint("latest", tmp_path, mode=LoadMode.VERIFY).folder.name == "step-00000010"


def test_a_mark_that_cannot_be_read_prunes_nothing_and_best_is_refused(data_dir, tmp_path):
    ran = train(data_dir, tmp_path, "--max-steps", "4", "--checkpoint-every", "1", "--keep-last", "4",
                "--set", "training.eval_every=2", "--set", "checkpoint.best_metric=mse",
                "--set", "checkpoint.best_mode=max")  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    (tmp_path / "BEST.json").write_text("{not json")
    store = CheckpointStore(tmp_path, keep_last=1)
    with store:
        assert store.prune() == []
        assert store.committed_steps() == [1, 2, 3, 4]
    from pipeline.checkpoint import load_checkpoint
    from pipeline.errors import CheckpointError

    with pytest.raises(CheckpointError, match="BEST.json is not valid JSON"):
        load_checkpoint("best", tmp_path)
    # The resume marks the best again over the damaged mark, and the prunes run again.
    evaluations = {
        key.removeprefix("evaluation/"): t.tolist()
        for key, t in _state(tmp_path / "step-00000004").items()
        if key.startswith("evaluation/")
    }
    with store:
        store.mark_best_again(evaluations, "mse", "max")
        assert read_best(tmp_path)["step"] == _best_steps(tmp_path / "step-00000004", "max") == 2
        assert store.prune() == [1, 3]
    assert load_checkpoint("best", tmp_path).folder.name == "step-00000002"
    (tmp_path / "BEST.json").unlink()
    with pytest.raises(CheckpointError, match="no best checkpoint is marked"):
        load_checkpoint("best", tmp_path)


def _kill_child(data_dir: Path, folder: Path) -> ScriptRun:
    return start_script("02_train.py", *data_args(data_dir), "--checkpoint-dir", str(folder), "--quiet",
                        "--max-steps", "300", "--resume", "auto", "--keep-last", "1", "--checkpoint-every", "4",
                        "--set", "training.eval_every=1", "--set", "checkpoint.best_metric=mse",
                        "--set", "checkpoint.best_mode=max", "--set", "checkpoint.async=true")  # fmt: skip


def test_a_kill_at_any_instant_leaves_the_best_and_the_last_verifiable(data_dir, tmp_path):
    rng, killed = random.Random(35), 0
    for trial in range(3):
        folder = tmp_path / f"trial-{trial}"
        child = _kill_child(data_dir, folder)
        # Strike at a random instant after the first commit: a clock alone would strike before
        # it on a loaded machine, or after the end on a fast one. The deadlines are for a run
        # that never gets there; on a machine busy with other work it may take minutes.
        deadline = time.monotonic() + 600
        while not CheckpointStore(folder).committed_steps() and not child.ended():
            assert time.monotonic() < deadline, "no checkpoint within 600 s"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0))
        if child.ended():
            continue  # finished before the strike: nothing to learn from this trial
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=60).returncode == -signal.SIGKILL
        steps = CheckpointStore(folder).committed_steps()
        killed += 1
        assert steps[-1] < 300, "the kill must strike while the run trains"
        verify_checkpoint(folder / f"step-{steps[-1]:08d}")
        marked = read_best(folder)
        if marked is not None:
            assert marked["step"] in steps
            verify_checkpoint(folder / f"step-{marked['step']:08d}")
        # The best by the newest checkpoint's own evaluations is still there too.
        assert _best_steps(folder / f"step-{steps[-1]:08d}", "max") in steps
        # And the run goes on from there.
        resumed = _kill_child(data_dir, folder).wait(timeout=900)
        assert resumed.returncode == 0, resumed.stderr
        assert read_best(folder)["step"] in CheckpointStore(folder).committed_steps()
    assert killed, "no trial was killed after its first checkpoint"


def _without_dtype(tmp_path: Path) -> Path:
    raw = yaml.safe_load((REPO / "config.yaml").read_text())
    del raw["training"]["dtype"]
    path = tmp_path / "nodtype.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_config_without_dtype_trains_and_stages_float32(data_dir, tmp_path):
    config = _without_dtype(tmp_path)
    env = script_env()
    common = ["--config", str(config), *data_args(data_dir)]
    for script, extra in (("01_prepare_data.py", []), ("02_train.py", ["--quiet", "--max-steps", "2"]),
                          ("04_evaluate.py", []), ("05_stage.py", [])):  # fmt: skip
        if script == "01_prepare_data.py":
            continue  # the session's data is the default config's: same recipe
        ran = run_script(script, *common, *extra, cwd=tmp_path, env=env)
        assert ran.returncode == 0, ran.stderr
    checkpoint = next(tmp_path.glob("runs/nodtype/estados_local/step-*"))
    assert {t.dtype for t in _weights(checkpoint).values()} == {torch.float32}
    staged = load_file(next(tmp_path.glob("runs/nodtype/hub_stage/modelo.safetensors")))
    assert {t.dtype for t in staged.values()} == {torch.float32}
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["config"]["training"]["dtype"] == "float32"


def test_checkpoint_best_stages_the_best(data_dir, tmp_path):
    env = script_env()
    best = [*data_args(data_dir), "--set", "training.eval_every=3", "--set", "checkpoint.best_metric=mse",
            "--set", "checkpoint.best_mode=max"]  # fmt: skip
    for script, extra in (("02_train.py", ["--quiet"]), ("04_evaluate.py", ["--checkpoint", "best"]),
                          ("05_stage.py", ["--checkpoint", "best"])):  # fmt: skip
        ran = run_script(script, "--config", str(REPO / "config.yaml"), *best, *extra, cwd=tmp_path, env=env)
        assert ran.returncode == 0, ran.stderr
    staged = json.loads((tmp_path / "hub_stage" / "meta.json").read_text())
    assert staged["step"] == read_best(tmp_path / "estados_local")["step"] == 3
    assert os.path.isdir(tmp_path / "estados_local" / "step-00000010")
    # The staged traces hold the best checkpoint's evaluation, read through the checkpoint's check.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tmp_path / "hub_stage" / "runs"), size_guidance={"scalars": 0})
    accumulator.Reload()
    assert [event.step for event in accumulator.Scalars("eval/mse")] == [3]


def test_the_resume_proof_passes_with_accumulation_and_evaluation_and_its_controls_diverge(
    data_dir, tmp_path
):
    """03 proves a run with accumulated micro-batches, evaluations and a callback keeping state:
    each is compared bit for bit, and leaving any saved component out of the resume diverges."""
    args = [
        "--set",
        "training.grad_accum_steps=2",
        "--set",
        "training.callbacks=[callback_factories:loss_sum]",
        *EVAL,
        "--set",
        "training.deterministic=false",
        "--jobs",
        "1",
    ]
    ran = run_script("03_verify_resume.py", "--config", str(REPO / "config.yaml"), *data_args(data_dir),
                     "--output", str(tmp_path / "proof"), *args, cwd=tmp_path, timeout=600)  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    report = json.loads((tmp_path / "proof" / "verification.json").read_text())
    assert report["all_checks_passed"] and report["positive"] and report["negative_divergence_detected"]
    for name in ("rng", "optimizer", "scheduler", "data", "callbacks"):
        assert report["components"]["negative"][name]["result"] == "detected", name
    assert "final.callbacks" in report["components"]["negative"]["callbacks"]["diverged_checks"], report
    checks = {check["name"]: check for check in report["checks"]["positive"]}
    for name in ("final.evaluations", "final.callbacks"):
        assert checks[name]["passed"] and checks[name]["max_abs_diff"] == 0.0, checks[name]


def test_an_evaluate_that_draws_from_every_rng_changes_nothing_the_training_computes(data_dir, tmp_path):
    drawing = ["--set", "data.factory=trainer_factories:build_data_drawing_evaluate"]
    plain = train(data_dir, tmp_path / "plain", "--max-steps", "6", *drawing)
    evaluated = train(
        data_dir, tmp_path / "evaluated", "--max-steps", "6", *drawing, "--set", "training.eval_every=1"
    )
    assert plain.returncode == 0 and evaluated.returncode == 0, plain.stderr + evaluated.stderr
    state = _state(tmp_path / "evaluated" / "step-00000006")
    assert state["evaluation/step"].tolist() == [1, 2, 3, 4, 5, 6]
    assert state["evaluation/train_mode"].tolist() == state["evaluation/grad_mode"].tolist() == [0.0] * 6
    for name, tensor in _weights(tmp_path / "plain" / "step-00000006").items():
        assert torch.equal(tensor, _weights(tmp_path / "evaluated" / "step-00000006")[name]), name


def test_the_evaluation_at_a_step_is_what_04_says_of_its_checkpoint(data_dir, tmp_path):
    ran = train(data_dir, tmp_path, "--max-steps", "5", "--set", "training.eval_every=5")
    assert ran.returncode == 0, ran.stderr
    from pipeline.config import load_config
    from pipeline.evaluate import evaluate_checkpoint

    config = load_config(REPO / "config.yaml", {"data.dir": str(data_dir), "checkpoint.dir": str(tmp_path),
                                                 "outputs.metrics": str(tmp_path / "metrics.json")})  # fmt: skip
    record = evaluate_checkpoint(config, "latest")
    state = _state(tmp_path / "step-00000005")
    assert state["evaluation/mse"].tolist() == [record["metrics"]["mse"]]


@pytest.mark.parametrize(
    ("tensors", "says"),
    [
        ({"evaluation/step": torch.tensor([2, 2]), "evaluation/mse": torch.tensor([1.0, 2.0], dtype=torch.float64)},
         "evaluation/step does not count up within 1 ... 5: the checkpoint is sealed"),
        ({"evaluation/step": torch.tensor([2, 9]), "evaluation/mse": torch.tensor([1.0, 2.0], dtype=torch.float64)},
         "evaluation/step does not count up within 1 ... 5: the checkpoint is sealed"),
        ({"evaluation/step": torch.tensor([2]), "evaluation/mse": torch.tensor([1.0, 2.0], dtype=torch.float64)},
         "evaluation/mse is not 1 float64 values"),
        ({"evaluation/step": torch.tensor([2]), "evaluation/mse": torch.tensor([float("nan")], dtype=torch.float64)},
         "evaluation/mse holds a value that is not finite"),
        ({"evaluation/step": torch.tensor([2, 4]), "evaluation/mse": torch.tensor([1.0, float("inf")], dtype=torch.float64)},
         "evaluation/mse holds a value that is not finite"),
        ({"evaluation/mse": torch.tensor([1.0], dtype=torch.float64)}, "evaluation/step is not a list"),
        ({"evaluation/step": torch.tensor([2])}, "evaluation/step has no metric beside it"),
        ({"evaluation/step": torch.tensor([0, 2]), "evaluation/mse": torch.tensor([1.0, 2.0], dtype=torch.float64)},
         "evaluation/step does not count up within 1 ... 5: the checkpoint is sealed"),
        ({"evaluation/step": torch.tensor([2.0]), "evaluation/mse": torch.tensor([1.0], dtype=torch.float64)},
         "evaluation/step is not a list of int64"),
        ({"evaluation/step": torch.tensor([2]), "evaluation/mse": torch.tensor([1.0], dtype=torch.float32)},
         "evaluation/mse is not 1 float64 values"),
        ({"evaluation/step": torch.tensor([2]), "evaluation/a b": torch.tensor([1.0], dtype=torch.float64)},
         "evaluation/a b is not a metric name"),
        ({"evaluation/step": torch.tensor([[2]]), "evaluation/mse": torch.tensor([[1.0]], dtype=torch.float64)},
         "evaluation/step is not a list of int64"),
        ({"evaluation/step": torch.tensor([], dtype=torch.int64), "evaluation/mse": torch.tensor([], dtype=torch.float64)},
         "evaluation/step is not a list of int64"),
        ({"evaluation/step": torch.tensor([2, 4]), "evaluation/mse": torch.tensor([[1.0], [2.0]], dtype=torch.float64)},
         "evaluation/mse is not 2 float64 values: the checkpoint is sealed"),
        ({"evaluation/step": torch.tensor([2]), "evaluation/mse": torch.tensor(1.0, dtype=torch.float64)},
         "evaluation/mse is not 1 float64 values: the checkpoint is sealed"),
    ],
    ids=["repeated-step", "past-the-run", "short", "nan", "inf-beside-finite", "no-steps", "no-metric", "step-0",
         "float-steps", "float32-values", "no-metric-name", "steps-in-rows", "no-evaluated-step", "values-in-rows",
         "one-value-no-list"],
)  # fmt: skip
def test_saved_evaluations_are_checked_before_use(tensors, says):
    from pipeline.checkpoint.evaluations import evaluation_tensors, evaluations_from
    from pipeline.errors import StateMismatch

    with pytest.raises(StateMismatch) as refused:
        evaluations_from(tensors, step=5)
    assert str(refused.value).startswith(f"training_state.{says}") and "\n" not in str(refused.value)
    assert evaluations_from({}, step=5) == {"step": []}
    # The boundary: the step a checkpoint is of is one its run may have evaluated.
    at_its_step = evaluation_tensors({"step": [1, 5], "mse": [0.5, 0.25]})
    assert evaluations_from(at_its_step, step=5) == {"step": [1, 5], "mse": [0.5, 0.25]}
    # What a checkpoint stores comes back as it was; a run that evaluated nothing stores nothing.
    evaluations = {"step": [2, 4], "mse": [0.5, 0.25], "validation/mse": [1.5, 1.25]}
    assert evaluations_from(evaluation_tensors(evaluations), step=5) == evaluations
    assert evaluation_tensors({"step": []}) == {}


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_accumulated_and_evaluated_under_torchrun_as_in_one_process(data_dir, tmp_path, mode):
    args = [*data_args(data_dir), "--max-steps", "4", "--quiet", *NO_DROPOUT, "--set", "training.grad_accum_steps=2",
            "--set", "training.eval_every=2", "--set", "checkpoint.best_metric=mse",
            "--set", "checkpoint.best_mode=max"]  # fmt: skip
    one = train(data_dir, tmp_path / "one", *args[2:])
    assert one.returncode == 0, one.stderr
    ran = subprocess.run(
        [PYTHON, "-B", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(REPO / "scripts" / "02_train.py"), "--config", str(REPO / "config.yaml"), *args,
         "--set", f"training.parallel={mode}", "--checkpoint-dir", str(tmp_path / "two")],
        cwd=tmp_path, env=script_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    from pipeline.checkpoint import load_checkpoint

    single, launched = (
        load_checkpoint(tmp_path / "one" / "step-00000004"),
        load_checkpoint(tmp_path / "two" / "step-00000004"),
    )
    for name, tensor in single.model_tensors.items():
        assert torch.allclose(tensor, launched.model_tensors[name], rtol=0, atol=1e-12), name
    for key in ("evaluation/step", "evaluation/mse", "history/loss"):
        assert torch.allclose(
            single.state_tensors[key].double(), launched.state_tensors[key].double(), rtol=0, atol=1e-12
        ), key
    # The best mark of a distributed run, checked against its training state's evaluations.
    from pipeline.checkpoint import LoadMode
    from pipeline.errors import CheckpointError

    marked = read_best(tmp_path / "two")
    assert marked["step"] == 2 and marked["value"] == launched.state_tensors["evaluation/mse"].tolist()[0]
    assert load_checkpoint("best", tmp_path / "two", mode=LoadMode.WEIGHTS).best == marked
    (tmp_path / "two" / "BEST.json").write_text(json.dumps({**marked, "step": 4}))
    with pytest.raises(
        CheckpointError, match=r"BEST.json marks step 4 with mse = .*, but that checkpoint recorded"
    ):
        load_checkpoint("best", tmp_path / "two", mode=LoadMode.VERIFY)


class _SyncRecorder(torch.nn.Module):
    """Records what DDP's and FSDP2's gradient-sync switches are asked."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def set_requires_gradient_sync(self, on: bool) -> None:
        self.calls.append(on)

    @contextlib.contextmanager
    def no_sync(self):
        self.calls.append("no_sync")
        yield
        self.calls.append("synced again")


@pytest.mark.parametrize(
    ("mode", "before_last", "last"),
    [("ddp", ["no_sync", "synced again"], []), ("fsdp2", [False, True], []), ("none", [], [])],
    ids=["ddp", "fsdp2", "none"],
)
def test_micro_batches_before_the_last_skip_the_gradient_reduce(mode, before_last, last):
    from pipeline.accumulation import _gradient_sync
    from pipeline.world import World

    world = World(device=torch.device("cpu"), mode=mode)
    for sync, expected in ((False, before_last), (True, last)):
        model = _SyncRecorder()
        with _gradient_sync(model, world, sync):
            pass
        assert model.calls == expected, (mode, sync)


def test_the_proofs_cut_is_planned_on_the_steps_training_takes_with_accumulation(data_dir, tmp_path):
    """24 rows in batches of 4, two per optimizer step: epoch 1 begins at step 4, as the
    checkpoints of a real run record it; the proof plans its cut inside epoch 0 with that
    boundary still to come (not "no new epoch starts", as six batches would say)."""
    from pipeline.config import load_config
    from pipeline.proof.plan import plan_cut

    sets = {"training.grad_accum_steps": 2, "training.max_steps": 6}
    args = [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    ran = train(data_dir, tmp_path, *args, "--set", "checkpoint.every=1", "--set", "checkpoint.keep_last=6")
    assert ran.returncode == 0, ran.stderr
    recorded = [
        json.loads((tmp_path / f"step-{step:08d}" / "meta.json").read_text())["training_state"]["data"][
            "sampler"
        ]["epoch"]
        for step in range(1, 7)
    ]
    assert recorded == [0, 0, 0, 1, 1, 1]
    plan = plan_cut(load_config(REPO / "config.yaml", {"data.dir": str(data_dir), **sets}), None, None)
    assert plan.epochs[1:] == recorded
    assert (plan.steps, plan.cut) == (6, 2), plan
    assert plan.reason.endswith("step 2 is inside epoch 0; epoch 1 starts at step 4"), plan.reason
    assert plan.to_dict()["first_step_of_a_new_epoch_after_cut"] == 4


@pytest.mark.parametrize("amp", ["none", "bf16", "fp16"])
def test_a_float32_run_trains_on_the_losses_of_its_amp_precision(data_dir, amp):
    """``training.amp: none`` is full precision: the loss a float32 step trains on is the
    task's own loss of that batch, bitwise, not one computed under an autocast; ``bf16`` and
    ``fp16`` are the task's loss under an autocast to that half precision, not the other."""
    from pipeline.config import load_config
    from pipeline.run import build_run
    from pipeline.train import train_step

    sets = {"data.dir": str(data_dir), "training.dtype": "float32", "training.amp": amp}
    config = load_config(REPO / "config.yaml", sets)
    trained = build_run(config, torch.device("cpu"))
    loss, _ = train_step(trained)
    by_hand = build_run(config, torch.device("cpu"))  # the same seed: the same model and batch
    batch, _ = by_hand.feed.next_batch()
    by_hand.model.train()
    half = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    found = {}
    rng = torch.get_rng_state()  # each forward draws the dropout the trained step drew
    for name, dtype in half.items():
        torch.set_rng_state(rng)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None), torch.no_grad():
            found[name] = float(by_hand.data.loss(by_hand.model, batch))
    assert len(set(found.values())) == 3, found  # each precision tells itself from the others
    assert loss == found[amp]


def test_a_bf16_amp_run_trains_and_saves_without_a_grad_scaler(data_dir, tmp_path):
    """bf16 has float32's range: no GradScaler scales its loss or skips its steps, and its
    checkpoint's training state has no scaler state (fp16's only)."""
    from pipeline.config import load_config
    from pipeline.train import train

    overrides = {"training.amp": "bf16", "training.max_steps": 1}
    config = load_config(
        REPO / "config.yaml", {"data.dir": str(data_dir), "checkpoint.dir": str(tmp_path), **overrides}
    )
    state = verify_checkpoint(train(config, progress=False).checkpoint)["training_state"]
    assert sorted(state) == ["callbacks", "data", "optimizer", "progress", "rng", "scaler", "scheduler"]
    assert state["scaler"] is None
