"""Inputs as users have them: a map-style dataset read by DataLoader workers, a datasets
stream, and per-sample randomness. In-process trainings on the default data (a second each);
the workers are real processes, killed for real."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import get_args

import pytest
from safetensors.torch import load_file

from pipeline.checkpoint import LoadMode, load_checkpoint, read_tensors
from pipeline.config import load_config
from pipeline.data import InputForm, input_mode, prepare_data
from pipeline.errors import DataError
from pipeline.layout import STATE_FILE
from pipeline.train import train

from support import REPO, assert_checkpoints_bitwise_equal, reseal, run_script, script_env

CONFIG = REPO / "config.yaml"
NOISY = {"data.factory": "inputs_factories:build_noisy_rows"}
STREAM = {"data.prepare": "inputs_factories:prepare_stream", "data.factory": "inputs_factories:build_stream"}


def _config(data_dir: Path, checkpoints: Path, **overrides):
    return load_config(CONFIG, {"data.dir": str(data_dir), "checkpoint.dir": str(checkpoints), **overrides})


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and exc.value.exit_code == 2, message
    return message


def test_the_task_data_takes_exactly_one_of_the_three_input_forms_and_anything_else_is_one_line():
    forms = {
        "batches": SimpleNamespace(get_batch=lambda indices, device: None, num_train=4),
        "dataset": SimpleNamespace(train_dataset=[1, 2]),
        "stream": SimpleNamespace(train_iterable=iter(())),
    }
    assert set(forms) == set(get_args(InputForm))
    assert {form: input_mode(data) for form, data in forms.items()} == {form: form for form in forms}
    with pytest.raises(DataError) as none:
        input_mode(SimpleNamespace(get_batch=4, train_dataset=None, num_train=4))
    assert "a SimpleNamespace with none of them: give exactly one of get_batch" in _one_line(none)
    with pytest.raises(DataError) as two:
        input_mode(SimpleNamespace(train_dataset=[1], train_iterable=iter(())))
    assert "with dataset and stream: give exactly one of" in _one_line(two)


def test_the_resume_proofs_report_names_the_workers_only_of_a_dataset_and_the_split_only_of_a_stream():
    """data.num_workers is what a DataLoader reads a dataset with: batches built in the training
    process and a stream use none, whatever the config says; data.stream_split splits a stream."""
    from pipeline.data import describe_inputs

    config = SimpleNamespace(data=SimpleNamespace(num_workers=2, stream_split="shards"))
    forms = {
        "batches": SimpleNamespace(get_batch=lambda indices, device: None, num_train=4),
        "dataset": SimpleNamespace(train_dataset=[1, 2]),
        "stream": SimpleNamespace(train_iterable=iter(())),
    }
    assert {form: describe_inputs(data, config) for form, data in forms.items()} == {
        "batches": {
            "mode": "batches",
            "source": "types.SimpleNamespace",
            "num_workers": 0,
            "stream_split": None,
        },
        "dataset": {"mode": "dataset", "source": "builtins.list", "num_workers": 2, "stream_split": None},
        "stream": {
            "mode": "stream",
            "source": "builtins.tuple_iterator",
            "num_workers": 0,
            "stream_split": "shards",
        },
    }


def test_noisy_samples_are_bitwise_the_same_with_0_or_2_workers_and_after_a_stop_mid_epoch(
    data_dir, tmp_path
):
    """torch, NumPy and random draws in __getitem__ (dropout on): 0 workers (fetched in the
    training process, whose own streams must not move), 2 workers, and 2 workers stopped at
    step 5 (mid-epoch, batches prefetched past it) then resumed: one history, one checkpoint."""
    runs = {}
    for name, workers, stop in (("zero", 0, None), ("two", 2, None), ("cut", 2, 5), ("cut", 2, None)):
        config = _config(data_dir, tmp_path / name, **NOISY, **{"data.num_workers": workers})
        runs[name] = train(config, progress=False, stop_at=stop, resume="auto" if name == "cut" else None)
    assert runs["cut"].resumed_from == 5
    assert runs["zero"].history["loss"] == runs["two"].history["loss"] == runs["cut"].history["loss"]
    for name in ("two", "cut"):
        assert_checkpoints_bitwise_equal(
            tmp_path / "zero" / "step-00000010", tmp_path / name / "step-00000010"
        )
    source = json.loads((tmp_path / "cut" / "step-00000010" / "meta.json").read_text())["training_state"][
        "data"
    ]
    assert source["source"] == {"kind": "dataset", "num_samples": 24, "fingerprint": None}


@pytest.mark.parametrize(
    "knob, message",
    [
        (
            "INPUTS_FAIL_AT",
            r"train_dataset\[21\] \(epoch 0\) raised ValueError: row 21 is corrupt; the last committed "
            r"checkpoint \(step 4\) is intact: fix it and resume with ",
        ),
        (
            "INPUTS_KILL_AT",
            r"a DataLoader worker \(pid \d+\) was killed by SIGKILL \(the out-of-memory killer sends it[^;]*; "
            r"the last committed checkpoint \(step [24]\) is intact",
        ),
    ],
    ids=["raises", "killed"],
)
def test_a_sample_that_raises_or_a_worker_killed_mid_epoch_ends_in_one_line_with_the_checkpoint_intact(
    data_dir, tmp_path, monkeypatch, knob, message
):
    monkeypatch.setenv(knob, "21")  # unshuffled: step 6 reads rows 20..23
    monkeypatch.setenv("INPUTS_KILL_AFTER", str(tmp_path / "step-00000002"))
    config = _config(
        data_dir,
        tmp_path,
        **NOISY,
        **{"data.num_workers": 2, "data.shuffle": False, "checkpoint.every": 2, "checkpoint.async": False},
    )
    with pytest.raises(DataError, match=message) as refused:
        train(config, progress=False)
    _one_line(refused)
    # A killed worker may take the batches it had finished with it (its queue's writer dies
    # too), so the run may stop at step 4 or 6; the sample that raises stops it at step 6.
    (kept,) = tmp_path.glob("step-*")
    assert load_checkpoint(kept, mode=LoadMode.VERIFY).meta["step"] in (
        (4,) if knob == "INPUTS_FAIL_AT" else (2, 4)
    )


def test_a_training_set_whose_length_or_fingerprint_changed_since_the_checkpoint_is_refused(
    data_dir, tmp_path, monkeypatch
):
    config = _config(data_dir, tmp_path, **NOISY)
    train(config, progress=False, stop_at=3)
    monkeypatch.setenv("INPUTS_ROWS", "23")
    with pytest.raises(
        DataError, match="the training set had 24 samples when the checkpoint was saved and has 23"
    ):
        train(config, progress=False, resume="latest")
    monkeypatch.delenv("INPUTS_ROWS")
    monkeypatch.setenv("INPUTS_FINGERPRINT", "rows-v2")
    with pytest.raises(
        DataError, match="fingerprint is 'rows-v2', the checkpoint's None: its content changed"
    ) as exc:
        train(config, progress=False, resume="latest")
    _one_line(exc)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003"]


@pytest.fixture(scope="module")
def stream_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("stream") / "data"
    prepare_data(_config(folder, folder.parent / "unused", **STREAM))
    return folder


@pytest.mark.heavy
def test_a_stream_is_proven_to_resume_bitwise_mid_pass_and_its_checkpoints_hold_no_pickle(
    stream_dir, tmp_path
):
    """scripts/03 on 24 rows in 2 JSON-lines shards, batches of 4, noise added by a map: cut
    at step 5 (mid-pass), the resumed run crosses into the second pass; omit-data (the stream
    read from its start again) diverges."""
    output = tmp_path / "proof"
    result = run_script(
        "03_verify_resume.py",
        "--config",
        str(CONFIG),
        *_set_args({"data.dir": stream_dir, **STREAM}),
        "--set",
        "training.deterministic=false",
        "--jobs",
        "1",
        "--output",
        str(output),
        cwd=tmp_path,
        env=script_env(OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((output / "verification.json").read_text())
    assert report["all_checks_passed"] and report["protocol"]["data"]["mode"] == "stream"
    assert report["components"]["negative"]["data"]["result"] == "detected"
    assert "inputs: stream (datasets.iterable_dataset.IterableDataset)" in result.stdout
    folder = output / "resume" / "checkpoints" / "step-00000010"
    for path in folder.iterdir():  # plain JSON and safetensors, nothing else (no pickle)
        assert path.suffix in (".json", ".safetensors"), path
        if path.suffix == ".json":
            json.loads(path.read_text())
        else:
            load_file(path)
    source = json.loads((folder / "meta.json").read_text())["training_state"]["data"]["source"]
    assert source["kind"] == "stream" and source["world_size"] is None and source["ranks"][0]["pass"] == 1
    assert source["ranks"][0]["consumed"] == 16 and isinstance(source["ranks"][0]["state"], dict)


def _set_args(overrides: dict) -> list[str]:
    return [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]


def test_a_saved_stream_position_of_another_source_is_refused_in_one_line(stream_dir, tmp_path):
    train(_config(stream_dir, tmp_path / "cut", **STREAM), progress=False, stop_at=3)
    from inputs_factories import build_mapped_stream

    other = build_mapped_stream(
        _config(stream_dir, tmp_path, **STREAM), stream_dir
    ).train_iterable.state_dict()

    def forge(meta: dict) -> None:  # identity kept, as a forger would
        meta["training_state"]["data"]["source"]["ranks"][0]["state"] = other

    reseal(tmp_path / "cut" / "step-00000003", forge)
    with pytest.raises(
        DataError,
        match=r"source\.ranks\[0\]\.state\.examples_iterable\S* (has other fields|is "
        r"'MappedExamplesIterable'.*): the saved stream position does not belong to "
        r"this train_iterable",
    ) as exc:
        train(_config(stream_dir, tmp_path / "cut", **STREAM), progress=False, resume="latest")
    _one_line(exc)


def test_a_saved_stream_position_with_a_negative_counter_is_refused_and_one_at_0_is_not(stream_dir, tmp_path):
    """The feed's check of a resumed position, in this process: a counter below 0, a boolean or
    a float (the pass, the records read, the source's own epoch or place in its shard) is no
    position a stream reaches, and is refused in one line naming it; each at 0 is one, and passes."""
    import copy

    import torch

    from pipeline.data import load_task_data
    from pipeline.data.stream import StreamFeed
    from pipeline.errors import SEALED_BUT_UNFIT
    from pipeline.world import World

    config = _config(stream_dir, tmp_path, **STREAM)
    feed = StreamFeed(load_task_data(config), config, torch.device("cpu"), World(device=torch.device("cpu")))
    for _ in range(2):
        feed.next_batch()
    saved = feed.state_dict()
    feed.check_state(saved)
    # The datasets state nests one reader in the next; the innermost holds the place in its shard.
    path, holder = [], saved["ranks"][0]["state"]
    while "examples_iterable" in holder:
        path, holder = [*path, "examples_iterable"], holder["examples_iterable"]
    path.append("shard_example_idx")
    where = "training_state.data.source.ranks[0]"
    foreign = "the saved stream position does not belong to this train_iterable; resume with the stream it was trained on"
    for keys, says in (
        (["pass"], lambda value: f"{where}.pass is {value!r}, expected an integer >= 0: {SEALED_BUT_UNFIT}"),
        (
            ["consumed"],
            lambda value: f"{where}.consumed is {value!r}, expected an integer >= 0: {SEALED_BUT_UNFIT}",
        ),
        (["state", "epoch"], lambda value: f"{where}.state.epoch is not an integer >= 0: {foreign}"),
        (["state", *path], lambda value: f"{where}.state.{'.'.join(path)} is not an integer >= 0: {foreign}"),
    ):
        for value in (-1, True, 2.0, 0):  # a boolean and a whole float are no counters either
            forged = copy.deepcopy(saved)
            record = forged["ranks"][0]
            for key in keys[:-1]:
                record = record[key]
            record[keys[-1]] = value
            if value == 0:
                feed.check_state(forged)
                continue
            with pytest.raises(DataError) as refused:
                feed.check_state(forged)
            assert _one_line(refused) == says(value), (keys, value)


def test_a_saved_stream_state_must_hold_the_fresh_states_flags_and_names():
    """Where the fresh state of a stream holds a flag, the saved one holds a flag (not 0 or 1);
    where it holds a reader's name, the same name; a counter may be 0; where it holds None, any
    value. Each refusal is one line naming the field."""
    from pipeline.data.stream import _shaped_like

    belongs = "the saved stream position does not belong to this train_iterable; resume with the stream it was trained on"
    fresh = {"drop_last": False, "type": "ArrowExamplesIterable", "shard_idx": 0, "previous_state": None}
    accepted = {
        "drop_last": True,
        "type": "ArrowExamplesIterable",
        "shard_idx": 0,
        "previous_state": {"x": [1]},
    }
    _shaped_like(accepted, fresh, "state")
    for field, value, refusal in (
        ("drop_last", 1, "is not a boolean"),
        ("drop_last", 0, "is not a boolean"),
        (
            "type",
            "JsonExamplesIterable",
            "is 'JsonExamplesIterable', this source's is 'ArrowExamplesIterable'",
        ),
    ):
        with pytest.raises(DataError) as exc:
            _shaped_like({**accepted, field: value}, fresh, "state")
        assert _one_line(exc) == f"state.{field} {refusal}: {belongs}", (field, value)


def test_a_stream_whose_state_does_not_resume_it_exactly_is_refused_before_the_first_step(
    stream_dir, tmp_path
):
    config = _config(
        stream_dir, tmp_path, **{**STREAM, "data.factory": "inputs_factories:build_buffered_stream"}
    )
    with pytest.raises(
        DataError, match=r"does not resume exactly from its own state_dict\(\).*shuffle buffer"
    ) as exc:
        train(config, progress=False)
    _one_line(exc)
    assert not list(tmp_path.glob("step-*"))
    with pytest.raises(DataError, match="a stream is read in the training process"):
        train(_config(stream_dir, tmp_path, **STREAM, **{"data.num_workers": 2}), progress=False)


def test_a_stream_tasks_own_state_is_given_back_on_resume(stream_dir, tmp_path):
    """A stream task with a ``state_dict`` of its own (a loss weight that grows with every loss
    computed): a stream run resumed from step 4 gets it back and trains on the losses of the
    uninterrupted run, bit for bit (a stream has no sampler: its task's state is restored all the
    same)."""
    stateful = {**STREAM, "data.factory": "inputs_factories:build_stateful_stream", "training.max_steps": 6}
    full = train(_config(stream_dir, tmp_path / "full", **stateful), progress=False)
    config = _config(stream_dir, tmp_path / "cut", **stateful)
    cut = train(config, stop_at=4, progress=False)
    assert (
        json.loads((cut.checkpoint / "meta.json").read_text())["training_state"]["data"]["task"]["calls"] == 4
    )
    resumed = train(config, resume="latest", progress=False)
    assert resumed.step == 6 and resumed.history["loss"] == full.history["loss"]
    assert_checkpoints_bitwise_equal(full.checkpoint, resumed.checkpoint)
    assert read_tensors(resumed.checkpoint / STATE_FILE)["data/task/weight"].tolist() == [1.0625**6]


def test_a_stream_checkpoint_is_refused_by_a_map_style_run_and_back(stream_dir, tmp_path):
    train(_config(stream_dir, tmp_path / "s", **STREAM), progress=False, stop_at=2)
    shutil.copytree(tmp_path / "s", tmp_path / "m")
    dataset = {"kind": "dataset", "num_samples": 24, "fingerprint": None}
    reseal(
        tmp_path / "m" / "step-00000002", lambda meta: meta["training_state"]["data"].update(source=dataset)
    )
    with pytest.raises(
        DataError, match="trained from a 'dataset' source, this run's data.factory gives a 'stream'"
    ):
        train(_config(stream_dir, tmp_path / "m", **STREAM), progress=False, resume="latest")
