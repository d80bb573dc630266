"""What the scripts tell a user to do next: a mistyped checkpoint name lists the names
accepted, and a printed command repeats every flag the user gave, so that running it
as printed does what it says (never a second error)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import signal
import subprocess

import pytest

from localhub import LocalHub
from pipeline.commands import staged_command

from support import REPO, script_env

CONFIG = REPO / "config.yaml"


@pytest.mark.parametrize("script", ["04_evaluate.py", "05_stage.py"])
def test_a_mistyped_checkpoint_name_lists_latest_best_and_path(script, evaluated_run, run_copy):
    run = run_copy(evaluated_run)
    before = sorted(p.name for p in run.root.iterdir())
    line = run.refused(script, "--checkpoint", "bset")
    assert line.startswith("error: bset is neither latest, best nor an existing folder: "), line
    assert "latest|best|PATH" in line, line
    line = run.refused(script, "--checkpoint", str(run.root / "data"))  # a folder, not a checkpoint
    assert "is not a committed checkpoint folder" in line and "latest|best|PATH" in line, line
    assert sorted(p.name for p in run.root.iterdir()) == before


def test_06s_restage_hint_repeats_every_flag_05_was_given_and_runs_as_printed(
    trained_run, run_copy, tmp_path
):
    """05 stages the best checkpoint of another checkpoint folder for one repo; 06 is asked
    to publish it to another. Its fix is the 05 command that built the stage, with the new
    repo id: run as printed, word for word, it stages that same checkpoint (a command without
    --checkpoint best or --checkpoint-dir would stage another step and be refused for
    metrics that evaluate this one)."""
    run = run_copy(trained_run)
    chosen = ["--checkpoint-dir", "best-run", "--checkpoint", "best"]
    evaluated = ["--set", "training.eval_every=3", "--set", "checkpoint.best_metric=mse"]
    # mse falls while training: 'max' marks an early step as the best, not the last.
    run.ok(
        "02_train.py",
        "--quiet",
        "--checkpoint-dir",
        "best-run",
        *evaluated,
        "--set",
        "checkpoint.best_mode=max",
    )
    run.ok("04_evaluate.py", *chosen)
    run.ok("05_stage.py", *chosen, "--repo-id", "me/first")
    step = json.loads((run.stage / "meta.json").read_text())["step"]
    assert step == 3
    with LocalHub(tmp_path / "hub", token="t") as hub:
        publish = ("06_publish.py", "--repo-id", "me/second", "--dry-run", "--endpoint", hub.url)
        line = run.refused(*publish)
        printed = line.split("restage with ", 1)[1].split(", or pass --force-repo-id")[0]
        assert "--checkpoint best" in printed and "--checkpoint-dir best-run" in printed, printed
        assert printed.endswith("--repo-id me/second") and "me/first" not in printed, printed
        rerun = subprocess.run(
            shlex.split(printed), cwd=run.root, env=script_env(), capture_output=True, text=True
        )
        assert rerun.returncode == 0, rerun.stderr
        staged = json.loads((run.stage / "meta.json").read_text())
        assert (staged["step"], staged["repo_id"]) == (step, "me/second")
        assert "dry run: no write request was sent" in run.ok(*publish).stdout


def test_a_record_of_another_stage_or_folder_is_not_repeated(staged_run, run_copy, tmp_path):
    """The record beside the stage names the command only for the stage it built, run from
    the folder it ran in; otherwise 06 names 05 on its config."""
    run = run_copy(staged_run)
    run.ok("05_stage.py", "--repo-id", "me/first", "--no-metrics")
    record = run.root / ".hub_stage.staged-by.json"
    manifest = hashlib.sha256((run.stage / "MANIFEST.sha256").read_bytes()).hexdigest()
    with contextlib.chdir(run.root):
        assert "--no-metrics" in staged_command(run.stage, manifest)
        assert staged_command(run.stage, "0" * 64) is None
        # Only the file 05 wrote is its record: not a link to one, a pipe (no wait), nor a
        # file too large to be one.
        written = record.read_bytes()
        elsewhere = tmp_path / "elsewhere.json"
        elsewhere.write_bytes(written)
        record.unlink()
        record.symlink_to(elsewhere)
        assert staged_command(run.stage, manifest) is None
        record.unlink()
        os.mkfifo(record)
        assert staged_command(run.stage, manifest) is None
        record.unlink()
        record.write_bytes(written[:-1] + b" " * 70_000 + b"}")
        assert staged_command(run.stage, manifest) is None
        record.write_bytes(written)
        assert "--no-metrics" in staged_command(run.stage, manifest)
    assert staged_command(run.stage, manifest) is None  # another working folder: its paths mean other things
    with LocalHub(tmp_path / "hub", token="t") as hub:
        publish = ("06_publish.py", "--repo-id", "me/second", "--dry-run", "--endpoint", hub.url)
        assert "--no-metrics --repo-id me/second, or" in run.refused(*publish)
        record.write_text(record.read_text().replace(manifest, "0" * 64))
        line = run.refused(*publish)
    assert "--no-metrics" not in line and "05_stage.py --config" in line, line


def test_a_command_to_run_the_same_script_again_repeats_every_flag_and_replaces_the_ones_it_sets(monkeypatch):
    from pipeline.commands import script_command
    from pipeline.config import Config

    config = Config(command_args=("--config", "mine.yaml"))
    argv = ["scripts/02_train.py", "--config", "mine.yaml", "--set", "training.parallel=ddp", "--resume=auto"]
    monkeypatch.setattr("sys.argv", [*argv, "--stop-at", "5", "--checkpoint-dir", "runs/x", "--quiet"])
    again = shlex.split(
        script_command(config, "02_train.py", "--set", "training.parallel=none", "--resume", "7")
    )
    assert again[1:] == [
        "scripts/02_train.py", "--config", "mine.yaml", "--stop-at", "5", "--checkpoint-dir", "runs/x", "--quiet",
        "--set", "training.parallel=none", "--resume", "7",
    ]  # fmt: skip
    # The --set=KEY=VALUE form of a key set again is dropped too; a replaced flag takes no value.
    monkeypatch.setattr(
        "sys.argv", ["scripts/05_stage.py", "--set=a.b=1", "--no-metrics", "--repo-id", "me/x"]
    )
    staged = shlex.split(script_command(config, "05_stage.py", "--no-metrics", "--set", "a.b=2"))
    assert staged[1:] == ["scripts/05_stage.py", "--repo-id", "me/x", "--no-metrics", "--set", "a.b=2"]
    monkeypatch.setattr("sys.argv", argv)
    # Another script: only the config as it was given, beside the script this one was run from.
    other = shlex.split(script_command(config, "01_prepare_data.py", "--set", "data.dir=d"))
    assert other[1:] == ["scripts/01_prepare_data.py", "--config", "mine.yaml", "--set", "data.dir=d"]


def test_02s_torchrun_hint_keeps_the_runs_own_flags(trained_run, run_copy):
    """training.parallel ddp in one process: the torchrun launch it names resumes (a launch
    without --resume would be refused over the committed checkpoints) and stops where asked."""
    run = run_copy(trained_run)
    asked = ("--set", "training.parallel=ddp", "--resume", "latest", "--extend-to", "12", "--stop-at", "11")
    line = run.refused("02_train.py", *asked)
    launch = shlex.split(line.split("launch with ", 1)[1].split(", or set training.parallel")[0])
    assert launch[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=N"], launch
    assert launch[6:] == ["--config", str(CONFIG), *asked], launch


def test_04s_and_05s_pointer_to_an_older_checkpoint_names_the_flag_they_take(trained_run, run_copy):
    run = run_copy(trained_run)
    two = ("--checkpoint-dir", "two", "--set", "checkpoint.keep_last=2")
    run.ok("02_train.py", "--quiet", *two)
    weights = run.root / "two" / "step-00000010" / "modelo.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    older = "two/step-00000005"  # as 04 and 05 were given the folder that holds it
    for script in ("04_evaluate.py", "05_stage.py"):
        line = run.refused(script, *two)
        assert line.endswith(
            f"; the older checkpoint {older} verifies: evaluate or stage it with --checkpoint {older} (nothing was deleted)"
        ), (script, line)
    run.ok("04_evaluate.py", *two, "--checkpoint", older)


def test_04s_fix_for_unprepared_data_prepares_the_data_of_the_config_it_was_given(trained_run, run_copy):
    run = run_copy(trained_run)
    elsewhere = ("--set", "data.dir=elsewhere/regression")
    line = run.refused("04_evaluate.py", *elsewhere)
    printed = line.split("run ", 1)[1].removesuffix(" first")
    assert printed.endswith(f"01_prepare_data.py --config {CONFIG} --set data.dir=elsewhere/regression"), line
    prepared = subprocess.run(
        shlex.split(printed), cwd=run.root, env=script_env(), capture_output=True, text=True
    )
    assert prepared.returncode == 0, prepared.stderr
    run.ok("04_evaluate.py", *elsewhere)


@pytest.mark.parametrize(
    ("stop_at", "stopped_by"),
    [(None, None), (4, None), (None, 4)],
    ids=["last-step", "stop-at", "callback-stop"],
)
def test_a_signal_after_the_last_step_says_the_run_is_complete_and_after_any_other_how_to_resume(
    data_dir, tmp_path, monkeypatch, stop_at, stopped_by
):
    """SIGTERM during the last step's save: the run is complete, nothing is left to resume
    (a "Resume with" would point at a run with no step left), and so is one a callback stopped;
    after ``--stop-at`` it is not."""
    from pipeline.config import load_config
    from pipeline.errors import Preempted
    from pipeline.train import TrainingHooks, train

    checkpoints = tmp_path / "ck"
    sets = {"data.dir": str(data_dir), "checkpoint.dir": str(checkpoints), "training.max_steps": 6}
    if stopped_by is not None:
        monkeypatch.setenv("STOP_AT", str(stopped_by))
        sets["training.callbacks"] = ["callback_factories:stop_at"]
    config = load_config(CONFIG, sets)
    last = stop_at or stopped_by or 6

    def on_step(run) -> None:
        if run.step == last:
            os.kill(os.getpid(), signal.SIGTERM)  # recorded by the loop, honoured after the step's save

    hint = "python scripts/02_train.py --resume latest"
    with pytest.raises(Preempted) as stopped:
        train(config, progress=False, stop_at=stop_at, hooks=TrainingHooks(on_step=on_step), resume_hint=hint)
    where = checkpoints / f"step-{last:08d}"
    assert stopped.value.exit_code == 128 + signal.SIGTERM and (where / "meta.json").is_file()
    if stop_at is None:
        assert str(stopped.value) == (
            f"stopped by SIGTERM after the last step, {last}: the run is complete; its checkpoint {where} is committed"
        )
    else:
        assert str(stopped.value) == (
            f"stopped by SIGTERM after step 4; checkpoint {where} is committed. Resume with: {hint}"
        )


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        (["--checkpoint", "estados_local/step-00000005", "--repo-id", "me/x"], ["--repo-id", "me/x"]),
        (["--checkpoint=estados_local/step-00000005", "--no-metrics"], ["--no-metrics"]),
        (["--no-metrics", "--checkpoint", "latest"], ["--no-metrics"]),
    ],
)
def test_a_hint_that_sets_an_option_again_drops_the_given_one_with_its_value(monkeypatch, given, kept):
    """One option, one value: the replaced option's value is not left behind as a stray
    argument (which the step would refuse), and the flag after it is kept."""
    import sys

    from pipeline.commands import script_command
    from pipeline.config import load_config

    monkeypatch.setattr(sys, "argv", ["scripts/05_stage.py", *given])
    command = shlex.split(script_command(load_config(CONFIG), "05_stage.py", "--checkpoint", "best"))
    assert command[1:] == ["scripts/05_stage.py", *kept, "--checkpoint", "best"], command
