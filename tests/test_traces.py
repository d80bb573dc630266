"""TensorBoard traces: written while training, rebuilt from the restored history at every start
(a cut or killed run resumed holds exactly the uninterrupted run's), staged by 05 from the
verified checkpoint's history with no host or wall-clock time, and left alone where they are
not ours. Read back with tensorboard's own readers."""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import RunFolder
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

import pipeline.traces as traces_module
from pipeline.checkpoint import read_tensors
from pipeline.config import load_config
from pipeline.layout import TRACE_FILE, TRACES_MARKER
from pipeline.stage import build_stage
from pipeline.traces import INSTALL_HINT, SPEED_TAG, open_traces, trace_bytes
from pipeline.train import train

from support import REPO, run_python, script_env

CONFIG = REPO / "config.yaml"
HELPERS = Path(__file__).resolve().parent / "helpers"
TRACE = "events.out.tfevents.pipeline"
STAGED_TRACE = f"runs/{TRACE}"
STEPS = list(range(1, 11))
HISTORY = ("step", "loss", "lr", "grad_norm", "epoch")
# A run's own traces: traces/<name of its checkpoint folder> beside that folder.
RUN_TRACES = Path("traces") / "estados_local"


def events(folder: Path, *, measured: bool = False) -> list[tuple[str, int, float]]:
    """Every scalar of every event file in ``folder`` as written, in file order (no purge, no
    sampling: a step written twice shows twice); ``train/samples_per_second``, a wall-clock
    measure part of no bitwise claim, only if ``measured``."""
    out = []
    for path in sorted(folder.glob("*tfevents*")):
        for event in LegacyEventFileLoader(str(path)).Load():
            out += [(value.tag, event.step, value.simple_value) for value in event.summary.value]
    return [point for point in out if measured or point[0] != SPEED_TAG]


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard shows: each tag's (step, value) points, all of them kept (but the
    wall-clock ``train/samples_per_second``)."""
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
        if tag != SPEED_TAG
    }


def assert_each_step_once(points: list[tuple[str, int, float]]) -> None:
    keys = [(tag, step) for tag, step, _ in points]
    assert len(keys) == len(set(keys)), f"a step was written twice: {sorted(keys)}"


def weights(checkpoint: Path) -> list:
    tensors = read_tensors(checkpoint / "modelo.safetensors")
    return [tensors[name] for name in sorted(tensors)]


def history_of(checkpoint: Path) -> dict[str, list]:
    tensors = read_tensors(checkpoint / "estado_treino.safetensors")
    return {key: tensors[f"history/{key}"].tolist() for key in HISTORY}


def as_traced(history: dict[str, list]) -> dict[str, list[tuple[int, float]]]:
    """The history as TensorBoard holds it (float32 values; a value not there, NaN, left out)."""
    tags = (
        ("train/loss", "loss"),
        ("train/lr", "lr"),
        ("train/grad_norm", "grad_norm"),
        ("train/epoch", "epoch"),
    )
    return {
        tag: [
            (step, float(np.float32(value)))
            for step, value in zip(history["step"], history[key])
            if not math.isnan(value)
        ]
        for tag, key in tags
    }


def without_tensorboard(run: RunFolder, script: str, *args: str) -> subprocess.CompletedProcess:
    return run_python(
        [HELPERS / "no_tensorboard.py", REPO / "scripts" / script, "--config", CONFIG, *args],
        cwd=run.root,
        env=script_env(),
    )


def fresh_run(trained_run: RunFolder, folder: Path) -> RunFolder:
    """A run folder holding only the prepared data of ``trained_run``."""
    shutil.copytree(trained_run.root / "data", folder / "data")
    return RunFolder(folder)


# -- while training -----------------------------------------------------------------------


def test_training_writes_its_history_at_every_step_in_a_file_that_names_no_host(trained_run):
    traces = trained_run.root / RUN_TRACES
    assert sorted(p.name for p in traces.iterdir()) == [".pipeline-traces", TRACE]
    points = events(traces, measured=True)
    assert_each_step_once(points)
    history = history_of(trained_run.checkpoint)
    assert scalars(traces) == as_traced(history)
    assert sorted(scalars(traces)) == ["train/epoch", "train/grad_norm", "train/loss", "train/lr"]
    # 24 rows in batches of 4: an epoch every 6 steps; a gradient norm at every logged step.
    assert history["epoch"][5] == 1.0 and history["epoch"][6] == 1 + 4 / 24
    assert all(norm > 0 for norm in history["grad_norm"])
    # Measured from the second step on, this process's: not in the checkpoint.
    speeds = [(step, value) for tag, step, value in points if tag == SPEED_TAG]
    assert [step for step, _ in speeds] == STEPS[1:] and all(value > 0 for _, value in speeds)
    assert socket.gethostname().encode() not in (traces / TRACE).read_bytes()


def test_traces_of_a_run_resumed_from_an_earlier_checkpoint_equal_the_uninterrupted_run(
    trained_run, tmp_path
):
    """Cut at step 7 with checkpoints at 5 and 7; step 7's checkpoint lost (as a crash right
    before its commit would): the traces hold steps 6 and 7, past the checkpoint the run
    resumes from. The resumed run's traces hold each step once, with the values of the run
    that was never cut."""
    run = fresh_run(trained_run, tmp_path / "cut")
    run.ok("02_train.py", "--quiet", "--stop-at", "7", "--set", "checkpoint.keep_last=2")
    shutil.rmtree(run.checkpoint_dir / "step-00000007")
    assert [step for tag, step, _ in events(run.root / RUN_TRACES) if tag == "train/loss"] == STEPS[:7]
    run.ok("02_train.py", "--quiet", "--resume", "latest")
    points = events(run.root / RUN_TRACES)
    assert_each_step_once(points)
    assert sorted(points) == sorted(events(trained_run.root / RUN_TRACES))
    assert scalars(run.root / RUN_TRACES) == scalars(trained_run.root / RUN_TRACES)


def test_traces_of_a_run_killed_and_resumed_equal_the_uninterrupted_run(data_dir, tmp_path):
    """SIGKILL right after step 250 (its checkpoint at step 200): nothing of the writer's
    cleanup runs, and the file holds what the writer had handed to the disk by then, steps
    past the checkpoint included. The next start rebuilds the traces from step 200's history
    and goes on; the result is the run that was never killed, each step once."""

    def child(name: str, kill_at: int) -> subprocess.CompletedProcess:
        overrides = {
            "data.dir": str(data_dir),
            "checkpoint.dir": str(tmp_path / name / "estados_local"),
            "checkpoint.async": False,
            "checkpoint.every": 100,
            "training.max_steps": 300,
        }
        command = [HELPERS / "traces_child.py", CONFIG, json.dumps(overrides), str(kill_at)]
        return run_python(command, cwd=tmp_path, env=script_env())

    straight = child("straight", 0)
    assert straight.returncode == 0, straight.stderr
    killed = child("killed", 250)
    assert killed.returncode == -9, killed.stderr
    traced = [step for tag, step, _ in events(tmp_path / "killed" / RUN_TRACES) if tag == "train/loss"]
    assert traced == list(range(1, len(traced) + 1)) and 200 < len(traced) <= 250, traced[-3:]
    finished = child("killed", 0)
    assert finished.returncode == 0, finished.stderr
    points = events(tmp_path / "killed" / RUN_TRACES)
    assert_each_step_once(points)
    assert sorted(points) == sorted(events(tmp_path / "straight" / RUN_TRACES))
    assert len(points) == 4 * 300  # loss, lr, gradient norm and epoch at every step


def test_without_tensorboard_training_runs_and_one_line_says_how_to_turn_traces_on(trained_run, tmp_path):
    run = fresh_run(trained_run, tmp_path / "plain")
    result = without_tensorboard(run, "02_train.py")
    assert result.returncode == 0, result.stderr
    said = [line for line in (result.stdout + result.stderr).splitlines() if "traces" in line.lower()]
    assert len(said) == 1 and "TensorBoard traces are off" in said[0] and INSTALL_HINT in said[0], said
    assert not (run.root / RUN_TRACES).exists()
    assert (run.checkpoint_dir / "step-00000010" / "meta.json").is_file()


@pytest.mark.parametrize("kind", ["folder", "unmarked-events", "marked", "file"])
def test_a_traces_folder_training_did_not_write_is_left_alone(trained_run, tmp_path, kind):
    run = fresh_run(trained_run, tmp_path / "theirs")
    theirs = run.root / RUN_TRACES
    # unmarked-events: a copy of training's file kept by the user; marked: training's own folder,
    # with a file of the user's added since.
    kept = {"folder": ["notes.txt"], "unmarked-events": [TRACE_FILE], "marked": [TRACES_MARKER, "notes.txt"]}
    theirs.parent.mkdir()
    if kind == "file":
        theirs.write_text("mine\n")
    else:
        theirs.mkdir()
        for name in kept[kind]:
            (theirs / name).write_text("mine\n")
    result = run.script("02_train.py")
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "traces" in line.lower()]
    assert len(said) == 1 and "TensorBoard traces are off" in said[0] and "outputs.traces" in said[0], said
    if kind == "file":
        assert theirs.read_text() == "mine\n"
    else:
        assert sorted(p.name for p in theirs.iterdir()) == sorted(kept[kind])
        assert all((theirs / name).read_text() == "mine\n" for name in kept[kind])


MARKER_TEXT = "Written by training, and rebuilt from the checkpoint's history at every start.\n"


def _snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry under ``folder`` (links not followed): its kind and its bytes or target."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            out[str(path.relative_to(folder))] = ("link", os.readlink(path))
        elif path.is_dir():
            out[str(path.relative_to(folder))] = ("dir",)
        elif path.is_fifo():
            out[str(path.relative_to(folder))] = ("fifo",)
        else:
            out[str(path.relative_to(folder))] = ("file", path.read_bytes())
    return out


def _ours(folder: Path) -> None:
    """What training leaves: its marker and an event file of its own."""
    run = SimpleNamespace(history={"step": [1], "loss": [1.0], "lr": [0.1]})
    traces = open_traces(folder, run, log_every=1, say=print, data_dir=folder.parent / "data")
    traces.close(run)


@pytest.mark.parametrize(
    "kind",
    [
        "nested-folder",
        "empty-marker",
        "marker-link",
        "events-link",
        "folder-link",
        "foreign-events",
        "fifo",
        "unmarked-events",
        "empty-user-file",
        "three-user-files",
        "another-writers-events",
        "garbled-events",
    ],
)
def test_anything_but_what_training_writes_turns_traces_off_and_nothing_is_deleted(tmp_path, kind):
    """Only a folder holding exactly training's marker (its text, a regular file) and its event
    file (a regular file starting with training's header) is replaced: a folder named like the
    event file holding the user's notes, an empty marker, links, a file of the user's under the
    event file's name, a FIFO (never opened to block), an empty file of the user's beside them,
    another writer's event file (a SummaryWriter of the user's pointed at the folder): the
    traces are off, nothing deleted."""
    theirs, elsewhere = tmp_path / "traces", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "private.txt").write_text("mine\n")
    (elsewhere / TRACES_MARKER).write_text(MARKER_TEXT)
    if kind == "folder-link":  # to a folder that looks like training's own: never followed
        _ours(elsewhere / "linked")
        theirs.symlink_to(elsewhere / "linked", target_is_directory=True)
    else:
        _ours(theirs)
        if kind == "nested-folder":
            (theirs / TRACE).unlink()
            (theirs / TRACE).mkdir()
            (theirs / TRACE / "notes.txt").write_text("mine\n")
        elif kind == "empty-marker":
            (theirs / TRACES_MARKER).write_text("")
        elif kind == "marker-link":
            (theirs / TRACES_MARKER).unlink()
            (theirs / TRACES_MARKER).symlink_to(elsewhere / TRACES_MARKER)
        elif kind == "events-link":
            (theirs / TRACE).unlink()
            (theirs / TRACE).symlink_to(elsewhere / "private.txt")
        elif kind == "foreign-events":
            (theirs / TRACE).write_text("my own notes, under that name\n")
        elif kind == "fifo":
            (theirs / TRACE).unlink()
            os.mkfifo(theirs / TRACE)
        elif kind == "unmarked-events":  # a training's event file the user kept, without the marker
            (theirs / TRACES_MARKER).unlink()
        elif kind == "empty-user-file":
            (theirs / "notes.txt").touch()
        elif kind == "three-user-files":  # the first by name is named, whatever order the folder lists
            for name in ("m.txt", "z.txt", "a.txt"):
                (theirs / name).write_text("mine\n")
        elif kind == "garbled-events":  # a record's frame around bytes that are no event
            (theirs / TRACE).write_bytes((3).to_bytes(8, "little") + bytes(4) + b"\xff\xff\xff" + bytes(4))
        elif kind == "another-writers-events":
            from torch.utils.tensorboard import SummaryWriter

            with SummaryWriter(str(theirs)) as writer:
                writer.add_scalar("my/metric", 1.0, 1)
    before, outside = _snapshot(theirs) if kind != "folder-link" else {}, _snapshot(elsewhere)
    said: list[str] = []
    run = SimpleNamespace(history={"step": [1, 2], "loss": [1.0, 0.5], "lr": [0.1, 0.1]})
    assert open_traces(theirs, run, log_every=1, say=said.append, data_dir=tmp_path / "data") is None
    # What is wrong, named (the first entry not training's), and the two ways out.
    problem = {
        "folder-link": "is not a folder",
        "unmarked-events": f"holds files training did not write (no {TRACES_MARKER})",
        "empty-marker": f"holds files training did not write ({TRACES_MARKER})",
        "marker-link": f"holds files training did not write ({TRACES_MARKER})",
        "empty-user-file": "holds files training did not write (notes.txt)",
        "three-user-files": "holds files training did not write (a.txt)",
        "another-writers-events": "holds files training did not write (events.out.tfevents.",
    }.get(kind, f"holds files training did not write ({TRACE})")
    assert len(said) == 1 and said[0].startswith(f"TensorBoard traces are off: {theirs} {problem}"), said
    assert said[0].endswith(
        ", and training only replaces a traces folder it wrote; move it away or set outputs.traces to another folder"
    ), said
    if kind != "folder-link":
        assert _snapshot(theirs) == before
    assert _snapshot(elsewhere) == outside


def test_a_traces_folder_that_cannot_be_made_turns_the_traces_off_in_one_line(tmp_path):
    folder = tmp_path / ("t" * 300)  # longer than a file name may be
    said: list[str] = []
    run = SimpleNamespace(history={"step": [1], "loss": [1.0], "lr": [0.1]})
    assert open_traces(folder, run, log_every=1, say=said.append, data_dir=tmp_path / "data") is None
    assert said == [f"TensorBoard traces are off: {folder} cannot be written (File name too long)"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["ours", "empty-events", "marker-only", "absent", "empty"])
def test_what_training_wrote_is_replaced(tmp_path, kind):
    folder = tmp_path / "traces"
    if kind != "absent":
        folder.mkdir()
    if kind in ("ours", "empty-events", "marker-only"):
        _ours(folder)
    if kind == "empty-events":  # killed before its first flush
        (folder / TRACE).write_bytes(b"")
    if kind == "marker-only":
        (folder / TRACE).unlink()
    run = SimpleNamespace(history={"step": [1, 2], "loss": [1.0, 0.5], "lr": [0.1, 0.1]})
    said: list[str] = []
    traces = open_traces(folder, run, log_every=1, say=said.append, data_dir=tmp_path / "data")
    assert traces is not None and not said
    traces.close(run)
    assert (folder / TRACES_MARKER).read_text() == MARKER_TEXT
    assert [step for tag, step, _ in events(folder) if tag == "train/loss"] == [1, 2]


def test_the_restored_history_is_traced_at_the_start_not_with_the_first_step_after_it(tmp_path, monkeypatch):
    """A run resumed at step 2: its traces hold steps 1 and 2 from the moment it starts (a run that
    then trains nothing, or slowly, still shows them), written at that wall time; step 3 at its own."""
    clock = [10.0]
    monkeypatch.setattr(
        traces_module, "time", SimpleNamespace(monotonic=lambda: clock[0], time=lambda: clock[0])
    )
    run = SimpleNamespace(
        step=2,
        history={"step": [1, 2], "loss": [1.0, 0.5], "lr": [0.1, 0.1]},
        sampler=SimpleNamespace(samples_seen=8),
    )
    traces = open_traces(tmp_path / "traces", run, log_every=1, say=print, data_dir=tmp_path / "data")
    clock[0] = 20.0
    run.step, run.sampler.samples_seen = 3, 12
    for key, value in (("step", 3), ("loss", 0.25), ("lr", 0.05)):
        run.history[key].append(value)
    traces.on_step_end(run, None)
    traces.close(run)
    written = [
        (event.step, event.wall_time, [(value.tag, value.simple_value) for value in event.summary.value])
        for event in LegacyEventFileLoader(str(tmp_path / "traces" / TRACE)).Load()
        if event.summary.value
    ]
    assert written == [
        (1, 10.0, [("train/loss", 1.0), ("train/lr", np.float32(0.1))]),
        (2, 10.0, [("train/loss", 0.5), ("train/lr", np.float32(0.1))]),
        (3, 20.0, [("train/loss", 0.25), ("train/lr", np.float32(0.05))]),
    ]


def _traced_speeds(tmp_path, monkeypatch, run, times=(1.0, 1.0, 2.0, 2.0)) -> list[tuple[int, float]]:
    """``run`` resumed at step 4 trains steps 5 to 8, of ``times`` seconds (1, 1, 2 and 2) on the
    traces' clock, logged every 2 steps (its sampler, if any, drawing 4 rows a step): the traced
    samples-per-second points."""
    clock = [100.0]
    monkeypatch.setattr(traces_module, "time", SimpleNamespace(monotonic=lambda: clock[0], time=lambda: 0.0))
    traces = open_traces(tmp_path / "traces", run, log_every=2, say=print, data_dir=tmp_path / "data")
    for step, seconds in zip(range(5, 9), times):
        clock[0] += seconds
        run.step = step
        if run.sampler is not None:
            run.sampler.samples_seen += 4
        for key, value in (("step", step), ("loss", 1.0 / step), ("lr", 0.1)):
            run.history[key].append(value)
        traces.on_step_end(run, None)
    traces.close(run)
    return [
        (step, value) for tag, step, value in events(tmp_path / "traces", measured=True) if tag == SPEED_TAG
    ]


def test_samples_per_second_counts_the_rows_of_each_interval_over_its_own_time(tmp_path, monkeypatch):
    """A run resumed at step 4 (16 rows drawn before), 4 rows a step, steps of 1, 1, 2 and 2
    seconds, logged every 2 steps: 4 then 2 rows a second, each over the steps since the last
    logged one, not the rows since the run began, nor since it resumed."""
    run = SimpleNamespace(
        step=4,
        history={"step": [1, 2, 3, 4], "loss": [1.0, 0.9, 0.8, 0.7], "lr": [0.1] * 4},
        sampler=SimpleNamespace(samples_seen=16),
    )
    assert _traced_speeds(tmp_path, monkeypatch, run) == [(6, 4.0), (8, 2.0)]
    # An interval the clock did not see pass (a coarse clock) has no speed; the next one counts
    # from its end: 8 rows over 4 seconds.
    run.step, run.sampler.samples_seen = 4, 16
    run.history = {key: values[:4] for key, values in run.history.items()}
    assert _traced_speeds(tmp_path / "coarse", monkeypatch, run, times=(0.0, 0.0, 2.0, 2.0)) == [(8, 2.0)]


def test_a_streamed_runs_samples_per_second_counts_every_micro_batch_of_a_step(tmp_path, monkeypatch):
    """A stream has no sampler counting rows: a step trains ``data.batch_size`` rows in each of
    its ``training.grad_accum_steps`` micro-batches, so 4 rows x 3 micro-batches a step, steps
    of 1, 1, 2 and 2 seconds logged every 2: 12 then 6 rows a second."""
    run = SimpleNamespace(
        step=4,
        history={"step": [1, 2, 3, 4], "loss": [1.0, 0.9, 0.8, 0.7], "lr": [0.1] * 4},
        sampler=None,
        config=SimpleNamespace(
            data=SimpleNamespace(batch_size=4), training=SimpleNamespace(grad_accum_steps=3)
        ),
    )
    assert _traced_speeds(tmp_path, monkeypatch, run) == [(6, 12.0), (8, 6.0)]


@pytest.mark.parametrize("where", ["periodic-flush", "write", "close"])
def test_a_disk_that_refuses_the_events_turns_the_traces_off_in_one_line(tmp_path, monkeypatch, where):
    """A real EFBIG (the process's file-size limit, as a full quota would be): at the periodic
    flush, at a write that spills the buffer, at the close. Training's call returns; one line."""
    run = SimpleNamespace(history={"step": [1], "loss": [1.0], "lr": [0.1]})
    said: list[str] = []
    traces = open_traces(tmp_path / "traces", run, log_every=1, say=said.append, data_dir=tmp_path / "data")
    assert traces is not None and not said
    monkeypatch.setattr(traces_module, "FLUSH_SECONDS", 0.0 if where == "periodic-flush" else 1e9)
    more = 3000 if where == "write" else 1  # a few dozen bytes an event: past the 8 KiB buffer
    for step in range(2, 2 + more):
        for key, value in (("step", step), ("loss", 1.0 / step), ("lr", 0.1)):
            run.history[key].append(value)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    try:
        if where == "close":
            traces.close(run)
        else:
            traces.update(run)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert said == [
        f"TensorBoard traces are off from here: writing {tmp_path / 'traces' / TRACE} failed (File too large); "
        "the next start writes them again from the checkpoint"
    ]
    run.history["step"].append(run.history["step"][-1] + 1)
    traces.update(run)  # off: nothing more, no second line
    traces.close(run)
    assert len(said) == 1


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_the_gradient_norm_is_measured_at_logged_steps_and_changes_no_bit_of_training(
    data_dir, tmp_path, clip
):
    def run(log_every: int):
        overrides = {
            "data.dir": str(data_dir),
            "checkpoint.dir": str(tmp_path / f"every{log_every}"),
            "training.log_every": log_every,
            "training.grad_clip": clip,
        }
        return train(load_config(CONFIG, overrides), progress=False)

    every, some = run(1), run(4)
    assert all(torch.equal(a, b) for a, b in zip(weights(every.checkpoint), weights(some.checkpoint)))
    norms = every.history["grad_norm"]
    assert all(norm > 0 for norm in norms)
    # train/epoch counts the fraction of the epoch trained, not only whole epochs.
    assert any(not float(epoch).is_integer() for epoch in every.history["epoch"]), every.history["epoch"]
    assert [n for n in some.history["grad_norm"] if not math.isnan(n)] == [norms[3], norms[7]]
    if clip:  # before clipping: the clipped steps' norms are above the bound
        assert max(norms) > clip


def test_under_fp16_amp_the_gradient_norm_is_of_the_unscaled_gradients(data_dir, tmp_path):
    """fp16 AMP scales the loss (a GradScaler, 65536 at first) before the gradients are taken:
    the norm traced is the gradients' once unscaled, with clipping (which unscales them first)
    or without it (measured on the scaled ones and divided back). A bound no norm reaches
    changes no step, so both runs trace the same norms; the steps the scaler skips (an
    overflow: an infinite norm) alike."""

    def norms(clip: float) -> list[float]:
        overrides = {
            "data.dir": str(data_dir),
            "checkpoint.dir": str(tmp_path / f"clip{clip}"),
            "training.amp": "fp16",
            "training.dtype": "float32",
            "training.grad_clip": clip,
        }
        return train(load_config(CONFIG, overrides), progress=False).history["grad_norm"]

    unclipped, bounded = norms(0.0), norms(1e30)
    finite = [(a, b) for a, b in zip(unclipped, bounded) if math.isfinite(b)]
    assert len(finite) >= 3, bounded
    assert [math.isfinite(n) for n in unclipped] == [math.isfinite(n) for n in bounded]
    assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in finite), (unclipped, bounded)
    assert all(0 < b < 1e3 for _, b in finite), bounded  # a regression's gradients, not 65536 times them


