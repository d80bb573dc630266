"""Fast unit tests of the checkpoint package and the durable helpers, in this process:
store listing / resolve / prune order, the safetensors parser, the codec round trip,
hashing while writing, tied-weight dedupe, the atomic-folder steps, the JSON writer and
the lock. A failure here points at one module, not at a script run."""

from __future__ import annotations

import errno
import hashlib
import inspect
import json
import math
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_model

import pipeline.durable as durable
from pipeline.checkpoint import CheckpointStore, LoadMode, load_checkpoint, read_tensors, write_safetensors
from pipeline.checkpoint.codec import join_state, split_state
from pipeline.checkpoint.store import parse_step_dir, resolve, step_dir_name
from pipeline.checkpoint.tensorfile import map_file, parse_header, tensors_from_map
from pipeline.checkpoint.weights import dedupe_shared_tensors
from pipeline.errors import CheckpointError, CheckpointLocked, InternalError, NoCheckpoint, SchemaMismatch
from pipeline.hashing import HashingWriter, sha256_file

from support import save_parts

META = save_parts(split_state({"best": math.inf}, "state", {}))


def _save(root: Path, steps, keep_last: int = 10) -> CheckpointStore:
    store = CheckpointStore(root, keep_last=keep_last)
    with store:
        for step in steps:
            store.save(step, {"w": torch.full((3,), float(step))}, {"s": torch.zeros(1)}, META)
    return store


# -- store ---------------------------------------------------------------------------------


def test_step_names_sort_as_integers_and_only_committed_folders_count(tmp_path):
    assert step_dir_name(10) == "step-00000010" and parse_step_dir("step-00000010") == 10
    assert parse_step_dir(".tmp-step-00000010-ab") is None and parse_step_dir("step-1") is None
    assert parse_step_dir("step-00000010\n") is None and parse_step_dir("step-00000010 ") is None
    # Digits of another script are no step: int() would read both as 10.
    assert parse_step_dir("step-٠٠٠٠٠٠١٠") is None and parse_step_dir("step-𝟎𝟎𝟎𝟎𝟎𝟎𝟏𝟎") is None
    store = _save(tmp_path, [9, 100_000_000, 10])
    (tmp_path / "step-٠٠٠٠٠٠١١").mkdir()  # a user's folder, with a meta.json of its own
    (tmp_path / "step-٠٠٠٠٠٠١١" / "meta.json").write_bytes(
        (tmp_path / "step-00000010" / "meta.json").read_bytes()
    )
    (tmp_path / "step-00000011").mkdir()  # no meta.json: not committed
    (tmp_path / ".tmp-step-00000012-0bad").mkdir()
    assert store.committed_steps() == [9, 10, 100_000_000]
    folder, older = resolve("latest", tmp_path)
    assert folder.name == "step-100000000" and [p.name for p in older] == ["step-00000010", "step-00000009"]


def test_prune_keeps_the_newest_and_deletes_oldest_first(tmp_path):
    store = _save(tmp_path, [1, 2, 3, 4], keep_last=2)
    assert store.committed_steps() == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "step-00000003", "step-00000004"]


def test_a_prune_at_exactly_keep_last_deletes_nothing_and_past_it_the_oldest_but_the_marked_best(tmp_path):
    """keep_last 3: three checkpoints are all kept; a fourth deletes the oldest only; a fifth
    keeps step 2, which BEST.json marks, besides the newest three, and a sixth deletes step 3
    but not step 2. What else lies in the folder (a file, a step folder without meta.json,
    another name) is never touched, nor counted as a checkpoint."""
    from pipeline.checkpoint.best import write_best

    with pytest.raises(ValueError) as refused:
        CheckpointStore(tmp_path, keep_last=0)
    assert str(refused.value) == "keep_last must be >= 1"
    (tmp_path / "step-00000000").mkdir(parents=True)  # no meta.json: not a committed checkpoint
    (tmp_path / "step-7").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    store = _save(tmp_path, [1, 2, 3], keep_last=3)
    assert store.committed_steps() == [1, 2, 3]
    write_best(tmp_path, {"step": 2, "metric": "mse", "mode": "min", "value": 0.5})
    with store:
        store.save(4, {"w": torch.full((3,), 4.0)}, {"s": torch.zeros(1)}, META)
        assert store.committed_steps() == [2, 3, 4]
        store.save(5, {"w": torch.full((3,), 5.0)}, {"s": torch.zeros(1)}, META)
        assert store.committed_steps() == [2, 3, 4, 5]
        store.save(6, {"w": torch.full((3,), 6.0)}, {"s": torch.zeros(1)}, META)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".lock", "BEST.json", "notes.txt", "step-00000000", "step-00000002", "step-00000004",
        "step-00000005", "step-00000006", "step-7",
    ]  # fmt: skip


