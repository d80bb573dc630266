"""Sealed checkpoints of other trainers: transformers' Trainer with SealedCheckpoints (a real run,
then SIGKILLs at random instants of its saves), a hostile seal, accelerate's save_state folders.

The Trainer runs are one helper process (tests/helpers/sealed_trainer.py: transformers imported
once, every run a forked child); the seal's own checks run in this process, on small folders.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest

from pipeline.errors import UnsealedCheckpoint
from pipeline.integrations.seal import (
    SEAL_SCHEMA,
    check_seal,
    prune_checkpoints,
    seal_checkpoint,
    verified_checkpoint,
)

from support import HELPERS, a_socket, run_python, run_script, script_env

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("sealed-trainer")

# SIGKILLs in the suite: about 0.2 s each on the 2-core machine. A soak runs more (docs/testing.md).
KILLS = 20


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sealed_trainer")
    seed = secrets.randbelow(2**31)
    report = root / "report.json"
    argv = [HELPERS / "sealed_trainer.py", report, "--reference", root / "reference"]
    argv += ["--kills", KILLS, "--seed", seed, "--kill-dir", root / "killed"]
    result = run_python(argv, cwd=root, env=script_env(OMP_NUM_THREADS="1"), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return {"root": root, **json.loads(report.read_text())}


@pytest.mark.heavy
def test_every_checkpoint_a_trainer_run_keeps_is_sealed_and_lists_exactly_its_files(trainer_runs):
    reference = trainer_runs["root"] / "reference"
    assert trainer_runs["reference"]["exit"] == 0
    kept = sorted(p.name for p in reference.iterdir())
    assert kept == ["checkpoint-4", "checkpoint-6"]  # save_steps 2, save_total_limit 2, 6 steps
    for name in kept:
        seal = check_seal(reference / name)
        assert seal["schema"] == SEAL_SCHEMA and seal["step"] == int(name.split("-")[1])
        present = {p.name for p in (reference / name).iterdir()} - {"meta.json"}
        assert set(seal["files"]) == present and "optimizer.pt" in present
    assert verified_checkpoint(reference) == reference / "checkpoint-6"


@pytest.mark.heavy
def test_sigkill_at_random_instants_of_saves_never_leaves_a_verified_checkpoint_that_is_incomplete(
    trainer_runs,
):
    kills, seed = trainer_runs["kills"], trainer_runs["seed"]
    assert len(kills) == KILLS
    problems = [(number, kill) for number, kill in enumerate(kills) if kill["problems"]]
    assert not problems, f"seed {seed}: {problems}"
    # With SealedCheckpoints(keep_last=2) a sealed checkpoint always remains (the Trainer's own
    # save_total_limit, deleting before the seal, can leave none: docs/other-trainers.md).
    assert all(kill["returned"] is not None for kill in kills), f"seed {seed}"
    # The kills landed inside saves: most left a newer folder that was skipped, named on stderr.
    cut_short = sum(bool(kill["skipped"]) for kill in kills)
    assert cut_short >= KILLS // 4, f"seed {seed}: only {cut_short} kills left an unsealed checkpoint"


@pytest.mark.heavy
def test_05_stages_a_sealed_trainer_checkpoint_without_its_training_state(trainer_runs, tmp_path):
    checkpoint = trainer_runs["root"] / "reference" / "checkpoint-6"
    target = tmp_path / "stage"
    result = run_script("05_stage.py", "--from-folder", str(checkpoint), "--stage", str(target), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"staged step 6 from {checkpoint}" in result.stdout
    meta = json.loads((target / "meta.json").read_text())
    assert meta["source_checkpoint"]["sealed"] and meta["step"] == 6
    training_state = {
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "training_args.bin",
        "trainer_state.json",
    }
    assert set(meta["source_checkpoint"]["left_out"]) == training_state
    assert not training_state & {p.name for p in target.iterdir()}
    assert (target / "model.safetensors").read_bytes() == (checkpoint / "model.safetensors").read_bytes()


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# heavy as the other users of trainer_runs: conftest runs heavy tests first, and a module fixture
# shared across that split would be built twice.
@pytest.mark.heavy
@pytest.mark.parametrize(
    "name",
    [
        "model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "trainer_state.json",
        "training_args.bin",
        "config.json",
        "meta.json",
    ],
)
def test_one_flipped_byte_in_the_newest_makes_verified_checkpoint_return_the_previous(
    trainer_runs, tmp_path, capfd, name
):
    output = Path(shutil.copytree(trainer_runs["root"] / "reference", tmp_path / "output"))
    _flip_middle_byte(output / "checkpoint-6" / name)
    assert verified_checkpoint(output) == output / "checkpoint-4"
    assert "skipping checkpoint-6" in capfd.readouterr().err


# -- the seal itself: hostile seals are refused, never trusted ---------------------------------------


@pytest.fixture
def sealed(tmp_path) -> Path:
    """``output/checkpoint-2`` and ``output/checkpoint-3``, both sealed; returns checkpoint-3."""
    for step in (2, 3):
        folder = tmp_path / "output" / f"checkpoint-{step}"
        (folder / "sub").mkdir(parents=True)
        (folder / "weights.bin").write_bytes(secrets.token_bytes(4096))
        (folder / "sub" / "state.json").write_text(json.dumps({"step": step}))
        seal_checkpoint(folder, step=step)
    return tmp_path / "output" / "checkpoint-3"


def rewrite_seal(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def tamper(folder: Path) -> None:
        seal = json.loads((folder / "meta.json").read_text())
        change(seal)
        (folder / "meta.json").write_text(json.dumps(seal))

    return tamper


def added_file(folder):
    (folder / "extra.bin").write_bytes(b"x")


def removed_file(folder):
    (folder / "sub" / "state.json").unlink()


def truncated(folder):
    path = folder / "weights.bin"
    path.write_bytes(path.read_bytes()[:100])


def same_size_edit(folder):
    _flip_middle_byte(folder / "weights.bin")


def link_inside(folder):
    (folder / "sub" / "state.json").unlink()
    (folder / "sub" / "state.json").symlink_to("/etc/hostname")


def no_seal(folder):
    (folder / "meta.json").unlink()


def not_json(folder):
    (folder / "meta.json").write_text("{'schema': 1}")


def listed_twice(folder):
    text = (folder / "meta.json").read_text()
    start = text.index('"weights.bin"')
    end = text.index("}", start) + 1
    (folder / "meta.json").write_text(text[:end] + ", " + text[start:end] + text[end:])


def oversize(folder):
    (folder / "meta.json").write_bytes(b" " * (16 * 1024 * 1024 + 1))


def seal_as_link(folder):
    (folder / "meta.json").rename(folder.parent / "seal.json")
    (folder / "meta.json").symlink_to(folder.parent / "seal.json")


def fifo_nested(folder):
    os.mkfifo(folder / "sub" / "pipe")  # hashed, it would wait for a writer forever


def socket_nested(folder):
    a_socket(folder / "sub" / "sock")


def fifo_at_the_top(folder):
    os.mkfifo(folder / "pipe")


def dangling_link_at_the_top(folder):
    (folder / "latest").symlink_to("nowhere")


def seal_a_fifo(folder):
    (folder / "meta.json").unlink()
    os.mkfifo(folder / "meta.json")


def seal_a_folder(folder):
    (folder / "meta.json").unlink()
    (folder / "meta.json").mkdir()


def seal_empty(folder):
    (folder / "meta.json").write_bytes(b"")


def outside_name(target: str) -> Callable[[dict], None]:
    def change(seal: dict) -> None:
        seal["files"][target] = seal["files"].pop("weights.bin")

    return change


HOSTILE = [
    pytest.param(
        fifo_nested,
        "sub/pipe is a link or special file: a sealed folder holds plain files and folders only",
        id="fifo_nested",
    ),
    pytest.param(
        socket_nested,
        "sub/sock is a link or special file: a sealed folder holds plain files and folders only",
        id="socket_nested",
    ),
    pytest.param(
        fifo_at_the_top,
        "checkpoint-3/pipe is a link or special file: a sealed folder holds plain files and folders only",
        id="fifo_at_the_top",
    ),
    pytest.param(
        dangling_link_at_the_top,
        "checkpoint-3/latest is a link or special file: a sealed folder holds plain files and folders only",
        id="dangling_link_at_the_top",
    ),
    pytest.param(
        seal_a_fifo, "checkpoint-3/meta.json is a link or special file, not a seal", id="seal_a_fifo"
    ),
    pytest.param(
        seal_a_folder, "checkpoint-3/meta.json is a link or special file, not a seal", id="seal_a_folder"
    ),
    pytest.param(
        seal_empty,
        "checkpoint-3/meta.json is not a valid seal: Expecting value: line 1 column 1 (char 0)",
        id="seal_empty",
    ),
    pytest.param(added_file, "extra.bin is not listed in its seal", id="added_file"),
    pytest.param(removed_file, "state.json is listed in its seal but missing", id="removed_file"),
    pytest.param(truncated, "its seal records 4,096", id="truncated"),
    pytest.param(same_size_edit, "weights.bin: SHA-256 differs from its seal", id="same_size_edit"),
    pytest.param(link_inside, "is a link or special file", id="link_inside"),
    pytest.param(no_seal, "has no meta.json", id="no_seal"),
    pytest.param(not_json, "is not a valid seal", id="not_json"),
    pytest.param(listed_twice, "appears twice", id="listed_twice"),
    pytest.param(oversize, "over the 16,777,216-byte limit", id="oversize"),
    pytest.param(seal_as_link, "meta.json is a link or special file, not a seal", id="seal_as_link"),
    pytest.param(
        rewrite_seal(lambda s: s.update(schema="pipeline.checkpoint/2")),
        "a checkpoint of this pipeline",
        id="our_checkpoint_schema",
    ),
    pytest.param(
        rewrite_seal(lambda s: s.update(schema="pipeline.folder-seal/2")),
        "not a pipeline.folder-seal/1 seal",
        id="unknown_schema",
    ),
    pytest.param(
        rewrite_seal(lambda s: s.update(step=True)), "step must be a non-negative integer", id="step_a_bool"
    ),
    pytest.param(
        rewrite_seal(lambda s: s.update(note="x")), "must hold exactly files, schema, step", id="extra_key"
    ),
    pytest.param(
        rewrite_seal(outside_name("../checkpoint-2/weights.bin")),
        "not a plain relative path inside the folder",
        id="name_out_of_the_folder",
    ),
    pytest.param(
        rewrite_seal(outside_name("/etc/hostname")),
        "not a plain relative path inside the folder",
        id="absolute",
    ),
    pytest.param(
        rewrite_seal(outside_name("sub/../weights.bin")),
        "not a plain relative path inside the folder",
        id="dotdot_inside",
    ),
    pytest.param(
        rewrite_seal(outside_name("weights.bin\n")),
        "is not a printable relative path",
        id="control_character",
    ),
    pytest.param(
        rewrite_seal(lambda s: s["files"]["weights.bin"].update(sha256="A" * 64)),
        "lowercase hex sha256",
        id="uppercase_sha256",
    ),
    pytest.param(
        rewrite_seal(lambda s: s["files"]["weights.bin"].update(size=-1)),
        "lowercase hex sha256 and a size",
        id="negative_size",
    ),
    pytest.param(
        rewrite_seal(lambda s: s.update(step=2)),
        "seals step 2, but its folder is checkpoint-3",
        id="step_of_another_folder",
    ),
    pytest.param(rewrite_seal(lambda s: s.update(files={})), "lists no file", id="empty_seal"),
    pytest.param(
        lambda folder: (folder / "meta.json").write_text("[]"),
        "meta.json: not a pipeline.folder-seal/1 seal",
        id="seal_a_list",
    ),
    pytest.param(
        rewrite_seal(lambda s: s.update(files=sorted(s["files"]))),
        "meta.json: files must map each file to its sha256 and size",
        id="files_a_list",
    ),
    pytest.param(
        rewrite_seal(lambda s: s["files"].update({"meta.json": s["files"]["weights.bin"]})),
        "lists 'meta.json', which is the seal itself",
        id="lists_the_seal",
    ),
    pytest.param(
        rewrite_seal(outside_name("sub\\weights.bin")),
        "which is not a printable relative path",
        id="backslash",
    ),
    pytest.param(
        rewrite_seal(lambda s: s["files"]["weights.bin"].update(mtime=1)),
        "the entry of weights.bin must be exactly a lowercase hex sha256 and a size in bytes",
        id="entry_extra_key",
    ),
    pytest.param(
        rewrite_seal(lambda s: s["files"]["weights.bin"].update(size=True)),
        "the entry of weights.bin must be exactly",
        id="size_a_bool",
    ),
    pytest.param(
        rewrite_seal(lambda s: s["files"]["weights.bin"].update(sha256=7)),
        "the entry of weights.bin must be exactly",
        id="sha256_a_number",
    ),
    pytest.param(
        rewrite_seal(lambda s: s.update(step=-1)),
        "meta.json: step must be a non-negative integer or null",
        id="step_negative",
    ),
    pytest.param(
        lambda folder: (folder / "meta.json").write_bytes(b" " * (16 * 1024 * 1024)),
        "meta.json is not a valid seal",
        id="seal_at_the_size_limit",
    ),
]


@pytest.mark.parametrize(("tamper", "reason"), HOSTILE)
def test_a_hostile_or_damaged_seal_is_refused_and_the_previous_checkpoint_returned(
    sealed, capsys, tamper, reason
):
    tamper(sealed)
    with pytest.raises(UnsealedCheckpoint) as refused:
        check_seal(sealed)
    assert reason in str(refused.value)
    assert verified_checkpoint(sealed.parent) == sealed.parent / "checkpoint-2"
    err = capsys.readouterr().err
    assert err.count("skipping") == 1 and "skipping checkpoint-3" in err and reason in err


def test_when_no_checkpoint_verifies_verified_checkpoint_raises_instead_of_starting_over(sealed, tmp_path):
    assert verified_checkpoint(tmp_path / "nothing-yet") is None
    (tmp_path / "fresh").mkdir()
    assert verified_checkpoint(tmp_path / "fresh") is None
    for folder in sealed.parent.iterdir():
        same_size_edit(folder)
    with pytest.raises(
        UnsealedCheckpoint, match="no checkpoint in .* has a seal that verifies .*checkpoint-3"
    ):
        verified_checkpoint(sealed.parent)


def test_a_checkpoint_pruned_or_unreadable_while_checked_is_skipped_with_its_reason(
    sealed, capsys, monkeypatch
):
    """A rotation deletes the newest checkpoint (or one of its files) while verified_checkpoint
    hashes it, or the disk fails a read: the folder is skipped, named with the reason, and the
    previous one returned; nothing raises out of the user's resume_from_checkpoint= line. The
    event is made to happen at the real open of the file, from the test's side."""
    import errno

    real_open = os.open

    def events(kind):
        done = []

        def open_then(path, flags, *args, dir_fd=None, **kwargs):
            inside = dir_fd is not None and os.readlink(f"/proc/self/fd/{dir_fd}") == str(sealed)
            if inside and path == "weights.bin" and not done:
                done.append(kind)
                if kind == "eio":
                    raise OSError(errno.EIO, "Input/output error", str(sealed / path))
                if kind == "file_deleted":
                    (sealed / path).unlink()
                else:
                    shutil.rmtree(sealed)
            return real_open(path, flags, *args, dir_fd=dir_fd, **kwargs)

        return open_then, done

    for kind, reason in [
        ("eio", "weights.bin: Input/output error"),
        ("file_deleted", "weights.bin changed while its seal was checked (gone)"),
        ("folder_pruned", "weights.bin changed while its seal was checked (gone)"),
    ]:
        if not sealed.exists():
            shutil.copytree(sealed.parent / "checkpoint-2", sealed)
            seal_checkpoint(sealed, step=3)
        elif not (sealed / "weights.bin").exists():
            (sealed / "weights.bin").write_bytes(b"w")
            seal_checkpoint(sealed, step=3)
        opener, done = events(kind)
        monkeypatch.setattr(os, "open", opener)
        assert verified_checkpoint(sealed.parent) == sealed.parent / "checkpoint-2", kind
        monkeypatch.setattr(os, "open", real_open)
        err = capsys.readouterr().err
        assert done == [kind] and f"skipping checkpoint-3: {sealed}/{reason}" in err, err


