"""Peak memory of ``scripts/05_stage.py``: extra RSS against the largest tensor. A benchmark, not a test.

    python benchmarks/stage_memory.py [--layers 64] [--width 2048] [--nproc 2] [--out FILE]

Trains a float32 model of ``--layers`` square ``Linear(width, width)`` layers (no bias; 64
of 2048 is 1 GiB of weights, the largest tensor 16 MiB) for one step on the default
regression data, with the real scripts: 01, then 02 under torchrun (``--nproc 2``:
``training.parallel: fsdp2``, each weight split across the two ranks' shard files) or in
one process (``--nproc 1``). Then ``05_stage.py --no-metrics`` runs in a child process,
and so does a baseline child that only imports torch and the project (``import
pipeline.stage``). Reported: each child's peak RSS as the OS counts it (``ru_maxrss`` of
``wait4``: anonymous and mapped file pages alike), the extra peak of 05 over the baseline,
and the bound it must stay within: the largest tensor + 128 MiB, whatever the model size.
Files go to ``$BENCH_DIR`` (default: the temporary folder), removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024

# The model factory, written beside the run's config (factories import from the working folder).
FACTORY = """
import torch

from pipeline.params import read_params


def build_model(config):
    params = read_params(config.model.params, "model.params", {"layers": (int, 64), "width": (int, 2048)})
    width, features = params["width"], config.data.params.get("num_features", 3)
    layers = [torch.nn.Linear(features, width)]
    layers += [torch.nn.Linear(width, width, bias=False) for _ in range(params["layers"])]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
"""


def peak_rss(command: list[str], cwd: Path) -> tuple[int, float]:
    """(peak RSS in bytes, seconds) of ``command`` run to completion in its own process."""
    start = time.perf_counter()
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(
            f"{' '.join(command)} exited {process.returncode}: {process.stderr.read().decode()[-2000:]}"
        )
    return usage.ru_maxrss * 1024, elapsed


def run(args: argparse.Namespace, folder: Path) -> dict:
    (folder / "wide_model.py").write_text(FACTORY)
    overrides = {
        "model.factory": "wide_model:build_model",
        "model.params": f"{{layers: {args.layers}, width: {args.width}}}",
        "training.dtype": "float32",
        "training.max_steps": "1",
        "checkpoint.every": "1",
        "checkpoint.async": "false",
        "data.dir": "data",
        "training.parallel": "fsdp2" if args.nproc > 1 else "none",
    }
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    config = ["--config", str(REPO / "config.yaml"), *sets]
    script = str(REPO / "scripts" / "{}")
    subprocess.run(
        [sys.executable, script.format("01_prepare_data.py"), *config],
        cwd=folder,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    train = [script.format("02_train.py"), *config, "--quiet"]
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
        if args.nproc > 1
        else [sys.executable]
    )
    started = time.perf_counter()
    subprocess.run(
        [*launcher, *train],
        cwd=folder,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
    )
    trained = time.perf_counter() - started
    [checkpoint] = sorted((folder / "estados_local").glob("step-*"))
    weights = sum(
        p.stat().st_size
        for p in checkpoint.rglob("*.safetensors")
        if "optim" not in p.parts and p.name != "estado_treino.safetensors"
    )
    baseline, _ = peak_rss([sys.executable, "-c", "import torch, pipeline.stage"], folder)
    staged, seconds = peak_rss(
        [sys.executable, script.format("05_stage.py"), *config, "--no-metrics", "--stage", "hub_stage"],
        folder,
    )
    largest = args.width * args.width * 4
    extra = staged - baseline
    return {
        "layers": args.layers,
        "width": args.width,
        "nproc": args.nproc,
        "checkpoint_bytes": sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()),
        "weight_bytes": weights,
        "largest_tensor_bytes": largest,
        "train_seconds": round(trained, 1),
        "stage_seconds": round(seconds, 1),
        "baseline_peak_rss": baseline,
        "stage_peak_rss": staged,
        "extra_peak_rss": extra,
        "bound": largest + 128 * MIB,
        "within_bound": extra <= largest + 128 * MIB,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument(
        "--nproc", type=int, default=2, help="2: an FSDP2 checkpoint; 1: a single-process one"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "stage_memory.json")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="stage-memory-", dir=os.environ.get("BENCH_DIR")))
    try:
        result = run(args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    kind = "FSDP2, 2 processes" if args.nproc > 1 else "single process"
    print(
        f"{kind}: weights {result['weight_bytes'] / MIB:,.0f} MiB (checkpoint {result['checkpoint_bytes'] / MIB:,.0f} "
        f"MiB), largest tensor {result['largest_tensor_bytes'] / MIB:,.0f} MiB"
    )
    print(
        f"  05 peak RSS {result['stage_peak_rss'] / MIB:,.0f} MiB, baseline (import torch, pipeline.stage) "
        f"{result['baseline_peak_rss'] / MIB:,.0f} MiB: extra {result['extra_peak_rss'] / MIB:,.0f} MiB, bound "
        f"{result['bound'] / MIB:,.0f} MiB: {'met' if result['within_bound'] else 'NOT met'} "
        f"(05 took {result['stage_seconds']} s)"
    )
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results[f"{args.nproc}x{args.layers}x{args.width}"] = result
    args.out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
