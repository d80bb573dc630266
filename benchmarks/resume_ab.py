"""Resume load of two checkouts side by side: is this change slower than its base?

    python benchmarks/resume_ab.py --base /path/to/base-checkout [--sizes 0.6,0.06] [--reps 6]

Each checkout's own ``benchmarks/checkpoint.py`` builds the same state, saves it with its
own code (formats may differ between versions) and times its own ``ours_load_verified``
(what ``train --resume`` does: verify every byte, then the tensors),
``ours_load_mapped`` (map and parse only) and ``torch_load`` (``torch.load(weights_only=True)``
of a ``torch.save`` of the same state: the yardstick), page cache evicted before every load.
``resume`` and ``resume_step`` are what ``train --resume`` does, end to end: into a run
built fresh (model initialised, optimizer without state, gradients ready), the checkout's
own verified load and ``restore_state``, then the first ``optimizer.step()``, timed apart.
A loader whose tensors view a private map of the file defers a page copy per byte to the
first write of each page (the step writes every Adam moment), so the fair comparison is
their sum, ``resume + step``.
Workers of the two checkouts alternate, one fresh process per repetition, so load on the
machine spreads over both. Printed: medians, the ratios this change / base (paired per
repetition), and each checkout's loads / ``torch.load`` (paired within one process, so
load on the machine cancels). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
CANDIDATES = ("ours_load_verified", "ours_load_mapped", "torch_load")
RESUME = ("resume", "resume_step", "resume+step")


def resume_and_step(bench, pipeline, state) -> dict[str, float]:
    """Time the checkout's resume into ``state.run`` (optimizer state dropped, gradients set
    beforehand), then the first optimizer step; the files are evicted from the page cache."""
    import gc
    import time

    import torch

    from pipeline.checkpoint import restore_state

    run = state.run
    # What the restored state is validated against: the benchmark's sampler (64 rows, batches
    # of 8) and a step past the default config's 10.
    run.config.training.max_steps = 10**6
    run.config.data.batch_size = 8
    run.data.num_train = 64
    run.optimizer.state.clear()  # a resumed run's optimizer is built without state
    for parameter in run.model.parameters():
        parameter.grad = torch.full_like(parameter, 1e-3)
    folder = state.outputs["ours_sync"]
    bench._evict(folder)
    gc.collect()
    start = time.perf_counter()
    load = pipeline.checkpoint.load_checkpoint
    # As each checkout's train.py resumes: this change verifies the weights into the model.
    into = {"into": run.model} if "into" in inspect.signature(load).parameters else {}
    if into:
        pipeline.checkpoint.checkpoint_meta(folder)  # it reads meta.json first, to build the run
    loaded = load(folder, **into)
    extra = {"step": loaded.meta["step"], "derived": loaded.derived_buffers} if hasattr(
        loaded, "derived_buffers") else {}
    restore_state(run, loaded.model_tensors, loaded.meta["training_state"], loaded.state_tensors, **extra)
    del loaded  # train.py drops it after restoring, too
    middle = time.perf_counter()
    run.optimizer.step()
    end = time.perf_counter()
    return {"resume": middle - start, "resume_step": end - middle, "resume+step": end - start}


def worker(root: Path, size_gb: float, folder: Path) -> dict[str, float]:
    sys.path.insert(0, str(root / "benchmarks"))
    import checkpoint as bench  # the checkout's own benchmark module, importing its own pipeline

    import pipeline

    for module in (bench, pipeline):  # not the installed checkout's
        assert Path(module.__file__).resolve().parents[1] == root.resolve(), module
    state = bench.Bench(size_gb, folder, with_accelerate=False)
    run = state.run
    steps = run.step + 1  # ours_sync counts one step: the restored history must agree with it
    run.history = {"step": list(range(1, steps + 1)), "loss": [1.0] * steps, "lr": [1e-4] * steps}
    run.scheduler.last_epoch = steps
    state.ours_sync()
    state.torch_save()  # the yardstick: torch.load(weights_only=True) of the same state, same process
    times = {name: getattr(state, name)()[0] for name in CANDIDATES}
    return {**times, **resume_and_step(bench, pipeline, state)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="the checkout to compare with")
    parser.add_argument("--sizes", default="0.6,0.06")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.size, args.dir)))
        return 0
    roots = {"base": args.base.resolve(), "this": HERE}
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for size in [s.strip() for s in args.sizes.split(",") if s.strip()]:
        results[size] = {"base": [], "this": []}
        for rep in range(args.reps):
            for label in (("base", "this") if rep % 2 == 0 else ("this", "base")):
                with tempfile.TemporaryDirectory(dir=HERE.parent) as folder:
                    done = subprocess.run([sys.executable, __file__, "--worker", str(roots[label]), "--size", size,
                                           "--dir", folder, "--base", "-"], capture_output=True, text=True,
                                          cwd=roots[label])
                if done.returncode != 0:
                    raise SystemExit(f"{label} worker failed:\n{done.stderr}")
                results[size][label].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"command: {' '.join(sys.argv)}")
    print("| size | candidate | base median s | this median s | this / base (paired median) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for size, by_label in results.items():
        for name in (*CANDIDATES, *RESUME):
            base = [r[name] for r in by_label["base"]]
            this = [r[name] for r in by_label["this"]]
            paired = statistics.median(t / b for t, b in zip(this, base))
            print(f"| {size} GB | {name} | {statistics.median(base):.3f} | {statistics.median(this):.3f} | "
                  f"{paired:.2f} |")
    print("| size | checkout | verified / torch.load (paired median) | mapped / torch.load | resume+step / torch.load |")
    print("| --- | --- | ---: | ---: | ---: |")
    for size, by_label in results.items():
        for label in ("base", "this"):
            runs = by_label[label]
            verified = statistics.median(r["ours_load_verified"] / r["torch_load"] for r in runs)
            mapped = statistics.median(r["ours_load_mapped"] / r["torch_load"] for r in runs)
            whole = statistics.median(r["resume+step"] / r["torch_load"] for r in runs)
            print(f"| {size} GB | {label} | {verified:.2f} | {mapped:.2f} | {whole:.2f} |")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
