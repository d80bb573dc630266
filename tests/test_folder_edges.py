"""Folders handed over, at their edges: nested a thousand deep, a newest checkpoint changed after
its seal, weights whose header is garbage or whose tail is a sparse hole, a folder's name in the
card's front matter, weights only their owner may read, and names shown once, never twice.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import struct
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from test_hostile_folders import leftovers, socket_at, stage, tiny_folder

import pipeline.stage.from_folder as from_folder
from pipeline.durable import fsync_tree, remove_tree
from pipeline.errors import FolderTooDeep, RepoIdError, StageError, UnsealedCheckpoint
from pipeline.integrations.seal import prune_checkpoints, seal_checkpoint, verified_checkpoint
from pipeline.safe_read import HandedFolder
from pipeline.stage.card_parts import card_data
from pipeline.stage.folder_source import survey_folder

from support import PYTHON, REPO, a_socket, one_line_error, run_script, script_env


def make_nest(root: Path, depth: int) -> None:
    """``root/d/d/.../d``, ``depth`` folders deep, made through folder descriptors (a path
    that long, or os.makedirs's own recursion, would fail first)."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        with open(os.open("x.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as out:
            out.write("deep")
    finally:
        os.close(fd)


@pytest.fixture
def nest(tmp_path):
    """:func:`make_nest`; the test's folder is removed after it, without recursion: pytest's own
    removal of old temporary folders recurses once per level and would fail on these."""
    yield make_nest
    remove_tree(tmp_path)


# -- a thousand folders deep --------------------------------------------------------------------------


def test_05_refuses_a_folder_nested_a_thousand_deep_in_one_line(tmp_path, nest):
    """A left-out runs/ folder nested 1000 deep ended 05 in a 31-line RecursionError traceback."""
    folder = tiny_folder(tmp_path / "model")
    nest(folder / "runs", 1000)
    target = tmp_path / "stage"
    result = run_script("05_stage.py", "--from-folder", str(folder), "--stage", str(target), cwd=tmp_path)
    line = one_line_error(result)
    assert result.returncode == 2 and line.startswith(
        f"error: {folder} nests folders more than 64 deep (runs/d/d/"
    ), line
    assert line.endswith("no model or checkpoint folder does; nothing was staged"), line
    assert not target.exists() and leftovers(tmp_path) == []
    # As deep as real folders go, and well beyond: staged.
    (folder / "runs").rename(tmp_path / "deep-runs")
    nest(folder / "runs", 60)
    assert stage(folder, target).stage == target


def test_verified_checkpoint_and_the_seal_refuse_a_deep_folder_and_never_raise_out_of_a_trainer_run(
    tmp_path, capsys, nest
):
    """verified_checkpoint raised RecursionError out of trainer.train(resume_from_checkpoint=...),
    seal_checkpoint too, and SealedCheckpoints.on_save ended the training run with it."""
    output = tmp_path / "output"
    for step in (1, 2):
        folder = output / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(bytes([step]) * 64)
        seal_checkpoint(folder, step=step)
    nest(output / "checkpoint-2" / "runs", 1000)
    assert verified_checkpoint(output) == output / "checkpoint-1"
    skipped = capsys.readouterr().err
    assert (
        "verified_checkpoint: skipping checkpoint-2:" in skipped
        and "nests folders more than 64 deep" in skipped
    )
    with pytest.raises(UnsealedCheckpoint, match="nests folders more than 64 deep"):
        seal_checkpoint(output / "checkpoint-2", step=2)
    with pytest.raises(FolderTooDeep):
        fsync_tree(output / "checkpoint-2")
    from pipeline.integrations.transformers import SealedCheckpoints

    args = SimpleNamespace(should_save=True, output_dir=str(output))
    control = object()
    state = SimpleNamespace(global_step=2, best_model_checkpoint=None)
    assert SealedCheckpoints(keep_last=1).on_save(args, state, control) is control
    assert "checkpoint-2 was not sealed" in capsys.readouterr().err
    assert verified_checkpoint(output) == output / "checkpoint-1"


def test_fsync_tree_passes_over_links_fifos_and_sockets_but_a_file_it_cannot_open_is_an_error(
    tmp_path, monkeypatch
):
    folder = tmp_path / "checkpoint-1"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "weights.bin").write_bytes(b"w" * 64)
    (tmp_path / "private.txt").write_text("notes")
    (folder / "outside").symlink_to(tmp_path / "private.txt")
    (folder / "dangling").symlink_to(tmp_path / "nowhere")
    os.mkfifo(folder / "pipe")  # fsync of a FIFO is EINVAL: not synced, nor waited on
    socket_at(folder / "sock", monkeypatch)
    listing = sorted((p.relative_to(folder).as_posix(), p.lstat().st_mode) for p in folder.rglob("*"))
    fsync_tree(folder)
    assert sorted((p.relative_to(folder).as_posix(), p.lstat().st_mode) for p in folder.rglob("*")) == listing
    # A file whose path is past PATH_MAX, in folders whose paths are not: never left unsynced.
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    length = len(str(folder))
    try:
        while length < 3900:
            name = "d" * min(200, 3900 - length - 1)
            os.mkdir(name, dir_fd=fd)
            inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd, length = inner, length + 1 + len(name)
        os.close(os.open("f" * 200, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)
    with pytest.raises(OSError) as failed:
        fsync_tree(folder)
    assert failed.value.errno == errno.ENAMETOOLONG and failed.value.filename.endswith("/" + "f" * 200)


def test_pruning_removes_an_old_checkpoint_nested_a_thousand_deep(tmp_path, nest):
    """shutil.rmtree recursed once per level (Python 3.11): the prune raised RecursionError."""
    output = tmp_path / "output"
    for step in (1, 2):
        folder = output / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "weights.bin").write_bytes(bytes([step]) * 64)
        seal_checkpoint(folder, step=step)
    nest(output / "checkpoint-1" / "logs", 1000)  # after its seal: still counted as sealed
    assert prune_checkpoints(output / "checkpoint-2", 1) == ["checkpoint-1"]
    assert sorted(p.name for p in output.iterdir()) == ["checkpoint-2"]


