"""torchrun DDP and FSDP2: exact resume, pickle-free atomic checkpoints, fp16 AMP, one
consolidated publish and its metrics, stopping together. Launches are few and shared (each
costs seconds): one 2-process launch runs fourteen trainings (tests/helpers/dist_leg.py); the
signal and the kill use the real script. Moving a run between launches: test_launches.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from oprecorder import Op, ordering_problems
from readrecorder import ReadRecorder
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageReader

from pipeline.checkpoint import LoadMode, load_checkpoint, load_model_weights, read_tensors
from pipeline.checkpoint.meta import entry_of
from pipeline.checkpoint.store import meta_sha256
from pipeline.checkpoint.verified_dcp import SealedReads
from pipeline.cli import python_command, script_command
from pipeline.config import load_config
from pipeline.data import load_task_data, prepare_data
from pipeline.distributed.world import LaunchWorld
from pipeline.errors import (
    CheckpointError,
    ChecksumMismatch,
    DataError,
    LaunchMismatch,
    PipelineError,
    SchemaMismatch,
    StageError,
    StateMismatch,
)
from pipeline.evaluate import evaluate_checkpoint, evaluation_config, write_metrics
from pipeline.hashing import sha256_file
from pipeline.layout import DIST_MODEL_DIR, DIST_OPTIM_DIR, DIST_RNG_DIR, STATE_FILE, rank_rng_file
from pipeline.proof.checks import control_verdict, judge
from pipeline.proof.compare import Check, compare
from pipeline.proof.dist_leg import reported_exercise
from pipeline.run import build_model
from pipeline.stage import build_stage
from pipeline.train import train

from support import HELPERS, REPO, reseal, script_env

CONFIG = REPO / "config.yaml"
# The tests that read the shared launches (``legs``) run on one worker, so those launches run
# once (make test: --dist loadgroup); the module's other launches go to either worker.
LEGS = pytest.mark.xdist_group("distributed-legs")
# Dropout draws from per-rank streams (re-derived by a reshard); the augmentation noise is
# seeded per sample, the same at any world size, so it stays on.
QUIET_RNG = {"model.params.dropout": 0.0}
# The chunk size the counted resume's checkpoint is sealed with: small enough that a shard
# file of the test's model spans many chunks.
READ_CHUNK = 256
# The tests reading the one-rank launch's checkpoints (``one_rank_launch``) run on one worker,
# so its training runs once.
ONE_RANK_LAUNCH = pytest.mark.xdist_group("one-rank-launch")
STREAM = {"data.prepare": "inputs_factories:prepare_stream", "data.factory": "inputs_factories:build_stream"}


def torchrun(nproc: int, *args: str, cwd: Path, timeout: float = 240, **popen) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-B",
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *args,
    ]
    return subprocess.run(
        command,
        cwd=cwd,
        env=script_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
        **popen,
    )


def train_args(data_dir: Path, checkpoint_dir: Path, *extra: str, parallel: str | None = "ddp") -> list[str]:
    """02's arguments; ``parallel`` None leaves training.parallel as config.yaml has it (auto)."""
    return [
        str(REPO / "scripts" / "02_train.py"),
        "--config",
        str(CONFIG),
        "--set",
        f"data.dir={data_dir}",
        *(["--set", f"training.parallel={parallel}"] if parallel is not None else []),
        "--checkpoint-dir",
        str(checkpoint_dir),
        *extra,
    ]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@pytest.fixture(scope="module")
def legs(data_dir, tmp_path_factory):
    """Two processes: per mode, cut at step 6 + resume, and uninterrupted (DDP saving
    synchronously, FSDP2 in the background: checkpoint.async); a resume from the FSDP2 run's
    step 5, saved in the background while steps 6 to 10 trained; a background save on a full
    disk; a datasets stream split over the ranks, uninterrupted, and cut at 7 + resumed;
    without dropout (the per-rank streams a reshard re-derives), uninterrupted and cut; and
    per mode, fp16 AMP cut at 2 + resume, and uninterrupted; FSDP2 resumes of step 5 (its reads
    recorded, a shard damaged, an older seal); and FSDP2 evaluated with the best mark kept."""
    root = tmp_path_factory.mktemp("dist")
    runs = []
    for mode, background in (("ddp", False), ("fsdp2", True)):
        base = {"data.dir": str(data_dir), "training.parallel": mode, "checkpoint.async": background}
        runs += [
            {"overrides": {**base, "checkpoint.dir": str(root / f"cut_{mode}")}, "stop_at": 6},
            {
                "overrides": {**base, "checkpoint.dir": str(root / f"cut_{mode}")},
                "resume": "latest",
                "record": str(root / f"ops_{mode}"),
            },
            {"overrides": {**base, "checkpoint.dir": str(root / f"full_{mode}"), "checkpoint.keep_last": 2}},
        ]
    runs.append(
        {
            "overrides": {**base, "checkpoint.dir": str(root / "mid_fsdp2")},
            "resume": str(root / "full_fsdp2" / "step-00000005"),
        }
    )
    # A background save that fails: checkpoints on a real 64 KiB tmpfs (a step takes 20 pages).
    full_disk = root / "full_disk"
    mounted = os.geteuid() == 0 and _mount_tmpfs(full_disk, "size=64k")
    runs.append(
        {"overrides": {**base, "checkpoint.dir": str(full_disk)}}
        if mounted
        else {"overrides": {**base, "checkpoint.dir": str(root / "not_mounted")}, "stop_at": 1}
    )
    stream = {"data.dir": str(root / "stream"), "training.parallel": "ddp", **QUIET_RNG, **STREAM}
    prepare_data(load_config(CONFIG, stream))
    runs += [
        {"overrides": {**stream, "checkpoint.dir": str(root / "stream_full")}},
        {
            "overrides": {**stream, "checkpoint.dir": str(root / "stream_cut"), "checkpoint.keep_last": 2},
            "stop_at": 7,
        },
        {
            "overrides": {**stream, "checkpoint.dir": str(root / "stream_cut"), "checkpoint.keep_last": 2},
            "resume": "latest",
        },
    ]
    base = {"data.dir": str(data_dir), "training.parallel": "ddp", **QUIET_RNG}
    runs += [
        {"overrides": {**base, "checkpoint.dir": str(root / "quiet_full")}},
        {"overrides": {**base, "checkpoint.dir": str(root / "quiet_cut")}, "stop_at": 6},
    ]
    # fp16 AMP: float32 weights, the GradScaler's state saved and restored (the first steps
    # overflow at its initial scale, so steps are skipped, on every rank alike).
    for mode in ("fsdp2", "ddp"):
        base = {
            "data.dir": str(data_dir),
            "training.parallel": mode,
            "training.amp": "fp16",
            "training.dtype": "float32",
            "training.max_steps": 4,
        }
        runs += [
            {"overrides": {**base, "checkpoint.dir": str(root / f"fp16_cut_{mode}")}, "stop_at": 2},
            {"overrides": {**base, "checkpoint.dir": str(root / f"fp16_cut_{mode}")}, "resume": "latest"},
            {"overrides": {**base, "checkpoint.dir": str(root / f"fp16_full_{mode}")}},
        ]
    # The FSDP2 run's step 5, resumed: sealed anew in chunks of READ_CHUNK bytes, each rank's
    # reads counted, and each file it read whole rewritten on disk at once
    # (tests/helpers/readrecorder.py); then with a shard damaged; then in the form of
    # distributed schema 2 (whole-file digests only).
    fsdp2 = {"data.dir": str(data_dir), "training.parallel": "fsdp2", "checkpoint.keep_last": 3}
    for name, flip, sealed_again in (
        ("reads_fsdp2", None, {"chunk_size": READ_CHUNK}),
        ("damaged_fsdp2", f"{DIST_MODEL_DIR}/{_shard(2)}", None),
        ("old_fsdp2", None, {"schema": "pipeline.checkpoint.distributed/2"}),
    ):
        runs.append(
            {
                "overrides": {**fsdp2, "checkpoint.dir": str(root / name)},
                "resume": "latest",
                "copy": {
                    "from": str(root / "full_fsdp2" / "step-00000005"),
                    "to": str(root / name),
                    "flip": flip,
                    "reseal": sealed_again,
                },
                # Only the files one rank reads are rewritten (FSDP2: its model shard, its RNGs).
                **(
                    {
                        "reads": {
                            "to": str(root / "reads"),
                            "rewrite": ["step-00000005/model/", "step-00000005/rng/"],
                        }
                    }
                    if name == "reads_fsdp2"
                    else {}
                ),
            }
        )
    # Evaluated every 4 steps, the best mark kept: its value read from a sharded checkpoint.
    runs.append(
        {
            "overrides": {
                "data.dir": str(data_dir),
                "training.parallel": "fsdp2",
                "checkpoint.dir": str(root / "best_fsdp2"),
                "training.eval_every": 4,
                "checkpoint.best_metric": "mse",
                "checkpoint.keep_last": 3,
            }
        }
    )
    try:
        return root, launch_plan(2, root, "legs", runs), mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(full_disk)], check=False)


def _shard(index: int) -> str:
    """The name of a model or optimizer shard file (DCP's layout; index = rank + 1)."""
    return f"shard-{index:05d}-model-00001-of-00001.safetensors"


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(where)], capture_output=True
        ).returncode
        == 0
    )


def verify_distributed(folder: Path) -> dict:
    """The verification every reader runs (resume on rank 0, evaluate, stage)."""
    return load_checkpoint(folder, mode=LoadMode.VERIFY).meta


def stage(checkpoint: Path, out: Path) -> Path:
    """Script 05's step, in this process (the script itself is covered by test_stage)."""
    build_stage(load_config(CONFIG), checkpoint=checkpoint, stage_dir=out, with_metrics=False)
    return out / "modelo.safetensors"


@LEGS
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_cut_and_resumed_run_stages_the_same_bytes_as_uninterrupted(legs, mode, tmp_path):
    root, results, _ = legs
    offset = 0 if mode == "ddp" else 3
    cut, resumed, full = results[offset : offset + 3]
    assert cut["step"] == 6 and resumed["step"] == full["step"] == 10
    assert resumed["loss"] == full["loss"]  # the whole history, bit for bit
    # The traced gradient norm is the whole model's: FSDP2's sharded gradients give the norm
    # of DDP's whole ones, not that of rank 0's shard.
    ddp_norms = results[2]["grad_norm"]
    assert len(full["grad_norm"]) == 10 and all(norm > 0 for norm in full["grad_norm"])
    if mode == "fsdp2":
        assert full["grad_norm"] == pytest.approx(ddp_norms, rel=1e-4)
    cut = root / f"cut_{mode}" / "step-00000010"
    # Its first shard readable by the group only, its last by others only: the staged weights,
    # made from both, by neither (the modes are put back: the checkpoint is shared).
    shards = sorted(path for path in (cut / DIST_MODEL_DIR).iterdir() if path.is_file())
    modes = {path: path.stat().st_mode & 0o777 for path in shards}
    os.chmod(shards[0], 0o640)
    os.chmod(shards[-1], 0o604)
    try:
        staged = stage(cut, tmp_path / "resumed")
    finally:
        for path, mode_bits in modes.items():
            os.chmod(path, mode_bits)
    assert oct(staged.stat().st_mode & 0o777) == oct(0o600)
    reference = stage(root / f"full_{mode}" / "step-00000010", tmp_path / "full")
    assert staged.read_bytes() == reference.read_bytes()
    card = (tmp_path / "resumed" / "README.md").read_text()
    assert f"| launch | 2 processes ({mode.upper()}) on cpu |" in card and "| history |" not in card
    # The consolidated file equals a full-state load of the shards by torch's own reader.
    weights = load_file(staged)
    gathered = {name: torch.zeros_like(tensor) for name, tensor in weights.items()}
    dcp.load(
        gathered,
        storage_reader=HuggingFaceStorageReader(str(root / f"cut_{mode}" / "step-00000010" / "model")),
        no_dist=True,
    )
    assert all(torch.equal(gathered[name], weights[name]) for name in weights)
    # Same names and header as a single-process checkpoint's modelo.safetensors.
    meta = json.loads((root / f"full_{mode}" / "step-00000010" / "meta.json").read_text())
    assert sorted(weights) == sorted(meta["model"]["tensors"])


@LEGS
def test_close_ends_the_default_groups_gloo_threads(legs):
    """A gloo worker still releasing its last collective's tensors when the interpreter
    finalizes aborts its rank (SIGABRT, "terminate called without an active exception";
    see LaunchWorld.close): by the time LaunchWorld.close returns, the default group's worker threads
    are gone, on every rank, although DDP reducers left in reference cycles, failed saves'
    tracebacks and FSDP2's device mesh (kept by torch's DTensor caches) referred to groups."""
    root, _, _ = legs
    for rank in range(2):
        threads = json.loads((root / f"legs-results.json-threads-rank{rank}.json").read_text())
        assert sorted(threads["before_close"]) == ["gloo_tcp_loop", "pt_gloo_runloop", "pt_gloo_runloop"], (
            threads
        )
        assert threads["after_close"] == [], (rank, threads)


@LEGS
def test_a_background_save_holds_its_step_while_training_goes_on(legs, tmp_path):
    """FSDP2 with checkpoint.async: step 5 was committed in the background while steps 6 to
    10 trained; resumed from it, the run ends bitwise where the uninterrupted one did (a save
    that wrote the live shards instead of its snapshot would hold later weights)."""
    root, results, _ = legs
    full, mid = results[5], results[6]
    assert mid["step"] == full["step"] == 10 and mid["loss"] == full["loss"]
    staged = stage(root / "mid_fsdp2" / "step-00000010", tmp_path / "mid")
    assert staged.read_bytes() == stage(root / "full_fsdp2" / "step-00000010", tmp_path / "full").read_bytes()
    assert verify_distributed(root / "full_fsdp2" / "step-00000005")["config"]["checkpoint"]["async"] is True


@LEGS
def test_a_failed_background_save_ends_every_rank_with_exit_2(legs):
    root, results, mounted = legs
    if not mounted:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    failed = results[7]
    assert failed["error"] in ("OSError", "CheckpointError", "PeerFailed"), failed
    # The rank that failed says why; a peer that did not carries its line (for torchrun's report).
    assert (
        "No space left on device" in failed["message"] or "no space left on the device" in failed["message"]
    ), failed
    assert "\n" not in failed["message"] and failed["exit_codes"] == [2, 2], failed
    assert not list((root / "full_disk").glob("step-*")), "a failed save left a step folder"


@LEGS
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_a_distributed_save_fsyncs_before_publishing_and_prunes_only_after(legs, mode):
    """The ordering check of the crash-point harness (tests/helpers/oprecorder.py) on the resumed
    run's calls from both ranks, merged by completion time: it saved step 10 and pruned
    step 6 (keep_last 1)."""
    root, _, _ = legs
    ops = []
    for rank in (0, 1):
        record = json.loads((root / f"ops_{mode}-rank{rank}.json").read_text())
        ops += [
            (done, rank, Op(**op))
            for op, done in zip(record["ops"], record["done"], strict=True)
            if done is not None
        ]  # a call that raised changed nothing
    ops = [op for _, _, op in sorted(ops, key=lambda item: item[:2])]
    assert ordering_problems(ops) == [], "\n".join(ordering_problems(ops))
    created = [
        op.path.split("/.tmp-step-00000010-")[-1]
        for op in ops
        if op.kind == "create" and ".tmp-step" in op.path
    ]
    assert {name.split("/", 1)[1] for name in created} >= {
        "meta.json",
        "estado_treino.safetensors",
        "rng/rank-00000.safetensors",
        "rng/rank-00001.safetensors",
    }
    assert sum("/model/" in name for name in created) == 2 and sum("/optim/" in name for name in created) == 2
    kinds = [(op.kind, os.path.basename(op.target or op.path)) for op in ops]
    assert ("rename", "step-00000010") in kinds and ("rmtree", kinds[-1][1]) == kinds[-1]
    assert any(kind == "rename" and name.startswith(".deleting-step-00000006") for kind, name in kinds)


