"""The meta.json record: its fields against docs/format.md, the chunk table written with
each file, verified chunk by chunk on load, every malformed table refused in one line,
and a checkpoint sealed before chunk tables still read, verified and resumed bitwise."""

from __future__ import annotations

import hashlib
import json
import mmap
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint import CheckpointStore, LoadMode, load_checkpoint, verified_read
from pipeline.checkpoint.meta import FIELDS, FILE_FIELDS, META_KEYS, SCHEMA_VERSION, entry_of
from pipeline.checkpoint.tensorfile import map_file, write_safetensors_files
from pipeline.checkpoint.verified_read import read_verified, sha256_mapped
from pipeline.errors import ChecksumMismatch, SchemaMismatch
from pipeline.hashing import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, ChunkDigests, chunk_size_for

from support import REPO, assert_checkpoints_bitwise_equal, read_meta_json, save_parts, train, write_sealed

SMALL = 4096  # a chunk size that makes the test checkpoints span several chunks


def _doc_table(heading: str) -> dict[str, str]:
    """``{key: description}`` of the markdown table whose header row is ``heading``."""
    lines = (REPO / "docs" / "format.md").read_text(encoding="utf-8").splitlines()
    start = lines.index(heading) + 2
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        match = re.fullmatch(r"\| `([^`]+)` \| (.*) \|", line)
        assert match, line
        rows[match.group(1)] = match.group(2)
    return rows


def test_the_meta_json_tables_of_the_docs_are_the_code_s():
    assert _doc_table("| key | what |") == FIELDS
    assert _doc_table("| entry key | what |") == FILE_FIELDS
    assert set(FIELDS) == META_KEYS
    assert (
        str(MIN_CHUNK_SIZE) in FILE_FIELDS["chunk_size"] and str(MAX_CHUNK_SIZE) in FILE_FIELDS["chunk_size"]
    )


MiB, GiB = 1024 * 1024, 1024 * 1024 * 1024


@pytest.mark.parametrize(
    "size, chunk_size",
    [
        (0, 4 * MiB),
        (10 * MiB, 4 * MiB),
        (256 * MiB, 4 * MiB),  # 64 chunks
        (256 * MiB + 1, 8 * MiB),  # 65 would be too many
        (600 * MiB, 16 * MiB),
        (4 * GiB, 64 * MiB),
        (1024 * GiB, 64 * MiB),  # the table grows past 64 chunks only above 4 GiB
    ],
)
def test_a_save_cuts_each_file_into_at_most_64_chunks_of_4_to_64_mib(size, chunk_size):
    assert chunk_size_for(size) == chunk_size


# -- writing: the chunk table comes from the written memory -------------------------------


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3000, generator=generator), "b": torch.randn(77, generator=generator)}


def _slices(raw: bytes, size: int) -> list[str]:
    return [hashlib.sha256(raw[i : i + size]).hexdigest() for i in range(0, len(raw), size)]


