"""Background checkpoint saves: same bytes as synchronous ones, reused buffers, errors that
surface in the training thread, commits that outlive SIGTERM. Resume verifies and reads the
files in one pass, refuses exactly what verification refuses, and copies no tensor twice."""

from __future__ import annotations

import gc
import json
import signal
import subprocess
import threading
import weakref
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint import (
    Checkpointer,
    CheckpointStore,
    LoadMode,
    capture_state,
    load_checkpoint,
    read_tensors,
    restore_state,
)
from pipeline.checkpoint.checkpointer import PendingSave
from pipeline.checkpoint.snapshot import SnapshotBuffers
from pipeline.config import load_config
from pipeline.data import prepare_data as prepare_data_in_process
from pipeline.errors import CheckpointError
from pipeline.layout import MODEL_FILE, STATE_FILE
from pipeline.run import build_run
from pipeline.train import train_step

from support import PYTHON, REPO, data_args, save_parts, script_env, train, verify_checkpoint

FILES = (MODEL_FILE, STATE_FILE)


@pytest.fixture
def make_run(data_dir):
    """``make_run(steps)``: the default config's run, built in this process and trained ``steps`` steps."""
    config = load_config(REPO / "config.yaml", {"data.dir": str(data_dir)})
    prepare_data_in_process(config)  # already prepared: only verifies the manifest

    def make(steps: int):
        run = build_run(config, torch.device("cpu"))
        for _ in range(steps):
            train_step(run)
        return run

    return make


def _provenance() -> dict:
    from pipeline.environment import current_environment

    return {
        "config": {},
        "fingerprints": {"data": "d", "code": "c"},
        "versions": {},
        "device": "cpu",
        "environment": {**current_environment(torch.device("cpu")), "changes": []},
        "lineage": [],
    }


