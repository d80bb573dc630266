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

from pipeline.checkpoint import (
    Component,
    component_names,
    load_checkpoint,
    read_tensors,
    register_component,
    unregister_component,
)
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
    for name in ("rng", "model", "progress", "history", dummy.NAME):
        with pytest.raises(ValueError) as refused:
            register_component(dummy.component(name=name))
        assert str(refused.value) == f"a training-state component named {name!r} exists already"
    with pytest.raises(ValueError, match="per_rank"):
        register_component(dummy.component(name="other", per_rank=True))
    with pytest.raises(ValueError) as refused:
        register_component(dummy.component(name="my/ema"))  # its tensors' prefix, a meta.json key
    assert str(refused.value) == "a component's name is a plain identifier (got 'my/ema')"
    with pytest.raises(ValueError) as refused:
        unregister_component("optimizer")
    assert str(refused.value) == "'optimizer' is a built-in component of the training state"
    assert "my/ema" not in component_names() and "optimizer" in component_names()
    assert isinstance(dummy.component(), Component)


def test_hooks_refuse_to_leave_out_a_component_no_run_has():
    """The proof's controls name components: a misspelt one would restore everything and
    prove nothing, so it is refused naming it and the names there are."""
    assert TrainingHooks(skip_restore=("optimizer", "rng")).skip_restore == ("optimizer", "rng")
    with pytest.raises(ValueError) as refused:
        TrainingHooks(skip_restore=("optimizer", "rngs"))
    assert str(refused.value) == (
        "skip_restore names unknown components ['rngs']; choose from "
        "('rng', 'optimizer', 'scheduler', 'data', 'scaler', 'callbacks')"
    )


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


def _refusal(where: str, why: str) -> str:
    from pipeline.errors import SEALED_BUT_UNFIT

    return f"training_state.{where} {why}: {SEALED_BUT_UNFIT}"


LIKE = {
    # (saved, the fresh run's value, why it is refused or None where it fits[, the field
    # named when it is not the top one])
    "a bool for a bool": (False, True, None),
    "an int for a bool": (1, True, "is 1, expected a bool"),
    "a str for a str": ("b", "a", None),
    "an int for a str": (1, "a", "is 1, expected a str"),
    "an int for an int": (4, 3, None),
    "a bool for an int": (True, 3, "is True, expected an integer"),
    "a float for an int": (3.0, 3, "is 3.0, expected an integer"),
    "a float for a float": (2.5, 1.0, None),
    "an int for a float": (1, 1.0, "is 1, expected a finite number"),
    "nan for a float": (float("nan"), 1.0, "is nan, expected a finite number"),
    "-inf for a float": (float("-inf"), 1.0, "is -inf, expected a finite number"),
    "inf where the fresh value is inf": (float("inf"), float("inf"), None),
    "a list of as many": ([1.5, 2.0], [0.5, 1.0], None),
    "a list one longer": ([1.0, 1.0], [1.0], "is not a list of 1 items"),
    "a list one shorter": ([], [1.0], "is not a list of 1 items"),
    "a tuple for a list": ((1.0,), [1.0], "is not a list of 1 items"),
    "a list for a tuple": ([0.9, 0.99], (0.9, 0.99), "is not a tuple of 2 items"),
    "an item of a list": ([1.0, float("nan")], [1.0, 1.0], "is nan, expected a finite number", "w[1]"),
    "a dict of the same fields": ({"b": 2, "a": 1}, {"a": 0, "b": 0}, None),
    "a dict with a field more": (
        {"a": 1, "z": 2, "y": 3, "x": 4, "w": 5},
        {"a": 1},
        "does not have the expected fields (differs at ['w', 'x', 'y'])",
    ),
    "a dict with a field less": ({}, {"a": 1}, "does not have the expected fields (differs at ['a'])"),
    "a list for a dict": ([1], {"a": 1}, "does not have the expected fields"),
    "a field of a dict": ({"a": {"b": "1"}}, {"a": {"b": 1}}, "is '1', expected an integer", "w.a.b"),
    "an equal tensor": (torch.ones(2, 3), torch.zeros(2, 3), None),
    "a float64 tensor for a float32": (
        torch.zeros(2, 3, dtype=torch.float64),
        torch.zeros(2, 3),
        "is not a torch.float32 tensor of shape (2, 3)",
    ),
    "a tensor of another shape": (
        torch.zeros(3, 2),
        torch.zeros(2, 3),
        "is not a torch.float32 tensor of shape (2, 3)",
    ),
    "a list for a tensor": ([0.0] * 6, torch.zeros(2, 3), "is not a torch.float32 tensor of shape (2, 3)"),
    "anything where the fresh value is None": ({"x": [1]}, None, None),
}