def test_two_runs_whose_checkpoints_share_a_parent_keep_both_traces(trained_run, tmp_path):
    """The docs' own pattern: a run, then a fine-tune of it --init-from in a folder beside it;
    each run's traces in its own folder, named after its checkpoints, listed by TensorBoard."""
    run = fresh_run(trained_run, tmp_path / "two")
    run.ok("02_train.py", "--quiet", "--checkpoint-dir", "runs/base")
    run.ok(
        "02_train.py", "--quiet", "--checkpoint-dir", "runs/ft", "--init-from", "runs/base/step-00000010",
        "--max-steps", "4",
    )  # fmt: skip
    traces = run.root / "runs" / "traces"
    base, tuned = events(traces / "base"), events(traces / "ft")
    assert [step for tag, step, _ in base if tag == "train/loss"] == STEPS
    assert [step for tag, step, _ in tuned if tag == "train/loss"] == [1, 2, 3, 4]
    multiplexer = EventMultiplexer().AddRunsFromDirectory(str(traces))
    assert sorted(multiplexer.Runs()) == ["base", "ft"]


def test_traces_inside_the_data_folder_are_off_and_the_run_resumes(trained_run, tmp_path):
    """The data folder is fingerprinted file by file: a trace file there would make the next
    start refuse the run's own data."""
    run = fresh_run(trained_run, tmp_path / "inside")
    inside = ("--set", f"outputs.traces={run.data_dir / 'traces'}")
    before = sorted(p.name for p in run.data_dir.iterdir())
    stopped = run.script("02_train.py", "--stop-at", "5", *inside)
    assert stopped.returncode == 0, stopped.stderr
    said = [line for line in stopped.stderr.splitlines() if "traces" in line.lower()]
    assert len(said) == 1 and "inside data.dir" in said[0] and "outputs.traces" in said[0], said
    assert sorted(p.name for p in run.data_dir.iterdir()) == before
    resumed = run.script("02_train.py", "--resume", "latest", *inside)
    assert resumed.returncode == 0, resumed.stderr