def _temporary_folders(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_async_and_sync_saves_of_one_state_write_byte_identical_files(make_run, tmp_path):
    run = make_run(3)
    with CheckpointStore(tmp_path / "sync") as store:
        Checkpointer(store, _provenance(), background=False).save(run)
    with CheckpointStore(tmp_path / "async") as store:
        checkpointer = Checkpointer(store, _provenance(), background=True)
        pending = checkpointer.save(run)
        assert isinstance(pending, PendingSave)
        checkpointer.close()
    for name in FILES:
        sync_bytes = (tmp_path / "sync" / "step-00000003" / name).read_bytes()
        assert sync_bytes == (tmp_path / "async" / "step-00000003" / name).read_bytes(), name
    sync_meta = verify_checkpoint(tmp_path / "sync" / "step-00000003")
    async_meta = verify_checkpoint(tmp_path / "async" / "step-00000003")
    assert sync_meta["files"] == async_meta["files"]
    assert sync_meta["training_state"] == async_meta["training_state"]


def _snapshot(buffers: SnapshotBuffers, run) -> dict:
    model_tensors, _, state_tensors = capture_state(run)
    copies = buffers.copy({"model": model_tensors, "state": state_tensors})
    return {(group, name): t for group, tensors in copies.items() for name, t in tensors.items()}


def test_snapshot_buffers_are_reused_from_save_to_save_and_freed_by_release(make_run):
    run = make_run(1)
    buffers = SnapshotBuffers()
    # Holding the first buffers keeps fresh allocations from landing at their addresses.
    first = _snapshot(buffers, run)
    live = {t.data_ptr() for t in run.model.state_dict().values()}
    assert not live & {t.data_ptr() for t in first.values()}, "the snapshot aliases live weights"
    train_step(run)
    second = _snapshot(buffers, run)
    kept = {key for key in first if key[0] == "model" or key[1].startswith("optimizer/")}
    assert kept and all(first[key].data_ptr() == second[key].data_ptr() for key in kept)
    held = weakref.ref(second[min(kept)])
    del first, second
    buffers.release()
    gc.collect()
    assert held() is None, "release() keeps the buffers alive"


def _copy_helpers() -> int:
    return sum(thread.name == "snapshot-copy" for thread in threading.enumerate())


def test_a_small_snapshot_is_copied_by_the_training_thread_alone():
    # A helper descheduled mid-piece on a busy host makes the training thread wait for it,
    # longer than the whole copy of a small state takes alone (benchmarks/README.md).
    sources = {"a": torch.randn(2**20), "b": torch.randn(2**20 + 3), "c": torch.arange(5)}  # 8 MB, 3 pieces
    buffers, before = SnapshotBuffers(), _copy_helpers()
    copies = buffers.copy({"g": sources})["g"]
    assert _copy_helpers() == before, "a helper thread was started for an 8 MB snapshot"
    assert all(torch.equal(copies[name], sources[name]) for name in sources)
    buffers.release()


def test_a_large_snapshot_is_shared_with_a_helper_and_copied_exactly():
    sources = {
        "big": torch.randn(9 * 2**20 + 5),
        "small": torch.randn(7),
        "ints": torch.arange(1000),
    }  # 36 MB
    buffers, before = SnapshotBuffers(), _copy_helpers()
    for shift in (0, 1):  # the second copy reuses the buffers, as a run's later saves do
        for tensor in sources.values():
            tensor.add_(shift)
        copies = buffers.copy({"g": sources})["g"]
        assert _copy_helpers() == before + 1, "no helper thread shared a 36 MB snapshot"
        assert all(torch.equal(copies[name], sources[name]) for name in sources)
    buffers.release()
    assert _copy_helpers() == before, "release() leaves the helper thread running"


def test_async_save_holds_the_state_of_its_own_step(make_run, tmp_path):
    run = make_run(1)
    with CheckpointStore(tmp_path, keep_last=2) as store:
        checkpointer = Checkpointer(store, _provenance(), background=True)
        checkpointer.save(run)
        train_step(run)
        expected = {name: t.clone() for name, t in run.model.state_dict().items()}
        checkpointer.save(run)
        # Training moves on while step 2 is written: the file must still hold step 2.
        train_step(run)
        checkpointer.close()
    saved = read_tensors(tmp_path / "step-00000002" / MODEL_FILE)
    assert all(torch.equal(saved[name], expected[name]) for name in saved)
    assert not torch.equal(saved["net.0.weight"], run.model.state_dict()["net.0.weight"])


@pytest.mark.parametrize("surfaces_at", ["next save", "close"])
def test_failed_background_write_raises_in_training_thread_and_keeps_previous_checkpoint(
    make_run, tmp_path, surfaces_at
):
    run = make_run(1)
    with CheckpointStore(tmp_path) as store:
        checkpointer = Checkpointer(store, _provenance(), background=True)
        checkpointer.save(run).result()
        train_step(run)
        # A real failure in the writer: safetensors has no complex dtype. The copy into the
        # snapshot succeeds, so the error can only come from the background write.
        state = run.optimizer.state[run.optimizer.param_groups[0]["params"][0]]
        state["unwritable"] = torch.zeros(2, dtype=torch.complex64)
        assert isinstance(checkpointer.save(run), PendingSave)
        del state["unwritable"]
        train_step(run)
        with pytest.raises(TypeError, match="unwritable"):
            checkpointer.save(run) if surfaces_at == "next save" else checkpointer.close()
        assert _temporary_folders(tmp_path) == []
        assert store.committed_steps() == [1]
        verify_checkpoint(tmp_path / "step-00000001")
        # Raised once, then the checkpointer works again.
        checkpointer.save(run)
        checkpointer.close()
        assert store.committed_steps() == [3]


@pytest.mark.heavy
def test_async_training_ends_bitwise_equal_to_sync_and_resumes_exactly(data_dir, tmp_path):
    sync, straight, resumed = tmp_path / "sync", tmp_path / "async", tmp_path / "resumed"
    # Saving every step keeps a write in flight while the next steps train; the interrupted
    # run also saves mid-run, then resumes in a new process. Each run is its own process.
    for folder, *args in (
        (sync, "--set", "checkpoint.async=false"),
        (straight, "--set", "checkpoint.async=true", "--checkpoint-every", "1"),
        (resumed, "--set", "checkpoint.async=true", "--checkpoint-every", "2", "--stop-at", "5"),
        (resumed, "--set", "checkpoint.async=true", "--resume", "latest"),
    ):
        result = train(data_dir, folder, *args)
        assert result.returncode == 0, result.stderr
    for other in (straight, resumed):
        for name in FILES:
            assert (sync / "step-00000010" / name).read_bytes() == (
                other / "step-00000010" / name
            ).read_bytes(), f"{other.name}/{name} differs from the synchronous run"
        assert (
            verify_checkpoint(other / "step-00000010")["training_state"]
            == verify_checkpoint(sync / "step-00000010")["training_state"]
        )


def test_sigterm_during_async_training_waits_for_the_save_in_flight_which_verifies(data_dir, tmp_path):
    # A wide model (tens of MB per save) saved every step: a write is nearly always in flight.
    command = [
        PYTHON,
        "-B",
        str(REPO / "scripts" / "02_train.py"),
        *data_args(data_dir),
        "--checkpoint-dir",
        str(tmp_path),
        "--max-steps",
        "100000",
        "--checkpoint-every",
        "1",
        "--set",
        "checkpoint.async=true",
        "--set",
        "model.params.hidden=1500",
    ]
    process = subprocess.Popen(
        command, cwd=REPO, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for line in process.stderr:
        if line.startswith("step 3/"):
            break
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    steps = CheckpointStore(tmp_path).committed_steps()
    assert len(steps) == 1 and steps[0] >= 3
    folder = tmp_path / f"step-{steps[0]:08d}"
    assert str(folder) in stderr, "the message names a checkpoint that is not the committed one"
    assert verify_checkpoint(folder)["step"] == steps[0]
    assert _temporary_folders(tmp_path) == []


def _mapped_file(pointer: int) -> str | None:
    """The file behind the memory mapping that holds ``pointer`` (None: anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= pointer < high:
            return fields[5].strip() if len(fields) == 6 else None
    return None


def _saved_checkpoint(make_run, root: Path) -> Path:
    with CheckpointStore(root) as store:
        return Checkpointer(store, _provenance()).save(make_run(2)).path


def test_one_pass_load_returns_the_meta_and_what_read_tensors_returns(make_run, tmp_path):
    folder = _saved_checkpoint(make_run, tmp_path)
    loaded = load_checkpoint(folder)
    assert loaded.meta == json.loads((folder / "meta.json").read_text())
    for name, tensors in ((MODEL_FILE, loaded.model_tensors), (STATE_FILE, loaded.state_tensors)):
        expected = read_tensors(folder / name)
        assert tensors.keys() == expected.keys()
        assert all(
            tensors[k].dtype == expected[k].dtype and torch.equal(tensors[k], expected[k]) for k in expected
        )


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped byte in weights": lambda f: _flip_last_byte(f / MODEL_FILE),
    "flipped byte in training state": lambda f: _flip_last_byte(f / STATE_FILE),
    "truncated weights": lambda f: (f / MODEL_FILE).write_bytes((f / MODEL_FILE).read_bytes()[:-8]),
    "missing training state": lambda f: (f / STATE_FILE).unlink(),
    "stray file": lambda f: (f / "notes.txt").write_text("x"),
    "edited meta.json": lambda f: (f / "meta.json").write_text(
        (f / "meta.json").read_text().replace('"step": 2', '"step": 3')
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_load_refuses_damage_with_or_without_tensors_and_by_path_or_latest(make_run, tmp_path, damage):
    folder = _saved_checkpoint(make_run, tmp_path)
    DAMAGE[damage](folder)
    with pytest.raises(CheckpointError) as verified:
        load_checkpoint(folder, mode=LoadMode.VERIFY)
    with pytest.raises(type(verified.value)) as loaded:
        load_checkpoint(folder)
    with pytest.raises(type(verified.value)) as latest:
        load_checkpoint("latest", tmp_path)
    assert str(loaded.value) == str(verified.value) == str(latest.value)
    assert str(folder) in str(loaded.value)


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs Linux /proc/self/maps")
def test_mixed_dtypes_are_stored_aligned_loaded_into_own_memory_and_viewed_by_read_tensors(tmp_path):
    # Adam's float32 step scalars between float64 moments: packed by name, the moments
    # would sit at offsets that are not multiples of 8.
    mixed = {
        "a/step": torch.tensor(3.0),
        "a/exp_avg": torch.randn(5, dtype=torch.float64),
        "b/flag": torch.tensor([True, False, True]),
        "b/exp_avg": torch.randn(7, dtype=torch.float64),
        "c/ids": torch.arange(3, dtype=torch.int16),
        "empty": torch.zeros(0),
    }
    with CheckpointStore(tmp_path) as store:
        folder = store.save(1, mixed, mixed, save_parts()).path
    loaded = load_checkpoint(folder)
    for name, tensors, mapped in (
        (MODEL_FILE, loaded.model_tensors, False),
        (STATE_FILE, loaded.state_tensors, False),
        (STATE_FILE, read_tensors(folder / STATE_FILE), True),
    ):
        assert all(torch.equal(tensors[k], v) and tensors[k].dtype == v.dtype for k, v in mixed.items())
        stored = [t for t in tensors.values() if t.numel()]
        assert all(t.data_ptr() % t.element_size() == 0 for t in stored), f"{name}: misaligned tensor"
        # A verified load reads into memory of its own (the hashed bytes are the used bytes);
        # read_tensors, which verifies nothing, views the file.
        assert all((_mapped_file(t.data_ptr()) == str(folder / name)) is mapped for t in stored), name


def test_resume_restores_the_loaded_state_without_another_copy_and_training_never_writes_the_file(
    make_run, tmp_path
):
    folder = _saved_checkpoint(make_run, tmp_path)
    fresh = make_run(0)
    loaded = load_checkpoint("latest", tmp_path, into=fresh.model)
    parameters = dict(fresh.model.named_parameters())
    assert all(loaded.model_tensors[name].data_ptr() == p.data_ptr() for name, p in parameters.items())
    restore_state(fresh, loaded.model_tensors, loaded.meta["training_state"], loaded.state_tensors)
    exp_avg = next(iter(fresh.optimizer.state.values()))["exp_avg"]
    assert any(exp_avg.data_ptr() == t.data_ptr() for t in loaded.state_tensors.values()), (
        "optimizer state was copied again on restore"
    )
    train_step(fresh)
    verify_checkpoint(folder)
