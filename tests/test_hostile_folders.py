"""Folders a user hands over, attacked for real: a file swapped between the survey and the read
(for a link to a private file, a FIFO, a device that never ends, another file), lock files
planted as links, names that carry Markdown and HTML, and a stop in the middle of staging.

The swaps land deterministically: ``tests/helpers/swapped_stage.py`` wraps the survey from the
test's side and swaps the file on the real file system once the survey has returned; the
stage runs in a process of its own, so a read that would block or never end is a timeout here,
not a hung suite.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import stat
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pipeline.durable import FolderLock
from pipeline.errors import FileChanged, InternalError, LockRefused, PipelineError, StageError
from pipeline.safe_read import HandedFolder, Seen, read_own, read_regular
from pipeline.stage.from_folder import FolderStage, folder_config, stage_folder

from support import HELPERS, one_line_error, run_python, run_script, script_env, start_script

# A name that, unescaped, becomes a heading of the card and an HTML element with a handler.
HOSTILE = "x\n\n## Verified by Hugging Face <img src=x onerror=alert(1)>"
PRIVATE_MARK = "private-notes-of-the-user"
# A tensor name may hold any printable ASCII (the header parser refuses the rest).
TENSOR = "## Verified `<img src=x onerror=alert(3)>`|x"


def tiny_folder(folder: Path, *, tensors: dict | None = None) -> Path:
    """A folder another tool wrote: safetensors weights, config.json and a tokenizer file."""
    folder.mkdir(parents=True)
    torch.manual_seed(0)
    save_file(
        tensors or {"layer.weight": torch.randn(4, 4), "layer.bias": torch.zeros(4)},
        folder / "model.safetensors",
    )
    (folder / "config.json").write_text(json.dumps({"width": 4}))
    (folder / "tokenizer.json").write_text(json.dumps({"vocab": {"hello": 0, "world": 1}}))
    return folder


def stage(folder: Path, target: Path, **options):
    return stage_folder(folder_config({}), FolderStage(folder=folder, stage_dir=target, **options))


def private_file(tmp_path: Path) -> Path:
    private = tmp_path / "home" / "notes.json"
    private.parent.mkdir()
    private.write_text(json.dumps({"note": PRIVATE_MARK}))
    return private


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith((".tmp-", ".scratch-", ".old-")))


# -- a file swapped between the survey and the read -------------------------------------------------

SWAPS = [
    pytest.param("tokenizer.json", "link", "now a link", id="tokenizer-to-a-link"),
    pytest.param("model.safetensors", "link", "now a link", id="weights-to-a-link"),
    pytest.param("tokenizer.json", "fifo", "now a FIFO, not a regular file", id="tokenizer-to-a-fifo"),
    pytest.param("model.safetensors", "fifo", "now a FIFO, not a regular file", id="weights-to-a-fifo"),
    pytest.param("config.json", "device", "now a device, not a regular file", id="config-to-dev-zero"),
    pytest.param("model.safetensors", "device", "now a device, not a regular file", id="weights-to-dev-zero"),
    pytest.param("tokenizer.json", "other", "now another file", id="tokenizer-to-another-file"),
    pytest.param("config.json", "grown", "now 19 bytes, not the 12 surveyed", id="config-appended-to"),
    pytest.param(".", "folder", "now another folder", id="folder-replaced-by-a-copy"),
]


@pytest.mark.parametrize(("name", "kind", "reason"), SWAPS)
def test_a_file_swapped_after_the_survey_is_refused_in_one_line_never_followed_or_waited_on(
    tmp_path, name, kind, reason
):
    if kind == "device" and os.geteuid() != 0:
        pytest.skip("making a device node needs root (CI runs as root)")
    folder = tiny_folder(tmp_path / "model")
    private = private_file(tmp_path)
    target = tmp_path / "stage"
    result = run_python(
        [HELPERS / "swapped_stage.py", folder, target, name, kind, private],
        cwd=tmp_path,
        env=script_env(),
        timeout=60,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line_error(result)
    assert line == (
        f"error: {folder / name} changed while it was staged ({reason}): is another program writing the "
        "folder? Nothing was staged"
    ), line
    assert not target.exists() and leftovers(tmp_path) == []
    assert private.read_text() == json.dumps({"note": PRIVATE_MARK})
    staged_nowhere = [
        p
        for p in tmp_path.rglob("*")
        if p.is_file() and not p.is_symlink() and PRIVATE_MARK.encode() in p.read_bytes()
    ]
    assert staged_nowhere == [private]


def test_a_read_stops_at_the_size_the_descriptor_showed_and_notices_growth_or_shrinking(tmp_path):
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a.bin").write_bytes(b"a" * 1000)
    with HandedFolder(folder) as handed:
        seen = Seen.of(handed.lstat("sub/a.bin"))
        with handed.open("sub/a.bin", seen=seen) as file:
            with open(folder / "sub" / "a.bin", "ab") as grow:
                grow.write(b"more")
            with pytest.raises(FileChanged, match="grew past 1,000 bytes while read"):
                file.read()
        with handed.open("sub/a.bin") as file:
            os.truncate(folder / "sub" / "a.bin", 10)
            with pytest.raises(FileChanged, match="shrank to 10 bytes while read"):
                file.read()
        # Cut short between the survey and the open: refused at the open, as a grown file is.
        with pytest.raises(FileChanged) as shrunk:
            handed.open("sub/a.bin", seen=seen)
        assert (
            str(shrunk.value)
            == f"{folder / 'sub' / 'a.bin'} changed while it was read (now 10 bytes, not the 1,000 surveyed)"
        )
        # A folder on the way swapped for a link to one outside: never followed.
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "a.bin").write_bytes(b"secret")
        (folder / "sub").rename(tmp_path / "moved")
        (folder / "sub").symlink_to(outside)
        with pytest.raises(
            FileChanged, match=r"sub changed while it was read \(now a link or not a folder\)"
        ):
            handed.open("sub/a.bin")
    # A file whose size fstat does not tell (procfs says 0 bytes) is read as one that grew.
    status = "/proc/self/status"
    with pytest.raises(FileChanged) as grew:
        read_regular(status, 1 << 20)
    assert str(grew.value) == f"{status} changed while it was read (grew past 0 bytes while read)"
    with pytest.raises(ValueError) as refused:
        read_own(status, 1 << 20)
    assert str(refused.value) == "grew past 0 bytes while read"


def socket_at(path: Path, monkeypatch) -> Path:
    """A Unix socket's file at ``path``, bound by its short name (a long tmp path would pass
    AF_UNIX's 107 bytes); the file stays once the socket is closed."""
    monkeypatch.chdir(path.parent)
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path.name)
    return path


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_name_opened_from_the_folder_is_refused_for_what_it_is_and_no_descriptor_is_left_open(
    tmp_path, monkeypatch
):
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a.bin").write_bytes(b"a")
    socket_at(folder / "sock", monkeypatch)
    before = open_fds()
    with HandedFolder(folder) as handed:
        with pytest.raises(FileChanged) as changed:
            handed.open("sock")
        assert str(changed.value) == f"{folder / 'sock'} changed while it was read (now a socket)"
        # Missing, and no survey saw it: the open's own error, for the caller to word; a
        # folder on the way missing, once the one before it was opened, too.
        for missing in ("sub/b.bin", "sub/gone/a.bin", "gone/a.bin"):
            with pytest.raises(FileNotFoundError):
                handed.open(missing)
        for name in ("", ".", "..", "../x", "sub/../../x", "sub//a.bin", "./sub/a.bin", "sub/"):
            with pytest.raises(InternalError) as refused:
                handed.lstat(name)
            assert str(refused.value) == f"{name!r} is not a relative path inside a folder"
        with handed.open("sub/a.bin") as file:
            assert file.read() == b"a"
            file.close()  # and once more on leaving the with: harmless
    handed.close()  # after its with: harmless
    assert (file.fd, handed.fd, open_fds()) == (-1, -1, before)


