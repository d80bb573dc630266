"""Script 04 evaluates exactly the newest verified checkpoint on held-out data."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.checkpoint import load_model_weights
from pipeline.config import load_config
from pipeline.data import load_manifest, prepare_data
from pipeline.errors import ChecksumMismatch, DataError
from pipeline.evaluate import evaluate_checkpoint
from pipeline.provenance import code_fingerprint
from pipeline.run import build_model

CONFIG = Path(__file__).resolve().parents[1] / "config.yaml"


def test_metrics_json_names_the_step_and_sha256_of_the_evaluated_weights(evaluated_run):
    record = json.loads(evaluated_run.metrics.read_text())
    checkpoint = evaluated_run.checkpoint
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert record["step"] == meta["step"] == 10
    assert (
        record["modelo_sha256"]
        == hashlib.sha256((checkpoint / "modelo.safetensors").read_bytes()).hexdigest()
    )
    assert record["checkpoint"] == "estados_local/step-00000010"
    assert record["split"] == "heldout"
    assert record["fingerprints"]["data"] == meta["fingerprints"]["data"]
    assert set(record["metrics"]) == {"mse", "rmse"}
    # The hash of the meta.json file, named apart from meta.json's own seal (meta_sha256).
    assert record["meta_file_sha256"] == hashlib.sha256((checkpoint / "meta.json").read_bytes()).hexdigest()
    assert "meta_sha256" not in record
    # When, as every record states it: UTC, to the second.
    created = datetime.datetime.fromisoformat(record["created"])
    assert created.utcoffset() == datetime.timedelta(0), record["created"]
    assert record["created"] == created.isoformat(timespec="seconds"), record["created"]


def test_metrics_json_names_every_code_file_and_the_config_it_evaluated_under(evaluated_run):
    record = json.loads(evaluated_run.metrics.read_text())
    meta = json.loads((evaluated_run.checkpoint / "meta.json").read_text())
    # The files the checkpoint counts, as they were when 04 ran (unchanged since training here).
    assert record["fingerprints"]["sources"] == meta["fingerprints"]["sources"]
    assert "pipeline/tasks/regression.py" in record["fingerprints"]["sources"]  # model, data and evaluate
    assert record["fingerprints"]["code"] == code_fingerprint()
    config = load_config(CONFIG, evaluated_run.overrides)
    assert {**record["config"], "data": {**record["config"]["data"], "dir": None}} == {
        **meta["config"],
        "data": {**meta["config"]["data"], "dir": None},
    }
    assert record["config"]["training"]["device"] == config.training.device


@pytest.mark.parametrize(
    "edit",
    ["first-schema", "old-key", "no-sources", "a-key-more", "step-as-text", "sha-not-text", "code-not-text",
     "config-not-a-mapping", "source-hash-not-text", "other-schema-same-keys"],
)  # fmt: skip
def test_a_metrics_record_that_names_no_code_files_is_refused_with_the_command_that_rewrites_it(
    evaluated_run, tmp_path, edit
):
    from pipeline.errors import MetricsError
    from pipeline.evaluate import read_metrics

    record = json.loads(evaluated_run.metrics.read_text())
    if edit == "first-schema":
        record = {**record, "schema": "pipeline.metrics/1"}
        del record["config"]
        del record["fingerprints"]["sources"]
    elif edit == "old-key":
        record["meta_sha256"] = record.pop("meta_file_sha256")
    elif edit == "a-key-more":  # a record of another writer: not the schema's exact keys
        record["metrics_of"] = "another run"
    elif edit == "step-as-text":
        record["step"] = str(record["step"])
    elif edit == "sha-not-text":
        record["modelo_sha256"] = None
    elif edit == "code-not-text":
        record["fingerprints"]["code"] = 1
    elif edit == "config-not-a-mapping":
        record["config"] = "config.yaml"
    elif edit == "other-schema-same-keys":  # every key a pipeline.metrics/2 record has, another version's
        record["schema"] = "pipeline.metrics/3"
    elif edit == "source-hash-not-text":
        record["fingerprints"]["sources"]["pipeline/tasks/regression.py"] = None
    else:
        del record["fingerprints"]["sources"]
    (tmp_path / "metrics.json").write_text(json.dumps(record))
    refused = (
        r"metrics\.json (is not a pipeline\.metrics/2 record|has (a )?malformed "
        r"(fingerprints or config|step or modelo_sha256)): rerun python scripts/04_evaluate\.py$"
    )
    with pytest.raises(MetricsError, match=refused) as refusal:
        read_metrics(tmp_path / "metrics.json")
    if edit in ("first-schema", "other-schema-same-keys", "old-key", "a-key-more"):
        assert str(refusal.value) == (
            f"{tmp_path / 'metrics.json'} is not a pipeline.metrics/2 record: rerun python scripts/04_evaluate.py"
        )


@pytest.mark.parametrize(
    "metrics, says",
    [
        ({"mse": float("nan"), "rmse": 0.5}, "held-out metric mse is nan"),
        ({"mse": "0.01", "rmse": 0.5}, "metric 'mse' is '0.01'; metrics must map str to a number"),
        ({}, "metrics must be a non-empty mapping of name to number"),
        ({"heldout": {}}, "evaluation set 'heldout' holds no metric"),
    ],
)
def test_a_metrics_record_whose_metrics_are_not_finite_numbers_is_refused(
    evaluated_run, tmp_path, metrics, says
):
    """What 05 puts on the card comes through read_metrics: a record 04 could not have written
    (a NaN, which Python's json writes and reads; a number as text; no metric at all) is
    refused in one line, as 04 refuses such values from a task's evaluate()."""
    from pipeline.errors import MetricsError
    from pipeline.evaluate import read_metrics

    record = json.loads(evaluated_run.metrics.read_text())
    assert read_metrics(evaluated_run.metrics)["metrics"] == record["metrics"]
    (tmp_path / "metrics.json").write_text(json.dumps({**record, "metrics": metrics}))
    with pytest.raises(MetricsError, match=re.escape(says)) as refused:
        read_metrics(tmp_path / "metrics.json")
    # Which file, and the command that writes a good one.
    assert str(refused.value).startswith(f"{tmp_path / 'metrics.json'}: ")
    assert str(refused.value).endswith("; rerun python scripts/04_evaluate.py")


@pytest.mark.parametrize(
    "kind",
    [
        "fifo",
        "link-to-fifo",
        "folder",
        "oversized",
        "missing",
        "not-json",
        "not-utf8",
        "under-a-file",
        "procfs",
    ],
)
def test_a_metrics_file_that_is_not_a_small_regular_file_is_refused_in_one_line(tmp_path, kind):
    """--metrics names a file 05 reads: a FIFO (or a link to one) is refused at once, not
    waited on; a folder or an endless file is not read."""
    from pipeline.errors import MetricsError
    from pipeline.evaluate import read_metrics

    path = tmp_path / "metrics.json"
    says = {
        "fifo": "is a FIFO, not a regular file: not a metrics file; rerun",
        "link-to-fifo": "is a FIFO, not a regular file: not a metrics file; rerun",
        "folder": "is a folder, not a regular file: not a metrics file; rerun",
        "oversized": "bytes, over the 16,777,216-byte limit: not a metrics file; rerun",
        "missing": "not found: run python scripts/04_evaluate.py first",
        "not-json": "is not valid JSON: rerun python scripts/04_evaluate.py",
        "not-utf8": "is not valid JSON: rerun python scripts/04_evaluate.py",
        "under-a-file": " could not be read (Not a directory): rerun python scripts/04_evaluate.py",
        # A file whose size fstat does not tell (procfs says 0 bytes): read as one that grew.
        "procfs": " changed while it was read (grew past 0 bytes while read): rerun python scripts/04_evaluate.py",
    }[kind]
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link-to-fifo":
        os.mkfifo(tmp_path / "pipe")
        path.symlink_to(tmp_path / "pipe")
    elif kind == "folder":
        path.mkdir()
    elif kind == "oversized":
        with open(path, "wb") as sparse:
            sparse.truncate(1 << 40)  # a terabyte on paper, nothing on disk
    elif kind == "not-json":
        path.write_text('{"schema": "pipeline.metrics/2", ')  # cut short
    elif kind == "not-utf8":
        path.write_bytes(b'{"schema": "\xff"}')
    elif kind == "under-a-file":  # the disk's own refusal, in its words
        (tmp_path / "notes").write_text("")
        path = tmp_path / "notes" / "metrics.json"
    elif kind == "procfs":
        path = Path("/proc/self/status")
    with pytest.raises(MetricsError) as refused:
        read_metrics(path)
    assert str(refused.value).startswith(str(path)) and says in str(refused.value), refused.value
    if kind in ("under-a-file", "procfs"):
        assert str(refused.value) == f"{path}{says}"


def test_metrics_are_written_where_asked_and_a_folder_given_as_the_file_is_refused(evaluated_run, tmp_path):
    from pipeline.errors import MetricsError
    from pipeline.evaluate import read_metrics, write_metrics

    record = json.loads(evaluated_run.metrics.read_text())
    config = load_config(CONFIG, evaluated_run.overrides)
    nested = tmp_path / "runs" / "a" / "metrics.json"  # its folders made as needed
    assert write_metrics(record, config, nested) == nested
    assert read_metrics(nested) == record
    with pytest.raises(MetricsError) as refused:
        write_metrics(record, config, tmp_path)
    assert str(refused.value) == (
        f"--output {tmp_path} is a folder; give a file path such as {tmp_path / 'metrics.json'}"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def test_the_checkpoints_config_is_evaluated_with_only_the_data_folder_and_device_of_the_command_line(
    caplog,
):
    """04 takes the architecture and recipe from the checkpoint's meta.json, where things are from
    the command line (a --set of those is used, and not warned about; a --set of the recipe is
    named in one warning); a saved config this version cannot use is one line, not a traceback."""
    from pipeline.errors import ConfigMismatch
    from pipeline.evaluate import evaluation_config

    saved = load_config(CONFIG, {"data.dir": "/trained/here", "training.device": "auto"}).to_dict()
    sets = {
        "data.dir": "/evaluated/here",
        "training.device": "cpu",
        "outputs.metrics": "m.json",
        "model.params.hidden": 32,
        "data.batch_size": saved["data"]["batch_size"],  # the checkpoint's own value: nothing to say
        "training.seed": saved["training"]["seed"] + 1,
        # Where it saves is never the checkpoint's to decide: nothing to say.
        "checkpoint.every": saved["checkpoint"]["every"] + 1,
    }
    given = load_config(CONFIG, sets)
    args = (
        "--config",
        "mine.yaml",
        *(arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")),
    )
    given = dataclasses.replace(given, command_args=args)
    with caplog.at_level(logging.WARNING, logger="pipeline.evaluate"):
        config = evaluation_config({"config": saved}, given, source="ck/meta.json")
    assert [record.getMessage() for record in caplog.records] == [
        f"warning: not used: --set model.params.hidden=32 (it has 16), --set training.seed={sets['training.seed']} "
        f"(it has {saved['training']['seed']}): a checkpoint is evaluated and staged with the config it was trained "
        "with (ck/meta.json)"
    ]
    assert (config.data.dir, config.training.device, config.command_args) == ("/evaluated/here", "cpu", args)
    assert config.to_dict() == {
        **saved,
        "data": {**saved["data"], "dir": "/evaluated/here"},
        "training": {**saved["training"], "device": "cpu"},
    }
    for unusable in ({**saved, "training": None}, {"data": saved["data"]}, {**saved, "data": []}, "a config"):
        with pytest.raises(ConfigMismatch) as refused:
            evaluation_config({"config": unusable}, given, source="ck/meta.json")
        assert str(refused.value) == "ck/meta.json has no usable config section"
    invalid = {**saved, "training": {**saved["training"], "max_steps": -1}}
    with pytest.raises(ConfigMismatch) as refused:
        evaluation_config({"config": invalid}, given, source="ck/meta.json")
    assert str(refused.value).startswith("the checkpoint's config is not valid for this version: ")
    assert "training.max_steps" in str(refused.value) and "\n" not in str(refused.value)


def test_metric_is_the_error_on_the_heldout_rows_not_the_training_rows(evaluated_run):
    config = load_config(CONFIG, evaluated_run.overrides)
    model = build_model(config)
    load_model_weights(model, load_file(evaluated_run.checkpoint / "modelo.safetensors"))
    model.eval()
    heldout = load_file(evaluated_run.data_dir / "heldout.safetensors")
    with torch.no_grad():
        by_hand = torch.mean((model(heldout["x"]) - heldout["y"]) ** 2).item()
    recorded = json.loads(evaluated_run.metrics.read_text())["metrics"]["mse"]
    assert recorded == pytest.approx(by_hand, rel=1e-12)


def test_evaluate_refuses_data_other_than_the_checkpoint_was_trained_on(trained_run, run_copy):
    run = run_copy(trained_run)
    other = run.root / "other_data"
    prepare_data(load_config(CONFIG, {"data.dir": str(other), "data.seed": 99}))
    config = load_config(CONFIG, {**run.overrides, "data.dir": str(other)})
    assert (
        load_manifest(load_config(CONFIG, {"data.dir": str(other), "data.seed": 99}))["fingerprint"]
        != load_manifest(load_config(CONFIG, run.overrides))["fingerprint"]
    )
    with pytest.raises(DataError) as refused:
        evaluate_checkpoint(config)
    assert str(refused.value) == (
        f"{other}/ holds data prepared with data.seed 99, but step-00000010 was trained on data prepared with "
        "1234: point data.dir at the data it was trained on"
    )


def test_evaluate_refuses_data_of_the_same_recipe_but_other_bytes(trained_run, run_copy):
    """Data prepared with the checkpoint's recipe (data.prepare, data.seed, data.params) whose
    bytes differ (a data.prepare that is not deterministic, run into a fresh folder): its
    manifest verifies, but its fingerprint is not the one the checkpoint was trained on."""
    from safetensors.torch import save_file

    from pipeline.hashing import fingerprint_table

    run = run_copy(trained_run)
    trained_on = load_manifest(load_config(CONFIG, run.overrides))["fingerprint"]
    heldout = run.data_dir / "heldout.safetensors"
    tensors = load_file(heldout)
    save_file({**tensors, "y": tensors["y"] + 1.0}, heldout)
    manifest = json.loads((run.data_dir / "manifest.json").read_text())
    manifest["files"]["heldout.safetensors"] = {
        "sha256": hashlib.sha256(heldout.read_bytes()).hexdigest(),
        "size": heldout.stat().st_size,
    }
    manifest["fingerprint"] = other = fingerprint_table(manifest["files"])
    (run.data_dir / "manifest.json").write_text(json.dumps(manifest))
    config = load_config(CONFIG, run.overrides)
    assert load_manifest(config)["fingerprint"] == other != trained_on
    with pytest.raises(DataError) as refused:
        evaluate_checkpoint(config)
    assert str(refused.value) == (
        f"{run.data_dir}/ holds data with fingerprint {other[:12]}, but step-00000010 was trained on "
        f"{trained_on[:12]}: its held-out split is not this one; point data.dir at the data the checkpoint "
        "was trained with"
    )


def test_a_sample_that_is_not_text_is_refused_in_one_line(data_dir, tmp_path):
    """04 writes a task's sample() into metrics.json and 05 onto the card: it must be text. The
    record's folder is made as needed (the weights' scratch copy goes beside it)."""
    from pipeline.errors import MetricsError
    from pipeline.train import train

    overrides = {
        "data.dir": str(data_dir),
        "data.factory": "trainer_factories:build_data_bytes_sample",
        "checkpoint.dir": str(tmp_path / "ck"),
        "outputs.metrics": str(tmp_path / "not" / "yet" / "metrics.json"),
        "training.max_steps": 2,
    }
    train(load_config(CONFIG, overrides), progress=False)
    with pytest.raises(MetricsError) as refused:
        evaluate_checkpoint(load_config(CONFIG, overrides))
    assert (
        str(refused.value)
        == "trainer_factories:build_data_bytes_sample: sample() must return a str, got bytes"
    )
    assert list((tmp_path / "not" / "yet").iterdir()) == []


def test_a_sample_that_raises_is_refused_in_one_line_naming_it(data_dir, tmp_path):
    """04 ends with one line naming data.factory's sample(), its error and where to look, and
    writes no record."""
    from pipeline.errors import FactoryFailed
    from pipeline.train import train

    factory = "trainer_factories:build_data_raising_sample"
    overrides = {
        "data.dir": str(data_dir),
        "data.factory": factory,
        "checkpoint.dir": str(tmp_path / "ck"),
        "outputs.metrics": str(tmp_path / "out" / "metrics.json"),
        "training.max_steps": 1,
    }
    train(load_config(CONFIG, overrides), progress=False)
    with pytest.raises(FactoryFailed) as refused:
        evaluate_checkpoint(load_config(CONFIG, overrides))
    assert str(refused.value) == (
        f"data.factory {factory} sample() failed: ValueError: no prompt to sample from "
        "(check data.params; --debug prints the traceback)"
    )
    assert list((tmp_path / "out").iterdir()) == []


def test_evaluate_refuses_a_checkpoint_whose_weights_changed(trained_run, run_copy):
    run = run_copy(trained_run)
    weights = run.checkpoint / "modelo.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match="modelo.safetensors"):
        evaluate_checkpoint(load_config(CONFIG, run.overrides))


@pytest.mark.parametrize("name", ["train.safetensors", "heldout.safetensors"])
def test_a_same_size_in_place_edit_of_a_prepared_data_file_is_refused_by_02_and_04(
    trained_run, run_copy, name
):
    run = run_copy(trained_run)
    path = run.data_dir / name
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # same size, one bit of the last value
    path.write_bytes(bytes(data))
    for script, args in (("02_train.py", ("--resume", "latest", "--quiet")), ("04_evaluate.py", ())):
        line = run.refused(script, *args)
        assert name in line and "changed since it was prepared" in line, (script, line)


HOLDER = (
    "import sys, time\n"
    "from pipeline.durable import scratch_folder\n"
    "with scratch_folder(sys.argv[1], 'evaluate-weights') as folder:\n"
    "    (folder / 'modelo.safetensors').write_bytes(b'x' * 4096)\n"
    "    print(folder, flush=True)\n"
    "    time.sleep(120)\n"
)


def test_a_weights_copy_left_by_a_killed_evaluate_is_removed_by_the_next_and_a_live_ones_is_kept(
    evaluated_run, run_copy
):
    """04 copies the weights beside its metrics: a SIGKILL leaves that copy behind, the next
    04 removes it (nobody holds its lock), and leaves alone the one of an evaluate still
    running; its own is gone when it returns."""
    import os
    import signal
    import subprocess
    import sys

    from support import script_env

    run = run_copy(evaluated_run)
    holders = [
        subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(run.root)], stdout=subprocess.PIPE, text=True, env=script_env()
        )
        for _ in range(2)
    ]
    try:
        killed, live = (Path(holder.stdout.readline().strip()) for holder in holders)
        os.kill(holders[0].pid, signal.SIGKILL)
        holders[0].wait()
        assert killed.is_dir() and live.is_dir()
        config = load_config(
            CONFIG,
            {
                "data.dir": str(run.data_dir),
                "checkpoint.dir": str(run.checkpoint_dir),
                "outputs.metrics": str(run.metrics),
            },
        )
        record = evaluate_checkpoint(config)
        assert record["step"] == 10
        assert not killed.exists(), "the killed evaluate's copy of the weights was left behind"
        assert (live / "modelo.safetensors").is_file(), "a running evaluate's copy was removed"
        assert [p.name for p in run.root.glob(".scratch-*")] == [live.name]
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()


def test_04_evaluates_in_eval_mode_for_a_task_whose_evaluate_does_not_set_it(data_dir, tmp_path):
    """A task's evaluate() that runs the model as it is handed (most do) gets it in eval mode:
    dropout (the default model's 0.1) off, so metrics.json records the weights' own held-out
    error, not a noisier one. Evaluated with training.device auto, the record names the device
    it resolved to; the weights copy is made beside the metrics (in another folder than the
    checkpoints'), where a killed evaluate's copy left behind is swept."""
    from pipeline.durable import _SUFFIX_HEX, SCRATCH_PREFIX
    from pipeline.train import train

    overrides = {
        "data.dir": str(data_dir),
        "data.factory": "trainer_factories:build_data_mode_blind_evaluate",
        "checkpoint.dir": str(tmp_path / "ck"),
        "outputs.metrics": str(tmp_path / "out" / "metrics.json"),
        "training.max_steps": 2,
    }
    config = load_config(CONFIG, overrides)
    assert config.model.params["dropout"] > 0
    checkpoint = train(config, progress=False).checkpoint
    left = tmp_path / "out" / f"{SCRATCH_PREFIX}evaluate-weights-{'0' * _SUFFIX_HEX}"
    left.mkdir(parents=True)
    record = evaluate_checkpoint(load_config(CONFIG, {**overrides, "training.device": "auto"}))
    assert record["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert (
        sorted(p.name for p in tmp_path.iterdir()) == ["ck", "out", "traces"]
        and list((tmp_path / "out").iterdir()) == []
    )
    device = torch.device(record["device"])
    model = build_model(config).to(device)
    load_model_weights(model, load_file(checkpoint / "modelo.safetensors"))
    model.eval()
    heldout = load_file(data_dir / "heldout.safetensors", device=str(device))
    with torch.no_grad():
        by_hand = torch.nn.functional.mse_loss(model(heldout["x"]), heldout["y"]).item()
    assert record["metrics"]["mse"] == by_hand


@pytest.mark.parametrize(
    ("metrics", "says"),
    [
        (
            {"mse": True},
            "metric 'mse' is True; metrics must map str to a number (or a set's name to such a mapping)",
        ),
        (
            {"heldout": {"mse": False}},
            "metric 'heldout/mse' is False; metrics must map str to a number (or a set's name to such a mapping)",
        ),
        ({"mse": float("inf")}, "held-out metric mse is inf: the checkpoint's weights are not usable"),
        ({"a/b": 1.0, "a": {"b": 2.0}}, "metric 'a/b' is named twice"),
    ],
    ids=["bool", "bool-in-a-set", "inf", "named-twice"],
)
def test_a_task_metric_that_is_a_bool_or_not_finite_or_named_twice_is_refused_in_one_line(metrics, says):
    """A bool is an int to Python, but no metric: a task returning one has a bug."""
    from pipeline.errors import MetricsError
    from pipeline.evaluate import check_metrics

    assert check_metrics({"mse": 1, "heldout": {"mae": 0.5}}, "task evaluate()") == {
        "mse": 1.0,
        "heldout/mae": 0.5,
    }
    with pytest.raises(MetricsError) as refused:
        check_metrics(metrics, "task evaluate()")
    assert str(refused.value) == f"task evaluate(): {says}"


def test_04_seeds_a_task_whose_evaluate_draws_so_its_record_is_the_same_every_time(data_dir, tmp_path):
    """04 seeds every RNG from the checkpoint's training.seed before it builds and evaluates:
    a metric that samples gives the same value however the process drew before, and whatever
    seed today's config.yaml holds."""
    from pipeline.train import train

    overrides = {
        "data.dir": str(data_dir),
        "data.factory": "trainer_factories:build_data_drawing_evaluate",
        "checkpoint.dir": str(tmp_path / "ck"),
        "training.max_steps": 1,
    }
    config = load_config(CONFIG, overrides)
    train(config, progress=False)
    torch.manual_seed(1)
    first = evaluate_checkpoint(config)["metrics"]
    torch.manual_seed(2)
    torch.rand(5)
    assert evaluate_checkpoint(config)["metrics"] == first
    assert set(first) == {"mse", "rmse", "noise", "train_mode", "grad_mode"} and first["train_mode"] == 0.0
    # The seed is the checkpoint's: a config.yaml edited since training evaluates the same.
    edited = load_config(CONFIG, {**overrides, "training.seed": config.training.seed + 1})
    assert evaluate_checkpoint(edited)["metrics"] == first
    # A checkpoint trained with another seed than the default draws other numbers.
    seven = load_config(CONFIG, {**overrides, "checkpoint.dir": str(tmp_path / "ck7"), "training.seed": 7})
    train(seven, progress=False)
    assert evaluate_checkpoint(seven)["metrics"]["noise"] != first["noise"]
