"""Time per optimizer step, side by side: script 02's training, a plain PyTorch loop and
transformers' Trainer, on the same model, data, batch, optimizer, schedule, seed and threads.

    python benchmarks/throughput.py [--reps 3] [--steps 100] [--warmup 10] [--threads 1]
                                    [--out benchmarks/results/throughput.json]

The task (``throughput_task.py``): a 4-layer byte-level transformer LM (width 128, context 64,
0.87M parameters, float32), batches of 16 windows of random bytes read from a map-style dataset
by a ``DataLoader`` with no workers; AdamW (matrices decay, vectors do not), linear warmup then
cosine (``pipeline.factories.warmup_cosine``'s rule), gradient clipping at 1.0, seed 0,
``--threads`` intra-op threads and deterministic algorithms, set alike in every candidate:

- ``02``: ``pipeline.train`` on a config naming the task's factories by import path, as a
  user's own model is plugged in: a checkpoint every 50 steps (``checkpoint.async`` as the
  default config has it: on), TensorBoard traces on, a log line every step
  (``training.log_every: 1``, into a file);
- ``plain loop``: what a user writes: ``DataLoader(shuffle=True)``, forward, backward, clip,
  ``optimizer.step()``, ``scheduler.step()``; nothing logged, nothing saved;
- ``transformers Trainer``: ``Trainer(model, args, train_dataset, optimizers=(the same
  optimizer, the same schedule))`` with ``save_steps=50`` (safetensors weights plus its pickled
  optimizer, scheduler and RNG files), ``save_total_limit=1``, ``logging_steps=1``,
  ``report_to=tensorboard``, no evaluation, ``max_grad_norm=1.0``.

Each candidate runs in a fresh process per repetition (the rotated order of ``sidebyside.py``:
02, plain, Trainer; plain, Trainer, 02; ...); each stamps the time after every optimizer step
from inside the run (02: ``TrainingHooks.on_step``; Trainer: a callback's ``on_step_end``; the
loop: after ``scheduler.step()``), so process start, imports and the model's build are left
out. Measured: steps ``warmup + 1`` to ``warmup + steps`` (``--steps`` a multiple of 50, so each
candidate's window holds the same number of saves; the save of step 50 falls in step 51's
time, as both 02 and Trainer save after the step's stamp); the run goes two steps further so
that its last save and teardown fall outside. The window's mean step time is the figure (the
saves included); the median single step (saves excluded) is reported beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from sidebyside import loadavg, ratio, rotated, summary, target_table  # noqa: E402

CANDIDATES = ("02", "plain loop", "transformers Trainer")
# 02 with one thing changed, for finding where its time goes (``--only``; no targets).
VARIANTS = {
    "02 without saves": {"checkpoint.every": 10**6},  # only the last step's, outside the window
    "02 sync save": {"checkpoint.async": False},
    "02 get_batch": {"data.factory": "throughput_task:build_batches"},  # no DataLoader, no per-sample seeds
}
SAVE_EVERY = 50
SEED = 0
BATCH = 16
LR, WEIGHT_DECAY, BETAS, EPS = 1e-3, 0.1, (0.9, 0.999), 1e-8
WARMUP_STEPS, MIN_RATIO = 10, 0.1
CLIP = 1.0
MODEL = {"width": 128, "layers": 4, "heads": 4, "context": 64}
DATA = {"windows": 4096, "context": 64}


def pipeline_config(root: Path, total: int, threads: int, tag: str, changes: dict | None = None) -> Any:
    from pipeline.config import load_config

    return load_config(
        REPO / "config.yaml",
        {
            "data.prepare": "throughput_task:prepare",
            "data.factory": "throughput_task:build_data",
            "data.dir": str(root / "data"),
            "data.batch_size": BATCH,
            "data.params": dict(DATA),
            "model.factory": "throughput_task:build_model",
            "model.name": "throughput-tinylm",
            "model.params": dict(MODEL),
            "optimizer.factory": "pipeline.factories:adamw",
            "optimizer.lr": LR,
            "optimizer.weight_decay": WEIGHT_DECAY,
            "optimizer.params": {"betas": list(BETAS), "eps": EPS},
            "scheduler.factory": "pipeline.factories:warmup_cosine",
            "scheduler.params": {"warmup_steps": WARMUP_STEPS, "min_ratio": MIN_RATIO},
            "training.seed": SEED,
            "training.max_steps": total,
            "training.dtype": "float32",
            "training.grad_clip": CLIP,
            "training.deterministic": True,
            "training.threads": threads,
            "training.log_every": 1,
            "checkpoint.dir": str(root / f"ck-{tag}"),
            "checkpoint.every": SAVE_EVERY,
            "outputs.traces": str(root / f"traces-{tag}"),
            **(changes or {}),
        },
    )


# -- the three candidates, each run in a worker process ------------------------------------------


def _stamp() -> tuple[float, float]:
    """Wall time and this process's CPU time (every thread's: a background save's too)."""
    return time.perf_counter(), time.process_time()


