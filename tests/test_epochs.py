"""A run's length in epochs (training.epochs): counted from the sampler before the schedule is
built, recorded in every checkpoint, with and without accumulation, resumed and extended, and
the same under torchrun (whose launch also holds a callback asking to stop on one rank only)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_distributed import torchrun

from pipeline.config import load_config
from pipeline.data import EpochSampler, batches_per_epoch
from pipeline.errors import ConfigError, ConfigMismatch
from pipeline.run import counted_length, with_counted_length
from pipeline.train import train

from support import HELPERS, REPO, assert_checkpoints_bitwise_equal, read_meta_json

CONFIG = REPO / "config.yaml"
COSINE = {"scheduler.factory": "pipeline.factories:warmup_cosine", "scheduler.params": {"warmup_steps": 2}}


def _config(data_dir: Path, folder: Path, **overrides):
    return load_config(CONFIG, {"data.dir": str(data_dir), "checkpoint.dir": str(folder), **overrides})


@pytest.mark.parametrize(
    ("sets", "steps"),
    [
        ({"training.epochs": 2}, 12),  # 24 rows in batches of 4: 6 a epoch
        ({"training.epochs": 2, "data.batch_size": 5}, 10),  # 5 a epoch, the last of 4 rows
        ({"training.epochs": 2, "data.batch_size": 5, "data.drop_last": True}, 8),
        ({"training.epochs": 3, "training.grad_accum_steps": 4}, 5),  # 18 batches, 4 a step: 4.5
    ],
    ids=["batches", "short-last-batch", "drop-last", "accumulated"],
)
def test_epochs_train_the_run_the_counted_max_steps_would(data_dir, tmp_path, sets, steps):
    """The count is E x the batches of an epoch / grad_accum_steps, rounded up; the schedule sees
    it (a cosine over max_steps): the run is bitwise the one given that many steps."""
    counted = train(_config(data_dir, tmp_path / "epochs", **COSINE, **sets), progress=False)
    assert counted.step == counted.max_steps == steps
    training = read_meta_json(counted.checkpoint)["config"]["training"]
    assert (training["epochs"], training["max_steps"]) == (sets["training.epochs"], steps)
    in_steps = {key: value for key, value in sets.items() if key != "training.epochs"}
    given = train(
        _config(data_dir, tmp_path / "steps", **COSINE, **in_steps, **{"training.max_steps": steps}),
        progress=False,
    )
    assert_checkpoints_bitwise_equal(given.checkpoint, counted.checkpoint)


def test_an_epochs_run_resumes_to_its_length_and_extends(data_dir, tmp_path):
    sets = {**COSINE, "training.epochs": 2, "checkpoint.every": 4}
    straight = train(_config(data_dir, tmp_path / "straight", **sets), progress=False)
    train(_config(data_dir, tmp_path / "cut", **sets), stop_at=5, progress=False)
    resumed = train(_config(data_dir, tmp_path / "cut", **sets), resume="latest", progress=False)
    assert resumed.step == 12
    assert_checkpoints_bitwise_equal(straight.checkpoint, resumed.checkpoint)
    extended = train(
        _config(data_dir, tmp_path / "cut", **sets), resume="latest", extend_to=15, progress=False
    )
    meta = read_meta_json(extended.checkpoint)
    assert extended.step == 15 and meta["lineage"] == [
        {"from_max_steps": 12, "at_step": 12, "to_max_steps": 15}
    ]
    # A resume with another number of epochs is another run.
    with pytest.raises(ConfigMismatch, match=r"training\.epochs: checkpoint has 2"):
        train(
            _config(data_dir, tmp_path / "cut", **{**sets, "training.epochs": 3}),
            resume="latest",
            progress=False,
        )


def test_epochs_and_max_steps_together_are_refused_in_one_line(trained_run):
    line = trained_run.refused("02_train.py", "--set", "training.epochs=2", "--max-steps", "7")
    assert "the command line gives both training.max_steps (7) and training.epochs (2): keep one" in line, (
        line
    )


def test_a_config_made_from_a_checkpoints_record_trains_again_and_a_pair_that_disagrees_is_refused(
    data_dir, tmp_path
):
    """A checkpoint records both keys (the steps counted): its config as a file (what a model
    card's recipe does) trains the same run; a file whose two lengths disagree is refused."""
    counted = train(_config(data_dir, tmp_path / "first", **{"training.epochs": 2}), progress=False)
    recorded = read_meta_json(counted.checkpoint)["config"]
    assert (recorded["training"]["epochs"], recorded["training"]["max_steps"]) == (2, 12)
    again = tmp_path / "again.yaml"
    again.write_text(
        yaml.safe_dump({**recorded, "checkpoint": {**recorded["checkpoint"], "dir": str(tmp_path / "again")}})
    )
    assert_checkpoints_bitwise_equal(counted.checkpoint, train(load_config(again), progress=False).checkpoint)
    recorded["training"]["max_steps"] = 11
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(
        yaml.safe_dump({**recorded, "checkpoint": {**recorded["checkpoint"], "dir": str(tmp_path / "w")}})
    )
    with pytest.raises(
        ConfigError, match=r"training\.max_steps is 11, but training\.epochs 2 counts 12 steps"
    ):
        train(load_config(wrong), progress=False)
    assert not list((tmp_path / "w").glob("step-*"))


def test_a_length_no_one_can_count_is_refused_in_one_line(data_dir, tmp_path):
    config = _config(data_dir, tmp_path, **{"training.epochs": 2})
    with pytest.raises(
        ConfigError, match=r"training\.epochs is 2, but the task's training inputs are a stream"
    ):
        with_counted_length(config, None)

    class Endless:
        def next_indices(self) -> list[int]:
            return [0]

    with pytest.raises(ConfigError, match=r"sampler \(Endless\) does not say how many batches an epoch has"):
        with_counted_length(config, Endless())
    sampler = EpochSampler(24, 5, np.random.Generator(np.random.PCG64(0)), drop_last=True)
    assert batches_per_epoch(sampler) == 4 and with_counted_length(config, sampler).training.max_steps == 8
    in_steps = _config(data_dir, tmp_path)
    assert with_counted_length(in_steps, None).training.max_steps == 10
    # Both, as a checkpoint records them: an extended run's first length is the count.
    both = load_config(CONFIG, {"training.epochs": 2, "data.batch_size": 5, "data.drop_last": True})
    recorded = dataclasses.replace(both, training=dataclasses.replace(both.training, max_steps=20))
    assert with_counted_length(recorded, sampler, first_length=8).training.max_steps == 20
    with pytest.raises(ConfigError, match="counts 8 steps"):
        with_counted_length(recorded, sampler)
    # An extended run whose first length is not the count: the refusal names that length, not the extended one.
    with pytest.raises(ConfigError) as refused:
        with_counted_length(recorded, sampler, first_length=9)
    assert str(refused.value) == (
        f"{recorded.source}: training.max_steps is 9, but training.epochs 2 counts 8 steps "
        "(4 batches an epoch, 1 a step): give one of the two"
    )


def test_a_run_planned_before_it_trains_is_counted_from_its_data(data_dir, tmp_path):
    """counted_length (what plans a run before it trains: the proof's cut) counts a length in
    epochs from the task's data, as training does; a length in steps is the config's own."""
    in_epochs = _config(data_dir, tmp_path, **{"training.epochs": 2, "data.batch_size": 5})
    assert in_epochs.training.max_steps is None
    assert counted_length(in_epochs).training.max_steps == 10  # 24 rows: 5 batches an epoch
    in_steps = _config(data_dir, tmp_path, **{"training.max_steps": 7})
    assert counted_length(in_steps) is in_steps


@pytest.mark.heavy
def test_epochs_and_a_callback_stop_under_torchrun(data_dir, tmp_path, monkeypatch):
    """One launch of two processes (DDP): an accumulated run in epochs counts what one process
    counts (data.batch_size is the global batch); a callback asking to stop on rank 1 only stops
    both ranks after the same step, and the record names it."""
    base = {"data.dir": str(data_dir), "training.parallel": "ddp", "checkpoint.every": 2}
    epochs = {
        **base,
        "checkpoint.dir": str(tmp_path / "epochs"),
        "training.epochs": 3,
        "training.grad_accum_steps": 4,
    }
    stops = {
        **base,
        "checkpoint.dir": str(tmp_path / "stops"),
        "training.callbacks": ["callback_factories:stop_at"],
    }
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps(
            {
                "config": str(CONFIG),
                "results": str(tmp_path / "results.json"),
                "runs": [{"overrides": epochs}, {"overrides": stops}],
            }
        )
    )
    monkeypatch.setenv("STOP_AT", "3")
    monkeypatch.setenv("STOP_RANK", "1")
    ran = torchrun(2, str(HELPERS / "dist_leg.py"), str(plan), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    counted, stopped = json.loads((tmp_path / "results.json").read_text())
    assert "error" not in counted and "error" not in stopped, (counted, stopped)
    assert counted["step"] == 5
    assert read_meta_json(Path(counted["checkpoint"]))["config"]["training"]["max_steps"] == 5
    assert stopped["step"] == 3 and stopped["exit_codes"] == [0, 0]
    record = read_meta_json(Path(stopped["checkpoint"]))["training_state"]["callbacks"]["stopped"]
    assert record == {"step": 3, "by": "callback_factories:stop_at", "reason": "asked to stop at step 3"}