def test_the_writer_seals_every_chunk_of_a_file_spanning_several(tmp_path):
    path = tmp_path / "x.safetensors"
    [(sha256, size, chunk_size, chunks)] = write_safetensors_files(
        [(path, _tensors(), {"format": "pt"})], chunk_size=lambda size: SMALL
    )
    assert chunk_size == SMALL
    raw = path.read_bytes()
    assert size == len(raw) > 2 * SMALL and sha256 == hashlib.sha256(raw).hexdigest()
    assert chunks == _slices(raw, SMALL) and len(chunks) == -(-len(raw) // SMALL)
    assert entry_of(raw, SMALL) == {
        "sha256": sha256,
        "size": size,
        "chunk_size": SMALL,
        "chunk_sha256": chunks,
    }
    table = ChunkDigests(SMALL)
    for start in range(0, len(raw), 1000):  # pieces that straddle the chunk boundaries
        table.update(raw[start : start + 1000])
    assert table.hexdigests() == chunks
    with pytest.raises(ValueError, match="positive integer"):
        ChunkDigests(0)


def test_a_file_of_one_chunk_beside_larger_ones_has_its_whole_digest_as_its_table(tmp_path):
    """Only files larger than a chunk are hashed a second time; the others' table is their
    whole digest, whatever their place among the files; each file gets the chunk size its
    own size asks for."""
    files = [(tmp_path / "small-1", {"t": torch.ones(10)}, None), (tmp_path / "big", _tensors(), None)]
    files.append((tmp_path / "small-2", {"t": torch.zeros(20)}, None))
    files.append(
        (tmp_path / "big-2", {name: t * 2 for name, t in _tensors().items()} | {"c": torch.ones(99)}, None)
    )

    def sizes(size: int) -> int:  # the two large files differ in size: their chunks too
        return SMALL if size < 12_500 else SMALL // 2

    for (path, _, _), written in zip(files, write_safetensors_files(files, chunk_size=sizes)):
        raw = path.read_bytes()
        expected = sizes(len(raw))
        assert written == (hashlib.sha256(raw).hexdigest(), len(raw), expected, _slices(raw, expected))
    assert {(path.name, len(path.read_bytes()) > SMALL) for path, _, _ in files} == {
        ("small-1", False),
        ("small-2", False),
        ("big", True),
        ("big-2", True),
    }
    assert all(
        written.chunks is None and written.chunk_size is None
        for written in write_safetensors_files([(tmp_path / "x", _tensors(), None)])
    )


def test_a_save_records_the_chunk_table_of_each_file(tmp_path):
    """The training-state file (9 MiB) spans three 4 MiB chunks; the weights fit in one."""
    with CheckpointStore(tmp_path) as store:
        saved = store.save(1, _tensors(), {"s": torch.zeros(9 * MiB // 4)}, save_parts())
    meta = read_meta_json(saved.path)
    assert meta["schema"] == SCHEMA_VERSION == "pipeline.checkpoint/3"
    for name, entry in meta["files"].items():
        raw = (saved.path / name).read_bytes()
        assert entry == entry_of(raw) == saved.files[name]
        assert entry["chunk_size"] == MIN_CHUNK_SIZE and entry["chunk_sha256"] == _slices(raw, MIN_CHUNK_SIZE)
    assert len(meta["files"]["estado_treino.safetensors"]["chunk_sha256"]) == 3


# -- reading: each chunk verified, a damaged one named ------------------------------------


@pytest.fixture
def chunked(tmp_path) -> Path:
    """A checkpoint whose files are sealed in chunks of SMALL bytes (several per file)."""
    with CheckpointStore(tmp_path) as store:
        folder = store.save(1, _tensors(), {"s": torch.randn(2500)}, save_parts()).path
    meta = read_meta_json(folder)
    for name in meta["files"]:
        meta["files"][name] = entry_of((folder / name).read_bytes(), SMALL)
        assert len(meta["files"][name]["chunk_sha256"]) >= 3
    write_sealed(folder, meta)
    return folder


@pytest.mark.parametrize("into", [False, True])
def test_a_load_verifies_each_chunk_and_names_the_damaged_one(chunked, into):
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(3000))
    model.b = torch.nn.Parameter(torch.zeros(77))
    loaded = load_checkpoint(chunked, into=model if into else None)
    assert torch.equal(loaded.model_tensors["a"], _tensors()["a"])
    path = chunked / "modelo.safetensors"
    raw = path.read_bytes()
    for chunk in (0, 1, len(raw) // SMALL):
        damaged = bytearray(raw)
        damaged[min(chunk * SMALL + 9, len(raw) - 1)] ^= 1
        path.write_bytes(damaged)
        with pytest.raises(ChecksumMismatch) as caught:
            load_checkpoint(chunked, into=model if into else None)
        end = min((chunk + 1) * SMALL, len(raw))
        assert (
            f"modelo.safetensors SHA-256 differs from meta.json (chunk {chunk}: bytes {chunk * SMALL}-{end})"
            in (str(caught.value))
        )
    path.write_bytes(raw)
    assert load_checkpoint(chunked, mode=LoadMode.VERIFY).meta["step"] == 1


def test_read_verified_hashes_chunks_of_files_read_and_files_only_verified(chunked):
    names = ("modelo.safetensors", "estado_treino.safetensors")
    paths = {name: chunked / name for name in names}
    for destinations in ({name: {} for name in names}, dict.fromkeys(names)):
        read = read_verified(paths, destinations, dict.fromkeys(names, SMALL))
        for name in names:
            assert read[name][0] == _slices(paths[name].read_bytes(), SMALL)
        whole = read_verified(paths, destinations, dict.fromkeys(names))
        assert all(whole[n][0] == [hashlib.sha256(paths[n].read_bytes()).hexdigest()] for n in names)


def test_read_verified_reads_into_a_destination_only_where_it_fits_and_hashes_the_files_bytes(tmp_path):
    """A resume reads a file's tensors straight into the model's parameters: one that fits
    (dtype, shape, contiguous, on the CPU) is filled in place; one that does not gets a fresh
    tensor of the file's dtype and shape holding the file's values, and the destination is left
    as it was; either way the digest is the file's (what was read is what was hashed)."""
    path = tmp_path / "m.safetensors"
    stored = {
        "a": torch.randn(3, 4),
        "b": torch.randn(5, dtype=torch.float64),
        "c": torch.randn(2, 6),
        "d": torch.randn(6),
    }
    write_safetensors_files([(path, stored, None)])
    destinations = {
        "a": torch.zeros(3, 4),
        "b": torch.zeros(5),
        "c": torch.zeros(6, 2),
        "d": torch.zeros(12)[::2],
    }
    digests, tensors = read_verified({"m": path}, {"m": destinations}, {"m": None})["m"]
    assert digests == [hashlib.sha256(path.read_bytes()).hexdigest()]
    assert tensors["a"].data_ptr() == destinations["a"].data_ptr() and torch.equal(
        destinations["a"], stored["a"]
    )
    for name in ("b", "c", "d"):
        assert tensors[name].data_ptr() != destinations[name].data_ptr(), name
        assert tensors[name].dtype == stored[name].dtype and torch.equal(tensors[name], stored[name]), name
        assert not destinations[name].any(), name


def test_read_verified_never_reads_into_a_destination_off_the_cpu_and_fills_a_parameter_in_place(tmp_path):
    """A destination on another device (here ``meta``, which has no bytes) gets a fresh CPU
    tensor holding the file's values, the destination untouched; a model's parameter that fits
    is filled in place, through its data (no autograd record); a tensor not ``wanted`` is
    hashed, never handed out."""
    path = tmp_path / "m.safetensors"
    stored = {"off": torch.randn(2, 3), "param": torch.randn(4), "skip": torch.randn(5)}
    write_safetensors_files([(path, stored, None)])
    destinations = {
        "off": torch.empty(2, 3, device="meta"),
        "param": torch.nn.Parameter(torch.zeros(4)),
        "skip": torch.zeros(5),
    }
    read = read_verified(
        {"m": path}, {"m": destinations}, {"m": SMALL}, wanted={"m": lambda name: name != "skip"}
    )
    digests, tensors = read["m"]
    assert digests == _slices(path.read_bytes(), SMALL)
    assert sorted(tensors) == ["off", "param"] and not destinations["skip"].any()
    assert tensors["off"].device.type == "cpu" and torch.equal(tensors["off"], stored["off"])
    assert destinations["off"].device.type == "meta"
    assert tensors["param"].data_ptr() == destinations["param"].data_ptr()
    assert torch.equal(destinations["param"].detach(), stored["param"])
    assert not tensors["param"].requires_grad and destinations["param"].requires_grad


class _SideBySide:
    """hashlib as verified_read sees it, whose SHA-256 objects wait, at their first update,
    until another thread's does too: a read that hashes one file's chunks one after the
    other never gets past its first chunk (the barrier breaks)."""

    def __init__(self) -> None:
        self.meeting = threading.Barrier(2, timeout=60)
        self.threads: set[int] = set()

    def sha256(self, *args):
        real, side = hashlib.sha256(*args), self

        class Digest:
            def update(self, data) -> None:
                if threading.get_ident() not in side.threads:
                    side.threads.add(threading.get_ident())
                    side.meeting.wait()
                real.update(data)

            def hexdigest(self) -> str:
                return real.hexdigest()

        return Digest()


def test_sha256_mapped_hashes_the_chunks_of_one_file_side_by_side(chunked, monkeypatch):
    """A distributed checkpoint read by one process: each chunk of each map is a task of the
    pool, so two chunks of one file are hashed at once; the digests are the chunk table's
    (the whole file's for no chunk size), whether the pages are owned or not."""
    path = chunked / "modelo.safetensors"
    raw = path.read_bytes()
    for own in ((), ("m",)):
        # A barrier of its own per read: a new pool's threads may reuse the identities of the
        # last pool's, which would then skip the meeting and leave the other waiting alone.
        side = _SideBySide()
        monkeypatch.setattr(verified_read, "hashlib", side)
        assert sha256_mapped({"m": map_file(path)}, {"m": SMALL}, own=own) == {"m": _slices(raw, SMALL)}
        assert len(side.threads) == 2
    monkeypatch.undo()
    whole = hashlib.sha256(raw).hexdigest()
    assert sha256_mapped({"m": map_file(path), "e": b""}, {"e": SMALL}) == {"m": [whole], "e": []}


class _RewriteOnHash:
    """hashlib as verified_read sees it, whose first SHA-256 update, once done, rewrites the
    file in place (every byte flipped), as a writer racing the reader would."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rewritten = False

    def sha256(self, *args):
        real, outer = hashlib.sha256(*args), self

        class Digest:
            def update(self, data) -> None:
                real.update(data)
                if not outer.rewritten:
                    outer.rewritten = True
                    raw = outer.path.read_bytes()
                    with open(outer.path, "r+b") as handle:  # in place: the pages the map shares
                        handle.write(bytes(b ^ 0xFF for b in raw))

            def hexdigest(self) -> str:
                return real.hexdigest()

        return Digest()


@pytest.mark.parametrize("kernel", ["populate-write", "without it"])
@pytest.mark.parametrize("chunk_size", [None, SMALL, 3000])
@pytest.mark.parametrize("tensors", [2, 300])
def test_sha256_mapped_hashes_the_bytes_a_parser_and_the_tensors_then_read_from_the_map(
    tmp_path, chunk_size, tensors, kernel, monkeypatch
):
    """The file rewritten as soon as a first piece was hashed: of a file whose tensors are
    used, the map then holds exactly the bytes hashed (each page made this process's own
    copy before it was hashed); of a file only verified, the header a parser reads from it
    (owned before any chunk is hashed; a header of one page, or of several), its other pages
    reading the file again (never used). Chunk sizes that are not a page's multiple share
    pages between chunks. A kernel without MADV_POPULATE_WRITE (before Linux 5.14, which
    refuses the advice) gets each page owned by a byte written to itself."""
    if kernel == "without it":
        monkeypatch.setattr(verified_read, "_MADV_POPULATE_WRITE", -1)  # EINVAL, as an older kernel
    path = tmp_path / "m.safetensors"
    write_safetensors_files(
        [(path, {f"t{i:03d}": torch.randn(3000 // tensors) for i in range(tensors)}, None)]
    )
    raw = path.read_bytes()
    head = 8 + int.from_bytes(raw[:8], "little")
    assert len(raw) > 2 * SMALL and (head < mmap.PAGESIZE) == (tensors == 2)
    paged = -(-head // mmap.PAGESIZE) * mmap.PAGESIZE  # a page is owned whole
    for own in ((), ("m",), None):  # None: every file's tensors are viewed
        path.write_bytes(raw)
        mapped = map_file(path)
        racing = _RewriteOnHash(path)
        monkeypatch.setattr(verified_read, "hashlib", racing)
        digests = sha256_mapped({"m": mapped}, {"m": chunk_size}, own=own)["m"]
        monkeypatch.setattr(verified_read, "hashlib", hashlib)
        held = bytes(mapped)
        mapped.close()
        assert racing.rewritten
        if own != ():
            assert digests == (
                _slices(held, chunk_size) if chunk_size else [hashlib.sha256(held).hexdigest()]
            )
        else:
            assert held[:paged] == raw[:paged]
            assert held[paged:] == bytes(b ^ 0xFF for b in raw[paged:])
    path.write_bytes(raw)


@pytest.mark.parametrize("chunk_size", [None, SMALL])
def test_a_file_whose_header_claims_more_than_it_holds_is_hashed_whole_then_refused_by_the_parser(
    tmp_path, chunk_size
):
    """A sealed file whose header length runs past its end (damaged before it was sealed, or
    written so): its digests are of the bytes it holds, so they match its seal, and the parser
    then refuses it; it is not taken for a file that shrank while read (no digests)."""
    path = tmp_path / "s.safetensors"
    write_safetensors_files([(path, {"t": torch.randn(3 * SMALL // 4)}, None)])
    raw = bytearray(path.read_bytes())
    raw[:8] = len(raw).to_bytes(8, "little")
    path.write_bytes(raw)
    for destinations in ({}, None):
        digests, parsed = read_verified({"s": path}, {"s": destinations}, {"s": chunk_size})["s"]
        assert digests == (_slices(bytes(raw), SMALL) if chunk_size else [hashlib.sha256(raw).hexdigest()])
        assert isinstance(parsed, ValueError), parsed


class _TruncateOnHash:
    """hashlib as verified_read sees it, whose first SHA-256 update cuts the file to nothing
    before any other update goes on, as a writer racing the reader would: every chunk not
    read yet by then (all but one per thread of the pool, at most) finds the file ended."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.cut = False

    def sha256(self, *args):
        real, outer = hashlib.sha256(*args), self

        class Digest:
            def update(self, data) -> None:
                real.update(data)
                with outer.lock:
                    if not outer.cut:
                        outer.cut = True
                        outer.path.write_bytes(b"")

            def hexdigest(self) -> str:
                return real.hexdigest()

        return Digest()


@pytest.mark.parametrize("chunk_size", [None, SMALL])
def test_a_file_cut_short_while_it_is_read_gives_no_digests_not_digests_of_what_was_read(
    tmp_path, chunk_size, monkeypatch
):
    """read_verified plans a file's reads from its size when opened; a file that ends sooner
    while its pieces are read into the tensors (truncated by another writer) comes back with
    no digests (None: the load refuses it as damaged or modified), not with digests of the
    part it held, or of the zeros left where the rest was to be read."""
    path = tmp_path / "m.safetensors"
    write_safetensors_files([(path, {"t": torch.randn(192 * SMALL // 4)}, None)])
    assert path.stat().st_size > 128 * SMALL
    monkeypatch.setattr(verified_read, "hashlib", _TruncateOnHash(path))
    digests, _ = read_verified({"m": path}, {"m": {}}, {"m": chunk_size})["m"]
    assert digests is None and path.stat().st_size == 0


def test_a_malformed_file_is_hashed_by_chunks_before_the_parser_refuses_it(chunked):
    path = chunked / "estado_treino.safetensors"
    raw = bytearray(path.read_bytes())
    raw[8:9] = b"["  # the header is no longer JSON; the size is unchanged
    path.write_bytes(raw)
    meta = read_meta_json(chunked)
    meta["files"]["estado_treino.safetensors"] = entry_of(bytes(raw), SMALL)
    write_sealed(chunked, meta)
    read = read_verified({"s": path}, {"s": {}}, {"s": SMALL})
    assert read["s"][0] == _slices(bytes(raw), SMALL) and isinstance(read["s"][1], ValueError)
    with pytest.raises(SchemaMismatch, match="estado_treino.safetensors is not a valid safetensors file"):
        load_checkpoint(chunked)


# -- a malformed chunk table: one line, before any file is read ---------------------------


def _swap_first_two(entry: dict) -> None:
    entry["chunk_sha256"][:2] = entry["chunk_sha256"][1::-1]


TABLE_FAULTS = {
    "a chunk short of the end (a gap)": (lambda e: e["chunk_sha256"].pop(), "do not cover"),
    "a chunk past the end (an overlap)": (lambda e: e["chunk_sha256"].append("0" * 64), "do not cover"),
    "a chunk size that disagrees with the count": (lambda e: e.update(chunk_size=SMALL * 2), "do not cover"),
    "a zero chunk size": (lambda e: e.update(chunk_size=0), "not a positive integer"),
    "a negative chunk size": (lambda e: e.update(chunk_size=-SMALL), "not a positive integer"),
    "a float chunk size": (lambda e: e.update(chunk_size=4096.0), "not a positive integer"),
    "a boolean chunk size": (lambda e: e.update(chunk_size=True), "not a positive integer"),
    "an uppercase digest": (
        lambda e: e["chunk_sha256"].__setitem__(0, e["chunk_sha256"][0].upper()),
        "not a list of SHA-256",
    ),
    "a short digest": (lambda e: e["chunk_sha256"].__setitem__(1, "ab"), "not a list of SHA-256"),
    "digests not a list": (
        lambda e: e.update(chunk_sha256={"0": e["chunk_sha256"][0]}),
        "not a list of SHA-256",
    ),
    "one chunk unlike the whole": (
        lambda e: e.update(chunk_size=e["size"], chunk_sha256=["0" * 64]),
        "its one chunk's digest differs from the file's",
    ),
}


@pytest.mark.parametrize("fault", sorted(TABLE_FAULTS))
def test_a_malformed_chunk_table_is_refused_in_one_line(chunked, fault):
    change, reason = TABLE_FAULTS[fault]
    meta = read_meta_json(chunked)
    change(meta["files"]["modelo.safetensors"])
    write_sealed(chunked, meta)
    with pytest.raises(SchemaMismatch) as caught:
        load_checkpoint(chunked, mode=LoadMode.VERIFY)
    message = str(caught.value)
    assert "\n" not in message and caught.value.exit_code == 2
    assert "the chunk table of modelo.safetensors is malformed" in message and reason in message, message


@pytest.mark.parametrize(
    "change",
    [
        lambda e: e.pop("chunk_sha256"),
        lambda e: e.pop("chunk_size"),
        lambda e: [e.pop("chunk_size"), e.pop("chunk_sha256")],
        lambda e: e.update(extra=1),
        lambda e: e.update(sha256="0" * 63),
    ],
    ids=["no digests", "no chunk size", "no chunk table", "an extra key", "a short whole digest"],
)
def test_a_files_entry_without_its_chunk_table_is_refused(chunked, change):
    meta = read_meta_json(chunked)
    change(meta["files"]["estado_treino.safetensors"])
    write_sealed(chunked, meta)
    with pytest.raises(SchemaMismatch, match="malformed files table"):
        load_checkpoint(chunked, mode=LoadMode.VERIFY)


@pytest.mark.parametrize("change", [_swap_first_two, lambda e: e["chunk_sha256"].__setitem__(2, "0" * 64)])
def test_a_well_formed_table_that_disagrees_with_the_file_is_refused(chunked, change):
    meta = read_meta_json(chunked)
    change(meta["files"]["modelo.safetensors"])
    write_sealed(chunked, meta)
    with pytest.raises(ChecksumMismatch, match=r"modelo.safetensors SHA-256 differs from meta.json \(chunk "):
        load_checkpoint(chunked)


# -- a checkpoint sealed before chunk tables -----------------------------------------------


def as_schema_2(folder: Path) -> None:
    """What the writer sealed before chunk tables: the same record, each file with its
    whole digest only, schema 2."""
    meta = read_meta_json(folder)
    meta["schema"] = "pipeline.checkpoint/2"
    meta["files"] = {name: {"sha256": e["sha256"], "size": e["size"]} for name, e in meta["files"].items()}
    write_sealed(folder, meta)


def test_a_schema_2_checkpoint_is_verified_by_its_whole_digests(tmp_path):
    with CheckpointStore(tmp_path) as store:  # files of several read pieces (2 MiB each)
        folder = store.save(1, {"w": torch.randn(1_500_000)}, {"s": torch.arange(5)}, save_parts()).path
    as_schema_2(folder)
    assert load_checkpoint(folder).meta["schema"] == "pipeline.checkpoint/2"
    meta = read_meta_json(folder)
    meta["files"]["modelo.safetensors"]["chunk_size"] = SMALL
    write_sealed(folder, meta)
    with pytest.raises(SchemaMismatch, match="malformed files table"):
        load_checkpoint(folder, mode=LoadMode.VERIFY)
    as_schema_2(folder)
    path = folder / "modelo.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(raw)
    with pytest.raises(ChecksumMismatch, match=r"modelo.safetensors SHA-256 differs from meta.json: "):
        load_checkpoint(folder)


def test_a_schema_2_checkpoint_resumes_bitwise(data_dir, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train(data_dir, straight, "--max-steps", "6", "--checkpoint-every", "6").returncode == 0
    first = train(data_dir, resumed, "--max-steps", "6", "--stop-at", "3", "--checkpoint-every", "3")
    assert first.returncode == 0, first.stderr
    as_schema_2(resumed / "step-00000003")
    second = train(data_dir, resumed, "--max-steps", "6", "--resume", "latest")
    assert second.returncode == 0, second.stderr
    assert_checkpoints_bitwise_equal(straight / "step-00000006", resumed / "step-00000006")
    assert json.loads((resumed / "step-00000006" / "meta.json").read_text())["schema"] == SCHEMA_VERSION
    shutil.rmtree(straight)


def test_build_meta_refuses_a_record_no_reader_would_accept():
    from pipeline.checkpoint.meta import build_meta
    from pipeline.errors import InternalError

    entry = entry_of(b"x" * 10)
    files = {"modelo.safetensors": entry, "estado_treino.safetensors": entry}
    assert build_meta(save_parts(), step=1, files=files)["schema"] == SCHEMA_VERSION
    with pytest.raises(InternalError, match="owns"):
        build_meta({**save_parts(), "schema": "mine"}, step=1, files=files)
    with pytest.raises(InternalError, match="keys differ"):
        build_meta({**save_parts(), "extra": 1}, step=1, files=files)
    for broken in ({**entry, "chunk_sha256": []}, {"sha256": entry["sha256"], "size": 10}):
        with pytest.raises(InternalError, match="files table is malformed"):
            build_meta(save_parts(), step=1, files={**files, "modelo.safetensors": broken})