@LEGS
def test_checkpoint_is_safetensors_only_and_fully_listed(legs):
    root, _, _ = legs
    for mode in ("ddp", "fsdp2"):
        folder = root / f"full_{mode}" / "step-00000010"
        meta = verify_distributed(folder)
        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        assert sorted(meta["files"]) == [f for f in files if f != "meta.json"]
        assert all(f.endswith(".safetensors") for f in meta["files"])
        assert not [f for f in files if f.endswith((".metadata", ".distcp", ".pkl", ".pt"))]
        for name in files:
            assert not (folder / name).read_bytes().startswith(b"PK"), f"{name} is a zip (torch.save) file"
        assert {"rng/rank-00000.safetensors", "rng/rank-00001.safetensors"} <= set(meta["files"])
        assert meta["parallel"] == {"mode": mode, "world_size": 2, "ddp_find_unused_parameters": False}
        assert meta["resharded_from"] is None and meta["schema"] == "pipeline.checkpoint.distributed/3"
        # Sealed like a single-process meta.json, and the environment recorded.
        assert meta["meta_sha256"] == meta_sha256(meta)
        assert meta["environment"]["intra_op_threads"] == 1 and meta["environment"]["changes"] == []


@LEGS
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_a_resumed_and_an_uninterrupted_run_write_byte_identical_checkpoint_files(legs, mode):
    """Two runs that reach the same state write the same bytes (every header in one order,
    not a hash map's), so ``sha256sum`` of one run's files matches the other's meta.json."""
    root, _, _ = legs
    resumed, full = (root / f"{kind}_{mode}" / "step-00000010" for kind in ("cut", "full"))
    files = verify_distributed(full)["files"]
    assert verify_distributed(resumed)["files"] == files and len(files) == 7  # 2 model, 2 optim, 2 rng, state
    for name, entry in files.items():
        data = (resumed / name).read_bytes()
        assert data == (full / name).read_bytes(), f"{name} differs between the two runs"
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]


def _damaged_copy(legs, tmp_path) -> Path:
    folder = tmp_path / "step-00000010"
    shutil.copytree(legs[0] / "full_fsdp2" / "step-00000010", folder)
    return folder


@LEGS
def test_missing_or_altered_shard_is_refused(legs, tmp_path):
    folder = _damaged_copy(legs, tmp_path)
    shard = sorted((folder / "model").iterdir())[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match="SHA-256 differs"):
        verify_distributed(folder)
    shard.unlink()
    with pytest.raises(ChecksumMismatch, match="is missing"):
        verify_distributed(folder)


@LEGS
def test_a_rank_hashes_the_chunks_it_reads_and_refuses_a_bad_one_or_a_bad_table(legs, tmp_path):
    """SealedReads on a real checkpoint (no launch): a read hashes the chunks covering its
    ranges and no other (a damaged chunk elsewhere is not read, so not refused); a damaged
    chunk it reads is refused, naming it; a read past the file's end is refused; a distributed
    checkpoint's chunk table that does not tile its file is refused by meta.json's reader."""
    folder = _damaged_copy(legs, tmp_path)
    name = f"{DIST_OPTIM_DIR}/{_shard(1)}"
    reseal(folder, lambda meta: meta["files"].update({name: entry_of((folder / name).read_bytes(), 256)}))
    meta = verify_distributed(folder)
    size = meta["files"][name]["size"]
    assert size > 4 * 256
    data = bytearray((folder / name).read_bytes())
    data[-1] ^= 1  # the last chunk damaged
    (folder / name).write_bytes(bytes(data))
    reads = SealedReads(folder, meta)
    with ReadRecorder(folder) as recorder:
        first = reads.read(name, [(10, 300)])
    assert first is not None and bytes(first[:512]) == bytes(data[:512]) and not reads.refusals
    assert recorder.read == {name: 512}, recorder.read  # chunks 0 and 1, nothing else
    assert reads.read(name, [(300, 400), (size - 1, size)]) is None
    assert f"SHA-256 differs from meta.json (chunk {(size - 1) // 256}: bytes" in str(reads.refusals[0])
    assert reads.read(name, [(0, size + 1)]) is None
    assert "falls outside the file" in str(reads.refusals[1])
    reseal(folder, lambda meta: meta["files"][name]["chunk_sha256"].pop())
    with pytest.raises(SchemaMismatch, match=f"the chunk table of {name} is malformed"):
        verify_distributed(folder)


