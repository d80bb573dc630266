"""Small defects, one test each: the NaN check under fp16 AMP, prepared
data fsynced (files, every folder, the parent) and refused once changed since (a forged
manifest fingerprint, a damaged file under 01 run again), ``factories.resolve`` leaving
``sys.path`` as it was, an oversize staged meta.json named as such, and 01 naming what is in
its way."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from pathlib import Path

import pytest

import pipeline.durable as durable
from pipeline.audit import audit_stage
from pipeline.config import load_config
from pipeline.data import load_manifest, prepare_data
from pipeline.errors import DataError, StageAuditError, TrainingDiverged
from pipeline.factories import resolve

from support import REPO

CONFIG = REPO / "config.yaml"


def test_a_nan_loss_stops_training_under_fp16_amp_too(data_dir, tmp_path):
    from pipeline.train import train

    config = load_config(
        CONFIG,
        {
            "data.dir": str(data_dir),
            "checkpoint.dir": str(tmp_path / "ck"),
            "data.factory": "failure_factories:build_nan_after_data",
            "training.amp": "fp16",
            "training.dtype": "float32",
        },
    )
    with (
        pytest.raises(TrainingDiverged, match="loss is nan at step 3"),
        warnings.catch_warnings(record=True) as seen,
    ):
        warnings.simplefilter("always")
        train(config, progress=False)
    # The steps the GradScaler skipped move the schedule on without torch's order warning.
    assert not [w for w in seen if "lr_scheduler.step()" in str(w.message)], [str(w.message) for w in seen]


def test_prepared_data_is_fsynced_file_by_file_folder_by_folder_and_the_parent(tmp_path, monkeypatch):
    synced: list[tuple[str, Path]] = []
    real = durable.step

    def recording_step(name, call, *args):
        if name in ("fsync_file", "fsync_temp", "fsync_parent"):
            synced.append((name, Path(args[0])))
        return real(name, call, *args)

    monkeypatch.setattr(durable, "step", recording_step)
    target = tmp_path / "data" / "nested"
    config = load_config(
        CONFIG, {"data.dir": str(target), "data.prepare": "failure_factories:prepare_nested"}
    )
    prepare_data(config)
    temporary = next(p for name, p in synced if name == "fsync_temp" and p.parent == target.parent)
    relative = {
        (name, p.relative_to(temporary).as_posix()) for name, p in synced if p.is_relative_to(temporary)
    }
    files = {"top.bin", "sub/middle.bin", "sub/deeper/bottom.bin", "manifest.json"}
    assert {("fsync_file", f) for f in files} <= relative
    assert {("fsync_temp", f) for f in (".", "sub", "sub/deeper")} <= relative
    assert ("fsync_parent", target.parent) in synced
    assert load_manifest(config)["files"].keys() == files - {"manifest.json"}


def test_resolve_imports_from_the_working_folder_and_leaves_sys_path_as_it_was(tmp_path, monkeypatch):
    (tmp_path / "my_task_factories_11.py").write_text("def build(config):\n    return 42\n")
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    assert resolve("my_task_factories_11:build", "model.factory")(None) == 42
    assert sys.path == before


def test_an_oversize_staged_meta_json_is_called_oversize_not_invalid_json(staged_run, run_copy):
    run = run_copy(staged_run)
    meta_path = run.stage / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(meta) + " " * (16 * 1024 * 1024))  # still valid JSON
    digest = hashlib.sha256(meta_path.read_bytes()).hexdigest()
    manifest = run.stage / "MANIFEST.sha256"
    manifest.write_text(
        "".join(
            line if not line.endswith("  meta.json\n") else f"{digest}  meta.json\n"
            for line in manifest.read_text().splitlines(keepends=True)
        )
    )
    with pytest.raises(StageAuditError, match="meta.json is .* bytes, over the 16777216-byte limit"):
        audit_stage(run.stage)


@pytest.mark.parametrize(
    "in_the_way, expected",
    [
        (
            {"notes.txt": "mine", "old/": None, "a.bin": "x", "b.bin": "y"},
            r"already holds a.bin, b.bin, notes.txt and 1 more but no manifest.json",
        ),
        ({"a.bin": "x", "b.bin": "y", "c/": None}, r"already holds a\.bin, b\.bin, c/ but no manifest\.json"),
        ("a file", r"exists and is not a folder"),
        ({"\x1b[31mred": "x"}, r"already holds \\x1b\[31mred but no manifest.json"),
    ],
)
def test_01_names_exactly_what_is_in_the_way_and_touches_nothing(tmp_path, in_the_way, expected):
    """02, 03 and 04 reading that data.dir give 01's refusal, not "run 01 first", which 01 would
    refuse."""
    target = tmp_path / "data"
    if isinstance(in_the_way, dict):
        target.mkdir()
        for name, text in in_the_way.items():
            (target / name).mkdir() if text is None else (target / name).write_text(text)
    else:
        target.write_text(in_the_way)
    before = sorted(
        (p.relative_to(tmp_path).as_posix(), p.read_bytes() if p.is_file() else None)
        for p in tmp_path.rglob("*")
    )
    config = load_config(CONFIG, {"data.dir": str(target)})
    with pytest.raises(DataError, match=expected):
        prepare_data(config)
    with pytest.raises(DataError, match=expected):
        load_manifest(config)
    after = sorted(
        (p.relative_to(tmp_path).as_posix(), p.read_bytes() if p.is_file() else None)
        for p in tmp_path.rglob("*")
    )
    assert after == before


@pytest.mark.parametrize("names", ["nothing", "an empty folder"])
def test_01_refuses_a_link_at_data_dir_and_leaves_it_and_its_target_alone(tmp_path, names):
    """A link at data.dir is "in the way" whether what it names does not exist or is an empty
    folder: 01 says so in one line before preparing anything, and creates nothing through it."""
    target, named = tmp_path / "data", tmp_path / "elsewhere"
    if names == "an empty folder":
        named.mkdir()
    target.symlink_to(named)
    config = load_config(CONFIG, {"data.dir": str(target)})
    refusal = (
        f"data.dir {target} exists and is not a folder: "
        "move it away or point data.dir elsewhere (--set data.dir=PATH)"
    )
    for step in (prepare_data, load_manifest):
        with pytest.raises(DataError) as refused:
            step(config)
        assert str(refused.value) == refusal
    assert target.is_symlink() and os.readlink(target) == str(named)
    assert os.path.lexists(named) == (names == "an empty folder")
    if names == "an empty folder":
        assert list(named.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["data"] + (["elsewhere"] if os.path.lexists(named) else [])
    )


@pytest.mark.parametrize("made", ["absent", "empty folder"])
def test_a_data_dir_01_would_prepare_into_is_named_with_01s_command(tmp_path, made):
    target = tmp_path / "data"
    if made == "empty folder":
        target.mkdir()
    with pytest.raises(DataError) as refused:
        load_manifest(load_config(CONFIG, {"data.dir": str(target)}))
    assert str(refused.value).startswith(f"no prepared data in {target}/: run ")
    assert str(refused.value).endswith(f"01_prepare_data.py --set data.dir={target} first")


def test_prepared_data_changed_since_is_refused_by_01_run_again_and_by_every_reader(tmp_path):
    """A manifest whose fingerprint (what checkpoints are pinned to) was edited while every file
    still matches its table is refused; so is a file damaged since, by 01 run again over it,
    which keeps nothing damaged without a word and touches nothing."""
    target = tmp_path / "data"
    config = load_config(CONFIG, {"data.dir": str(target)})
    prepare_data(config)
    manifest_file = target / "manifest.json"
    original = manifest_file.read_bytes()
    forged = {**json.loads(original), "fingerprint": hashlib.sha256(b"other data").hexdigest()}
    manifest_file.write_text(json.dumps(forged))
    for reader in (load_manifest, prepare_data):
        with pytest.raises(DataError, match="manifest.json fingerprint does not match its file table"):
            reader(config)
    manifest_file.write_bytes(original)
    name = sorted(forged["files"])[0]
    damaged = bytearray((target / name).read_bytes())
    damaged[-1] ^= 0x01
    (target / name).write_bytes(bytes(damaged))
    with pytest.raises(DataError, match=f"{name} changed since it was prepared"):
        prepare_data(config)
    assert (target / name).read_bytes() == damaged and manifest_file.read_bytes() == original


@pytest.mark.parametrize("swap", ["fifo", "link", "folder"])
def test_a_data_manifest_that_is_not_the_file_01_wrote_is_refused_without_being_read(tmp_path, swap):
    """manifest.json is opened once, not following a link: a FIFO would hang 02, 03 and 04, and a
    link (here to a byte-identical copy, which a reader following it would accept) would make
    another file the data's record."""
    target = tmp_path / "data"
    config = load_config(CONFIG, {"data.dir": str(target)})
    prepare_data(config)
    manifest_file = target / "manifest.json"
    copy = tmp_path / "elsewhere.json"
    copy.write_bytes(manifest_file.read_bytes())
    manifest_file.unlink()
    {"fifo": os.mkfifo, "link": lambda path: path.symlink_to(copy), "folder": os.mkdir}[swap](manifest_file)
    what = {
        "fifo": "a FIFO, not a regular file",
        "link": "a symbolic link",
        "folder": "a folder, not a regular file",
    }
    with pytest.raises(DataError) as refused:
        load_manifest(config)
    message = str(refused.value)
    assert message.startswith(f"{manifest_file} is {what[swap]}: not the manifest script 01 writes; move ")
    assert (
        f"is {what[swap]}: not the manifest script 01 writes; move {target}/ aside (nothing in it is deleted) and rerun "
        in message
    )
    assert message.endswith("01_prepare_data.py --set data.dir=" + str(target))