def test_a_run_from_before_sealed_checkpoints_is_told_how_to_seal_one_it_trusts(tmp_path):
    output = tmp_path / "out"
    for step in (2, 4):
        (output / f"checkpoint-{step}").mkdir(parents=True)
        (output / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"w" * step)
    with pytest.raises(UnsealedCheckpoint) as refused:
        verified_checkpoint(output)
    assert str(refused.value) == (
        f"no checkpoint in {output} is sealed (the newest is checkpoint-4): written before SealedCheckpoints, or "
        "every save was cut short; nothing was resumed. If you trust one, seal it and resume from it: "
        f"pipeline.integrations.seal.seal_checkpoint('{output / 'checkpoint-4'}') (docs/other-trainers.md); "
        "otherwise move the folders away to start from scratch"
    )
    with pytest.raises(UnsealedCheckpoint) as unsealed:
        check_seal(output / "checkpoint-4")
    assert "has no meta.json" in str(unsealed.value) and "seal_checkpoint" in str(unsealed.value)
    seal_checkpoint(output / "checkpoint-4", step=4)  # the user trusts it
    assert verified_checkpoint(output) == output / "checkpoint-4"


def test_sealing_refuses_an_empty_folder_and_a_step_that_is_not_the_folders(tmp_path):
    empty = tmp_path / "checkpoint-5"
    empty.mkdir()
    with pytest.raises(UnsealedCheckpoint, match="holds no file: nothing to seal"):
        seal_checkpoint(empty, step=5)
    (empty / "weights.bin").write_bytes(b"w")
    with pytest.raises(ValueError, match="is the folder of step 5, not of step 6"):
        seal_checkpoint(empty, step=6)
    assert not (empty / "meta.json").exists()
    assert seal_checkpoint(empty, step=5)["step"] == 5


