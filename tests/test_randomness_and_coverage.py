"""The newest guarantees, each tested where a quiet slip would break it: per-sample randomness
(the documented rule, in every epoch and pass, on every rank, and nothing taken from the
training streams), the stream split over ranks, shard coverage (chunks tile each tensor
exactly, whatever their layout), and the launcher watchdog's last resort.

All in this process, or forked from the suite's fork server: the recording tasks
(tests/helpers/randomness_factories.py) log what each sample drew; the shard files are
written by the pipeline's own safetensors writer with the sharding record torch's DCP
writes; the orphaned rank runs below a subreaper (tests/helpers/orphaned_rank.py)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.checkpoint import ConsolidatedTensors, MappedTensors, read_meta, write_safetensors
from pipeline.checkpoint.shards import consolidate, shard_tensors
from pipeline.config import load_config
from pipeline.data import load_task_data, make_feed, make_sampler, prepare_data
from pipeline.data.stream import StreamFeed
from pipeline.distributed.world import LaunchWorld
from pipeline.errors import ChecksumMismatch, DataError, SchemaMismatch
from pipeline.train import train
from pipeline.world import World

from support import HELPERS, REPO, run_python, script_env

CONFIG = REPO / "config.yaml"
ROWS = {"data.factory": "randomness_factories:build_recording_rows"}
STREAM = {
    "data.prepare": "randomness_factories:prepare_recording_stream",
    "data.factory": "randomness_factories:build_recording_stream",
}
SEED = 7  # training.seed: neither the config's 0 nor data.seed (1234), so a wrong seed shows


def documented_draws(seed: int, epoch: int, index: int) -> list[float]:
    """What sample ``index`` of epoch (or pass) ``epoch`` draws first from Python's random,
    NumPy's legacy state and torch, by the rule docs/data.md gives users, computed here
    without the pipeline."""
    words = np.random.SeedSequence([seed, epoch, index]).generate_state(3, dtype=np.uint64)
    generator = torch.Generator().manual_seed(int(words[2]))
    return [
        random.Random(int(words[0])).random(),
        float(np.random.RandomState(int(words[1]) % 2**32).random_sample()),
        float(torch.rand((), generator=generator).item()),
    ]


def logged_batches(log: Path) -> list[list[tuple[int, list[float]]]]:
    """Each collated batch's ``(record, draws)`` pairs, in order."""
    return [[(record, draws) for record, draws in json.loads(line)] for line in log.read_text().splitlines()]


def _config(data_dir: Path, checkpoints: Path, **overrides):
    return load_config(
        CONFIG,
        {
            "data.dir": str(data_dir),
            "checkpoint.dir": str(checkpoints),
            "training.seed": SEED,
            **overrides,
        },
    )


# -- per-sample randomness --------------------------------------------------------------------


def test_each_sample_draws_by_the_documented_rule_from_seed_epoch_and_index(data_dir, tmp_path, monkeypatch):
    """10 steps of 4 over 24 shuffled rows: epoch 0 is steps 1-6, epoch 1 steps 7-10. Every
    sample's draws are the rule's for (training.seed, its epoch, its index), so a row is
    augmented anew each epoch and the same in every run of the seed."""
    log = tmp_path / "draws.jsonl"
    monkeypatch.setenv("RANDOMNESS_LOG", str(log))
    train(_config(data_dir, tmp_path / "run", **ROWS), progress=False)
    batches = logged_batches(log)
    assert [len(batch) for batch in batches] == [4] * 10
    seen: dict[int, dict[int, list[float]]] = {}
    for step, batch in enumerate(batches):
        epoch = step // 6
        for index, draws in batch:
            assert draws == documented_draws(SEED, epoch, index), (step, index)
            seen.setdefault(index, {})[epoch] = draws
    assert sorted(index for index, by_epoch in seen.items() if 0 in by_epoch) == list(range(24))
    twice = [by_epoch for by_epoch in seen.values() if len(by_epoch) == 2]
    assert len(twice) == 16 and all(by_epoch[0] != by_epoch[1] for by_epoch in twice)


@pytest.fixture(scope="module")
def stream_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("recording-stream") / "data"
    prepare_data(_config(folder, folder.parent / "unused", **STREAM))
    return folder


def _world(rank: int, world_size: int) -> LaunchWorld:
    return LaunchWorld(
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        local_world_size=world_size,
        device=torch.device("cpu"),
        mode="ddp",
    )