def test_a_folder_nesting_exactly_64_folders_is_walked_whole_and_one_more_is_refused_naming_it(
    tmp_path, nest
):
    """64 nested folders, the documented maximum, are walked to the file in the last of them; a
    65th is refused in one line naming it, before it is entered."""
    folder = tmp_path / "model"
    nest(folder, 64)
    with HandedFolder(folder) as handed:
        assert [name for name, _ in handed.walk()] == [
            *("/".join(["d"] * level) for level in range(1, 65)),
            "/".join(["d"] * 64 + ["x.txt"]),
        ]
    remove_tree(folder)
    nest(folder, 65)
    with HandedFolder(folder) as handed, pytest.raises(FolderTooDeep) as refused:
        list(handed.walk())
    assert str(refused.value) == (
        f"{folder} nests folders more than 64 deep ({'/'.join(['d'] * 65)}): no model or checkpoint folder does"
    )


# -- prune beside a newest checkpoint that does not verify ---------------------------------------------


def test_pruning_keeps_the_older_checkpoints_when_the_newest_does_not_verify(tmp_path, capsys, monkeypatch):
    """keep_last=1 deleted every older checkpoint although the newest one's files had changed
    after its seal (a late writer, another rank): verified_checkpoint then found none."""
    output = tmp_path / "output"
    for step in (1, 2, 3):
        folder = output / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "weights.bin").write_bytes(bytes([step]) * 64)
        seal_checkpoint(folder, step=step)
    (output / "checkpoint-3" / "weights.bin").write_bytes(b"\xff" * 64)  # same size, other bytes
    with pytest.raises(UnsealedCheckpoint, match="SHA-256 differs from its seal.*; nothing was pruned"):
        prune_checkpoints(output / "checkpoint-3", 1)
    assert sorted(p.name for p in output.iterdir()) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert verified_checkpoint(output) == output / "checkpoint-2"
    capsys.readouterr()
    import pipeline.integrations.transformers as callback

    SealedCheckpoints = callback.SealedCheckpoints
    args = SimpleNamespace(should_save=True, output_dir=str(output))
    (output / "checkpoint-4").mkdir()
    (output / "checkpoint-4" / "weights.bin").write_bytes(b"\x04" * 64)
    real_seal = callback.seal_checkpoint

    def seal_then_change(folder, step):  # a late writer: the file changes between the seal and the prune
        sealed = real_seal(folder, step=step)
        (Path(folder) / "weights.bin").write_bytes(b"\x00" * 64)
        return sealed

    monkeypatch.setattr(callback, "seal_checkpoint", seal_then_change)
    state = SimpleNamespace(global_step=4, best_model_checkpoint=None)
    SealedCheckpoints(keep_last=1).on_save(args, state, None)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint-4 was not pruned after it" in err[0], err
    assert verified_checkpoint(output) == output / "checkpoint-2"
    assert (output / "checkpoint-1").is_dir()


# -- weights whose header is checked before a byte is copied -------------------------------------------


def garbage_weights(folder: Path, size: int, *, valid_header: bool) -> Path:
    """``size`` bytes, a sparse hole after the header: garbage, or a valid header whose one
    small tensor ends long before the file does."""
    folder.mkdir()
    if valid_header:
        header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
        head = struct.pack("<Q", len(header)) + header + bytes(8)
    else:
        head = struct.pack("<Q", 40) + b"this is no JSON at all, just a bad file!"
    with open(folder / "model.safetensors", "wb") as out:
        out.write(head)
        out.truncate(size)
    (folder / "config.json").write_text("{}")
    return folder


@pytest.mark.parametrize(
    ("valid_header", "rule"),
    [
        (False, "the header does not start with '{'"),
        (True, "trailing bytes after the last tensor (tensors end at data byte 8, the file holds"),
    ],
    ids=["garbage-header", "sparse-tail"],
)
def test_weights_with_a_bad_header_are_refused_before_they_are_copied(tmp_path, valid_header, rule):
    """A 6 GiB sparse file with a 40-byte garbage header was refused after 45 s, once 6 GiB
    had been copied into the scratch folder; a 1 TiB one would fill the disk first. Here 05
    may write no file larger than 1 MiB (prlimit): it must refuse before copying a byte."""
    folder = garbage_weights(tmp_path / "model", 256 * 1024 * 1024, valid_header=valid_header)
    target = tmp_path / "stage"
    result = subprocess.run(
        ["prlimit", "--fsize=1048576", PYTHON, "-B", str(REPO / "scripts" / "05_stage.py")]
        + ["--from-folder", str(folder), "--stage", str(target)],
        cwd=tmp_path,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = one_line_error(result)
    assert result.returncode == 2, line
    assert line.startswith(
        f"error: {folder / 'model.safetensors'} is not a valid safetensors file ({rule}"
    ), line
    assert line.endswith("; nothing was staged"), line
    assert not target.exists() and leftovers(tmp_path) == []


# -- the card's front matter --------------------------------------------------------------------------

HOSTILE_NAMES = ["<script>alert(1)<_script>", "x\nlicense: evil\ntags: [pwn]", "evil\u202egnp.exe\u2028`x`|y"]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=["html", "yaml-keys", "bidi-separator-code"])
def test_a_folders_name_reaches_the_front_matter_as_a_plain_model_name(tmp_path, name):
    """Without --repo-id the front matter's model_name (which the Hub shows in its evaluation
    widget, and builds the eval dataset's name from) was the folder's name as it was."""
    folder = tiny_folder(tmp_path / name)
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"eval_loss": 0.5}))
    target = tmp_path / "stage"
    stage(folder, target, metrics=metrics)
    card = (target / "README.md").read_text(encoding="utf-8")
    front = card.split("\n---\n", 1)[0]
    plain = from_folder.model_name(name)
    assert plain and set(plain) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
    data = yaml.safe_load(front.removeprefix("---\n"))
    (index,) = data["model-index"]  # model_name, as the Hub's evaluation widget shows it
    assert index["name"] == plain and index["results"][0]["dataset"]["name"] == f"{plain} held-out data"
    assert set(data) == {"library_name", "license", "tags", "metrics", "model-index"}, data
    assert not any(char in front for char in "<>`|\u202e\u2028"), front
    assert card.split("\n---\n", 1)[1].startswith(f"\n# {plain}\n")


def test_a_folders_name_becomes_a_repository_name_never_an_empty_one():
    assert from_folder.model_name("my model (v2)") == "my-model-v2"
    assert from_folder.model_name(".hidden-model.") == "hidden-model"
    assert from_folder.model_name("...") == from_folder.model_name("\u202e") == "model"


