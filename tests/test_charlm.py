"""The character-level LM example (examples/charlm) through the real scripts, on a short run.

A tiny version of the same code paths (2 layers of width 32, 3000 bytes of text, 10 steps):
the tied embedding is stored once and loads strictly with safetensors alone, the card shows
the curve and a deterministic sample, the checkpoint holds the short batch at the end of an
epoch and the task's own offset generator, and scripts/03 proves the resume exact. Also:
the example's data prepared inside the default data folder (data/charlm/ in data/) leaves
both verifiable.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_model

from pipeline.checkpoint import load_model_weights, read_tensors
from pipeline.config import load_config, parse_set_overrides
from pipeline.errors import ConfigError

from support import REPO, run_script, script_env

CONFIG = REPO / "examples" / "charlm" / "config.yaml"
# The scripts import `examples.charlm` from their working folder; this process needs the same.
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))
# 3000 bytes -> 2700 training bytes -> 2700 // 32 - 1 = 83 windows: 5 batches of 16 and one of 3.
WINDOWS, BATCH = 83, 16
TINY = {
    "data.params.max_chars": "3000",
    "data.params.block_size": "32",
    "data.params.sample_chars": "60",
    "data.batch_size": str(BATCH),
    "model.params.d_model": "32",
    "model.params.n_layer": "2",
    "model.params.n_head": "2",
    "training.max_steps": "10",
    "scheduler.params.warmup_steps": "3",
}


def _set_args(overrides: dict[str, str]) -> list[str]:
    return [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]


def _config(overrides: dict[str, str]):
    return load_config(CONFIG, parse_set_overrides([f"{k}={v}" for k, v in overrides.items()]))


def _run(name: str, *args: str):
    # cwd is the repository: `examples.charlm` imports from the working folder, as for a user.
    # One thread per process: the tiny model gains nothing from two, and 03 runs legs side by side.
    return run_script(name, "--config", str(CONFIG), *args, env=script_env(OMP_NUM_THREADS="1"))


def _ok(name: str, *args: str) -> str:
    result = _run(name, *args)
    assert result.returncode == 0, f"{name} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("charlm")
    overrides = {**TINY, "data.dir": str(root / "data"), "checkpoint.dir": str(root / "checkpoints")}
    args = _set_args(overrides)
    _ok("01_prepare_data.py", *args)
    _ok("02_train.py", *args, "--quiet")
    _ok("04_evaluate.py", *args, "--output", str(root / "metrics.json"))
    _ok("05_stage.py", *args, "--metrics", str(root / "metrics.json"), "--stage", str(root / "stage"))
    checkpoint = root / "checkpoints" / "step-00000010"
    assert (checkpoint / "meta.json").is_file()
    return {"root": root, "overrides": overrides, "args": args, "checkpoint": checkpoint,
            "stage": root / "stage", "config": _config(overrides)}


def _fresh_model(config):
    from examples.charlm.model import build_model

    return build_model(config)


def _probe_ids(config) -> torch.Tensor:
    block = config.data.params["block_size"]
    return torch.arange(2 * block, dtype=torch.int64).remainder(97).add(32).view(2, block)


def test_published_weights_hold_the_tied_embedding_once_and_load_strictly_with_safetensors(short_run):
    path = short_run["stage"] / "modelo.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        names = set(handle.keys())
    model = _fresh_model(short_run["config"])
    assert model.head.weight is model.embed.weight
    assert len(names) == len(model.state_dict()) - 1, "the tied tensor must be stored exactly once"
    assert len(names & {"embed.weight", "head.weight"}) == 1

    model.eval()
    with torch.no_grad():
        untrained_logits = model(_probe_ids(short_run["config"]))
    missing, unexpected = load_model(model, str(path), strict=True)
    assert not missing and not unexpected
    # Loading copies into the one shared Parameter: the tie survives the round trip.
    assert model.head.weight is model.embed.weight

    reference = _fresh_model(short_run["config"])
    load_model_weights(reference, read_tensors(short_run["checkpoint"] / "modelo.safetensors"))
    reference.eval()
    with torch.no_grad():
        logits = model(_probe_ids(short_run["config"]))
        assert torch.equal(logits, reference(_probe_ids(short_run["config"])))
        assert not torch.equal(logits, untrained_logits), "the published weights are the trained ones"


def test_card_shows_the_training_curve_and_the_sample_that_the_weights_generate(short_run):
    stage = short_run["stage"]
    card = (stage / "README.md").read_text(encoding="utf-8")
    assert (stage / "training_curve.png").read_bytes().startswith(b"\x89PNG")
    assert "training_curve.png" in card
    recorded = json.loads((short_run["root"] / "metrics.json").read_text(encoding="utf-8"))
    assert set(recorded["metrics"]) == {"loss", "bits_per_char"}
    sample = recorded["sample"]
    assert sample.startswith("HAMLET:\n") and len(sample) > len("HAMLET:\n")
    assert "## Sample" in card and sample[len("HAMLET:\n"):].strip() in card

    # The same text again, in this process: sample() depends on the weights alone, and
    # leaves the run's RNGs and the model's mode as it found them.
    from examples.charlm.data import build_data

    config = short_run["config"]
    model = _fresh_model(config)
    load_model(model, str(stage / "modelo.safetensors"), strict=True)
    data = build_data(config, Path(config.data.dir))
    before = (random.getstate(), np.random.get_state(legacy=False)["state"]["key"].tobytes(), torch.get_rng_state())
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the 04 process: the same kernels, so the same rounding
    try:
        assert data.sample(model, torch.device("cpu")) == sample
    finally:
        torch.set_num_threads(threads)
    assert model.training
    after = (random.getstate(), np.random.get_state(legacy=False)["state"]["key"].tobytes(), torch.get_rng_state())
    assert before[:2] == after[:2] and torch.equal(before[2], after[2])


def test_checkpoint_holds_the_short_epoch_end_param_groups_schedule_and_offset_generator(short_run):
    meta = json.loads((short_run["checkpoint"] / "meta.json").read_text(encoding="utf-8"))
    state = meta["training_state"]
    sampler = state["data"]["sampler"]
    # Epoch 0 = 5 full batches + a short one of 3; steps 7-10 are 4 full batches of epoch 1.
    assert (sampler["epoch"], sampler["cursor"], sampler["num_rows"]) == (1, 4 * BATCH, WINDOWS)
    assert sampler["samples_seen"] == WINDOWS + 4 * BATCH
    offset_rng = state["data"]["task"]["offset_rng"]
    assert offset_rng["bit_generator"] == "PCG64" and isinstance(offset_rng["state"]["state"], int)
    groups = state["optimizer"]["param_groups"]
    assert [group["weight_decay"] for group in groups] == [0.1, 0.0]
    assert state["scheduler"]["last_epoch"] == 10
    assert meta["model"]["tied"] == ["head.weight"] or meta["model"]["tied"] == ["embed.weight"]


def test_resume_proof_passes_on_a_short_run_with_an_epoch_boundary_after_the_cut(short_run, tmp_path):
    output = tmp_path / "proof"
    result = _run("03_verify_resume.py", *short_run["args"], "--output", str(output))
    assert result.returncode == 0, f"03 exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    report = json.loads((output / "verification.json").read_text(encoding="utf-8"))
    assert report["all_checks_passed"] and report["positive"] and report["negative_divergence_detected"]
    assert report["boundary"]["first_step_of_a_new_epoch_after_cut"] is not None
    negative = report["components"]["negative"]
    # Leaving out the data state (sampler position and the offset generator) must show.
    for component in ("rng", "optimizer", "scheduler", "data"):
        assert negative[component]["result"] == "detected", (component, negative[component])


@pytest.mark.parametrize(("overrides", "message"), [
    ({"model.params.n_head": "3"}, "model.params.d_model (128) must be a multiple of model.params.n_head (3)"),
    ({"model.params.depth": "2"}, "unknown key model.params.depth"),
    ({"data.params.block_size": "0"}, "data.params.block_size must be >= 1"),
    ({"data.params.sample_temperature": "0"}, "data.params.sample_temperature must be > 0"),
])
def test_example_params_are_validated_with_the_key_named(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _fresh_model(_config(overrides))


def test_example_data_prepared_inside_the_default_data_folder_leaves_both_verifiable(tmp_path):
    from pipeline.data import load_manifest, prepare_data
    from pipeline.errors import DataError

    default = load_config(REPO / "config.yaml", {"data.dir": str(tmp_path / "data")})
    example = _config({**TINY, "data.dir": str(tmp_path / "data" / "charlm")})
    prepare_data(default)
    prepare_data(example)
    # A preparation that died half-way leaves its staging folder beside the target.
    (tmp_path / "data" / ".tmp-charlm-0badf00d").mkdir()
    (tmp_path / "data" / ".tmp-charlm-0badf00d" / "train.safetensors").write_bytes(b"partial")
    assert load_manifest(default)["fingerprint"] != load_manifest(example)["fingerprint"]
    # Files of the default data set itself are still all checked.
    (tmp_path / "data" / "extra.bin").write_bytes(b"x")
    with pytest.raises(DataError, match="extra.bin added or missing"):
        load_manifest(default)