def _expected_stream(split: str, world_size: int, rank: int, steps: int) -> list[list[tuple[int, int, int]]]:
    """(record, pass, seeded position) of each sample rank ``rank`` trains on in each of
    ``steps`` steps of 4, as docs/data.md describes the split: 'examples', the records of
    global batch k are positions 4k..4k+3 of the pass, every rank keeps its contiguous part;
    'shards', rank r reads only its file (records 12r..12r+11) two a step, its k-th record
    of a pass seeded as position kW + r."""
    batches = []
    for step in range(steps):
        if split == "shards":
            reads = [(2 * step + i) for i in range(2)]
            batches.append([(12 * rank + k % 12, k // 12, (k % 12) * world_size + rank) for k in reads])
        else:
            share = 4 // world_size
            reads = [4 * step + share * rank + i for i in range(share)]
            batches.append([(g % 24, g // 24, g % 24) for g in reads])
    return batches


@pytest.mark.parametrize(
    "split, world_size",
    [("examples", 1), ("examples", 2), ("shards", 2)],
    ids=["one-process", "examples", "shards"],
)
def test_each_rank_reads_its_own_records_seeded_by_their_global_position(
    split, world_size, stream_dir, tmp_path, monkeypatch
):
    """Eight steps (past the end of the first pass) of each rank of a launch, read in this
    process: a rank's reader of a stream takes no collective until a checkpoint, so both
    ranks' readers run side by side here. Together the ranks train on every record once a
    pass, and each record draws by the rule for (seed, pass, its global position): no two
    records of a pass, on any rank, share their augmentation."""
    config = _config(stream_dir, tmp_path, **STREAM, **{"data.stream_split": split})
    drawn: dict[tuple[int, int], list[float]] = {}
    for rank in range(world_size):
        log = tmp_path / f"rank{rank}.jsonl"
        monkeypatch.setenv("RANDOMNESS_LOG", str(log))
        world = _world(rank, world_size) if world_size > 1 else World(device=torch.device("cpu"))
        feed = StreamFeed(load_task_data(config), config, torch.device("cpu"), world)
        for _ in range(8):
            feed.next_batch()
        expected = _expected_stream(split, world_size, rank, 8)
        batches = logged_batches(log)
        assert [[record for record, _ in batch] for batch in batches] == [
            [record for record, _, _ in batch] for batch in expected
        ], f"rank {rank} read other records"
        for got, want in zip(batches, expected):
            for (record, draws), (_, pass_, position) in zip(got, want):
                assert draws == documented_draws(SEED, pass_, position), (rank, record, pass_, position)
                drawn[(pass_, position)] = draws
    first_pass = [draws for (pass_, _), draws in drawn.items() if pass_ == 0]
    assert len(first_pass) == 24 and len({tuple(d) for d in first_pass}) == 24


def test_uneven_slices_of_a_stream_batch_weigh_to_the_global_batchs_mean(stream_dir, tmp_path, monkeypatch):
    """Batches of 3 over 2 ranks ('examples'): one rank keeps 1 record, the other 2. Each
    rank's factor makes the mean over ranks of its scaled mean (what DDP averages) the
    global batch's mean, for any per-record value (here the record numbers)."""
    config = _config(stream_dir, tmp_path, **STREAM, **{"data.batch_size": 3})
    kept, scales = {}, {}
    for rank in range(2):
        log = tmp_path / f"rank{rank}.jsonl"
        monkeypatch.setenv("RANDOMNESS_LOG", str(log))
        feed = StreamFeed(load_task_data(config), config, torch.device("cpu"), _world(rank, 2))
        scales[rank] = [feed.next_batch()[1] for _ in range(3)]
        kept[rank] = [[record for record, _ in batch] for batch in logged_batches(log)]
    for step in range(3):
        records = kept[0][step] + kept[1][step]
        assert records == [3 * step, 3 * step + 1, 3 * step + 2]
        weighed = sum(scales[r][step] * sum(kept[r][step]) / len(kept[r][step]) for r in range(2)) / 2
        assert weighed == pytest.approx(sum(records) / 3, rel=1e-12), step


def test_a_stream_split_into_shards_refuses_what_does_not_divide_over_the_ranks(stream_dir, tmp_path):
    """'shards': every rank takes B/W records a step from its own files, so the batch must
    divide over the ranks, and the files too (the recording stream has 2)."""
    for batch, world_size, message in (
        (3, 2, "data.batch_size 3 does not divide over 2 processes"),
        (4, 4, "the stream has 2 shards, not a multiple of 4 processes"),
    ):
        config = _config(
            stream_dir, tmp_path, **STREAM, **{"data.stream_split": "shards", "data.batch_size": batch}
        )
        with pytest.raises(DataError, match=message) as refused:
            StreamFeed(load_task_data(config), config, torch.device("cpu"), _world(0, world_size))
        assert "\n" not in str(refused.value)


@pytest.mark.heavy
def test_a_stream_split_into_shards_resumes_each_rank_at_its_own_place(tmp_path):
    """'shards' under torchrun (2 processes), over files of 16 and 8 records, so the ranks
    are at different places: cut at step 6 (rank 0 at record 12 of its first pass, rank 1 at
    record 4 of its second) and resumed, the run trains on what the uninterrupted one did,
    bitwise; resumed on one process with --reshard, it is refused in one line (each rank's
    position is its own)."""
    run = {
        "data.dir": str(tmp_path / "data"),
        **STREAM,
        "data.prepare": "randomness_factories:prepare_uneven_recording_stream",
        "data.stream_split": "shards",
        "training.parallel": "ddp",
        "training.seed": SEED,
    }
    prepare_data(load_config(CONFIG, run))
    cut = tmp_path / "cut" / "step-00000006"
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps(
            {
                "config": str(CONFIG),
                "results": str(tmp_path / "results.json"),
                "runs": [
                    {"overrides": {**run, "checkpoint.dir": str(tmp_path / "full")}},
                    {"overrides": {**run, "checkpoint.dir": str(tmp_path / "cut")}, "stop_at": 6},
                    {"overrides": {**run, "checkpoint.dir": str(tmp_path / "resumed")}, "resume": str(cut)},
                ],
            }
        )
    )
    launch = subprocess.run(
        [
            sys.executable,
            "-B",
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(HELPERS / "dist_leg.py"),
            str(plan),
        ],
        cwd=tmp_path,
        env=script_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launch.returncode == 0, launch.stderr[-3000:]
    full, stopped, resumed = json.loads((tmp_path / "results.json").read_text())
    assert stopped["step"] == 6 and resumed["step"] == full["step"] == 10, (stopped, resumed)
    assert resumed["loss"] == full["loss"]

    def positions(folder: Path) -> list[tuple[int, int]]:
        source = read_meta(folder)["training_state"]["data"]["source"]
        assert source["split"] == "shards" and source["world_size"] == 2
        return [(rank["pass"], rank["consumed"]) for rank in source["ranks"]]

    assert positions(cut) == [(0, 12), (1, 4)]
    assert positions(tmp_path / "resumed" / "step-00000010") == [(1, 4), (2, 4)]
    alone = load_config(CONFIG, {**run, "training.parallel": "none", "checkpoint.dir": str(tmp_path / "one")})
    with pytest.raises(
        DataError, match="saved by 2 processes reading their own shards.*resumes on 2 processes only"
    ) as refused:
        train(alone, resume=str(cut), reshard=True, progress=False)
    assert "\n" not in str(refused.value)


def _streams() -> tuple:
    """The states of the three global generators, comparable with ``==``."""
    _, key, pos, has_gauss, gauss = np.random.get_state()
    return random.getstate(), (key.tobytes(), pos, has_gauss, gauss), torch.get_rng_state().numpy().tobytes()


def test_fetching_a_batch_leaves_the_training_processs_random_streams_as_they_were(
    data_dir, stream_dir, tmp_path, monkeypatch
):
    """Dropout and the run's own draws use the global generators that fetching reseeds per
    sample: a batch fetched in the training process (a map-style set with 0 workers, a
    stream, its first batch after the exactness probe) puts them back as they were."""
    monkeypatch.setenv("RANDOMNESS_LOG", str(tmp_path / "draws.jsonl"))
    for folder, overrides in ((data_dir, ROWS), (stream_dir, STREAM)):
        config = _config(folder, tmp_path, **overrides)
        data = load_task_data(config)
        generator = np.random.default_rng(0)
        feed = make_feed(data, make_sampler(data, generator, config), generator, config, torch.device("cpu"))
        random.seed(11)
        np.random.seed(12)
        torch.manual_seed(13)
        for _ in range(2):
            before = _streams()
            feed.next_batch()
            after = _streams()
            moved = [name for name, a, b in zip(("random", "numpy", "torch"), before, after) if a != b]
            assert not moved, f"{config.data.factory}: fetching a batch moved {moved}"
        feed.close()


# -- shard coverage ---------------------------------------------------------------------------

FULL = torch.arange(24, dtype=torch.float32).view(4, 6)


def _write_shards(folder: Path, chunks: list[tuple[list[int] | None, torch.Tensor]], name: str = "w") -> dict:
    """``model/`` shard files, one per chunk of tensor ``name`` (as one rank's file holds
    its chunk), each chunk's offsets recorded as torch's DCP writer records them
    (``DCP_SHARDING_INFO``; offsets None: not recorded); {file name in meta.json: MappedTensors}."""
    (folder / "model").mkdir(parents=True)
    mapped = {}
    for number, (offsets, chunk) in enumerate(chunks):
        path = f"model/shard-{number + 1:05d}-model-00001-of-00001.safetensors"
        write_safetensors(
            folder / path,
            {name: chunk.contiguous()},
            {
                "DCP_SHARDING_INFO": json.dumps(
                    {} if offsets is None else {name: {"saved_offsets": offsets}}
                ),
                "format": "pt",
            },
        )
        mapped[path] = MappedTensors(folder / path)
    return mapped


def _read(reader: str, folder: Path, files: dict, expected: dict) -> dict[str, torch.Tensor]:
    """The full tensors as each reader of a distributed checkpoint builds them: the load's
    (resume, evaluate: :func:`shard_tensors` then :func:`consolidate`) or the private copy's
    (stage: :class:`ConsolidatedTensors`, one tensor at a time)."""
    if reader == "load":
        maps = {name: file.buffer for name, file in files.items()}
        return {
            k: v.clone()
            for k, v in consolidate(shard_tensors(folder, "model", expected, maps), expected).items()
        }
    return {name: tensor.clone() for name, tensor in ConsolidatedTensors(folder, "model", expected, files)}


FITS = {"w": {"dtype": "F32", "shape": [4, 6]}}

UNCOVERED = {
    # rows 0-1 and 1-2: 24 elements as the whole has, row 1 twice and row 3 never
    "overlapping as much as a gap": (
        [([0, 0], FULL[0:2]), ([1, 0], FULL[1:3])],
        "{part}: two shards of w overlap",
    ),
    # the first and the third chunk overlap (row 1), neither overlaps the second
    "first and last overlapping": (
        [([0, 0], FULL[0:2]), ([3, 0], FULL[3:4]), ([1, 0], FULL[1:2])],
        "{part}: two shards of w overlap",
    ),
    # the second and the third chunk overlap (row 2, row 3 a gap), neither overlaps the first
    "middle and last overlapping": (
        [([0, 0], FULL[0:2]), ([2, 0], FULL[2:3]), ([2, 0], FULL[2:3])],
        "{part}: two shards of w overlap",
    ),
    # rows 0-1 and 3: row 2 is a gap, nothing overlaps or lies outside
    "with a gap": (
        [([0, 0], FULL[0:2]), ([3, 0], FULL[3:4])],
        "{part}: the shards of w cover 18 of its 24 elements: a shard file is missing or damaged",
    ),
    # rows 0-1 and 3-4 of a 4-row tensor: the volume adds up, row 2 is a gap, row 4 is outside
    "running past the end": (
        [([0, 0], FULL[0:2]), ([3, 0], FULL[2:4])],
        "{part}: a shard of w does not fit its F32 tensor of shape [4, 6]",
    ),
    # columns 0-5 of row 2 at column offset 1: the last column lies outside
    "running past the last column": (
        [([0, 0], FULL[0:2]), ([2, 1], FULL[2:3]), ([3, 0], FULL[3:4])],
        "{part}: a shard of w does not fit its F32 tensor of shape [4, 6]",
    ),
    "of another dtype": (
        [([0, 0], FULL[0:2]), ([2, 0], FULL[2:4].to(torch.float64))],
        "{part}: a shard of w does not fit its F32 tensor of shape [4, 6]",
    ),
    "with offsets of fewer dimensions than the chunk": (
        [([0], FULL[0:2]), ([2, 0], FULL[2:4])],
        "{first} has a malformed DCP_SHARDING_INFO (bad offsets for w): the file is damaged",
    ),
    "at a negative offset": (
        [([-1, 0], FULL[0:2]), ([1, 0], FULL[2:4])],
        "{first} has a malformed DCP_SHARDING_INFO (bad offsets for w): the file is damaged",
    ),
}


@pytest.mark.parametrize("reader", ["load", "private copy"])
@pytest.mark.parametrize("case", sorted(UNCOVERED))
def test_shards_that_do_not_tile_their_tensor_exactly_are_refused_by_every_reader(reader, case, tmp_path):
    """Torch's reader loads whatever chunks it finds, and an assembled tensor starts as
    uninitialised memory: chunks that add up to the whole but overlap, leave a gap, lie
    outside the tensor, hold another dtype or sit at a negative offset are refused, in one
    line naming the tensor, before any value is read."""
    layout, message = UNCOVERED[case]
    files = _write_shards(tmp_path, layout)
    with pytest.raises((ChecksumMismatch, SchemaMismatch)) as refused:
        _read(reader, tmp_path, files, FITS)
    assert str(refused.value) == message.format(
        part=f"{tmp_path / 'model'}/", first=tmp_path / sorted(files)[0]
    )


def test_a_chunk_of_fewer_dimensions_than_its_tensor_is_refused(tmp_path):
    """A column tensor whose second half comes as a 1-D chunk of the right size and place."""
    column = torch.arange(4, dtype=torch.float32).view(4, 1)
    files = _write_shards(tmp_path, [([0, 0], column[0:2]), ([2], column[2:4].view(2))])
    for reader in ("load", "private copy"):
        with pytest.raises(ChecksumMismatch, match="a shard of w does not fit"):
            _read(reader, tmp_path, files, {"w": {"dtype": "F32", "shape": [4, 1]}})


TILINGS = {
    "rows, unevenly": [([0, 0], FULL[0:3]), ([3, 0], FULL[3:4])],
    "blocks, out of order": [
        ([2, 3], FULL[2:4, 3:6]),
        ([0, 0], FULL[0:2, 0:3]),
        ([2, 0], FULL[2:4, 0:3]),
        ([0, 3], FULL[0:2, 3:6]),
    ],
    # a tensor the sharding info does not list starts at 0 in every dimension
    "whole, its offsets not recorded": [(None, FULL)],
    # FSDP2 gives a rank an empty chunk when a tensor has fewer rows than the launch has ranks
    "with an empty chunk at the end": [([0, 0], FULL), ([4, 0], FULL[4:4])],
}
# A chunk of 10 MB: the private copy's reader copies it in slices of 8 MiB.
LARGE = torch.arange(2500 * 1024 + 500 * 1024, dtype=torch.float32).view(3000, 1024)
# Rows of 8.8 MB, each wider than a copy slice: copied a row at a time.
WIDE = torch.arange(2 * 2200 * 1024, dtype=torch.float32).view(2, 2200 * 1024)


@pytest.mark.parametrize(
    "case", [*sorted(TILINGS), "a chunk larger than a copy slice", "rows wider than a copy slice"]
)
def test_shards_that_tile_their_tensor_in_any_layout_are_assembled_exactly(case, tmp_path):
    full, layout = (
        (FULL, TILINGS[case])
        if case in TILINGS
        else (LARGE, [([0, 0], LARGE[:2500]), ([2500, 0], LARGE[2500:])])
        if case == "a chunk larger than a copy slice"
        else (WIDE, [([0, 0], WIDE[:1]), ([1, 0], WIDE[1:])])
    )
    files = _write_shards(tmp_path, layout)
    expected = {"w": {"dtype": "F32", "shape": list(full.shape)}}
    for reader in ("load", "private copy"):
        assert torch.equal(_read(reader, tmp_path, files, expected)["w"], full), reader


# -- the launcher watchdog ----------------------------------------------------------------------


def test_a_rank_that_agreed_to_stop_and_then_hangs_is_ended_after_its_agent_dies(tmp_path):
    """The ranks agreed to stop (a peer was signalled), so this rank's watchdog does not
    signal it when the agent dies: it is on its way out with a checkpoint. Then it hangs, as
    in a save's collective whose peer is gone: the last resort still ends it, ``grace``
    seconds later, with one line and exit 137. The orphan is reparented to a subreaper (as
    under systemd or a container's init shim), not to init: the watchdog must notice that
    its parent changed, not wait for init to adopt it."""
    rank = tmp_path / "rank.py"
    rank.write_text(
        "import time\n"
        "import torch, torch.distributed as dist\n"
        "from pipeline.distributed.world import LaunchWorld, end_with_launcher\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "world = LaunchWorld(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device('cpu'),\n"
        "              mode='ddp')\n"
        "end_with_launcher(grace=1)\n"
        "assert world.agree_signal(15) == 15\n"
        "ready()\n"
        "time.sleep(120)\n"
    )
    result = run_python(
        [HELPERS / "orphaned_rank.py", rank, "180"], cwd=tmp_path, env=script_env(), timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["status"] is not None, (
        "the hung rank outlived its agent by 180 s: " + result.stderr[-2000:]
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert outcome["status"] == 128 + 9 and outcome["seconds"] >= 1, (outcome, result.stderr[-2000:])
    assert len(errors) == 1 and "did not stop within 1 s" in errors[0], errors