def test_keep_last_1_makes_the_new_checkpoint_durable_before_it_prunes_the_old(tmp_path):
    """The crash harness's page-cache model (tests/helpers/oprecorder.py): a Trainer save that
    fsyncs nothing, then SealedCheckpoints(keep_last=1); after every recorded call, what a power
    cut would keep must still hold a checkpoint that verifies."""
    from oprecorder import PageCache, Recorder

    from pipeline.integrations.transformers import SealedCheckpoints

    output = tmp_path / "output"
    old = output / "checkpoint-2"
    old.mkdir(parents=True)
    (old / "model.safetensors").write_bytes(secrets.token_bytes(4096))
    seal_checkpoint(old, step=2)
    cache = PageCache(output)  # what exists now counts as durable
    states: dict[int, tuple] = {}  # op index -> what a power cut right after it keeps

    def after(op) -> None:
        cache.after(op)
        states[len(recorder.ops) - 1] = cache.durable()

    recorder = Recorder(output, after=after)
    with recorder:
        new = output / "checkpoint-3"
        (new / "sub").mkdir(parents=True)
        (new / "model.safetensors").write_bytes(secrets.token_bytes(8192))
        (new / "sub" / "optimizer.pt").write_bytes(secrets.token_bytes(1024))
        args = SimpleNamespace(output_dir=str(output), should_save=True, save_total_limit=None)
        state = SimpleNamespace(global_step=3, best_model_checkpoint=None)
        SealedCheckpoints(keep_last=1).on_save(args, state, object())
    assert not old.exists() and verified_checkpoint(output) == new
    pruned = next(i for i, op in enumerate(recorder.ops) if op.kind == "rename" and op.path == str(old))
    for at in sorted(i for i in states if i >= pruned):
        cut = tmp_path / f"power-cut-{at}"
        cut.mkdir()
        cache.materialize(states[at], cut)
        try:
            kept = verified_checkpoint(cut)
        except UnsealedCheckpoint:
            kept = None
        assert kept is not None, f"a power cut after {recorder.ops[at]} leaves no checkpoint that verifies"