def test_the_configs_model_name_is_inert_text_in_the_front_matter(tmp_path):
    folder = tiny_folder(tmp_path / "model")
    stage(folder, tmp_path / "stage")
    meta = json.loads((tmp_path / "stage" / "meta.json").read_text())
    meta["config"]["model"]["name"] = "mine\u202e\nlicense: evil"
    assert card_data(meta).model_name == "mine\\u202e\\x0alicense: evil"


# -- weights only their owner may read -----------------------------------------------------------------


def test_private_weights_stay_private_while_staged_and_once_staged(tmp_path, monkeypatch):
    """A 0600 model.safetensors was copied into a 0755 scratch folder as a 0644 file and staged
    0644: any local user could read the weights during and after staging."""
    folder = tiny_folder(tmp_path / "model")
    os.chmod(folder / "model.safetensors", 0o600)
    os.chmod(folder / "tokenizer.json", 0o640)
    target = tmp_path / "stage"
    seen = {}
    real_audit = from_folder.audit_stage

    def audit_and_look(built):  # while the stage is built: what could another user open?
        seen["built"] = stat.S_IMODE(built.stat().st_mode)
        seen["scratch"] = [stat.S_IMODE(p.stat().st_mode) for p in tmp_path.glob(".scratch-stage-weights-*")]
        return real_audit(built)

    monkeypatch.setattr(from_folder, "audit_stage", audit_and_look)
    umask = os.umask(0o022)
    try:
        stage(folder, target)
    finally:
        os.umask(umask)
    assert seen == {"built": 0o700, "scratch": [0o700]}
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in target.iterdir()}
    assert modes["model.safetensors"] == 0o600 and modes["tokenizer.json"] == 0o640, modes
    assert modes["config.json"] == modes["README.md"] == modes["meta.json"] == 0o644, modes
    assert stat.S_IMODE(target.stat().st_mode) == 0o755


def test_a_checkpoints_private_weights_are_staged_private(trained_run, run_copy):
    run = run_copy(trained_run)
    os.chmod(run.checkpoint / "modelo.safetensors", 0o600)
    run.ok("05_stage.py", "--no-metrics")
    assert stat.S_IMODE((run.stage / "modelo.safetensors").stat().st_mode) == 0o600
    assert stat.S_IMODE((run.stage / "README.md").stat().st_mode) & 0o044 == 0o044


def sharded_tiny_folder(root: Path, modes: tuple[int, int] = (0o644, 0o644)) -> Path:
    """A tiny folder whose weights are two shards and their index, each shard with its mode."""
    folder = tiny_folder(root)
    (folder / "model.safetensors").unlink()
    shards = {
        "model-00001-of-00002.safetensors": "layer.weight",
        "model-00002-of-00002.safetensors": "layer.bias",
    }
    for (shard, tensor), mode in zip(shards.items(), modes):
        save_file({tensor: torch.ones(4, 4) if tensor == "layer.weight" else torch.zeros(4)}, folder / shard)
        os.chmod(folder / shard, mode)
    weight_map = {tensor: shard for shard, tensor in shards.items()}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return folder


def test_sharded_weights_are_staged_with_the_least_permissions_of_their_shards(tmp_path):
    """Two shards another user may read only one of each (0640, 0604): the staged weights,
    made from both, may be read by neither group nor others."""
    folder = sharded_tiny_folder(tmp_path / "model", modes=(0o640, 0o604))
    umask = os.umask(0o022)
    try:
        stage(folder, tmp_path / "stage")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "stage" / "model.safetensors").stat().st_mode) == 0o600


def test_the_survey_of_a_folder_names_its_first_training_state_and_leaves_the_rest_out_in_order(tmp_path):
    folder = tiny_folder(tmp_path / "model")
    for name in ("trainer_state.json", "optimizer.pt", "zeta.txt", "merges.txt"):
        (folder / name).write_bytes(b"\x80\x04N.")
    (folder / "a-runs").mkdir()
    (folder / "a-runs" / "events.txt").write_text("x")
    (folder / "weights.safetensors").mkdir()  # a folder: no second weights file
    inventory = survey_folder(folder)
    assert (inventory.weights, inventory.index, inventory.carried, inventory.left_out) == (
        ("model.safetensors",),
        None,
        ("config.json", "tokenizer.json", "merges.txt"),
        ("a-runs/", "optimizer.pt", "trainer_state.json", "weights.safetensors/", "zeta.txt"),
    )
    assert inventory.checkpoint_like == "it holds optimizer.pt"
    assert sorted(inventory.seen) == [
        ".",
        "config.json",
        "merges.txt",
        "model.safetensors",
        "optimizer.pt",
    ] + [
        "tokenizer.json",
        "trainer_state.json",
        "zeta.txt",
    ]


def test_a_fifo_socket_hard_link_and_empty_file_one_level_down_are_left_out_never_opened(tmp_path):
    """Special entries in a subfolder are not read (only the top's weights, config and tokenizer
    are): the folder stages, the subfolder is left out, and nothing is written into the folder."""
    folder = tiny_folder(tmp_path / "model")
    runs = folder / "runs"
    runs.mkdir()
    os.mkfifo(runs / "pipe")  # opened, it would wait for a writer forever
    a_socket(runs / "sock")
    os.link(folder / "config.json", runs / "config-copy.json")
    (runs / "empty.txt").write_bytes(b"")
    before = _tree(folder)
    target = tmp_path / "stage"
    stage(folder, target)
    record = json.loads((target / "meta.json").read_text())["source_checkpoint"]
    assert (record["left_out"], sorted(record["files"])) == (
        ["runs/"],
        ["config.json", "model.safetensors", "tokenizer.json"],
    )
    assert _tree(folder) == before and leftovers(tmp_path) == []