@pytest.mark.parametrize("case", sorted(LIKE))
def test_like_refuses_a_saved_value_of_another_structure_type_or_a_non_finite_float_naming_where(case):
    """The default check of a registered component (and of the built-in ones' fields): the
    saved tree has the fresh one's structure and types, its floats finite where the fresh ones
    are; a refusal is one line naming the field, what it is, and the fix."""
    from pipeline.checkpoint.components import like

    saved, live, why, *inner = LIKE[case]
    if why is None:
        like(saved, live, "w")
        return
    with pytest.raises(StateMismatch) as refused:
        like(saved, live, "w")
    assert str(refused.value) == _refusal(inner[0] if inner else "w", why), str(refused.value)


def _with(tree: dict, path: tuple, value) -> dict:
    """A deep copy of ``tree`` with the item at ``path`` (keys and indexes) set to ``value``."""
    import copy

    tree = copy.deepcopy(tree)
    *parents, last = path
    inner = tree
    for key in parents:
        inner = inner[key]
    inner[last] = value
    return tree


def test_the_built_in_components_refuse_a_saved_state_that_does_not_fit_the_fresh_run_naming_it(tmp_path):
    """Each built-in component's check, given a saved state as a checkpoint's would come back
    (the live state of a real run whose Adam took one step, then edited): the state as it is
    passes; each edit is refused in one line naming the field, what it is, and the fix, before
    anything is set."""
    from pipeline.checkpoint.components import capture_data, components, restore_order
    from pipeline.data import prepare_data
    from pipeline.run import build_run

    config = load_config(CONFIG, {"data.dir": str(tmp_path / "data")})
    prepare_data(config)  # in this process: a fraction of a second, no script started
    run = build_run(config, torch.device("cpu"))
    for parameter in run.model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    run.optimizer.step()  # a state for each of the six parameters: step, exp_avg, exp_avg_sq
    table = {c.name: c for c in components()}
    assert list(table) == ["rng", "optimizer", "scheduler", "data", "scaler", "callbacks"]
    assert [c.name for c in restore_order()][-1] == "rng"
    optimizer = run.optimizer.state_dict()
    scheduler = run.scheduler.state_dict()
    rng = table["rng"].live(run)
    data = capture_data(run, None)
    for name, saved in (("optimizer", optimizer), ("scheduler", scheduler), ("rng", rng), ("data", data)):
        table[name].checked(run, saved, 0)
    table["scaler"].checked(run, None, 0)
    cases = [
        ("optimizer", [], 0, "optimizer", "is not an optimizer state (state, param_groups)"),
        (
            "optimizer",
            {**optimizer, "x": 1},
            0,
            "optimizer",
            "is not an optimizer state (state, param_groups)",
        ),
        (
            "optimizer",
            {**optimizer, "param_groups": optimizer["param_groups"] * 2},
            0,
            "optimizer.param_groups",
            "does not hold 1 groups",
        ),
        (
            "optimizer",
            _with(optimizer, ("param_groups", 0, "params"), [0, 1, 2, 3, 5, 4]),
            0,
            "optimizer.param_groups[0].params",
            "differ from this model's parameters",
        ),
        (
            "optimizer",
            _with(optimizer, ("param_groups", 0, "lr"), float("inf")),
            0,
            "optimizer.param_groups[0].lr",
            "is inf, expected a finite number",
        ),
        ("optimizer", {**optimizer, "state": []}, 0, "optimizer.state", "is not a mapping"),
        (
            "optimizer",
            _with(optimizer, ("state", 6), {}),
            0,
            "optimizer.state",
            "names parameter 6, this model has 6",
        ),
        (
            "optimizer",
            _with(optimizer, ("state", -1), {}),
            0,
            "optimizer.state",
            "names parameter -1, this model has 6",
        ),
        (
            "optimizer",
            _with(optimizer, ("state", "0"), {}),
            0,
            "optimizer.state",
            "names parameter '0', this model has 6",
        ),
        ("optimizer", _with(optimizer, ("state", 5), [1]), 0, "optimizer.state[5]", "is not a mapping"),
        (
            "optimizer",
            _with(optimizer, ("state", 0, "step"), torch.tensor(float("nan"))),
            0,
            "optimizer.state[0].step",
            "is nan",
        ),
        (
            "optimizer",
            _with(optimizer, ("state", 1, "exp_avg"), torch.zeros(6, 16)),  # a bias (16,) given a matrix
            0,
            "optimizer.state[1].exp_avg",
            "has shape (6, 16), the parameter (16,)",
        ),
        (
            "optimizer",
            _with(optimizer, ("state", 0, "exp_avg_sq"), torch.zeros(3, 16)),  # the (16, 3) weight transposed
            0,
            "optimizer.state[0].exp_avg_sq",
            "has shape (3, 16), the parameter (16, 3)",
        ),
        (
            "optimizer",
            _with(optimizer, ("state", 2, "step"), float("nan")),
            0,
            "optimizer.state[2].step",
            "is nan, expected a tensor or a finite number",
        ),
        (
            "optimizer",
            _with(optimizer, ("state", 2, "step"), True),
            0,
            "optimizer.state[2].step",
            "is True, expected a tensor or a finite number",
        ),
        (
            "optimizer",
            _with(optimizer, ("state", 2, "step"), "1"),
            0,
            "optimizer.state[2].step",
            "is '1', expected a tensor or a finite number",
        ),
        ("scheduler", scheduler, 1, "scheduler.last_epoch", "is 0, the run is at step 1"),
        (
            "scheduler",
            {**scheduler, "last_epoch": 1},
            0,
            "scheduler.last_epoch",
            "is 1, the run is at step 0",
        ),
        (
            "rng",
            {k: v for k, v in rng.items() if k != "torch_cuda"},
            0,
            "rng",
            "does not hold exactly python, numpy_generator, numpy_legacy, torch_cpu, torch_cuda",
        ),
        (
            "rng",
            {**rng, "extra": 1},
            0,
            "rng",
            "does not hold exactly python, numpy_generator, numpy_legacy, torch_cpu, torch_cuda",
        ),
        ("rng", {**rng, "python": "x"}, 0, "rng.python", "is not a valid state (ValueError)"),
        (
            "rng",
            {**rng, "python": (rng["python"][0], (2**70, *rng["python"][1][1:]), rng["python"][2])},
            0,
            "rng.python",
            "is not a valid state (OverflowError)",
        ),
        ("rng", {**rng, "numpy_legacy": "x"}, 0, "rng.numpy_legacy", "is not a valid state (TypeError)"),
        (
            "rng",
            {**rng, "numpy_generator": "x"},
            0,
            "rng.numpy_generator",
            "is not a valid state (TypeError)",
        ),
        ("rng", {**rng, "torch_cpu": "x"}, 0, "rng.torch_cpu", "is not a valid state (TypeError)"),
        ("rng", {**rng, "torch_cuda": torch.zeros(2)}, 0, "rng.torch_cuda", "is not a list of byte tensors"),
        ("rng", {**rng, "torch_cuda": [1]}, 0, "rng.torch_cuda", "is not a list of byte tensors"),
        ("data", {**data, "sampler": None}, 0, "data.sampler", "is missing"),
    ]
    for name, saved, step, where, why in cases:
        with pytest.raises(StateMismatch) as refused:
            table[name].checked(run, saved, step)
        assert str(refused.value) == _refusal(where, why), (where, str(refused.value))
    # The data's source record belongs to the feed (its own refusal), the sampler's position to
    # a scratch sampler of this data.
    from pipeline.errors import SEALED_BUT_UNFIT, DataError

    rows = data["source"]["num_samples"]
    with pytest.raises(DataError) as refused:
        table["data"].checked(run, _with(data, ("source", "num_samples"), rows + 1), 0)
    assert str(refused.value).startswith(
        f"the training set had {rows + 1} samples when the checkpoint was saved"
    )
    with pytest.raises(StateMismatch) as refused:
        table["data"].checked(run, _with(data, ("sampler", "cursor"), 10**6), 0)
    assert str(refused.value).startswith("training_state.data.sampler does not fit this data ("), (
        refused.value
    )
    assert str(refused.value).endswith(f"): {SEALED_BUT_UNFIT}"), refused.value
    # Other float types a saved optimizer state may hold (an older torch's float step) pass.
    table["optimizer"].checked(run, _with(optimizer, ("state", 2, "step"), 3.0), 0)
    with pytest.raises(StateMismatch) as refused:
        table["scaler"].checked(run, {"scale": 1024.0}, 0)
    assert str(refused.value) == "the checkpoint and this run disagree on AMP GradScaler use (training.amp)"
    amp = build_run(
        load_config(CONFIG, {"data.dir": str(tmp_path / "data"), "training.amp": "fp16"}), run.device
    )
    scaler = amp.scaler.state_dict()
    table["scaler"].checked(amp, scaler, 0)
    with pytest.raises(StateMismatch) as refused:
        table["scaler"].checked(amp, None, 0)
    assert str(refused.value) == "the checkpoint and this run disagree on AMP GradScaler use (training.amp)"
    with pytest.raises(StateMismatch) as refused:
        table["scaler"].checked(amp, {**scaler, "scale": float("nan")}, 0)
    assert str(refused.value) == _refusal("scaler.scale", "is nan, expected a finite number")
    with pytest.raises(StateMismatch) as refused:
        table["data"].joined({"sampler": None, "task": None, "source": None, "order": 1}, {}, set())
    assert str(refused.value) == _refusal("data", "does not hold exactly sampler, task, source")