def test_sealing_replaces_only_a_seal_and_never_lists_its_own_temporaries(sealed):
    stale = sealed / ".meta.json.0123abcd.tmp"  # what write_json_atomic leaves if killed
    stale.write_text("{")
    theirs = sealed / ".meta.json.backup.tmp"  # a user's file: not a name write_json_atomic gives
    theirs.write_text("mine")
    short = sealed / ".meta.json.abc.tmp"  # hex, but not the eight digits write_json_atomic gives
    short.write_text("also mine")
    (sealed / "weights.bin").write_bytes(b"new")
    seal_checkpoint(sealed, step=3)
    files = check_seal(sealed)["files"]
    assert files["weights.bin"]["size"] == 3 and not stale.exists()
    assert theirs.read_text() == "mine" and short.read_text() == "also mine"
    # The user's files are files of the checkpoint: sealed with it, not passed over as ours.
    assert (files[theirs.name]["size"], files[short.name]["size"]) == (4, 9)
    assert ".meta.json.0123abcd.tmp" not in files
    ours = {"schema": "pipeline.checkpoint/2", "step": 3}
    (sealed / "meta.json").write_text(json.dumps(ours))
    with pytest.raises(
        UnsealedCheckpoint, match="is not a pipeline.folder-seal/1 seal: refusing to replace it"
    ):
        seal_checkpoint(sealed)
    assert json.loads((sealed / "meta.json").read_text()) == ours


