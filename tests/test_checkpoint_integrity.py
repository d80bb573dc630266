"""Damaged, foreign or mismatched checkpoints are refused with one clear line, exit 2, and
nothing on disk changes."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from pipeline.checkpoint import CheckpointStore
from pipeline.config import load_config
from pipeline.errors import PipelineError
from pipeline.hashing import sha256_file
from pipeline.train import train as train_in_process

from support import REPO, one_line_error, prepare_data, read_meta_json, train, write_sealed


@pytest.fixture(scope="module")
def pristine(data_dir, tmp_path_factory) -> Path:
    """Checkpoints at steps 3 and 6 of a 10-step run (keep_last 2)."""
    folder = tmp_path_factory.mktemp("pristine")
    result = train(
        data_dir, folder, "--max-steps", "10", "--stop-at", "6", "--checkpoint-every", "3", "--keep-last", "2"
    )
    assert result.returncode == 0, result.stderr
    assert CheckpointStore(folder).committed_steps() == [3, 6]
    return folder


@pytest.fixture
def checkpoints(pristine, tmp_path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(pristine, folder)
    return folder


def snapshot(folder: Path) -> dict[str, str]:
    """Every file's hash, except the lock file, which records the pid of its last holder."""
    return {
        p.relative_to(folder).as_posix(): sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def resume(data_dir: Path, folder: Path, *extra: str):
    """Through the real script: checks the one-line error and the exit code too."""
    return train(data_dir, folder, "--max-steps", "10", "--resume", "latest", *extra)


def refusal(
    data_dir: Path,
    folder: Path,
    before: dict[str, str],
    *patterns: str,
    resume_from: str = "latest",
    **overrides,
) -> str:
    """Resume in this process (fast: no interpreter start) and return the refusal message."""
    config = load_config(
        REPO / "config.yaml",
        {"data.dir": str(data_dir), "checkpoint.dir": str(folder), "training.max_steps": 10, **overrides},
    )
    with pytest.raises(PipelineError) as refused:
        train_in_process(config, resume=resume_from, progress=False)
    message = str(refused.value)
    assert refused.value.exit_code == 2
    for pattern in patterns:
        assert re.search(pattern, message), f"{pattern!r} not in {message!r}"
    assert snapshot(folder) == before, "a refused resume changed files on disk"
    return message


def flip_byte(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def assert_refused(result, folder: Path, before: dict[str, str], *patterns: str) -> str:
    assert result.returncode == 2, result.stderr
    line = one_line_error(result)
    for pattern in patterns:
        assert re.search(pattern, line), f"{pattern!r} not in {line!r}"
    assert snapshot(folder) == before, "a refused resume changed files on disk"
    return line


@pytest.mark.parametrize("name", ["modelo.safetensors", "estado_treino.safetensors"])
def test_flipped_byte_is_refused_naming_the_file_and_the_older_good_checkpoint(data_dir, checkpoints, name):
    target = checkpoints / "step-00000006" / name
    flip_byte(target, target.stat().st_size - 3)
    before = snapshot(checkpoints)
    line = assert_refused(resume(data_dir, checkpoints), checkpoints, before, re.escape(name), "SHA-256")
    assert "step-00000003" in line and "--resume" in line


def test_truncated_file_is_refused(data_dir, checkpoints):
    target = checkpoints / "step-00000006" / "estado_treino.safetensors"
    target.write_bytes(target.read_bytes()[:100])
    refusal(data_dir, checkpoints, snapshot(checkpoints), "estado_treino.safetensors", "truncated")


def test_zero_byte_file_is_refused(data_dir, checkpoints):
    (checkpoints / "step-00000006" / "modelo.safetensors").write_bytes(b"")
    refusal(data_dir, checkpoints, snapshot(checkpoints), "modelo.safetensors", "0 bytes")


def test_garbled_meta_json_is_refused(data_dir, checkpoints):
    meta = checkpoints / "step-00000006" / "meta.json"
    meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
    message = refusal(data_dir, checkpoints, snapshot(checkpoints), "meta.json", "not valid JSON")
    older = checkpoints / "step-00000003"
    assert message.endswith(
        f"; the older checkpoint {older} verifies: resume from it with --resume {older} (nothing was deleted)"
    )


def test_a_damaged_checkpoint_whose_config_also_differs_is_refused_for_its_damage(data_dir, checkpoints):
    """The files are verified as they load into the run, after its config was compared: a
    refusal met first still names the damage, as every reader reports damage first."""
    damaged = checkpoints / "step-00000006" / "modelo.safetensors"
    flip_byte(damaged, 100)
    message = refusal(data_dir, checkpoints, snapshot(checkpoints), **{"training.seed": 7})
    older = checkpoints / "step-00000003"
    assert message == (
        f"{damaged} SHA-256 differs from meta.json (chunk 0: bytes 0-{damaged.stat().st_size}): the file is "
        f"damaged or was modified; the older checkpoint {older} verifies: resume from it with --resume {older} "
        "(nothing was deleted)"
    )


@pytest.mark.parametrize("swap", ["fifo", "link"])
def test_a_meta_json_swapped_for_a_fifo_or_a_link_is_refused_without_being_read(
    data_dir, checkpoints, tmp_path, swap
):
    """meta.json is opened once, not following a link: a FIFO would hang the reader, and a link
    (here to a byte-identical copy, which a reader following it would accept) is not ours."""
    meta = checkpoints / "step-00000006" / "meta.json"
    copy = tmp_path / "elsewhere.json"
    copy.write_bytes(meta.read_bytes())
    meta.unlink()
    if swap == "fifo":
        os.mkfifo(meta)
    else:
        meta.symlink_to(copy)
    expected = "FIFO" if swap == "fifo" else "symbolic link"
    # Named as a path: a listing passes over a step whose meta.json is not a regular file
    # (not committed), but a path given, or a swap after the listing, reaches the reader.
    before = snapshot(checkpoints)
    refusal(
        data_dir, checkpoints, before, "meta.json", expected, "not a meta.json", resume_from=str(meta.parent)
    )


def test_wrong_schema_version_is_refused(data_dir, checkpoints):
    meta_path = checkpoints / "step-00000006" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["schema"] = "pipeline.checkpoint/0"
    meta_path.write_text(json.dumps(meta))
    refusal(data_dir, checkpoints, snapshot(checkpoints), "schema", "pipeline.checkpoint/0")


def test_foreign_checkpoint_without_our_meta_is_refused(data_dir, checkpoints):
    """A folder that merely looks like a step (say, another trainer's) is not half-loaded."""
    meta_path = checkpoints / "step-00000006" / "meta.json"
    meta_path.write_text(json.dumps({"global_step": 6, "format": "other-trainer"}))
    refusal(data_dir, checkpoints, snapshot(checkpoints), "schema")


def test_extra_file_in_checkpoint_is_refused(data_dir, checkpoints):
    (checkpoints / "step-00000006" / "optimizer.pt").write_bytes(b"\x80\x04not a checkpoint of ours")
    refusal(data_dir, checkpoints, snapshot(checkpoints), "optimizer.pt", "not listed")


def test_config_whose_model_differs_is_refused_naming_the_key(data_dir, checkpoints):
    before = snapshot(checkpoints)
    result = resume(data_dir, checkpoints, "--set", "model.params.hidden=8")
    assert_refused(result, checkpoints, before, r"model\.params", "hidden", "16", "8")


def test_config_whose_optimizer_differs_is_refused_naming_the_key(data_dir, checkpoints):
    refusal(data_dir, checkpoints, snapshot(checkpoints), r"optimizer\.lr", **{"optimizer.lr": 0.5})


def test_checkpoint_settings_may_change_on_resume(data_dir, checkpoints):
    result = resume(data_dir, checkpoints, "--checkpoint-every", "2", "--keep-last", "1")
    assert result.returncode == 0, result.stderr
    assert CheckpointStore(checkpoints).committed_steps() == [10]


def test_changed_data_is_refused_even_when_the_config_matches(data_dir, checkpoints, tmp_path):
    """Data re-prepared differently (say, by a changed prepare function) under the same config:
    other data, whose manifest records this config's recipe."""
    other = tmp_path / "other-data"
    prepare_data(other, "--set", "data.seed=99")
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "seed": 1234}))
    refusal(other, checkpoints, snapshot(checkpoints), "prepared data differs")


