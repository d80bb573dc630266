"""--init-from warm-starts weights only, shape-tolerant, and says what it loaded."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pipeline.checkpoint import CheckpointStore

from support import data_args, run_script, train


@pytest.fixture(scope="module")
def base(data_dir, tmp_path_factory):
    """Prepared data and a 4-step checkpoint to start from."""
    root = tmp_path_factory.mktemp("base")
    assert train(data_dir, root / "ckpt", "--max-steps", "4").returncode == 0
    return data_dir, root / "ckpt" / "step-00000004"


def test_init_from_a_checkpoint_of_another_width_reports_loaded_skipped_new(base, tmp_path):
    data_dir, source = base

    result = run_script(
        "02_train.py",
        *data_args(data_dir),
        "--checkpoint-dir",
        str(tmp_path / "wide"),
        "--max-steps",
        "2",
        "--init-from",
        str(source),
        "--set",
        "model.params.hidden=8",
    )
    assert result.returncode == 0, result.stderr
    assert "loaded 1, skipped 5, new 0" in result.stderr
    assert "skipped: net.0.weight (shape (16, 3) vs (8, 3))" in result.stderr
    assert CheckpointStore(tmp_path / "wide").committed_steps() == [2]


def test_init_from_same_architecture_starts_a_new_run_from_those_weights(base, tmp_path):
    data_dir, source = base
    fresh = train(data_dir, tmp_path / "fresh", "--max-steps", "1")
    warm = train(data_dir, tmp_path / "warm", "--max-steps", "1", "--init-from", str(source))
    assert fresh.returncode == warm.returncode == 0, warm.stderr
    step_one = lambda folder: load_file(tmp_path / folder / "step-00000001" / "modelo.safetensors")  # noqa: E731
    assert not torch.equal(step_one("fresh")["net.0.weight"], step_one("warm")["net.0.weight"])
    # A new run: its history starts at step 1, not where the source stopped.
    state = load_file(tmp_path / "warm" / "step-00000001" / "estado_treino.safetensors")
    assert state["history/step"].tolist() == [1]


def test_init_from_and_resume_together_are_refused(base, tmp_path):
    data_dir, source = base
    result = train(data_dir, tmp_path / "x", "--resume", "latest", "--init-from", str(source))
    assert result.returncode == 2 and "exclude each other" in result.stderr