def test_the_callback_names_a_checkpoint_it_could_not_seal_prunes_nothing_and_training_goes_on(
    sealed, capsys
):
    from pipeline.integrations.transformers import SealedCheckpoints

    older = sealed.parent / "checkpoint-1"  # sealed, and past keep_last=1 had the save been sealed
    older.mkdir()
    (older / "weights.bin").write_bytes(secrets.token_bytes(64))
    seal_checkpoint(older, step=1)
    link_inside(sealed)
    args = SimpleNamespace(output_dir=str(sealed.parent), should_save=True, save_total_limit=None)
    state = SimpleNamespace(global_step=3, best_model_checkpoint=None)
    control = object()
    assert SealedCheckpoints(keep_last=1).on_save(args, state, control) is control
    assert "checkpoint-3 was not sealed" in capsys.readouterr().err
    assert verified_checkpoint(sealed.parent) == sealed.parent / "checkpoint-2"
    assert sorted(p.name for p in sealed.parent.iterdir()) == [f"checkpoint-{n}" for n in (1, 2, 3)]


def test_the_callback_warns_that_save_total_limit_deletes_before_the_seal(capsys):
    from pipeline.integrations.transformers import SealedCheckpoints

    args = SimpleNamespace(should_save=True, save_total_limit=2)
    SealedCheckpoints().on_train_begin(args, SimpleNamespace(), object())
    assert "prefer save_total_limit=None and SealedCheckpoints(keep_last=2)" in capsys.readouterr().err
    SealedCheckpoints().on_train_begin(SimpleNamespace(should_save=True, save_total_limit=None), None, None)
    assert capsys.readouterr().err == ""


def test_pruning_keeps_the_newest_sealed_and_never_touches_unsealed_newer_or_protected_folders(tmp_path):
    output = tmp_path / "output"
    for step in range(8):
        folder = output / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "weights.bin").write_bytes(bytes([step]) * 64)
        if step not in (0, 6):  # 0: from a run without the callback; 6: a save cut short
            seal_checkpoint(folder, step=step)
    leftover = output / ".pruned-checkpoint-9-0123abcd"  # what a prune killed midway leaves
    leftover.mkdir()
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("a month of notes")
    (output / ".pruned-checkpoint-8-0123abcd").symlink_to(
        precious
    )  # named as one, but a link: never followed
    removed = prune_checkpoints(output / "checkpoint-5", 2, protect=output / "checkpoint-2")
    assert removed == ["checkpoint-3", "checkpoint-1"]
    left = sorted(p.name for p in output.iterdir())
    assert left == [".pruned-checkpoint-8-0123abcd"] + [f"checkpoint-{n}" for n in (0, 2, 4, 5, 6, 7)]
    assert (precious / "notes.txt").read_text() == "a month of notes"
    # Protected among the keep_last newest, it is one of them: no older one is kept in its place.
    assert prune_checkpoints(output / "checkpoint-5", 2, protect=output / "checkpoint-4") == ["checkpoint-2"]
    with pytest.raises(ValueError):
        prune_checkpoints(output / "checkpoint-5", 0)