def test_01_prepares_into_an_empty_folder(tmp_path):
    target = tmp_path / "data"
    target.mkdir()
    folder, manifest, changed = prepare_data(load_config(CONFIG, {"data.dir": str(target)}))
    assert (
        changed
        and (target / "manifest.json").is_file()
        and sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    )


def _prepared_with_socket_at(tmp_path: Path, name: str, monkeypatch) -> tuple[Path, Path]:
    import socket

    target = tmp_path / "data"
    config = load_config(CONFIG, {"data.dir": str(target)})
    prepare_data(config)
    where = target / name
    where.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX)
    monkeypatch.chdir(target)  # bound by its short name: a long tmp path would pass AF_UNIX's 107 bytes
    server.bind(name)
    server.close()  # the socket file stays
    return target, where


def test_a_socket_as_manifest_json_is_refused_like_a_fifo(tmp_path, monkeypatch):
    """read_own: a socket fails the open with ENXIO, which it passes on as a bare OSError, so
    02/03/04 end with "manifest.json: No such device or address" (no fix); read_meta has the
    same hole. HandedFolder.open already maps ENXIO to "now a socket"."""
    target, manifest_file = _prepared_with_socket_at(tmp_path, "manifest.json", monkeypatch)
    config = load_config(CONFIG, {"data.dir": str(target)})
    with pytest.raises(DataError) as refused:
        load_manifest(config)
    assert str(refused.value).startswith(f"{manifest_file} is a socket, not a regular file: not the manifest")


