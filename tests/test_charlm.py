"""The character-level LM example (examples/charlm) through the real scripts, on a short run.

A tiny version of the same code paths (2 layers of width 32, 3000 bytes of text, 10 steps):
the tied embedding is stored once and loads strictly with safetensors alone, the card shows
the curve and a deterministic sample, the checkpoint holds the short batch at the end of an
epoch and the task's own offset generator, and scripts/03 proves the resume exact. Also:
the example's data prepared inside the default data folder (data/charlm/ in data/) leaves
both verifiable, and each shipped task has a data folder of its own.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_model

from localhub import LocalHub
from pipeline.checkpoint import load_model_weights, read_tensors
from pipeline.config import load_config, parse_set_overrides
from pipeline.errors import ConfigError
from pipeline.stage.card_parts import printable

from support import REPO, first_python_block, publish_stage, run_as_hub_user, run_script, script_env

CONFIG = REPO / "examples" / "charlm" / "config.yaml"
# The scripts import `examples.charlm` from their working folder; this process needs the same.
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))
# 3000 bytes -> 2700 training bytes -> 2700 // 32 - 1 = 83 windows: 5 batches of 16 and one of 3.
WINDOWS, BATCH = 83, 16
REPO_ID = "test/charlm"
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


# The tests that read the short run go to one xdist worker, so it is trained and staged once.
SHORT_RUN = pytest.mark.xdist_group("short-run")


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("charlm")
    overrides = {**TINY, "data.dir": str(root / "data"), "checkpoint.dir": str(root / "checkpoints")}
    args = _set_args(overrides)
    _ok("01_prepare_data.py", *args)
    _ok("02_train.py", *args, "--quiet")
    _ok("04_evaluate.py", *args, "--output", str(root / "metrics.json"))
    _ok(
        "05_stage.py",
        *args,
        "--metrics",
        str(root / "metrics.json"),
        "--stage",
        str(root / "stage"),
        "--repo-id",
        REPO_ID,
    )
    checkpoint = root / "checkpoints" / "step-00000010"
    assert (checkpoint / "meta.json").is_file()
    return {
        "root": root,
        "overrides": overrides,
        "args": args,
        "checkpoint": checkpoint,
        "stage": root / "stage",
        "config": _config(overrides),
    }


def _fresh_model(config):
    from examples.charlm.model import build_model

    return build_model(config)


def test_a_model_built_without_weights_keeps_its_tie_and_takes_the_configured_dtype():
    """The stage's model without weights (build_model on meta): every parameter on meta in
    training.dtype, and the tied head still the embedding's one parameter."""
    from pipeline.run import build_model

    model = build_model(_config({"training.dtype": "bfloat16"}), "meta")
    assert model.head.weight is model.embed.weight
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}


def _probe_ids(config) -> torch.Tensor:
    block = config.data.params["block_size"]
    return torch.arange(2 * block, dtype=torch.int64).remainder(97).add(32).view(2, block)


@SHORT_RUN
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


@SHORT_RUN
def test_card_snippet_alone_rebuilds_the_published_model_where_this_project_cannot_be_imported(
    short_run, tmp_path
):
    """Acceptance: published, downloaded, and the card's first Python block run in an empty
    folder by an interpreter that cannot import `pipeline` or `examples` leaves `model`
    holding exactly the published weights, built by the code the repo ships."""
    stage = short_run["stage"]
    # The model's code closure only: not the data factory, and of this project the one
    # self-contained helper the model imports (read_params), plus the loader the card calls.
    shipped = sorted(
        p.relative_to(stage / "code").as_posix() for p in (stage / "code").rglob("*") if p.is_file()
    )
    assert shipped == [
        "examples/__init__.py",
        "examples/charlm/__init__.py",
        "examples/charlm/model.py",
        "hub_loader.py",
        "pipeline/__init__.py",
        "pipeline/params.py",
    ]
    card = (stage / "README.md").read_text(encoding="utf-8")
    assert "Loading runs this repository's Python code" in card and 'revision = "main"' in card
    snippet = first_python_block(card)
    assert snippet.rstrip().endswith("model = load_model(folder)"), "a one-line loader"
    assert (
        "import pipeline" not in snippet
        and "from pipeline" not in snippet
        and "import examples" not in snippet
    )
    token = "charlm-test-token"
    with LocalHub(tmp_path / "hub", token=token) as hub:
        published = publish_stage(stage, hub.url, REPO_ID, token)
        assert published.returncode == 0, published.stdout + published.stderr
        # Uploaded over Xet, and verified by the Hub's Xet hash: no reconstruction, no xorb read during 06.
        assert hub.count("POST", r"/xorbs/") >= 1 and hub.count("GET", r"/reconstructions/|/_xet/data/") == 0
        check = """
import torch
from safetensors.torch import load_file
stored = load_file(folder / "modelo.safetensors")
state = model.state_dict()
assert set(stored) < set(state) and len(state) - len(stored) == 1, "one tied alias"
for name, tensor in stored.items():
    assert tensor.dtype == state[name].dtype and torch.equal(tensor.view(torch.uint8), state[name].view(torch.uint8)), name
assert model.head.weight is model.embed.weight, "the tie survives"
assert sys.modules[type(model).__module__].__file__.startswith(str(folder)), "the repo's own code built it"
print("LOADED", sum(p.numel() for p in model.parameters()))
"""
        result = run_as_hub_user(snippet + "\n" + check, tmp_path / "empty", hub.url, token)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "LOADED" in result.stdout


