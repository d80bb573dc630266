"""Every special entry a handed-over folder can hold (a FIFO, a socket, a device, a link that
dangles, points inside or outside, a folder where a file is expected, a hard link, an empty
file), at the top and one level down, met by the readers and writers that take such a folder:
:class:`~pipeline.safe_read.HandedFolder`, :func:`~pipeline.durable.fsync_tree` and the lock
file of :class:`~pipeline.durable.FolderLock`. Each is refused in one line naming it, or read
as documented; none is waited on, followed or written through. In-process, on small folders.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pipeline.durable import FolderLock, fsync_tree
from pipeline.errors import FileChanged, LockRefused
from pipeline.safe_read import HandedFolder, Seen, read_own, read_regular

from support import a_socket


def _plant(path: Path, kind: str, outside: Path) -> None:
    {
        "fifo": os.mkfifo,
        "socket": a_socket,
        "device": lambda p: os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 3)),  # /dev/null's numbers
        "dangling-link": lambda p: p.symlink_to("nowhere"),
        "link-inside": lambda p: p.symlink_to("plain.txt"),
        "link-outside": lambda p: p.symlink_to(outside),
        "folder": os.mkdir,
    }[kind](path)


# What opening each one reports: a link is never followed, a FIFO never waited on.
OPENED = {
    "fifo": "now a FIFO, not a regular file",
    "socket": "now a socket",
    "device": "now a device, not a regular file",
    "dangling-link": "now a link",
    "link-inside": "now a link",
    "link-outside": "now a link",
    "folder": "now a folder, not a regular file",
}


@pytest.fixture
def handed(tmp_path) -> Path:
    folder = tmp_path / "handed"
    (folder / "sub").mkdir(parents=True)
    for where in (folder, folder / "sub"):
        (where / "plain.txt").write_bytes(b"plain bytes")
    (tmp_path / "outside.txt").write_bytes(b"private")
    return folder


@pytest.mark.parametrize("where", ["", "sub/"], ids=["top", "nested"])
@pytest.mark.parametrize("kind", sorted(OPENED))
def test_opening_a_special_entry_of_a_handed_folder_is_one_line_naming_it(handed, kind, where):
    _plant(handed / f"{where}x", kind, handed.parent / "outside.txt")
    with HandedFolder(handed) as folder:
        with pytest.raises(FileChanged) as refused:
            folder.open(f"{where}x")
    assert str(refused.value) == f"{handed}/{where}x changed while it was read ({OPENED[kind]})"
    assert (handed.parent / "outside.txt").read_bytes() == b"private"


@pytest.mark.parametrize("kind", ["dangling-link", "link-inside", "link-outside", "fifo"])
def test_a_subfolder_that_is_a_link_or_not_a_folder_is_never_gone_through(handed, kind):
    (handed / "other").mkdir()
    (handed / "other" / "plain.txt").write_bytes(b"other")
    _plant(handed / "via", kind, handed / "other")
    with HandedFolder(handed) as folder:
        with pytest.raises(FileChanged) as refused:
            folder.open("via/plain.txt")
        with pytest.raises(FileChanged) as listed:
            folder.lstat("via/plain.txt")
    assert (
        str(refused.value)
        == str(listed.value)
        == f"{handed}/via changed while it was read (now a link or not a folder)"
    )


def test_a_hard_link_and_an_empty_file_are_read_as_the_bytes_they_hold(handed):
    os.link(handed.parent / "outside.txt", handed / "sub" / "linked.txt")
    (handed / "empty.txt").write_bytes(b"")
    with HandedFolder(handed) as folder:
        seen = Seen.of(folder.lstat("sub/linked.txt"))
        with folder.open("sub/linked.txt", seen=seen) as linked, folder.open("empty.txt") as empty:
            assert (linked.read(), empty.read(), seen.links, seen.size) == (b"private", b"", 2, 7)


def test_a_survey_seen_file_that_is_gone_or_another_is_named_as_such(handed):
    keep = os.open(handed / "plain.txt", os.O_RDONLY)  # its inode stays taken, never reused
    with HandedFolder(handed) as folder:
        seen = Seen.of(folder.lstat("plain.txt"))
        (handed / "plain.txt").unlink()
        with pytest.raises(FileChanged) as gone:
            folder.open("plain.txt", seen=seen)
        with pytest.raises(FileNotFoundError):
            folder.open("plain.txt")  # nothing surveyed: missing is missing
        (handed / "new.txt").write_bytes(b"plain bytes")  # made while the old inode is held: another
        os.rename(handed / "new.txt", handed / "plain.txt")
        with pytest.raises(FileChanged) as other:
            folder.open("plain.txt", seen=seen)
    os.close(keep)
    assert str(gone.value) == f"{handed}/plain.txt changed while it was read (gone)"
    assert str(other.value) == f"{handed}/plain.txt changed while it was read (now another file)"


def test_fsync_tree_passes_every_special_entry_at_the_top_and_nested_and_changes_nothing(handed):
    """Another tool's folder made durable as it is: a FIFO is not waited on, a socket not
    opened, a link (dangling, inside, outside) not followed, a device not synced."""
    for where in (handed, handed / "sub"):
        for kind in sorted(OPENED):
            if kind != "folder":
                _plant(where / kind, kind, handed.parent / "outside.txt")
    before = sorted((p.relative_to(handed), p.lstat().st_mode, p.lstat().st_ino) for p in handed.rglob("*"))
    assert fsync_tree(handed) is None
    after = sorted((p.relative_to(handed), p.lstat().st_mode, p.lstat().st_ino) for p in handed.rglob("*"))
    assert after == before and (handed.parent / "outside.txt").read_bytes() == b"private"


def test_a_walk_goes_depth_first_in_name_order_at_every_level(handed):
    """Names made out of order, at the top and one level down: each folder's entries come in
    name order, a folder's own entries right after it."""
    for where in (handed, handed / "sub"):
        for name in ("m.txt", "b.txt", "z.txt", "a.txt", "q.txt", "c.txt"):
            (where / name).write_bytes(b"")
    with HandedFolder(handed) as folder:
        walked = [name for name, _ in folder.walk()]
    names = ["a.txt", "b.txt", "c.txt", "m.txt", "plain.txt", "q.txt"]
    assert walked == [*names, "sub", *(f"sub/{name}" for name in [*names, "z.txt"]), "z.txt"]