def _seen() -> dict[str, Any]:
    """What the run computes under, read from inside it (the same for every candidate)."""
    import torch

    return {
        "intra_op_threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def run_02(
    root: Path, total: int, threads: int, tag: str, changes: dict | None = None
) -> tuple[list[tuple[float, float]], dict]:
    from pipeline.train import TrainingHooks, train

    stamps: list[tuple[float, float]] = []
    seen: dict[str, Any] = {}

    def on_step(run: Any) -> None:
        stamps.append(_stamp())
        if run.step == total - 1:
            seen.update(_seen())

    config = pipeline_config(root, total, threads, tag, changes)
    train(config, progress=True, hooks=TrainingHooks(on_step=on_step))
    return stamps, seen


def _same_settings(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)


def _model_and_optimizer(root: Path, total: int) -> tuple[Any, Any, Any, Any]:
    """The model, AdamW with 02's ``adamw`` groups, the warmup-cosine schedule, the dataset."""
    import numpy as np
    import torch
    from throughput_task import TOKENS_FILE, TinyLM, Windows

    torch.manual_seed(SEED)
    model = TinyLM(**MODEL)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=BETAS,
        eps=EPS,
    )

    def factor(step: int) -> float:
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        progress = min(1.0, (step - WARMUP_STEPS) / max(1, total - WARMUP_STEPS))
        return MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return model, optimizer, scheduler, Windows(np.load(root / "data" / TOKENS_FILE), DATA["context"])


def run_plain(root: Path, total: int, threads: int, tag: str) -> tuple[list[tuple[float, float]], dict]:
    import torch

    _same_settings(threads)
    model, optimizer, scheduler, dataset = _model_and_optimizer(root, total)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(SEED)
    )
    model.train()
    stamps: list[tuple[float, float]] = []
    seen: dict[str, Any] = {}
    step = 0
    while step < total:
        for batch in loader:
            loss = model(**batch)["loss"]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            scheduler.step()
            step += 1
            stamps.append(_stamp())
            if step == total - 1:
                seen.update(_seen())
            if step == total:
                break
    return stamps, seen


