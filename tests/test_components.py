"""The training state's components are one table (pipeline.checkpoint.components): a component
registered here, as a user's would be, is saved, checked, restored and left out by the
single-process and the distributed checkpointers alike, and script 03 runs its control."""

from __future__ import annotations

import json
from pathlib import Path

import component_factories as dummy
import pytest
import torch
from test_distributed import torchrun

from pipeline.checkpoint import Component, component_names, load_checkpoint, read_tensors, register_component
from pipeline.config import load_config
from pipeline.errors import StateMismatch
from pipeline.layout import STATE_FILE
from pipeline.proof.distributed import dist_controls
from pipeline.proof.plan import Plan, controls, make_legs
from pipeline.train import TrainingHooks, train

from support import HELPERS, REPO

CONFIG = REPO / "config.yaml"


@pytest.fixture
def registered():
    dummy.register()
    try:
        yield
    finally:
        dummy.unregister()


def _config(data_dir: Path, folder: Path, **overrides):
    return load_config(
        CONFIG,
        {
            "data.dir": str(data_dir),
            "checkpoint.dir": str(folder / "ck"),
            "training.max_steps": 6,
            "checkpoint.every": 2,
            **overrides,
        },
    )


def _restored(folder: Path, rank: int = 0) -> dict:
    return json.loads(dummy.restored_path(folder / "ck", rank).read_text())


def test_a_registered_component_round_trips_through_a_single_process_checkpoint(
    registered, data_dir, tmp_path
):
    config = _config(data_dir, tmp_path)
    cut = train(config, stop_at=4, progress=False)
    meta = json.loads((cut.checkpoint / "meta.json").read_text())
    saved = meta["training_state"][dummy.NAME]
    assert saved["step"] == 4 and saved["label"] == "dummy", saved
    total = read_tensors(cut.checkpoint / STATE_FILE)[f"{dummy.NAME}/total"]
    assert total.tolist() == [sum(cut.history["loss"])]  # bitwise: the losses' own float64 sum
    resumed = train(config, resume="latest", progress=False)
    assert _restored(tmp_path) == {"total": total.tolist(), "step": 4, "label": "dummy"}
    assert resumed.step == 6
    # The load of any checkpoint (stage, evaluate) reads it like the built-in components.
    assert load_checkpoint(resumed.checkpoint).meta["training_state"][dummy.NAME]["step"] == 6


def test_the_tasks_own_state_is_saved_with_the_data_and_given_back_on_resume(data_dir, tmp_path):
    """A task data object with a ``state_dict`` of its own (a loss weight that grows with every
    loss computed): a checkpoint holds it, a resume gives it back, and the resumed run trains on
    the losses of the uninterrupted one, bit for bit."""
    stateful = {"data.factory": "component_factories:build_stateful_data"}
    full = train(_config(data_dir, tmp_path / "full", **stateful), progress=False)
    config = _config(data_dir, tmp_path / "cut", **stateful)
    cut = train(config, stop_at=4, progress=False)
    saved = json.loads((cut.checkpoint / "meta.json").read_text())["training_state"]["data"]["task"]
    assert saved["calls"] == 4, saved
    weight = read_tensors(cut.checkpoint / STATE_FILE)["data/task/weight"]
    assert weight.tolist() == [1.0625**4]
    resumed = train(config, resume="latest", progress=False)
    assert resumed.step == 6 and resumed.history["loss"] == full.history["loss"]
    final = read_tensors(resumed.checkpoint / STATE_FILE)["data/task/weight"]
    assert (
        final.tolist()
        == [1.0625**6]
        == read_tensors(full.checkpoint / STATE_FILE)["data/task/weight"].tolist()
    )


