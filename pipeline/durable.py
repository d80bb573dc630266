"""Durable writes, in one place: atomic folders, the JSON writer (and the time its records
state, :func:`utc_now`), and the folder lock.

Every folder the pipeline publishes to the user (a checkpoint ``step-…/``, the prepared
``data/``, the ``hub_stage/``) is built by :func:`atomic_folder`, modelled on Orbax's
``path/atomicity.py``:

1. ``mkdir``       a temporary folder beside the destination (``.tmp-<name>-<hex>``);
2. the caller fills it;
3. ``fsync_file``  every file in it (unless the caller's writers already did), then
   ``fsync_temp`` the folder itself;
4. ``move_aside``  an existing destination to ``.old-<name>-<hex>``, only when the caller's
   ``owned`` check proves we built it (a checkpoint's meta.json schema, a stage's manifest);
5. ``rename``      the temporary folder into place;
6. ``fsync_parent`` so the rename survives a power cut;
7. ``remove_old``  the moved-aside folder.

A SIGTERM or SIGINT that a script turns into an exception (:mod:`pipeline.stops`) waits from
step 4 to step 7: it is raised once the new folder is in place and the old one gone, saying so.

Each OS call goes through :func:`step` under one of the names in :data:`STEPS`, so a
crash-point test can fail the protocol at each named step. :func:`recover` undoes what a
crash between steps left behind.

Every ``flock`` of the pipeline is taken on a descriptor opened by :func:`open_lock_fd` and
closed by :func:`close_lock_fd`: a child forked while it is open (a DataLoader worker)
closes its copy at once, so the lock stays with the process that took it and dies with it.
Torch-free.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import glob
import json
import math
import os
import re
import secrets
import shutil
import stat
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

from . import stops
from .errors import FileChanged, InternalError, LockRefused, naming, shown
from .hashing import HashingWriter
from .safe_read import HandedFolder

__all__ = [
    "STEPS",
    "step",
    "naming",
    "fsync_dir",
    "fsync_tree",
    "remove_tree",
    "atomic_folder",
    "recover",
    "scratch_folder",
    "lock_folder",
    "open_lock_fd",
    "close_lock_fd",
    "json_bytes",
    "json_loads_strict",
    "utc_now",
    "write_json_atomic",
    "write_atomic",
    "FolderLock",
]

STEPS = ("mkdir", "fsync_file", "fsync_temp", "move_aside", "rename", "fsync_parent", "remove_old")
TEMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
_SUFFIX_HEX = 8  # secrets.token_hex(4)


def step(name: str, call: Callable[..., Any], *args: Any) -> Any:
    """Run one named step of the atomic-folder protocol (``name`` is one of :data:`STEPS`)."""
    if name not in STEPS:
        raise InternalError(f"unknown atomic-folder step {name!r}")
    return call(*args)


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with naming(path):
            os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        with naming(path):
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Make a folder another tool wrote durable, as it is: every regular file under it, then
    every folder deepest first, then ``folder`` itself and its parent. Links and special
    files are not followed nor synced (each file is opened ``O_NOFOLLOW|O_NONBLOCK``). The
    folder is walked as handed over (:meth:`~pipeline.safe_read.HandedFolder.walk`: no link
    entered, no recursion; one nested deeper than any model folder raises FolderTooDeep)."""
    folder = Path(folder)
    with HandedFolder(folder) as handed:
        entries = list(handed.walk())
    for name, info in reversed(entries):  # every entry before the folder that holds it
        path = folder / name
        if stat.S_ISDIR(info.st_mode):
            fsync_dir(path)
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):
                continue  # a link or a socket: nothing of ours to sync
            raise
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                with naming(path):
                    os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(folder)
    fsync_dir(folder.parent)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: Path) -> None:
    """Remove the folder ``path`` and everything under it, as ``shutil.rmtree`` does, without
    recursion (Python 3.11's recurses once per level: a folder nested a thousand deep raised
    RecursionError) and on one descriptor: it goes down into each folder, never through a
    link, and back up through ``..``, checked to be the folder it came from (else
    :class:`~pipeline.errors.FileChanged`, and nothing outside is touched)."""
    path = Path(path)
    fd = os.open(path, _DIR_FLAGS)
    way: list[tuple[str, tuple[int, int]]] = []  # each folder entered: its name, its parent's identity
    try:
        while True:
            inner = None
            for name in os.listdir(fd):
                try:
                    if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                        inner = inner or name
                    else:
                        os.unlink(name, dir_fd=fd)
                except FileNotFoundError:
                    continue  # gone meanwhile
            if inner is not None:
                here = os.fstat(fd)
                child = os.open(inner, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
                way.append((inner, (here.st_dev, here.st_ino)))
                continue
            if not way:
                break
            name, identity = way.pop()
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            info = os.fstat(fd)
            if (info.st_dev, info.st_ino) != identity:
                raise FileChanged(path, "moved while it was removed")
            os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)