def test_evaluations_become_eval_traces_in_step_order(tmp_path):
    """An evaluation of step 2 recorded after step 3 ran is still written before step 3's
    values: TensorBoard reads a step going back as a restart and drops what came after it."""
    run = SimpleNamespace(history={"step": [1, 2], "loss": [1.0, 0.5], "lr": [0.1, 0.1]})
    said: list[str] = []
    traces = open_traces(tmp_path / "traces", run, log_every=1, say=said.append, data_dir=tmp_path / "data")
    assert traces is not None and not said
    for key, value in (("step", 3), ("loss", 0.25), ("lr", 0.05)):
        run.history[key].append(value)
    run.evaluations = {"step": [2], "mse": [0.75], "acc": [0.5]}
    traces.update(run)
    run.evaluations = {"step": [2, 3], "mse": [0.75, 0.125], "acc": [0.5, 0.625]}
    traces.close(run)
    points = events(tmp_path / "traces")
    assert_each_step_once(points)
    # Every point in file order: a step's training values, then its evaluation, then the next step.
    lr = float(np.float32(0.1))
    assert points == [
        ("train/loss", 1, 1.0),
        ("train/lr", 1, lr),
        ("train/loss", 2, 0.5),
        ("train/lr", 2, lr),
        ("eval/acc", 2, 0.5),
        ("eval/mse", 2, 0.75),
        ("train/loss", 3, 0.25),
        ("train/lr", 3, float(np.float32(0.05))),
        ("eval/acc", 3, 0.625),
        ("eval/mse", 3, 0.125),
    ]
    shown = scalars(tmp_path / "traces")
    assert shown["eval/mse"] == [(2, 0.75), (3, 0.125)] and shown["eval/acc"] == [(2, 0.5), (3, 0.625)]
    # One curve per metric (`eval/<metric>`): the evaluated step is the x axis, not a curve of its own.
    assert sorted(tag for tag in shown if tag.startswith("eval/")) == ["eval/acc", "eval/mse"], sorted(shown)
    assert shown["train/loss"] == [(1, 1.0), (2, 0.5), (3, 0.25)]
    # The published form of the same history and evaluations: the same points.
    published = tmp_path / "published"
    published.mkdir()
    (published / TRACE).write_bytes(trace_bytes(run.history, run.evaluations, 1))
    assert events(published) == points


