"""A resumed run ends bitwise identical to an uninterrupted one, whatever interrupted it."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.checkpoint import CheckpointStore

from support import (
    PYTHON,
    REPO,
    assert_checkpoints_bitwise_equal,
    data_args,
    script_env,
    train,
    train_until_killed,
    verify_checkpoint,
)


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory) -> Path:
    """Ten uninterrupted steps, saved only at the end."""
    folder = tmp_path_factory.mktemp("reference")
    result = train(data_dir, folder, "--max-steps", "10", "--checkpoint-every", "10")
    assert result.returncode == 0, result.stderr
    return folder / "step-00000010"


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_stop_at_5_then_resume_in_second_process_is_bitwise_equal(data_dir, reference, tmp_path, async_save):
    mode = ["--set", f"checkpoint.async={async_save}"]
    first = train(data_dir, tmp_path, "--max-steps", "10", "--stop-at", "5", "--checkpoint-every", "2", *mode)
    assert first.returncode == 0, first.stderr
    assert CheckpointStore(tmp_path).committed_steps() == [5]
    # A different checkpoint interval after the resume: saving must not consume randomness.
    second = train(
        data_dir, tmp_path, "--max-steps", "10", "--resume", "latest", "--checkpoint-every", "3", *mode
    )
    assert second.returncode == 0, second.stderr
    assert_checkpoints_bitwise_equal(reference, tmp_path / "step-00000010")
    resumed, straight = verify_checkpoint(tmp_path / "step-00000010"), verify_checkpoint(reference)
    assert resumed["step"] == straight["step"] == 10
    assert resumed["training_state"] == straight["training_state"]


def test_checkpoint_interval_does_not_change_the_result(data_dir, reference, tmp_path):
    result = train(data_dir, tmp_path, "--max-steps", "10", "--checkpoint-every", "1", "--keep-last", "3")
    assert result.returncode == 0, result.stderr
    assert CheckpointStore(tmp_path).committed_steps() == [8, 9, 10]
    assert_checkpoints_bitwise_equal(reference, tmp_path / "step-00000010")


def _wait_for_training(process: subprocess.Popen) -> bool:
    """Block until the trainer logs its first step (training, not importing); False if it exited."""
    for line in process.stderr:
        if line.startswith("step "):
            return True
    return False


# Random instants are a complement: every step of every commit protocol is failed in turn by
# tests/test_crash_points.py.
KILLS = 12


@pytest.mark.heavy
def test_resume_after_sigkill_is_bitwise_equal(data_dir, tmp_path):
    """SIGKILL at KILLS random instants of a run that checkpoints every step (so kills land
    inside saves too); after each kill the newest committed checkpoint verifies, and the
    run resumed again and again ends bitwise equal to an uninterrupted one.

    Each trainer is a real process forked from a forkserver that has already imported
    torch, so the kills cost seconds instead of one interpreter start each; the script path
    itself is killed and resumed in the preemption tests below and in the proof.
    """
    total = 300
    straight = tmp_path / "straight"
    assert (
        train(data_dir, straight, "--max-steps", str(total), "--checkpoint-every", str(total)).returncode == 0
    )

    killed_dir = tmp_path / "killed"
    overrides = {
        "data.dir": str(data_dir),
        "checkpoint.dir": str(killed_dir),
        "training.max_steps": total,
        "checkpoint.every": 1,
        "checkpoint.keep_last": 2,
    }
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["support", "pipeline.train", "torch._dynamo"])
    chooser = random.Random(20261130)
    kills, steps_seen = 0, []
    while kills < KILLS:
        committed_before = max(CheckpointStore(killed_dir).committed_steps(), default=0)
        started = context.Event()
        trainer = context.Process(
            target=train_until_killed, args=(str(REPO / "config.yaml"), overrides, started)
        )
        trainer.start()
        if started.wait(timeout=300):
            # Under load a kill could land before this run committed anything, which proves
            # nothing and, repeated, never moves the run on: wait for a save newer than the one
            # it resumed from, then kill at a random instant of the saves that follow.
            deadline = time.monotonic() + 300
            while (
                max(CheckpointStore(killed_dir).committed_steps(), default=0) <= committed_before
                and time.monotonic() < deadline
            ):
                time.sleep(0.005)
            time.sleep(chooser.uniform(0.0, 0.05))
            os.kill(trainer.pid, signal.SIGKILL)
            kills += 1
        trainer.join(timeout=120)
        assert trainer.exitcode == -signal.SIGKILL, (
            f"trainer ended with {trainer.exitcode} before it was killed"
        )
        steps = CheckpointStore(killed_dir).committed_steps()
        assert steps, "a killed run left no committed checkpoint"
        assert steps[-1] < total, f"the run finished before {KILLS} kills; raise the step count"
        verify_checkpoint(killed_dir / f"step-{steps[-1]:08d}")
        steps_seen.append(steps[-1])
    assert len(set(steps_seen)) > 5, f"kills did not land at varied steps: {steps_seen}"

    # The last leg saves only at the end: the interval does not change the numbers (tested above).
    final = train(
        data_dir,
        killed_dir,
        "--max-steps",
        str(total),
        "--checkpoint-every",
        str(total),
        "--keep-last",
        "2",
        "--resume",
        "latest",
    )
    assert final.returncode == 0, final.stderr
    assert not [p for p in killed_dir.iterdir() if p.name.startswith(".tmp-")], "stale temporary folder left"
    assert_checkpoints_bitwise_equal(straight / f"step-{total:08d}", killed_dir / f"step-{total:08d}")


@pytest.mark.heavy
# SIGINT here; SIGTERM, the same path, in test_untrusted_checkpoint's printed-resume test
# (exit 143, one verified checkpoint, no traceback, and the printed command finishing bitwise).
@pytest.mark.parametrize("signum", [signal.SIGINT])
def test_preemption_signal_finishes_the_step_checkpoints_and_says_how_to_resume(data_dir, tmp_path, signum):
    total = 400
    command = [
        PYTHON,
        "-B",
        str(REPO / "scripts" / "02_train.py"),
        *data_args(data_dir),
        "--checkpoint-dir",
        str(tmp_path),
        "--max-steps",
        str(total),
        "--checkpoint-every",
        "1000",
    ]
    process = subprocess.Popen(
        command, cwd=REPO, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert _wait_for_training(process)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=180)
    assert process.returncode == 128 + signum
    assert "--resume latest" in stderr and "Traceback" not in stderr
    # A requested stop is reported as a stop, not as an error (the exit code says 128 + N).
    assert "error:" not in stderr and f"stopped by {signal.Signals(signum).name} after step" in stderr, stderr
    steps = CheckpointStore(tmp_path).committed_steps()
    assert len(steps) == 1 and 0 < steps[0] < total
    meta = verify_checkpoint(tmp_path / f"step-{steps[0]:08d}")
    assert meta["step"] == steps[0]


def test_finished_run_resumed_again_does_nothing_and_keeps_its_checkpoint(data_dir, reference, tmp_path):
    assert train(data_dir, tmp_path, "--max-steps", "10").returncode == 0
    before = (tmp_path / "step-00000010" / "meta.json").read_bytes()
    again = train(data_dir, tmp_path, "--max-steps", "10", "--resume", "latest")
    assert again.returncode == 0, again.stderr
    assert "step 10/10" in again.stdout
    assert (tmp_path / "step-00000010" / "meta.json").read_bytes() == before


def test_meta_records_history_fingerprints_and_versions(reference):
    meta = json.loads((reference / "meta.json").read_text())
    assert set(meta["fingerprints"]) == {"data", "code", "factories", "sources"}
    # Per file, under import paths (no machine path): the model's closure and each factory's file.
    assert {"pipeline/tasks/regression.py", "pipeline/factories.py"} <= set(meta["fingerprints"]["sources"])
    assert meta["versions"]["torch"] and meta["versions"]["numpy"]
    assert meta["config"]["training"]["max_steps"] == 10
    assert meta["training_state"]["progress"]["step"] == 10