def test_an_index_mapping_a_tensor_to_a_shard_that_does_not_hold_it_is_refused(tmp_path):
    """Staged, such a folder would lack a tensor its own index promises (what from_pretrained expects)."""
    folder = sharded_tiny_folder(tmp_path / "model")
    index = folder / "model.safetensors.index.json"
    listed = json.loads(index.read_text())
    listed["weight_map"]["layer.scale"] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps(listed))
    with pytest.raises(StageError) as refused:
        stage(folder, tmp_path / "stage")
    message = str(refused.value)
    assert (
        "model.safetensors.index.json maps tensor layer.scale to model-00002-of-00002.safetensors, which does "
        "not hold it; nothing was staged"
    ) in message, message
    assert not (tmp_path / "stage").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "name, text, why",
    [
        ("tokenizer_config.json", '{"model_max_length": 512', "is not valid JSON"),
        ("tokenizer_config.json", '["not", "an", "object"]', "must hold a JSON object"),
        ("generation_config.json", '{"max_new_tokens": NaN}', "is not valid JSON"),
    ],
    ids=["tokenizer-config-cut", "tokenizer-config-a-list", "generation-config-nan"],
)
def test_a_carried_json_file_that_is_not_a_strict_json_object_is_refused_naming_it(tmp_path, name, text, why):
    """Every carried JSON file is parsed strictly, not only config.json: staged, a broken
    tokenizer_config.json or generation_config.json would be published and fail to load."""
    folder = tiny_folder(tmp_path / "model")
    (folder / name).write_text(text)
    with pytest.raises(StageError) as refused:
        stage(folder, tmp_path / "stage")
    message = str(refused.value)
    assert message.startswith(f"{folder / name} {why}") and message.endswith("; nothing was staged"), message
    assert not (tmp_path / "stage").exists() and leftovers(tmp_path) == []


def test_an_index_whose_weight_map_is_empty_is_refused_not_staged_as_a_model_without_tensors(tmp_path):
    """An index mapping no tensor to any file names no weights: staged, the model would hold none."""
    folder = sharded_tiny_folder(tmp_path / "model")
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(StageError) as refused:
        stage(folder, tmp_path / "stage")
    message = str(refused.value)
    assert message.startswith(f"{index} ") and message.endswith("; nothing was staged"), message
    assert "weight_map" in message and "\n" not in message, message
    assert not (tmp_path / "stage").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("model_type", [{}, {"model_type": None}], ids=["absent", "null"])
def test_a_config_naming_architectures_without_model_type_gets_the_plain_pytorch_loading_snippet(
    tmp_path, model_type
):
    """architectures and model_type make a transformers model; architectures alone (or with a
    model_type of null) do not. Such a model's card loads the weights with its own class: the
    folder stage ships no code/hub_loader.py for a snippet to import."""
    folder = tiny_folder(tmp_path / "model")
    (folder / "config.json").write_text(json.dumps({"width": 4, "architectures": ["TinyNet"], **model_type}))
    stage(folder, tmp_path / "stage")
    meta = json.loads((tmp_path / "stage" / "meta.json").read_text())
    assert meta["export"]["transformers"] is False and meta["export"]["architecture"] == "TinyNet"
    assert not (tmp_path / "stage" / "code").exists()
    card = (tmp_path / "stage" / "README.md").read_text(encoding="utf-8")
    load = card.split("## How to load it", 1)[1].split("\n## ", 1)[0]
    assert "is a PyTorch model" in card and "this repository holds no code" in load, load
    assert "load_state_dict(state_dict)" in load, load
    assert "hub_loader" not in card and "code/" not in load and "from_pretrained(folder" not in load, load


def test_a_transformers_config_listing_several_architectures_is_staged_and_loaded_as_its_first(tmp_path):
    """transformers builds a config's first architecture: the card loads that class, not another
    one listed after it."""
    folder = tiny_folder(tmp_path / "model")
    config = {"width": 4, "model_type": "tiny", "architectures": ["TinyNetModel", "TinyNetForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(config))
    stage(folder, tmp_path / "stage")
    meta = json.loads((tmp_path / "stage" / "meta.json").read_text())
    assert meta["export"]["transformers"] is True and meta["export"]["architecture"] == "TinyNetModel"
    card = (tmp_path / "stage" / "README.md").read_text(encoding="utf-8")
    assert (
        "\n`model` is a transformers `TinyNetModel` model with 20 parameters in `model.safetensors`." in card
    )
    load = card.split("## How to load it", 1)[1].split("\n## ", 1)[0]
    assert "from transformers import TinyNetModel\n" in load, load
    assert "model, info = TinyNetModel.from_pretrained(folder, output_loading_info=True)\n" in load, load
    assert "ForCausalLM" not in card, card


def test_a_repo_id_without_a_namespace_is_refused_before_anything_is_staged(tmp_path):
    """The card's snippets download from --repo-id: a bare name is a repo of the Hub's own."""
    folder = tiny_folder(tmp_path / "model")
    with pytest.raises(RepoIdError, match="--repo-id 'tiny-net' names no namespace: use 'namespace/name'"):
        stage(folder, tmp_path / "stage", repo_id="tiny-net")
    assert not (tmp_path / "stage").exists() and leftovers(tmp_path) == []
    stage(folder, tmp_path / "stage", repo_id="you/tiny-net")
    assert "you/tiny-net" in (tmp_path / "stage" / "README.md").read_text()


# -- names shown once ----------------------------------------------------------------------------------


def test_a_name_is_shown_once_never_escaped_twice(tmp_path, capsys):
    """A file x<newline>y read as x\\x5cx5cny: shown() of a message built from shown names, or of
    a repr."""
    output = tmp_path / "output"
    folder = output / "checkpoint-1"
    folder.mkdir(parents=True)
    (folder / "x`y").write_bytes(b"a" * 8)
    seal_checkpoint(folder, step=1)
    (folder / "x`y").write_bytes(b"b" * 8)
    with pytest.raises(UnsealedCheckpoint) as refused:
        verified_checkpoint(output)
    err = capsys.readouterr().err
    assert "x\\x60y: SHA-256 differs from its seal" in err and "x5c" not in err, err
    assert "x\\x60y: SHA-256 differs" in str(refused.value) and "x5c" not in str(refused.value)
    seal = json.loads((folder / "meta.json").read_text())
    seal["files"]["x\ny"] = seal["files"].pop("x`y")
    (folder / "meta.json").write_text(json.dumps(seal))
    with pytest.raises(UnsealedCheckpoint):
        verified_checkpoint(output)
    err = capsys.readouterr().err
    assert "lists 'x\\x0ay', which is not a printable relative path" in err and "x5c" not in err, err
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"a\nb": "not a number"}))
    with pytest.raises(Exception, match=r"--metrics .*: 'a\\x0ab' must be a short metric name"):
        stage(tiny_folder(tmp_path / "model"), tmp_path / "stage", metrics=metrics)