def test_a_surveyed_folder_swapped_for_a_link_or_a_file_is_changed_and_an_unsurveyed_one_fails_its_open(
    tmp_path,
):
    folder = tmp_path / "model"
    folder.mkdir()
    seen = Seen.of(os.lstat(folder))
    folder.rename(tmp_path / "moved")
    folder.symlink_to(tmp_path / "moved")
    for swap in ("link", "file"):  # O_DIRECTORY|O_NOFOLLOW fails both with ENOTDIR
        with pytest.raises(FileChanged) as changed:
            HandedFolder(folder, seen=seen)
        assert str(changed.value) == f"{folder} changed while it was read (now a link or not a folder)", swap
        with pytest.raises(OSError) as failed:
            HandedFolder(folder)
        assert (failed.value.errno, failed.value.filename) == (errno.ENOTDIR, str(folder)), swap
        folder.unlink()
        folder.write_text("not a folder")
    folder.unlink()
    with pytest.raises(FileNotFoundError):  # gone: the open's own error, surveyed or not
        HandedFolder(folder, seen=seen)


@pytest.mark.parametrize(
    ("swap", "reason"),
    [("link", "now a link or not a folder"), ("folder", "now another folder"), ("gone", None)],
)
def test_a_walk_passes_over_a_file_gone_since_listed_and_refuses_a_folder_swapped_before_it_is_entered(
    tmp_path, swap, reason
):
    """The walk yields each entry before it enters it: the swaps land between the two looks."""
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    for name in ("a.txt", "b.txt", "sub/c.txt"):
        (folder / name).write_text(name)
    before = open_fds()
    with HandedFolder(folder) as handed:
        walk = handed.walk()
        assert next(walk)[0] == "a.txt"
        (folder / "b.txt").unlink()  # listed, gone before its lstat: as if never there
        name, info = next(walk)
        assert name == "sub" and stat.S_ISDIR(info.st_mode)
        (folder / "sub").rename(tmp_path / "moved")
        if swap == "link":
            (folder / "sub").symlink_to(tmp_path / "moved")
        elif swap == "folder":
            (folder / "sub").mkdir()
        if reason is None:
            with pytest.raises(FileNotFoundError):
                next(walk)
        else:
            with pytest.raises(FileChanged) as changed:
                next(walk)
            assert str(changed.value) == f"{folder / 'sub'} changed while it was read ({reason})"
    assert open_fds() == before