def _sibling(dest: Path, prefix: str) -> Path:
    return dest.parent / f"{prefix}{dest.name}-{secrets.token_hex(4)}"


@contextlib.contextmanager
def atomic_folder(
    dest: str | Path, *, owned: Callable[[Path], bool] | None = None, files_synced: bool = False
) -> Iterator[Path]:
    """Yield an empty temporary folder; on a clean exit, commit it as ``dest`` atomically.

    ``dest`` must not exist, unless ``owned(dest)`` is true: then it is replaced (moved
    aside, the new folder renamed in, the old one deleted). Anything else raises
    ``FileExistsError`` and nothing is touched, so a folder we did not build is never
    deleted. On an exception the temporary folder is removed and ``dest`` is unchanged.
    ``files_synced``: the caller wrote every file through a writer that fsyncs on close
    (``HashingWriter``, ``write_safetensors``), so step 3 syncs only the folder; the
    checkpoint store uses it, as a save sits on the training path.
    """
    dest = Path(os.path.abspath(dest))
    temporary = _sibling(dest, TEMP_PREFIX)
    step("mkdir", os.mkdir, temporary)
    try:
        yield temporary
        # Deepest first: a file, then the folder that names it, up to the temporary folder.
        for entry in sorted(temporary.rglob("*"), key=lambda path: len(path.parts), reverse=True):
            if entry.is_symlink():
                continue
            if entry.is_file() and not files_synced:
                step("fsync_file", _fsync_file, entry)
            elif entry.is_dir():
                step("fsync_temp", fsync_dir, entry)
        step("fsync_temp", fsync_dir, temporary)
        # From the move aside to the old folder's removal, a stop waits (stops.held): cut in
        # between, it would leave the old folder beside the new one, or put it back over it.
        with stops.held() as hold:
            previous = None
            if os.path.lexists(dest):
                if owned is None or not owned(dest):
                    raise FileExistsError(
                        errno.EEXIST, "exists and was not built by this pipeline", str(dest)
                    )
                previous = _sibling(dest, OLD_PREFIX)
                step("move_aside", os.rename, dest, previous)
            try:
                step("rename", os.rename, temporary, dest)
            except BaseException:
                if previous is not None:
                    os.rename(previous, dest)
                raise
            hold.committed = True
            step("fsync_parent", fsync_dir, dest.parent)
            if previous is not None:
                step("remove_old", shutil.rmtree, previous)
    except BaseException as exc:
        shutil.rmtree(temporary, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno is not None and not exc.filename:
            exc.filename = str(temporary)  # a write through a descriptor names no path: name the folder
        raise


def recover(dest: str | Path) -> list[Path]:
    """Undo a crash of :func:`atomic_folder` for ``dest``: drop its temporary folders, and
    if the crash came between ``move_aside`` and ``rename``, put the previous folder back.
    Call it while holding the lock that serializes writers of ``dest``."""
    dest = Path(os.path.abspath(dest))
    removed = []
    if not dest.parent.is_dir():
        return removed
    for prefix in (TEMP_PREFIX, OLD_PREFIX):
        # Only the exact names _sibling gives: a user's ".tmp-<name>-notes" is not ours.
        ours = re.compile(re.escape(f"{prefix}{dest.name}-") + f"[0-9a-f]{{{_SUFFIX_HEX}}}")
        for entry in sorted(dest.parent.iterdir()):
            if not (ours.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink()):
                continue
            if prefix == OLD_PREFIX and not os.path.lexists(dest):
                os.rename(entry, dest)
            else:
                shutil.rmtree(entry)
            removed.append(entry)
    if removed:
        fsync_dir(dest.parent)
    return removed


SCRATCH_PREFIX = ".scratch-"
# New scratch folders tried when each is swept away by another process before we lock it.
_SCRATCH_ATTEMPTS = 5


@contextlib.contextmanager
def scratch_folder(parent: str | Path, role: str) -> Iterator[Path]:
    """A private working folder ``parent/.scratch-<role>-<hex>`` (mode 0700), removed on exit, and locked
    (``flock``) while it is in use. The scratch folders of ``role`` that a killed process left
    behind (nobody holds their lock) are removed first, so a SIGKILL never leaves a copy of
    the weights behind for good; those of a run still going are left alone."""
    parent = Path(os.path.abspath(parent))
    ours = re.compile(re.escape(f"{SCRATCH_PREFIX}{role}-") + f"[0-9a-f]{{{_SUFFIX_HEX}}}")
    for entry in sorted(parent.iterdir()) if parent.is_dir() else []:
        if ours.fullmatch(entry.name) and not entry.is_symlink():
            fd = lock_folder(entry)
            if fd is not None:  # nobody holds it: its process is gone
                try:
                    shutil.rmtree(entry)
                except FileNotFoundError:
                    pass  # removed meanwhile by another sweeper
                finally:
                    close_lock_fd(fd)
    # Between our mkdir and our flock another process's sweep may take the new folder for a
    # dead one and remove it: keep a folder only if it is still there, locked by us.
    for _ in range(_SCRATCH_ATTEMPTS):
        folder = parent / f"{SCRATCH_PREFIX}{role}-{secrets.token_hex(_SUFFIX_HEX // 2)}"
        step("mkdir", os.mkdir, folder, 0o700)  # its owner's alone: it holds copies of private weights
        fd = lock_folder(folder)
        if fd is not None:
            break
    else:
        raise InternalError(f"{parent}/: every new scratch folder was removed by another process's sweep")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        close_lock_fd(fd)


# Descriptors that hold (or are about to take) a flock in this process. A forked child shares
# the parent's open file descriptions, and a flock belongs to the description, not the process:
# DataLoader workers forked by a trainer would keep its checkpoint folder locked after a
# SIGKILL until they exit (seconds, or never for a worker stuck in a sample), and the resume
# that follows would be refused. Each child closes its copies as it starts; the guard keeps a
# fork from landing between an open and its registration.
_LOCK_FDS: set[int] = set()
_LOCK_FDS_GUARD = threading.Lock()


def _close_lock_fds_in_child() -> None:
    global _LOCK_FDS_GUARD
    for fd in _LOCK_FDS:
        try:
            os.close(fd)  # the parent's lock stays: its own descriptor still refers to it
        except OSError:
            pass
    _LOCK_FDS.clear()
    _LOCK_FDS_GUARD = threading.Lock()  # held by the forking thread, which the child does not have


os.register_at_fork(
    before=lambda: _LOCK_FDS_GUARD.acquire(),
    after_in_parent=lambda: _LOCK_FDS_GUARD.release(),
    after_in_child=_close_lock_fds_in_child,
)


def open_lock_fd(path: str | Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` of a file or folder whose descriptor will hold a ``flock``; close it with
    :func:`close_lock_fd`. Children forked while it is open do not keep it."""
    with _LOCK_FDS_GUARD:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), mode)
        _LOCK_FDS.add(fd)
    return fd


def close_lock_fd(fd: int) -> None:
    """Close a descriptor from :func:`open_lock_fd`, releasing its lock."""
    with _LOCK_FDS_GUARD:
        _LOCK_FDS.discard(fd)
        os.close(fd)


def lock_folder(folder: Path) -> int | None:
    """An open descriptor of ``folder`` holding its exclusive ``flock`` (release it with
    :func:`close_lock_fd`), or ``None`` when someone else holds it, or the folder is gone or
    is not the one at that path any more."""
    try:
        fd = open_lock_fd(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):  # gone, or replaced by a file or a link
            return None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(folder, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
            return fd
    except (BlockingIOError, FileNotFoundError):
        pass
    close_lock_fd(fd)
    return None


def _refuse_nonfinite(value: Any, where: str = "") -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(
            f"refusing to write {value} at {where or 'the top level'}: JSON has no NaN or infinity"
        )
    if isinstance(value, dict):
        for key, item in value.items():
            _refuse_nonfinite(item, f"{where}/{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _refuse_nonfinite(item, f"{where}/{index}")


def json_bytes(payload: Any, *, allow_nan: bool = False) -> bytes:
    """The one JSON encoding of the project: sorted keys, one-space indent, a final newline.

    Strict by default: a NaN or infinity raises ``ValueError`` naming where it is. Only
    the training-state formats (checkpoint meta.json, proof records), which must round-trip
    Python floats such as a scheduler's ``best = inf`` exactly, pass ``allow_nan=True``.
    """
    if not allow_nan:
        _refuse_nonfinite(payload)
    return (json.dumps(payload, indent=1, sort_keys=True, allow_nan=allow_nan) + "\n").encode("utf-8")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} appears twice in one object")
        seen.add(key)
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def json_loads_strict(data: bytes) -> Any:
    """The one strict JSON reader, for files that may be hostile: UTF-8 only, no key twice
    in one object (compared after decoding escapes, so ``"a"`` and ``"\\u0061"`` collide),
    no NaN or Infinity. Nesting deeper than the interpreter's recursion limit is refused.
    Raises ``ValueError`` saying which rule failed."""
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None


def utc_now() -> str:
    """The time a record is written, as every record states it: ISO 8601 in UTC, to the second
    (``2026-01-31T12:00:00+00:00``)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_json_atomic(path: str | Path, payload: Any, *, allow_nan: bool = False) -> None:
    """Write JSON beside ``path``, fsync, rename over it, fsync the folder (:func:`write_atomic`)."""
    write_atomic(path, json_bytes(payload, allow_nan=allow_nan))


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` beside ``path``, fsync, rename over it, fsync the folder. Temporaries of
    ``path`` left by a crash are removed first."""
    path = Path(path)
    # A crash before the rename leaves a hidden temporary of this very file: drop it now. Only the
    # names made below (eight hex digits): a user's ".meta.json.old.tmp" beside it is not ours.
    for stale in path.parent.glob(f".{glob.escape(path.name)}.{'[0-9a-f]' * 8}.tmp"):
        stale.unlink(missing_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with HashingWriter(temporary) as out:
            out.write(data)
        os.replace(temporary, path)
    except OSError as exc:
        if exc.filename in (None, str(temporary)):  # the user knows the file, not our temporary
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise
    finally:
        # Only if it was made: on a read-only file system even unlinking a missing file fails,
        # and that error would hide the one that says what happened, naming our temporary.
        if os.path.lexists(temporary):
            temporary.unlink()
    fsync_dir(path.parent)


# The most a lock file holds: the decimal pid this class writes (Linux's pid_max is 2**22).
_PID_BYTES = 20


class FolderLock:
    """An exclusive, non-blocking ``flock`` on ``path`` (a lock file, created if needed, or
    a folder). The kernel drops it when the process dies, even by SIGKILL, so no lock is
    ever stale. ``busy(holder)`` builds the error raised when someone else holds it;
    ``holder`` is the pid recorded in a lock file, or ``"unknown"``.

    The lock file's name is someone's to plant: a link there to a user's file, a FIFO, a
    device, a hard link or a file of other content is refused (:class:`LockRefused`), never
    written through; only an empty file or one holding a pid is ever truncated."""

    def __init__(self, path: str | Path, busy: Callable[[str], Exception]) -> None:
        self.path = Path(path)
        self.busy = busy
        self._fd: int | None = None
        self._pid = 0

    def _refused(self, what: str) -> LockRefused:
        return LockRefused(
            f"{shown(self.path)} {what}: a lock file is never written through, so nothing was touched; "
            "if it is not yours, remove it (rm) and run again, else use another folder"
        )

    def _open(self) -> tuple[int, bool]:
        """(descriptor, is a folder). A lock file is opened without following a link and
        checked on its descriptor before a byte is written: a regular file with no other
        name (hard link), holding nothing or a pid (what this class writes)."""
        try:
            folder = stat.S_ISDIR(os.lstat(self.path).st_mode)
        except FileNotFoundError:
            folder = False
        if folder:
            return open_lock_fd(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW), True
        try:
            fd = open_lock_fd(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._refused("is a link") from None
            if exc.errno in (errno.ENXIO, errno.EISDIR):
                raise self._refused("is not a regular file") from None
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise self._refused("is not a regular file (a FIFO or device)")
            if info.st_nlink != 1:
                raise self._refused(f"has {info.st_nlink} names (hard links): another file shares its bytes")
            held = os.pread(fd, _PID_BYTES + 1, 0)
            if len(held) > _PID_BYTES or not (held == b"" or held.isdigit()):
                raise self._refused("holds something else than the process id a lock holds")
        except BaseException:
            close_lock_fd(fd)
            raise
        return fd, False

    def acquire(self) -> None:
        fd, is_dir = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = "unknown" if is_dir else (os.read(fd, 64).decode(errors="replace").strip() or "unknown")
            close_lock_fd(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise self.busy(holder) from None
            raise
        if not is_dir:
            try:
                with naming(self.path):  # a full disk fails the write of the pid: say which file
                    os.ftruncate(fd, 0)
                    os.write(fd, str(os.getpid()).encode())
            except OSError:
                close_lock_fd(fd)
                raise
        self._fd, self._pid = fd, os.getpid()

    @property
    def held(self) -> bool:
        # A forked child's copy of this object holds nothing: its descriptor was closed at the fork.
        return self._fd is not None and self._pid == os.getpid()

    def release(self) -> None:
        if self.held:
            close_lock_fd(self._fd)
        self._fd = None

    def __enter__(self) -> "FolderLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