def run_trainer(root: Path, total: int, threads: int, tag: str) -> tuple[list[tuple[float, float]], dict]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    _same_settings(threads)
    model, optimizer, scheduler, dataset = _model_and_optimizer(root, total)
    stamps: list[tuple[float, float]] = []
    seen: dict[str, Any] = {}

    class Stamps(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            stamps.append(_stamp())
            if state.global_step == total - 1:
                seen.update(_seen())

    args = TrainingArguments(
        output_dir=str(root / f"trainer-{tag}"),
        max_steps=total,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1,
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=CLIP,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_EVERY,
        save_total_limit=1,
        eval_strategy="no",
        report_to=["tensorboard"],
        use_cpu=True,
        seed=SEED,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=dataset,
        optimizers=(optimizer, scheduler),
        callbacks=[Stamps()],
    )
    trainer.train()
    return stamps, seen


RUNNERS = {
    "02": run_02,
    "plain loop": run_plain,
    "transformers Trainer": run_trainer,
    **{name: functools.partial(run_02, changes=changes) for name, changes in VARIANTS.items()},
}


def worker(name: str, root: Path, total: int, threads: int, tag: str, result: Path) -> None:
    pauses: list[tuple[float, float, int]] = []  # Python's garbage collections: (start, seconds, generation)
    started = [0.0]

    def collected(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((started[0], time.perf_counter() - started[0], info["generation"]))

    gc.callbacks.append(collected)
    stamps, seen = RUNNERS[name](root, total, threads, tag)
    gc.callbacks.remove(collected)
    result.write_text(json.dumps({"stamps": stamps, "seen": seen, "gc": pauses}))


# -- the side-by-side run ------------------------------------------------------------------------


def run_candidate(name: str, root: Path, args: argparse.Namespace, rep: int) -> dict[str, Any]:
    """One candidate in a fresh process: its per-step times over the measured window."""
    tag = f"{list(RUNNERS).index(name)}-{rep}"
    total = args.warmup + args.steps + 2
    result = root / f"result-{tag}.json"
    log = root / f"log-{tag}.txt"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        name,
        "--root",
        str(root),
        "--total",
        str(total),
        "--threads",
        str(args.threads),
        "--tag",
        tag,
        "--result",
        str(result),
    ]
    with open(log, "wb") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        sys.exit(f"{name} failed (exit {done.returncode}); its output:\n{log.read_text()[-4000:]}")
    report = json.loads(result.read_text())
    stamps = report["stamps"]
    if len(stamps) != total:
        sys.exit(f"{name} stamped {len(stamps)} steps, not {total}")
    # stamps[k] is the time after step k + 1: the window is steps warmup + 1 .. warmup + steps.
    cpu = [c for _, c in stamps[args.warmup - 1 : args.warmup + args.steps]]
    window = [w for w, _ in stamps[args.warmup - 1 : args.warmup + args.steps]]
    steps = [b - a for a, b in zip(window, window[1:])]
    save_steps = [
        s for s in range(args.warmup + 1, args.warmup + args.steps + 1) if (s - 1) % SAVE_EVERY == 0
    ]
    median = statistics.median(steps)
    collections = [
        (seconds, generation)
        for start, seconds, generation in report["gc"]
        if window[0] <= start < window[-1]
    ]
    return {
        "gc_per_step": sum(seconds for seconds, _ in collections) / args.steps,
        "gc_full": sum(1 for _, generation in collections if generation == 2),
        "mean": (window[-1] - window[0]) / args.steps,
        "cpu": (cpu[-1] - cpu[0]) / args.steps,
        "median": median,
        "save_extra": [steps[s - args.warmup - 1] - median for s in save_steps],
        "steps": steps,
        "seen": report["seen"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help="measured steps, a multiple of 50")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out at the start")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of every candidate")
    parser.add_argument(
        "--only",
        default=",".join(CANDIDATES),
        help=f"a comma-separated choice of {', '.join(RUNNERS)} (default: the first three)",
    )
    parser.add_argument("--tmp-parent", default=None, help="where the runs write (default: the system's)")
    parser.add_argument("--out", default=str(HERE / "results" / "throughput.json"))
    # One candidate's run, in the worker process.
    parser.add_argument("--worker", choices=list(RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--total", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, Path(args.root), args.total, args.threads, args.tag, Path(args.result))
        return
    if args.steps < SAVE_EVERY or args.steps % SAVE_EVERY or args.warmup < 1 or args.reps < 1:
        parser.error(f"--steps must be a positive multiple of {SAVE_EVERY}, --warmup and --reps >= 1")
    names = [name.strip() for name in args.only.split(",")]
    if unknown := set(names) - set(RUNNERS):
        parser.error(f"--only: unknown candidates {sorted(unknown)}; choose from {', '.join(RUNNERS)}")

    import torch

    from pipeline.data import prepare_data

    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    loads = []
    with tempfile.TemporaryDirectory(prefix="bench-throughput-", dir=args.tmp_parent) as tmp:
        root = Path(tmp)
        with contextlib.redirect_stdout(sys.stderr):
            prepare_data(pipeline_config(root, 1, args.threads, "prepare"))
        for rep in range(args.reps):
            loads.append(loadavg())
            for name in rotated(names, rep):
                results[name].append(run_candidate(name, root, args, rep))
                print(f"rep {rep + 1}/{args.reps} {name:<22} {1e3 * results[name][-1]['mean']:8.2f} ms/step")

    means = {name: [r["mean"] for r in runs] for name, runs in results.items()}
    medians = {name: [r["median"] for r in runs] for name, runs in results.items()}
    cpu = {name: [r["cpu"] for r in runs] for name, runs in results.items()}
    collecting = {name: [r["gc_per_step"] for r in runs] for name, runs in results.items()}
    print()
    print(
        f"{'candidate':<24} {'ms/step, window mean':>21} {'[min-max]':>15} {'median step':>12} "
        f"{'CPU ms/step':>12} {'gc ms/step':>11}"
    )
    for name in names:
        s = summary(means[name])
        spread = f"[{1e3 * s['min']:.1f}-{1e3 * s['max']:.1f}]"
        print(
            f"{name:<24} {1e3 * s['median']:>21.2f} {spread:>15} {1e3 * statistics.median(medians[name]):>12.2f} "
            f"{1e3 * statistics.median(cpu[name]):>12.2f} {1e3 * statistics.median(collecting[name]):>11.3f}"
        )
    ratios = []
    if "02" in names:
        targets = {"plain loop": 1.05, "transformers Trainer": 1.0}
        for other in (n for n in names if n != "02"):
            ratios.append(
                ratio(
                    f"02 / {other}", "time per optimizer step", means["02"], means[other], targets.get(other)
                )
            )
        for other in (n for n in names if n != "02"):
            ratios.append(ratio(f"02 / {other}", "median single step", medians["02"], medians[other], None))
        for other in (n for n in names if n != "02"):
            ratios.append(ratio(f"02 / {other}", "CPU time per step", cpu["02"], cpu[other], None))
    print()
    print(target_table(ratios))
    for r in ratios:
        if r.target is None:
            print(f"{r.label} ({r.scope}): {r.of_medians:.3f} ({r.median_of_ratios:.3f})")
    import transformers

    Path(args.out).write_text(
        json.dumps(
            {
                "reps": args.reps,
                "steps": args.steps,
                "warmup": args.warmup,
                "threads": args.threads,
                "batch": BATCH,
                "model": MODEL,
                "save_every": SAVE_EVERY,
                "seconds_per_step": {name: summary(values) for name, values in means.items()},
                "median_single_step": {name: summary(values) for name, values in medians.items()},
                "cpu_seconds_per_step": {name: summary(values) for name, values in cpu.items()},
                "gc_seconds_per_step": collecting,
                "gc_full_collections": {name: [r["gc_full"] for r in runs] for name, runs in results.items()},
                "save_step_extra": {name: [r["save_extra"] for r in runs] for name, runs in results.items()},
                "settings_seen": {name: [r["seen"] for r in runs] for name, runs in results.items()},
                "per_step": {name: [r["steps"] for r in runs] for name, runs in results.items()},
                "ratios": [r.to_dict() for r in ratios],
                "load_average": loads,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
