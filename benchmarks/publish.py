"""Publishing a 0.6 GB stage to the local Hub over Xet and over Git LFS, side by side.
A benchmark, not a test.

    python benchmarks/publish.py [--size-gb 0.6] [--tensors 12] [--out benchmarks/results/publish.json]

The stage is what scripts/05_stage.py would hand to 06 (``modelo.safetensors``, ``meta.json``,
``README.md``, ``MANIFEST.sha256``), with weights of ``--tensors`` equal fp32 tensors of random
normal values (trained weights compress about as badly). One ``localhub`` runs in this
process; each publish is ``pipeline.publishing.publish`` in a fresh process (a fresh Xet session)
with ``HF_HUB_DISABLE_XET=1`` for LFS and unset for Xet, each protocol with its own HF_HOME.
Per protocol: a first publish to a new repo, then one tensor is replaced by new values (same
shape) and the stage republished from the same HF_HOME, then from a new HF_HOME (another
machine: only the Hub's dedup can help). Bytes sent are the request bodies the Hub received
for uploads (LFS PUTs; Xet xorbs and shards). Times are split at the start of the check after
landing (LFS: reads the Hub's SHA-256; Xet: downloads and hashes the file). Files go to a
temporary folder beside the repository (same disk), removed at the end.
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from localhub import LocalHub  # noqa: E402
from localhub import handler as localhub_handler  # noqa: E402
from pipeline.audit import STAGE_SCHEMA  # noqa: E402
from pipeline.hashing import sha256_file  # noqa: E402
from pipeline.layout import MANIFEST_FILE, META_FILE, MODEL_FILE, README_FILE  # noqa: E402

TOKEN = "bench-token"
_WORKER = """
import json, sys, time
from pipeline.publishing import publish
marks = {}
start = time.perf_counter()
def say(line):
    if line.startswith("verifying"):
        marks["landed"] = time.perf_counter() - start
result = publish(sys.argv[1], sys.argv[2], endpoint=sys.argv[3], receipt_dir=sys.argv[4], say=say)
print(json.dumps({"status": result.status, "total_s": time.perf_counter() - start,
                  "upload_and_commit_s": marks["landed"]}))
"""


def build_stage(folder: Path, tensors: dict[str, torch.Tensor], step: int) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / MODEL_FILE))
    (folder / README_FILE).write_text(f"# benchmark stage, step {step}\n")
    files = {MODEL_FILE: {"sha256": sha256_file(folder / MODEL_FILE), "size": (folder / MODEL_FILE).stat().st_size}}
    (folder / META_FILE).write_text(json.dumps({"schema": STAGE_SCHEMA, "step": step, "files": files}))
    names = sorted([MODEL_FILE, README_FILE, META_FILE])
    (folder / MANIFEST_FILE).write_text("".join(f"{sha256_file(folder / n)}  {n}\n" for n in names))


def count_upload_bytes() -> collections.Counter:
    """Count the request body bytes the Hub reads, by kind of upload (a measuring wrapper)."""
    received: collections.Counter = collections.Counter()
    original = localhub_handler.Handler._body_chunks

    def counting(self):
        path = self.path.split("?")[0]
        kind = ("xorb" if "/v1/xorbs/" in path else "shard" if path.endswith("/shards")
                else "lfs" if "/_localhub/lfs/" in path else "other")
        chunks = original(self)

        def counted():
            for chunk in chunks:
                received[kind] += len(chunk)
                yield chunk
        return counted()

    localhub_handler.Handler._body_chunks = counting
    return received


def run_publish(stage: Path, repo_id: str, hub: LocalHub, protocol: str, hf_home: Path, receipts: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_ENDPOINT", "HF_HUB_DISABLE_XET")}
    env.update({"HF_TOKEN": TOKEN, "HF_HOME": str(hf_home), "HF_HUB_DISABLE_TELEMETRY": "1",
                "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONPATH": str(REPO)})
    if protocol == "lfs":
        env["HF_HUB_DISABLE_XET"] = "1"
    done = subprocess.run([sys.executable, "-c", _WORKER, str(stage), repo_id, hub.url, str(receipts)],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"publish over {protocol} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=0.6)
    parser.add_argument("--tensors", type=int, default=12)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "publish.json"))
    args = parser.parse_args()
    side = int((args.size_gb * 1e9 / 4 / args.tensors) ** 0.5)
    generator = torch.Generator().manual_seed(0)
    tensors = {f"layer{i:02d}.weight": torch.randn(side, side, generator=generator) for i in range(args.tensors)}
    changed = dict(tensors, **{"layer05.weight": torch.randn(side, side, generator=generator)})
    received = count_upload_bytes()
    work = Path(tempfile.mkdtemp(prefix="bench-publish-", dir=REPO.parent))
    results: dict = {"size_bytes": None, "tensors": args.tensors, "runs": {}}
    try:
        first, second = work / "first" / "hub_stage", work / "second" / "hub_stage"
        build_stage(first, tensors, 1)
        build_stage(second, changed, 2)
        results["size_bytes"] = (first / MODEL_FILE).stat().st_size
        with LocalHub(work / "hub", token=TOKEN) as hub:
            for protocol in ("lfs", "xet"):
                repo_id, home = f"bench/{protocol}", work / f"hf_home_{protocol}"
                for label, stage, hf_home in (("first publish", first, home),
                                              ("republish, one tensor changed", second, home),
                                              ("republish, new machine", first, work / f"hf_home_{protocol}_2")):
                    if label == "republish, new machine":
                        # Back to the first stage on a new repo from a fresh HF_HOME: only the Hub can dedup.
                        repo_id = f"bench/{protocol}-again"
                    received.clear()
                    timing = run_publish(stage, repo_id, hub, protocol, hf_home, work / "receipts")
                    timing["bytes_sent"] = dict(received)
                    timing["upload_bytes"] = sum(v for k, v in received.items() if k != "other")
                    results["runs"].setdefault(protocol, {})[label] = timing
                    print(f"{protocol:3s}  {label:32s}  total {timing['total_s']:6.2f} s  upload+commit "
                          f"{timing['upload_and_commit_s']:6.2f} s  upload bytes {timing['upload_bytes']:>12,}",
                          flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["versions"] = {name: importlib.metadata.version(name) for name in ("huggingface_hub", "hf_xet")}
    results["versions"]["python"] = platform.python_version()
    results["load_average"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    lfs, xet = results["runs"]["lfs"], results["runs"]["xet"]
    for label in lfs:
        print(f"ratio xet/lfs, {label}: time {xet[label]['total_s'] / lfs[label]['total_s']:.2f}, "
              f"upload+commit {xet[label]['upload_and_commit_s'] / lfs[label]['upload_and_commit_s']:.2f}, "
              f"bytes sent {xet[label]['upload_bytes'] / max(1, lfs[label]['upload_bytes']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