def test_a_renamed_backup_copy_of_a_checkpoint_is_neither_resumed_from_nor_pruned(sealed):
    """checkpoint-10.bak and checkpoint-3-old are a user's copies, sealed as the originals were:
    only checkpoint-N itself is a checkpoint, to resume from or to prune."""
    output = sealed.parent
    originals = {step: (output / f"checkpoint-{step}" / "weights.bin").read_bytes() for step in (2, 3)}
    shutil.copytree(output / "checkpoint-3", output / "checkpoint-10.bak")
    shutil.copytree(output / "checkpoint-2", output / "checkpoint-3-old")
    assert verified_checkpoint(output) == output / "checkpoint-3"
    assert prune_checkpoints(output / "checkpoint-3", 1) == ["checkpoint-2"]
    assert sorted(p.name for p in output.iterdir()) == [
        "checkpoint-10.bak",
        "checkpoint-3",
        "checkpoint-3-old",
    ]
    for backup, step in (("checkpoint-10.bak", 3), ("checkpoint-3-old", 2)):
        assert (output / backup / "weights.bin").read_bytes() == originals[step]
        assert check_seal(output / backup)["step"] == step


def test_accelerate_save_state_folders_are_sealed_pruned_and_verified_the_same_way(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    import torch
    from accelerate.utils import ProjectConfiguration

    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = accelerate.Accelerator(cpu=True, project_config=project)
    net = torch.nn.Linear(4, 4)
    model, optimizer = accelerator.prepare(net, torch.optim.AdamW(net.parameters()))
    saved, weights = [], []
    for _ in range(3):
        with torch.no_grad():
            model.weight.add_(1.0)
        weights.append(model.weight.detach().clone())
        saved.append(Path(accelerator.save_state()))
        seal_checkpoint(saved[-1])
        prune_checkpoints(saved[-1], keep_last=2)
    checkpoints = tmp_path / "checkpoints"
    assert saved == [checkpoints / f"checkpoint_{n}" for n in range(3)]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_1", "checkpoint_2"]
    assert verified_checkpoint(checkpoints) == saved[2]
    _flip_middle_byte(saved[2] / "model.safetensors")
    assert verified_checkpoint(checkpoints) == saved[1]
    accelerator.load_state(str(saved[1]))  # accelerate reads its own files; the seal is not one of them
    assert torch.equal(model.weight, weights[1]) and not torch.equal(model.weight, weights[2])


# -- the order of a sealed save: seal durable first, then prune; a crash at any call ----------------


def _trainer_save(output: Path) -> None:
    """checkpoint-2 and checkpoint-4 sealed, and checkpoint-6 just written by the Trainer."""
    for step in (2, 4, 6):
        folder = output / f"checkpoint-{step}"
        (folder / "sub").mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(bytes([step]) * 4096)
        (folder / "sub" / "optimizer.pt").write_bytes(bytes([step + 1]) * 512)
        if step < 6:
            seal_checkpoint(folder, step=step)


def _on_save(output: Path, step: int) -> None:
    from pipeline.integrations.transformers import SealedCheckpoints

    args = SimpleNamespace(output_dir=str(output), should_save=True, save_total_limit=None)
    state = SimpleNamespace(global_step=step, best_model_checkpoint=None)
    SealedCheckpoints(keep_last=1).on_save(args, state, object())


def test_the_callback_makes_the_seal_durable_before_it_prunes_and_a_crash_at_any_call_keeps_a_save(
    tmp_path, capsys
):
    """SealedCheckpoints(keep_last=1) after the Trainer wrote checkpoint-6, its file-system calls
    recorded (tests/helpers/oprecorder.py): the seal goes to a temporary file, fsynced, renamed
    into place, its folder fsynced, all before an older checkpoint is touched; each older one is
    renamed away, the rename made durable, then removed. Then the save is failed right before
    each recorded call in turn, by a crash (a forked process ended there) and by an OSError
    (which the callback reports): verified_checkpoint then returns checkpoint-6 or checkpoint-4,
    no visible checkpoint folder is half deleted, and the next save leaves only itself."""
    from oprecorder import CRASH_EXIT, Recorder, ordering_problems

    pristine = tmp_path / "pristine"
    _trainer_save(pristine)
    recorded = tmp_path / "recorded"
    shutil.copytree(pristine, recorded)
    with Recorder(recorded) as recorder:
        _on_save(recorded, 6)
    ops = recorder.ops
    assert ordering_problems(ops) == [], ops
    assert sorted(p.name for p in recorded.iterdir()) == ["checkpoint-6"]
    assert verified_checkpoint(recorded) == recorded / "checkpoint-6"
    new = str(recorded / "checkpoint-6")
    sealed = next(i for i, op in enumerate(ops) if op.kind == "rename" and op.target == f"{new}/meta.json")
    durable = next(i for i, op in enumerate(ops) if i > sealed and op.kind == "fsync" and op.path == new)
    touched = [i for i, op in enumerate(ops) if "checkpoint-2" in op.path or "checkpoint-4" in op.path]
    assert len(touched) >= 4 and durable < min(touched), ops
    for index, op in enumerate(ops):
        if op.kind == "rename" and op.path != ops[sealed].path:
            # The hidden folder's own rmdir ends its removal (what is inside goes by descriptor).
            removed = next(
                i for i, o in enumerate(ops) if o.kind in ("rmtree", "rmdir") and o.path == op.target
            )
            assert any(
                o.kind == "fsync" and o.is_dir and o.path == str(recorded) for o in ops[index + 1 : removed]
            ), (op, ops)

    for at, what in [(at, how) for at in range(len(ops)) for how in ("exit", "raise")]:
        case = tmp_path / f"{what}-{at}"
        shutil.copytree(pristine, case)
        if what == "exit":
            pid = os.fork()
            if pid == 0:
                try:
                    with Recorder(case, fail_at=at, how="exit"):
                        _on_save(case, 6)
                finally:
                    os._exit(0)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == CRASH_EXIT, (at, ops[at])
        else:
            with Recorder(case, fail_at=at, how="raise"):
                _on_save(case, 6)
            assert "checkpoint-6 was not" in capsys.readouterr().err, (at, ops[at])
        where = f"{what} before #{at} {ops[at]}"
        resumed = verified_checkpoint(case)
        assert resumed in (case / "checkpoint-6", case / "checkpoint-4"), where
        for folder in case.glob("checkpoint-*"):
            if (folder / "meta.json").exists():
                check_seal(folder)  # a visible, sealed checkpoint is whole
        # The run resumes there and saves its next checkpoint (step 6 again, over the unsealed one).
        following = case / f"checkpoint-{int(resumed.name.split('-')[1]) + 2}"
        following.mkdir(exist_ok=True)
        (following / "model.safetensors").write_bytes(b"\x08" * 64)
        _on_save(case, int(following.name.split("-")[1]))
        assert sorted(p.name for p in case.iterdir()) == [following.name], where
        assert verified_checkpoint(case) == following, where
        capsys.readouterr()


# -- seals at their edges: step 0, no step, an empty file, what is not a folder ----------------------


def test_a_seal_of_step_0_or_of_no_step_lists_an_empty_file_and_a_nested_meta_json_and_verifies(tmp_path):
    """Step 0 is a step; a seal need not know its step; a file may be empty; only the top-level
    meta.json is the seal (a nested one is a file like any other, and checked)."""
    first = tmp_path / "output" / "checkpoint-0"
    (first / "sub").mkdir(parents=True)
    (first / "weights.bin").write_bytes(b"w" * 64)
    (first / "added_tokens.json").write_bytes(b"")
    (first / "sub" / "meta.json").write_text('{"a": 1}')
    sealed = seal_checkpoint(first, step=0)
    assert sealed["step"] == 0 and sealed["files"]["added_tokens.json"]["size"] == 0
    assert sorted(sealed["files"]) == ["added_tokens.json", "sub/meta.json", "weights.bin"]
    assert check_seal(first) == sealed
    later = tmp_path / "output" / "checkpoint-3"
    shutil.copytree(first, later)
    (later / "meta.json").unlink()
    assert seal_checkpoint(later)["step"] is None and check_seal(later)["step"] is None
    assert verified_checkpoint(tmp_path / "output") == later
    (later / "sub" / "meta.json").write_text('{"a": 2}')  # same size, other bytes
    with pytest.raises(UnsealedCheckpoint, match=r"sub/meta\.json: SHA-256 differs from its seal"):
        check_seal(later)


def test_what_is_not_a_folder_is_neither_checked_nor_sealed_and_nothing_is_written_through_a_link(
    tmp_path, capsys
):
    output = tmp_path / "output"
    real = output / "checkpoint-1"
    real.mkdir(parents=True)
    (real / "weights.bin").write_bytes(b"w" * 64)
    seal_checkpoint(real, step=1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "weights.bin").write_bytes(b"x" * 64)
    link = output / "checkpoint-5"
    link.symlink_to(elsewhere)
    missing = tmp_path / "missing"
    for folder in (link, missing, real / "weights.bin"):
        with pytest.raises(UnsealedCheckpoint) as refused:
            check_seal(folder)
        assert str(refused.value) == f"{folder} is not a folder"
        with pytest.raises(UnsealedCheckpoint) as refused:
            seal_checkpoint(folder)
        assert str(refused.value) == f"{folder} is not a folder: nothing to seal"
    assert sorted(p.name for p in elsewhere.iterdir()) == ["weights.bin"]
    assert verified_checkpoint(output) == real
    assert f"skipping checkpoint-5: {link} is not a folder" in capsys.readouterr().err
    unsealed = output / "checkpoint-2"
    unsealed.mkdir()
    (unsealed / "weights.bin").write_bytes(b"w")
    for step in (-1, True, 2.0):
        with pytest.raises(ValueError) as refused:
            seal_checkpoint(unsealed, step=step)
        assert str(refused.value) == f"step must be a non-negative integer or None, got {step!r}"
    assert not (unsealed / "meta.json").exists()


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param(lambda path: path.symlink_to("nowhere"), id="a-dangling-link"),
        pytest.param(lambda path: path.symlink_to("weights.bin"), id="a-link-inside"),
        pytest.param(os.mkfifo, id="a-fifo"),
        pytest.param(os.mkdir, id="a-folder"),
        pytest.param(lambda path: path.write_bytes(b""), id="an-empty-file"),
        pytest.param(lambda path: path.write_text('{"schema": "theirs/1"}'), id="their-json"),
    ],
)
def test_sealing_never_replaces_a_meta_json_that_is_not_a_seal_and_leaves_the_folder_as_it_was(
    tmp_path, plant
):
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"w" * 64)
    meta = folder / "meta.json"
    plant(meta)
    before = {p.name: (p.lstat().st_mode, p.lstat().st_ino) for p in folder.iterdir()}
    with pytest.raises(UnsealedCheckpoint) as refused:
        seal_checkpoint(folder, step=1)
    assert str(refused.value) == f"{meta} exists and is not a {SEAL_SCHEMA} seal: refusing to replace it"
    assert {p.name: (p.lstat().st_mode, p.lstat().st_ino) for p in folder.iterdir()} == before
    assert (folder / "weights.bin").read_bytes() == b"w" * 64