# -- a small file that is not small ----------------------------------------------------------------


def test_a_tokenizer_or_config_over_its_limit_is_refused_before_it_is_read(tmp_path):
    """tokenizer.json (a sparse hole one byte over 256 MiB): refused from its size alone, so
    a file of any size costs no memory; peak allocations stay far below the file."""
    import tracemalloc

    folder = tiny_folder(tmp_path / "model")
    with open(folder / "tokenizer.json", "r+b") as sparse:
        sparse.truncate(256 * 1024 * 1024 + 1)
    tracemalloc.start()
    try:
        with pytest.raises(StageError) as refused:
            stage(folder, tmp_path / "stage")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(refused.value) == (
        f"{folder}/tokenizer.json is 268,435,457 bytes, over the 268,435,456-byte limit of such a file"
    )
    assert peak < 32 * 1024 * 1024, f"{peak:,} bytes allocated to refuse it"
    assert not (tmp_path / "stage").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "char",
    [
        "\u202e",
        "\u2066",
        "\u200b",
        "\u200d",
        "\u200f",
        "\ufeff",
        "\u2028",
        "\u2029",
        "\x00",
        "\x1b",
        "\n",
        "\ud800",
    ],
    ids=["RLO", "LRI", "ZWSP", "ZWJ", "RLM", "BOM", "LS", "PS", "NUL", "ESC", "LF", "surrogate"],
)
def test_a_bidi_override_or_invisible_character_in_a_name_is_shown_as_an_escape(char):
    """A name such as evil<RLO>gnp.exe reads as evilexe.png in a terminal or on a Hub page:
    every format, control or separator character is written out, so what is shown is what
    the name holds."""
    from pipeline.errors import shown

    escaped = shown(f"evil{char}gnp.exe")
    assert char not in escaped and escaped.startswith("evil\\") and escaped.endswith("gnp.exe"), escaped
    assert escaped.isprintable() and shown("a-plain_name.v2.txt") == "a-plain_name.v2.txt"


# -- every refusal of a folder: its exact line, nothing staged, the folder untouched ----------------


def _tree(root: Path) -> dict[str, object]:
    """Every entry under ``root``: a file's bytes and mode, a link's target, a folder's or FIFO's mode."""
    tree: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        if stat.S_ISLNK(info.st_mode):
            tree[path.relative_to(root).as_posix()] = ("link", os.readlink(path))
        elif stat.S_ISREG(info.st_mode):
            tree[path.relative_to(root).as_posix()] = (path.read_bytes(), info.st_mode)
        else:
            tree[path.relative_to(root).as_posix()] = ("special", info.st_mode)
    return tree


def _index(folder: Path, weight_map: object) -> Path:
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def _safetensors_files(count: int) -> Callable[[Path], str]:
    def damage(folder: Path) -> str:
        for i in range(1, count):
            save_file({"x": torch.zeros(1)}, folder / f"extra-{i}.safetensors")
        names = sorted(p.name for p in folder.glob("*.safetensors"))
        listed = ", ".join(names[:3]) + (", …" if count > 3 else "")
        return (
            f"{folder} holds {count} .safetensors files ({listed}) and no model.safetensors.index.json naming "
            "them: which are the weights? Keep one, or the shards and their index; nothing was staged"
        )

    return damage


def no_config(folder: Path) -> str:
    (folder / "config.json").unlink()
    return (
        f"{folder} has no config.json: the Hub's tools need one beside the weights (save_pretrained writes it); "
        "nothing was staged"
    )


def fifos_at_the_top(folder: Path) -> str:
    os.mkfifo(folder / "b-pipe")
    os.mkfifo(folder / "a-pipe")
    return f"{folder}/a-pipe is not a plain file or folder; nothing was staged"


def a_socket_at_the_top(folder: Path) -> str:
    a_socket(folder / "a-sock")
    return f"{folder}/a-sock is not a plain file or folder; nothing was staged"


def config_a_link_inside(folder: Path) -> str:
    (folder / "config.json").rename(folder / "real-config.json")
    (folder / "config.json").symlink_to("real-config.json")
    return (
        f"{folder}/config.json is a link to real-config.json: 05 reads the folder's plain files only, never "
        "through a link; copy the files into a folder (cp -rL) and stage the copy; nothing was staged"
    )


def a_dangling_link_at_the_top(folder: Path) -> str:
    (folder / "latest").symlink_to("nowhere")
    return (
        f"{folder}/latest is a link to nowhere: 05 reads the folder's plain files only, never "
        "through a link; copy the files into a folder (cp -rL) and stage the copy; nothing was staged"
    )


def config_a_folder(folder: Path) -> str:
    (folder / "config.json").unlink()
    (folder / "config.json").mkdir()
    return (
        f"{folder} has no config.json: the Hub's tools need one beside the weights (save_pretrained writes it); "
        "nothing was staged"
    )


def config_empty(folder: Path) -> str:
    (folder / "config.json").write_bytes(b"")
    return f"{folder}/config.json is not valid JSON (Expecting value: line 1 column 1 (char 0)); nothing was staged"


def weights_empty(folder: Path) -> str:
    (folder / "model.safetensors").write_bytes(b"")
    return (
        f"{folder}/model.safetensors is not a valid safetensors file (shorter than the 8-byte header length); "
        "nothing was staged"
    )


def link_in_a_left_out_folder(folder: Path) -> str:
    (folder / "runs").mkdir()
    (folder / "runs" / "latest").symlink_to("../../elsewhere")
    return (
        f"{folder}/runs/latest is a link to ../../elsewhere: 05 reads the folder's plain files only, never "
        "through a link; copy the files into a folder (cp -rL) and stage the copy; nothing was staged"
    )


def _no_weights(folder: Path) -> str:
    return (
        f"{folder} holds no weights (model.safetensors, or shards and model.safetensors.index.json); "
        "nothing was staged"
    )


def _a_pickle(path: Path) -> str:
    return (
        f"{path} is a pickle, and pickles are never loaded here (loading one runs code): "
        "convert the model where you trust it, e.g. AutoModel.from_pretrained(DIR).save_pretrained(NEW_DIR) "
        "writes model.safetensors, then stage NEW_DIR; nothing was staged"
    )