def test_read_own_calls_a_socket_a_socket(tmp_path, monkeypatch):
    from pipeline.safe_read import read_own

    _, where = _prepared_with_socket_at(tmp_path, "meta.json", monkeypatch)
    with pytest.raises(ValueError, match="is a socket"):
        read_own(where, 1024)


@pytest.mark.parametrize("swap", ["fifo", "dangling link", "folder"])
def test_01_does_not_say_manifest_json_is_there_and_not_there(tmp_path, swap):
    """01's _check_target asks ``is_file()`` (links followed, non-regular False), so a FIFO,
    a folder or a dangling link named manifest.json reads "already holds ..., manifest.json,
    ... but no manifest.json"; 02/04 (read_own) say what it is. 01 should say the same."""
    target = tmp_path / "data"
    config = load_config(CONFIG, {"data.dir": str(target)})
    prepare_data(config)
    manifest_file = target / "manifest.json"
    manifest_file.unlink()
    {"fifo": os.mkfifo, "dangling link": lambda p: p.symlink_to(tmp_path / "nowhere"), "folder": os.mkdir}[
        swap
    ](manifest_file)
    with pytest.raises(DataError) as refused:
        prepare_data(config)
    message = str(refused.value)
    holds, _, lacks = message.partition(" but no ")
    assert not ("manifest.json" in holds and lacks.startswith("manifest.json")), message