@LEGS
def test_each_rank_hashes_only_the_chunks_it_reads_and_uses_the_bytes_it_hashed(legs):
    """Per rank: every shard file's header read (DCP plans from them); once, only the sealed
    chunks covering the header and the bytes its plan reads of each file: its own shards
    whole, of another rank's optimizer shard the chunks of the tensors every rank holds alike
    (the optimizer's step counts, which DCP saves in one rank's file), never that whole
    file; its RNG file and the shared state; never another rank's RNGs. Each model shard
    and RNG file rewritten on disk as soon as its rank read it, and the resume still bitwise
    that of the uninterrupted run: the bytes used are the bytes read (and hashed there:
    SealedReads). A checkpoint in the form of distributed schema 2 (whole-file digests)
    resumes bitwise too."""
    root, results, _ = legs
    full, resumed, old = results[5], results[19], results[21]
    assert resumed.get("loss") == full["loss"], resumed
    assert old.get("loss") == full["loss"], old
    old_meta = json.loads((root / "old_fsdp2" / "step-00000005" / "meta.json").read_text())
    assert old_meta["schema"] == "pipeline.checkpoint.distributed/2"
    assert all(set(entry) == {"sha256", "size"} for entry in old_meta["files"].values())
    folder = root / "reads_fsdp2" / "step-00000005"
    with pytest.raises(ChecksumMismatch, match="SHA-256 differs"):
        verify_distributed(folder)  # the rewrites did land on disk
    files = json.loads((folder / "meta.json").read_text())["files"]
    assert {entry["chunk_size"] for entry in files.values()} == {READ_CHUNK}
    heads, replicated = {}, {}
    for name in files:
        if name.startswith((f"{DIST_MODEL_DIR}/", f"{DIST_OPTIM_DIR}/")):
            data = (folder / name).read_bytes()
            heads[name] = 8 + int.from_bytes(data[:8], "little")
            entries = json.loads(data[8 : heads[name]])
            # The chunks covering the header and each tensor every rank holds alike (shape []).
            spans = [(0, heads[name])] + [
                (heads[name] + e["data_offsets"][0], heads[name] + e["data_offsets"][1])
                for e in entries.values()
                if e.get("shape") == []
            ]
            chunks = {k for a, b in spans for k in range(a // READ_CHUNK, (b - 1) // READ_CHUNK + 1)}
            if len(spans) > 1:
                replicated[name] = sum(min(READ_CHUNK, files[name]["size"] - k * READ_CHUNK) for k in chunks)
    sizes = {name: files[name]["size"] for name in replicated}
    assert replicated and all(replicated[name] < sizes[name] for name in replicated), (replicated, sizes)
    for rank in (0, 1):
        got = json.loads(Path(f"{root / 'reads'}-rank{rank}.json").read_text())
        read = {name.removeprefix("step-00000005/"): count for name, count in got["read"].items()}
        own = {f"{DIST_MODEL_DIR}/{_shard(rank + 1)}", f"{DIST_OPTIM_DIR}/{_shard(rank + 1)}"}
        for name, entry in files.items():
            if name in heads:
                hashed = entry["size"] if name in own else replicated.get(name, 0)
                assert read.get(name) == heads[name] + hashed, (rank, name, read)
            elif name in (rank_rng_file(rank), STATE_FILE):
                assert read.get(name) == entry["size"], (rank, name, read)
            else:
                assert name not in read, (rank, name, read)
        mine = {f"step-00000005/{DIST_MODEL_DIR}/{_shard(rank + 1)}", f"step-00000005/{rank_rng_file(rank)}"}
        assert set(got["rewritten"]) == mine, got


@LEGS
def test_a_shard_damaged_after_its_seal_is_refused_on_every_launch_shape(legs, data_dir, tmp_path):
    """Only rank 1 reads the damaged shard; both ranks refuse with its line, exit 2. In one
    process (04 and 05) the same copy is refused; the 2->1 reshard: see
    test_other_world_size_is_refused_then_resharded_within_1e9."""
    root, results, _ = legs
    damaged = results[20]
    assert damaged.get("error") == "ChecksumMismatch", damaged
    assert f"{DIST_MODEL_DIR}/{_shard(2)} SHA-256 differs from meta.json" in damaged["message"], damaged
    assert damaged["exit_codes"] == [2, 2], damaged
    folder = root / "damaged_fsdp2" / "step-00000005"
    config = load_config(CONFIG, {"data.dir": str(data_dir), "checkpoint.dir": str(root / "damaged_fsdp2")})
    with pytest.raises(ChecksumMismatch, match=f"{_shard(2)} SHA-256 differs"):
        evaluate_checkpoint(config, folder)
    with pytest.raises(ChecksumMismatch, match=f"{_shard(2)} SHA-256 differs"):
        build_stage(config, checkpoint=folder, stage_dir=tmp_path / "stage")


@LEGS
def test_one_process_verifies_each_chunk_of_a_distributed_checkpoint_and_names_the_damaged_one(
    legs, data_dir, tmp_path
):
    """04, 05 and a load of the weights and the state in one process (the proof's) compare
    every chunk digest of every file: a byte flipped in a middle chunk of a model shard is
    refused naming the file and the chunk. Sealed with whole-file digests only (distributed
    schema 2), the same copy is verified by those, the flip refused naming the file."""
    folder = _damaged_copy(legs, tmp_path)
    whole = load_checkpoint(folder)
    reseal(
        folder,
        lambda meta: meta["files"].update(
            {name: entry_of((folder / name).read_bytes(), READ_CHUNK) for name in meta["files"]}
        ),
    )
    loaded = load_checkpoint(folder)
    assert loaded.model_tensors.keys() == whole.model_tensors.keys()
    assert all(torch.equal(loaded.model_tensors[k], whole.model_tensors[k]) for k in whole.model_tensors)
    name = f"{DIST_MODEL_DIR}/{_shard(2)}"
    raw = (folder / name).read_bytes()
    chunk = len(raw) // READ_CHUNK // 2
    assert 0 < chunk < len(raw) // READ_CHUNK - 1
    damaged = bytearray(raw)
    damaged[chunk * READ_CHUNK + 9] ^= 1
    (folder / name).write_bytes(damaged)
    span = f"bytes {chunk * READ_CHUNK}-{(chunk + 1) * READ_CHUNK}"
    line = f"{name} SHA-256 differs from meta.json (chunk {chunk}: {span})"
    config = load_config(CONFIG, {"data.dir": str(data_dir), "checkpoint.dir": str(tmp_path)})
    for load in (
        lambda: evaluate_checkpoint(config, folder),
        lambda: build_stage(config, checkpoint=folder, stage_dir=tmp_path / "stage"),
        lambda: load_checkpoint(folder),
    ):
        with pytest.raises(ChecksumMismatch) as caught:
            load()
        assert line in str(caught.value)
    reseal(
        folder,
        lambda meta: meta.update(
            schema="pipeline.checkpoint.distributed/2",
            files={n: {"sha256": e["sha256"], "size": e["size"]} for n, e in meta["files"].items()},
        ),
    )
    with pytest.raises(ChecksumMismatch, match=f"{name} SHA-256 differs from meta.json: the file is damaged"):
        verify_distributed(folder)
    (folder / name).write_bytes(raw)
    assert verify_distributed(folder)["schema"] == "pipeline.checkpoint.distributed/2"


@LEGS
def test_meta_is_sealed_and_the_folder_listed_like_a_single_process_checkpoint(legs, tmp_path):
    folder = _damaged_copy(legs, tmp_path)
    text = (folder / "meta.json").read_text()
    (folder / "meta.json").write_text(text.replace('"world_size": 2', '"world_size": 1'))
    with pytest.raises(ChecksumMismatch, match="meta_sha256 does not match"):
        verify_distributed(folder)
    (folder / "meta.json").write_text(text)
    (folder / "model" / ".metadata").write_bytes(b"\x80\x04pickle")  # what FileSystemWriter would add
    with pytest.raises(ChecksumMismatch, match=r"model/\.metadata is not listed in meta.json"):
        verify_distributed(folder)
    (folder / "model" / ".metadata").unlink()
    reseal(folder, lambda meta: meta["parallel"].update(mode="tp"))
    with pytest.raises(SchemaMismatch, match="malformed parallel record"):
        verify_distributed(folder)
    for resharded in (0, -2, 2.0, True):  # a world size it was resharded from: a whole number from 1
        reseal(
            folder,
            lambda meta, r=resharded: meta.update(
                parallel={**meta["parallel"], "mode": "fsdp2"}, resharded_from=r
            ),
        )
        with pytest.raises(SchemaMismatch, match="malformed resharded_from"):
            verify_distributed(folder)
    reseal(folder, lambda meta: meta.update(resharded_from=None))
    reseal(
        folder,
        lambda meta: (meta["parallel"].update(mode="fsdp2"), meta["files"].pop("rng/rank-00001.safetensors")),
    )
    with pytest.raises(SchemaMismatch, match="does not list rng/rank-00001.safetensors"):
        verify_distributed(folder)


@LEGS
def test_one_process_resumes_a_distributed_checkpoint_only_with_reshard_and_stages_only_its_metrics(
    legs, data_dir, tmp_path
):
    folder = _damaged_copy(legs, tmp_path)  # intact copy in tmp_path/step-00000010
    config = load_config(CONFIG, {"data.dir": str(data_dir), "checkpoint.dir": str(tmp_path)})
    with pytest.raises(
        LaunchMismatch,
        match=r"was written by 2 processes \(training.parallel fsdp2\), this run is "
        r"one process \(training.parallel none\): .* pass --reshard",
    ):
        train(config, resume="latest", progress=False)
    # Another checkpoint's metrics stay off its card.
    other = evaluate_checkpoint(config, legs[0] / "full_fsdp2" / "step-00000005")
    with pytest.raises(StageError, match="evaluates step 5 .* not the checkpoint being staged"):
        build_stage(
            config,
            checkpoint=folder,
            stage_dir=tmp_path / "stage",
            metrics=write_metrics(other, config, tmp_path / "metrics.json"),
        )


@LEGS
def test_shard_coverage_is_checked_even_when_meta_agrees(legs, tmp_path):
    # A shard removed and struck from meta.json passes the hashes; only coverage catches it
    # (DCP's reader would load half the rows without a word).
    folder = _damaged_copy(legs, tmp_path)
    shard = sorted((folder / "model").iterdir())[0]
    reseal(folder, lambda meta: meta["files"].pop(f"model/{shard.name}"))
    shard.unlink()
    with pytest.raises(ChecksumMismatch, match="cover|no shard"):
        verify_distributed(folder)


def _sharded_by_hand(folder: Path) -> dict[str, torch.Tensor]:
    """A model part as FSDP2 shards it, written with the project's writer: ``w`` (4x3) split by
    rows over two shard files (DCP's offsets in each header), ``b`` whole in the first; the
    full tensors."""
    from pipeline.checkpoint.tensorfile import write_safetensors

    full = {"b": torch.arange(3.0), "w": torch.arange(12.0).reshape(4, 3)}
    (folder / DIST_MODEL_DIR).mkdir(parents=True)
    for index, rows, extra in ((1, slice(0, 2), {"b": full["b"]}), (2, slice(2, 4), {})):
        offsets = {"w": {"saved_offsets": [rows.start, 0]}, **{n: {"saved_offsets": [0]} for n in extra}}
        write_safetensors(
            folder / DIST_MODEL_DIR / _shard(index),
            {"w": full["w"][rows].clone(), **extra},
            {"DCP_SHARDING_INFO": json.dumps(offsets)},
        )
    return full


def test_shard_coverage_refuses_a_tensor_meta_json_does_not_list_and_one_no_shard_holds(tmp_path):
    """Coverage looks both ways: a shard holding a tensor meta.json's ``tensors`` does not list
    is refused naming it (not consolidated without a word), and so is a listed tensor no shard
    holds; the shards as listed consolidate to the full tensors."""
    from pipeline.checkpoint.shards import consolidate, shard_tensors, tensor_specs
    from pipeline.checkpoint.tensorfile import map_file

    full = _sharded_by_hand(tmp_path)
    maps = {f"{DIST_MODEL_DIR}/{p.name}": map_file(p) for p in (tmp_path / DIST_MODEL_DIR).iterdir()}
    listed = tensor_specs(full)
    pieces = shard_tensors(tmp_path, DIST_MODEL_DIR, listed, maps)
    joined = consolidate(pieces, listed)
    assert all(torch.equal(joined[name], full[name]) for name in full) and sorted(joined) == ["b", "w"]
    assert joined["b"] is pieces["b"][0][1]  # held whole by one shard: that shard's view, no copy
    without_b = tensor_specs({"w": full["w"]})
    with pytest.raises(ChecksumMismatch, match="holds tensor b that meta.json does not list"):
        shard_tensors(tmp_path, DIST_MODEL_DIR, without_b, maps)
    with_c = tensor_specs({**full, "c": torch.zeros(2)})
    with pytest.raises(ChecksumMismatch, match="holds no shard of tensor c: a shard file is missing"):
        shard_tensors(tmp_path, DIST_MODEL_DIR, with_c, maps)
    # Sharding info whose entry for a tensor is not a mapping: the file named, not a traceback.
    _rewrite_shard(tmp_path, 2, {"w": full["w"][2:4].clone()}, {"w": [2, 0]})
    second = tmp_path / DIST_MODEL_DIR / _shard(2)
    maps[f"{DIST_MODEL_DIR}/{_shard(2)}"] = map_file(second)
    with pytest.raises(SchemaMismatch) as refused:
        shard_tensors(tmp_path, DIST_MODEL_DIR, listed, maps)
    assert str(refused.value) == (
        f"{second} has a malformed DCP_SHARDING_INFO ('list' object has no attribute 'get'): the file is damaged"
    )


def _launch_meta(world_size: int = 2, **changes) -> dict:
    """The launch record of a meta.json as a 2-process DDP run writes it (files table by name)."""
    meta = {
        "parallel": {"mode": "ddp", "world_size": world_size, "ddp_find_unused_parameters": False},
        "resharded_from": None,
        "tensors": {
            DIST_MODEL_DIR: {"w": {"dtype": "F32", "shape": [4, 3]}, "e": {"dtype": "BF16", "shape": [0]}},
            DIST_OPTIM_DIR: {"state.w.exp_avg": {"dtype": "F32", "shape": [4, 3]}},
        },
        "files": dict.fromkeys(
            [
                STATE_FILE,
                *(rank_rng_file(rank) for rank in range(world_size)),
                f"{DIST_MODEL_DIR}/{_shard(1)}",
                f"{DIST_OPTIM_DIR}/{_shard(1)}",
            ],
            {},
        ),
    }
    meta.update(changes)
    return meta


def test_a_launch_record_that_does_not_describe_a_launch_is_one_line_naming_what_and_the_fix(tmp_path):
    """meta.json's launch record (read by every load of a distributed checkpoint, sealed: only a
    writer of another version or a resealed edit gets here): each field and the files table
    is held to what a launch writes, on both sides of each bound, and refused in one line
    naming the file and what is wrong with it."""
    from pipeline.checkpoint.shards import check_launch_record
    from pipeline.errors import SEALED_BUT_UNFIT

    path = tmp_path / "meta.json"
    parallel = _launch_meta()["parallel"]
    fits = [
        _launch_meta(),
        _launch_meta(1),  # one process under torchrun
        _launch_meta(parallel={**parallel, "mode": "fsdp2", "ddp_find_unused_parameters": True}),
        _launch_meta(resharded_from=1),
        _launch_meta(
            tensors={DIST_MODEL_DIR: {}, DIST_OPTIM_DIR: {}},
            files={STATE_FILE: {}, **{rank_rng_file(r): {} for r in range(2)}},
        ),
    ]
    for meta in fits:
        check_launch_record(path, meta)
    malformed = {
        "parallel record": [
            {**parallel, "mode": "tp"},
            {**parallel, "world_size": 0},
            {**parallel, "world_size": True},
            {**parallel, "world_size": 2.0},
            {**parallel, "ddp_find_unused_parameters": 0},
            {k: v for k, v in parallel.items() if k != "ddp_find_unused_parameters"},
            {**parallel, "nodes": 1},
        ],
        "resharded_from": [0, True, 1.0],
        "tensors table": [
            {DIST_MODEL_DIR: {}},
            {DIST_MODEL_DIR: {}, DIST_OPTIM_DIR: {}, "rng": {}},
            {DIST_MODEL_DIR: {"w": {"dtype": "F99", "shape": [4]}}, DIST_OPTIM_DIR: {}},
            {DIST_MODEL_DIR: {"w": {"dtype": "F32", "shape": [-1]}}, DIST_OPTIM_DIR: {}},
            {DIST_MODEL_DIR: {"w": {"dtype": "F32", "shape": [4.0]}}, DIST_OPTIM_DIR: {}},
            {DIST_MODEL_DIR: {"w": {"dtype": "F32", "shape": [True, 3]}}, DIST_OPTIM_DIR: {}},
            {DIST_MODEL_DIR: {"w": {"dtype": "F32", "shape": 4}}, DIST_OPTIM_DIR: {}},
            {DIST_MODEL_DIR: {"w": {"dtype": "F32"}}, DIST_OPTIM_DIR: {}},
            {DIST_MODEL_DIR: {"w": {"dtype": "F32", "shape": [4], "stride": [1]}}, DIST_OPTIM_DIR: {}},
            {DIST_MODEL_DIR: [], DIST_OPTIM_DIR: {}},
        ],
    }
    field = {"parallel record": "parallel", "resharded_from": "resharded_from", "tensors table": "tensors"}
    for what, values in malformed.items():
        for value in values:
            with pytest.raises(SchemaMismatch) as refused:
                check_launch_record(path, _launch_meta(**{field[what]: value}))
            assert str(refused.value) == f"{path} has a malformed {what}: {SEALED_BUT_UNFIT}", (
                value,
                refused.value,
            )
    files = _launch_meta()["files"]
    for odd in ("modelo.safetensors", rank_rng_file(2), DIST_MODEL_DIR, "rng/x.safetensors"):
        with pytest.raises(SchemaMismatch) as refused:
            check_launch_record(path, _launch_meta(files={**files, odd: {}}))
        assert str(refused.value) == f"{path} lists {odd!r}, which has no place in a distributed checkpoint"
    for gone, named in ((rank_rng_file(1), rank_rng_file(1)), (DIST_RNG_DIR, rank_rng_file(0))):
        kept = {name: entry for name, entry in files.items() if not name.startswith(gone)}
        with pytest.raises(SchemaMismatch) as refused:
            check_launch_record(path, _launch_meta(files=kept))
        assert str(refused.value) == f"{path} does not list {named}: the checkpoint is incomplete"
    # Three ranks: the middle rank's RNG file is as required as the first's and the last's.
    three = _launch_meta(3)
    check_launch_record(path, three)
    for rank in range(3):
        kept = {name: entry for name, entry in three["files"].items() if name != rank_rng_file(rank)}
        with pytest.raises(SchemaMismatch) as refused:
            check_launch_record(path, _launch_meta(3, files=kept))
        assert (
            str(refused.value) == f"{path} does not list {rank_rng_file(rank)}: the checkpoint is incomplete"
        )
    for part in (DIST_MODEL_DIR, DIST_OPTIM_DIR):
        kept = {name: entry for name, entry in files.items() if not name.startswith(f"{part}/")}
        with pytest.raises(SchemaMismatch) as refused:
            check_launch_record(path, _launch_meta(files=kept))
        assert str(refused.value) == (
            f"{path} lists no shard file for the model or the optimizer: the checkpoint is incomplete"
        )


def test_a_rank_rng_file_without_a_readable_rng_record_is_one_line_naming_it(tmp_path):
    """A rank's RNG file (sealed, so its hash passes) is read by a torchrun resume or a reshard
    through read_rank_rng: one whose header metadata lacks the ``rng`` record, or holds one
    that is not JSON, is refused naming the file, not a KeyError or a parser's traceback."""
    from pipeline.checkpoint.dist_restore import read_rank_rng
    from pipeline.checkpoint.tensorfile import write_safetensors

    path = tmp_path / rank_rng_file(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"rng/torch_cpu": torch.get_rng_state()}
    write_safetensors(path, state, {"format": "pt", "rng": json.dumps({"python": 1})})
    tree, tensors = read_rank_rng(path)
    assert tree == {"python": 1} and torch.equal(tensors["rng/torch_cpu"], state["rng/torch_cpu"])
    for metadata in ({"format": "pt"}, {"format": "pt", "rng": "{not json"}):
        path.unlink()
        write_safetensors(path, state, metadata)
        with pytest.raises(StateMismatch) as caught:
            read_rank_rng(path)
        message = str(caught.value)
        assert f"{path} holds no readable RNG record" in message and "\n" not in message, message


def test_a_file_grown_since_its_seal_is_refused_by_the_rank_that_reads_it(tmp_path):
    """A rank's read of a sealed file (SealedReads, as a torchrun resume reads): the sealed
    bytes pass; the same file with bytes appended since is refused, although every chunk the
    rank reads still matches its digest; so is one cut short."""
    _sharded_by_hand(tmp_path)
    name = f"{DIST_MODEL_DIR}/{_shard(1)}"
    path = tmp_path / name
    data = path.read_bytes()
    meta = {"files": {name: entry_of(data, 64)}}
    assert len(data) > 2 * 64
    reads = SealedReads(tmp_path, meta)
    assert bytes(reads.read(name)) == data and bytes(reads.read(name, [(0, 10)])[:64]) == data[:64]
    # A read ending at the file's last byte is inside it; one starting before it or past its end is not.
    assert bytes(reads.read(name, [(len(data) - 1, len(data))])[-1:]) == data[-1:]
    assert not reads.refusals
    for outside in ((-1, 10), (10, len(data) + 1)):
        assert SealedReads(tmp_path, meta).read(name, [(0, 10), outside]) is None
    outside = SealedReads(tmp_path, meta)
    outside.read(name, [(-1, 10)])
    assert [str(e) for e in outside.refusals] == [
        f"{path}: a planned read falls outside the file: the file was modified"
    ]
    # Ranges to read in place that overlap (planned from a header not this file's): the first
    # is read in place, the second left untouched (its bytes read into the buffer), all hashed.
    first, second = bytearray(16), bytearray(16)
    got = SealedReads(tmp_path, meta).read(name, [(0, 24)], {0: memoryview(first), 8: memoryview(second)})
    assert bytes(first) == data[:16] and bytes(second) == bytes(16) and bytes(got[16:24]) == data[16:24]
    with open(path, "ab") as grown:
        grown.write(b"\0" * 64)
    assert reads.read(name, [(0, 10)]) is None
    assert str(reads.refusals[0]) == (
        f"{path} SHA-256 differs from meta.json (chunk 0: bytes 0-64): the file is damaged or was modified"
    )
    path.write_bytes(data[:-8])
    assert reads.read(name) is None and len(reads.refusals) == 2
    # Sealed with its whole digest only (distributed schema 2): one chunk, which the line does not name.
    whole = SealedReads(
        tmp_path, {"files": {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}
    )
    path.write_bytes(data)
    assert bytes(whole.read(name, [(0, 10)])) == data
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert whole.read(name, [(0, 10)]) is None
    assert [str(e) for e in whole.refusals] == [
        f"{path} SHA-256 differs from meta.json: the file is damaged or was modified"
    ]


def test_the_ranks_agree_on_the_first_refusal_a_rank_kept_of_the_kind_it_was():
    """What a rank refused while DCP's collectives ran is raised at the agreement (here one
    process, its own world): nothing when it refused nothing; else its first refusal, of its
    own kind (a checkpoint that does not fit is not called damaged), with its whole line."""
    from pipeline.world import World

    alone = World(device=torch.device("cpu"))
    reads = SealedReads(Path("ck"), {"files": {}})
    reads.agree(alone)
    for first in (
        StateMismatch("ck/rng/x holds no readable RNG record"),
        SchemaMismatch("ck/y is not valid"),
    ):
        reads = SealedReads(Path("ck"), {"files": {}})
        reads.refuse(first)
        reads.refuse(ChecksumMismatch("ck/z SHA-256 differs from meta.json"))
        with pytest.raises(type(first)) as caught:
            reads.agree(alone)
        assert type(caught.value) is type(first) and str(caught.value) == str(first)


def test_a_resume_refuses_a_shard_stored_in_another_dtype_than_meta_json_lists(tmp_path):
    """meta.json's ``tensors`` lists each tensor's dtype: a torchrun resume plans its reads
    from the shards' headers (VerifiedShardReader, no launch), and a sealed shard holding its
    rows of ``w`` in float64 where meta.json lists float32 is refused naming the file, not cast
    into the parameters; the shards as listed plan."""
    from pipeline.checkpoint.shards import tensor_specs
    from pipeline.checkpoint.tensorfile import write_safetensors
    from pipeline.checkpoint.verified_dcp import VerifiedShardReader

    full = _sharded_by_hand(tmp_path)
    names = [f"{DIST_MODEL_DIR}/{_shard(i)}" for i in (1, 2)]

    def planned() -> object:
        files = {name: entry_of((tmp_path / name).read_bytes(), 64) for name in names}
        meta = {"files": files, "tensors": {"model": tensor_specs(full)}}
        return VerifiedShardReader(SealedReads(tmp_path, meta), "model").read_metadata()

    assert sorted(planned().state_dict_metadata) == ["b", "w"]
    (tmp_path / names[1]).unlink()
    write_safetensors(
        tmp_path / names[1],
        {"w": full["w"][2:4].to(torch.float64)},
        {"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [2, 0]}})},
    )
    with pytest.raises(ChecksumMismatch, match=rf"{_shard(2)}: a shard of w does not fit its F32 tensor"):
        planned()


def _rewrite_shard(folder: Path, index: int, tensors: dict, offsets: dict | str) -> None:
    """Shard file ``index`` of the model part replaced by ``tensors`` at DCP ``offsets`` (a
    dict per tensor, or the raw sharding text)."""
    from pipeline.checkpoint.tensorfile import write_safetensors

    path = folder / DIST_MODEL_DIR / _shard(index)
    path.unlink(missing_ok=True)
    info = offsets if isinstance(offsets, str) else json.dumps(offsets)
    write_safetensors(path, tensors, {"DCP_SHARDING_INFO": info})


def test_a_resume_plans_only_from_shards_that_tile_every_tensor_meta_json_lists(tmp_path):
    """A torchrun resume plans its reads from the shards' headers (VerifiedShardReader, no
    launch): the hand-made shards plan each tensor's chunks where they lie, one rank's rows
    ending exactly at the tensor's end; a tensor a shard holds that meta.json does not list,
    a listed one no shard holds, a shard past its tensor's rows or of another rank, two shards
    overlapping, a shard struck from meta.json and unreadable sharding info are each refused
    in one line naming the file or part and what is wrong."""
    from pipeline.checkpoint.shards import tensor_specs
    from pipeline.checkpoint.verified_dcp import VerifiedShardReader

    full = _sharded_by_hand(tmp_path)
    names = [f"{DIST_MODEL_DIR}/{_shard(i)}" for i in (1, 2)]
    part = tmp_path / DIST_MODEL_DIR

    def planned(specs=None, listed=names):
        files = {name: entry_of((tmp_path / name).read_bytes(), 64) for name in listed}
        meta = {"files": files, "tensors": {DIST_MODEL_DIR: tensor_specs(full) if specs is None else specs}}
        return VerifiedShardReader(SealedReads(tmp_path, meta), DIST_MODEL_DIR).read_metadata()

    def refused(error, line, **kwargs):
        with pytest.raises(error) as caught:
            planned(**kwargs)
        assert str(caught.value) == line

    plan = planned()
    chunks = {
        name: [(list(c.offsets), list(c.sizes)) for c in tensor.chunks]
        for name, tensor in plan.state_dict_metadata.items()
    }
    assert chunks == {"b": [([0], [3])], "w": [([0, 0], [2, 3]), ([2, 0], [2, 3])]}
    assert all(t.properties.dtype == torch.float32 for t in plan.state_dict_metadata.values())
    assert {(i.fqn, tuple(i.offset)): name for i, name in plan.storage_data.items()} == {
        ("b", (0,)): names[0],
        ("w", (0, 0)): names[0],
        ("w", (2, 0)): names[1],
    }
    refused(
        ChecksumMismatch,
        f"{tmp_path / names[0]} holds tensor b that meta.json does not list",
        specs=tensor_specs({"w": full["w"]}),
    )
    refused(
        ChecksumMismatch,
        f"{part}/ holds no shard of tensor c: a shard file is missing",
        specs=tensor_specs({**full, "c": torch.zeros(2)}),
    )
    for shape in ((3, 3), (12,)):  # rows 2-3 past a 3-row w; a 2-D shard of a 1-D w
        refused(
            ChecksumMismatch,
            f"{tmp_path / names[1 if shape == (3, 3) else 0]}: a shard of w does not fit its F32 tensor "
            f"of shape {list(shape)}",
            specs=tensor_specs({**full, "w": torch.zeros(shape)}),
        )
    refused(
        ChecksumMismatch,
        f"{part}/: the shards of w cover 6 of its 12 elements: a shard file is missing or damaged",
        listed=names[:1],
    )
    _rewrite_shard(tmp_path, 2, {"w": full["w"][1:3].clone()}, {"w": {"saved_offsets": [1, 0]}})
    refused(ChecksumMismatch, f"{part}/: two shards of w overlap")
    # Three ranks, w's rows 0-1, 3 and 2: planned where each lies; then the last overlapping
    # the first (row 1), or the middle one (row 2), though neither overlaps the other.
    three = [*names, f"{DIST_MODEL_DIR}/{_shard(3)}"]
    for middle, last in ((3, 2), (3, 1), (2, 2)):
        _rewrite_shard(
            tmp_path, 2, {"w": full["w"][middle : middle + 1].clone()}, {"w": {"saved_offsets": [middle, 0]}}
        )
        _rewrite_shard(
            tmp_path, 3, {"w": full["w"][last : last + 1].clone()}, {"w": {"saved_offsets": [last, 0]}}
        )
        if middle == 3 and last == 2:
            plan = planned(listed=three).state_dict_metadata["w"]
            rows = [([0, 0], [2, 3]), ([3, 0], [1, 3]), ([2, 0], [1, 3])]
            assert [(list(c.offsets), list(c.sizes)) for c in plan.chunks] == rows
        else:
            with pytest.raises(ChecksumMismatch) as caught:
                planned(listed=three)
            assert str(caught.value) == f"{part}/: two shards of w overlap"
    (tmp_path / three[2]).unlink()
    # Two ranks holding w's columns 0-1 and 2 (every row each): they meet, they do not overlap.
    _rewrite_shard(
        tmp_path, 1, {"b": full["b"], "w": full["w"][:, :2].clone()}, {"w": {"saved_offsets": [0, 0]}}
    )
    _rewrite_shard(tmp_path, 2, {"w": full["w"][:, 2:].clone()}, {"w": {"saved_offsets": [0, 2]}})
    plan = planned().state_dict_metadata["w"]
    assert [(list(c.offsets), list(c.sizes)) for c in plan.chunks] == [([0, 0], [4, 2]), ([0, 2], [4, 1])]
    # A column w whose second half comes as a 1-D chunk of the right size and place.
    column = torch.arange(4.0).view(4, 1)
    _rewrite_shard(tmp_path, 1, {"b": full["b"], "w": column[:2].clone()}, {"w": {"saved_offsets": [0, 0]}})
    _rewrite_shard(tmp_path, 2, {"w": column[2:].reshape(2).clone()}, {"w": {"saved_offsets": [2]}})
    refused(
        ChecksumMismatch,
        f"{tmp_path / names[1]}: a shard of w does not fit its F32 tensor of shape [4, 1]",
        specs=tensor_specs({"b": full["b"], "w": column}),
    )
    _rewrite_shard(tmp_path, 2, {"w": full["w"][2:4].clone()}, "{not json")
    with pytest.raises(SchemaMismatch) as caught:
        planned()
    assert str(caught.value).startswith(f"{tmp_path / names[1]} is not a valid shard file: ")
    assert "\n" not in str(caught.value)


def test_a_resume_whose_built_tensors_differ_from_the_checkpoints_names_the_first_that_differs(tmp_path):
    """Before DCP reads a byte, the run's tensors are compared with meta.json's list of the
    part: a tensor the run has and the checkpoint lacks, one it lacks and the checkpoint has,
    and one of another shape or dtype are each refused naming it (the first in name order)
    and the part, as a checkpoint that does not fit the config."""
    from types import SimpleNamespace

    from pipeline.checkpoint.dist_restore import _dcp_load
    from pipeline.checkpoint.shards import tensor_specs

    full = _sharded_by_hand(tmp_path)
    names = [f"{DIST_MODEL_DIR}/{_shard(i)}" for i in (1, 2)]
    files = {name: entry_of((tmp_path / name).read_bytes(), 64) for name in names}
    meta = {"files": files, "tensors": {DIST_MODEL_DIR: tensor_specs(full)}}
    alone = SimpleNamespace(launched=False)
    fresh = {name: torch.zeros_like(tensor) for name, tensor in full.items()}
    for template, odd in (
        ({**fresh, "a": torch.zeros(1)}, "a"),
        ({"w": fresh["w"]}, "b"),
        ({**fresh, "w": torch.zeros(4, 4)}, "w"),
        ({**fresh, "b": torch.zeros(3, dtype=torch.float64)}, "b"),
    ):
        with pytest.raises(StateMismatch) as caught:
            _dcp_load(template, SealedReads(tmp_path, meta), DIST_MODEL_DIR, "model", alone)
        assert str(caught.value) == (
            f"{tmp_path / DIST_MODEL_DIR}: the checkpoint's model tensors differ from this run's at {odd}: "
            "it does not fit the model or optimizer built from the config"
        )
        assert all(not tensor.any() for tensor in template.values()), "a refused load wrote into the run"


def test_a_state_loader_that_misses_a_key_is_one_line_naming_the_checkpoint(tmp_path):
    """torch's state loaders report a state naming a key this run lacks as a KeyError: a
    resume or --reshard ends with one line naming the checkpoint, like their other refusals."""
    from pipeline.checkpoint.dist_restore import _fits

    saved: dict[str, torch.Tensor] = {"exp_avg": torch.zeros(2)}
    with pytest.raises(StateMismatch) as caught, _fits(tmp_path):
        saved["exp_avg_sq"]
    assert str(caught.value) == f"{tmp_path}: saved training state does not fit this run: 'exp_avg_sq'"


def test_a_shard_damaged_after_its_seal_is_kept_as_the_ranks_refusal_until_they_agree(tmp_path, monkeypatch):
    """A torchrun resume's load through DCP, in-process: a byte of one shard flipped after its
    seal does not end the load in DCP's collectives (a rank raising there would leave its peers
    waiting); the rank keeps the refusal naming the file and its chunk, reads the intact shard,
    and raises that refusal at the ranks' agreement. So is a shard whose header changed between
    the plan and the read, although the bytes read match their seal."""
    from types import SimpleNamespace

    from pipeline.checkpoint.dist_restore import _dcp_load
    from pipeline.checkpoint.shards import tensor_specs
    from pipeline.world import World

    full = _sharded_by_hand(tmp_path)
    names = [f"{DIST_MODEL_DIR}/{_shard(i)}" for i in (1, 2)]
    files = {name: entry_of((tmp_path / name).read_bytes(), 64) for name in names}
    meta = {"files": files, "tensors": {DIST_MODEL_DIR: tensor_specs(full)}}
    damaged = bytearray((tmp_path / names[1]).read_bytes())
    damaged[-1] ^= 1
    (tmp_path / names[1]).write_bytes(bytes(damaged))
    template = {name: torch.zeros_like(tensor) for name, tensor in full.items()}
    reads = SealedReads(tmp_path, meta)
    _dcp_load(template, reads, DIST_MODEL_DIR, "model", SimpleNamespace(launched=False))
    assert torch.equal(template["b"], full["b"]) and torch.equal(template["w"][:2], full["w"][:2])
    last = (len(damaged) - 1) // 64
    line = (
        f"{tmp_path / names[1]} SHA-256 differs from meta.json (chunk {last}: bytes {last * 64}-{len(damaged)}): "
        "the file is damaged or was modified"
    )
    assert [str(refusal) for refusal in reads.refusals] == [line]
    with pytest.raises(ChecksumMismatch) as caught:
        reads.agree(World(device=torch.device("cpu")))
    assert str(caught.value) == line
    from pipeline.checkpoint.tensorfile import write_safetensors
    from pipeline.checkpoint.verified_dcp import VerifiedShardReader

    (tmp_path / names[1]).write_bytes(bytes(damaged[:-1]) + bytes([damaged[-1] ^ 1]))
    planned = VerifiedShardReader.read_metadata

    def then_rewritten(reader, *args, **kwargs):
        plan = planned(reader, *args, **kwargs)
        # Same rows, another header, sealed anew: only the plan knows the old one.
        (tmp_path / names[1]).unlink()
        offsets = {"w": {"saved_offsets": [2, 0]}}
        write_safetensors(
            tmp_path / names[1],
            {"w": full["w"][2:4].clone()},
            {"DCP_SHARDING_INFO": json.dumps(offsets), "by": "x"},
        )
        reader.reads.meta["files"][names[1]] = entry_of((tmp_path / names[1]).read_bytes(), 64)
        return plan

    monkeypatch.setattr(VerifiedShardReader, "read_metadata", then_rewritten)
    reads = SealedReads(tmp_path, {**meta, "files": dict(files)})
    _dcp_load(
        {name: torch.zeros_like(tensor) for name, tensor in full.items()},
        reads,
        DIST_MODEL_DIR,
        "model",
        SimpleNamespace(launched=False),
    )
    assert [str(refusal) for refusal in reads.refusals] == [
        f"{tmp_path / names[1]} changed while it was read: the file was modified"
    ]


def test_a_disk_error_reading_a_shard_in_a_resume_is_the_os_error_not_a_checkpoint_that_does_not_fit(
    tmp_path, monkeypatch
):
    """A torchrun resume's load through DCP, in-process (one process reading every shard): the
    sealed shards load whole; a read that fails with EIO (a failing disk, a shard file gone) is
    reported as that OS error, which the command prints with its fix, not as "saved training
    state does not fit this run", which would send the user to their config."""
    import errno
    from types import SimpleNamespace

    import pipeline.checkpoint.verified_dcp as verified_dcp
    from pipeline.checkpoint.dist_restore import _dcp_load
    from pipeline.checkpoint.shards import tensor_specs
    from pipeline.checkpoint.tensorfile import parse_header

    full = _sharded_by_hand(tmp_path)
    names = [f"{DIST_MODEL_DIR}/{_shard(i)}" for i in (1, 2)]
    files = {name: entry_of((tmp_path / name).read_bytes(), 64) for name in names}
    meta = {"files": files, "tensors": {DIST_MODEL_DIR: tensor_specs(full)}}
    alone = SimpleNamespace(launched=False)
    template = {name: torch.zeros_like(tensor) for name, tensor in full.items()}
    _dcp_load(template, SealedReads(tmp_path, meta), DIST_MODEL_DIR, "model", alone)
    assert all(torch.equal(template[name], full[name]) for name in full)
    # Shard 2 sealed in chunks that break just before its last element: that chunk is read too.
    second = (tmp_path / names[1]).read_bytes()
    header, start = parse_header(second)
    edge = {
        **meta,
        "files": {**files, names[1]: entry_of(second, start + header["w"]["data_offsets"][1] - 4)},
    }
    template = {name: torch.zeros_like(tensor) for name, tensor in full.items()}
    _dcp_load(template, SealedReads(tmp_path, edge), DIST_MODEL_DIR, "model", alone)
    assert all(torch.equal(template[name], full[name]) for name in full)
    # A run's tensor laid out otherwise than the stored rows (transposed) is copied into, not read over.
    template = {"b": torch.zeros(3), "w": torch.zeros(3, 4).t()}
    _dcp_load(template, SealedReads(tmp_path, meta), DIST_MODEL_DIR, "model", alone)
    assert all(torch.equal(template[name], full[name]) for name in full)

    def failing_disk(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(verified_dcp, "read_and_hash", failing_disk)
    with pytest.raises(OSError) as failed:
        _dcp_load(template, SealedReads(tmp_path, meta), DIST_MODEL_DIR, "model", alone)
    assert failed.value.errno == errno.EIO, failed.value


def launch_plan(nproc: int, root: Path, name: str, runs: list[dict]) -> list[dict]:
    """Run ``runs`` in one launch of tests/helpers/dist_leg.py; their results (rank 0's)."""
    plan = root / f"{name}.json"
    plan.write_text(
        json.dumps({"config": str(CONFIG), "results": str(root / f"{name}-results.json"), "runs": runs})
    )
    result = torchrun(nproc, str(HELPERS / "dist_leg.py"), str(plan), cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((root / f"{name}-results.json").read_text())


@LEGS
def test_a_stream_split_over_two_ranks_resumes_bitwise_and_trains_on_the_batches_of_one_process(
    legs, tmp_path
):
    """data.stream_split 'examples': global batch k holds the records of one process's batch
    k, each seeded by its position, so the 2-process run follows the 1-process one (DDP's
    reduction order aside) across the pass boundary at step 6."""
    root, results, _ = legs
    full, cut, resumed = results[8:11]
    assert cut["step"] == 7 and resumed["step"] == full["step"] == 10 and resumed["loss"] == full["loss"]
    source = verify_distributed(root / "stream_cut" / "step-00000010")["training_state"]["data"]["source"]
    assert source["world_size"] is None and [(r["pass"], r["consumed"]) for r in source["ranks"]] == [(1, 16)]
    config = load_config(
        CONFIG, {"data.dir": str(root / "stream"), "checkpoint.dir": str(tmp_path), **QUIET_RNG, **STREAM}
    )
    alone = train(config, progress=False)
    assert max(abs(a - b) for a, b in zip(alone.history["loss"], full["loss"])) <= 1e-12


@LEGS
def test_other_world_size_is_refused_then_resharded_within_1e9(legs, data_dir, tmp_path):
    """One 1-process launch: the refusal, a forged state refused by the validated restore,
    a shard damaged after its seal refused, one struck from a resealed meta.json refused by
    its coverage, headers swapped while planning refused, then the 2->1 reshard (augmentation noise on: it
    is seeded per sample); a stream, whose position is per rank, refused."""
    root, results, _ = legs
    assert results[12]["step"] == 6
    base = {"data.dir": str(data_dir), "training.parallel": "ddp", **QUIET_RNG}
    resume = {"resume": "latest", "overrides": {**base, "checkpoint.dir": str(root / "quiet_cut")}}
    stream = {
        "data.dir": str(root / "stream"),
        "training.parallel": "ddp",
        **QUIET_RNG,
        **STREAM,
        "checkpoint.dir": str(tmp_path / "stream"),
    }
    damaged = f"{DIST_OPTIM_DIR}/{_shard(2)}"
    # Both FSDP2 model shards with the places of net.0.weight's chunks swapped in their headers
    # (coverage still whole), each swapped back once its header was read: the plan was made
    # from headers other than the sealed ones now read, and hashed, whole.
    chunk = '\\"net.0.weight\\": {\\"saved_offsets\\": [@, 0]}'
    swap = {
        f"{DIST_MODEL_DIR}/{_shard(1)}": [chunk.replace("@", "0"), chunk.replace("@", "8")],
        f"{DIST_MODEL_DIR}/{_shard(2)}": [chunk.replace("@", "8"), chunk.replace("@", "0")],
    }
    swapped = {
        "resume": "latest",
        "reshard": True,
        "overrides": {
            "data.dir": str(data_dir),
            "training.parallel": "fsdp2",
            "checkpoint.dir": str(tmp_path / "swapped"),
        },
        "copy": {
            "from": str(root / "full_fsdp2" / "step-00000005"),
            "to": str(tmp_path / "swapped"),
            "forge_header": swap,
        },
        "reads": {"to": str(tmp_path / "swapped_reads"), "restore": [f"step-00000005/{n}" for n in swap]},
    }
    refused, forged, refused_damaged, uncovered, header_swapped, resharded, stream = launch_plan(
        1,
        tmp_path,
        "reshard",
        [
            resume,
            {
                **resume,
                "reshard": True,
                "overrides": {**base, "checkpoint.dir": str(tmp_path / "forged")},
                "forge": {
                    "from": str(root / "quiet_cut"),
                    "to": str(tmp_path / "forged"),
                    "key": ["training_state", "scheduler", "last_epoch"],
                    "value": 5,
                },
            },
            {
                **resume,
                "reshard": True,
                "overrides": {**base, "checkpoint.dir": str(tmp_path / "damaged")},
                "copy": {
                    "from": str(root / "quiet_cut" / "step-00000006"),
                    "to": str(tmp_path / "damaged"),
                    "flip": damaged,
                },
            },
            {
                **swapped,
                # FSDP2: every tensor keeps rank 0's chunk, so DCP alone would load half the rows.
                "overrides": {**swapped["overrides"], "checkpoint.dir": str(tmp_path / "uncovered")},
                "copy": {
                    "from": str(root / "full_fsdp2" / "step-00000005"),
                    "to": str(tmp_path / "uncovered"),
                    "strike": f"{DIST_MODEL_DIR}/{_shard(2)}",
                },
                "reads": {"to": str(tmp_path / "uncovered_reads")},
            },
            swapped,
            {**resume, "reshard": True},
            {"resume": str(root / "stream_cut" / "step-00000007"), "reshard": True, "overrides": stream},
        ],
    )
    # A stream split by examples has one position for all ranks: it moves to one process too.
    assert stream["step"] == 10, stream
    assert max(abs(a - b) for a, b in zip(stream["loss"], results[8]["loss"])) <= 1e-9
    assert refused["error"] == "WorldSizeMismatch", refused
    assert (
        "written by 2 processes, this launch has 1" in refused["message"] and "\n" not in refused["message"]
    )
    assert forged["error"] == "StateMismatch" and "scheduler.last_epoch is 5" in forged["message"], forged
    # The one process reads every shard, and verifies each: a shard damaged after its seal is refused.
    assert refused_damaged["error"] == "ChecksumMismatch", refused_damaged
    assert f"{damaged} SHA-256 differs from meta.json" in refused_damaged["message"], refused_damaged
    # A shard struck from meta.json passes the hashes; the coverage DCP plans from catches it.
    assert uncovered["error"] == "ChecksumMismatch" and "cover" in uncovered["message"], uncovered
    assert header_swapped.get("error") == "ChecksumMismatch", header_swapped
    assert f"{_shard(1)} changed while it was read" in header_swapped["message"], header_swapped
    assert resharded["step"] == 10, resharded
    meta = verify_distributed(root / "quiet_cut" / "step-00000010")
    assert meta["resharded_from"] == 2 and meta["parallel"]["world_size"] == 1
    got = load_file(stage(root / "quiet_cut" / "step-00000010", tmp_path / "resharded"))
    card = (tmp_path / "resharded" / "README.md").read_text()
    # A torchrun launch of one process (training.parallel ddp), after two.
    assert "| launch | one process (DDP) on cpu |" in card, card
    assert "| history | trained in 2 processes (DDP); moved to one process (DDP) after step 6 |" in card, card
    want = load_file(stage(root / "quiet_full" / "step-00000010", tmp_path / "full"))
    worst = max((got[name] - want[name]).abs().max().item() for name in want)
    assert worst <= 1e-9, worst


@LEGS
@pytest.mark.parametrize("mode", ["fsdp2", "ddp"])
def test_fp16_amp_resumes_bitwise_with_its_grad_scaler(legs, mode, tmp_path):
    """Under DDP the ranks' gradients are all-reduced before the GradScaler checks them, under
    FSDP2 its found-inf flag is all-reduced over the mesh: every rank skips the same steps,
    so one scaler state is saved, and a resume restores it."""
    root, results, _ = legs
    offset = 13 if mode == "fsdp2" else 16
    cut, resumed, full = results[offset : offset + 3]
    assert (cut["step"], resumed["step"], full["step"]) == (2, 4, 4), results[offset : offset + 3]
    assert resumed["loss"] == full["loss"]
    meta = verify_distributed(root / f"fp16_full_{mode}" / "step-00000004")
    scaler = meta["training_state"]["scaler"]
    assert scaler["scale"] < 2.0**16, scaler  # overflowing steps were skipped
    assert (
        verify_distributed(root / f"fp16_cut_{mode}" / "step-00000004")["training_state"]["scaler"] == scaler
    )
    assert (
        stage(root / f"fp16_cut_{mode}" / "step-00000004", tmp_path / "cut").read_bytes()
        == stage(root / f"fp16_full_{mode}" / "step-00000004", tmp_path / "full").read_bytes()
    )


@LEGS
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_evaluate_reads_a_distributed_checkpoint_as_its_staged_weights(legs, mode, data_dir, tmp_path):
    """04 on a 2-process checkpoint: the metrics of the weights 05 stages from it, bit for
    bit, named by that file's SHA-256, so 05 puts them on the card."""
    root, _, _ = legs
    folder = root / f"full_{mode}" / "step-00000010"
    config = load_config(CONFIG, {"data.dir": str(data_dir)})
    record = evaluate_checkpoint(config, folder)
    metrics = write_metrics(record, config, tmp_path / "metrics.json")
    result = build_stage(config, checkpoint=folder, stage_dir=tmp_path / "stage", metrics=metrics)
    staged = tmp_path / "stage" / "modelo.safetensors"
    assert result.with_metrics and record["modelo_sha256"] == sha256_file(staged)
    meta = verify_distributed(folder)
    eval_config = evaluation_config(meta, config, source="test")
    model = build_model(eval_config)
    load_model_weights(model, read_tensors(staged))
    model.eval()
    assert load_task_data(eval_config).evaluate(model, torch.device("cpu")) == record["metrics"]


@LEGS
def test_the_best_mark_of_a_distributed_run_is_checked_against_its_own_evaluations(legs, tmp_path):
    """04/05 --checkpoint best on an FSDP2 run: the mark is believed only as the sharded
    checkpoint's own record gives it, and refused once moved by hand."""
    root, _, _ = legs
    run = root / "best_fsdp2"
    mark = json.loads((run / "BEST.json").read_text())
    loaded = load_checkpoint("best", run, mode=LoadMode.VERIFY)
    assert loaded.best == mark and loaded.folder == run / f"step-{mark['step']:08d}"
    assert loaded.meta["parallel"]["mode"] == "fsdp2"
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    steps = sorted(int(f.name[5:]) for f in moved.glob("step-*"))
    # Another committed step that evaluated (every 4 steps, and the last), the value unchanged.
    other = next(step for step in steps if step != mark["step"] and (step % 4 == 0 or step == 10))
    (moved / "BEST.json").write_text(json.dumps({**mark, "step": other}))
    with pytest.raises(
        CheckpointError, match=f"BEST.json marks step {other} with mse = .* but that checkpoint recorded"
    ):
        load_checkpoint("best", moved, mode=LoadMode.VERIFY)


@LEGS
def test_a_run_moved_to_one_process_keeps_its_evaluations_and_derives_its_rng_from_the_resumed_step(
    legs, data_dir, tmp_path
):
    """The FSDP2 run evaluated every 4 steps, its step 8 resumed in one process (--reshard): the
    evaluations of steps 4 and 8 carry over (the best mark and the traces are made from them),
    and the process's RNG streams are derived from (seed, 8, rank 0), not a fresh run's."""
    from pipeline.checkpoint import best_record, evaluations_from, read_best
    from pipeline.checkpoint.dist_restore import read_full_state, read_rank_rng
    from pipeline.rng import capture_rng, derive_rank_rng
    from pipeline.train import TrainingHooks

    folder = legs[0] / "best_fsdp2" / "step-00000008"
    _, whole, table = read_full_state(folder)
    before = evaluations_from(table, 8)
    assert before["step"] == [4, 8], before
    # The whole state (the resume proof's) holds every rank's own RNG states.
    assert sorted(whole["rng"]) == ["rank-0", "rank-1"]
    for rank in (0, 1):
        tree, tensors = read_rank_rng(folder / rank_rng_file(rank))
        held = whole["rng"][f"rank-{rank}"]
        assert (held["python"], held["numpy_generator"]) == (tree["python"], tree["numpy_generator"])
        assert torch.equal(table[f"rng/rank-{rank}/torch_cpu"], tensors["rng/torch_cpu"])
    assert whole["rng"]["rank-0"]["python"] != whole["rng"]["rank-1"]["python"]
    shutil.copytree(folder, tmp_path / "step-00000008")
    sets = {"data.dir": str(data_dir), "checkpoint.dir": str(tmp_path), "training.eval_every": 4,
            "checkpoint.best_metric": "mse", "checkpoint.keep_last": 3}  # fmt: skip
    config = load_config(CONFIG, sets)
    started = {}

    def look(run) -> None:
        started["evaluations"] = {name: list(values) for name, values in run.evaluations.items()}
        started["rng"] = capture_rng(run.generator)

    result = train(config, resume="latest", reshard=True, progress=False, hooks=TrainingHooks(on_start=look))
    assert started["evaluations"] == before
    assert result.evaluations["step"] == [4, 8, 10]
    committed = sorted(int(f.name[5:]) for f in tmp_path.glob("step-*"))
    assert read_best(tmp_path) == best_record(result.evaluations, "mse", "min", among=committed)
    derive_rank_rng(config.training.seed, 8, 0)
    derived = capture_rng(np.random.Generator(np.random.PCG64(0)))
    assert started["rng"]["python"] == derived["python"]
    assert torch.equal(started["rng"]["torch_cpu"], derived["torch_cpu"])


@LEGS
def test_a_rank_the_checkpoint_has_no_rng_file_for_derives_its_streams_from_the_resumed_step(legs, data_dir):
    """A 2-process checkpoint resumed on more processes (docs/distributed.md, --reshard): rank 2
    has no RNG file in it; it continues the data order's Generator (rank 0's, the same on
    every rank) and derives its own streams from (seed, step, rank). Restored here in this
    process as rank 2 of 3, DCP reading every shard whole as a move to one process does."""
    from pipeline.checkpoint import restore_distributed
    from pipeline.checkpoint.dist_restore import read_rank_rng
    from pipeline.rng import capture_rng
    from pipeline.run import build_run
    from pipeline.world import World

    folder = legs[0] / "quiet_full" / "step-00000010"
    meta = verify_distributed(folder)
    assert meta["parallel"]["world_size"] == 2 and rank_rng_file(2) not in meta["files"]
    config = load_config(CONFIG, {"data.dir": str(data_dir), **QUIET_RNG})
    world = World(device=torch.device("cpu"), rank=2, world_size=3)
    run = build_run(config, world.device, world=world)
    restore_distributed(run, world, folder, meta)
    assert run.step == 10
    saved, _ = read_rank_rng(folder / rank_rng_file(0))
    assert run.generator.bit_generator.state == saved["numpy_generator"]
    restored = capture_rng(run.generator)
    words = np.random.SeedSequence([config.training.seed, 10, 2]).generate_state(4, dtype=np.uint64)
    torch.manual_seed(int(words[2]))
    assert torch.equal(restored["torch_cpu"], torch.get_rng_state())


@LEGS
def test_a_distributed_resume_compares_a_derived_buffer_with_the_value_this_code_builds(legs, data_dir):
    """A tensor meta.json records as derived (equal to its freshly built value when saved) must
    equal what this code builds, as in one process, although DCP loads into the run's own
    tensors (compared there, it would be compared with itself and a stale value put back).
    Here the given meta.json lists the trained first layer as derived: a fresh build differs."""
    from pipeline.checkpoint import restore_distributed
    from pipeline.run import build_run
    from pipeline.world import World

    folder = legs[0] / "quiet_full" / "step-00000010"
    meta = verify_distributed(folder)
    config = load_config(CONFIG, {"data.dir": str(data_dir), **QUIET_RNG})
    world = World(device=torch.device("cpu"), rank=0, world_size=2)
    run = build_run(config, world.device, world=world)
    listed = {**meta, "model": {**meta["model"], "derived_buffers": ["net.0.weight"]}}
    with pytest.raises(StateMismatch) as caught:
        restore_distributed(run, world, folder, listed)
    assert str(caught.value) == (
        f"{folder / DIST_MODEL_DIR}: buffer net.0.weight differs from the value this code builds (the code "
        "or config that builds it changed since the checkpoint was saved); restore that code, or start a new run"
    )


def test_a_ddp_resume_compares_derived_buffers_under_the_models_own_names_not_the_wrappers(
    data_dir, tmp_path, monkeypatch
):
    """A DDP run resumed (one process of a gloo group, in-process: no launch) whose model has a
    derived buffer (``scale``, built from a code constant): DDP names it ``module.scale``, the
    checkpoint ``scale``, so the check looks in the plain module. Unchanged, the resume is
    accepted; with the constant changed, the buffer is refused; a list of them that is no list
    (sealed by a writer with a bug) is refused as malformed, before anything of it is used."""
    import buffer_factories
    import torch.distributed as dist

    from pipeline.checkpoint import restore_distributed
    from pipeline.errors import SEALED_BUT_UNFIT
    from pipeline.run import build_run

    config = load_config(
        CONFIG,
        {
            "data.dir": str(data_dir),
            "training.parallel": "ddp",
            "model.factory": "buffer_factories:build_model",
            "checkpoint.dir": str(tmp_path / "ck"),
            "training.max_steps": 4,
        },
    )
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    world = dataclasses.replace(_world(0, 1), mesh_group=dist.new_group())
    try:
        assert train(config, world=world, stop_at=2, progress=False).step == 2
        folder = tmp_path / "ck" / "step-00000002"
        meta = verify_distributed(folder)
        assert meta["parallel"] == {"mode": "ddp", "world_size": 1, "ddp_find_unused_parameters": False}
        assert "scale" in meta["model"]["derived_buffers"]
        monkeypatch.setattr(buffer_factories, "SCALE", 2.0)
        with pytest.raises(StateMismatch) as caught:
            train(config, world=world, resume="latest", progress=False)
        assert str(caught.value) == (
            f"{folder / DIST_MODEL_DIR}: buffer scale differs from the value this code builds (the code "
            "or config that builds it changed since the checkpoint was saved); restore that code, or start "
            "a new run"
        )
        monkeypatch.setattr(buffer_factories, "SCALE", 1.0)
        assert train(config, world=world, resume="latest", progress=False).step == 4
        last = tmp_path / "ck" / "step-00000004"
        meta = verify_distributed(last)
        unlisted = {**meta, "model": {**meta["model"], "derived_buffers": None}}
        with pytest.raises(StateMismatch) as caught:
            restore_distributed(build_run(config, world.device, world=world), world, last, unlisted)
        assert str(caught.value) == (
            f"{last / DIST_MODEL_DIR}: the derived-buffer list in meta.json is malformed: {SEALED_BUT_UNFIT}"
        )
    finally:
        world.close()


def test_a_single_process_checkpoint_continued_by_a_launch_sets_the_optimizer_unless_omitted(
    data_dir, tmp_path
):
    """--reshard of a single-process checkpoint (this process as the launch's one rank): the
    optimizer's saved state is set, for every parameter; the resume proof's control that omits
    it keeps the fresh build's (no state), the rest restored all the same; the rank's RNG
    streams are derived from the resumed step, or, omitted, are a fresh run's."""
    from pipeline.checkpoint import restore_from_single
    from pipeline.rng import derive_rank_rng
    from pipeline.run import build_run
    from pipeline.world import World

    sets = {"data.dir": str(data_dir), "checkpoint.dir": str(tmp_path / "ck"), "training.max_steps": 2}
    config = load_config(CONFIG, sets)
    assert train(config, progress=False).step == 2
    loaded = load_checkpoint(tmp_path / "ck" / "step-00000002")
    world = World(device=torch.device("cpu"), rank=0, world_size=1)
    restored, streams = {}, {}
    for omit in ((), ("optimizer",), ("rng",)):
        run = build_run(config, world.device, world=world)
        restore_from_single(run, world, loaded, omit=omit)
        state = run.optimizer.state
        params = [p for g in run.optimizer.param_groups for p in g["params"]]
        restored[omit] = (run.step, [float(state[p]["step"]) for p in params if p in state])
        streams[omit] = torch.get_rng_state()
    full = [2.0] * len(params)
    assert restored == {(): (2, full), ("optimizer",): (2, []), ("rng",): (2, full)}
    # The rank's streams: derived from the resumed step; the control that omits them, a fresh run's (step 0).
    for omit, step in (((), 2), (("rng",), 0)):
        derive_rank_rng(config.training.seed, step, 0)
        assert torch.equal(streams[omit], torch.get_rng_state()), omit


def test_a_distributed_resume_whose_training_state_file_was_damaged_is_refused_naming_it(data_dir, tmp_path):
    """A torchrun resume (one process of a gloo group, in-process: no launch) of a checkpoint
    whose training-state file (the shared tensors beside every rank's RNGs) was damaged after
    its seal: the rank keeps the refusal naming the file and its chunk, and the resume ends in
    it, one line (not an error of reading the tensors it refused). A rank RNG file without a
    readable RNG record is kept as a refusal the same way: raised at the agreement, after any
    the rank kept before it."""
    import torch.distributed as dist

    config = load_config(
        CONFIG,
        {
            "data.dir": str(data_dir),
            "training.parallel": "ddp",
            "checkpoint.dir": str(tmp_path / "ck"),
            "training.max_steps": 4,
        },
    )
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    world = dataclasses.replace(_world(0, 1), mesh_group=dist.new_group())
    try:
        assert train(config, world=world, stop_at=2, progress=False).step == 2
        state = tmp_path / "ck" / "step-00000002" / STATE_FILE
        entry = verify_distributed(state.parent)["files"][STATE_FILE]
        intact = state.read_bytes()
        damaged = bytearray(intact)
        damaged[-1] ^= 1
        state.write_bytes(bytes(damaged))
        with pytest.raises(ChecksumMismatch) as caught:
            train(config, world=world, resume="latest", progress=False)
        state.write_bytes(intact)
        # The rank's RNG file without its RNG record (sealed as it now is) and a model shard
        # damaged: the unreadable record is kept like the damaged shard, and the agreement
        # raises the first refusal the rank kept, the shard's, on every rank alike.
        from pipeline.checkpoint import restore_distributed
        from pipeline.checkpoint.tensorfile import write_safetensors
        from pipeline.errors import SEALED_BUT_UNFIT
        from pipeline.run import build_run

        folder, rng, shard = state.parent, rank_rng_file(0), f"{DIST_MODEL_DIR}/{_shard(1)}"
        meta = verify_distributed(folder)
        kept = read_tensors(folder / rng)
        (folder / rng).unlink()
        write_safetensors(folder / rng, kept, {"format": "pt"})
        files = {
            **meta["files"],
            rng: entry_of((folder / rng).read_bytes(), meta["files"][rng].get("chunk_size")),
        }
        unreadable = {**meta, "files": files}
        with pytest.raises(StateMismatch) as alone:
            restore_distributed(build_run(config, world.device, world=world), world, folder, unreadable)
        assert str(alone.value) == f"{folder / rng} holds no readable RNG record: {SEALED_BUT_UNFIT}"
        weights = bytearray((folder / shard).read_bytes())
        weights[-1] ^= 1
        (folder / shard).write_bytes(bytes(weights))
        with pytest.raises(ChecksumMismatch) as first:
            restore_distributed(build_run(config, world.device, world=world), world, folder, unreadable)
    finally:
        world.close()
    sealed = meta["files"][shard]
    chunk = (sealed["size"] - 1) // sealed.get("chunk_size", sealed["size"])
    begin = chunk * sealed.get("chunk_size", sealed["size"])
    assert str(first.value) == (
        f"{folder / shard} SHA-256 differs from meta.json (chunk {chunk}: bytes {begin}-{sealed['size']}): "
        "the file is damaged or was modified"
    )
    size = entry["size"]
    last = (size - 1) // entry.get("chunk_size", size)
    start = last * entry.get("chunk_size", size)
    assert str(caught.value) == (
        f"{state} SHA-256 differs from meta.json (chunk {last}: bytes {start}-{size}): the file is damaged "
        "or was modified"
    )


@pytest.mark.heavy
def test_four_process_ddp_resumes_bitwise_with_the_bucket_setting_recorded(data_dir, tmp_path):
    """At 4 processes the order of a reduction shows in the last bits. A model of several
    gradient buckets (2 MB of weights: DDP's first bucket holds 1 MB), without
    find_unused_parameters (the default, so torch does not warn), resumes bitwise: every
    process settles DDP's buckets on its first batch before it steps."""
    base = {"data.dir": str(data_dir), "training.parallel": "ddp", "model.params.hidden": 512}
    cut, resumed, full = launch_plan(
        4,
        tmp_path,
        "four",
        [
            {"overrides": {**base, "checkpoint.dir": str(tmp_path / "cut")}, "stop_at": 6},
            {"overrides": {**base, "checkpoint.dir": str(tmp_path / "cut")}, "resume": "latest"},
            {"overrides": {**base, "checkpoint.dir": str(tmp_path / "full")}},
        ],
    )
    assert cut["step"] == 6 and resumed["step"] == full["step"] == 10
    assert resumed["loss"] == full["loss"]
    for folder in (tmp_path / "cut" / "step-00000010", tmp_path / "full" / "step-00000010"):
        meta = verify_distributed(folder)
        assert meta["parallel"] == {"mode": "ddp", "world_size": 4, "ddp_find_unused_parameters": False}
        assert meta["config"]["training"]["ddp_find_unused_parameters"] is False
    staged = stage(tmp_path / "cut" / "step-00000010", tmp_path / "resumed")
    reference = stage(tmp_path / "full" / "step-00000010", tmp_path / "uninterrupted")
    assert staged.read_bytes() == reference.read_bytes()


@pytest.mark.heavy
def test_a_one_process_launch_of_ddp_and_fsdp2_resumes_bitwise_and_trains_as_one_process_does(
    data_dir, tmp_path
):
    """torchrun --nproc-per-node 1 with training.parallel ddp, then fsdp2 (one launch): each a
    launch of one process, its checkpoints distributed ones that record the mode and world size
    1; cut at 6 and resumed, it ends where one plain process ends, bit for bit (one rank's
    reductions are the identity; dropout off, its streams are per rank in a launch)."""
    runs = []
    for mode in ("ddp", "fsdp2"):
        base = {"data.dir": str(data_dir), "training.parallel": mode, **QUIET_RNG}
        folder = str(tmp_path / mode)
        runs += [
            {"overrides": {**base, "checkpoint.dir": folder}, "stop_at": 6},
            {"overrides": {**base, "checkpoint.dir": folder}, "resume": "latest"},
        ]
    results = launch_plan(1, tmp_path, "one", runs)
    alone = train(
        load_config(
            CONFIG, {"data.dir": str(data_dir), "checkpoint.dir": str(tmp_path / "alone"), **QUIET_RNG}
        ),
        progress=False,
    )
    for offset, mode in ((0, "ddp"), (2, "fsdp2")):
        cut, resumed = results[offset : offset + 2]
        assert (cut.get("step"), resumed.get("step")) == (6, 10), (mode, cut, resumed)
        assert resumed["loss"] == alone.history["loss"] and cut["loss"] == alone.history["loss"][:6], mode
        meta = verify_distributed(tmp_path / mode / "step-00000010")
        assert meta["parallel"] == {"mode": mode, "world_size": 1, "ddp_find_unused_parameters": False}
        assert (tmp_path / mode / "step-00000010" / DIST_MODEL_DIR).is_dir(), mode
        staged = load_file(stage(tmp_path / mode / "step-00000010", tmp_path / f"staged-{mode}"))
        assert staged.keys() == read_tensors(alone.checkpoint / "modelo.safetensors").keys()
        want = read_tensors(alone.checkpoint / "modelo.safetensors")
        assert all(torch.equal(staged[name], want[name]) for name in want), mode


@pytest.mark.heavy
def test_the_resume_proof_under_torchrun_is_bitwise_and_every_control_diverges(data_dir, tmp_path):
    """scripts/03 with --nproc-per-node 2: two launches (reference with the cut; resume and
    the five controls, swap of two ranks' RNG streams included), compared bit for bit."""
    output = tmp_path / "proof"
    result = subprocess.run(
        [
            sys.executable,
            "-B",
            str(REPO / "scripts" / "03_verify_resume.py"),
            "--config",
            str(CONFIG),
            "--set",
            f"data.dir={data_dir}",
            "--set",
            "training.parallel=fsdp2",
            "--set",
            "training.deterministic=false",
            "--nproc-per-node",
            "2",
            "--steps",
            "8",
            "--output",
            str(output),
        ],
        cwd=tmp_path,
        env=script_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["all_checks_passed"] and summary["positive"] and summary["negative_divergence_detected"]
    report = json.loads((output / "verification.json").read_text())
    assert sorted(report["protocol"]["launches"]) == ["reference", "resume-and-controls"]
    assert all(
        "--nproc-per-node=2" in launch["command"] for launch in report["protocol"]["launches"].values()
    )
    positive = report["checks"]["positive"]
    assert {c["name"] for c in positive} >= {"final.model", "final.optimizer", "final.rng", "final.losses"}
    assert all(c["passed"] and c["max_abs_diff"] == 0.0 for c in positive), positive
    controls = report["components"]["negative"]
    assert sorted(controls) == ["data", "optimizer", "rank_rng", "rng", "scheduler"]
    assert all(c["result"] == "detected" and c["exercised"] for c in controls.values()), controls
    assert (
        controls["rank_rng"]["leg"] == "swap-rng" and "final.rng" in controls["rank_rng"]["diverged_checks"]
    )
    assert controls["rank_rng"]["why_exercised"].startswith("every rank restored streams other than its own")
    # The resume really started at the cut, from the reference's checkpoint.
    resumed = load_checkpoint(output / "resume" / "checkpoints" / "step-00000008", mode=LoadMode.VERIFY).meta
    assert resumed["parallel"]["world_size"] == 2 and report["boundary"]["cut"] < 8


def test_a_control_that_does_not_diverge_fails_the_proof_naming_it():
    """The verdict both proofs share: a control whose omission restored other values
    (exercised) but changed no outcome is 'not detected', and the proof fails (exit 1)."""
    exercise = compare("exercise.rng", "rng", {"rank-1": 7}, {"rank-1": 8}, 0.0)
    outcome = [compare("final.model", "model", {"w": torch.ones(2)}, {"w": torch.ones(2)}, 0.0)]
    verdict = control_verdict("rank_rng", exercise, outcome, None)
    assert verdict["result"] == "not detected" and verdict["exercised"] and verdict["diverged_checks"] == {}
    detected = control_verdict("optimizer", exercise, [compare("final.model", "model", 1.0, 2.0, 0.0)], 7)
    report = judge(outcome, {"rank_rng": verdict, "optimizer": detected})
    assert report["positive"] is True and report["negative_divergence_detected"] is False
    assert report["all_checks_passed"] is False and report["failed_components"] == ["rank_rng"]
    assert judge(outcome, {"optimizer": detected})["all_checks_passed"] is True


def test_an_omission_reports_a_rank_it_changed_and_the_rng_swap_a_rank_it_left_unchanged():
    """The exercise check a control under torchrun reports, of every rank's (in rank order):
    an omission's is the first rank whose restored values differ, as it shows on any rank that
    holds the component; the RNG swap's is the first rank that kept its own streams, as a swap
    that misses one rank is not exercised; where no rank tells, rank 0's."""
    kept = compare("exercise.rng", "rng", {"s": 1}, {"s": 1}, 0.0).to_dict()
    moved = [compare("exercise.rng", "rng", {"s": 1}, {"s": 1 + n}, 0.0).to_dict() for n in (1, 2)]
    assert reported_exercise([kept, moved[0], moved[1]], swap=False) == moved[0]
    assert reported_exercise([kept, kept], swap=False) == kept
    assert reported_exercise([moved[0], kept], swap=True) == kept
    assert reported_exercise([moved[0], moved[1]], swap=True) == moved[0]
    swap = control_verdict(
        "rank_rng", Check(**reported_exercise([moved[0], kept], swap=True)), [], None, swap=True
    )
    assert (swap["result"], swap["exercised"]) == ("not swapped", False)


def test_a_swap_that_left_a_rank_its_own_streams_fails_the_proof_saying_so():
    """Each rank's streams are derived from its rank, so a working swap is always exercised: one
    that left a rank its own is "not swapped", which fails the proof naming rank_rng, while an
    omission that restored the same values ("not exercised") still does not."""
    from pipeline.proof import describe

    kept = compare("exercise.rng", "rng", {"s": 1}, {"s": 1}, 0.0)
    moved = compare("exercise.rng", "rng", {"s": 1}, {"s": 2}, 0.0)
    outcome = [compare("final.rng", "rng", 1.0, 2.0, 0.0)]
    unswapped = control_verdict("rank_rng", kept, outcome, 6, swap=True)
    assert (unswapped["result"], unswapped["exercised"], unswapped["why_exercised"]) == (
        "not swapped",
        False,
        "a rank restored its own streams: the swap did not reach every rank",
    )
    swapped = control_verdict("rank_rng", moved, outcome, 6, swap=True)
    assert (swapped["result"], swapped["why_exercised"]) == (
        "detected",
        "every rank restored streams other than its own, first differing at s (1 of 1 values)",
    )
    unexercised = control_verdict("rng", kept, [], None)
    assert unexercised["result"] == "not exercised"
    assert control_verdict("rng", moved, outcome, 6)["why_exercised"] == (
        "its state at the cut differs from the freshly built one at s (1 of 1 values)"
    )
    positive = [compare("final.model", "model", 1.0, 1.0, 0.0)]
    failing = judge(positive, {"rng": unexercised, "rank_rng": unswapped})
    assert (failing["all_checks_passed"], failing["negative_divergence_detected"]) == (False, False)
    assert failing["failed_components"] == ["rank_rng"]
    assert judge(positive, {"rng": unexercised, "rank_rng": swapped})["all_checks_passed"] is True
    report = {
        **failing,
        "boundary": {"steps": 8, "cut": 5, "reason": "mid-epoch"},
        "protocol": {"tolerance": {"atol": 0}},
        "checks": {"positive": [check.to_dict() for check in positive]},
    }
    passing = {**report, **judge(positive, {"rng": unexercised, "rank_rng": swapped})}
    assert [line for line in describe(passing) if line.startswith("FAILED")] == []
    lines = describe(report)
    assert lines[-3:] == [
        "  rng        not exercised  its state at the cut equals the freshly built one, so leaving it out "
        "restores the same values",
        "  rank_rng   not swapped    diverged in 1 check; the loss first differs at step 6",
        "FAILED: the swap of the ranks' RNG streams left a rank its own, so it proves nothing",
    ]


@pytest.fixture(scope="module")
def one_rank_launch(data_dir, tmp_path_factory):
    """A DDP run of three steps, each saved as a distributed checkpoint, by this process as the
    one rank of a gloo launch (in-process: no torchrun): (its config, the checkpoints' folder)."""
    import torch.distributed as dist

    root = tmp_path_factory.mktemp("one_rank_launch")
    overrides = {"data.dir": str(data_dir), "training.parallel": "ddp", "checkpoint.dir": str(root / "ck")}
    config = load_config(
        CONFIG, {**overrides, "training.max_steps": 3, "checkpoint.every": 1, "checkpoint.keep_last": 3}
    )
    dist.init_process_group("gloo", store=dist.FileStore(str(root / "store"), 1), rank=0, world_size=1)
    world = dataclasses.replace(_world(0, 1), mesh_group=dist.new_group())
    try:
        assert train(config, world=world, progress=False).step == 3
    finally:
        world.close()
    return config, root / "ck"


@ONE_RANK_LAUNCH
def test_the_rng_swap_gives_every_rank_the_next_ranks_streams_and_the_last_rank_rank_0s(
    one_rank_launch, tmp_path
):
    """The torchrun proof's swap control at three ranks, each rank played in turn by this
    process (not launched, a rank reads its files and loads through DCP without its peers): a
    checkpoint of a launch of three, sealed with three different RNG files (one run's at steps
    3, 1 and 2, as ranks 0, 1 and 2's). Restored, each rank gets its own streams; swapped, the
    next rank's, the last rank rank 0's, so no rank keeps its own at any world size."""
    from pipeline.checkpoint import restore_distributed
    from pipeline.run import build_run
    from pipeline.world import World

    config, checkpoints = one_rank_launch
    folder = tmp_path / "step-00000003"
    shutil.copytree(checkpoints / "step-00000003", folder)
    for rank, step in ((1, 1), (2, 2)):
        shutil.copyfile(checkpoints / f"step-0000000{step}" / rank_rng_file(0), folder / rank_rng_file(rank))

    def of_three_ranks(meta: dict) -> None:
        meta["parallel"]["world_size"] = 3
        chunk = meta["files"][rank_rng_file(0)].get("chunk_size")
        for rank in (1, 2):
            meta["files"][rank_rng_file(rank)] = entry_of((folder / rank_rng_file(rank)).read_bytes(), chunk)

    reseal(folder, of_three_ranks)
    meta = verify_distributed(folder)
    restored = {}
    for swap in (False, True):
        for rank in range(3):
            world = World(device=torch.device("cpu"), rank=rank, world_size=3)
            restore_distributed(
                build_run(config, world.device, world=world), world, folder, meta, swap_rng=swap
            )
            restored[swap, rank] = torch.get_rng_state()
    own = [restored[False, rank] for rank in range(3)]
    assert not any(torch.equal(own[a], own[b]) for a, b in ((0, 1), (0, 2), (1, 2))), "the ranks' files agree"
    for rank in range(3):
        assert torch.equal(restored[True, rank], own[(rank + 1) % 3]), rank


@ONE_RANK_LAUNCH
def test_the_torchrun_proof_judges_the_swap_by_its_own_rule_under_its_own_leg(one_rank_launch, tmp_path):
    """The orchestrator's verdict over every leg's final checkpoint (real, sealed ones: the same
    run's, so no outcome differs) and the exercise check each leg's launch reported: the swap
    that left a rank its own streams is "not swapped" under its leg, swap-rng, and fails the
    proof; an omission that restored the same values is "not exercised" and one that restored
    others but changed nothing "not detected" (which fails it too), each under its omit- leg."""
    from pipeline.proof.distributed import _evaluate, dist_controls
    from pipeline.proof.layout import CHECKPOINTS_DIR

    config, checkpoints = one_rank_launch
    legs = dist_controls(config)
    for name in ("reference", "resume", *(leg for leg, *_ in legs)):
        shutil.copytree(checkpoints / "step-00000003", tmp_path / name / CHECKPOINTS_DIR / "step-00000003")
    kept = compare("exercise.rng", "rng", {"s": 1}, {"s": 1}, 0.0).to_dict()
    moved = compare("exercise.optimizer", "optimizer", {"s": 1}, {"s": 2}, 0.0).to_dict()
    results = {leg: {"exercise": moved if component == "optimizer" else kept} for leg, component, *_ in legs}
    report = _evaluate(tmp_path, 3, 2, 0.0, results, legs)
    assert [component for _, component, *_ in legs] == ["rng", "optimizer", "scheduler", "data", "rank_rng"]
    unchanged = {
        "result": "not exercised",
        "exercised": False,
        "omission_detected": False,
        "why_exercised": "its state at the cut equals the freshly built one, so leaving it out restores the same values",
        "diverged_checks": {},
        "first_divergent_loss_step": None,
    }
    assert report["components"]["negative"] == {
        **{
            name: {"component": name, "leg": f"omit-{name}", **unchanged}
            for name in ("rng", "scheduler", "data")
        },
        "optimizer": {
            "component": "optimizer",
            "leg": "omit-optimizer",
            **unchanged,
            "result": "not detected",
            "exercised": True,
            "why_exercised": "its state at the cut differs from the freshly built one at s (1 of 1 values)",
        },
        "rank_rng": {
            "component": "rank_rng",
            "leg": "swap-rng",
            **unchanged,
            "result": "not swapped",
            "why_exercised": "a rank restored its own streams: the swap did not reach every rank",
        },
    }
    assert (report["all_checks_passed"], report["positive"], report["negative_divergence_detected"]) == (
        False,
        True,
        False,
    )
    assert report["failed_components"] == ["optimizer", "rank_rng"]


def _ranks(launcher: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the launcher's workers."""
    ranks = {}
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    for pid in map(int, children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        for entry in environ:
            if entry.startswith(b"RANK="):
                ranks[int(entry[5:])] = pid
    return ranks


def _launch(
    data_dir: Path, checkpoint_dir: Path, log: Path, *extra: str, parallel: str | None = "ddp"
) -> subprocess.Popen:
    command = [
        sys.executable,
        "-B",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        *train_args(data_dir, checkpoint_dir, "--max-steps", "1000000", *extra, parallel=parallel),
    ]
    return subprocess.Popen(
        command,
        cwd=log.parent,
        env=script_env(OMP_NUM_THREADS="1"),
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )


def _wait_for(condition, launcher: subprocess.Popen, what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert launcher.poll() is None, f"the launch ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.heavy
def test_sigterm_on_one_rank_stops_all_after_the_same_step(data_dir, tmp_path):
    log = tmp_path / "log.txt"
    checkpoints = tmp_path / "ck"
    launcher = _launch(
        data_dir,
        checkpoints,
        log,
        "--checkpoint-every",
        "1000000",
        "--set",
        "training.log_every=2",
        parallel="fsdp2",
    )
    try:
        _wait_for(lambda: "step 2/" in log.read_text(), launcher, "step 2")
        os.kill(_ranks(launcher)[1], signal.SIGTERM)
        launcher.wait(timeout=600)
    finally:
        launcher.kill()
    text = log.read_text()
    # A graceful stop is reported once, as a stop (no "error:" line), by rank 0.
    lines = [line for line in text.splitlines() if line.startswith("stopped by SIGTERM after step")]
    assert len(lines) == 1 and not error_lines(text), text[-3000:]
    step = int(lines[0].split("after step ")[1].split(";")[0])
    assert "exitcode: 143" in text or "exitcode  : 143" in text, text[-3000:]
    # The command repeats the launch under the ranks' own interpreter; torchrun's report that
    # follows names the stop as its root cause, and the command is kept in checkpoint.dir.
    command = lines[0].split("Resume with: ")[1].removesuffix(f" (saved in {checkpoints / 'RESUME'})")
    assert command != lines[0].split("Resume with: ")[1], lines[0]
    interpreter, *launch = shlex.split(command)[:6]
    assert (tmp_path / interpreter).resolve() == Path(sys.executable).resolve(), command
    assert launch == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(REPO / "scripts" / "02_train.py"),
    ]
    assert command.endswith(" --resume latest") and (checkpoints / "RESUME").read_text() == command + "\n"
    root_cause = text.split("Root Cause (first observed failure):")[1]
    assert f"traceback : {lines[0]}" in root_cause, root_cause
    committed = sorted(checkpoints.glob("step-*"))
    assert [p.name for p in committed] == [f"step-{step:08d}"]
    verify_distributed(committed[0])


@pytest.mark.heavy
def test_killing_one_rank_during_a_save_leaves_the_previous_checkpoint(data_dir, tmp_path):
    """Also: config.yaml as it is under torchrun (training.parallel auto) trains DDP, and its
    checkpoints record ddp, never auto; a resume of a shard damaged since is one line."""
    log = tmp_path / "log.txt"
    checkpoints = tmp_path / "ck"
    launcher = _launch(data_dir, checkpoints, log, "--checkpoint-every", "1", "--quiet", parallel=None)
    try:
        _wait_for(
            lambda: checkpoints.is_dir() and any(p.name.startswith("step-") for p in checkpoints.iterdir()),
            launcher,
            "a first checkpoint",
        )
        _wait_for(
            lambda: any(p.name.startswith(".tmp-step-") for p in checkpoints.iterdir()),
            launcher,
            "a save in progress",
        )
        os.kill(_ranks(launcher)[1], signal.SIGKILL)
        launcher.wait(timeout=600)
    finally:
        launcher.kill()
    assert launcher.returncode != 0
    committed = sorted(p for p in checkpoints.iterdir() if p.name.startswith("step-"))
    assert committed, "the previous checkpoint is gone"
    for folder in committed:  # every step folder is complete: none half-made
        meta = verify_distributed(folder)
        assert meta["parallel"]["mode"] == "ddp" and meta["config"]["training"]["parallel"] == "ddp"
    # A shard damaged after its seal: the ranks that read it refuse, every rank stops, and
    # the launch prints the refusal once.
    shard = sorted((committed[-1] / DIST_MODEL_DIR).iterdir())[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    resumed = torchrun(
        2, *train_args(data_dir, checkpoints, "--resume", "latest", parallel=None), cwd=tmp_path
    )
    assert resumed.returncode == 1 and "exitcode  : 2" in resumed.stderr, resumed.stderr[
        -3000:
    ]  # torchrun's 1
    errors = error_lines(resumed.stderr)
    assert len(errors) == 1 and f"{shard.name} SHA-256 differs from meta.json" in errors[0], resumed.stderr[
        -3000:
    ]


def _world(rank: int, size: int) -> LaunchWorld:
    return LaunchWorld(
        rank=rank,
        world_size=size,
        local_rank=rank,
        local_world_size=size,
        device=torch.device("cpu"),
        mode="ddp",
    )


def test_leaving_a_group_never_made_or_closing_twice_leaves_the_process_groups_as_they_are(tmp_path):
    """A rank that never made a group of its own leaves only that (the launch's group stays for
    the rest of the run); close ends the launch's group, and a second close, once nothing is
    left, is a no-op, as is a leave after it (a failure's clean-up after the normal one)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        world = _world(0, 1)
        world.leave_group()
        assert dist.is_initialized()
        own = world.own_group()
        own.close()
        assert not dist.is_initialized()
        own.close()
        own.leave_group()
        world.close()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_rank_0_shares_a_checkpoint_folder_named_in_non_ascii_whole(tmp_path):
    """The folder a resume starts from is rank 0's text, sent as its UTF-8 bytes: a name whose
    characters are fewer than its bytes arrives whole (a launch of one rank over gloo)."""
    import torch.distributed as dist

    folder = str(tmp_path / "états-检查点" / "step-00000004")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        world = _world(0, 1)
        assert (world.broadcast_text(folder), world.gather_text(folder)) == (folder, [folder])
    finally:
        dist.destroy_process_group()


def test_each_rank_of_a_micro_batch_that_splits_unevenly_trains_on_its_share(data_dir, tmp_path):
    """5 rows over 2 ranks (2 and 3 rows): the step's loss and gradients of each rank, weighed
    by its share, average to one process's of the same 5 rows."""
    from pipeline.accumulation import accumulate_gradients
    from pipeline.run import build_run
    from pipeline.world import World

    config = load_config(
        CONFIG,
        {"data.dir": str(data_dir), "checkpoint.dir": str(tmp_path), "data.batch_size": 5, **QUIET_RNG},
    )

    def step(world):
        run = build_run(config, torch.device("cpu"), world=world)
        loss = accumulate_gradients(run, world)
        return float(loss), [p.grad.double() for p in run.model.parameters()]

    alone = step(World(device=torch.device("cpu")))
    ranks = [step(_world(rank, 2)) for rank in range(2)]
    assert sum(loss for loss, _ in ranks) / 2 == pytest.approx(alone[0], rel=1e-6)
    for index, grad in enumerate(alone[1]):
        assert torch.allclose((ranks[0][1][index] + ranks[1][1][index]) / 2, grad, rtol=1e-5, atol=1e-7)


def test_global_batch_slices_cover_it_once_and_scale_to_its_mean():
    for total, size in ((4, 2), (5, 2), (7, 3), (3, 3)):
        batch = list(range(100, 100 + total))
        parts = [_world(rank, size).slice(batch) for rank in range(size)]
        assert [i for part, _ in parts for i in part] == batch
        # mean over ranks of (scale x local mean) == global mean, for any per-row losses
        rows = [float(i * i) for i in batch]
        local = [(scale * sum(rows[batch.index(i)] for i in part) / len(part)) for part, scale in parts]
        assert sum(local) / size == pytest.approx(sum(rows) / total, rel=1e-15)
    with pytest.raises(DataError) as refused:
        _world(0, 3).slice([1, 2])
    assert str(refused.value) == (
        "a batch of 2 rows cannot be split over 3 processes: raise data.batch_size, set data.drop_last, "
        "or launch fewer processes"
    )


@pytest.mark.parametrize(
    ("rows", "size", "losses"),
    [
        # 8 rows over 3 ranks: 2, 3 and 3 rows, factors 0.75, 1.125 and 1.125.
        ([1, 3, 2, 4, 6, 5, 7, 9], 3, [0.75, 2.25, 3.9375]),
        # 4 rows over 3 ranks: 1, 1 and 2 rows, factors 0.75, 0.75 and 1.5.
        ([8, 4, 2, 6], 3, [3.0, 1.5, 3.0]),
    ],
    ids=["8-over-3", "4-over-3"],
)
def test_ranks_of_a_batch_that_splits_unevenly_backpropagate_what_one_process_does(rows, size, losses):
    """Each rank's loss (the mean of its rows) times its factor: the ranks' mean, the loss the
    launch reports and DDP's mean of the gradients are one process's for the same batch (rows
    chosen so that every value is exact in binary, compared with ==)."""
    from pipeline.world import World

    def backpropagated(world, indices):
        weight = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
        part, scale = world.slice(indices)
        loss = world.scaled_loss(
            (weight * torch.tensor([float(rows[i]) for i in part], dtype=torch.float64)).mean(), scale
        )
        loss.backward()
        return float(loss.detach()), float(weight.grad)

    batch = list(range(len(rows)))
    alone = backpropagated(World(device=torch.device("cpu")), batch)
    assert alone == (sum(rows) / len(rows) / 2, sum(rows) / len(rows))
    ranks = [backpropagated(_world(rank, size), batch) for rank in range(size)]
    assert [loss for loss, _ in ranks] == losses
    assert [loss * 2 for loss in losses] == [grad for _, grad in ranks]
    assert (sum(losses) / size, sum(grad for _, grad in ranks) / size) == alone


def test_resume_command_repeats_the_launch_with_resume_latest():
    command = _world(0, 2).resume_command(
        argv=["scripts/02_train.py", "--set", "training.parallel=fsdp2", "--resume=auto", "--quiet"]
    )
    assert command == shlex.join([python_command(), "-m", "torch.distributed.run"]) + (
        " --standalone --nproc-per-node=2 scripts/02_train.py --set training.parallel=fsdp2 "
        "--quiet --resume latest"
    )
    two_nodes = dataclasses.replace(_world(0, 4), local_world_size=2).resume_command(
        argv=["scripts/02_train.py"]
    )
    assert " -m torch.distributed.run --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT " in two_nodes


def test_a_printed_command_sets_each_key_once_with_the_value_it_names(tmp_path):
    """A hint's own --set of a key replaces the config's (the launch a refusal names), and
    every other argument that selects the run stays."""
    mine = Path(shutil.copy(CONFIG, tmp_path / "mine.yaml"))
    config = load_config(
        mine, {"training.parallel": "ddp", "checkpoint.dir": str(tmp_path / "ck"), "training.max_steps": 12}
    )
    command = shlex.split(script_command(config, "02_train.py", "--set", "training.parallel=none"))
    assert command[command.index("--config") + 1] == str(mine)
    sets = [command[i + 1] for i, token in enumerate(command) if token == "--set"]
    assert sets == [f"checkpoint.dir={tmp_path / 'ck'}", "training.max_steps=12", "training.parallel=none"]


def _thread_ranks(tmp_path: Path, body, size: int = 2) -> list:
    """``body(world)`` on ``size`` ranks of a launch that are threads of this process, on a
    gloo process group of their own over a file store (real collectives, no launch); what
    each returned or raised, by rank."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    tmp_path.mkdir(parents=True, exist_ok=True)
    store = dist.FileStore(str(tmp_path / "store"), size)
    results: list = [None] * size

    def rank(index: int) -> None:
        group = dist.ProcessGroupGloo(dist.PrefixStore("ranks", store), index, size, timedelta(seconds=60))
        world = dataclasses.replace(_world(index, size), group=group)
        try:
            results[index] = body(world)
        except Exception as exc:
            results[index] = exc

    threads = [threading.Thread(target=rank, args=(index,), daemon=True) for index in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def _two_ranks(tmp_path: Path, body) -> list:
    return _thread_ranks(tmp_path, body, 2)


def test_the_ranks_of_a_launch_agree_on_one_loss_one_signal_and_each_others_text(tmp_path, monkeypatch):
    """Two ranks' collectives: the global loss is the mean of the ranks' scaled losses, a
    signal or a flag raised on one rank or on both is raised on both, as it was raised, and
    every rank gets every rank's text (of any length, in rank order)."""
    import threading

    import pipeline.distributed.world as launch_world

    monkeypatch.setattr(launch_world, "_stop_agreed", threading.Event())  # this process agrees to stop

    def body(world: LaunchWorld) -> tuple:
        mine = world.rank
        return (
            world.global_loss(torch.tensor([0.5, 2.0][mine])),
            world.agree_signal([None, signal.SIGTERM][mine]),
            world.agree_signal(None),
            world.agree_signal(signal.SIGINT),
            world.agree_flags([[1, 0, 0, 1], [0, 0, 1, 1]][mine]),
            world.gather_text(["", "ünï\tcode"][mine]),
            world.gather_text(["a longer line of rank 0", "b"][mine]),
        )

    first, second = _two_ranks(tmp_path, body)
    agreed = (1.25, signal.SIGTERM, None, signal.SIGINT, [1, 0, 1, 1])
    assert first == second == (*agreed, ["", "ünï\tcode"], ["a longer line of rank 0", "b"])


def test_a_block_that_fails_on_some_ranks_fails_on_all_with_one_line_and_the_worst_exit_code(tmp_path):
    """World.together on two ranks: a refusal on one rank is raised there, and on the other as
    a quiet PeerFailed carrying its one line (newlines joined) and exit code 2; a bug (any
    other exception) as ``Type: message`` with exit code 1; a disk error as its described OS
    error with code 2; the same refusal on both is printed by rank 0 only; a rank whose error
    says nothing of its own leaves the other naming the block; ranks that fail differently
    each raise their own."""
    import errno

    from pipeline.errors import PeerFailed, describe_os_error

    disk = OSError(errno.ENOSPC, "No space left on device", "/ck/step-00000002")
    cases = [
        (DataError("a batch\nof 1 row"), None),
        (None, KeyError("k")),
        (disk, None),
        (StateMismatch("does not fit"), StateMismatch("does not fit")),
        (None, PeerFailed("a line a lower rank printed already", 3)),
        (StateMismatch("one"), SchemaMismatch("two")),
        (None, None),
    ]

    def body(world: LaunchWorld) -> list:
        got = []
        for case in cases:
            try:
                with world.together("the save"):
                    if case[world.rank] is not None:
                        raise case[world.rank]
                got.append("ok")
            except Exception as exc:
                got.append(exc)
        return got

    def seen(error) -> tuple:
        if error == "ok":
            return ("ok",)
        return (
            type(error).__name__,
            str(error),
            getattr(error, "exit_code", None),
            getattr(error, "quiet", False),
        )

    first, second = ([seen(error) for error in got] for got in _two_ranks(tmp_path, body))
    assert first == [
        ("DataError", "a batch\nof 1 row", 2, False),
        ("PeerFailed", "KeyError: 'k'", 1, True),
        ("OSError", str(disk), None, False),
        ("StateMismatch", "does not fit", 2, False),
        ("PeerFailed", "the save failed on another rank (its message is above)", 3, True),
        ("StateMismatch", "one", 2, False),
        ("ok",),
    ]
    assert second == [
        ("PeerFailed", "a batch of 1 row", 2, True),
        ("KeyError", "'k'", None, False),
        ("PeerFailed", describe_os_error(disk), 2, True),
        ("PeerFailed", "does not fit", 2, True),
        ("PeerFailed", "a line a lower rank printed already", 3, True),
        ("SchemaMismatch", "two", 2, False),
        ("ok",),
    ]


def test_three_ranks_receive_each_others_text_whole_and_name_the_first_rank_that_asked_to_stop(tmp_path):
    """Texts between three ranks, whatever their length or script: every rank's text (none, one
    of 80,000 characters of two and three UTF-8 bytes, one of a single character) arrives whole
    on every rank in rank order; a stop a callback asked on the last rank alone, or on the middle
    and the last alike, is recorded on every rank by the first rank that asked, in its own words,
    and one asked on the middle rank alone without a reason names that rank's callback."""
    from pipeline.callbacks import Callbacks, Control

    long = "ü✓" * 40_000

    def stop(world: LaunchWorld, asked: tuple) -> dict:
        control = Control(agree=world.agree_flags)
        if asked[world.rank] is not None:
            control.should_training_stop = True
            control.stopped_by, control.stop_reason = asked[world.rank]
        control.agreed()
        return Callbacks().record_stop(7, control, world.gather_text)

    def body(world: LaunchWorld) -> tuple:
        mine = world.rank
        return (
            world.gather_text(["", long, "✓"][mine]),
            stop(world, (None, None, ("cb:läst", "plateau — ünï ✓"))),
            stop(world, (None, ("cb:middle", "a middle's reason"), ("cb:läst", "the last's"))),
            stop(world, (None, ("", ""), None)),
            stop(world, (None, ("cb:middle", ""), None)),
        )

    results = _thread_ranks(tmp_path, body, 3)
    every_rank = (
        ["", long, "✓"],
        {"step": 7, "by": "cb:läst", "reason": "plateau — ünï ✓"},
        {"step": 7, "by": "cb:middle", "reason": "a middle's reason"},
        {"step": 7, "by": "a callback", "reason": "a callback asked to stop"},
        {"step": 7, "by": "cb:middle", "reason": "cb:middle asked to stop"},
    )
    assert results == [every_rank] * 3


def test_three_ranks_agree_on_the_mean_loss_each_ranks_text_and_who_prints_a_failure(tmp_path):
    """Three ranks (first, middle and last differ): the global loss is the mean over all three,
    each rank gets every rank's text in rank order; a refusal on the middle and the last rank
    alike is raised by the middle one (the lowest that failed) and quietly by the others; a bug
    on the last rank alone is raised there, and quietly by the first and the middle; the first
    and the last refusing alike, the middle otherwise: the last is quiet, the others raise."""
    cases = [
        (None, StateMismatch("does not fit"), StateMismatch("does not fit")),
        (None, None, KeyError("k")),
        (StateMismatch("one"), SchemaMismatch("two"), StateMismatch("one")),
        (None, None, None),
    ]

    def body(world: LaunchWorld) -> tuple:
        got = []
        for case in cases:
            try:
                with world.together("the save"):
                    if case[world.rank] is not None:
                        raise case[world.rank]
                got.append("ok")
            except Exception as exc:
                got.append((type(exc).__name__, str(exc), getattr(exc, "exit_code", None)))
        texts = world.gather_text(["rank 0", "", "the last rank's longest line"][world.rank])
        return world.global_loss(torch.tensor([0.5, 2.0, 3.5][world.rank])), texts, got

    first, middle, last = _thread_ranks(tmp_path, body, 3)
    texts = ["rank 0", "", "the last rank's longest line"]
    assert first == (
        2.0,
        texts,
        [
            ("PeerFailed", "does not fit", 2),
            ("PeerFailed", "KeyError: 'k'", 1),
            ("StateMismatch", "one", 2),
            "ok",
        ],
    )
    assert middle == (
        2.0,
        texts,
        [
            ("StateMismatch", "does not fit", 2),
            ("PeerFailed", "KeyError: 'k'", 1),
            ("SchemaMismatch", "two", 2),
            "ok",
        ],
    )
    assert last == (
        2.0,
        texts,
        [("PeerFailed", "does not fit", 2), ("KeyError", "'k'", None), ("PeerFailed", "one", 2), "ok"],
    )


def test_a_rank_whose_failed_peer_is_gone_before_saying_why_says_what_it_knows(tmp_path):
    """Rank 1 agrees that it failed (exit code 2), then its process is gone before the ranks
    exchange their lines: rank 0 raises its own failure if it had one, else the lost contact
    with the launch in one line naming the fix."""

    def body(failing: bool):
        def run(world: LaunchWorld):
            if world.rank == 1:
                world.agree_flags([2])  # what together() agrees first: this rank's exit code
                world.group.abort()
                return "gone"
            with world.together("the save"):
                if failing:
                    raise DataError("rank 0's own refusal")
            return "ok"

        return run

    own, gone = _two_ranks(tmp_path / "own", body(True))
    assert gone == "gone" and type(own) is DataError and str(own) == "rank 0's own refusal"
    lost, _ = _two_ranks(tmp_path / "lost", body(False))
    assert type(lost) is PipelineError, lost
    assert str(lost).startswith("lost contact with another process of the launch (") and str(lost).endswith(
        "); the last committed checkpoint is intact: relaunch with --resume latest"
    )
    assert "\n" not in str(lost)


def test_what_a_proof_leg_restored_is_a_copy_that_training_on_does_not_change(data_dir, tmp_path):
    """The distributed proof compares each control's restored state with the full resume's,
    taken right after the restore (``live_components``). The optimizer's moments then move
    in place at every step: what was taken must stay the state as restored, or every
    comparison is of the state as it ends and the omit-optimizer control proves nothing."""
    from pipeline.checkpoint import live_components
    from pipeline.train import TrainingHooks

    config = load_config(
        CONFIG, {"data.dir": str(data_dir), "checkpoint.dir": str(tmp_path / "ck"), "training.max_steps": 4}
    )
    train(config, stop_at=2, progress=False)
    taken, as_restored = {}, {}

    def on_start(run) -> None:
        taken.update(live_components(run))
        as_restored.update({name: t.clone() for name, t in taken["optimizer"].items()})

    assert train(config, resume="latest", progress=False, hooks=TrainingHooks(on_start=on_start)).step == 4
    assert any(name.endswith("exp_avg") for name in as_restored), sorted(as_restored)
    for name, tensor in as_restored.items():
        assert torch.equal(taken["optimizer"][name], tensor), name