def test_resume_latest_with_no_checkpoint_says_how_to_start(data_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    refusal(data_dir, tmp_path / "empty", {}, "no committed checkpoint", "train first")


def test_fresh_run_into_a_folder_with_checkpoints_is_refused(data_dir, checkpoints):
    refusal(data_dir, checkpoints, snapshot(checkpoints), "--resume latest", "step 6", resume_from=None)


def test_second_trainer_on_the_same_folder_is_refused(data_dir, checkpoints):
    with CheckpointStore(checkpoints):
        before = snapshot(checkpoints)
        result = resume(data_dir, checkpoints)
    assert_refused(result, checkpoints, before, "in use by another trainer")


def test_stale_temporary_folders_are_cleaned_on_the_next_start(data_dir, checkpoints):
    stale = checkpoints / ".tmp-step-00000009-deadbeef"
    stale.mkdir()
    (stale / "modelo.safetensors").write_bytes(b"half")
    result = resume(data_dir, checkpoints)
    assert result.returncode == 0, result.stderr
    assert not stale.exists()


def test_resume_from_an_explicit_older_folder_is_refused_when_newer_steps_exist(data_dir, checkpoints):
    refusal(
        data_dir, checkpoints, snapshot(checkpoints), "newer", resume_from=str(checkpoints / "step-00000003")
    )


def test_checkpoint_files_are_safetensors_not_pickles(pristine):
    folder = pristine / "step-00000006"
    for name in ("modelo.safetensors", "estado_treino.safetensors"):
        raw = (folder / name).read_bytes()
        header_length = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + header_length])
        assert raw[:1] != b"\x80", f"{name} starts with a pickle protocol byte"
        assert header["__metadata__"]["format"] == "pt"
    weights = load_file(folder / "modelo.safetensors")
    assert {"net.0.weight", "net.0.bias", "net.6.weight"} <= set(weights)