def test_log_every_keeps_the_logged_steps_only(tmp_path):
    history = {"step": STEPS, "loss": [float(s) for s in STEPS], "lr": [0.1] * 10}
    (tmp_path / TRACE).write_bytes(trace_bytes(history, {}, 5))
    assert scalars(tmp_path)["train/loss"] == [(5, 5.0), (10, 10.0)]


def test_a_value_the_history_does_not_hold_is_left_out_of_the_traces_not_drawn_as_nan(tmp_path):
    """NaN in the history means "not there": a gradient norm not measured (a checkpoint of
    the version before), the epoch of a stream. Such a value is no point; the others of the
    same step are."""
    nan = float("nan")
    history = {
        "step": [1, 2, 3],
        "loss": [1.0, 0.5, 0.25],
        "lr": [0.1, 0.1, 0.1],
        "grad_norm": [nan, 2.0, nan],
        "epoch": [nan, nan, nan],
    }
    (tmp_path / TRACE).write_bytes(trace_bytes(history, {}, 1))
    shown = scalars(tmp_path)
    assert sorted(shown) == ["train/grad_norm", "train/loss", "train/lr"]
    assert shown["train/grad_norm"] == [(2, 2.0)] and shown["train/loss"] == [(1, 1.0), (2, 0.5), (3, 0.25)]