# -- locks never write through a link ------------------------------------------------------------------


def busy(holder: str) -> PipelineError:
    return PipelineError(f"busy {holder}")


def test_a_lock_file_planted_as_a_link_fifo_hard_link_or_foreign_file_is_refused_and_left_as_it_was(
    tmp_path, monkeypatch
):
    precious = tmp_path / "precious.txt"
    precious.write_text("a month of notes\n")
    lock = tmp_path / "run" / ".lock"
    lock.parent.mkdir()
    lock.symlink_to(precious)
    with pytest.raises(LockRefused, match=r"\.lock is a link: a lock file is never written through"):
        FolderLock(lock, busy).acquire()
    lock.unlink()
    os.mkfifo(lock)
    with pytest.raises(LockRefused, match=r"\.lock is not a regular file \(a FIFO or device\)"):
        FolderLock(lock, busy).acquire()
    lock.unlink()
    socket_at(lock, monkeypatch)
    with pytest.raises(LockRefused) as refused:
        FolderLock(lock, busy).acquire()
    assert str(refused.value) == (
        f"{lock} is not a regular file: a lock file is never written through, so nothing was touched; if it is "
        "not yours, remove it (rm) and run again, else use another folder"
    )
    lock.unlink()
    os.link(precious, lock)
    with pytest.raises(LockRefused, match=r"\.lock has 2 names \(hard links\)"):
        FolderLock(lock, busy).acquire()
    lock.unlink()
    lock.write_text("not a pid\n")
    with pytest.raises(LockRefused, match=r"\.lock holds something else than the process id"):
        FolderLock(lock, busy).acquire()
    assert lock.read_text() == "not a pid\n" and precious.read_text() == "a month of notes\n"
    # What an earlier holder left, shorter or longer than this pid (20 digits: the most a lock
    # file holds): taken over, and a second taker is told this pid, not what is left of the old one.
    for stale in ("123", "9" * 20):
        lock.write_text(stale)
        with FolderLock(lock, busy):
            assert lock.read_text() == str(os.getpid())
            with pytest.raises(PipelineError) as taken:
                FolderLock(lock, busy).acquire()
            assert str(taken.value) == f"busy {os.getpid()}"
    lock.unlink()
    with FolderLock(lock, busy):  # created: ours
        assert lock.read_text() == str(os.getpid())


def test_02_05_and_06_dry_run_refuse_a_lock_linked_to_a_users_file_and_leave_it_unchanged(
    trained_run, tmp_path
):
    precious = tmp_path / "precious.txt"
    precious.write_text("a month of notes\n")
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / ".lock").symlink_to(precious)
    line = trained_run.refused(
        "02_train.py", "--quiet", "--set", "training.max_steps=1", "--checkpoint-dir", str(checkpoints)
    )
    assert f"{checkpoints / '.lock'} is a link" in line, line
    folder = tiny_folder(tmp_path / "model")
    target = tmp_path / "stage"
    stage(folder, target)
    (tmp_path / ".stage.lock").unlink()
    (tmp_path / ".stage.lock").symlink_to(precious)
    staged = run_script("05_stage.py", "--from-folder", str(folder), "--stage", str(target), cwd=tmp_path)
    assert staged.returncode == 2 and f"{tmp_path / '.stage.lock'} is a link" in one_line_error(staged)
    published = run_script(
        "06_publish.py",
        "--stage",
        str(target),
        "--repo-id",
        "x/y",
        "--dry-run",
        "--endpoint",
        "http://127.0.0.1:9",
        cwd=tmp_path,
    )
    assert published.returncode == 2 and f"{tmp_path / '.stage.lock'} is a link" in one_line_error(published)
    assert precious.read_text() == "a month of notes\n"