def test_a_link_is_read_through_when_the_user_named_it_and_refused_when_the_pipeline_wrote_it(handed):
    link = handed / "named.txt"
    link.symlink_to(handed / "plain.txt")
    assert read_regular(link, 64) == b"plain bytes"
    with pytest.raises(ValueError) as refused:
        read_own(link, 64)
    assert str(refused.value) == "is a symbolic link"


def busy(holder: str) -> Exception:
    return RuntimeError(f"held by {holder}")


@pytest.mark.parametrize(
    "kind, what",
    [
        ("socket", "is not a regular file"),
        ("device", "is not a regular file (a FIFO or device)"),
        ("dangling-link", "is a link"),
        ("link-outside", "is a link"),
    ],
)
def test_a_lock_file_planted_as_a_socket_device_or_link_is_refused_in_one_line_and_left_as_it_was(
    handed, kind, what
):
    lock = handed / ".lock"
    _plant(lock, kind, handed.parent / "outside.txt")
    before = lock.lstat()
    with pytest.raises(LockRefused) as refused:
        FolderLock(lock, busy).acquire()
    assert str(refused.value) == (
        f"{lock} {what}: a lock file is never written through, so nothing was touched; if it is not yours, "
        "remove it (rm) and run again, else use another folder"
    )
    after = lock.lstat()
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    assert (handed.parent / "outside.txt").read_bytes() == b"private" and not (handed / "nowhere").exists()