def test_a_hard_link_and_an_empty_file_are_sealed_as_the_bytes_they_hold_and_verify(tmp_path):
    """A hard link is a plain file of the folder (its bytes may have another name outside):
    sealed, listed once under its name, verified; the file outside is left as it was."""
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"o" * 32)
    folder = tmp_path / "checkpoint-4"
    (folder / "sub").mkdir(parents=True)
    os.link(outside, folder / "sub" / "linked.bin")
    (folder / "empty.txt").write_bytes(b"")
    seal = seal_checkpoint(folder, step=4)
    assert seal == {
        "schema": SEAL_SCHEMA,
        "step": 4,
        "files": {
            "empty.txt": {"sha256": hashlib.sha256(b"").hexdigest(), "size": 0},
            "sub/linked.bin": {"sha256": hashlib.sha256(b"o" * 32).hexdigest(), "size": 32},
        },
    }
    assert check_seal(folder) == seal and verified_checkpoint(tmp_path) == folder
    assert outside.read_bytes() == b"o" * 32 and outside.stat().st_nlink == 2


def test_when_the_newest_is_unsealed_and_an_older_seal_fails_the_user_is_not_told_to_seal_one(tmp_path):
    """Only when no checkpoint has a seal at all is sealing one the way out: here one seal
    failed, so the folders are damaged, and sealing the newest (a save cut short) would vouch for it."""
    output = tmp_path / "output"
    older = output / "checkpoint-2"
    older.mkdir(parents=True)
    (older / "weights.bin").write_bytes(b"w" * 64)
    seal_checkpoint(older, step=2)
    _flip_middle_byte(older / "weights.bin")
    (output / "checkpoint-4").mkdir()
    (output / "checkpoint-4" / "weights.bin").write_bytes(b"w" * 32)
    with pytest.raises(UnsealedCheckpoint) as refused:
        verified_checkpoint(output)
    assert str(refused.value) == (
        f"no checkpoint in {output} has a seal that verifies (newest checkpoint-4: {output}/checkpoint-4 has no "
        "meta.json: an unsealed folder (a save cut short, or one written before SealedCheckpoints; if you trust "
        "it, seal it with pipeline.integrations.seal.seal_checkpoint)); nothing was resumed: move those folders "
        "away to start from scratch"
    )


def test_a_seal_check_names_the_first_of_several_missing_or_unlisted_files_and_seals_a_nested_temporary(
    sealed,
):
    """Two files gone, or two added: the refusal names the first in name order. A file named
    like the seal's temporary but one folder down is the checkpoint's own: sealed and checked."""
    (sealed / "weights.bin").unlink()
    (sealed / "sub" / "state.json").unlink()
    with pytest.raises(UnsealedCheckpoint) as missing:
        check_seal(sealed)
    assert str(missing.value) == f"{sealed}/sub/state.json is listed in its seal but missing"
    nested = sealed / "sub" / ".meta.json.0123abcd.tmp"
    nested.write_text("theirs")
    (sealed / "weights.bin").write_bytes(b"w")
    seal_checkpoint(sealed, step=3)
    assert sorted(check_seal(sealed)["files"]) == ["sub/.meta.json.0123abcd.tmp", "weights.bin"]
    (sealed / "a.bin").write_bytes(b"a")
    (sealed / "z.bin").write_bytes(b"z")
    with pytest.raises(UnsealedCheckpoint) as extra:
        check_seal(sealed)
    assert str(extra.value) == (
        f"{sealed}/a.bin is not listed in its seal: written after the seal, or left by an earlier save"
    )
