"""Several evaluation sets (evaluate returning {set: {metric: value}}), named set/metric in the
run's evaluations, its checkpoints, its traces, 04's record and checkpoint.best_metric; and an
evaluate whose names change, refused at the evaluation that shows it, before anything of that
step is recorded or written (in one process, and across a resume)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipeline.checkpoint import CheckpointStore, load_checkpoint, read_best, read_tensors
from pipeline.config import load_config
from pipeline.errors import CheckpointError, ConfigError, MetricsError
from pipeline.evaluate import check_metrics, evaluate_checkpoint
from pipeline.train import train

from support import REPO

CONFIG = REPO / "config.yaml"
TWO_SETS = {"data.factory": "callback_factories:build_data_two_sets"}
ADDED_LATER = {"data.factory": "callback_factories:build_data_metric_added_later"}


def _config(data_dir: Path, folder: Path, **overrides):
    return load_config(
        CONFIG,
        {
            "data.dir": str(data_dir),
            "checkpoint.dir": str(folder / "ck"),
            "outputs.metrics": str(folder / "metrics.json"),
            "training.max_steps": 10,
            "training.eval_every": 2,
            **overrides,
        },
    )


def test_several_sets_are_named_set_slash_metric_traced_and_used_for_the_best_mark(data_dir, tmp_path):
    config = _config(
        data_dir, tmp_path, **TWO_SETS, **{"checkpoint.best_metric": "test/mse", "checkpoint.every": 20}
    )
    result = train(config, progress=False)
    assert sorted(result.evaluations) == ["step", "test/mse", "validation/mse"]
    assert result.evaluations["step"] == [2, 4, 6, 8, 10]
    # The best of test/mse is marked and kept (saved off the interval when it is a new best).
    values = result.evaluations["test/mse"]
    best_step = result.evaluations["step"][values.index(min(values))]
    mark = read_best(tmp_path / "ck")
    assert mark == {"step": best_step, "metric": "test/mse", "mode": "min", "value": min(values)}
    assert best_step in CheckpointStore(tmp_path / "ck").committed_steps()
    # In the checkpoint, read back through its check; in the traces, by set.
    loaded = load_checkpoint(result.checkpoint)
    assert (
        read_tensors(result.checkpoint / "estado_treino.safetensors")["evaluation/test/mse"].tolist()
        == values
    )
    assert loaded.meta["step"] == 10
    traces = EventAccumulator(str(tmp_path / "traces" / "ck"), size_guidance={"scalars": 0})
    traces.Reload()
    tags = traces.Tags()["scalars"]
    assert {"eval/validation/mse", "eval/test/mse"} <= set(tags), tags
    assert [e.step for e in traces.Scalars("eval/test/mse")] == [2, 4, 6, 8, 10]
    # Script 04 records the same names.
    record = evaluate_checkpoint(config)
    assert sorted(record["metrics"]) == ["test/mse", "validation/mse"]


def test_metric_names_that_change_are_refused_before_anything_of_their_step_is_written(
    data_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("EXTRA_FROM", "3")  # the third evaluation (step 6) adds validation/mae
    config = _config(data_dir, tmp_path, **ADDED_LATER, **{"checkpoint.every": 2, "checkpoint.keep_last": 5})
    capsys.readouterr()
    with pytest.raises(MetricsError) as refused:
        train(config)
    printed = capsys.readouterr()
    # Every step trained and every evaluation recorded is said, as the run whose names never
    # change trains and evaluates them; the refused evaluation of step 6 is not said at all.
    monkeypatch.setenv("EXTRA_FROM", "99")
    unchanged = train(_config(data_dir, tmp_path / "unchanged", **ADDED_LATER), stop_at=6, progress=False)
    history, evaluations = unchanged.history, unchanged.evaluations
    said = []
    for step in range(1, 7):
        said.append(f"step {step}/10  loss {history['loss'][step - 1]:.6g}  lr {history['lr'][step - 1]:.6g}")
        if step in (2, 4):
            at = evaluations["step"].index(step)
            said.append(
                f"step {step} evaluation: validation/mse {evaluations['validation/mse'][at]:.6g}, "
                f"test/mse {evaluations['test/mse'][at]:.6g}"
            )
    assert (printed.out, printed.err.splitlines()) == ("", said)
    message = str(refused.value)
    assert (
        "returned other metrics at step 6 than at the run's earlier evaluations (new: validation/mae)"
        in message
    )
    assert (
        "nothing of step 6 was recorded" in message
        and "the last committed checkpoint (step 4) is intact" in message
    )
    assert "\n" not in message
    assert CheckpointStore(tmp_path / "ck").committed_steps() == [2, 4]
    # What was committed loads whole, its evaluations checked.
    assert load_checkpoint(tmp_path / "ck" / "step-00000004").meta["step"] == 4


def test_metric_names_that_change_across_a_resume_are_refused_at_its_first_evaluation(
    data_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("EXTRA_FROM", "1")
    config = _config(data_dir, tmp_path, **ADDED_LATER, **{"checkpoint.every": 2, "checkpoint.keep_last": 5})
    train(config, stop_at=5, progress=False)  # evaluated at 2 and 4 with three metrics
    monkeypatch.setenv("EXTRA_FROM", "99")  # the resumed process's evaluations leave one out
    with pytest.raises(MetricsError) as refused:
        train(config, resume="latest", progress=False)
    assert (
        "callback_factories:build_data_metric_added_later evaluate() returned other metrics at step 6 than at "
        "the run's earlier evaluations (missing: validation/mae): a run's evaluations keep the same names; "
        "nothing of step 6 was recorded"
    ) in str(refused.value)
    assert CheckpointStore(tmp_path / "ck").committed_steps() == [2, 4, 5]
    assert load_checkpoint(tmp_path / "ck" / "step-00000005").meta["step"] == 5


def test_metric_names_are_checked_as_tensor_names():
    # Every value a float (metrics.json writes 1.0, not 1), named set/metric.
    assert json.dumps(check_metrics({"validation": {"mse": 1}, "loss": 2}, "x")) == (
        '{"validation/mse": 1.0, "loss": 2.0}'
    )
    with pytest.raises(MetricsError, match="named twice"):
        check_metrics({"a/b": 1.0, "a": {"b": 2.0}}, "x")
    with pytest.raises(MetricsError, match="evaluation set 'a' holds no metric"):
        check_metrics({"a": {}}, "x")
    with pytest.raises(MetricsError, match=r"metric 3 is 1"):
        check_metrics({"a": {3: 1.0}}, "x")
    with pytest.raises(MetricsError, match=r"metric 3 is \{'mse': 1.0\}"):  # a set is named by a str too
        check_metrics({3: {"mse": 1.0}}, "x")
    for flag in (True, False):  # a bool is an int to Python, not a metric
        with pytest.raises(MetricsError, match=f"metric 'converged' is {flag}"):
            check_metrics({"converged": flag, "loss": 2.0}, "x")
        with pytest.raises(MetricsError, match=f"metric 'val/converged' is {flag}"):
            check_metrics({"val": {"converged": flag}}, "x")
    for name in ("validation/mse", "mse"):
        assert load_config(CONFIG, {"checkpoint.best_metric": name, "training.eval_every": 1})
    for name in ("validation/", "a/b/c", "/mse", "x y", "mse\n", "validation/mse\n"):
        with pytest.raises(ConfigError, match="checkpoint.best_metric must be a metric name"):
            load_config(CONFIG, {"checkpoint.best_metric": name, "training.eval_every": 1})


UNSORTED = {"data.factory": "callback_factories:build_data_unsorted_metrics"}


def test_metrics_out_of_alphabetical_order_are_said_as_returned_and_the_best_is_marked_by_its_name(
    data_dir, tmp_path, monkeypatch, capsys
):
    """``zeta, alpha, Mid``: each evaluation's line names them as evaluate returned them, the
    run's evaluations keep them so, the mark is the best of the one named (not of the first,
    nor of the first in order), and a resume whose names change lists what is new and what is
    missing each in order (capitals first)."""
    config = _config(
        data_dir,
        tmp_path,
        **UNSORTED,
        **{
            "training.max_steps": 6,
            "checkpoint.every": 3,
            "checkpoint.keep_last": 1,
            "checkpoint.best_metric": "alpha",
            "checkpoint.best_mode": "min",
        },
    )
    capsys.readouterr()
    evaluations = train(config).evaluations
    assert list(evaluations) == ["step", "zeta", "alpha", "Mid"] and evaluations["step"] == [2, 4, 6]
    said = [line for line in capsys.readouterr().err.splitlines() if " evaluation: " in line]
    assert said == [
        f"step {step} evaluation: zeta {evaluations['zeta'][at]:.6g}, alpha {evaluations['alpha'][at]:.6g}, "
        f"Mid {evaluations['Mid'][at]:.6g}"
        for at, step in enumerate(evaluations["step"])
    ]
    value = min(evaluations["alpha"])
    best = evaluations["step"][evaluations["alpha"].index(value)]
    assert best != 6, evaluations  # the mark is not the newest, as the mse-like zeta's would be
    assert read_best(tmp_path / "ck") == {"step": best, "metric": "alpha", "mode": "min", "value": value}
    assert CheckpointStore(tmp_path / "ck").committed_steps() == [best, 6]

    monkeypatch.setenv("RENAMED_FROM", "1")
    with pytest.raises(MetricsError) as refused:
        train(config, resume="latest", extend_to=8, progress=False, resume_hint="H")
    assert str(refused.value) == (
        "callback_factories:build_data_unsorted_metrics evaluate() returned other metrics at step 8 than at the "
        "run's earlier evaluations (new: Alpha, beta; missing: Mid, alpha): a run's evaluations keep the same "
        "names; nothing of step 8 was recorded; the last committed checkpoint (step 6) is intact: fix it and "
        "resume with H"
    )


def test_a_best_metric_none_returned_is_refused_listing_the_metrics_in_order(data_dir, tmp_path):
    """The refusal lists ``Mid, alpha, zeta`` (capitals first), and the printed command sets the
    closest name, or the first in that order when none is close; a mark naming a metric its
    checkpoint never recorded lists the recorded ones in the same order."""
    from pipeline.checkpoint.best import check_best

    hint = "python scripts/02_train.py --resume latest"
    for given, fix in (("alhpa", "alpha"), ("accuracy", "Mid")):
        config = _config(
            data_dir,
            tmp_path / given,
            **UNSORTED,
            **{"training.max_steps": 6, "checkpoint.best_metric": given},
        )
        with pytest.raises(ConfigError) as refused:
            train(config, progress=False, resume_hint=hint)
        assert str(refused.value) == (
            f"{config.source}: checkpoint.best_metric is {given!r}, but the task's evaluate returned Mid, alpha, "
            "zeta: set checkpoint.best_metric to one of them; step 2 is committed: resume with python "
            f"scripts/02_train.py --set checkpoint.best_metric={fix} --resume latest"
        )
        assert CheckpointStore(tmp_path / given / "ck").committed_steps() == [2]
    mark = {"step": 2, "metric": "accuracy", "mode": "min", "value": 0.5}
    recorded = {"step": [2], "zeta": [1.0], "alpha": [0.5], "Mid": [0.25]}
    with pytest.raises(CheckpointError) as refused:
        check_best(mark, recorded, [2], "ck/BEST.json")
    assert str(refused.value) == (
        "ck/BEST.json marks step 2 as the best by accuracy, but that checkpoint recorded no evaluation of "
        "accuracy at its own step (it recorded Mid, alpha, zeta): delete it (the next save marks the best "
        "again), or pass --checkpoint latest or PATH"
    )
