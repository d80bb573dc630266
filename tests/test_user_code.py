"""Training around the user's code and data, attacked: a trainer SIGKILLed while its DataLoader
workers are stuck in a sample, data prepared for another config, and a task whose samples,
collate, length, stream, loss or evaluation raise, exit or hang. Each ends in one ``error:``
line and a non-zero exit (``--debug``: the traceback through the user's code, from workers
too), or resumes cleanly; nothing is lost. The task is tests/helpers/hostile_factories.py."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import time
from pathlib import Path

import pytest

from pipeline.checkpoint import CheckpointStore
from pipeline.config import load_config
from pipeline.errors import CapturedTraceback, ConfigError, DataError, InputFailed, TrainingDiverged
from pipeline.factories import resolve
from pipeline.train import train

from support import (
    REPO,
    ScriptRun,
    children,
    one_line_error,
    run_script,
    script_env,
    start_script,
    verify_checkpoint,
)

CONFIG = REPO / "config.yaml"
ROWS = "hostile_factories:build_rows"
STREAM = "hostile_factories:build_stream"


def _config(data_dir: Path, checkpoints: Path, **overrides):
    return load_config(
        CONFIG,
        {"data.dir": str(data_dir), "checkpoint.dir": str(checkpoints), "data.factory": ROWS, **overrides},
    )


def _set(data_dir: Path, checkpoints: Path, *pairs: str) -> list[str]:
    """02's arguments for the hostile task on ``data_dir`` into ``checkpoints``."""
    args = [
        "--config",
        str(CONFIG),
        "--set",
        f"data.dir={data_dir}",
        "--set",
        f"data.factory={ROWS}",
        "--checkpoint-dir",
        str(checkpoints),
    ]
    for pair in pairs:
        args += ["--set", pair]
    return [*args, "--quiet"]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_until(condition, what: str, run: ScriptRun, timeout: float = 180) -> None:
    """Poll ``condition`` while ``run`` lives; its output if it ended first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if not _alive(run.pid):
            result = run.wait(timeout=120)
            pytest.fail(f"the script ended ({result.returncode}) before {what}:\n{result.stderr}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- the folder lock and DataLoader workers -------------------------------------------------


@pytest.mark.parametrize("outlive", [True, False], ids=["workers-outlive-it", "workers-die-with-it"])
def test_a_sigkilled_trainers_stuck_workers_never_keep_its_folder_from_an_immediate_resume(
    data_dir, tmp_path, outlive
):
    """Two workers stall in a sample once step 2 is committed. While the trainer lives, a second
    trainer is refused (the lock is still one trainer's). SIGKILL it: ``--resume latest`` at once
    succeeds. ``outlive``: the workers dropped the order to die with their trainer and are still
    running when the resume takes the folder (they never held its lock); otherwise they end with
    their trainer (nothing is left running, nothing printed)."""
    checkpoints, marks = tmp_path / "ck", tmp_path / "stalled"
    marks.mkdir()
    args = _set(data_dir, checkpoints, "data.num_workers=2", "checkpoint.every=2", "training.max_steps=1000")
    env = script_env(
        HOSTILE="stall",
        HOSTILE_AFTER=str(checkpoints / "step-00000002"),
        HOSTILE_MARK=str(marks),
        HOSTILE_OUTLIVE="1" if outlive else "0",
    )
    trainer = start_script("02_train.py", *args, cwd=tmp_path, env=env)
    workers: list[int] = []
    try:
        _wait_until(lambda: len(list(marks.iterdir())) == 2, "both workers to stall", trainer)
        workers = children(trainer.pid)
        assert sorted(workers) == sorted(int(p.name) for p in marks.iterdir())
        # Were it let in, its first sample would raise: a quick failure, not a long run.
        second = run_script(
            "02_train.py", *args, "--resume", "latest", cwd=tmp_path, env=script_env(HOSTILE="raise")
        )
        assert second.returncode == 2
        assert f"is in use by another trainer (pid {trainer.pid})" in one_line_error(second)
        os.kill(trainer.pid, signal.SIGKILL)
        stop = CheckpointStore(checkpoints).committed_steps()[-1] + 1
        resumed = run_script("02_train.py", *args, "--resume", "latest", "--stop-at", str(stop), cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr
        assert f"trained to step {stop}/1000" in resumed.stdout
        if outlive:
            assert all(_alive(pid) for pid in workers), "the workers ended before the resume: nothing proven"
        else:
            killed = trainer.wait(timeout=120)  # its pipes close once its workers are gone too
            assert killed.returncode == -signal.SIGKILL and killed.stderr == "", killed.stderr
            assert not any(_alive(pid) for pid in workers)
    finally:
        for pid in [trainer.pid, *workers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert trainer.wait(timeout=120).stderr == ""


# -- the task's code failing -----------------------------------------------------------------


def _refused(config, env: dict[str, str], monkeypatch, error=InputFailed, **options) -> BaseException:
    """The one-line error ``train(config)`` ends with under the hostile ``env``."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(error) as refused:
        train(config, progress=False, **options)
    assert "\n" not in str(refused.value) and refused.value.exit_code == 2, str(refused.value)
    return refused.value


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(
    "kind, message, trace",
    [
        (
            "raise",
            r"^train_dataset\[5\] \(epoch 0\) raised ValueError: this row is corrupt; ",
            'hostile_factories.py", line',
        ),
        ("exit0", r"^train_dataset\[5\] \(epoch 0\) raised SystemExit: 0; ", "sys.exit(0)"),
        (
            # The first sample of the batch is the wide one: in a worker, torch's collate says
            # "Trying to resize storage that is not resizable".
            "shape",
            r"^collate of the batch of train_dataset\[4\], train_dataset\[5\], train_dataset\[6\], "
            r"train_dataset\[7\] \(epoch 0\) failed: the samples differ in shape \(train_dataset\[4\]\[0\] is "
            r"\[7\], train_dataset\[5\]\[0\] \[3\]\), and default_collate stacks samples of one shape only: "
            r"give data.factory a collate\(samples\) that pads them \(docs/data.md\); ",
            "RuntimeError: ",
        ),
    ],
)
def test_a_sample_or_collate_that_fails_is_one_line_naming_the_sample_with_or_without_workers(
    data_dir, tmp_path, monkeypatch, kind, message, trace, workers
):
    """Unshuffled, batches of 4: samples 4 and 5 are in step 2's batch. The same line with 2
    workers as with none, the traceback kept for --debug, and where to go on: nothing was
    committed yet."""
    config = _config(data_dir, tmp_path, **{"data.shuffle": False, "data.num_workers": workers})
    error = _refused(config, {"HOSTILE": kind, "HOSTILE_AT": "4" if kind == "shape" else "5"}, monkeypatch)
    assert re.match(message, str(error)), str(error)
    assert str(error).endswith("; no checkpoint was committed yet: fix it and run the same command again")
    assert isinstance(error.__cause__, CapturedTraceback) and trace in error.__cause__.text
    assert not list(tmp_path.glob("step-*"))


@pytest.mark.parametrize(
    "kind, message",
    [
        ("interrupt", r"train_dataset\[5\] \(epoch 0\) raised KeyboardInterrupt; "),
        (
            "os_exit",
            r"a DataLoader worker \(pid \d+\) exited with code 3 before handing over its batch \(the dataset's "
            r"code ended the process: os._exit\?\); ",
        ),
    ],
)
def test_a_worker_that_interrupts_or_exits_itself_is_not_reported_as_killed(
    data_dir, tmp_path, monkeypatch, kind, message
):
    config = _config(
        data_dir, tmp_path, **{"data.shuffle": False, "data.num_workers": 2, "checkpoint.every": 1}
    )
    error = _refused(config, {"HOSTILE": kind, "HOSTILE_AT": "5"}, monkeypatch)
    assert re.match(message, str(error)) and "killed" not in str(error), str(error)
    # Sample 5 is step 2's; a worker prefetches it while step 1 trains, so its exit may be seen
    # before step 1 is committed or after: the line says which, as the folder shows.
    committed = sorted(path.name for path in tmp_path.glob("step-*"))
    if committed:
        assert committed == ["step-00000001"], committed
        assert "the last committed checkpoint (step 1) is intact: fix it and resume with " in str(error)
    else:
        assert str(error).endswith("; no checkpoint was committed yet: fix it and run the same command again")


@pytest.mark.parametrize(
    "length, message",
    [
        ("-3", "train_dataset.__len__() is -3: the number of training rows must be an integer >= 0"),
        ("24.5", "train_dataset.__len__() is 24.5: the number of training rows must be an integer >= 0"),
        (
            "2**62",
            "the training set has 4611686018427387904 rows: a permutation of them (8 bytes a row, 36.9 EB)",
        ),
    ],
)
def test_a_length_that_is_not_a_count_of_rows_is_one_line(data_dir, tmp_path, monkeypatch, length, message):
    error = _refused(_config(data_dir, tmp_path), {"HOSTILE": f"len={length}"}, monkeypatch, DataError)
    assert str(error).startswith(message), str(error)


def test_debug_prints_the_traceback_through_a_workers_sample_and_a_task_that_exits_0_ends_with_exit_2(
    data_dir, tmp_path
):
    """The real script: a sample raising in a DataLoader worker is one line without --debug and
    the worker's own traceback through the sample's code with it; a loss that calls
    sys.exit(0) after step 2 (committed) is one line and exit 2, never the 0 of a finished run."""
    args = _set(data_dir, tmp_path / "ck", "data.shuffle=false", "data.num_workers=2")
    hostile = script_env(HOSTILE="raise", HOSTILE_AT="5")
    plain = run_script("02_train.py", *args, cwd=tmp_path, env=hostile)
    assert plain.returncode == 2
    line = one_line_error(plain)
    assert line.startswith(
        "error: train_dataset[5] (epoch 0) raised ValueError: this row is corrupt; no checkpoint"
    )
    debug = run_script("02_train.py", *args, "--debug", cwd=tmp_path, env=hostile)
    assert debug.returncode == 2
    trace, last = debug.stderr.rstrip("\n").rsplit("\n", 1)
    assert last == line, debug.stderr
    assert trace.startswith("Traceback (most recent call last):") and trace.endswith(
        "ValueError: this row is corrupt"
    )
    assert re.search(r'hostile_factories\.py", line \d+, in __getitem__', trace), trace

    args = _set(data_dir, tmp_path / "exits", "checkpoint.every=2", "checkpoint.async=false")
    exits = run_script(
        "02_train.py",
        *args,
        cwd=tmp_path,
        env=script_env(HOSTILE="loss_exit", HOSTILE_AFTER=str(tmp_path / "exits" / "step-00000002")),
    )
    assert exits.returncode == 2, exits.stdout + exits.stderr
    assert re.match(
        r"error: the task's code raised SystemExit\(0\) at \S*hostile_factories\.py:\d+ \(loss\) before the run "
        r"reached its last step; the last committed checkpoint \(step 2\) is intact: fix it and resume with "
        r"\S*python\S* \S*02_train\.py .*--resume latest$",
        one_line_error(exits),
    ), exits.stderr


def test_a_stream_that_raises_cannot_be_copied_or_does_not_stack_is_one_line(data_dir, tmp_path, monkeypatch):
    stream = {"data.factory": STREAM, "checkpoint.every": 1}
    error = _refused(
        _config(data_dir, tmp_path / "a", **stream), {"HOSTILE": "raise", "HOSTILE_AT": "9"}, monkeypatch
    )
    assert str(error).startswith(
        "train_iterable's record 9 of pass 0 raised ValueError: this row is corrupt; the last committed "
        "checkpoint (step 2) is intact: fix it and resume with "
    ), str(error)
    assert isinstance(error.__cause__, ValueError)  # the stream's own traceback, for --debug
    error = _refused(
        _config(data_dir, tmp_path / "b", **stream), {"HOSTILE": "raise", "HOSTILE_AT": "1"}, monkeypatch
    )
    assert str(error).startswith(
        "train_iterable, read from a copy before the first step (to check that it resumes exactly), raised "
        "ValueError: this row is corrupt; no checkpoint was committed yet"
    ), str(error)
    error = _refused(
        _config(data_dir, tmp_path / "c", **stream), {"HOSTILE": "shape", "HOSTILE_AT": "9"}, monkeypatch
    )
    assert str(error).startswith(
        "collate of the stream's record 8 to record 11 of pass 0 failed: the samples differ in shape (record "
        "8[0] is [3], record 9[0] [7]), and default_collate stacks samples of one shape only: give "
        "data.factory a collate(samples) that pads them"
    ), str(error)
    error = _refused(
        _config(data_dir, tmp_path / "d", **stream), {"HOSTILE": "uncopyable"}, monkeypatch, DataError
    )
    assert str(error).startswith(
        "train_iterable cannot be copied (TypeError: cannot pickle '_thread.lock' object): the pipeline reads a "
        "copy to check"
    ), str(error)


def test_a_get_batch_that_raises_is_one_line_naming_its_rows(data_dir, tmp_path, monkeypatch):
    config = _config(
        data_dir, tmp_path, **{"data.factory": "hostile_factories:build_batches", "data.shuffle": False}
    )
    error = _refused(config, {"HOSTILE": "exit0", "HOSTILE_AT": "5"}, monkeypatch)
    assert str(error).startswith(
        "get_batch of rows [4, 5, 6, 7] (epoch 0) raised SystemExit: 0; no checkpoint was committed yet"
    ), str(error)
    assert isinstance(error.__cause__, SystemExit)  # its traceback, for --debug


@pytest.mark.parametrize("source", ["workers", "no-workers", "stream"])
def test_a_sample_that_never_returns_ends_the_run_at_data_sample_timeout(
    data_dir, tmp_path, monkeypatch, source
):
    """Sample 9 (step 3's batch) takes 10 minutes; the run ends in one line after 5 s, step 2
    committed. Without the option it would wait for ever (a SIGTERM too: the stop waits for the
    step in progress). 5 s, not less: every other batch must arrive within it, the first one's
    workers started, on a machine busy with other work too."""
    overrides = {"data.shuffle": False, "checkpoint.every": 2, "data.sample_timeout": 5}
    overrides.update(
        {"workers": {"data.num_workers": 2}, "no-workers": {}, "stream": {"data.factory": STREAM}}[source]
    )
    # Were the deadline not kept, the sample would return after 10 minutes and the run go on.
    hostile = {"HOSTILE": "stall", "HOSTILE_AT": "9", "HOSTILE_STALL": "600"}
    error = _refused(_config(data_dir, tmp_path, **overrides), hostile, monkeypatch)
    expected = {
        "workers": "no batch came from the DataLoader workers in data.sample_timeout=5 s",
        "no-workers": "the batch of train_dataset[8] (epoch 0) took more than data.sample_timeout=5 s",
        "stream": "the stream's batch from record 8 of pass 0 took more than data.sample_timeout=5 s",
    }[source]
    assert str(error).startswith(expected), str(error)
    assert "; the last committed checkpoint (step 2) is intact: fix it and resume with " in str(error)


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_loss_that_diverges_before_any_checkpoint_says_none_was_committed(data_dir, tmp_path, bad):
    config = _config(data_dir, tmp_path, **{"data.factory": f"failure_factories:build_{bad}_after_data"})
    with pytest.raises(TrainingDiverged) as diverged:
        train(config, progress=False)
    assert str(diverged.value) == (
        f"loss is {bad} at step 3, nothing was saved for it: lower optimizer.lr or check the data; no checkpoint "
        "was committed yet: fix it and run the same command again"
    )


@pytest.mark.parametrize(
    "module, path, message",
    [
        (
            "raises_at_import",
            "raises_at_import:build",
            "model.factory: importing module 'raises_at_import' raised RuntimeError: no GPU here (--debug prints "
            "the traceback)",
        ),
        (
            "exits_at_import",
            "exits_at_import:build",
            "model.factory: importing module 'exits_at_import' raised SystemExit: 3 (--debug prints the traceback)",
        ),
        (
            None,
            "../model:build",
            "model.factory: '../model:build' is not an import path: write 'package.module:function' with dotted "
            "names (no file path, no '..', no '.py'), e.g. 'model:function'",
        ),
        (None, "model.py:build", "model.factory: 'model.py:build' is not an import path"),
    ],
)
def test_a_factory_module_that_fails_at_import_or_a_path_that_is_a_file_is_one_line(
    tmp_path, monkeypatch, module, path, message
):
    (tmp_path / "raises_at_import.py").write_text("raise RuntimeError('no GPU here')\n")
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.chdir(tmp_path)  # the factory module beside the config, as a user keeps it
    with pytest.raises(ConfigError) as refused:
        resolve(path, "model.factory")
    assert str(refused.value).startswith(message), str(refused.value)
    if module is not None:
        assert refused.value.__cause__ is not None  # printed by --debug


def test_04_says_in_one_line_when_the_tasks_evaluate_raises(data_dir, tmp_path):
    train(_config(data_dir, tmp_path / "ck"), progress=False, stop_at=2)
    args = [
        "--config",
        str(CONFIG),
        "--set",
        f"data.dir={data_dir}",
        "--set",
        f"checkpoint.dir={tmp_path / 'ck'}",
    ]
    args += ["--set", f"data.factory={ROWS}"]
    result = run_script("04_evaluate.py", *args, cwd=tmp_path, env=script_env(HOSTILE="evaluate"))
    assert result.returncode == 2
    assert one_line_error(result) == (
        f"error: data.factory {ROWS} evaluate() failed: RuntimeError: the held-out file is unreadable (check "
        "data.params; --debug prints the traceback)"
    )
    assert not (tmp_path / "metrics.json").exists()


def test_02_says_in_one_line_when_the_tasks_evaluate_raises_during_training(data_dir, tmp_path):
    """The same task's evaluate() raising at training.eval_every's first step: 02 ends with
    the one line that names data.factory, exit 2, no traceback."""
    checkpoints = tmp_path / "ck"
    args = _set(data_dir, checkpoints, "training.eval_every=2")
    result = run_script("02_train.py", *args, cwd=tmp_path, env=script_env(HOSTILE="evaluate"))
    assert result.returncode == 2, result.stderr
    assert one_line_error(result) == (
        f"error: data.factory {ROWS} evaluate() failed: RuntimeError: the held-out file is unreadable (check "
        "data.params; --debug prints the traceback)"
    )


# -- data prepared for another config --------------------------------------------------------


def test_data_prepared_with_another_seed_is_refused_by_01_to_04_naming_the_key_and_the_fix_works(
    data_dir, tmp_path
):
    """02, 03 and 04 with ``--set data.seed=99`` on data 01 prepared with the config's 1234: each
    refuses naming data.seed (04: the checkpoint's own recipe decides). 01 refuses to replace the
    data in place and prints the command that prepares the seed-99 data into a folder of its
    own; run as printed, then 02 with that folder trains."""
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    base = ["--config", str(CONFIG), "--set", f"data.dir={data}"]
    seed = ["--set", "data.seed=99"]
    for script, extra in (
        ("02_train.py", ["--checkpoint-dir", str(tmp_path / "ck"), "--quiet"]),
        ("03_verify_resume.py", ["--output", str(tmp_path / "proof")]),
    ):
        result = run_script(script, *base, *seed, *extra, cwd=tmp_path)
        assert result.returncode == 2
        line = one_line_error(result)
        assert line.startswith(
            f"error: {data}/ holds data prepared with data.seed 1234, but this config has 99: prepare this "
            "config's data into a folder of its own with "
        ), line
    assert not (tmp_path / "ck").exists() and not (tmp_path / "proof").exists()

    refused = run_script("01_prepare_data.py", *base, *seed, cwd=tmp_path)
    assert refused.returncode == 2
    line = one_line_error(refused)
    match = re.fullmatch(
        rf"error: {re.escape(str(data))}/ holds data prepared with data\.seed 1234, this config has 99; nothing "
        r"was touched \(checkpoints may be trained on it\): prepare this config's data into a folder of its "
        r"own with (?P<command>.+), and give (?P<point>--set data\.dir=\S+) to the other scripts too",
        line,
    )
    assert match, line
    command = shlex.split(match["command"])
    assert command[1:] == [
        str(REPO / "scripts" / "01_prepare_data.py"),
        *base[:2],
        *seed,
        match["point"].split()[0],
        match["point"].split()[1],
    ]
    assert sorted(p.name for p in data.iterdir()) == sorted(p.name for p in data_dir.iterdir())
    assert run_script("01_prepare_data.py", *command[2:], cwd=tmp_path).returncode == 0
    own = ["--config", str(CONFIG), *seed, *match["point"].split()]
    trained = run_script(
        "02_train.py", *own, "--checkpoint-dir", str(tmp_path / "ck"), "--quiet", cwd=tmp_path
    )
    assert trained.returncode == 0, trained.stderr

    # 04 on the seed-1234 checkpoint... pointed at the seed-99 data: refused naming the key too.
    train(
        load_config(CONFIG, {"data.dir": str(data), "checkpoint.dir": str(tmp_path / "ck1234")}),
        progress=False,
        stop_at=1,
    )
    result = run_script(
        "04_evaluate.py",
        "--config",
        str(CONFIG),
        *match["point"].split(),
        "--set",
        f"checkpoint.dir={tmp_path / 'ck1234'}",
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert one_line_error(result).endswith(
        "/ holds data prepared with data.seed 99, but step-00000001 was trained on data prepared with 1234: "
        "point data.dir at the data it was trained on"
    )


def test_data_params_changed_after_01_are_refused_by_02_and_01_each_value_its_own_folder(data_dir, tmp_path):
    """data.params decide the data's content as much as data.seed does (here the label noise of
    the rows 01 wrote): 02 with another value refuses the data in place naming the very param,
    and trains nothing; 01 refuses to replace it and proposes a folder of its own, another one
    for each value."""
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    base = ["--config", str(CONFIG), "--set", f"data.dir={data}"]
    result = run_script(
        "02_train.py",
        *base,
        "--set",
        "data.params.noise=0.5",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--quiet",
        cwd=tmp_path,
    )
    assert result.returncode == 2
    line = one_line_error(result)
    assert line.startswith(
        f"error: {data}/ holds data prepared with data.params.noise 0.05, but this config has 0.5: "
    ), line
    assert not (tmp_path / "ck").exists()

    points = []
    for noise in ("0.5", "0.6"):
        refused = run_script("01_prepare_data.py", *base, "--set", f"data.params.noise={noise}", cwd=tmp_path)
        assert refused.returncode == 2
        line = one_line_error(refused)
        assert f"holds data prepared with data.params.noise 0.05, this config has {noise}; nothing" in line, (
            line
        )
        points.append(re.search(r"give (--set data\.dir=\S+) to the other scripts", line)[1])
    assert points[0] != points[1], points
    assert sorted(p.name for p in data.iterdir()) == sorted(p.name for p in data_dir.iterdir())


def test_a_manifest_that_does_not_record_a_recipe_key_is_refused_naming_the_key(data_dir, tmp_path):
    """A manifest.json without data.params (written by an older 01, or edited by hand) cannot
    show the data was made with the config's params: 02 refuses it in one line naming the key,
    trains nothing, and 01 leaves the data in place."""
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    manifest = json.loads((data / "manifest.json").read_text())
    del manifest["params"]
    (data / "manifest.json").write_text(json.dumps(manifest))
    base = ["--config", str(CONFIG), "--set", f"data.dir={data}"]
    result = run_script(
        "02_train.py", *base, "--checkpoint-dir", str(tmp_path / "ck"), "--quiet", cwd=tmp_path
    )
    assert result.returncode == 2
    line = one_line_error(result)
    assert line.startswith(
        f"error: {data}/ holds data prepared with data.params (not recorded), but this config has {{"
    ), line
    assert not (tmp_path / "ck").exists()
    refused = run_script("01_prepare_data.py", *base, cwd=tmp_path)
    assert refused.returncode == 2
    assert "holds data prepared with data.params (not recorded), this config has {" in one_line_error(refused)
    assert json.loads((data / "manifest.json").read_text()) == manifest


def test_a_data_prepare_that_is_not_deterministic_keeps_the_data_in_place(tmp_path):
    """Run again with the same config, a non-deterministic data.prepare (a tokenizer trained on
    threads) writes other bytes: 01 says so and keeps the data checkpoints were trained on."""
    args = ["--config", str(CONFIG), "--set", f"data.dir={tmp_path / 'data'}"]
    args += ["--set", "data.prepare=hostile_factories:prepare_unrepeatable"]
    assert run_script("01_prepare_data.py", *args, cwd=tmp_path).returncode == 0
    before = (
        (tmp_path / "data" / "vocabulary.bin").read_bytes(),
        (tmp_path / "data" / "manifest.json").read_bytes(),
    )
    again = run_script("01_prepare_data.py", *args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "data unchanged, already prepared" in again.stdout
    (line,) = again.stderr.splitlines()
    kept = json.loads(before[1])
    # The fingerprint of the bytes discarded first, then that of the data kept ("in place").
    written = re.fullmatch(
        re.escape(
            "warning: hostile_factories:prepare_unrepeatable wrote other bytes than the data already in "
            f"{tmp_path / 'data'}/ for this same config (fingerprint "
        )
        + "([0-9a-f]{12})"
        + re.escape(
            f", in place {kept['fingerprint'][:12]}): it is not deterministic (a tokenizer trained on several "
            "threads? an unseeded draw?). The data in place is kept and verifies: checkpoints are trained on it"
        ),
        line,
    )
    assert written is not None and written[1] != kept["fingerprint"][:12], line
    assert (
        (tmp_path / "data" / "vocabulary.bin").read_bytes(),
        (tmp_path / "data" / "manifest.json").read_bytes(),
    ) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # nothing left beside it
    # What 01 prints is the data kept, which checkpoints train on, not the bytes it discarded.
    assert f"fingerprint {kept['fingerprint']}\n" in again.stdout, again.stdout
    digest = hashlib.sha256(before[0]).hexdigest()
    assert kept["files"]["vocabulary.bin"]["sha256"] == digest
    assert f"  {digest}  " in again.stdout and again.stdout.count("fingerprint ") == 1, again.stdout


def test_04_and_05_say_which_set_values_the_checkpoints_own_config_overrules(evaluated_run, run_copy):
    """--set of a key the checkpoint decides, with another value: one warning line, and the
    checkpoint's own config is what is evaluated and staged (as the line says)."""
    run = run_copy(evaluated_run)
    warning = (
        "warning: not used: --set model.params.hidden=32 (it has 16): a checkpoint is evaluated and staged "
        "with the config it was trained with (estados_local/step-00000010/meta.json)"
    )
    evaluated = run.ok("04_evaluate.py", "--set", "model.params.hidden=32", "--output", "other.json")
    assert evaluated.stderr.splitlines() == [warning], evaluated.stderr
    before, after = (json.loads((run.root / name).read_text()) for name in ("metrics.json", "other.json"))
    assert after["metrics"] == before["metrics"] and after["modelo_sha256"] == before["modelo_sha256"]
    staged = run.ok(
        "05_stage.py", "--set", "model.params.hidden=32", "--no-metrics", "--stage", "other_stage"
    )
    assert staged.stderr.splitlines() == [warning], staged.stderr
    assert (
        json.loads((run.root / "other_stage" / "meta.json").read_text())["config"]["model"]["params"][
            "hidden"
        ]
        == 16
    )
    # The value it was trained with, and keys that only say where things are, are no change.
    same = run.ok(
        "04_evaluate.py",
        "--set",
        "model.params.hidden=16",
        "--set",
        "training.device=cpu",
        "--output",
        "m.json",
    )
    assert same.stderr == ""


# -- workers and trainers killed at random instants ------------------------------------------

# Worker kills in the suite; `WORKER_KILLS=60 pytest tests/test_user_code.py -k random` is the soak.
WORKER_KILLS = int(os.environ.get("WORKER_KILLS", "6"))


@pytest.mark.heavy
def test_workers_and_trainers_killed_at_random_instants_end_in_one_line_or_resume(data_dir, tmp_path):
    """A run with 2 DataLoader workers, started again after each kill (--resume auto): a worker
    SIGKILLed at a random instant (while the iterator starts its workers, mid-sample, mid-handover
    of a batch, while the step trains) ends the run with one line naming it, exit 2; the trainer
    itself SIGKILLed (one kill in four) leaves nothing printed by its workers, and the next start
    takes the folder at once. Never a traceback; the last leg resumes and its checkpoint verifies."""
    chooser = random.Random(int(os.environ.get("WORKER_KILLS_SEED", "20261201")))
    checkpoints = tmp_path / "ck"
    args = _set(
        data_dir, checkpoints, "data.num_workers=2", "checkpoint.every=2", "training.max_steps=1000000"
    )
    seen: collections.Counter[str] = collections.Counter()
    worker_kills = 0
    while worker_kills < WORKER_KILLS:
        trainer = start_script("02_train.py", *args, "--resume", "auto", cwd=tmp_path)
        try:
            _wait_until(lambda: len(children(trainer.pid)) == 2, "its workers", trainer)
            time.sleep(chooser.choice([0.0, chooser.uniform(0.0, 0.3)]))  # 0: while the iterator starts
            workers = children(trainer.pid)
            victim = trainer.pid if chooser.random() < 0.25 or not workers else chooser.choice(workers)
            os.kill(victim, signal.SIGKILL)
        finally:
            result = trainer.wait(timeout=120)
        assert "Traceback" not in result.stderr, (
            f"{'trainer' if victim == trainer.pid else 'worker'}: {result.stderr}"
        )
        if victim == trainer.pid:
            assert result.returncode == -signal.SIGKILL and result.stderr == "", result.stderr
            seen["trainer killed"] += 1
            continue
        worker_kills += 1
        assert result.returncode == 2, result.stdout + result.stderr
        line = one_line_error(result)
        assert re.match(rf"error: a DataLoader worker (\(pid {victim}\) )?", line) and "SIGKILL" in line, line
        seen["while handing over a batch" if "handing over" in line else "killed"] += 1
    print(f"outcomes over {sum(seen.values())} kills: {dict(seen)}")
    stop = CheckpointStore(checkpoints).committed_steps()[-1] + 1
    final = run_script("02_train.py", *args, "--resume", "latest", "--stop-at", str(stop), cwd=tmp_path)
    assert final.returncode == 0, final.stderr
    verify_checkpoint(checkpoints / f"step-{stop:08d}")
