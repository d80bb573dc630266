"""scripts/06_publish.py against HfApi.upload_folder on the same 0.6 GB stage, over Git LFS and
over Xet, side by side. A benchmark, not a test.

    python benchmarks/publish.py [--size-gb 0.6] [--reps 3] [--out benchmarks/results/publish.json]

The stage is what scripts/05_stage.py hands to 06: ``modelo.safetensors`` (12 fp32 tensors of
random normal values: trained weights compress about as badly), ``model.safetensors.index.json``,
``config.json``, ``meta.json``, ``README.md``, ``MANIFEST.sha256``. Each candidate runs in a fresh
process against a fresh ``localhub`` (so neither the Hub's dedup nor a warm Xet cache helps)
with a fresh HF_HOME, ``HF_HUB_DISABLE_XET=1`` for LFS, unset for Xet:

- ``06``: ``scripts/06_publish.py --repo-id bench/m`` (audit, leak scan and Xet hashes in one
  read, the one commit, the check after landing, the receipt);
- ``upload_folder``: ``HfApi().create_repo(exist_ok=True)`` then ``upload_folder`` of the stage
  (the client hashes and uploads; nothing is checked afterwards).

Wall time is the process's, interpreter start included; CPU time is its user + system time
(its threads and hf_xet's included, the Hub's not), which a busy machine disturbs far less
than the wall time. "Downloaded" is what the Hub sent back
(response bytes, headers included, from localhub's accounting); "weights downloaded" counts
the responses that carry file contents of the weights (LFS/regular downloads of them, Xet
reconstructions and xorb reads); "requests" every request the Hub received. The candidates
alternate, in rotated order, ``--reps`` times; the load average is recorded after each round,
as a measure of how busy the machine was. Targets: 06 <= 1.0x upload_folder over LFS, <= 1.1x
over Xet. Files go to a temporary folder beside the repository (same disk), removed at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from localhub import LocalHub  # noqa: E402
from pipeline.audit import STAGE_SCHEMA  # noqa: E402
from pipeline.layout import CONFIG_FILE, INDEX_FILE, MANIFEST_FILE, META_FILE, MODEL_FILE, README_FILE  # noqa: E402

TOKEN = "bench-token"
REPO_ID = "bench/m"
_UPLOAD_FOLDER = """
import sys
from huggingface_hub import HfApi
api = HfApi(endpoint=sys.argv[2])
api.create_repo(sys.argv[3], exist_ok=True)
api.upload_folder(folder_path=sys.argv[1], repo_id=sys.argv[3], commit_message="upload_folder")
"""
# What carries the weights' bytes back: a download of the file, a Xet reconstruction or xorb read.
WEIGHT_READS = rf"/resolve/.*{MODEL_FILE}$|/reconstructions/|/_xet/data/"
# 06's time over upload_folder's, at most (audit, leak scan and verification included).
TARGETS = {"lfs": 1.0, "xet": 1.1}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def build_stage(folder: Path, size_gb: float, tensors: int = 12) -> int:
    """A stage 06 accepts: every file listed in MANIFEST.sha256, the weights in meta.json's table."""
    folder.mkdir(parents=True)
    side = int((size_gb * 1e9 / 4 / tensors) ** 0.5)
    rng = np.random.default_rng(0)
    arrays = {
        f"layer{i:02d}.weight": rng.standard_normal((side, side), dtype=np.float32) for i in range(tensors)
    }
    save_file(arrays, str(folder / MODEL_FILE), metadata={"format": "pt"})
    (folder / README_FILE).write_text("# benchmark stage\n\nRandom weights, published to a loopback Hub.\n")
    (folder / CONFIG_FILE).write_text(json.dumps({"model_type": "bench"}) + "\n")
    (folder / INDEX_FILE).write_text(
        json.dumps({"metadata": {}, "weight_map": {k: MODEL_FILE for k in arrays}})
    )
    files = {
        name: {"sha256": _sha256(folder / name), "size": (folder / name).stat().st_size}
        for name in (MODEL_FILE, CONFIG_FILE, INDEX_FILE)
    }
    (folder / META_FILE).write_text(
        json.dumps({"schema": STAGE_SCHEMA, "step": 1, "repo_id": REPO_ID, "files": files})
    )
    names = sorted([MODEL_FILE, README_FILE, CONFIG_FILE, INDEX_FILE, META_FILE])
    (folder / MANIFEST_FILE).write_text("".join(f"{_sha256(folder / n)}  {n}\n" for n in names))
    return (folder / MODEL_FILE).stat().st_size


