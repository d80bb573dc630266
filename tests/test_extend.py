"""--extend-to: a finished or stopped run continues to a larger max_steps with its optimizer,
schedule, data position and RNGs; meta.json and the card record the lineage."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.errors import ConfigError, ConfigMismatch
from pipeline.stage import build_stage
from pipeline.train import train

from support import REPO, assert_checkpoints_bitwise_equal, one_line_error, verify_checkpoint
from support import train as train_script

COSINE = {
    "scheduler.factory": "pipeline.factories:warmup_cosine",
    "scheduler.params": {"warmup_steps": 2, "min_ratio": 0.1},
}


def _config(data_dir: Path, folder: Path, max_steps: int, **overrides):
    return load_config(
        REPO / "config.yaml",
        {
            "data.dir": str(data_dir),
            "checkpoint.dir": str(folder),
            "training.max_steps": max_steps,
            "checkpoint.every": 3,
            "checkpoint.async": False,
            **overrides,
        },
    )


def test_extending_a_finished_run_continues_it_exactly(data_dir, tmp_path):
    """step_lr does not depend on max_steps, so 6 steps extended to 10 must be bitwise the
    10-step run: nothing (optimizer, scheduler, sampler, RNG, history) restarted."""
    straight, extended = tmp_path / "straight", tmp_path / "extended"
    train(_config(data_dir, straight, 10), progress=False)
    first = train(_config(data_dir, extended, 6), progress=False)
    assert first.step == 6
    # The config file still says 6: the extension, not the file, sets the new length.
    result = train(_config(data_dir, extended, 6), resume="latest", extend_to=10, progress=False)
    assert (result.resumed_from, result.step, result.max_steps) == (6, 10, 10)
    assert result.history["step"] == list(range(1, 11))
    assert_checkpoints_bitwise_equal(straight / "step-00000010", extended / "step-00000010")
    meta, reference = (
        verify_checkpoint(extended / "step-00000010"),
        verify_checkpoint(straight / "step-00000010"),
    )
    assert meta["training_state"] == reference["training_state"]
    assert meta["config"]["training"]["max_steps"] == 10
    assert meta["lineage"] == [{"from_max_steps": 6, "at_step": 6, "to_max_steps": 10}]
    assert reference["lineage"] == []

    # Extending again keeps both entries; the card tells the story.
    train(_config(data_dir, extended, 6), resume="latest", extend_to=12, progress=False)
    meta = verify_checkpoint(extended / "step-00000012")
    assert meta["lineage"] == [
        {"from_max_steps": 6, "at_step": 6, "to_max_steps": 10},
        {"from_max_steps": 10, "at_step": 10, "to_max_steps": 12},
    ]
    stage = build_stage(
        _config(data_dir, extended, 6), stage_dir=tmp_path / "hub_stage", with_metrics=False
    ).stage
    card = (stage / "README.md").read_text()
    assert "planned for 6 steps, was extended at step 6 to 10" in card
    assert "planned for 10 steps, was extended at step 10 to 12" in card
    assert (
        "| history | trained in one process; extended from 6 to 10 steps after step 6; extended from 10 to 12 "
        "steps after step 10 |"
    ) in card

    # Refusals: not past the step or max_steps, another length without --extend-to.
    for target in (12, 11):
        with pytest.raises(
            ConfigError,
            match=f"--extend-to {target} must exceed the checkpoint's step 12 and its max_steps 12",
        ):
            train(_config(data_dir, extended, 6), resume="latest", extend_to=target, progress=False)
    with pytest.raises(
        ConfigMismatch,
        match="training.max_steps is 20, but the checkpoint's run is 12 steps "
        r"\(extended from 6\): .*--extend-to N \(N > 12\)",
    ):
        train(_config(data_dir, extended, 20), resume="latest", progress=False)
    assert verify_checkpoint(extended / "step-00000012")["lineage"] == meta["lineage"]


def test_extension_refused_by_the_script_in_one_line(data_dir, tmp_path):
    train(_config(data_dir, tmp_path, 2), progress=False)
    result = train_script(data_dir, tmp_path, "--max-steps", "2", "--resume", "latest", "--extend-to", "2")
    assert result.returncode == 2
    assert (
        one_line_error(result)
        == "error: --extend-to 2 must exceed the checkpoint's step 2 and its max_steps 2"
    )


def test_a_run_started_with_max_steps_extends_without_it_and_a_resume_names_its_length(data_dir, tmp_path):
    """A run started with ``--max-steps 6`` (the file says 10) and stopped at 3: ``--extend-to``
    alone continues it (it names the length; the schedule keeps the lineage's first), and a
    plain resume without ``--max-steps`` is refused naming the flag that resumes it."""
    started = train_script(data_dir, tmp_path, "--max-steps", "6", "--stop-at", "3")
    assert started.returncode == 0, started.stderr
    refused = train_script(data_dir, tmp_path, "--resume", "latest")
    assert refused.returncode == 2
    assert one_line_error(refused) == (
        "error: training.max_steps is 10, but the checkpoint's run is 6 steps: resume it at its length "
        "with --max-steps 6, or train it further with --extend-to N (N > 6)"
    )
    extended = train_script(data_dir, tmp_path, "--resume", "latest", "--extend-to", "8")
    assert extended.returncode == 0, extended.stderr
    meta = verify_checkpoint(tmp_path / "step-00000008")
    assert meta["config"]["training"]["max_steps"] == 8
    assert meta["lineage"] == [{"from_max_steps": 6, "at_step": 3, "to_max_steps": 8}]


def test_extended_cosine_holds_its_floor_and_resumes_bitwise(data_dir, tmp_path):
    """warmup_cosine keeps the run's first length: past it, the rate holds at min_ratio
    (no jump back up). An extended run cut after the extension and resumed with the
    original config is bitwise the uninterrupted extended run."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for folder in (whole, cut):
        train(_config(data_dir, folder, 4, **COSINE), progress=False)
    result = train(_config(data_dir, whole, 4, **COSINE), resume="latest", extend_to=8, progress=False)
    lr = load_config(REPO / "config.yaml").optimizer.lr
    assert result.history["lr"][4:] == [lr * 0.1] * 4
    assert result.history["lr"][3] > lr * 0.1

    stopped = train(
        _config(data_dir, cut, 4, **COSINE), resume="latest", extend_to=8, stop_at=6, progress=False
    )
    assert stopped.step == 6
    resumed = train(_config(data_dir, cut, 4, **COSINE), resume="latest", progress=False)
    assert (resumed.resumed_from, resumed.step) == (6, 8)
    assert_checkpoints_bitwise_equal(whole / "step-00000008", cut / "step-00000008")
    assert verify_checkpoint(cut / "step-00000008")["lineage"] == [
        {"from_max_steps": 4, "at_step": 4, "to_max_steps": 8}
    ]


def test_the_printed_resume_command_drops_extend_to():
    """The checkpoints of an extended run record its length: the resume command must not
    extend again (which its step would refuse)."""
    import shlex

    from pipeline.cli import python_command, resume_command

    printed = resume_command(
        [
            "scripts/02_train.py",
            "--config",
            "c.yaml",
            "--resume",
            "latest",
            "--extend-to",
            "40",
            "--set",
            "training.seed=1",
            "--extend-to=50",
        ]
    )
    assert shlex.split(printed) == [
        python_command(),
        "scripts/02_train.py",
        "--config",
        "c.yaml",
        "--set",
        "training.seed=1",
        "--resume",
        "latest",
    ]
