"""Gradient accumulation and evaluation during training, side by side, on the default task.

    python benchmarks/accumulate_evaluate.py [--steps 300] [--reps 5] [--out benchmarks/results/accumulate_evaluate.json]

Candidates, each a full ``pipeline.train`` run of ``config.yaml`` (float64, 1 thread) at
``training.log_every: 1`` (log lines written to a discarded stream), saving only at the end:

- ``batch 16``: one batch of 16 rows per optimizer step;
- ``4 x 4 accumulated``: ``data.batch_size: 4``, ``training.grad_accum_steps: 4``, the same
  effective batch of 16 rows;
- ``eval off``: ``batch_size`` 4, no evaluation (the default task's step);
- ``eval on, not due``: ``training.eval_every`` larger than the run (its one evaluation, at
  the last step, left out of the timing): what evaluation costs the steps it does not run at;
- ``eval every 10`` and ``eval every 1``: the task's ``evaluate`` on its 16 held-out rows, the
  RNG states saved and restored around it.

Seconds per optimizer step from the 20th step to the one before the last (start-up and the
last step's evaluation and save left out), candidates in an order rotated by the repetition
(``sidebyside.py``). Target: evaluation switched on costs the steps between evaluations
<= 2% of a step. The evaluations themselves are reported as ratios without a target: on this
task one evaluation (a forward pass over 16 rows) is a sizeable fraction of a step (a forward
and backward pass over 4 rows and an Adam update), so ``eval_every`` sets its share. The
accumulation ratio has no target either: four small forward/backward passes instead of one
over four times the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from sidebyside import loadavg, ratio, rotated, summary, target_table  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from pipeline.data import prepare_data  # noqa: E402
from pipeline.train import TrainingHooks, train  # noqa: E402

WARMUP = 20
CANDIDATES = {
    "batch 16": {"data.batch_size": 16},
    "4 x 4 accumulated": {"data.batch_size": 4, "training.grad_accum_steps": 4},
    "eval off": {},
    "eval on, not due": {"training.eval_every": 10**6},
    "eval every 10": {"training.eval_every": 10},
    "eval every 1": {"training.eval_every": 1},
}


def _config(root: Path, steps: int, overrides: dict):
    return load_config(
        HERE.parent / "config.yaml",
        {
            "data.dir": str(root / "data"),
            "checkpoint.dir": str(root / f"ck-{time.monotonic_ns()}"),
            "training.max_steps": steps,
            "training.log_every": 1,
            "checkpoint.every": steps,
            "checkpoint.async": False,
            **overrides,
        },
    )


def seconds_per_step(root: Path, steps: int, overrides: dict) -> float:
    stamps: list[float] = []
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        train(
            _config(root, steps, overrides),
            progress=True,
            hooks=TrainingHooks(on_step=lambda run: stamps.append(time.perf_counter())),
        )
    return (stamps[-2] - stamps[WARMUP - 1]) / (len(stamps) - 1 - WARMUP)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results" / "accumulate_evaluate.json"))
    args = parser.parse_args()
    results: dict[str, list[float]] = {name: [] for name in CANDIDATES}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare_data(_config(root, args.steps, {}))
        for rep in range(args.reps):
            loads.append(loadavg())
            for name in rotated(list(CANDIDATES), rep):
                results[name].append(seconds_per_step(root, args.steps, CANDIDATES[name]))
    print(f"{'candidate':<20} {'ms/step (median)':>17} {'min':>8} {'max':>8}")
    for name, values in results.items():
        s = summary(values)
        print(f"{name:<20} {1e3 * s['median']:>17.3f} {1e3 * s['min']:>8.3f} {1e3 * s['max']:>8.3f}")

    def overhead(name: str) -> list[float]:
        # The evaluation's cost per step as a fraction of a step without it, per repetition.
        return [1.0 + (a - b) / b for a, b in zip(results[name], results["eval off"])]

    ratios = [
        ratio(
            "accumulated / one batch",
            "time per step, 16 rows",
            results["4 x 4 accumulated"],
            results["batch 16"],
            None,
        ),
        ratio(
            "eval on, not due / off", "time per step", results["eval on, not due"], results["eval off"], 1.02
        ),
        ratio("eval every 10 / off", "time per step", results["eval every 10"], results["eval off"], None),
        ratio("eval every 1 / off", "time per step", results["eval every 1"], results["eval off"], None),
    ]
    print()
    print(target_table(ratios))
    print()
    for r in ratios:
        paired = f"{r.median_of_ratios:.3f}" if r.median_of_ratios is not None else "-"
        print(f"{r.label:<26} {r.scope:<24} ratio of medians {r.of_medians:.3f}, median of ratios {paired}")
    Path(args.out).write_text(
        json.dumps(
            {
                "steps": args.steps,
                "reps": args.reps,
                "seconds_per_step": {name: summary(values) for name, values in results.items()},
                "eval_overhead_per_step": {
                    n: overhead(n) for n in ("eval on, not due", "eval every 10", "eval every 1")
                },
                "ratios": [r.to_dict() for r in ratios],
                "load_average": loads,
                "torch": torch.__version__,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
