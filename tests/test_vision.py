"""examples/vision, small: 24 pictures prepared with datasets, 6 steps read by 2 DataLoader
workers with per-sample crops and flips, evaluated, staged, published to the loopback Hub,
and loaded back by the card's snippet where this project cannot be imported. Steps 01 to 05
run the functions the scripts call, in this process (each script start costs seconds);
06 and the Hub user's snippet run as their own processes."""

from __future__ import annotations

import sys

from localhub import LocalHub
from pipeline.config import load_config
from pipeline.data import prepare_data
from pipeline.evaluate import evaluate_checkpoint, write_metrics
from pipeline.stage import build_stage
from pipeline.train import train

from support import REPO, first_python_block, publish_stage, run_as_hub_user

CONFIG = REPO / "examples" / "vision" / "config.yaml"
# The factories import `examples.vision` from the working folder, as for a user.
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))
REPO_ID = "test/vision"


def test_the_vision_example_goes_from_its_images_to_a_published_repo_that_the_card_loads(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # datasets' cache of the parquet files
    config = load_config(
        CONFIG,
        {
            "data.dir": str(tmp_path / "data"),
            "checkpoint.dir": str(tmp_path / "ck"),
            "data.params.num_train": 24,
            "data.params.num_heldout": 12,
            "data.batch_size": 8,
            "training.max_steps": 6,
            "checkpoint.every": 3,
            "scheduler.params.warmup_steps": 2,
        },
    )
    assert config.data.num_workers == 2
    prepare_data(config)
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [
        "heldout.parquet",
        "manifest.json",
        "train.parquet",
    ]
    result = train(config, progress=False)
    assert result.step == 6 and result.history["loss"][-1] < result.history["loss"][0]
    record = evaluate_checkpoint(config)
    assert set(record["metrics"]) == {"accuracy", "loss", "perplexity"}
    metrics = write_metrics(record, config, tmp_path / "metrics.json")
    stage = tmp_path / "stage"
    build_stage(config, stage_dir=stage, metrics=metrics, repo_id=REPO_ID)
    card = (stage / "README.md").read_text(encoding="utf-8")
    assert "pipeline_tag: image-classification" in card and "accuracy" in card
    snippet = first_python_block(card)
    token = "vision-test-token"
    check = """
import torch
from safetensors.torch import load_file
stored = load_file(folder / "modelo.safetensors")
state = model.state_dict()
assert set(stored) == set(state)
assert all(torch.equal(stored[name], state[name]) for name in stored)
print("CLASSES", model(torch.zeros(2, 3, 16, 16)).shape[1])
"""
    with LocalHub(tmp_path / "hub", token=token) as hub:
        published = publish_stage(stage, hub.url, REPO_ID, token)
        assert published.returncode == 0, published.stdout + published.stderr
        loaded = run_as_hub_user(snippet + "\n" + check, tmp_path / "empty", hub.url, token)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    assert "CLASSES 3" in loaded.stdout