def test_a_registered_component_is_left_out_by_name_and_refused_when_it_does_not_fit(
    registered, data_dir, tmp_path
):
    config = _config(data_dir, tmp_path)
    train(config, stop_at=4, progress=False)
    assert dummy.NAME in component_names()
    train(config, resume="latest", stop_at=5, progress=False, hooks=TrainingHooks(skip_restore=(dummy.NAME,)))
    assert not dummy.restored_path(tmp_path / "ck", 0).exists()
    # The component changed since the checkpoint (its step became a float): refused before
    # anything is set, naming the field.
    dummy.unregister()
    register_component(dummy.component(live=lambda run: {**dummy.live(run), "step": float(run.step)}))
    with pytest.raises(
        StateMismatch, match=rf"training_state\.{dummy.NAME}\.step is 5, expected a finite number"
    ):
        train(config, resume="latest", progress=False)
    # A checkpoint without it (written before it was registered) does not hold this run's state.
    dummy.unregister()
    train(_config(data_dir, tmp_path / "without"), stop_at=2, progress=False)
    dummy.register()
    with pytest.raises(StateMismatch, match=rf"does not hold exactly .*{dummy.NAME}"):
        train(_config(data_dir, tmp_path / "without"), resume="latest", progress=False)


def test_a_registered_components_tensor_saved_in_another_dtype_is_refused_before_anything_is_set(
    registered, data_dir, tmp_path
):
    """The component now computes its sum in float32; the checkpoint holds it in float64. A
    resume that took it would train on in the wrong dtype: refused in one line naming the
    field and the dtype this run expects, and the component is given nothing."""
    config = _config(data_dir, tmp_path)
    train(config, stop_at=4, progress=False)
    dummy.unregister()
    register_component(dummy.component(live=lambda run: {**dummy.live(run), "total": torch.zeros(1)}))
    with pytest.raises(
        StateMismatch,
        match=rf"training_state\.{dummy.NAME}\.total is not a torch\.float32 tensor of shape \(1,\)",
    ):
        train(config, resume="latest", progress=False)
    assert not dummy.restored_path(tmp_path / "ck", 0).exists()


def test_registering_refuses_a_name_taken_a_reserved_one_and_per_rank_state(registered):
    for name in ("rng", "progress", dummy.NAME):
        with pytest.raises(ValueError, match="exists already"):
            register_component(dummy.component(name=name))
    with pytest.raises(ValueError, match="per_rank"):
        register_component(dummy.component(name="other", per_rank=True))
    assert isinstance(dummy.component(), Component)


def test_script_03_runs_a_control_for_a_registered_component(registered, data_dir, tmp_path):
    config = _config(data_dir, tmp_path)
    assert controls(config) == ("rng", "optimizer", "scheduler", "data", dummy.NAME)
    legs = make_legs(Plan(steps=10, cut=5, reason="", epochs=None), config)
    omitted = {leg.name: leg.omit for leg in legs}
    assert omitted[f"omit-{dummy.NAME}"] == (dummy.NAME,)
    assert (f"omit-{dummy.NAME}", dummy.NAME, (dummy.NAME,), False) in dist_controls(config)
    # fp16 AMP adds the scaler's control; without a GradScaler there is none to leave out.
    assert "scaler" in controls(_config(data_dir, tmp_path, **{"training.amp": "fp16"}))


def test_a_registered_component_round_trips_through_a_distributed_checkpoint(data_dir, tmp_path):
    """Two ranks (DDP over gloo), registered on each: saved once by rank 0 with the state the
    ranks share, restored on every rank."""
    base = {"data.dir": str(data_dir), "training.parallel": "ddp", "checkpoint.dir": str(tmp_path / "ck")}
    base.update({"training.max_steps": 6, "checkpoint.every": 2, "checkpoint.keep_last": 5})
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps(
            {
                "config": str(CONFIG),
                "results": str(tmp_path / "results.json"),
                "register": "component_factories:register",
                "runs": [{"overrides": base, "stop_at": 4}, {"overrides": base, "resume": "latest"}],
            }
        )
    )
    result = torchrun(2, str(HELPERS / "dist_leg.py"), str(plan), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    cut, resumed = json.loads((tmp_path / "results.json").read_text())
    assert "error" not in cut and "error" not in resumed, (cut, resumed)
    folder = Path(cut["checkpoint"])
    meta = load_checkpoint(folder).meta  # verified: every file hashed, the shards covered
    assert meta["parallel"]["world_size"] == 2 and meta["training_state"][dummy.NAME]["step"] == 4
    total = read_tensors(folder / STATE_FILE)[f"{dummy.NAME}/total"]
    assert total.dtype == torch.float64 and total.tolist() == [sum(cut["loss"])]
    for rank in range(2):
        assert _restored(tmp_path, rank) == {"total": total.tolist(), "step": 4, "label": "dummy"}
    assert resumed["step"] == 6
