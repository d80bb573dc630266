"""Helpers shared by the tests: run the real scripts as subprocesses and compare checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


# Variables that would change what a script does (a real token, a real endpoint).
_SCRUBBED_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT")


def script_env(**extra: str) -> dict[str, str]:
    """The environment for a script: this one, without tokens or endpoint, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_TELEMETRY": "1"})
    env.update(extra)
    return env


def run_script(name: str, *args: str, cwd: Path = REPO, env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``scripts/<name>`` with the test interpreter; never raises on a non-zero exit."""
    return subprocess.run([PYTHON, "-B", str(REPO / "scripts" / name), *args], cwd=cwd, env=env or script_env(),
                          capture_output=True, text=True, timeout=timeout)


def data_args(data_dir: Path) -> list[str]:
    return ["--set", f"data.dir={data_dir}"]


def prepare_data(data_dir: Path, *extra: str) -> None:
    result = run_script("01_prepare_data.py", *data_args(data_dir), *extra)
    assert result.returncode == 0, result.stderr


def train(data_dir: Path, checkpoint_dir: Path, *args: str, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess:
    return run_script("02_train.py", *data_args(data_dir), "--checkpoint-dir", str(checkpoint_dir), "--quiet",
                      *args, env=env)


def assert_checkpoints_bitwise_equal(a: Path, b: Path) -> None:
    """Every tensor of both safetensors files equal in name, dtype, shape and bits."""
    for name in ("modelo.safetensors", "estado_treino.safetensors"):
        left, right = load_file(a / name), load_file(b / name)
        assert left.keys() == right.keys(), f"{name}: tensor names differ: {sorted(left.keys() ^ right.keys())}"
        differing = [k for k in left if left[k].dtype != right[k].dtype or not torch.equal(left[k], right[k])]
        assert not differing, f"{name}: tensors differ: {differing[:5]}"


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The single ``error: ...`` line of a refused run; fails on a traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def train_until_killed(config_path: str, overrides: dict, started) -> None:
    """Child-process body for the SIGKILL test: resume (or start) and train, setting
    ``started`` once the first step has run so the parent kills a training process."""
    from pipeline.config import load_config
    from pipeline.train import TrainingHooks
    from pipeline.train import train as train_in_process

    config = load_config(config_path, overrides)
    train_in_process(config, resume="auto", progress=False, hooks=TrainingHooks(on_step=lambda run: started.set()))


def verify_checkpoint(folder: Path) -> dict:
    """Verify every file of a checkpoint folder (no tensors built) and return its meta.json."""
    from pipeline.checkpoint import load_checkpoint

    return load_checkpoint(folder, tensors=False).meta