def test_a_states_progress_and_history_are_held_to_the_run_on_both_sides_of_max_steps(tmp_path):
    """validated_state on a state captured from a real run at step 3 of a 3-step config (its
    last step): it passes, whole; the same run one step further (a config whose max_steps was
    lowered after training) is refused, and so is a history whose steps do not count up, one
    missing a list every checkpoint holds, one of another dtype, a tensor nothing references,
    a state without its progress; a checkpoint from before grad_norm and epoch were recorded,
    or before the callbacks component existed, is read as NaN history and no callback state."""
    from pipeline.checkpoint.state import capture_state
    from pipeline.checkpoint.validate import validated_state
    from pipeline.data import prepare_data
    from pipeline.run import build_run

    config = load_config(CONFIG, {"data.dir": str(tmp_path / "data"), "training.max_steps": 3})
    prepare_data(config)  # in this process: a fraction of a second, no script started
    run = build_run(config, torch.device("cpu"))
    nan = float("nan")
    history = {
        "step": [1, 2, 3],
        "loss": [0.5, 0.25, 0.125],
        "lr": [0.1, 0.2, 0.3],
        "grad_norm": [1.5, nan, 2.5],
        "epoch": [0.25, 0.5, 0.75],
    }

    def captured(step: int) -> tuple[dict, dict]:
        run.step, run.history = step, {key: values[:step] for key, values in history.items()}
        if step > 3:
            run.history = {key: [*values, values[-1]] for key, values in run.history.items()}
            run.history["step"] = [1, 2, 3, 4]
        _, state, tensors = capture_state(run)
        state["scheduler"]["last_epoch"] = step  # as a scheduler stepped once a step has it
        return state, tensors

    state, tensors = captured(3)
    joined = validated_state(run, state, tensors, step=3)
    assert sorted(joined) == [
        "callbacks", "data", "evaluations", "history", "optimizer", "rng", "scaler", "scheduler", "step"
    ]  # fmt: skip
    assert joined["step"] == 3 and repr(joined["history"]) == repr(history)
    assert joined["callbacks"] == {"stopped": None, "states": {}} and joined["evaluations"] == {"step": []}
    older = {
        key: tensor for key, tensor in tensors.items() if key not in ("history/grad_norm", "history/epoch")
    }
    before = validated_state(run, {k: v for k, v in state.items() if k != "callbacks"}, older, step=3)
    assert repr(before["history"]) == repr({**history, "grad_norm": [nan] * 3, "epoch": [nan] * 3})
    assert before["callbacks"] == {"stopped": None, "states": {}}
    names = "rng, optimizer, scheduler, data, scaler, callbacks, progress"
    values = "is not 3 torch.float64 values"
    past = captured(4)
    counted = {**tensors, "history/step": torch.tensor([2, 1, 3])}  # ends at 3, counts otherwise
    without_loss = {k: v for k, v in tensors.items() if k != "history/loss"}
    lr_as_float32 = {**tensors, "history/lr": tensors["history/lr"].float()}
    two_epochs = {**tensors, "history/epoch": torch.zeros(2, dtype=torch.float64)}
    for refused_state, refused_tensors, step, where, why in (
        (*past, 4, "progress.step", "is 4, past training.max_steps 3"),
        (state, tensors, 2, "progress.step", "is 3, the checkpoint is step 2"),
        (state, counted, 3, "history/step", "does not count 1, 2, ... step"),
        (state, without_loss, 3, "history/loss", values),
        (state, lr_as_float32, 3, "history/lr", values),
        (state, two_epochs, 3, "history/epoch", values),
        (state, {**tensors, "x": torch.zeros(1)}, 3, "", "does not reference tensor 'x' of the state file"),
        ({**state, "progress": {"step": 3, "epoch": 1}}, tensors, 3, "progress", "is not {step}"),
        (
            {**state, "progress": {"step": 3.0}},
            tensors,
            3,
            "progress.step",
            "is 3.0, expected an integer >= 0",
        ),
        (
            {k: v for k, v in state.items() if k != "progress"},
            tensors,
            3,
            "",
            f"does not hold exactly {names}",
        ),
        ({**state, "extra": 1}, tensors, 3, "", f"does not hold exactly {names}"),
    ):
        with pytest.raises(StateMismatch) as refused:
            validated_state(run, refused_state, refused_tensors, step=step)
        assert str(refused.value) == _refusal(where, why), (where, str(refused.value))


def test_a_saved_sampler_position_past_the_users_sampler_batches_is_refused_in_one_line(data_dir, tmp_path):
    """A task's own sampler that looks its saved position up (an IndexError one past its last
    batch: saved at an epoch's end) is refused before anything is restored, naming the
    sampler, not ended by the IndexError."""
    config = _config(data_dir, tmp_path, **{"data.factory": "proof_factories:build_lookup_data"})
    cut = train(config, stop_at=6, progress=False)  # 24 rows in batches of 4: the epoch's end
    assert cut.step == 6
    with pytest.raises(StateMismatch) as refused:
        train(config, resume="latest", progress=False)
    assert str(refused.value).startswith(
        "training_state.data.sampler does not fit this data (list index out of range): "
    ), refused.value