def test_a_save_returns_while_the_prune_runs_and_the_store_waits_for_it_before_anything_else(
    tmp_path, monkeypatch
):
    store = _save(tmp_path, [1], keep_last=1)
    deleting, may_finish = threading.Event(), threading.Event()
    rmtree = shutil.rmtree

    def slow_rmtree(path, *args, **kwargs):
        deleting.set()
        assert may_finish.wait(30), "the test never let the prune finish"
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    with store:
        saved = store.save(2, {"w": torch.full((3,), 2.0)}, {"s": torch.zeros(1)}, META)
        assert saved.step == 2 and deleting.wait(30)  # save returned; step 1 is still being deleted
        assert any(p.name.startswith(".deleting-step-00000001") for p in tmp_path.iterdir())
        may_finish.set()
        assert store.committed_steps() == [2]  # the listing waited for the prune
        assert not any(p.name.startswith(".deleting-") for p in tmp_path.iterdir())


def test_a_prune_that_fails_other_than_by_the_os_raises_in_the_caller_at_the_next_wait(tmp_path, monkeypatch):
    store = _save(tmp_path, [1], keep_last=1)
    monkeypatch.setattr(
        shutil, "rmtree", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bug in the prune"))
    )
    with pytest.raises(RuntimeError, match="bug in the prune"):
        with store:
            store.save(2, {"w": torch.full((3,), 2.0)}, {"s": torch.zeros(1)}, META)
    with CheckpointStore(tmp_path):  # the lock was released all the same
        pass


def test_resolve_says_what_to_do_when_there_is_nothing(tmp_path):
    with pytest.raises(NoCheckpoint, match="--checkpoint-dir"):
        resolve("latest", tmp_path)
    with pytest.raises(NoCheckpoint, match="pass --checkpoint PATH"):
        resolve("latest", tmp_path, committed=True)
    (tmp_path / ".tmp-step-00000001-ab").mkdir()  # a save in progress
    with pytest.raises(CheckpointError, match="not a committed checkpoint folder"):
        resolve(tmp_path / ".tmp-step-00000001-ab", tmp_path, committed=True)
    with pytest.raises(
        NoCheckpoint, match=r"neither latest, best nor an existing folder: name latest\|best\|PATH"
    ):
        resolve(tmp_path / "bset", tmp_path, committed=True)


def test_a_damaged_latest_names_the_newest_older_checkpoint_that_verifies(tmp_path):
    """Of two older checkpoints that verify, the newer one is named (resuming from the oldest
    would repeat work that was saved); one damaged too (a byte flipped, found by its hashes) is
    passed over; with none left that verifies, the damage alone is the refusal."""
    _save(tmp_path, [1, 2, 3])
    damaged = tmp_path / "step-00000003" / "modelo.safetensors"
    damaged.write_bytes(b"x" * 10)
    damage = f"{damaged} is 10 bytes, meta.json records 124: the file is truncated or was modified"

    def refusal() -> str:
        with pytest.raises(CheckpointError) as refused:
            load_checkpoint("latest", tmp_path)
        return str(refused.value)

    def naming(step: int) -> str:
        older = tmp_path / step_dir_name(step)
        return f"{damage}; the older checkpoint {older} verifies: resume from it with --resume {older} (nothing was deleted)"

    assert refusal() == naming(2)
    # A byte flipped, its size intact: only its hashes tell it is damaged.
    weights = tmp_path / "step-00000002" / "modelo.safetensors"
    flipped = bytearray(weights.read_bytes())
    flipped[-1] ^= 0x01
    weights.write_bytes(bytes(flipped))
    assert refusal() == naming(1)
    assert load_checkpoint(tmp_path / "step-00000001").model_tensors["w"].tolist() == [1.0, 1.0, 1.0]
    (tmp_path / "step-00000001" / "meta.json").write_bytes(b"{")
    assert refusal() == damage