# -- staged and reproducible ----------------------------------------------------------------


def test_stage_holds_the_checkpoint_history_as_traces_without_wall_time(staged_run):
    staged = staged_run.stage / "runs"
    assert [p.name for p in staged.iterdir()] == [TRACE]
    points = events(staged)
    assert_each_step_once(points)
    assert scalars(staged) == as_traced(history_of(staged_run.checkpoint))
    walls = {event.wall_time for event in LegacyEventFileLoader(str(staged / TRACE)).Load()}
    assert walls == {0.0}
    meta = json.loads((staged_run.stage / "meta.json").read_text())
    assert meta["training"]["traces"] == STAGED_TRACE and STAGED_TRACE in meta["files"]
    card = (staged_run.stage / "README.md").read_text()
    assert f"]({STAGED_TRACE})" in card and "Training metrics" in card


def test_the_stage_draws_the_traces_at_the_checkpoints_log_every_not_the_config_given_to_05(
    staged_run, run_copy
):
    """The traces are the checkpoint's own: a config edited after training (log_every 1 -> 5)
    changes no traced point. So are the record and the card: they state what the checkpoint ran
    with (its seed, learning rate, log_every), only the card section is today's; --repo-id given
    as its page's address is recorded, and downloaded from, as the id."""
    run = run_copy(staged_run)
    assert json.loads((run.checkpoint / "meta.json").read_text())["config"]["training"]["log_every"] == 1
    edits = {"training.log_every": 5, "training.seed": 7, "optimizer.lr": 0.5, "card.description": "Edited."}
    build_stage(
        load_config(CONFIG, {**run.overrides, **edits}),
        stage_dir=run.stage,
        metrics=run.metrics,
        repo_id="https://huggingface.co/you/mlp",
    )
    assert scalars(run.stage / "runs") == as_traced(history_of(staged_run.checkpoint))
    assert (run.stage / STAGED_TRACE).read_bytes() == (staged_run.stage / STAGED_TRACE).read_bytes()
    staged, before = (
        json.loads((stage / "meta.json").read_text()) for stage in (run.stage, staged_run.stage)
    )
    assert staged["config"] == {
        **before["config"],
        "card": {**before["config"]["card"], "description": "Edited."},
    }
    assert (staged["repo_id"], before["repo_id"]) == ("you/mlp", None)
    card, card_before = (
        (stage / "README.md").read_text().split("\n\n") for stage in (run.stage, staged_run.stage)
    )
    assert card[2] == "Edited."
    assert card[card.index("## How to load it") + 4].startswith('repo_id = "you/mlp"\nrevision = "main"  #')
    # From the training table on, every paragraph but those listing meta.json (its digest and size
    # changed with the description).
    assert [part for part in card[card.index("## Training") :] if "meta.json" not in part] == [
        part for part in card_before[card_before.index("## Training") :] if "meta.json" not in part
    ]