def test_no_pickle_in_any_load_path():
    """No module or script can unpickle: no pickle import, no torch.load, no weights_only=False."""
    forbidden = re.compile(r"import pickle|pickle\.load|torch\.load\(|weights_only\s*=\s*False|import dill")
    offenders = [
        f"{path.relative_to(REPO)}:{n}"
        for folder in ("pipeline", "scripts")
        for path in (REPO / folder).rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if forbidden.search(line)
    ]
    assert not offenders, offenders


def test_a_folder_not_named_like_a_step_is_never_resumed_from(data_dir, checkpoints, tmp_path):
    """Temporary (.tmp-…) folders are cleaned at start; any other odd name is refused."""
    odd = tmp_path / "half-copied"
    shutil.copytree(checkpoints / "step-00000006", odd)
    refusal(data_dir, checkpoints, snapshot(checkpoints), "not a committed checkpoint", resume_from=str(odd))


def test_a_stop_at_not_after_the_resume_step_is_refused_before_anything_is_built(data_dir, checkpoints):
    before = snapshot(checkpoints)
    for stop in (6, 5):
        config = load_config(
            REPO / "config.yaml",
            {"data.dir": str(data_dir), "checkpoint.dir": str(checkpoints), "training.max_steps": 10},
        )
        with pytest.raises(PipelineError) as refused:
            train_in_process(config, resume="latest", stop_at=stop, progress=False)
        assert str(refused.value) == f"--stop-at {stop} is not after the resume step 6"
    assert snapshot(checkpoints) == before


def test_what_a_resumed_start_says_names_its_folder_step_launch_extension_changes_and_warm_start():
    from pipeline.start import Launch, StartingPoint

    config = load_config(REPO / "config.yaml")
    folder = Path("estados_local") / "step-00000004"
    one, two = Launch("none", 1), Launch("ddp", 2, False)
    start = StartingPoint(
        config=config,
        folder=folder,
        meta={"step": 4},
        extended=True,
        lineage=[{"from_max_steps": 4, "to_max_steps": 6}, {"from_max_steps": 6, "to_max_steps": 10}],
    )
    changes = [
        {"item": "launch", "recorded": one.to_dict(), "now": two.to_dict(), "step": 4},
        {"item": "torch_threads", "recorded": 2, "now": 4, "step": 4},
    ]
    assert start.messages(changes, two) == [
        f"resumed from {folder} at step 4 (2 processes, ddp)",
        "extended from max_steps 6 to 10 (recorded in meta.json lineage)",
        "moved from one process (training.parallel none) to 2 processes (training.parallel ddp, "
        "ddp_find_unused_parameters false) at step 4; the result is no longer bitwise that of the first "
        "launch (recorded in meta.json)",
        "environment changed: torch_threads 2 -> 4; the result is no longer bitwise reproducible (recorded "
        "in meta.json)",
    ]
    plain = StartingPoint(config=config, folder=folder, meta={"step": 4})
    assert plain.messages([], one) == [f"resumed from {folder} at step 4"]
    fresh = StartingPoint(config=config, warm_report=["warm-started from w.safetensors"])
    assert fresh.messages([], one) == ["warm-started from w.safetensors"]


def test_a_resume_checks_the_weights_against_the_model_record_of_meta_json(data_dir, checkpoints):
    """The record is sealed with the rest: a record that no longer describes the weights (an
    edit resealed) is refused by the resume as by every reader."""
    folder = checkpoints / "step-00000006"
    meta = read_meta_json(folder)
    meta["model"]["tensors"]["net.0.bias"]["dtype"] = "float16"
    write_sealed(folder, meta)
    message = refusal(data_dir, checkpoints, snapshot(checkpoints))
    assert message == (
        "modelo.safetensors does not fit the model recorded in meta.json (tensor net.0.bias): the checkpoint "
        "is damaged or was edited"
    )