def test_a_checkpoint_folder_renamed_to_another_step_is_refused_naming_both(tmp_path):
    """A folder's name is the step 'latest', the prune and --resume read; meta.json records the
    step its state is at. A folder renamed by hand (step 2 as step 3) is refused, not resumed as
    a step it is not; under its own name it loads."""
    _save(tmp_path, [1, 2])
    (tmp_path / "step-00000002").rename(tmp_path / "step-00000003")
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(tmp_path / "step-00000003")
    assert str(refused.value) == (
        f"{tmp_path / 'step-00000003' / 'meta.json'} records step 2 but the folder is step-00000003"
    )
    (tmp_path / "step-00000003").rename(tmp_path / "step-00000002")
    assert load_checkpoint(tmp_path / "step-00000002").meta["step"] == 2


def test_meta_round_trips_a_python_infinity_exactly(tmp_path):
    _save(tmp_path, [1])
    meta = load_checkpoint("latest", tmp_path, mode=LoadMode.VERIFY).meta
    assert join_state(meta["training_state"], {})["best"] == math.inf


def test_a_second_store_on_the_same_folder_is_refused(tmp_path):
    with CheckpointStore(tmp_path):
        with pytest.raises(CheckpointLocked, match=f"pid {os.getpid()}"):
            CheckpointStore(tmp_path).acquire()


# -- the safetensors reader and writer -------------------------------------------------------


def test_written_file_hash_is_the_file_hash_and_plain_safetensors_reads_it(tmp_path):
    tensors = {
        "a": torch.randn(1000, dtype=torch.float64),
        "b": torch.arange(7, dtype=torch.int16),
        "empty": torch.zeros(0),
        "flag": torch.tensor([True, False]),
    }
    sha, size = write_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    assert (sha, size) == (
        sha256_file(tmp_path / "x.safetensors"),
        (tmp_path / "x.safetensors").stat().st_size,
    )
    for loaded in (load_file(tmp_path / "x.safetensors"), read_tensors(tmp_path / "x.safetensors")):
        assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in tensors.items())