def _manifest_edited(tmp_path: Path, edit) -> tuple[Path, object]:
    target = tmp_path / "data"
    config = load_config(CONFIG, {"data.dir": str(target)})
    prepare_data(config)
    manifest_file = target / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    edit(manifest)
    manifest_file.write_text(json.dumps(manifest))
    return target, config


def test_a_data_manifest_without_its_fingerprint_is_refused_as_damaged_in_one_line(tmp_path):
    """The fingerprint is what checkpoints are pinned to: a manifest without it is damaged (one
    line naming it and the fix), never a KeyError traceback in 02, 03 or 04."""
    target, config = _manifest_edited(tmp_path, lambda m: m.pop("fingerprint"))
    for call in (load_manifest, prepare_data):
        with pytest.raises(DataError) as refused:
            call(config)
        message = str(refused.value)
        assert message.startswith(f"{target / 'manifest.json'} is damaged: move {target}/ aside"), message
        assert "\n" not in message


def test_a_huge_recorded_value_does_not_become_a_huge_error_line(tmp_path):
    """_recipe_difference/_show echo the manifest's recorded value whole: a manifest recording
    a 20 MB data.prepare made 01, 02 and 04 print one 20 MB line."""
    _, config = _manifest_edited(tmp_path, lambda m: m.__setitem__("prepare", "x" * 1_000_000))
    with pytest.raises(DataError) as refused:
        load_manifest(config)
    assert len(str(refused.value)) < 2_000
    with pytest.raises(DataError) as refused:
        prepare_data(config)
    assert len(str(refused.value)) < 2_000


def test_a_params_key_from_the_manifest_is_shown_inert(tmp_path):
    """A params key recorded in manifest.json reaches the refusal as ``data.params.<key>``
    raw: terminal escapes in it (here a title change and a screen clear) reach stderr.
    errors.shown() exists for exactly this."""
    evil = "\x1b]0;pwned\x07\x1b[2J"
    _, config = _manifest_edited(tmp_path, lambda m: m["params"].__setitem__(evil, 1))
    for call in (load_manifest, prepare_data):
        with pytest.raises(DataError) as refused:
            call(config)
        assert "\x1b" not in str(refused.value) and "\x07" not in str(refused.value)


