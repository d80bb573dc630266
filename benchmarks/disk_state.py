"""Does the disk, not the writer, decide the save ratios? Our safetensors writer against the
streamed raw write of the same bytes, both writing new files, in two disk states. A
benchmark, not a test.

    python benchmarks/disk_state.py [--size 0.6] [--reps 6]

``fresh``: every candidate writes into a new folder and nothing is deleted meanwhile, so
each writes into space no file held just before. ``freed just before``: the raw write
first deletes its previous file and syncs (untimed), then writes at once, as
``checkpoint.py`` times every save; ours writes into fresh space. ``freed 1 s before``: the
same with a 1 s pause after the sync. Candidates run in an order rotated by the
repetition, in one process, each after ``os.sync()`` and a 0.5 s pause; medians and the
median of the per-repetition ratios to the raw write. Files go beside the repository
(same disk) and are removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402
from checkpoint import Bench  # noqa: E402

from pipeline.checkpoint import write_safetensors  # noqa: E402
from pipeline.checkpoint.tensorfile import write_safetensors_files  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=0.6, help="GB of state (weights + AdamW moments)")
    parser.add_argument("--reps", type=int, default=6)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-disk-", dir=REPO.parent))
    try:
        bench = Bench(args.size, work, with_accelerate=False)
        model = bench.run.model.state_dict()
        state = {f"state{i}": t for i, t in enumerate(bench.tensors[len(model) :])}

        def fresh_folder() -> Path:
            folder = work / f"run-{time.perf_counter_ns()}"
            folder.mkdir()
            os.sync()
            time.sleep(0.5)
            return folder

        def raw(delete_previous: bool, pause: float) -> float:
            bench.folder = fresh_folder()
            path = bench.outputs.pop("raw_write_streamed", None)
            if delete_previous and path is not None:
                path.unlink()
                os.sync()
                time.sleep(pause)
            return bench.raw_write_streamed()[0]

        def ours(both_files: bool) -> float:
            folder = fresh_folder()
            start = time.perf_counter()
            if both_files:
                write_safetensors_files(
                    [(folder / "model", model, {"format": "pt"}), (folder / "state", state, {"format": "pt"})]
                )
            else:
                write_safetensors(folder / "all", {**model, **state}, {"format": "pt"})
            return time.perf_counter() - start

        for label, delete, pause in (
            ("fresh", False, 0.0),
            ("freed just before", True, 0.0),
            ("freed 1 s before", True, 1.0),
        ):
            candidates = {
                "raw write, streamed": lambda: raw(delete, pause),
                "ours, both files": lambda: ours(True),
                "ours, one file": lambda: ours(False),
            }
            names = list(candidates)
            times: dict[str, list[float]] = {name: [] for name in names}
            for rep in range(args.reps):
                for name in names[rep % len(names) :] + names[: rep % len(names)]:
                    times[name].append(candidates[name]())
            base = np.array(times["raw write, streamed"])
            print(
                f"{label}: {bench.state_bytes / 1e9:.2f} GB, {args.reps} reps, median s "
                "[min-max], median of per-rep ratios to the raw write"
            )
            for name, values in times.items():
                print(
                    f"  {name:22s} {np.median(values):6.3f} [{min(values):.3f}-{max(values):.3f}]  "
                    f"{np.median(np.array(values) / base):.2f}"
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