def _file(header: dict | bytes, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"", "shorter than the 8-byte header length"),
        ((1 << 40).to_bytes(8, "little") + b"{}", "over the 104857600-byte limit"),
        ((64).to_bytes(8, "little") + b"{}", "runs past the end of the file"),
        (
            (1000).to_bytes(8, "little") + b"{}",
            "runs past the end of the file",
        ),  # under the header cap, past the end
        (_file(b"[1, 2]"), "does not start with"),
        (_file(b"\xff\xfe"), "utf-8"),
        (_file({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 8), "do not hold"),
        (
            _file({"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 4),
            "does not start the data at byte 0",
        ),
        (_file({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}), "non-negative integers"),
        (_file({"t": {"dtype": "X9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "X9"),
    ],
)
def test_the_parser_refuses_malformed_files_naming_them(tmp_path, raw, why):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw)
    with pytest.raises(SchemaMismatch, match=f"{path}.*{why}" if why != "utf-8" else str(path)):
        read_tensors(path)


def test_parse_header_returns_the_data_offset():
    raw = _file({"__metadata__": {"k": "v"}}, b"")
    header, start = parse_header(raw)
    assert header == {"__metadata__": {"k": "v"}} and start == len(raw)
    assert tensors_from_map(Path("m"), raw) == {}


def test_the_torch_free_parser_knows_every_dtype_the_writer_writes_at_its_size():
    from pipeline.checkpoint.tensorfile import SAFETENSORS_DTYPES
    from pipeline.safetensors_header import DTYPE_SIZES

    assert {code: dtype.itemsize for dtype, code in SAFETENSORS_DTYPES.items()} == DTYPE_SIZES


def test_mapped_tensors_are_private_copies_on_write(tmp_path):
    write_safetensors(tmp_path / "x.safetensors", {"a": torch.zeros(4)})
    before = sha256_file(tmp_path / "x.safetensors")
    tensors = tensors_from_map(tmp_path / "x.safetensors", map_file(tmp_path / "x.safetensors"))
    tensors["a"].add_(1)
    assert sha256_file(tmp_path / "x.safetensors") == before


# -- codec ---------------------------------------------------------------------------------


def test_codec_round_trip_is_exact():
    state = {
        "betas": (0.9, 0.999),
        "state": {0: {"exp_avg": torch.randn(3), "step": torch.tensor(2.0)}},
        "arr": np.arange(6, dtype=np.uint16).reshape(2, 3),
        "none": None,
        "flag": True,
        "inf": math.inf,
        "nested": [1, "two", (3,)],
        "np_scalar": np.float32(1.5),
    }
    tensors: dict = {}
    tree = split_state(state, "opt", tensors)
    json.dumps(tree, allow_nan=True)  # the tree is plain JSON
    back = join_state(json.loads(json.dumps(tree)), tensors)
    assert back["betas"] == (0.9, 0.999) and isinstance(back["betas"], tuple)
    assert list(back["state"]) == [0] and torch.equal(
        back["state"][0]["exp_avg"], state["state"][0]["exp_avg"]
    )
    assert back["arr"].dtype == np.uint16 and (back["arr"] == state["arr"]).all()
    assert back["nested"] == [1, "two", (3,)] and back["inf"] == math.inf and back["np_scalar"] == 1.5


def test_the_split_tree_shares_no_container_with_the_live_state():
    """A background save hands the tree to its writer thread uncopied: training's later
    changes to the live state (Python's RNG list, a scheduler's milestones) must not reach it."""
    live = {"milestones": [3, 6], "python_rng": (3, [1, 2, 3], None), "group": {"betas": [0.9, 0.99]}}
    tree = split_state(live, "s", {})
    before = json.dumps(tree)
    live["milestones"].append(9)
    live["python_rng"][1].append(4)
    live["group"]["betas"][0] = 0.5
    assert json.dumps(tree) == before


def test_codec_refuses_two_entries_with_one_tensor_name_and_unpicklable_objects():
    with pytest.raises(ValueError, match="opt/a/b"):
        split_state({"a/b": torch.zeros(1), "a": {"b": torch.ones(1)}}, "opt", {})
    with pytest.raises(TypeError, match="no pickle"):
        split_state({"f": object()}, "opt", {})


# -- dedupe of shared storages ---------------------------------------------------------------


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 4)
        self.out = torch.nn.Linear(4, 5, bias=False)
        self.out.weight = self.embed.weight
        self.buffer_slice = torch.nn.Parameter(torch.zeros(8))


def test_dedupe_keeps_the_name_safetensors_save_model_keeps(tmp_path):
    model = _Tied()
    save_model(model, str(tmp_path / "ref.safetensors"))
    assert set(dedupe_shared_tensors(model.state_dict())) == set(load_file(tmp_path / "ref.safetensors"))


def test_dedupe_keeps_disjoint_slices_and_refuses_partial_aliases():
    base = torch.arange(8.0)
    assert set(dedupe_shared_tensors({"lo": base[:4], "hi": base[4:]})) == {"lo", "hi"}
    assert set(dedupe_shared_tensors({"b": base, "a": base.view(2, 4)})) == {"a"}
    with pytest.raises(ValueError, match="share memory"):
        dedupe_shared_tensors({"x": base[:6], "y": base[2:]})


# -- hashing ---------------------------------------------------------------------------------


def test_sha256_file_and_hashing_writer_agree_with_hashlib_across_chunks(tmp_path):
    data = os.urandom(3 * 1024 + 17)
    with HashingWriter(tmp_path / "f") as out:
        out.write(data[:100])
        out.write(memoryview(data)[100:])
    expected = hashlib.sha256(data).hexdigest()
    assert out.sha256 == expected == sha256_file(tmp_path / "f", chunk=1024)
    with pytest.raises(FileExistsError):
        HashingWriter(tmp_path / "f")


# -- durable: atomic folders, JSON, lock -------------------------------------------------------


def test_json_writer_refuses_nan_naming_where_and_allows_it_only_when_asked(tmp_path):
    with pytest.raises(ValueError, match="nan at /a/1"):
        durable.write_json_atomic(tmp_path / "x.json", {"a": [1.0, math.nan]})
    assert not list(tmp_path.iterdir())
    durable.write_json_atomic(tmp_path / "x.json", {"a": math.inf}, allow_nan=True)
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": math.inf}


def _fill(folder: Path, text: str) -> None:
    (folder / "f.txt").write_text(text)


@pytest.mark.parametrize("failing", durable.STEPS)
def test_atomic_folder_failing_at_any_step_leaves_the_old_or_the_new_folder(tmp_path, monkeypatch, failing):
    dest = tmp_path / "out"
    with durable.atomic_folder(dest) as built:
        _fill(built, "old")
    real = durable.step

    def step(name, call, *args):
        if name == failing:
            raise OSError(f"injected failure at {name}")
        return real(name, call, *args)

    monkeypatch.setattr(durable, "step", step)
    with pytest.raises(OSError, match=failing):
        with durable.atomic_folder(dest, owned=lambda d: (d / "f.txt").is_file()) as built:
            _fill(built, "new")
    monkeypatch.setattr(durable, "step", real)
    durable.recover(dest)
    committed = failing in ("fsync_parent", "remove_old")  # the rename had happened
    assert (dest / "f.txt").read_text() == ("new" if committed else "old")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("crashing", durable.STEPS)
def test_a_crash_before_any_step_of_atomic_folder_is_undone_by_recover(tmp_path, monkeypatch, crashing):
    """As above, but the process dies before the step (no cleanup runs): recover() alone must
    bring back the old folder, or keep the new one once it was renamed in."""
    dest = tmp_path / "out"
    with durable.atomic_folder(dest) as built:
        _fill(built, "old")
    real = durable.step

    def step(name, call, *args):
        if name == crashing:
            os._exit(0)  # a crash: no except or finally runs
        return real(name, call, *args)

    pid = os.fork()
    if pid == 0:
        monkeypatch.setattr(durable, "step", step)
        with durable.atomic_folder(dest, owned=lambda d: (d / "f.txt").is_file()) as built:
            _fill(built, "new")
        os._exit(3)  # not reached: every step is a crash point
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    durable.recover(dest)
    committed = crashing in ("fsync_parent", "remove_old")  # the rename had happened
    assert (dest / "f.txt").read_text() == ("new" if committed else "old")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_atomic_folder_never_replaces_a_folder_it_cannot_prove_it_built(tmp_path):
    dest = tmp_path / "theirs"
    dest.mkdir()
    (dest / "precious").write_text("keep")
    for owned in (None, lambda d: (d / "manifest.json").is_file()):
        with pytest.raises(FileExistsError):
            with durable.atomic_folder(dest, owned=owned) as built:
                _fill(built, "new")
    assert (dest / "precious").read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == [
        "theirs"
    ]


def test_a_step_outside_the_protocol_is_an_internal_error_and_runs_nothing(tmp_path):
    with pytest.raises(InternalError) as refused:
        durable.step("fsync", os.mkdir, tmp_path / "x")
    assert str(refused.value) == "unknown atomic-folder step 'fsync'"
    assert list(tmp_path.iterdir()) == []


def test_atomic_folder_commits_a_link_as_a_link_and_never_syncs_what_it_points_to(tmp_path):
    """What a link names is not the folder's: a procfs file, which fsync refuses (EINVAL), here."""
    dest = tmp_path / "out"
    with durable.atomic_folder(dest) as built:
        _fill(built, "new")
        (built / "status").symlink_to("/proc/self/status")
        (built / "proc").symlink_to("/proc/self")
    assert (os.readlink(dest / "status"), os.readlink(dest / "proc")) == ("/proc/self/status", "/proc/self")
    assert (dest / "f.txt").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_lock_folder_takes_a_free_folder_and_passes_over_one_held_gone_or_replaced_by_a_file_or_link(
    tmp_path,
):
    folder = tmp_path / "step"
    folder.mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(folder)
    assert [durable.lock_folder(tmp_path / name) for name in ("missing", "file", "link")] == [
        None,
        None,
        None,
    ]
    with pytest.raises(OSError) as failed:  # any other failure is not taken for "gone"
        durable.lock_folder(tmp_path / ("x" * 256))
    assert failed.value.errno == errno.ENAMETOOLONG
    fd = durable.lock_folder(folder)
    try:
        assert fd is not None and durable.lock_folder(folder) is None
    finally:
        durable.close_lock_fd(fd)


def test_folder_lock_is_exclusive_and_released(tmp_path):
    first = durable.FolderLock(tmp_path, lambda holder: RuntimeError(f"busy {holder}"))
    with first:
        with pytest.raises(RuntimeError, match="busy unknown"):
            durable.FolderLock(tmp_path, lambda holder: RuntimeError(f"busy {holder}")).acquire()
    with durable.FolderLock(tmp_path, lambda holder: RuntimeError("busy")):
        pass


# -- the one private torch call ----------------------------------------------------------------


def test_the_private_determinism_switch_is_what_the_public_call_uses():
    """run.configure_determinism calls torch._C._set_deterministic_algorithms to avoid
    importing the compiler stack; this fails when torch stops implementing the public
    call through it, or changes its signature."""
    assert "_set_deterministic_algorithms(" in inspect.getsource(torch.use_deterministic_algorithms)
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    try:
        torch._C._set_deterministic_algorithms(True, warn_only=False)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch._C._set_deterministic_algorithms(before[0], warn_only=before[1])


# -- the public API ----------------------------------------------------------------------------


def test_public_api_resolves_every_name_and_the_publish_path_stays_torch_free():
    import subprocess
    import sys

    import pipeline

    assert all(getattr(pipeline, name) is not None for name in pipeline.__all__)
    code = (
        "import sys, pipeline; pipeline.publish; pipeline.audit_stage; "
        "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_resume_target_refuses_a_fresh_run_over_committed_checkpoints(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    assert store.resume_target("auto") is None and store.resume_target(None) is None
    (tmp_path / "ck" / "step-00000003").mkdir(parents=True)
    (tmp_path / "ck" / "step-00000003" / "meta.json").write_text("{}")
    assert store.resume_target("auto") == "latest" and store.resume_target("latest") == "latest"
    with pytest.raises(
        CheckpointError, match="already holds checkpoints up to step 3: continue with --resume latest"
    ):
        store.resume_target(None)


def test_a_resume_behind_newer_checkpoints_names_the_newest_and_a_failed_run_its_last(tmp_path):
    """Both name the newest committed step of several: the one a resume from latest continues."""
    from pipeline.config import load_config
    from pipeline.start import Launch, StartRequest, plan_start
    from pipeline.train import _where_to_go_on

    from support import REPO

    store = _save(tmp_path, [1, 2, 3])
    older = tmp_path / "step-00000001"
    with pytest.raises(CheckpointError) as caught:
        plan_start(
            store, load_config(REPO / "config.yaml"), "", StartRequest(resume=str(older)), Launch("none", 1)
        )
    assert str(caught.value) == (
        f"{tmp_path}/ holds step 3, newer than the resume point 1: resume from latest, or continue step 1 in "
        f"a new folder with --resume {older} --checkpoint-dir DIR"
    )
    assert _where_to_go_on(store, "python 02_train.py --resume latest") == (
        "the last committed checkpoint (step 3) is intact: fix it and resume with python 02_train.py --resume latest"
    )
    assert _where_to_go_on(store, None).endswith("(step 3) is intact: fix it and resume with --resume latest")
    assert _where_to_go_on(CheckpointStore(tmp_path / "none"), None) == (
        "no checkpoint was committed yet: fix it and run the same command again"
    )