def test_a_manifest_whose_params_are_not_a_table_names_the_whole_params_as_the_difference(tmp_path):
    """A manifest recording data.params as something other than a mapping (edited by hand) is
    data of another recipe: the refusal compares the whole params, never a traceback of a
    key-by-key comparison with a list."""
    import re

    target, config = _manifest_edited(tmp_path, lambda m: m.__setitem__("params", ["num_train"]))
    here = json.dumps(config.data.params)
    own = rf"{re.escape(str(target))}-[0-9a-f]{{8}}"
    held = f"{target}/ holds data prepared with data.params " + '["num_train"]'
    with pytest.raises(DataError) as refused:
        load_manifest(config)
    assert re.fullmatch(
        re.escape(
            f"{held}, but this config has {here}: prepare this config's data into a folder of its own with "
        )
        + rf"\S+ scripts/01_prepare_data\.py --set data\.dir={own}, then add --set data\.dir={own} here "
        + re.escape("(the data in place stays: checkpoints may be trained on it)"),
        str(refused.value),
    ), refused.value
    with pytest.raises(DataError) as refused:
        prepare_data(config)
    assert re.fullmatch(
        re.escape(f"{held}, this config has {here}; nothing was touched (checkpoints may be trained on it): ")
        + re.escape("prepare this config's data into a folder of its own with ")
        + rf"\S+ scripts/01_prepare_data\.py --set data\.dir={own}, and give --set data\.dir={own} "
        + "to the other scripts too",
        str(refused.value),
    ), refused.value


def test_a_data_prepare_that_writes_no_file_is_refused_and_leaves_no_data_dir(tmp_path):
    """01 with a data.prepare that wrote nothing: a data.dir holding only a manifest of no file
    would be "prepared data" every reader accepts; refused in one line naming the function."""
    target = tmp_path / "data"
    config = load_config(
        CONFIG, {"data.dir": str(target), "data.prepare": "hostile_factories:prepare_nothing"}
    )
    with pytest.raises(DataError) as refused:
        prepare_data(config)
    assert str(refused.value) == "hostile_factories:prepare_nothing wrote no files"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_data_manifest_that_is_not_a_table_of_files_is_refused_as_damaged_in_one_line(tmp_path):
    """manifest.json parsed but not the object 01 writes (a list, a files entry that is not a
    mapping): one line naming it and the fix from 01 run again and from every reader, not an
    AttributeError traceback."""
    from pipeline.commands import script_command

    target, config = _manifest_edited(tmp_path, lambda m: None)
    manifest_file = target / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    for damaged in ([manifest], {**manifest, "files": sorted(manifest["files"])}):
        manifest_file.write_text(json.dumps(damaged))
        for call in (load_manifest, prepare_data):
            with pytest.raises(DataError) as refused:
                call(config)
            assert str(refused.value) == (
                f"{manifest_file} is damaged: move {target}/ aside (nothing in it is deleted) and rerun "
                f"{script_command(config, '01_prepare_data.py')}"
            ), refused.value
            assert str(refused.value).endswith(f"01_prepare_data.py --set data.dir={target}")


