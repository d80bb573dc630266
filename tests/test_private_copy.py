"""The stage reads the weights from the private copy it verified, never from the checkpoint
folder, which anyone may change after the check (docs/stage.md, "What 05 checks")."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file

import pipeline.stage.build as build
from pipeline.config import load_config
from pipeline.stage import build_stage

from support import REPO


def _nan_the_data_in_place(path) -> None:
    """Every float64 of a safetensors file made NaN, in place (same inode, same size): staged,
    they would differ from the verified ones, or be refused as non-finite."""
    with open(path, "r+b") as handle:
        (header,) = struct.unpack("<Q", handle.read(8))
        size = path.stat().st_size - 8 - header
        handle.seek(8 + header)
        handle.write(struct.pack("<d", float("nan")) * (size // 8))


@pytest.mark.parametrize("max_shard_size", ["50GB", "500"], ids=["copied-file", "rewritten-shards"])
def test_weights_changed_in_the_checkpoint_after_the_copy_do_not_reach_the_stage(
    trained_run, run_copy, monkeypatch, max_shard_size
):
    """The checkpoint's modelo.safetensors is overwritten in place once its copy was verified
    and the weights checked (right before the stage's files are written): the stage still
    holds the verified tensors, whether it moves the copy in or rewrites them into shards."""
    run = run_copy(trained_run)
    source = run.checkpoint / "modelo.safetensors"
    verified = {name: tensor.clone() for name, tensor in load_file(source).items()}
    monkeypatch.chdir(run.root)
    real = build.inspect_model

    def tamper_then_inspect(*args, **kwargs):
        _nan_the_data_in_place(source)
        return real(*args, **kwargs)

    monkeypatch.setattr(build, "inspect_model", tamper_then_inspect)
    config = load_config(REPO / "config.yaml", run.overrides)
    result = build_stage(config, stage_dir=run.root / "st", with_metrics=False, max_shard_size=max_shard_size)
    assert result.nonfinite == []
    assert all(load_file(source)[name].isnan().all() for name in verified), "the checkpoint was overwritten"
    files = json.loads((result.stage / "meta.json").read_text())["export"]["weights"]
    assert (len(files) > 1) == (max_shard_size == "500"), files
    staged = {name: tensor for file in files for name, tensor in load_file(result.stage / file).items()}
    assert staged.keys() == verified.keys()
    assert all(torch.equal(staged[name], verified[name]) for name in verified), (
        "staged bytes that were not verified"
    )
