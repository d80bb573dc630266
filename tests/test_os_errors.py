"""Every operating-system failure is one line and loses nothing: full
disks (a real tmpfs of 1 MiB), read-only file systems, a prune that fails after a commit,
and memory a task's params cannot get.

Mounting needs root; CI runs as root. Elsewhere these tests skip and say why.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import torch

from pipeline.checkpoint import CheckpointStore

from support import (
    assert_checkpoints_bitwise_equal,
    one_line_error,
    run_script,
    save_parts,
    verify_checkpoint,
)

META = save_parts({"best": 0.5})


@contextlib.contextmanager
def tmpfs(where: Path, *options: str) -> Iterator[Path]:
    """A real tmpfs of 1 MiB mounted at ``where`` (created), unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(("size=1m", *options)), "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def fill(folder: Path) -> Path:
    """Take every free byte of the file system that holds ``folder``."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def remount_read_only(where: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.name.startswith((".tmp-", ".old-", ".deleting-")))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_training_into_a_full_disk_is_one_line_keeps_the_last_checkpoint_and_resumes_bitwise(
    trained_run, tmp_path, mode
):
    data = ["--set", f"data.dir={trained_run.data_dir}", "--set", f"checkpoint.async={mode == 'async'}"]
    with tmpfs(tmp_path / "disk") as disk:
        checkpoints = disk / "estados_local"
        first = run_script(
            "02_train.py", *data, "--checkpoint-dir", str(checkpoints), "--quiet", "--stop-at", "5"
        )
        assert first.returncode == 0, first.stderr
        filler = fill(disk)
        result = run_script(
            "02_train.py", *data, "--checkpoint-dir", str(checkpoints), "--quiet", "--resume", "latest"
        )
        assert result.returncode == 2, result.stdout + result.stderr
        line = one_line_error(result)
        assert "no space left on the device" in line and str(checkpoints) in line, line
        assert leftovers(checkpoints) == []
        assert CheckpointStore(checkpoints).committed_steps() == [5]
        assert verify_checkpoint(checkpoints / "step-00000005")["step"] == 5
        filler.unlink()
        shutil.copytree(checkpoints, tmp_path / "elsewhere", ignore=shutil.ignore_patterns(".lock"))
    resumed = run_script(
        "02_train.py", *data, "--checkpoint-dir", str(tmp_path / "elsewhere"), "--quiet", "--resume", "latest"
    )
    assert resumed.returncode == 0, resumed.stderr
    assert_checkpoints_bitwise_equal(tmp_path / "elsewhere" / "step-00000010", trained_run.checkpoint)


def test_staging_onto_a_full_disk_is_one_line_and_leaves_nothing_behind(evaluated_run, tmp_path):
    with tmpfs(tmp_path / "disk") as disk:
        filler = fill(disk)
        line = evaluated_run.refused("05_stage.py", "--stage", str(disk / "hub_stage"))
        assert "no space left on the device" in line and str(disk) in line, line
        assert sorted(p.name for p in disk.iterdir() if p.name != ".hub_stage.lock") == [filler.name]


def test_evaluating_beside_a_full_disk_names_the_weights_copy_and_leaves_nothing_behind(
    evaluated_run, tmp_path
):
    """04 copies the weights beside the metrics it writes: on a full disk the failed write
    names that file (a write through a descriptor names none by itself)."""
    with tmpfs(tmp_path / "disk") as disk:
        filler = fill(disk)
        line = evaluated_run.refused("04_evaluate.py", "--set", f"outputs.metrics={disk / 'metrics.json'}")
        assert "no space left on the device" in line and f"{disk}/.scratch-evaluate-weights-" in line, line
        assert sorted(p.name for p in disk.iterdir()) == [filler.name]


def test_a_json_record_or_a_failed_proofs_report_on_a_full_disk_names_the_file(tmp_path):
    """A failed write() names no file: the one JSON writer adds the path. A proof whose leg
    failed on a full disk cannot write its report there either, and says both."""
    from pipeline.durable import write_json_atomic
    from pipeline.errors import ProofIncomplete, describe_os_error
    from pipeline.proof.protocol import _fail

    with tmpfs(tmp_path / "disk") as disk:
        fill(disk)
        with pytest.raises(OSError) as failed:
            write_json_atomic(disk / "metrics.json", {"mse": 1.0, "pad": "x" * 8192})
        assert describe_os_error(failed.value) == f"{disk / 'metrics.json'}: no space left on the device"
        with pytest.raises(ProofIncomplete) as incomplete:
            _fail(disk, {"pad": "x" * 8192}, "leg resume exited with code 1: (no output)")
        assert str(incomplete.value) == (
            "the proof could not complete: leg resume exited with code 1: (no output); the report could not be "
            f"written either ({disk / 'verification.json'}: no space left on the device)"
        )
        assert leftovers(disk) == [] and not list(disk.glob(".*.tmp"))


def test_read_only_file_systems_are_one_line_for_the_lock_a_folder_and_metrics(evaluated_run, tmp_path):
    with tmpfs(tmp_path / "ro") as ro:
        (ro / "estados_local").mkdir()
        remount_read_only(ro)
        for args in (
            ["--checkpoint-dir", str(ro / "estados_local")],  # its .lock
            ["--checkpoint-dir", str(ro / "new" / "estados_local")],
        ):  # mkdir
            line = evaluated_run.refused("02_train.py", "--quiet", "--set", "training.max_steps=1", *args)
            assert "read-only file system" in line and str(ro) in line, line
        line = evaluated_run.refused("04_evaluate.py", "--output", str(ro / "metrics.json"))
        assert "read-only file system" in line and str(ro) in line, line
        assert sorted(p.name for p in ro.iterdir()) == ["estados_local"]


def test_a_prune_that_fails_after_the_commit_warns_and_the_next_save_retries(tmp_path, caplog):
    """The failure is real: the oldest checkpoint is a mount point, which rename refuses."""

    def save(store: CheckpointStore, step: int) -> None:
        store.save(step, {"w": torch.full((3,), float(step))}, {"s": torch.zeros(1)}, META)

    store = CheckpointStore(tmp_path / "ck", keep_last=1)
    with store:
        save(store, 1)
        oldest = store.path_for(1)
        copy = shutil.copytree(oldest, tmp_path / "copy")
        with tmpfs(oldest):
            for item in copy.iterdir():  # still a committed checkpoint, now on its own mount
                shutil.copy2(item, oldest / item.name)
            with caplog.at_level(logging.WARNING):
                save(store, 2)
            assert store.committed_steps() == [1, 2]
            warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warnings) == 1 and "step 2 is committed, but pruning" in warnings[0], warnings
            assert "training goes on and the next save retries" in warnings[0]
        save(store, 3)
    assert store.committed_steps() == [3]
    assert leftovers(tmp_path / "ck") == []


def test_params_asking_for_more_memory_than_there_is_are_one_line(tmp_path):
    result = run_script(
        "01_prepare_data.py",
        "--set",
        f"data.dir={tmp_path / 'data'}",
        "--set",
        "data.params.num_train=1000000000000",
    )
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line_error(result)
    assert line.startswith("error: out of memory") and "params" in line, line
    assert not (tmp_path / "data").exists() and list(tmp_path.iterdir()) == []


def test_sealing_and_the_receipt_folder_on_a_read_only_full_or_taken_place_are_one_line_and_touch_nothing(
    tmp_path,
):
    """The seal is written last into another tool's folder, the receipt folder is checked
    before 06 sends a write: a read-only file system, a full one, a file or a dangling link
    where the folder should be are each one line naming the path, and nothing is left."""
    from pipeline.errors import PublishError, describe_os_error
    from pipeline.integrations.seal import seal_checkpoint
    from pipeline.publishing.plan import prepare_receipt_dir

    def listing(root: Path) -> list[tuple[str, int]]:
        return sorted((p.relative_to(root).as_posix(), p.lstat().st_mode) for p in root.rglob("*"))

    def refused(folder: Path) -> str:
        with pytest.raises(PublishError) as refusal:
            prepare_receipt_dir(folder)
        return str(refusal.value)

    with tmpfs(tmp_path / "ro") as ro:
        (ro / "checkpoint-1").mkdir()
        (ro / "checkpoint-1" / "weights.bin").write_bytes(b"w" * 64)
        (ro / "receipts").mkdir()
        remount_read_only(ro)
        before = listing(ro)
        with pytest.raises(OSError) as failed:
            seal_checkpoint(ro / "checkpoint-1", step=1)
        assert describe_os_error(failed.value) == f"{ro}/checkpoint-1/meta.json: read-only file system"
        assert (
            refused(ro / "receipts") == f"--receipt-dir {ro}/receipts is not writable; nothing was published"
        )
        assert refused(ro / "new" / "receipts") == (
            f"--receipt-dir {ro}/new/receipts cannot be created (Read-only file system); nothing was published"
        )
        assert listing(ro) == before
    with tmpfs(tmp_path / "full") as full:
        (full / "checkpoint-1").mkdir()
        (full / "checkpoint-1" / "weights.bin").write_bytes(b"w" * 64)
        fill(full)
        before = listing(full)
        with pytest.raises(OSError) as failed:
            seal_checkpoint(full / "checkpoint-1", step=1)
        assert (
            describe_os_error(failed.value) == f"{full}/checkpoint-1/meta.json: no space left on the device"
        )
        assert listing(full) == before
    (tmp_path / "a-file").write_text("in the way")
    (tmp_path / "a-link").symlink_to("nowhere")
    for taken in (tmp_path / "a-file", tmp_path / "a-link"):
        assert (
            refused(taken) == f"--receipt-dir {taken} cannot be created (File exists); nothing was published"
        )
    assert (tmp_path / "a-file").read_text() == "in the way" and not (tmp_path / "nowhere").exists()