def test_stage_without_tensorboard_says_so_in_the_card(evaluated_run, run_copy):
    run = run_copy(evaluated_run)
    result = without_tensorboard(run, "05_stage.py")
    assert result.returncode == 0, result.stderr
    assert not (run.stage / "runs").exists()
    assert json.loads((run.stage / "meta.json").read_text())["training"]["traces"] is None
    assert (
        f"No TensorBoard traces: tensorboard was not installed where this model was staged ({INSTALL_HINT})"
        in (run.stage / "README.md").read_text()
    )
    assert "traces' events carry wall time 0" not in (run.stage / "README.md").read_text()


def test_two_runs_of_the_same_config_stage_the_same_bytes(staged_run, restaged_run):
    """Trained, evaluated and staged again in another folder, at another time: the checkpoints'
    meta.json differ (their wall-clock ``created``), every staged file is the same."""
    first, second = (json.loads((r.checkpoint / "meta.json").read_text()) for r in (staged_run, restaged_run))
    assert first["created"] != second["created"]

    def stage(run: RunFolder) -> dict[str, bytes]:
        return {
            p.relative_to(run.stage).as_posix(): p.read_bytes() for p in run.stage.rglob("*") if p.is_file()
        }

    staged, restaged = stage(staged_run), stage(restaged_run)
    assert sorted(staged) == sorted(restaged)
    assert [name for name in staged if staged[name] != restaged[name]] == []
    assert second["created"].encode() not in b"".join(restaged.values())