def only_a_pickle(folder: Path) -> str:
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    (folder / "optimizer.pt").write_bytes(b"\x80\x04N.")  # sorted first: training state, never named
    return _a_pickle(folder / "pytorch_model.bin")


def only_training_state(folder: Path) -> str:
    (folder / "model.safetensors").unlink()
    (folder / "optimizer.pt").write_bytes(b"\x80\x04N.")
    return _no_weights(folder)


def only_numbered_training_state(folder: Path) -> str:
    (folder / "model.safetensors").unlink()
    for name in ("optimizer_0.bin", "scheduler_12.pt", "random_states_0.pkl", "rng_state_3.pth"):
        (folder / name).write_bytes(b"\x80\x04N.")
    return _no_weights(folder)


def only_a_ckpt(folder: Path) -> str:
    (folder / "model.safetensors").rename(folder / "last.ckpt")
    return _a_pickle(folder / "last.ckpt")


def weights_only_a_folder(folder: Path) -> str:
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()  # a folder by the weights' name holds no weights
    return _no_weights(folder)


def weights_and_an_index(folder: Path) -> str:
    _index(folder, {"layer.weight": "model.safetensors"})
    return (
        f"{folder} holds both model.safetensors and model.safetensors.index.json: which are the weights? "
        "Remove the one that is stale; nothing was staged"
    )


def weight_map_not_strings(folder: Path) -> str:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    index = _index(folder, {"layer.weight": "model-00001-of-00001.safetensors", "layer.bias": 1})
    return f"{index} has no weight_map of tensor names to files; nothing was staged"


def weight_map_a_list(folder: Path) -> str:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    index = _index(folder, ["model-00001-of-00001.safetensors"])
    return f"{index} has no weight_map of tensor names to files; nothing was staged"


def index_naming_a_file_outside(folder: Path) -> str:
    (folder / "model.safetensors").rename(folder.parent / "outside.safetensors")
    index = _index(folder, {"layer.weight": "../outside.safetensors", "layer.bias": "../outside.safetensors"})
    return (
        f"{index} names '../outside.safetensors', not a .safetensors file of the folder; nothing was staged"
    )


def index_naming_a_missing_shard(folder: Path) -> str:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = _index(
        folder,
        {
            "layer.weight": "model-00001-of-00002.safetensors",
            "layer.bias": "model-00002-of-00002.safetensors",
        },
    )
    return (
        f"{index} names model-00002-of-00002.safetensors, which is missing from {folder}; nothing was staged"
    )


def a_tensor_in_two_shards_the_index_names_last_first(folder: Path) -> str:
    """The shards are read in name order, whatever order the index names them in."""
    (folder / "model.safetensors").unlink()
    first, second = (folder / f"model-0000{i}-of-00002.safetensors" for i in (1, 2))
    save_file({"x": torch.zeros(1)}, first)
    save_file({"a": torch.zeros(1), "x": torch.ones(1)}, second)
    _index(folder, {"a": second.name, "x": first.name})
    return f"tensor x is listed twice, in {first} and {second}; nothing was staged"


def an_index_mapping_two_tensors_no_shard_holds(folder: Path) -> str:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    shard = "model-00001-of-00001.safetensors"
    index = _index(folder, {"layer.weight": shard, "layer.bias": shard, "layer.b": shard, "layer.a": shard})
    return f"{index} maps tensor layer.a to {shard}, which does not hold it; nothing was staged"


def _config(value: object) -> Callable[[Path], str]:
    def damage(folder: Path) -> str:
        (folder / "config.json").write_text(json.dumps(value))
        if isinstance(value, dict):
            return f"{folder}/config.json: architectures must be a list of Python class names; nothing was staged"
        return f"{folder}/config.json must hold a JSON object; nothing was staged"

    return damage


def a_file_not_a_folder(folder: Path) -> str:
    shutil.rmtree(folder)
    folder.write_text("{}")
    return f"--from-folder {folder} is not a folder"


def seal_not_an_object(folder: Path) -> str:
    (folder / "meta.json").write_text("[]")
    return f"{folder}/meta.json: not a pipeline.folder-seal/1 seal; nothing was staged"


REFUSED = [
    pytest.param(no_config, id="no-config"),
    pytest.param(fifos_at_the_top, id="fifos-at-the-top"),
    pytest.param(link_in_a_left_out_folder, id="link-in-a-left-out-folder"),
    pytest.param(a_socket_at_the_top, id="a-socket-at-the-top"),
    pytest.param(config_a_link_inside, id="config-a-link-inside"),
    pytest.param(a_dangling_link_at_the_top, id="a-dangling-link-at-the-top"),
    pytest.param(config_a_folder, id="config-a-folder"),
    pytest.param(config_empty, id="config-empty"),
    pytest.param(weights_empty, id="weights-empty"),
    pytest.param(only_a_pickle, id="only-a-pickle"),
    pytest.param(only_training_state, id="only-training-state"),
    pytest.param(only_numbered_training_state, id="only-numbered-training-state"),
    pytest.param(only_a_ckpt, id="only-a-ckpt"),
    pytest.param(weights_only_a_folder, id="weights-only-a-folder"),
    pytest.param(weights_and_an_index, id="weights-and-an-index"),
    pytest.param(_safetensors_files(3), id="three-safetensors"),
    pytest.param(_safetensors_files(4), id="four-safetensors"),
    pytest.param(weight_map_not_strings, id="weight-map-not-strings"),
    pytest.param(weight_map_a_list, id="weight-map-a-list"),
    pytest.param(index_naming_a_file_outside, id="index-naming-a-file-outside"),
    pytest.param(index_naming_a_missing_shard, id="index-naming-a-missing-shard"),
    pytest.param(a_tensor_in_two_shards_the_index_names_last_first, id="a-tensor-in-two-shards"),
    pytest.param(an_index_mapping_two_tensors_no_shard_holds, id="two-tensors-no-shard-holds"),
    pytest.param(_config({"architectures": []}), id="architectures-empty"),
    pytest.param(
        _config({"architectures": "LlamaForCausalLM", "model_type": "llama"}), id="architectures-a-string"
    ),
    pytest.param(_config(["not", "an", "object"]), id="config-a-list"),
    pytest.param(seal_not_an_object, id="seal-a-list"),
    pytest.param(a_file_not_a_folder, id="a-file-not-a-folder"),
]