def run_once(candidate: str, protocol: str, stage: Path, work: Path) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"{candidate}-{protocol}-", dir=work))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_TOKEN", "HF_ENDPOINT", "HF_HUB_DISABLE_XET") and not k.startswith("HF_XET_")
    }
    env.update(
        {
            "HF_TOKEN": TOKEN,
            "HF_HOME": str(root / "hf_home"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "PYTHONPATH": str(REPO),
        }
    )
    if protocol == "lfs":
        env["HF_HUB_DISABLE_XET"] = "1"
    with LocalHub(root / "hub", token=TOKEN) as hub:
        if candidate == "06":
            argv = [
                sys.executable,
                str(REPO / "scripts" / "06_publish.py"),
                "--repo-id",
                REPO_ID,
                "--endpoint",
                hub.url,
                "--stage",
                str(stage),
                "--receipt-dir",
                str(root / "receipts"),
            ]
        else:
            argv = [sys.executable, "-c", _UPLOAD_FOLDER, str(stage), hub.url, REPO_ID]
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        done = subprocess.run(argv, env=env, cwd=root, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime
        if done.returncode != 0:
            raise SystemExit(
                f"{candidate} over {protocol} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            )
        result = {
            "wall_s": wall,
            "cpu_s": cpu,
            "downloaded_bytes": hub.bytes_sent("GET"),
            "weights_downloaded_bytes": hub.bytes_sent("GET", WEIGHT_READS),
            "xet_reads": hub.count("GET", r"/reconstructions/|/_xet/data/"),
            "uploaded_xorbs": hub.count("POST", r"/xorbs/"),
            "lfs_puts": hub.count("PUT"),
            "requests": sum(hub.request_counts().values()),
        }
    shutil.rmtree(root, ignore_errors=True)
    return result


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=0.6)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "publish.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-publish-", dir=REPO.parent))
    results: dict = {"size_gb": args.size_gb, "reps": args.reps, "runs": {}, "load_average": []}
    try:
        weights = build_stage(work / "hub_stage", args.size_gb)
        results["weights_bytes"] = weights
        candidates = [(c, p) for p in ("lfs", "xet") for c in ("06", "upload_folder")]
        for rep in range(args.reps):
            # Rotate the order so that drift spreads over every candidate.
            for candidate, protocol in (
                candidates[rep % len(candidates) :] + candidates[: rep % len(candidates)]
            ):
                run = run_once(candidate, protocol, work / "hub_stage", work)
                results["runs"].setdefault(f"{candidate} {protocol}", []).append(run)
                print(
                    f"rep {rep}  {candidate:13s} {protocol}  {run['wall_s']:6.2f} s  cpu {run['cpu_s']:6.2f} s  downloaded "
                    f"{run['downloaded_bytes']:>10,} B (weights {run['weights_downloaded_bytes']:,} B, "
                    f"Xet reads {run['xet_reads']})",
                    flush=True,
                )
            results["load_average"].append(os.getloadavg()[0])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\n{weights / 1e9:.2f} GB of weights, {args.reps} reps; wall s median [min-max]; ratio of medians "
        "(median of per-rep ratios)"
    )
    results["summary"] = {}
    for protocol in ("lfs", "xet"):
        ours, theirs = results["runs"][f"06 {protocol}"], results["runs"][f"upload_folder {protocol}"]
        ours_s, theirs_s = [r["wall_s"] for r in ours], [r["wall_s"] for r in theirs]
        ratio = statistics.median(ours_s) / statistics.median(theirs_s)
        per_rep = statistics.median(a / b for a, b in zip(ours_s, theirs_s))
        ours_cpu, theirs_cpu = [r["cpu_s"] for r in ours], [r["cpu_s"] for r in theirs]
        cpu_ratio = statistics.median(ours_cpu) / statistics.median(theirs_cpu)
        results["summary"][protocol] = {
            "06_s": _summary(ours_s),
            "upload_folder_s": _summary(theirs_s),
            "ratio_of_medians": ratio,
            "median_of_ratios": per_rep,
            "06_cpu_s": _summary(ours_cpu),
            "upload_folder_cpu_s": _summary(theirs_cpu),
            "cpu_ratio_of_medians": cpu_ratio,
            "06_weights_downloaded_bytes": max(r["weights_downloaded_bytes"] for r in ours),
            "06_downloaded_bytes": max(r["downloaded_bytes"] for r in ours),
            "06_requests": max(r["requests"] for r in ours),
            "upload_folder_requests": max(r["requests"] for r in theirs),
            "target": TARGETS[protocol],
        }
        s = results["summary"][protocol]
        target = TARGETS[protocol]
        verdict = (
            "MET"
            if ratio <= target and per_rep <= target
            else "borderline"
            if min(ratio, per_rep) <= target
            else "NOT MET"
        )
        print(
            f"{protocol}: 06 {s['06_s']['median']:.2f} [{s['06_s']['min']:.2f}-{s['06_s']['max']:.2f}]  "
            f"upload_folder {s['upload_folder_s']['median']:.2f} [{s['upload_folder_s']['min']:.2f}-"
            f"{s['upload_folder_s']['max']:.2f}]  ratio {ratio:.2f} ({per_rep:.2f}) target <= {target} {verdict}; "
            f"cpu 06 {s['06_cpu_s']['median']:.2f} upload_folder {s['upload_folder_cpu_s']['median']:.2f} "
            f"ratio {cpu_ratio:.2f}; "
            f"requests {s['06_requests']} vs {s['upload_folder_requests']}; "
            f"06 downloaded {s['06_downloaded_bytes']:,} B, weights {s['06_weights_downloaded_bytes']:,} B"
        )
    print(f"load average after each round: {', '.join(f'{x:.1f}' for x in results['load_average'])}")
    results["versions"] = {name: importlib.metadata.version(name) for name in ("huggingface_hub", "hf_xet")}
    results["versions"]["python"] = platform.python_version()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