def test_data_of_another_recipe_is_refused_naming_the_first_key_that_differs_and_both_values(
    data_dir, tmp_path
):
    """load_manifest (02, 03; 04 and 05 with the checkpoint named) on data whose manifest
    records another recipe: the first key in the order prepare, seed, params (a params entry by
    its own name, the first by name), the recorded value and the config's, each "(not
    recorded)" or "(not set)" where there is none; then the command preparing this config's
    data into a folder of its own, named by its recipe."""
    import re
    import shutil

    target = tmp_path / "data"
    shutil.copytree(data_dir, target)
    manifest_file = target / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    params = manifest["params"]
    assert params["noise"] == 0.05 and "b" not in params and "scale" not in params, params
    config = load_config(CONFIG, {"data.dir": str(target)})
    cases = [
        ({"params": {**params, "shift": 1}}, {}, "data.params.shift 1", "(not set)"),
        ({}, {"data.params.scale": 2}, "data.params.scale (not recorded)", "2"),
        ({"params": {**params, "noise": 0.1, "b": [1]}}, {}, "data.params.b [1]", "(not set)"),
        ({"params": {**params, "noise": 0.1}}, {}, "data.params.noise 0.1", "0.05"),
        ({"params": {**params, "noise": 0.1}, "seed": 7}, {}, "data.seed 7", "1234"),
        ({"seed": 7, "prepare": "x:y"}, {}, 'data.prepare "x:y"', '"pipeline.tasks.regression:prepare_data"'),
        ({"params": {**params, "\x1b[2J": 0}}, {}, "data.params.\\x1b[2J 0", "(not set)"),
        ({"params": None}, {}, "data.params (not recorded)", json.dumps(config.data.params)),
        # A recorded value is shown whole up to 200 characters, cut past them.
        ({"params": {**params, "long": "a" * 198}}, {}, f'data.params.long "{"a" * 198}"', "(not set)"),
        (
            {"params": {**params, "long": "a" * 199}},
            {},
            f'data.params.long "{"a" * 199}... (201 characters)',
            "(not set)",
        ),
    ]
    for edits, overrides, recorded, configured in cases:
        manifest_file.write_text(
            json.dumps({k: v for k, v in {**manifest, **edits}.items() if v is not None})
        )
        here = load_config(CONFIG, {"data.dir": str(target), **overrides})
        with pytest.raises(DataError) as refused:
            load_manifest(here)
        message = str(refused.value)
        folder = re.escape(f"--set data.dir={target}-") + "[0-9a-f]{8}"
        assert re.fullmatch(
            re.escape(
                f"{target}/ holds data prepared with {recorded}, but this config has {configured}: prepare this "
                "config's data into a folder of its own with "
            )
            + rf".*01_prepare_data\.py .*{folder}, then add {folder} here "
            + re.escape("(the data in place stays: checkpoints may be trained on it)"),
            message,
        ), (edits, message)
        with pytest.raises(DataError) as refused:
            load_manifest(here, trained="step-00000004")
        assert str(refused.value) == (
            f"{target}/ holds data prepared with {recorded}, but step-00000004 was trained on data prepared "
            f"with {configured}: point data.dir at the data it was trained on"
        )
    manifest_file.write_text(json.dumps(manifest))
    assert load_manifest(config, trained="step-00000004") == manifest
    # data.dir given with a trailing slash: the folder of its own is still beside it, not inside.
    from pipeline.data.prepared import _own_folder_command

    assert re.fullmatch(folder, _own_folder_command(load_config(CONFIG, {"data.dir": f"{target}/"}))[1])


def test_a_file_added_to_or_missing_from_prepared_data_is_refused_naming_it(tmp_path):
    """Every reader checks the data folder's files against the manifest's table both ways: a
    file added since 01 (trained on without a word otherwise) or one gone is named."""
    target, config = _manifest_edited(tmp_path, lambda m: None)
    (target / "zz-added.bin").write_bytes(b"x")
    (target / "aa-added.bin").write_bytes(b"x")
    with pytest.raises(DataError) as refused:
        load_manifest(config)
    # Two added: the first by name is named.
    assert str(refused.value) == f"{target}/ does not match its manifest (file aa-added.bin added or missing)"
    (target / "zz-added.bin").unlink()
    (target / "aa-added.bin").unlink()
    gone = sorted(json.loads((target / "manifest.json").read_text())["files"])[-1]
    (target / gone).unlink()
    with pytest.raises(DataError) as refused:
        load_manifest(config)
    assert str(refused.value) == f"{target}/ does not match its manifest (file {gone} added or missing)"


def test_the_files_table_leaves_out_what_is_being_prepared_and_nested_data_sets_only(tmp_path):
    """A data folder's table: what 01 is preparing beside it (.tmp-*, at any depth inside) and a
    data set of its own below (its manifest.json) are not part of it; a deeper folder or file
    merely named .tmp-* is."""
    from pipeline.data.prepared import _files_table

    for name in (
        "a.bin",
        ".tmp-x/b.bin",
        ".tmp-x/sub/c.bin",
        ".tmp-y",
        "inner/manifest.json",
        "inner/d.bin",
        "sub/.tmp-z/e.bin",
        "sub/.tmp-f",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    assert sorted(_files_table(tmp_path)) == ["a.bin", "sub/.tmp-f", "sub/.tmp-z/e.bin"]