@pytest.fixture(scope="module")
def earlier_stage(tmp_path_factory) -> Path:
    """A stage 05 built from a folder, staged once: each test replaces a copy of it."""
    parent = tmp_path_factory.mktemp("earlier")
    stage(tiny_folder(parent / "model"), parent / "stage")
    return parent / "stage"


@pytest.mark.parametrize("damage", REFUSED)
def test_each_refusal_of_a_folder_is_its_exact_line_and_leaves_folder_and_stage_as_they_were(
    tmp_path, earlier_stage, damage
):
    folder = tiny_folder(tmp_path / "model")
    target = Path(shutil.copytree(earlier_stage, tmp_path / "stage"))
    staged_before = _tree(target)
    expected = damage(folder)
    folder_before = _tree(folder)
    with pytest.raises(StageError) as refused:
        stage(folder, target)
    assert str(refused.value) == expected
    assert _tree(folder) == folder_before and _tree(target) == staged_before
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "content, why",
    [
        (None, "{path} not found"),
        ("[1, 2]", "{path} must hold a JSON object; nothing was staged"),
        (
            '{"": 1.0}',
            "{path}: '' must be a short metric name with a number, as Trainer.evaluate() returns them",
        ),
        ('{"eval_\\tloss": 1.0}', "{path}: 'eval_\\x09loss' must be a short metric name with a number, as "),
        (
            '{"' + "m" * 101 + '": 1.0}',
            "{path}: '" + "m" * 101 + "' must be a short metric name with a number",
        ),
    ],
    ids=["missing", "a-list", "empty-name", "tab-in-name", "name-of-101"],
)
def test_bad_metrics_are_refused_before_the_folder_is_even_surveyed(tmp_path, content, why):
    """--metrics is read first: a typo in its path costs no copy of the weights (here the folder,
    with no config.json, would be refused too, later)."""
    folder = tiny_folder(tmp_path / "model")
    (folder / "config.json").unlink()
    metrics = tmp_path / "eval.json"
    if content is not None:
        metrics.write_text(content)
    with pytest.raises(StageError) as refused:
        stage(folder, tmp_path / "stage", metrics=metrics)
    message = str(refused.value)
    expected = why.format(path=metrics)
    assert message.startswith(expected if content and content.startswith("[") else f"--metrics {expected}")
    assert message.endswith(("returns them", "not found", "nothing was staged")), message
    assert not (tmp_path / "stage").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_a_metrics_file_in_another_encoding_than_utf8_is_refused_not_decoded(tmp_path, encoding):
    """--metrics is read as UTF-8 only, as every JSON file the pipeline reads: a UTF-16 or UTF-32
    file (which json alone would detect and decode) is refused, not guessed at."""
    folder = tiny_folder(tmp_path / "model")
    metrics = tmp_path / "eval.json"
    metrics.write_bytes(json.dumps({"eval_loss": 0.5}).encode(encoding))
    with pytest.raises(StageError) as refused:
        stage(folder, tmp_path / "stage", metrics=metrics)
    assert str(refused.value) == f"{metrics} is not valid JSON (not UTF-8); nothing was staged"
    assert not (tmp_path / "stage").exists() and leftovers(tmp_path) == []


def test_a_metrics_path_that_cannot_be_opened_is_the_open_error_not_a_missing_file(tmp_path, monkeypatch):
    """Only a missing --metrics file is "not found": a path the open refuses for another reason
    (a link loop, a socket; as root a permission never does) is that error, which the command
    line prints as it is."""
    folder = tiny_folder(tmp_path / "model")
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop.name)
    sock = socket_at(tmp_path / "s.json", monkeypatch)
    for path, code in ((loop, errno.ELOOP), (sock, errno.ENXIO)):
        with pytest.raises(OSError) as refused:
            stage(folder, tmp_path / "stage", metrics=path)
        assert str(refused.value) == f"[Errno {code}] {os.strerror(code)}: {str(path)!r}"
    assert not (tmp_path / "stage").exists() and leftovers(tmp_path) == []


def test_a_metrics_file_of_exactly_1_mib_is_read_and_one_byte_more_is_refused(tmp_path):
    """The --metrics bound is inclusive: a file of exactly 1 MiB is read (the folder, with no
    config.json, is then what is refused); a byte more is refused as over the limit."""
    folder = tiny_folder(tmp_path / "model")
    (folder / "config.json").unlink()
    metrics = tmp_path / "eval.json"
    body = '{"accuracy": 0.5}'
    for size, refusal in [
        (
            1 << 20,
            f"{folder} has no config.json: the Hub's tools need one beside the weights (save_pretrained writes "
            "it); nothing was staged",
        ),
        ((1 << 20) + 1, f"--metrics {metrics} is 1,048,577 bytes, over the 1,048,576-byte limit"),
    ]:
        metrics.write_text(body + " " * (size - len(body)))
        with pytest.raises(StageError) as refused:
            stage(folder, tmp_path / "stage", metrics=metrics)
        assert str(refused.value) == refusal
    assert not (tmp_path / "stage").exists() and leftovers(tmp_path) == []


def test_a_bad_max_shard_size_is_refused_before_the_folder_is_even_surveyed(tmp_path):
    from pipeline.errors import ConfigError

    folder = tiny_folder(tmp_path / "model")
    (folder / "config.json").unlink()  # refused too, later
    with pytest.raises(ConfigError) as refused:
        stage(folder, tmp_path / "stage", max_shard_size="0GB")
    assert (
        str(refused.value) == "--max-shard-size '0GB': expected a positive size such as 5GB, 500MB or 1048576"
    )
    assert not (tmp_path / "stage").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "where",
    ["stage-inside-the-folder", "stage-is-the-folder", "folder-inside-the-stage", "stage-through-a-link"],
)
def test_a_stage_overlapping_its_folder_is_refused_and_nothing_is_written_into_either(tmp_path, where):
    """Not even the stage's lock file: nothing is ever written into the folder being staged."""
    target = tmp_path / "stage"
    if where == "folder-inside-the-stage":
        stage(tiny_folder(tmp_path / "earlier"), target)
        folder = tiny_folder(target / "model")
    else:
        folder = tiny_folder(tmp_path / "model")
        target = folder / "stage" if where == "stage-inside-the-folder" else folder
        if where == "stage-through-a-link":
            (tmp_path / "link").symlink_to(folder)
            target = tmp_path / "link" / "stage"
    before = _tree(tmp_path)
    with pytest.raises(StageError) as refused:
        stage(folder, target)
    assert str(refused.value) == (
        f"the stage {target} and the folder {folder} overlap: pass a --stage outside it; nothing was staged"
    )
    assert _tree(tmp_path) == before