@SHORT_RUN
def test_sharded_stage_splits_below_the_size_publishes_in_one_commit_and_loads_from_the_card(
    short_run, tmp_path
):
    """``--max-shard-size``: several files none above it, an index, their union the checkpoint's
    tensors bit for bit, every file in the manifest, one commit, and the card's snippet loads it."""
    from huggingface_hub import HfApi

    from pipeline.audit import audit_stage

    stage, limit = tmp_path / "sharded", 40_000
    _ok(
        "05_stage.py",
        *short_run["args"],
        "--metrics",
        str(short_run["root"] / "metrics.json"),
        "--stage",
        str(stage),
        "--repo-id",
        "test/sharded",
        "--max-shard-size",
        "40KB",
    )
    shards = sorted(p.name for p in stage.glob("modelo-*.safetensors"))
    assert len(shards) >= 3 and not (stage / "modelo.safetensors").exists()
    assert shards == [f"modelo-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert all((stage / name).stat().st_size <= limit for name in shards)
    index = json.loads((stage / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    union = {}
    for name in shards:
        with safe_open(str(stage / name), framework="pt") as handle:
            assert not set(handle.keys()) & set(union), "a tensor in two shards"
            union.update({key: handle.get_tensor(key) for key in handle.keys()})
    stored = read_tensors(short_run["checkpoint"] / "modelo.safetensors")
    assert union.keys() == stored.keys() and index["weight_map"].keys() == stored.keys()
    assert all(torch.equal(union[k].view(torch.uint8), stored[k].view(torch.uint8)) for k in stored)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
    files = {p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file()}
    assert set(audit_stage(stage)) == files and set(shards) <= files
    token = "shard-test-token"
    with LocalHub(tmp_path / "hub", token=token) as hub:
        published = publish_stage(stage, hub.url, "test/sharded", token)
        assert published.returncode == 0, published.stdout + published.stderr
        commits = HfApi(endpoint=hub.url, token=token).list_repo_commits("test/sharded")
        assert len(commits) == 2, (
            "the repo's initial commit and one publication"
        )  # create_repo adds the first
        check = """
import json, torch
from safetensors.torch import load_file
state = model.state_dict()
index = json.loads((folder / "model.safetensors.index.json").read_text())
for file in sorted(set(index["weight_map"].values())):
    for name, tensor in load_file(folder / file).items():
        assert torch.equal(tensor.view(torch.uint8), state[name].view(torch.uint8)), name
print("SHARDS LOADED")
"""
        card = (stage / "README.md").read_text(encoding="utf-8")
        result = run_as_hub_user(first_python_block(card) + "\n" + check, tmp_path / "empty", hub.url, token)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SHARDS LOADED" in result.stdout


@SHORT_RUN
def test_publishing_to_another_repo_than_the_card_names_is_refused_unless_forced(short_run, tmp_path):
    from support import one_line_error

    stage = tmp_path / "stage"
    shutil.copytree(short_run["stage"], stage)
    token = "repo-id-test-token"
    with LocalHub(tmp_path / "hub", token=token) as hub:
        refused = publish_stage(stage, hub.url, "someone/else", token)
        assert refused.returncode == 2 and "was staged for test/charlm" in one_line_error(refused)
        # The fix it prints restages the config 06 was given, as printed.
        refused = publish_stage(stage, hub.url, "someone/else", token, "--config", str(CONFIG))
        assert refused.returncode == 2
        assert (
            f"scripts/05_stage.py --config {CONFIG} --stage {stage} --repo-id someone/else, or pass "
            "--force-repo-id" in one_line_error(refused)
        )
        assert hub.count("POST") == 0, "nothing was sent"
        forced = publish_stage(stage, hub.url, "someone/else", token, "--force-repo-id")
        assert forced.returncode == 0, forced.stdout + forced.stderr


@SHORT_RUN
def test_card_shows_the_training_curve_and_the_sample_that_the_weights_generate(short_run):
    stage = short_run["stage"]
    card = (stage / "README.md").read_text(encoding="utf-8")
    assert (stage / "training_curve.png").read_bytes().startswith(b"\x89PNG")
    assert "training_curve.png" in card
    recorded = json.loads((short_run["root"] / "metrics.json").read_text(encoding="utf-8"))
    assert set(recorded["metrics"]) == {"loss", "bits_per_char"}
    sample = recorded["sample"]
    assert sample.startswith("HAMLET:\n") and len(sample) > len("HAMLET:\n")
    # An undertrained model samples control bytes: the card shows them escaped, as text.
    assert "## Sample" in card and printable(sample[len("HAMLET:\n") :].strip()) in card

    # The same text again, in this process: sample() depends on the weights alone, and
    # leaves the run's RNGs and the model's mode as it found them.
    from examples.charlm.data import build_data

    config = short_run["config"]
    model = _fresh_model(config)
    load_model(model, str(stage / "modelo.safetensors"), strict=True)
    data = build_data(config, Path(config.data.dir))
    before = (
        random.getstate(),
        np.random.get_state(legacy=False)["state"]["key"].tobytes(),
        torch.get_rng_state(),
    )
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the 04 process: the same kernels, so the same rounding
    try:
        assert data.sample(model, torch.device("cpu")) == sample
    finally:
        torch.set_num_threads(threads)
    assert model.training
    after = (
        random.getstate(),
        np.random.get_state(legacy=False)["state"]["key"].tobytes(),
        torch.get_rng_state(),
    )
    assert before[:2] == after[:2] and torch.equal(before[2], after[2])


@SHORT_RUN
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


@SHORT_RUN
def test_resume_proof_passes_on_a_short_run_with_an_epoch_boundary_after_the_cut(short_run, tmp_path):
    output = tmp_path / "proof"
    # One process per phase: legs sharing a process end as in their own (test_resume_proof).
    result = _run("03_verify_resume.py", *short_run["args"], "--output", str(output), "--jobs", "1")
    assert result.returncode == 0, f"03 exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    report = json.loads((output / "verification.json").read_text(encoding="utf-8"))
    assert report["all_checks_passed"] and report["positive"] and report["negative_divergence_detected"]
    assert report["boundary"]["first_step_of_a_new_epoch_after_cut"] is not None
    negative = report["components"]["negative"]
    # Leaving out the data state (sampler position and the offset generator) must show.
    for component in ("rng", "optimizer", "scheduler", "data"):
        assert negative[component]["result"] == "detected", (component, negative[component])

    # The proof travels with the model it proves: staged without machine paths, its verdict on the card.
    stage = tmp_path / "stage"
    stage_args = (
        *short_run["args"],
        "--metrics",
        str(short_run["root"] / "metrics.json"),
        "--stage",
        str(stage),
    )
    _ok("05_stage.py", *stage_args, "--proof", str(output))
    staged = (stage / "verification.json").read_text(encoding="utf-8")
    for machine in (str(tmp_path), str(REPO), str(Path.home()) + "/"):
        assert machine not in staged
    assert json.loads(staged)["sources"]["package"] == report["sources"]["package"], "sources' SHA-256 kept"
    card = (stage / "README.md").read_text(encoding="utf-8")
    assert "Resuming this training run is **proven**" in card and "rng: detected" in card
    assert "[`verification.json`](verification.json)" in card

    # A proof of another config, or of other code, is refused with one line; the stage is untouched.
    for where, change in (
        (("sources", "config", "resolved", "model", "params"), {"d_model": 48}),
        (("sources", "package"), {"fingerprint": "0" * 64}),
    ):
        other = tmp_path / f"other-{len(where)}"
        other.mkdir()
        edited = json.loads(json.dumps(report))
        node = edited
        for key in where:
            node = node[key]
        node.update(change)
        (other / "verification.json").write_text(json.dumps(edited), encoding="utf-8")
        result = _run("05_stage.py", *stage_args, "--proof", str(other))
        assert result.returncode == 2, result.stdout + result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and ("proves other code" in lines[0] or "proves another config" in lines[0]), (
            lines
        )
    assert (stage / "verification.json").read_text(encoding="utf-8") == staged


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"model.params.n_head": "3"},
            "model.params.d_model (128) must be a multiple of model.params.n_head (3)",
        ),
        ({"model.params.depth": "2"}, "unknown key model.params.depth"),
        ({"data.params.block_size": "0"}, "data.params.block_size must be >= 1"),
        ({"data.params.sample_temperature": "0"}, "data.params.sample_temperature must be > 0"),
    ],
)
def test_example_params_are_validated_with_the_key_named(overrides, message):
    from examples.charlm.data import data_params

    config = _config(overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _fresh_model(config)  # the model factory validates model.params and the block size it reads
        data_params(config)  # the data factory the rest of data.params


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


def test_each_shipped_task_has_its_own_data_folder_so_examples_run_in_any_order(tmp_path, monkeypatch):
    """The example's data first, then the default config's 01: neither replaces the other."""
    from pipeline.data import load_manifest, prepare_data

    monkeypatch.chdir(tmp_path)  # the configs' own relative data.dir, as a user runs them
    default, example = load_config(REPO / "config.yaml", {}), _config(TINY)
    assert (default.data.dir, example.data.dir) == ("data/regression", "data/charlm")
    for config in (example, default):
        _, _, changed = prepare_data(config)
        assert changed
    assert load_manifest(default)["fingerprint"] != load_manifest(example)["fingerprint"]
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["charlm", "regression"]
