"""The input pipeline's cost, side by side: steps per second of a data-bound task through
``pipeline.train`` (a DataLoader over the sampler's copy, per-sample seeding, the checks,
checkpoints) and through the same DataLoader loop written by hand without any of it, with 0
and 2 workers.

    python benchmarks/dataloader.py [--steps 60] [--reps 3] [--work-ms 4] [--out benchmarks/results/dataloader.json]

Each sample costs about ``--work-ms`` of CPU in ``__getitem__`` (NumPy arithmetic standing in
for decoding and augmenting an image); the model is one small linear layer, so the step is
bound by the data. Steps per second are measured from the 10th step on (worker start-up
left out), candidates interleaved per repetition; the table shows medians and the ratios
of medians. Expect 2 workers to beat 0 by up to 2x on 2 idle cores, and ours / hand near 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from pipeline.config import load_config  # noqa: E402
from pipeline.data import prepare_data  # noqa: E402
from pipeline.train import TrainingHooks, train  # noqa: E402

WARMUP = 10
ROWS, FEATURES, BATCH = 4096, 64, 8


class Busy(torch.utils.data.Dataset):
    """Each sample: about ``work_ms`` of NumPy work, then a noisy feature vector."""

    def __init__(self, work_ms: float) -> None:
        self.loops = max(1, int(work_ms * 4))
        self.target = torch.linspace(-1, 1, FEATURES, dtype=torch.float32)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = np.random.standard_normal((64, 64))
        for _ in range(self.loops):
            block = np.tanh(block @ block.T / 64)
        x = torch.from_numpy(block[0].astype(np.float32)) + torch.randn(FEATURES) * 0.01
        return x, (x * self.target).sum(0, keepdim=True)


class BusyTask:
    def __init__(self) -> None:
        self.train_dataset = Busy(float(os.environ.get("BENCH_WORK_MS", "4")))

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        return {}


def build_data(config, data_dir: Path) -> BusyTask:
    return BusyTask()


def build_model(config) -> torch.nn.Module:
    return torch.nn.Linear(FEATURES, 1)


def _config(root: Path, workers: int, steps: int):
    return load_config(
        HERE.parent / "config.yaml",
        {
            "data.dir": str(root / "data"),
            "checkpoint.dir": str(root / f"ck-{workers}-{time.monotonic_ns()}"),
            "data.factory": "dataloader:build_data",
            "model.factory": "dataloader:build_model",
            "data.batch_size": BATCH,
            "data.num_workers": workers,
            "training.max_steps": steps,
            "training.dtype": "float32",
            "checkpoint.every": 10**6,
            "training.deterministic": False,
        },
    )


def ours(root: Path, workers: int, steps: int) -> float:
    stamps: list[float] = []
    train(
        _config(root, workers, steps),
        progress=False,
        hooks=TrainingHooks(on_step=lambda run: stamps.append(time.perf_counter())),
    )
    return (len(stamps) - WARMUP) / (stamps[-1] - stamps[WARMUP - 1])


def by_hand(root: Path, workers: int, steps: int) -> float:
    """The loop a user writes: shuffled DataLoader, forward, backward, step; no checkpoints."""
    torch.manual_seed(0)
    model = build_model(None)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    task = BusyTask()
    loader = torch.utils.data.DataLoader(
        task.train_dataset,
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(0),
    )
    stamps: list[float] = []
    for step, batch in enumerate(loader, start=1):
        loss = task.loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        stamps.append(time.perf_counter())
        if step == steps:
            break
    return (len(stamps) - WARMUP) / (stamps[-1] - stamps[WARMUP - 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--work-ms", type=float, default=4.0)
    parser.add_argument("--out", default=str(HERE / "results" / "dataloader.json"))
    args = parser.parse_args()
    os.environ["BENCH_WORK_MS"] = str(args.work_ms)
    torch.set_num_threads(1)
    candidates = {
        f"{name}, {w} workers": (fn, w) for w in (0, 2) for name, fn in (("ours", ours), ("hand", by_hand))
    }
    results: dict[str, list[float]] = {name: [] for name in candidates}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare_data(_config(root, 0, args.steps))
        for _ in range(args.reps):
            for name, (fn, workers) in candidates.items():
                results[name].append(fn(root, workers, args.steps))
    medians = {name: statistics.median(values) for name, values in results.items()}
    print(f"{'candidate':<20} {'steps/s (median)':>17} {'min':>8} {'max':>8}")
    for name, values in results.items():
        print(f"{name:<20} {medians[name]:>17.1f} {min(values):>8.1f} {max(values):>8.1f}")
    ratios = {
        "ours / hand, 0 workers": medians["ours, 0 workers"] / medians["hand, 0 workers"],
        "ours / hand, 2 workers": medians["ours, 2 workers"] / medians["hand, 2 workers"],
        "ours 2 workers / ours 0 workers": medians["ours, 2 workers"] / medians["ours, 0 workers"],
    }
    for name, value in ratios.items():
        print(f"{name:<32} {value:.2f}x")
    Path(args.out).write_text(
        json.dumps(
            {
                "steps": args.steps,
                "reps": args.reps,
                "work_ms": args.work_ms,
                "steps_per_second": results,
                "medians": medians,
                "ratios": ratios,
                "load_average": os.getloadavg(),
                "torch": torch.__version__,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