def test_the_record_and_report_of_a_staged_folder_say_exactly_what_was_read_and_how(tmp_path):
    import hashlib

    from pipeline.audit import STAGE_SCHEMA

    folder = tiny_folder(tmp_path / "model")
    (folder / "runs").mkdir()
    (folder / "runs" / "log.txt").write_text("left out")
    (folder / "notes.txt").write_text("left out")
    seal_checkpoint(folder, step=7)
    metrics = tmp_path / "eval.json"
    long_name = "m" * 100  # as long as a metric name may be
    metrics.write_text(json.dumps({long_name: 2, "eval_loss": 0.5}))
    os.chmod(folder / "model.safetensors", 0o644)  # safetensors writes 0600
    os.chmod(folder / "tokenizer.json", 0o600)  # a private carried file: the weights stay as open as theirs
    target = tmp_path / "stage"
    umask = os.umask(0o022)
    try:
        (tmp_path / "latest").symlink_to(folder)  # a folder given through a link is the folder it names
        result = stage(tmp_path / "latest", target, metrics=metrics, repo_id="you/tiny-net")
    finally:
        os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in target.iterdir()}
    assert (modes["model.safetensors"], modes["tokenizer.json"], modes["config.json"]) == (
        0o644,
        0o600,
        0o644,
    )
    meta = json.loads((target / "meta.json").read_text())
    read = {
        name: {
            "sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest(),
            "size": (folder / name).stat().st_size,
        }
        for name in ("config.json", "model.safetensors", "tokenizer.json")
    }
    assert {key: meta[key] for key in meta if key not in ("config", "files")} == {
        "schema": STAGE_SCHEMA,
        "step": 7,
        "model": {"num_parameters": 20},
        "export": {
            "transformers": False,
            "architecture": None,
            "weights": ["model.safetensors"],
            "renamed": {},
            "total_size": 80,
        },
        "repo_id": "you/tiny-net",
        "metrics": {"split": None, "values": {"eval_loss": 0.5, long_name: 2}, "supplied": "eval.json"},
        "source_checkpoint": {
            "folder": "model",
            "kind": "folder",
            "sealed": True,
            "files": read,
            "left_out": ["notes.txt", "runs/"],
        },
        "checks": {"nonfinite_tensors": []},
        "proof": None,
    }
    assert list(meta["metrics"]["values"]) == ["eval_loss", long_name]
    card = (target / "README.md").read_text(encoding="utf-8")
    assert card.index("| `eval_loss` | 0.5 |") < card.index(f"| `{long_name}` | 2 |")  # sorted by name
    assert list(meta["source_checkpoint"]["files"]) == sorted(read)
    table = "".join(
        f"| `{name}` | {entry['size']:,} | `{entry['sha256']}` |\n" for name, entry in read.items()
    )
    assert (
        f"| file | bytes | SHA-256 |\n| --- | ---: | --- |\n{table}\nLeft out, never opened: `notes.txt`, `runs/`."
        in card
    )
    assert meta["config"]["model"] == {"name": "tiny-net"}
    assert set(meta["files"]) == {
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    }
    assert (result.step, result.source, result.with_metrics, result.nonfinite, result.warnings) == (
        7,
        folder,
        True,
        [],
        [],
    )
    rows = [(row.name, row.size, row.sha256, row.verified_against) for row in result.report[:3]]
    assert rows == [
        (f"{folder}/{name}", entry["size"], entry["sha256"], "its seal, re-hashed while copied")
        for name, entry in read.items()
    ]
    notes = {row.name: row.verified_against for row in result.report[3:]}
    assert notes["meta.json"] == "MANIFEST.sha256, its own files table"
    assert notes["MANIFEST.sha256"] == "lists every other staged file"
    (folder / "meta.json").unlink()
    unsealed = stage(folder, target)
    meta = json.loads((target / "meta.json").read_text())
    assert meta["step"] is None and unsealed.step is None and meta["source_checkpoint"]["sealed"] is False
    assert meta["metrics"] is None and meta["repo_id"] is None and unsealed.with_metrics is False
    assert meta["config"]["model"] == {"name": "model"}
    assert {row.verified_against for row in unsealed.report[:3]} == {"hashed while copied (no seal)"}


def test_a_staged_folders_record_names_its_card_sections_file_relative_never_by_its_local_path(
    tmp_path, monkeypatch
):
    """meta.json is published: the config's card.sections, given as an absolute path, is
    recorded relative to the folder 05 ran in."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "card.md").write_text("## Intended use\n\nTeaching.\n")
    target = tmp_path / "stage"
    config = from_folder.folder_config({"card.sections": str(tmp_path / "card.md")})
    from_folder.stage_folder(
        config, from_folder.FolderStage(folder=tiny_folder(tmp_path / "model"), stage_dir=target)
    )
    assert json.loads((target / "meta.json").read_text())["config"]["card"]["sections"] == "card.md"
    assert str(tmp_path) not in (target / "meta.json").read_text()


def test_sharded_weights_holding_nan_are_refused_naming_the_index_the_first_tensor_and_how_many_more(
    tmp_path,
):
    folder = sharded_tiny_folder(tmp_path / "model")
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        tensors = {name: torch.full_like(t, float("nan")) for name, t in load_file(folder / shard).items()}
        save_file(tensors, folder / shard)
    with pytest.raises(StageError) as refused:
        stage(folder, tmp_path / "stage")
    assert str(refused.value) == (
        f"{folder}/model.safetensors.index.json: tensor layer.bias (and 1 more) holds NaN or infinite values; "
        "refusing to stage it (pass --allow-nonfinite to stage it anyway)"
    )
    assert not (tmp_path / "stage").exists() and leftovers(tmp_path) == []
    result = stage(folder, tmp_path / "stage", allow_nonfinite=True)
    assert result.nonfinite == ["layer.bias", "layer.weight"]
    meta = json.loads((tmp_path / "stage" / "meta.json").read_text())
    assert meta["checks"]["nonfinite_tensors"] == ["layer.bias", "layer.weight"]
