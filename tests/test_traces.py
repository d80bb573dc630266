"""TensorBoard traces: written while training, rebuilt from the restored history at every start
(a cut or killed run resumed holds exactly the uninterrupted run's), staged by 05 from the
verified checkpoint's history with no host or wall-clock time, and left alone where they are
not ours. Read back with tensorboard's own readers."""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import RunFolder
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

from pipeline.checkpoint import read_tensors
from pipeline.layout import TRACE_FILE, TRACES_MARKER
from pipeline.traces import INSTALL_HINT, open_traces, trace_bytes

from support import REPO, run_python, script_env

CONFIG = REPO / "config.yaml"
HELPERS = Path(__file__).resolve().parent / "helpers"
TRACE = "events.out.tfevents.pipeline"
STAGED_TRACE = f"runs/{TRACE}"
STEPS = list(range(1, 11))
# A run's own traces: traces/<name of its checkpoint folder> beside that folder.
RUN_TRACES = Path("traces") / "estados_local"


def events(folder: Path) -> list[tuple[str, int, float]]:
    """Every scalar of every event file in ``folder`` as written, in file order (no purge, no
    sampling: a step written twice shows twice)."""
    out = []
    for path in sorted(folder.glob("*tfevents*")):
        for event in LegacyEventFileLoader(str(path)).Load():
            out += [(value.tag, event.step, value.simple_value) for value in event.summary.value]
    return out


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard shows: each tag's (step, value) points, all of them kept."""
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def assert_each_step_once(points: list[tuple[str, int, float]]) -> None:
    keys = [(tag, step) for tag, step, _ in points]
    assert len(keys) == len(set(keys)), f"a step was written twice: {sorted(keys)}"


def history_of(checkpoint: Path) -> dict[str, list]:
    tensors = read_tensors(checkpoint / "estado_treino.safetensors")
    return {key: tensors[f"history/{key}"].tolist() for key in ("step", "loss", "lr")}


def as_traced(history: dict[str, list]) -> dict[str, list[tuple[int, float]]]:
    """The history as TensorBoard holds it (float32 values)."""
    return {
        tag: [(step, float(np.float32(value))) for step, value in zip(history["step"], history[key])]
        for tag, key in (("train/loss", "loss"), ("train/lr", "lr"))
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


def test_training_writes_loss_and_lr_at_every_step_in_a_file_that_names_no_host(trained_run):
    traces = trained_run.root / RUN_TRACES
    assert sorted(p.name for p in traces.iterdir()) == [".pipeline-traces", TRACE]
    points = events(traces)
    assert_each_step_once(points)
    assert scalars(traces) == as_traced(history_of(trained_run.checkpoint))
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
    assert len(points) == 2 * 300


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
    assert [step for _, step, _ in points] == sorted(step for _, step, _ in points)
    shown = scalars(tmp_path / "traces")
    assert shown["eval/mse"] == [(2, 0.75), (3, 0.125)] and shown["eval/acc"] == [(2, 0.5), (3, 0.625)]
    assert shown["train/loss"] == [(1, 1.0), (2, 0.5), (3, 0.25)]
    # The published form of the same history and evaluations: the same points.
    published = tmp_path / "published"
    published.mkdir()
    (published / TRACE).write_bytes(trace_bytes(run.history, run.evaluations, 1))
    assert sorted(events(published)) == sorted(points)


def test_log_every_keeps_the_logged_steps_only(tmp_path):
    history = {"step": STEPS, "loss": [float(s) for s in STEPS], "lr": [0.1] * 10}
    (tmp_path / TRACE).write_bytes(trace_bytes(history, {}, 5))
    assert scalars(tmp_path)["train/loss"] == [(5, 5.0), (10, 10.0)]


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
