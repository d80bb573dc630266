"""Reading weights in bounded memory, as the OS counts it (mapped file pages included).

The figures at model size (05 on 0.4 and 1 GB FSDP2 and single-process checkpoints) are
in benchmarks/README.md (``benchmarks/stage_memory.py``); here, cheaply, the mechanisms:
pages hashed but not used are given back, and a distributed checkpoint's tensors are
assembled one at a time with their shards' pages released as they are copied.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint import ConsolidatedTensors, MappedTensors, write_safetensors
from pipeline.checkpoint.tensorfile import map_file
from pipeline.checkpoint.verified_read import read_verified, sha256_mapped

MIB = 1024 * 1024


def rss() -> dict[str, int]:
    """This process's resident pages, anonymous and mapped from files (a tmpfs file's count as
    shared memory, folded in), in bytes."""
    values = {"RssAnon": 0, "RssFile": 0}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "RssShmem"):
            values["RssAnon" if key == "RssAnon" else "RssFile"] += int(value.split()[0]) * 1024
    return values


@pytest.mark.parametrize("chunk_size", [None, 16 * MIB])
def test_pages_hashed_for_verification_only_are_given_back_and_owned_ones_kept(tmp_path, chunk_size):
    """Hashed whole or in chunks side by side (a thread per core)."""
    path = tmp_path / "big.safetensors"
    write_safetensors(path, {f"t{i}": torch.full((4 * MIB,), i, dtype=torch.uint8) for i in range(16)})
    before = rss()
    hashed = map_file(path)  # kept open: only given-back pages leave the count
    sha256_mapped({"big": hashed}, {"big": chunk_size}, own=())
    assert rss()["RssFile"] - before["RssFile"] < 24 * MIB, (
        "64 MiB hashed: at most a chunk or two stays mapped"
    )
    hashed.close()
    before = rss()
    kept = map_file(path)
    # Its tensors will be viewed: every page owned and kept.
    sha256_mapped({"big": kept}, {"big": chunk_size}, own=("big",))
    assert rss()["RssAnon"] - before["RssAnon"] > 60 * MIB, "the measure sees pages that stay"
    kept.close()


def peak_since(reset: bool = False) -> int:
    """This process's peak resident size (VmHWM) in bytes; ``reset``: make it the current
    size first (Linux: /proc/self/clear_refs)."""
    if reset:
        Path("/proc/self/clear_refs").write_text("5")
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024


def test_a_file_only_verified_is_hashed_with_its_pages_given_back_as_it_goes(tmp_path):
    """read_verified of a file whose tensors are not used (04 and 05 verify a single-process
    checkpoint so): its map's pages leave the count once hashed, at its peak too."""
    path = tmp_path / "big.safetensors"
    write_safetensors(path, {f"t{i}": torch.full((4 * MIB,), i, dtype=torch.uint8) for i in range(16)})
    for chunk_size in (None, 16 * MIB):
        before = peak_since(reset=True)
        read = read_verified({"big": path}, {"big": None}, {"big": chunk_size})
        assert read["big"][0] is not None and read["big"][1] == {}
        assert peak_since() - before < 24 * MIB, "64 MiB hashed: a few pieces per thread stay mapped"


def test_a_sharded_checkpoints_tensors_come_whole_one_at_a_time_with_their_pages_released(tmp_path):
    """Four 16 MiB tensors, the first held whole by one shard file, the others split by rows
    across two (as FSDP2 writes them): each comes back equal to the whole, and the process never
    holds much more than one (the whole one's pages given back once the next is asked for)."""
    full = {
        f"layer{i}.weight": torch.arange(2048 * 2048, dtype=torch.float32).view(2048, 2048) + i
        for i in range(4)
    }
    (tmp_path / "model").mkdir()
    files = {}
    whole = "layer0.weight"
    for rank, rows in enumerate((slice(0, 1024), slice(1024, 2048))):
        name = f"model/shard-{rank + 1:05d}.safetensors"
        held = {key: tensor[rows].clone() for key, tensor in full.items() if key != whole}
        if rank == 0:
            held[whole] = full[whole]
        sharding = {key: {"saved_offsets": [0 if key == whole else rows.start, 0]} for key in held}
        write_safetensors(tmp_path / name, held, {"DCP_SHARDING_INFO": json.dumps(sharding)})
        files[name] = MappedTensors(tmp_path / name)
    expected = {key: {"dtype": "F32", "shape": [2048, 2048]} for key in full}
    consolidated = ConsolidatedTensors(tmp_path, "model", expected, files)
    before, highest = rss(), 0
    seen, mapped = [], []
    for name, tensor in consolidated:
        assert torch.equal(tensor, full[name]), name
        seen.append(name)
        now = rss()
        highest = max(highest, now["RssAnon"] + now["RssFile"] - before["RssAnon"] - before["RssFile"])
        mapped.append(now["RssFile"] - before["RssFile"])
    assert seen == sorted(full)
    # 64 MiB of weights, each tensor measured before the iterator releases it: the 16 MiB
    # assembly buffer and about a page per chunk, never a tensor's chunks on top of it.
    assert highest < 16 * MIB + 6 * MIB, highest / MIB
    # The whole one's mapped pages (read by the comparison) given back once the next is asked for.
    assert mapped[0] >= 16 * MIB and max(mapped[1:]) < MIB, [m / MIB for m in mapped]
