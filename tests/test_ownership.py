"""Only replace or delete what we built: the stage's marker, the store's own temporary
folders, the atomic-folder helper's own siblings, and prune's checks."""

from __future__ import annotations

import ast
import errno
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

import pipeline.durable as durable
from pipeline.audit import stage_marker_problem
from pipeline.checkpoint import CheckpointStore
from pipeline.errors import InternalError

from support import REPO, save_parts

META = save_parts({"best": 0.5})


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _sha256sum_manifest(folder: Path) -> None:
    """A manifest in `sha256sum` format over the folder, as a user's release script writes it."""
    lines = [
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(folder).as_posix()}\n"
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in ("MANIFEST.sha256", "model.sig")
    ]
    (folder / "MANIFEST.sha256").write_text("".join(lines))


def test_05_refuses_a_foreign_folder_with_its_own_manifest_and_leaves_it_byte_for_byte(
    evaluated_run, run_copy
):
    run = run_copy(evaluated_run)
    release = run.root / "release"
    release.mkdir()
    (release / "important.txt").write_text("the only copy")
    # Even a meta.json listed in the manifest does not make it ours without our record.
    (release / "meta.json").write_text(json.dumps({"schema": "my-release/1"}))
    _sha256sum_manifest(release)
    before = snapshot(release)
    line = run.refused("05_stage.py", "--stage", "release")
    assert "was not built by scripts/05_stage.py" in line and "refusing to replace it" in line
    assert "not a pipeline.stage/1 record" in line
    assert snapshot(release) == before
    assert not [p for p in run.root.iterdir() if p.name.startswith((".tmp-release", ".old-release"))]


def test_the_stage_marker_is_a_valid_staged_record_listed_in_the_manifest(staged_run, run_copy):
    run = run_copy(staged_run)
    assert stage_marker_problem(run.stage) is None
    meta_path = run.stage / "meta.json"
    original = meta_path.read_bytes()
    meta_path.write_bytes(original + b" ")  # no longer the listed bytes
    assert "differs from the SHA-256" in stage_marker_problem(run.stage)
    meta = json.loads(original)
    del meta["source_checkpoint"]
    meta_path.write_text(json.dumps(meta))
    _sha256sum_manifest(run.stage)
    assert "naming a source checkpoint" in stage_marker_problem(run.stage)
    (run.stage / "MANIFEST.sha256").unlink()
    assert "holds no MANIFEST.sha256" in stage_marker_problem(run.stage)


def test_05_replaces_a_stage_it_built_even_after_its_card_was_edited(staged_run, run_copy):
    run = run_copy(staged_run)
    card = run.stage / "README.md"
    card.write_text(card.read_text() + "\nedited by hand\n")
    _sha256sum_manifest(run.stage)
    run.ok("05_stage.py")
    assert "edited by hand" not in card.read_text()


def _save(store: CheckpointStore, step: int) -> None:
    store.save(step, {"w": torch.full((3,), float(step))}, {"s": torch.zeros(1)}, META)


def test_store_removes_only_the_temporary_folders_it_names_and_only_under_its_lock(tmp_path):
    # A step past 99,999,999 is named with nine digits.
    ours = [".tmp-step-00000007-0badf00d", ".deleting-step-00000003-12345678", ".tmp-step-100000000-0badf00d"]
    theirs = [".tmp-notes", ".deleting-mine", ".tmp-step-00000007-notes", "step-00000002"]
    theirs += [".tmp-step-00000007-0badf00d\n", ".deleting-step-00000003-12345678\n"]  # a user's names
    theirs += [".tmp-step-١٢٣٤٥٦٧٨-0badf00d"]  # digits, but not the ones we write
    for name in ours + theirs:
        (tmp_path / name).mkdir()
        (tmp_path / name / "file").write_text(name)
    store = CheckpointStore(tmp_path)
    with pytest.raises(InternalError, match="without holding its lock"):
        store.clean_stale()
    with store:
        removed = store.clean_stale()
    assert sorted(p.name for p in removed) == sorted(ours)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == sorted(theirs)


def test_recover_removes_only_siblings_with_the_names_atomic_folder_gives(tmp_path):
    dest = tmp_path / "hub_stage"
    for name in (".tmp-hub_stage-0badf00d", ".tmp-hub_stage-mine", ".old-hub_stage-backup"):
        (tmp_path / name).mkdir()
    removed = durable.recover(dest)
    assert [p.name for p in removed] == [".tmp-hub_stage-0badf00d"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".old-hub_stage-backup", ".tmp-hub_stage-mine"]
    assert durable.recover(tmp_path / "absent" / "hub_stage") == [] and not (tmp_path / "absent").exists()


def test_prune_needs_the_lock_and_keeps_a_step_folder_whose_meta_is_not_ours(tmp_path, caplog):
    store = CheckpointStore(tmp_path, keep_last=1)
    with pytest.raises(InternalError, match="prune .* without holding its lock"):
        store.prune()
    foreign = tmp_path / "step-00000001"
    foreign.mkdir()
    (foreign / "meta.json").write_text('{"schema": "someone-else/1"}')
    with store:
        _save(store, 2)
        _save(store, 3)
    assert store.committed_steps() == [1, 3]
    assert (foreign / "meta.json").read_text() == '{"schema": "someone-else/1"}'
    assert "not pruning" in caplog.text and "step-00000001" in caplog.text


def test_no_assert_statements_in_the_package():
    """Preconditions are real checks: ``assert`` vanishes under ``python -O``."""
    found = []
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assert):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []


def test_a_failing_atomic_write_names_the_folder_it_was_writing(tmp_path):
    with pytest.raises(OSError) as failed:
        with durable.atomic_folder(tmp_path / "out") as built:
            fd = os.open(built / "f", os.O_WRONLY | os.O_CREAT)
            os.close(fd)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as os.write on a descriptor raises it
    assert failed.value.filename.startswith(str(tmp_path / ".tmp-out-"))
    assert list(tmp_path.iterdir()) == []
