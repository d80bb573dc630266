"""Callbacks, the loop's one extension point (pipeline.callbacks): a user's callback with state is
saved in every checkpoint and resumed bitwise, one may stop the run (committed, recorded,
trained no further on resume unless extended), what one raises is one line; early stopping is
such a callback, exact across a cut."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import RunFolder

from pipeline.checkpoint import CheckpointStore
from pipeline.checkpoint.meta import entry_of
from pipeline.config import load_config
from pipeline.errors import CheckpointError, ConfigError, MetricsError, StateMismatch
from pipeline.proof.plan import controls
from pipeline.train import TrainingHooks, train

from support import (
    HELPERS,
    REPO,
    assert_checkpoints_bitwise_equal,
    read_meta_json,
    reseal,
    run_python,
    script_env,
    verify_checkpoint,
)

CONFIG = REPO / "config.yaml"
LOSS_SUM = "callback_factories:loss_sum"
STOP_AT = "callback_factories:stop_at"
NAMED_STEP = "callback_factories:build_data_metric_named_step"
EVAL = {"training.eval_every": 2, "checkpoint.best_metric": "mse"}
# mse falls ever more slowly as the schedule halves the rate: improvements of more than 0.005
# stop after about 25 steps.
EARLY = {**EVAL, "training.early_stopping_patience": 2, "training.early_stopping_threshold": 0.005}


def _config(data_dir: Path, folder: Path, **overrides):
    return load_config(
        CONFIG,
        {
            "data.dir": str(data_dir),
            "checkpoint.dir": str(folder),
            "training.max_steps": 10,
            "checkpoint.every": 3,
            **overrides,
        },
    )


def _callbacks(folder: Path) -> dict:
    return read_meta_json(folder)["training_state"]["callbacks"]


# -- a callback of the user's ---------------------------------------------------------------


def test_a_callback_with_state_is_saved_in_every_checkpoint_and_resumed_bitwise(data_dir, tmp_path):
    sets = {"training.callbacks": [LOSS_SUM], "training.eval_every": 4}
    straight = train(_config(data_dir, tmp_path / "straight", **sets), progress=False)
    train(_config(data_dir, tmp_path / "cut", **sets), stop_at=5, progress=False)
    state = _callbacks(tmp_path / "cut" / "step-00000005")["states"][LOSS_SUM]
    assert state["steps"] == 5 and state["evaluated"] == [["mse", "rmse"]]
    resumed = train(_config(data_dir, tmp_path / "cut", **sets), resume="latest", progress=False)
    assert_checkpoints_bitwise_equal(straight.checkpoint, resumed.checkpoint)
    assert _callbacks(resumed.checkpoint) == _callbacks(straight.checkpoint)
    state = _callbacks(resumed.checkpoint)["states"][LOSS_SUM]
    # Every step heard once, the losses added in the same order: the same float64 bits.
    assert state["steps"] == 10 and state["total"] == sum(straight.history["loss"])
    assert state["evaluated"] == [["mse", "rmse"]] * 3  # steps 4, 8, 10
    # Each committed checkpoint heard once it was committed (background saves: at the next save).
    assert state["saved"] == [3, 6, 9]


def test_after_each_evaluation_the_model_is_back_in_training_mode(data_dir, tmp_path):
    """evaluate() runs with the model in eval mode (dropout off), then puts it back: the callbacks
    that hear the evaluation, and the steps after it, find the model as training left it."""
    watcher = "callback_factories:mode_watcher"
    sets = {"training.callbacks": [watcher], "training.eval_every": 2}
    result = train(_config(data_dir, tmp_path, **sets), progress=False)
    expected = []
    for step in range(1, 11):
        expected += [["step_end", step, 1]] + ([["evaluate", step, 1]] if step % 2 == 0 else [])
    assert _callbacks(result.checkpoint)["states"][watcher]["heard"] == expected


def test_a_background_save_is_heard_once_committed_not_at_the_next_save(data_dir, tmp_path):
    """checkpoint.async: the save of step 5 commits on its thread while steps go on; its on_save
    comes at the end of the first step that finds it committed (each step here lasts 0.1 s, the
    commit of this tiny checkpoint a few milliseconds), long before the save of step 10."""
    overrides = {"training.callbacks": ["callback_factories:listener"], "checkpoint.every": 5}
    result = train(_config(data_dir, tmp_path, **{"training.max_steps": 11, **overrides}), progress=False)
    heard = _callbacks(result.checkpoint)["states"]["callback_factories:listener"]["heard"]
    assert [saved for _, saved in heard] == [5, 10], heard
    assert 5 <= heard[0][0] < 10, heard  # not when the save of step 10 waits for it


def test_a_checkpoint_written_before_callbacks_and_the_new_history_resumes(data_dir, tmp_path):
    """A checkpoint of the version before: no callbacks component, no history/grad_norm or
    history/epoch. It resumes; the history it lacks reads as NaN (traced as nothing)."""
    from safetensors.torch import load_file, save_file

    config = _config(data_dir, tmp_path)
    train(config, stop_at=5, progress=False)
    folder = tmp_path / "step-00000005"
    state = load_file(folder / "estado_treino.safetensors")
    save_file(
        {k: v for k, v in state.items() if k not in ("history/grad_norm", "history/epoch")},
        folder / "estado_treino.safetensors",
        metadata={"format": "pt", "step": "5"},
    )

    def older(meta: dict) -> None:
        del meta["training_state"]["callbacks"]
        meta["files"]["estado_treino.safetensors"] = entry_of(
            (folder / "estado_treino.safetensors").read_bytes(), None
        )

    reseal(folder, older)
    resumed = train(config, resume="latest", progress=False)
    assert resumed.step == 10
    assert all(math.isnan(value) for value in resumed.history["grad_norm"][:5] + resumed.history["epoch"][:5])
    assert resumed.history["grad_norm"][5] > 0 and resumed.history["epoch"][5] > 0


def test_a_saved_callback_state_is_checked_before_anything_is_set(data_dir, tmp_path):
    config = _config(data_dir, tmp_path, **EARLY, **{"training.max_steps": 6})
    train(config, stop_at=5, progress=False)
    reseal(
        tmp_path / "step-00000005",
        lambda m: m["training_state"]["callbacks"]["states"].update(early_stopping={"waiting": -1}),
    )
    with pytest.raises(
        StateMismatch, match=r"training_state\.callbacks\.states\.early_stopping waiting is -1"
    ):
        train(config, resume="latest", progress=False)
    reseal(
        tmp_path / "step-00000005",
        lambda m: m["training_state"]["callbacks"].update(
            stopped={"step": 3, "by": "x", "reason": "y"}, states={"early_stopping": {"waiting": 0}}
        ),
    )
    with pytest.raises(StateMismatch, match=r"callbacks\.stopped is not the record of a stop at step 5"):
        train(config, resume="latest", progress=False)


def test_a_callback_asking_to_stop_ends_the_run_committed_recorded_and_trained_no_further(
    data_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("STOP_AT", "4")
    config = _config(data_dir, tmp_path, **{"training.callbacks": [STOP_AT]})
    result = train(config, progress=False)
    record = {"step": 4, "by": STOP_AT, "reason": "asked to stop at step 4"}
    assert result.step == 4 and result.stopped == record
    assert result.checkpoint == tmp_path / "step-00000004"
    assert verify_checkpoint(result.checkpoint)["training_state"]["callbacks"]["stopped"] == record
    again = train(config, resume="latest", progress=True)
    assert again.step == 4 and again.stopped == record and again.checkpoint == result.checkpoint
    assert CheckpointStore(tmp_path).committed_steps() == [4]
    said = capsys.readouterr().err
    assert "stopped early at step 4: asked to stop at step 4" in said, said
    # The run is 10 steps: --extend-to must exceed its length, not only the step it stopped at.
    assert "; --extend-to N (N > 10) trains it further" in said, said
    extended = train(config, resume="latest", extend_to=12, progress=False)
    assert extended.step == 12 and extended.stopped is None
    assert _callbacks(extended.checkpoint)["stopped"] is None


def test_a_stop_asked_at_the_step_stop_at_ends_on_is_recorded_and_trains_no_further(
    data_dir, tmp_path, monkeypatch
):
    """--stop-at 4 of a 10-step run, and a callback asks to stop at step 4: the run did stop
    early (the callback's stop, not the cut), so step 4 is committed with the stop recorded,
    and --resume latest trains no further."""
    monkeypatch.setenv("STOP_AT", "4")
    config = _config(data_dir, tmp_path, **{"training.callbacks": [STOP_AT]})
    record = {"step": 4, "by": STOP_AT, "reason": "asked to stop at step 4"}
    result = train(config, stop_at=4, progress=False)
    assert (result.step, result.stopped, result.checkpoint) == (4, record, tmp_path / "step-00000004")
    assert _callbacks(result.checkpoint)["stopped"] == record
    again = train(config, resume="latest", progress=False)
    assert (again.step, again.stopped, again.checkpoint) == (4, record, result.checkpoint)
    assert CheckpointStore(tmp_path).committed_steps() == [4]


def test_a_stop_asked_on_the_last_step_is_a_complete_run_not_an_early_stop(
    data_dir, tmp_path, monkeypatch, capsys
):
    """The run ends at that step either way: meta.json, the card and the line must not claim it
    was cut short, and --extend-to must not be offered as the way past a stop that never was."""
    monkeypatch.setenv("STOP_AT", "10")
    result = train(_config(data_dir, tmp_path, **{"training.callbacks": [STOP_AT]}), progress=False)
    assert result.step == 10 and result.stopped is None
    assert verify_checkpoint(result.checkpoint)["training_state"]["callbacks"]["stopped"] is None
    assert "stopped early" not in capsys.readouterr().err


def test_a_stop_and_a_refused_evaluation_at_one_step_commit_it_stopped_and_its_fix_resumes_to_the_mark(
    data_dir, tmp_path, monkeypatch, capsys
):
    """A callback asks to stop at step 2, the step whose evaluation names no best_metric: both
    are said, the step is committed with the stop recorded, and the command the refusal prints
    trains no further, marks the step the best by the metric it sets and says the run stopped."""
    from pipeline.checkpoint import read_best

    monkeypatch.setenv("STOP_AT", "2")
    hint = "python scripts/02_train.py --resume latest"
    config = _config(
        data_dir, tmp_path, **{**EVAL, "checkpoint.best_metric": "rmes", "training.callbacks": [STOP_AT]}
    )
    with pytest.raises(ConfigError) as refused:
        train(config, resume_hint=hint)
    record = {"step": 2, "by": STOP_AT, "reason": "asked to stop at step 2"}
    assert str(refused.value) == (
        f"{config.source}: checkpoint.best_metric is 'rmes', but the task's evaluate returned mse, rmse: set "
        "checkpoint.best_metric to one of them; step 2 is committed: resume with python scripts/02_train.py "
        "--set checkpoint.best_metric=rmse --resume latest"
    )
    said = [line for line in capsys.readouterr().err.splitlines() if "step 2" in line and "/10" not in line]
    assert CheckpointStore(tmp_path).committed_steps() == [2]
    assert _callbacks(tmp_path / "step-00000002")["stopped"] == record
    fixed = _config(
        data_dir, tmp_path, **{**EVAL, "checkpoint.best_metric": "rmse", "training.callbacks": [STOP_AT]}
    )
    resumed = train(fixed, resume="latest", progress=False)
    assert (resumed.step, resumed.stopped, resumed.checkpoint) == (2, record, tmp_path / "step-00000002")
    (mse,), (rmse,) = resumed.evaluations["mse"], resumed.evaluations["rmse"]
    assert said == [
        f"step 2 evaluation: mse {mse:.6g}, rmse {rmse:.6g}",
        "stopped early at step 2: asked to stop at step 2 (recorded in meta.json)",
    ]
    assert read_best(tmp_path) == {"step": 2, "metric": "rmse", "mode": "min", "value": rmse}


def test_a_failing_callback_is_one_line_naming_it_and_where_to_go_on(data_dir, tmp_path, monkeypatch):
    run = RunFolder(tmp_path)
    sets = (
        "--quiet",
        "--set",
        f"data.dir={data_dir}",
        "--set",
        "training.callbacks=[callback_factories:failing]",
    )
    line = run.refused("02_train.py", *sets)
    assert (
        "training.callbacks callback_factories:failing on_step_end() failed: RuntimeError: the callback's own bug"
        in line
    )
    assert "the last committed checkpoint" not in line and "no checkpoint was committed yet" in line
    line = run.refused("02_train.py", *sets, env={"FAIL_IN": "on_save"})
    assert "on_save() failed" in line and "the last committed checkpoint (step 5) is intact" in line, line


def test_a_callback_asking_to_evaluate_a_task_without_evaluate_is_one_line(data_dir, tmp_path):
    config = _config(
        data_dir,
        tmp_path,
        **{
            "training.callbacks": ["callback_factories:asks_evaluation"],
            "data.factory": "trainer_factories:build_data_without_evaluate",
        },
    )
    with pytest.raises(ConfigError) as refused:
        train(config, progress=False)
    assert str(refused.value) == (
        "a callback asked for an evaluation of step 2 (control.should_evaluate), but the task "
        "(trainer_factories:build_data_without_evaluate) has no evaluate(model, device)"
    )


@pytest.mark.parametrize(
    ("path", "says"),
    [
        (
            "callback_factories:nothing",
            "returned NoneType, which has none of on_step_end, on_evaluate, on_save",
        ),
        ("callback_factories:saves_only", "has state_dict but no load_state_dict"),
        ("callback_factories:loads_only", "has load_state_dict but no state_dict"),
        ("callback_factories:no_such", "has no attribute 'no_such'"),
    ],
)
def test_a_callback_that_is_not_one_is_refused_at_the_start(data_dir, tmp_path, path, says):
    with pytest.raises(ConfigError, match=says):
        train(_config(data_dir, tmp_path, **{"training.callbacks": [path]}), progress=False)
    assert not tmp_path.exists() or not list(tmp_path.glob("step-*"))


def test_a_factory_returning_a_function_is_refused_at_the_start_in_one_line(data_dir, tmp_path):
    """A function named like an event is still no callback: the loop would never call it."""
    path = "callback_factories:a_function"
    with pytest.raises(ConfigError) as refused:
        train(_config(data_dir, tmp_path, **{"training.callbacks": [path]}), progress=False)
    assert str(refused.value) == (
        f"training.callbacks: {path} returned function, which has none of on_step_end, on_evaluate, "
        "on_save: return a callback object (docs/training.md#callbacks)"
    )
    assert not tmp_path.exists() or not list(tmp_path.glob("step-*"))


def test_a_callback_listed_twice_is_refused_at_the_start(data_dir, tmp_path):
    """Its two states would be saved under one name, one overwriting the other."""
    with pytest.raises(ConfigError, match=f"training.callbacks names {LOSS_SUM} twice"):
        train(
            _config(data_dir, tmp_path, **{"training.callbacks": [LOSS_SUM, STOP_AT, LOSS_SUM]}),
            progress=False,
        )
    assert not tmp_path.exists() or not list(tmp_path.glob("step-*"))


def test_a_callback_state_comes_back_with_its_json_types():
    """A flag stays a flag: ``True`` saved is ``True`` resumed, not ``1`` (nor ``1.0``)."""
    from pipeline.callbacks import plain_json

    state = {
        "done": True,
        "off": False,
        "count": 3,
        "rate": 0.5,
        "name": "x",
        "none": None,
        "seen": [True, 2],
    }
    copied = plain_json(state, "state")
    assert copied == state
    assert [type(copied[key]) for key in state] == [bool, bool, int, float, str, type(None), list]
    assert [type(item) for item in copied["seen"]] == [bool, int]


def test_a_callback_state_that_is_not_plain_json_is_refused_before_the_first_step(data_dir, tmp_path):
    config = _config(data_dir, tmp_path, **{"training.callbacks": ["callback_factories:tuple_state"]})
    with pytest.raises(CheckpointError, match=r"callback_factories:tuple_state holds a tuple"):
        train(config, progress=False)
    assert not list(tmp_path.glob("step-*"))


def test_the_tracker_example_logs_each_step_once_across_a_kill(data_dir, tmp_path):
    """examples/tracker_callback.py sends each committed step once: a run SIGKILLed after step 25
    (its checkpoint at 20) and resumed has sent exactly what the run never killed sent."""

    def child(name: str, kill_at: int) -> subprocess.CompletedProcess:
        overrides = {
            "data.dir": str(data_dir),
            "checkpoint.dir": str(tmp_path / name / "estados_local"),
            "checkpoint.every": 10,
            "checkpoint.async": False,
            "training.max_steps": 30,
            "training.eval_every": 5,
            "training.callbacks": ["examples.tracker_callback:jsonl"],
        }
        command = [HELPERS / "traces_child.py", CONFIG, json.dumps(overrides), str(kill_at)]
        return run_python(command, cwd=tmp_path, env=script_env())

    def sent(name: str) -> list[dict]:
        path = tmp_path / name / "estados_local-tracker.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]

    assert child("straight", 0).returncode == 0
    assert child("killed", 25).returncode == -9
    assert [line["step"] for line in sent("killed")] == list(range(1, 21))
    finished = child("killed", 0)
    assert finished.returncode == 0, finished.stderr
    straight = sent("straight")
    assert [line["step"] for line in straight] == list(range(1, 31))
    assert sent("killed") == straight
    assert straight[4]["eval/mse"] > 0 and "eval/mse" not in straight[3]


@pytest.mark.heavy
def test_callbacks_are_a_component_script_03_leaves_out(data_dir, tmp_path):
    assert "callbacks" in controls(_config(data_dir, tmp_path, **EARLY))
    assert "callbacks" in controls(_config(data_dir, tmp_path, **{"training.callbacks": [LOSS_SUM]}))
    assert "callbacks" not in controls(_config(data_dir, tmp_path))


# -- early stopping ------------------------------------------------------------------------


def _expected_stop(evaluations: dict, metric: str, patience: int, threshold: float) -> int | None:
    """transformers' EarlyStoppingCallback rule, applied to a run's evaluations (mode min)."""
    waiting, best = 0, None
    for step, value in zip(evaluations["step"], evaluations[metric]):
        if best is None or (value < best and abs(value - best) > threshold):
            waiting = 0
        else:
            waiting += 1
        best = value if best is None else min(best, value)
        if waiting >= patience:
            return step
    return None


@pytest.fixture(scope="module")
def without_early_stopping(data_dir, tmp_path_factory):
    """The run early stopping would stop, trained to 40 steps without it (its evaluations)."""
    folder = tmp_path_factory.mktemp("plain")
    return train(_config(data_dir, folder, **EVAL, **{"training.max_steps": 40}), progress=False)


def test_the_best_mark_moves_to_each_new_best_as_the_run_trains(data_dir, tmp_path):
    """The best mark is a callback too: after each save it names the committed step that its
    rule gives, not the first step it ever marked."""
    from pipeline.checkpoint import read_best

    marks = []
    hooks = TrainingHooks(
        on_step=lambda run: marks.append((run.step, (read_best(tmp_path) or {}).get("step")))
    )
    sets = {**EVAL, "training.eval_every": 3, "checkpoint.every": 3, "checkpoint.keep_last": 2}
    result = train(_config(data_dir, tmp_path, **sets), hooks=hooks, progress=False)
    evaluated = dict(zip(result.evaluations["step"], result.evaluations["mse"]))
    committed = CheckpointStore(tmp_path).committed_steps()
    best = min((step for step in committed if step in evaluated), key=lambda step: (evaluated[step], step))
    assert read_best(tmp_path)["step"] == best and best != 3, (committed, evaluated)
    assert len({step for _, step in marks if step is not None}) >= 2, marks  # it moved during the run


def test_with_best_mode_max_the_steps_saved_as_new_bests_are_the_new_highest_values(data_dir, tmp_path):
    """A metric that jumps about (``wobble``), evaluated at every step, saved only as new bests
    (and the last step): the steps saved are exactly those whose value is higher than every
    earlier evaluation's, not the new lowest ones."""
    sets = {"data.factory": "trainer_factories:build_data_wobbling_evaluate", "training.eval_every": 1,
            "checkpoint.best_metric": "wobble", "checkpoint.best_mode": "max", "checkpoint.every": 100,
            "checkpoint.keep_last": 100}  # fmt: skip
    result = train(_config(data_dir, tmp_path, **sets), progress=False)
    steps, values = result.evaluations["step"], result.evaluations["wobble"]
    highs = {step for i, step in enumerate(steps) if all(values[i] > v for v in values[:i])}
    lows = {step for i, step in enumerate(steps) if all(values[i] < v for v in values[:i])}
    assert lows - highs - {10}, (steps, values)  # not vacuous: a new lowest value that is no new best
    assert CheckpointStore(tmp_path).committed_steps() == sorted(highs | {10})


def test_an_evaluation_that_only_ties_the_best_is_not_saved(data_dir, tmp_path):
    """A plateaued metric (an ``accuracy`` that reaches 1.0 and stays), evaluated at every
    step, saved only as new bests (and the last step): an evaluation equal to the best is no
    new best (the earliest of equal values stays the best), so it is not saved off the save
    interval."""
    sets = {"data.factory": "trainer_factories:build_data_plateau_evaluate", "training.eval_every": 1,
            "checkpoint.best_metric": "accuracy", "checkpoint.best_mode": "max", "checkpoint.every": 100,
            "checkpoint.keep_last": 100}  # fmt: skip
    result = train(_config(data_dir, tmp_path, **sets), progress=False)
    steps, values = result.evaluations["step"], result.evaluations["accuracy"]
    highs = [step for i, step in enumerate(steps) if all(values[i] > v for v in values[:i])]
    ties = [step for i, step in enumerate(steps) if values[i] == max(values[:i], default=None)]
    assert len(ties) >= 3 and 10 not in highs, (steps, values)  # not vacuous: evaluations that only tie
    assert CheckpointStore(tmp_path).committed_steps() == sorted({*highs, 10})
    from pipeline.checkpoint import read_best

    assert read_best(tmp_path)["step"] == highs[-1]


def test_early_stopping_stops_at_the_step_its_rule_gives(data_dir, tmp_path, without_early_stopping):
    expected = _expected_stop(without_early_stopping.evaluations, "mse", 2, 0.005)
    assert expected is not None and 10 < expected < 40
    assert _expected_stop(without_early_stopping.evaluations, "mse", 2, 0.0) is None  # the threshold counts
    config = _config(data_dir, tmp_path, **EARLY, **{"training.max_steps": 40})
    result = train(config, progress=False)
    reason = "mse did not improve by more than 0.005 for 2 evaluations"
    assert result.step == expected
    assert result.stopped == {"step": expected, "by": "early_stopping", "reason": reason}
    assert _callbacks(result.checkpoint) == {
        "stopped": result.stopped,
        "states": {"early_stopping": {"waiting": 2}},
    }
    # Early stopping changes where the run ends, not what it trains.
    assert result.history["loss"] == without_early_stopping.history["loss"][:expected]


def test_early_stopping_is_exact_across_a_cut_between_evaluations(data_dir, tmp_path, without_early_stopping):
    expected = _expected_stop(without_early_stopping.evaluations, "mse", 2, 0.005)
    straight = train(
        _config(data_dir, tmp_path / "straight", **EARLY, **{"training.max_steps": 40}), progress=False
    )
    # Cut right after the first evaluation that did not improve: the count (1) is state.
    cut_config = _config(data_dir, tmp_path / "cut", **EARLY, **{"training.max_steps": 40})
    cut = train(cut_config, stop_at=expected - 1, progress=False)
    assert _callbacks(cut.checkpoint)["states"]["early_stopping"] == {"waiting": 1}
    resumed = train(cut_config, resume="latest", progress=False)
    assert resumed.step == straight.step == expected and resumed.stopped == straight.stopped
    assert_checkpoints_bitwise_equal(straight.checkpoint, resumed.checkpoint)
    # Resumed again: nothing more to train; extended: trains on, and the next evaluation that
    # does not improve stops it again.
    again = train(cut_config, resume="latest", progress=False)
    assert again.step == expected and again.checkpoint == resumed.checkpoint
    extended = train(cut_config, resume="latest", extend_to=60, progress=False)
    assert extended.step == expected + 2 and extended.stopped["step"] == expected + 2


def test_an_early_stopped_run_is_staged_with_its_stop_on_the_card(trained_run, tmp_path):
    run = RunFolder(tmp_path)
    shutil.copytree(trained_run.root / "data", run.root / "data")
    sets = [item for key, value in EARLY.items() for item in ("--set", f"{key}={value}")]
    trained = run.ok("02_train.py", "--quiet", "--max-steps", "40", *sets)
    assert "trained to step" in trained.stdout
    stopped = read_meta_json(run.checkpoint)["training_state"]["callbacks"]["stopped"]
    assert stopped is not None and stopped["by"] == "early_stopping"
    resumed = run.script("02_train.py", "--max-steps", "40", *sets, "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr
    assert f"stopped early at step {stopped['step']}: {stopped['reason']}" in resumed.stderr
    assert not [line for line in resumed.stderr.splitlines() if line.startswith("step ")]  # nothing trained
    run.ok("05_stage.py", "--no-metrics")
    card = (run.stage / "README.md").read_text()
    assert f"This is step **{stopped['step']}**, the last step of its run" in card
    assert (
        f"It stopped early at step {stopped['step']}: mse did not improve by more than 0.005 for 2 "
        "evaluations (early\\_stopping)."
    ) in card
    assert json.loads((run.stage / "meta.json").read_text())["training"]["stopped"] == stopped


def test_an_evaluate_returning_a_metric_named_step_is_refused_before_anything_is_recorded(
    data_dir, tmp_path, capsys, without_early_stopping
):
    """ "step" names the evaluated steps' own tensor: its values would be mixed into them. The
    two steps trained are said; the refused evaluation is not."""
    config = _config(data_dir, tmp_path, **{"training.eval_every": 2, "data.factory": NAMED_STEP})
    capsys.readouterr()
    with pytest.raises(MetricsError, match=r"evaluate\(\) returned a metric named 'step'"):
        train(config)
    printed = capsys.readouterr()
    history = without_early_stopping.history  # the same training, evaluated without a refusal
    assert (printed.out, printed.err.splitlines()) == (
        "",
        [
            f"step {step}/10  loss {history['loss'][step - 1]:.6g}  lr {history['lr'][step - 1]:.6g}"
            for step in (1, 2)
        ],
    )
    assert not tmp_path.exists() or not list(tmp_path.glob("step-*"))


def test_early_stopping_settings_may_change_on_resume(data_dir, tmp_path):
    """Patience and threshold are the user's to retune mid-run (as for Trainer, a resume with
    another EarlyStoppingCallback): not a changed config that refuses the resume."""
    sets = {**EARLY, "training.max_steps": 8}
    train(_config(data_dir, tmp_path, **sets), stop_at=4, progress=False)
    retuned = {**sets, "training.early_stopping_patience": 3, "training.early_stopping_threshold": 0.001}
    assert train(_config(data_dir, tmp_path, **retuned), resume="latest", progress=False).step == 8


def test_a_callback_added_or_removed_on_resume_is_not_a_changed_config(data_dir, tmp_path, capsys):
    """What callbacks run changes what they see, not what is trained: a resume that adds one
    (it starts afresh, and says so) or drops one (its saved state is left out, and it says so)
    trains on to the end, bitwise the run that never changed them."""
    straight = train(_config(data_dir, tmp_path / "straight"), progress=False)
    train(_config(data_dir, tmp_path / "added"), stop_at=4, progress=False)
    capsys.readouterr()
    added = train(
        _config(data_dir, tmp_path / "added", **{"training.callbacks": [LOSS_SUM]}), resume="latest"
    )
    assert f"callback {LOSS_SUM} has no state in the checkpoint: it starts afresh" in capsys.readouterr().err
    assert added.step == 10 and added.history["loss"] == straight.history["loss"]
    assert _callbacks(added.checkpoint)["states"][LOSS_SUM]["steps"] == 6  # heard from step 5 on
    assert_checkpoints_bitwise_equal(straight.checkpoint, added.checkpoint)

    train(
        _config(data_dir, tmp_path / "removed", **{"training.callbacks": [LOSS_SUM]}),
        stop_at=4,
        progress=False,
    )
    capsys.readouterr()
    removed = train(_config(data_dir, tmp_path / "removed"), resume="latest")
    note = f"the checkpoint's state of callback {LOSS_SUM} is left out: no such callback runs"
    assert note in capsys.readouterr().err
    assert removed.step == 10 and removed.history["loss"] == straight.history["loss"]
    assert _callbacks(removed.checkpoint)["states"] == {}


@pytest.mark.parametrize(
    ("given", "fix", "not_fix", "sets"),
    [
        ("rmes", "rmse", "mse", {}),
        # Early stopping watches the same name: it passes over the evaluation, which is refused.
        ("accuracy", "mse", "rmse", {"training.early_stopping_patience": 1}),
    ],
    ids=["rmes-rmse-mse", "accuracy-mse-rmse"],  # the ids mutation lists name
)
def test_a_misspelt_best_metric_is_refused_at_its_first_evaluation_with_the_closest_name(
    data_dir, tmp_path, given, fix, not_fix, sets
):
    """The resume command it prints sets the name closest to the misspelt one (rmse, not mse,
    the first in order), so following it runs; a name close to none sets the first."""
    config = _config(data_dir, tmp_path, **{**EVAL, "checkpoint.best_metric": given, **sets})
    with pytest.raises(ConfigError) as refused:
        train(config, progress=False)
    message = str(refused.value)
    assert message.startswith(
        f"{config.source}: checkpoint.best_metric is {given!r}, but the task's evaluate returned mse, rmse: set "
        "checkpoint.best_metric to one of them; "
    ), message
    assert (
        f"checkpoint.best_metric={fix} " in message and f"checkpoint.best_metric={not_fix} " not in message
    ), message


def test_early_stopping_without_a_metric_to_watch_is_refused_in_one_line(data_dir, tmp_path):
    run = RunFolder(tmp_path)
    line = run.refused(
        "02_train.py", "--set", f"data.dir={data_dir}", "--set", "training.early_stopping_patience=3"
    )
    assert "training.early_stopping_patience counts evaluations of checkpoint.best_metric" in line, line
    assert "config.yaml" in line


def test_the_proof_hook_still_hears_every_step(data_dir, tmp_path):
    """Every step of the run, and none past it: a --stop-at beyond the run's length ends it at its last."""
    heard = []
    result = train(
        _config(data_dir, tmp_path),
        progress=False,
        stop_at=12,
        hooks=TrainingHooks(on_step=lambda run: heard.append(run.step)),
    )
    assert heard == list(range(1, 11)) and result.step == 10


def test_a_signal_during_a_save_step_stops_after_it_with_that_checkpoint_saved_once(data_dir, tmp_path):
    """SIGTERM while step 3 trains, and step 3 is a save step: the run stops after it, saying so
    in one line with the checkpoint the step saved (saved once, not again for the stop)."""
    import os
    import signal

    from pipeline.errors import Preempted

    saved = []

    class Counting:
        def on_save(self, run, checkpoint, control) -> None:
            saved.append(checkpoint.step)

    def on_start(run) -> None:
        run.callbacks.add("counting", Counting())

    def on_step(run) -> None:
        if run.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Preempted) as stopped:
        train(
            _config(data_dir, tmp_path),
            progress=False,
            resume_hint="go on",
            hooks=TrainingHooks(on_start=on_start, on_step=on_step),
        )
    assert (str(stopped.value), stopped.value.exit_code) == (
        f"stopped by SIGTERM after step 3; checkpoint {tmp_path / 'step-00000003'} is committed. Resume with: go on",
        128 + signal.SIGTERM,
    )
    assert saved == [3] and CheckpointStore(tmp_path).committed_steps() == [3]


def test_a_callbacks_flags_are_json_in_meta(data_dir, tmp_path):
    """The component is plain JSON in meta.json: nothing of it in the state file."""
    result = train(_config(data_dir, tmp_path, **{"training.callbacks": [LOSS_SUM]}), progress=False)
    meta = json.loads((result.checkpoint / "meta.json").read_text())
    assert set(meta["training_state"]["callbacks"]) == {"stopped", "states"}


@pytest.mark.parametrize(
    ("mode", "threshold", "values", "stops_at"),
    [
        # max: 2 and 3 improve; 1.5, 2.9, 2.8 do not: the second in a row stops the run.
        ("max", 0.0, [1.0, 2.0, 1.5, 3.0, 2.9, 2.8, 2.7], 6),
        # min: the evaluations without improvement are counted in a row, reset by each new best.
        ("min", 0.0, [5.0, 6.0, 4.0, 7.0, 3.0, 8.0, 9.0, 1.0], 7),
        # An improvement by no more than the threshold is none (4.6 and 4.5 beat the best by 0.4, 0.1).
        ("min", 0.5, [5.0, 4.6, 4.5, 1.0], 3),
        # max with a threshold: 3 beats 2 by 1; 3.4 beats 3 by 0.4 only.
        ("max", 0.5, [2.0, 3.0, 3.4, 3.3, 9.0], 4),
        # Compared with the best so far, not the evaluation before: 3.5 beats 4.0, not 3.0.
        ("min", 0.0, [5.0, 3.0, 4.0, 3.5, 9.0], 4),
        # Beating the best by exactly the threshold is no improvement (by more than it is).
        ("min", 0.5, [5.0, 4.5, 4.0, 9.0], 3),
        # A value equal to the best is no improvement, in either mode.
        ("min", 0.0, [5.0, 5.0, 4.0, 4.0, 4.0], 5),
        ("max", 0.0, [2.0, 2.0, 3.0, 3.0, 3.0], 5),
    ],
    ids=[
        "max-mode",
        "in-a-row",
        "min-threshold",
        "max-threshold",
        "against-the-best",
        "exactly-the-threshold",
        "min-tie",
        "max-tie",
    ],
)
def test_early_stopping_counts_as_transformers_does(mode, threshold, values, stops_at):
    """EarlyStopping alone, evaluation after evaluation, patience 2: the evaluation at which it
    asks to stop, by Trainer's rule (an improvement beats the best earlier value by more than
    the threshold; patience evaluations in a row without one stop the run)."""
    from types import SimpleNamespace

    from pipeline.callbacks import Control, EarlyStopping

    stopping = EarlyStopping("loss", mode, 2, threshold)
    run = SimpleNamespace(evaluations={"step": [], "loss": []})
    asked = None
    for index, value in enumerate(values, start=1):
        run.evaluations["step"].append(index)
        run.evaluations["loss"].append(value)
        control = Control()
        stopping.on_evaluate(run, {"loss": value}, control)
        if control.should_training_stop:
            asked = index
            break
    assert asked == stops_at


def test_the_flags_every_rank_agrees_on_keep_their_meaning():
    """Under torchrun, Control.agreed combines the ranks' flags (any rank asking counts): a save
    asked on this rank and an evaluation asked on another come back as a save and an
    evaluation on both; a save asked alone, as a save alone."""
    from pipeline.callbacks import Control

    other_rank = [0, 0, 1]  # the other rank asks only to evaluate
    control = Control(should_save=True, agree=lambda flags: [max(a, b) for a, b in zip(flags, other_rank)])
    control.agreed()
    assert (control.should_training_stop, control.should_save, control.should_evaluate) == (False, True, True)
    alone = Control(should_save=True, agree=lambda flags: list(flags))
    alone.agreed()
    assert (alone.should_training_stop, alone.should_save, alone.should_evaluate) == (False, True, False)


def test_early_stopping_without_a_best_metric_is_refused_in_one_line(data_dir, tmp_path):
    with pytest.raises(ConfigError, match="early_stopping_patience") as refused:
        _config(data_dir, tmp_path, **{"training.early_stopping_patience": 2, "training.eval_every": 2})
    assert "\n" not in str(refused.value)
    config = _config(
        data_dir,
        tmp_path,
        **{"training.early_stopping_patience": 2, "training.eval_every": 2, "checkpoint.best_metric": "mse"},
    )
    assert config.training.early_stopping_patience == 2


@pytest.mark.parametrize(
    ("patience", "reason"),
    [
        (1, "loss did not improve by more than 0.25 for 1 evaluation"),
        (2, "loss did not improve by more than 0.25 for 2 evaluations"),
    ],
)
def test_early_stopping_says_what_it_waited_for(patience, reason):
    """The stop's reason, recorded in meta.json and on the card: the metric, the threshold and
    the patience, 'evaluation' in the singular for a patience of 1."""
    from types import SimpleNamespace

    from pipeline.callbacks import Control, EarlyStopping

    stopping = EarlyStopping("loss", "min", patience, 0.25)
    run = SimpleNamespace(evaluations={"step": [], "loss": []})
    for step in range(1, patience + 2):
        run.evaluations["step"].append(step)
        run.evaluations["loss"].append(1.0)
        control = Control()
        stopping.on_evaluate(run, {"loss": 1.0}, control)
    assert (control.should_training_stop, control.stop_reason, stopping.state_dict()) == (
        True,
        reason,
        {"waiting": patience},
    )


def test_a_saved_early_stopping_count_is_checked_on_both_sides_of_its_bounds():
    """0 and up are counts a run saves; a negative count, a bool, a float or another key is not."""
    from pipeline.callbacks import EarlyStopping

    stopping = EarlyStopping("loss", "min", 2, 0.0)
    for good in (0, 3):
        stopping.load_state_dict({"waiting": good})
        assert stopping.state_dict() == {"waiting": good}
    refused = {
        "-1": ({"waiting": -1}, "waiting is -1, expected an integer >= 0"),
        "bool": ({"waiting": True}, "waiting is True, expected an integer >= 0"),
        "float": ({"waiting": 1.0}, "waiting is 1.0, expected an integer >= 0"),
        "a key more": ({"waiting": 1, "best": 2}, "is not {waiting}"),
        "a list": ([1], "is not {waiting}"),
    }
    for state, says in refused.values():
        with pytest.raises(ValueError) as caught:
            stopping.check_state(state)
        assert str(caught.value) == says
    assert stopping.state_dict() == {"waiting": 3}


def test_the_record_of_a_stop_names_who_asked_and_says_why_by_default():
    from pipeline.callbacks import Callbacks, Control

    callbacks = Callbacks()
    assert callbacks.record_stop(4, Control(stopped_by="mine", stop_reason="enough")) == {
        "step": 4,
        "by": "mine",
        "reason": "enough",
    }
    assert callbacks.record_stop(5, Control(stopped_by="mine")) == {
        "step": 5,
        "by": "mine",
        "reason": "mine asked to stop",
    }
    assert callbacks.record_stop(6, Control()) == {
        "step": 6,
        "by": "a callback",
        "reason": "a callback asked to stop",
    }
    assert callbacks.stopped == {"step": 6, "by": "a callback", "reason": "a callback asked to stop"}


@pytest.mark.parametrize(
    ("stopped", "step"),
    [
        ({"step": 3, "by": "x", "reason": 5}, 3),
        ({"step": 3, "by": None, "reason": "y"}, 3),
        ({"step": True, "by": "x", "reason": "y"}, 1),
        ({"step": 2, "by": "x", "reason": "y"}, 3),
        ({"step": 3, "by": "x"}, 3),
        (["step", 3], 3),
    ],
    ids=["reason-not-text", "by-not-text", "step-a-bool", "another-step", "no-reason", "a-list"],
)
def test_a_saved_stop_record_is_checked_field_by_field(stopped, step):
    from pipeline.callbacks import Callbacks
    from pipeline.errors import SEALED_BUT_UNFIT

    callbacks = Callbacks()
    callbacks.check({"stopped": {"step": step, "by": "x", "reason": "y"}, "states": {}}, step)
    callbacks.check({"stopped": None, "states": {}}, step)
    with pytest.raises(StateMismatch) as refused:
        callbacks.check({"stopped": stopped, "states": {}}, step)
    assert str(refused.value) == (
        f"training_state.callbacks.stopped is not the record of a stop at step {step} (step, by, reason): "
        f"{SEALED_BUT_UNFIT}"
    )
    assert callbacks.stopped is None


def test_a_callback_state_may_nest_to_the_depth_limit_and_no_deeper():
    from pipeline.callbacks import plain_json

    def nested(levels):
        value = 1
        for _ in range(levels):
            value = [value]
        return value

    assert plain_json(nested(32), "state") == nested(32)
    with pytest.raises(TypeError) as refused:
        plain_json(nested(33), "state")
    assert str(refused.value) == "state is nested deeper than 32 levels"


def test_callbacks_hear_each_event_in_the_order_added_one_added_first_before_them():
    from pipeline.callbacks import Callbacks, Control

    heard = []

    class Hears:
        def __init__(self, name):
            self.name = name

        def on_step_end(self, run, control):
            heard.append(("step", self.name))

        def on_evaluate(self, run, metrics, control):
            heard.append(("evaluate", self.name))

    callbacks = Callbacks()
    callbacks.add("a", Hears("a"))
    callbacks.add("b", Hears("b"))
    callbacks.add("first", Hears("first"), first=True)
    control = Control()
    callbacks.on_step_end(None, control)
    callbacks.on_evaluate(None, {}, control)
    assert [name for name, _ in callbacks] == ["first", "a", "b"]
    assert heard == [("step", "first"), ("step", "a"), ("step", "b")] + [
        ("evaluate", "first"),
        ("evaluate", "a"),
        ("evaluate", "b"),
    ]


@pytest.mark.parametrize(
    "sets, built",
    [
        pytest.param(
            {**EARLY, "checkpoint.best_metric": "rmse", "checkpoint.best_mode": "max"},
            ("rmse", "max", 2, 0.005, 0),
            id="every-setting",
        ),
        # The patience is what turns early stopping on: set alone, the threshold keeps its default 0.
        pytest.param(
            {**EVAL, "training.early_stopping_patience": 3}, ("mse", "min", 3, 0.0, 0), id="patience-alone"
        ),
        pytest.param(EVAL, None, id="no-patience"),
    ],
)
def test_early_stopping_is_built_with_the_configs_metric_mode_patience_and_threshold(
    data_dir, tmp_path, sets, built
):
    from pipeline.callbacks import EarlyStopping, build_callbacks

    callbacks = dict(build_callbacks(_config(data_dir, tmp_path, **sets)))
    if built is None:
        assert list(callbacks) == ["schedule"]
        return
    assert list(callbacks) == ["schedule", "early_stopping"]
    stopping = callbacks["early_stopping"]
    assert isinstance(stopping, EarlyStopping)
    assert (stopping.metric, stopping.mode, stopping.patience, stopping.threshold, stopping.waiting) == built


class _Keeps:
    """A user's callback whose state is whatever it was given (its check refuses a negative count)."""

    def __init__(self, state):
        self.state, self.loaded = state, []

    def on_step_end(self, run, control):
        pass

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.loaded.append(state)

    def check_state(self, state):
        if state.get("n") == "x":
            raise TypeError("n is text")
        if state.get("n") == 99:
            raise KeyError("n")
        if state.get("n", 0) < 0:
            raise ValueError(f"n is {state['n']}, expected >= 0")


def test_a_callback_state_keyed_by_anything_but_text_is_refused_saving_and_resuming():
    """JSON keys are text: a state {1: ...} saved would come back {"1": ...} on resume."""
    from pipeline.callbacks import Callbacks, plain_json
    from pipeline.errors import SEALED_BUT_UNFIT, CallbackFailed

    for state in ({1: "a"}, {"ok": [{"x": 1, 2: "b"}]}, {None: 1}):
        with pytest.raises(TypeError) as refused:
            plain_json(state, "the state")
        assert str(refused.value) == "the state has a key that is not a string"
    callbacks = Callbacks()
    callbacks.add("mine", _Keeps({"ok": {1: "a"}}), user=True)
    with pytest.raises(CallbackFailed) as refused:
        callbacks.state()
    assert str(refused.value) == (
        "training.callbacks: the state_dict() of callback mine has a key that is not a string"
    )
    with pytest.raises(StateMismatch) as refused:
        callbacks.check({"stopped": None, "states": {"mine": {"ok": {1: "a"}}}}, 3)
    assert str(refused.value) == (
        "training_state.callbacks.states.mine is not plain JSON (mine has a key that is not a string): "
        f"{SEALED_BUT_UNFIT}"
    )


def test_a_callbacks_state_is_a_copy_of_every_stateful_callbacks_and_the_stop():
    """The callbacks may keep changing the objects they returned, the loop its stop record."""
    from pipeline.callbacks import Callbacks, Control, Schedule

    mine, other = _Keeps({"seen": [1, {"a": 2}]}), _Keeps({"n": 0})
    callbacks = Callbacks()
    callbacks.add("schedule", Schedule())
    callbacks.add("mine", mine, user=True)
    callbacks.add("other", other, user=True)
    assert callbacks.state() == {
        "stopped": None,
        "states": {"mine": {"seen": [1, {"a": 2}]}, "other": {"n": 0}},
    }
    callbacks.record_stop(4, Control(stopped_by="mine"))
    state = callbacks.state()
    mine.state["seen"][1]["a"] = 3
    mine.state["seen"].append(5)
    callbacks.stopped["reason"] = "changed"
    assert state == {
        "stopped": {"step": 4, "by": "mine", "reason": "mine asked to stop"},
        "states": {"mine": {"seen": [1, {"a": 2}]}, "other": {"n": 0}},
    }


def test_a_saved_callbacks_component_is_checked_whole_before_anything_is_set():
    from pipeline.callbacks import Callbacks
    from pipeline.errors import SEALED_BUT_UNFIT, CallbackFailed

    mine = _Keeps({"n": 0})
    callbacks = Callbacks()
    callbacks.add("mine", mine, user=True)
    callbacks.add("late", _Keeps({"n": 0}), user=True)
    # A state for a callback not running, none for one running: both fine.
    callbacks.check({"stopped": None, "states": {"mine": {"n": 2}, "gone": {"n": -1}}}, 3)
    refused = {
        "training_state.callbacks does not hold exactly stopped, states": [
            [],
            {"stopped": None},
            {"stopped": None, "states": {}, "more": 1},
        ],
        "training_state.callbacks.states is not a mapping of callback names to their state": [
            {"stopped": None, "states": []},
            {"stopped": None, "states": {"mine": {"n": 1}, 1: {}}},
        ],
        "training_state.callbacks.states.mine is not plain JSON (mine holds a tuple: a callback's state "
        "is plain JSON (dict, list, str, int, float, bool, None))": [
            {"stopped": None, "states": {"mine": {"n": (1,)}}}
        ],
        "training_state.callbacks.states.mine n is -1, expected >= 0": [
            {"stopped": None, "states": {"mine": {"n": -1}}}
        ],
        "training_state.callbacks.states.late n is text": [
            {"stopped": None, "states": {"mine": {"n": 1}, "late": {"n": "x"}}},
            {"stopped": None, "states": {"late": {"n": "x"}}},
        ],
    }
    for says, saved_states in refused.items():
        for saved in saved_states:
            with pytest.raises(StateMismatch) as refusal:
                callbacks.check(saved, 3)
            assert str(refusal.value) == f"{says}: {SEALED_BUT_UNFIT}"
    # Anything else a check raises is the callback's own failure, not the checkpoint's.
    with pytest.raises(CallbackFailed) as failed:
        callbacks.check({"stopped": None, "states": {"mine": {"n": 99}}}, 3)
    assert str(failed.value) == (
        "training.callbacks mine check_state() failed: KeyError: 'n' "
        "(fix the callback; --debug prints the traceback)"
    )
    assert mine.loaded == [] and callbacks.stopped is None


def test_a_saved_callbacks_component_is_loaded_as_copies_with_a_line_for_each_left_out():
    from pipeline.callbacks import Callbacks

    mine, fresh, late = _Keeps({"n": 0}), _Keeps({"n": 0}), _Keeps({"n": 0})
    callbacks = Callbacks()
    callbacks.add("mine", mine, user=True)
    callbacks.add("fresh", fresh, user=True)
    callbacks.add("late", late, user=True)  # after one without state: its own still comes back
    saved = {
        "stopped": {"step": 3, "by": "mine", "reason": "done"},
        "states": {"mine": {"seen": [1]}, "zeta": {}, "alpha": {}, "late": {"n": 2}},
    }
    callbacks.notes = ["from before"]
    callbacks.load(saved)
    assert callbacks.stopped == {"step": 3, "by": "mine", "reason": "done"}
    assert (mine.loaded, fresh.loaded, late.loaded) == ([{"seen": [1]}], [], [{"n": 2}])
    assert callbacks.notes == [
        "callback fresh has no state in the checkpoint: it starts afresh",
        "the checkpoint's state of callback alpha is left out: no such callback runs",
        "the checkpoint's state of callback zeta is left out: no such callback runs",
    ]
    mine.loaded[0]["seen"].append(2)
    callbacks.stopped["step"] = 9
    assert saved == {
        "stopped": {"step": 3, "by": "mine", "reason": "done"},
        "states": {"mine": {"seen": [1]}, "zeta": {}, "alpha": {}, "late": {"n": 2}},
    }


def test_a_stop_asked_on_another_rank_is_recorded_as_the_first_rank_that_asked_says():
    from pipeline.callbacks import Callbacks, Control

    ranks = [["", ""], ["mine", "enough"], ["other", "also"]]
    control = Control()
    gather = lambda text: [text if not by else json.dumps([by, why]) for by, why in ranks]  # noqa: E731
    assert Callbacks().record_stop(7, control, gather) == {"step": 7, "by": "mine", "reason": "enough"}
    assert (control.stopped_by, control.stop_reason) == ("mine", "enough")
    # The first rank that asked, though it gave no reason and a later one did.
    ranks[1] = ["mine", ""]
    assert Callbacks().record_stop(7, Control(), gather) == {
        "step": 7,
        "by": "mine",
        "reason": "mine asked to stop",
    }
    asked_here = Control(stopped_by="here", stop_reason="")
    assert Callbacks().record_stop(7, asked_here, lambda text: [text, json.dumps(["", ""])]) == {
        "step": 7,
        "by": "here",
        "reason": "here asked to stop",
    }


def test_the_schedule_saves_and_evaluates_on_its_intervals_and_at_the_last_step():
    from types import SimpleNamespace

    from pipeline.callbacks import Control, Schedule

    def asked(every, eval_every):
        config = SimpleNamespace(
            training=SimpleNamespace(max_steps=7, eval_every=eval_every),
            checkpoint=SimpleNamespace(every=every),
        )
        saves, evaluations = [], []
        for step in range(1, 8):
            control = Control()
            Schedule().on_step_end(SimpleNamespace(step=step, config=config), control)
            saves += [step] if control.should_save else []
            evaluations += [step] if control.should_evaluate else []
            assert not control.should_training_stop
        return saves, evaluations

    assert asked(3, 2) == ([3, 6, 7], [2, 4, 6, 7])
    assert asked(7, 0) == ([7], [])


def test_the_progress_log_prints_each_logged_step_and_the_last_one_off_the_interval():
    """Without a terminal, a line at every step ``training.log_every`` logs and at the run's
    last (7 is not a multiple of 3); a message between them; nothing at all when disabled."""
    import io
    from types import SimpleNamespace

    from pipeline.progress import Progress

    stream = io.StringIO()
    report = Progress(total=7, initial=0, log_every=3, stream=stream)
    history = {"loss": [], "lr": []}
    for step in range(1, 8):
        history["loss"].append(step / 8)
        history["lr"].append(step / 1000)
        report.on_step_end(SimpleNamespace(step=step, history=history), None)
        if step == 4:
            report.message("a note")
    report.close()
    assert stream.getvalue() == (
        "step 3/7  loss 0.375  lr 0.003\na note\nstep 6/7  loss 0.75  lr 0.006\nstep 7/7  loss 0.875  lr 0.007\n"
    )
    quiet = io.StringIO()
    off = Progress(total=7, initial=0, log_every=1, stream=quiet, enabled=False)
    off.update(7, 0.5, 0.1)
    off.message("a note")
    assert quiet.getvalue() == ""


def test_a_finished_step_clears_its_save_and_evaluation_but_not_a_stop():
    from pipeline.callbacks import Control

    control = Control(should_training_stop=True, should_save=True, should_evaluate=True)
    control.step_done()
    flags = (control.should_training_stop, control.should_save, control.should_evaluate)
    assert flags == (True, False, False)


class _AsksToStop:
    def __init__(self, at, reason=""):
        self.at, self.reason = at, reason

    def on_step_end(self, run, control):
        if run.step == self.at:
            control.should_training_stop = True
            control.stop_reason = control.stop_reason or self.reason


class _WithdrawsEarlyStops:
    def on_step_end(self, run, control):
        if run.step < 5:
            control.should_training_stop = False


def test_a_stop_withdrawn_by_a_later_callback_leaves_no_name_or_reason_to_a_later_stop():
    """A callback may withdraw a stop an earlier one asked (should_training_stop set back): the
    run goes on, and a stop asked at a later step is recorded as its own callback's, with its own
    reason (none given: '<name> asked to stop'), not the withdrawn one's."""
    from types import SimpleNamespace

    from pipeline.callbacks import Callbacks, Control

    callbacks = Callbacks()
    callbacks.add("early", _AsksToStop(3, "too soon"), user=True)
    callbacks.add("guard", _WithdrawsEarlyStops(), user=True)
    callbacks.add("late", _AsksToStop(7), user=True)
    control = Control()
    for step in range(1, 9):
        callbacks.on_step_end(SimpleNamespace(step=step), control)
        if control.should_training_stop:
            break
        control.step_done()
    assert callbacks.record_stop(step, control) == {"step": 7, "by": "late", "reason": "late asked to stop"}


def test_a_stop_withdrawn_and_asked_again_at_the_same_step_is_the_second_askers():
    """A stop withdrawn, then asked again by a later callback hearing the same event: the run
    stops there, recorded as the callback that asked again, with its reason (none given:
    '<name> asked to stop'), never the withdrawn one's."""
    from types import SimpleNamespace

    from pipeline.callbacks import Callbacks, Control

    for again, record in (
        (_AsksToStop(3, "enough after all"), {"step": 3, "by": "again", "reason": "enough after all"}),
        (_AsksToStop(3), {"step": 3, "by": "again", "reason": "again asked to stop"}),
    ):
        callbacks = Callbacks()
        callbacks.add("early", _AsksToStop(3, "too soon"), user=True)
        callbacks.add("guard", _WithdrawsEarlyStops(), user=True)
        callbacks.add("again", again, user=True)
        control = Control()
        callbacks.on_step_end(SimpleNamespace(step=3), control)
        assert control.should_training_stop and callbacks.record_stop(3, control) == record