# -- names are data --------------------------------------------------------------------------------


def rendered(markdown: str) -> str:
    markdown_it = pytest.importorskip("markdown_it")
    # As a Hub page renders a card: CommonMark with tables, raw HTML let through.
    return markdown_it.MarkdownIt("commonmark", {"html": True}).enable("table").render(markdown)


def test_a_hostile_name_in_the_folder_is_inert_text_in_the_card_and_messages(tmp_path):
    folder = tiny_folder(
        tmp_path / HOSTILE.replace("/", "_"),
        tensors={"layer.weight": torch.randn(2, 2), TENSOR: torch.tensor([float("nan")])},
    )
    (folder / HOSTILE).write_text("left out")
    (folder / "a|b`c.txt").write_text("left out")
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"<img src=x onerror=alert(2)>": 0.5}))
    target = tmp_path / "stage"
    result = stage(folder, target, metrics=metrics, allow_nonfinite=True)
    card = (target / "README.md").read_text(encoding="utf-8")
    body = card.split("\n---\n", 1)[1]
    assert "Verified by Hugging Face" in body  # shown, as text
    html = rendered(body)
    assert "<img" not in html and "Verified by Hugging Face</h2>" not in html
    assert not any(line.startswith("## Verified") for line in body.splitlines())
    shown_name = "`x\\x0a\\x0a## Verified by Hugging Face <img src=x onerror=alert(1)>`"
    # Its title and front matter name the model as a repository would be named; the folder's own
    # name is shown as it is, inert, where the card says where the files came from.
    assert body.startswith("\n# x-Verified-by-Hugging-Face-img-src-x-onerror-alert-1\n")
    assert f"Staged from the folder {shown_name}." in body
    # A table bar or a backtick cannot end a table cell or a code span either.
    assert f"Left out, never opened: `a\\x7cb\\x60c.txt`, {shown_name}. " in body
    assert "`## Verified \\x60<img src=x onerror=alert(3)>\\x60\\x7cx`" in body  # the NaN tensor's warning
    assert all("\n" not in row.name for row in result.report)
    (folder / "model.safetensors").unlink()
    (folder / f"{HOSTILE}.bin").write_bytes(b"\x80\x04N.")  # a pickle named to inject
    with pytest.raises(StageError) as refused:
        stage(folder, tmp_path / "other")
    assert "\n" not in str(refused.value) and "x\\x0a\\x0a## Verified" in str(refused.value)


# -- a stop while staging a large folder -------------------------------------------------------------


def large_folder(folder: Path, size: int) -> Path:
    """A safetensors file of one ``size``-byte float32 tensor of zeros, sparse on disk."""
    folder.mkdir()
    header = json.dumps({"big": {"dtype": "F32", "shape": [size // 4], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(folder / "model.safetensors", "wb") as out:
        out.write(struct.pack("<Q", len(header)) + header)
        out.truncate(8 + len(header) + size)
    (folder / "config.json").write_text("{}")
    return folder


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_in_the_middle_of_staging_leaves_no_scratch_copy_and_ends_in_one_line(tmp_path, signum):
    folder = large_folder(tmp_path / "model", 256 * 1024 * 1024)
    target = tmp_path / "stage"
    running = start_script("05_stage.py", "--from-folder", str(folder), "--stage", str(target), cwd=tmp_path)
    deadline = time.monotonic() + 120
    copying = None
    while copying is None and time.monotonic() < deadline:
        copying = next(
            (p for p in tmp_path.glob(".scratch-stage-weights-*/model.safetensors") if p.stat().st_size), None
        )
        time.sleep(0.002)
    assert copying is not None, "the weights were never copied"
    os.kill(running.pid, signum)
    result = running.wait(timeout=120)
    name = signal.Signals(signum).name
    assert result.returncode == 128 + signum, result.stdout + result.stderr
    assert (
        one_line_error(result)
        == f"error: stopped by {name}; what was being staged was removed; an earlier stage is as it was"
    )
    assert not target.exists() and leftovers(tmp_path) == []