def test_the_cards_commands_train_the_published_weights_again(staged_run, tmp_path):
    """The card's Reproduce commands, run in an empty folder holding only the staged meta.json,
    give weights with the staged SHA-256; the card names the platform facts that decide it."""
    card = (staged_run.stage / "README.md").read_text()
    section = card.split("## Reproduce", 1)[1].split("\n## ", 1)[0]
    script = section.split("```sh\n", 1)[1].split("\n```", 1)[0]
    meta = json.loads((staged_run.stage / "meta.json").read_text())
    environment = meta["provenance"]["environment"]
    for fact in (
        f"torch {environment['torch']}",
        f"dtype `{meta['config']['training']['dtype']}`",
        f"deterministic algorithms {environment['deterministic_algorithms']}",
        f"{environment['intra_op_threads']} intra-op and {environment['inter_op_threads']} inter-op threads",
        meta["provenance"]["fingerprints"]["code"],
    ):
        assert fact in section, fact
    folder = tmp_path / "again"
    folder.mkdir()
    shutil.copy(staged_run.stage / "meta.json", folder / "meta.json")
    for line in script.splitlines():
        argv = shlex.split(line)
        assert argv[0] == "python", line
        if argv[1] == "-c":  # no torch: a plain interpreter is quick
            result = subprocess.run([sys.executable, *argv[1:]], cwd=folder, capture_output=True, text=True)
        else:  # scripts/NN_name.py of this tree, as the card's reader runs them from a clone
            result = run_python([REPO / argv[1], *argv[2:]], cwd=folder, env=script_env())
        assert result.returncode == 0, f"{line}\n{result.stderr}"
    step = f"step-{meta['step']:08d}"
    weights = (folder / "estados_local" / step / "modelo.safetensors").read_bytes()
    assert hashlib.sha256(weights).hexdigest() == meta["files"]["modelo.safetensors"]["sha256"]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_the_cards_commands_of_a_torchrun_run_launch_it_as_it_was(staged_run, parallel):
    """A run recorded as DDP or FSDP2 is refused in one process: the card's command is torchrun's,
    with the recorded number of processes."""
    from pipeline.stage.card import _reproduce_section

    meta = json.loads((staged_run.stage / "meta.json").read_text())
    meta["training"]["launch"] = {"parallel": parallel, "world_size": 2, "ddp_find_unused_parameters": False}
    script = _reproduce_section(meta).split("```sh\n", 1)[1].split("\n```", 1)[0]
    assert "python -m torch.distributed.run --standalone --nproc-per-node 2 scripts/02_train.py" in script
    assert "python scripts/02_train.py" not in script


@pytest.mark.parametrize("where", ["data-itself", "inside", "beside"])
def test_traces_are_off_in_the_data_folder_and_inside_it_and_on_beside_it(tmp_path, where):
    """The data folder itself, a folder in it, and a sibling whose name only starts like it."""
    data = tmp_path / "data"
    data.mkdir()
    inside, beside = data / "runs" / "traces", tmp_path / "data-traces"
    folder = {"data-itself": data, "inside": inside, "beside": beside}[where]
    run = SimpleNamespace(history={"step": [1], "loss": [0.5], "lr": [0.1]})
    said: list[str] = []
    traces = open_traces(folder, run, log_every=1, say=said.append, data_dir=data)
    if where == "beside":
        assert traces is not None and not said
        traces.close(run)
        assert scalars(folder)["train/loss"] == [(1, 0.5)]
        return
    assert traces is None and said == [
        f"TensorBoard traces are off: {folder} is inside data.dir ({data}), whose every file is fingerprinted; "
        "set outputs.traces to a folder outside it"
    ]
    assert sorted(data.rglob("*")) == []
