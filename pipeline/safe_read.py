"""Files of a folder someone handed over, read once from what was checked (torch-free).

A name checked and then opened is a race: in between, the file can become a link to a
private file, a FIFO that blocks its reader forever, or a device such as ``/dev/zero`` that
never ends. So every file read from a folder a user hands over (05 ``--from-folder``, a
sealed checkpoint folder, the ``card.sections`` file) is:

1. reached from a descriptor of the folder (:class:`HandedFolder`, opened once with
   ``O_NOFOLLOW``), each folder on the way opened ``O_DIRECTORY|O_NOFOLLOW`` from the one
   before: a link anywhere on the way fails the open;
2. opened ``O_RDONLY|O_NOFOLLOW|O_NONBLOCK|O_CLOEXEC``: a FIFO does not block the open;
3. checked on the open descriptor (``fstat``): a regular file and, when a survey saw it
   first (:class:`Seen`), the same device, inode and size;
4. read from that descriptor, never past the size ``fstat`` gave (one byte more is asked
   for, to notice a file that grew).

Whatever fails 2 to 4 raises :class:`~pipeline.errors.FileChanged` naming the file and what
it is now; the caller says what it was doing ("changed while it was staged"). A file with
other hard links (``Seen.links > 1``) is read like any other: its bytes are what the folder
holds, but they may also be reachable from outside it, which callers may flag.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .errors import FileChanged, FolderTooDeep, InternalError, shown
from .hashing import CHUNK

__all__ = ["MAX_DEPTH", "HandedFile", "HandedFolder", "Seen", "read_own", "read_regular"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# An open that meets a link: ELOOP for the last component, ENOTDIR for a link (or a file)
# where a folder was expected.
_LINK_ERRNOS = (errno.ELOOP, errno.ENOTDIR, errno.EMLINK)
# The deepest a handed-over folder may nest folders: a model or checkpoint folder nests a few.
MAX_DEPTH = 64


@dataclass(frozen=True, slots=True)
class Seen:
    """What a survey saw of a file (``lstat``): its identity, size and hard-link count."""

    dev: int
    ino: int
    size: int
    links: int

    @classmethod
    def of(cls, info: os.stat_result) -> "Seen":
        return cls(dev=info.st_dev, ino=info.st_ino, size=info.st_size, links=info.st_nlink)


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a link"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a regular file"


def _parts(name: str) -> list[str]:
    parts = name.split("/")
    if not name or any(part in ("", ".", "..") for part in parts):
        raise InternalError(f"{name!r} is not a relative path inside a folder")
    return parts


class HandedFile:
    """One regular file opened from a :class:`HandedFolder`, checked on its descriptor.
    ``size`` is what ``fstat`` said; every read stops there."""

    def __init__(self, fd: int, path: Path, info: os.stat_result) -> None:
        self.fd, self.path, self.info = fd, path, info
        self.size = info.st_size

    def chunks(self, size: int = CHUNK) -> Iterator[bytes]:
        """The file's bytes, ``size`` at a time, exactly ``self.size`` of them: a file that
        ends early or goes on past that size raises :class:`FileChanged`."""
        left = self.size
        while left:
            data = os.read(self.fd, min(size, left))
            if not data:
                raise FileChanged(self.path, f"shrank to {self.size - left:,} bytes while read")
            left -= len(data)
            yield data
        if os.read(self.fd, 1):
            raise FileChanged(self.path, f"grew past {self.size:,} bytes while read")

    def read(self) -> bytes:
        return b"".join(self.chunks())

    def sha256(self) -> str:
        digest = hashlib.sha256()
        for chunk in self.chunks():
            digest.update(chunk)
        return digest.hexdigest()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "HandedFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HandedFolder:
    """A folder opened once (``O_NOFOLLOW``); every name under it is reached from its
    descriptor. ``seen``: what a survey saw of the folder itself, checked at once."""

    def __init__(self, path: str | Path, *, seen: Seen | None = None) -> None:
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, _DIR_FLAGS)
        except OSError as exc:
            if exc.errno in _LINK_ERRNOS and seen is not None:
                raise FileChanged(self.path, "now a link or not a folder") from None
            raise
        self.info = os.fstat(self.fd)
        if seen is not None and (self.info.st_dev, self.info.st_ino) != (seen.dev, seen.ino):
            self.close()
            raise FileChanged(self.path, "now another folder")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "HandedFolder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open_folders(self, parts: list[str]) -> tuple[int, list[int]]:
        """The descriptor of the folder holding the last of ``parts`` (each folder on the
        way opened without following a link), and the descriptors to close."""
        opened: list[int] = []
        fd = self.fd
        try:
            for depth, part in enumerate(parts[:-1]):
                try:
                    fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in _LINK_ERRNOS:
                        where = self.path.joinpath(*parts[: depth + 1])
                        raise FileChanged(where, "now a link or not a folder") from None
                    raise
                opened.append(fd)
        except BaseException:
            for each in opened:
                os.close(each)
            raise
        return fd, opened

    def lstat(self, name: str) -> os.stat_result:
        """``lstat`` of ``name`` (a relative POSIX path), reached without following a link."""
        parts = _parts(name)
        fd, opened = self._open_folders(parts)
        try:
            return os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        finally:
            for each in opened:
                os.close(each)

    def open(self, name: str, *, seen: Seen | None = None) -> HandedFile:
        """``name`` (a relative POSIX path) opened and checked: a regular file and, with
        ``seen``, the device, inode and size the survey saw; else :class:`FileChanged`."""
        parts = _parts(name)
        path = self.path / name
        fd, opened = self._open_folders(parts)
        try:
            try:
                file_fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if seen is None:
                    raise
                raise FileChanged(path, "gone") from None
            except OSError as exc:
                if exc.errno in _LINK_ERRNOS:
                    raise FileChanged(path, "now a link") from None
                if exc.errno == errno.ENXIO:  # a socket
                    raise FileChanged(path, "now a socket") from None
                raise
        finally:
            for each in opened:
                os.close(each)
        try:
            info = os.fstat(file_fd)
            if not stat.S_ISREG(info.st_mode):
                raise FileChanged(path, f"now {_kind(info.st_mode)}, not a regular file")
            if seen is not None:
                if (info.st_dev, info.st_ino) != (seen.dev, seen.ino):
                    raise FileChanged(path, "now another file")
                if info.st_size != seen.size:
                    raise FileChanged(path, f"now {info.st_size:,} bytes, not the {seen.size:,} surveyed")
        except BaseException:
            os.close(file_fd)
            raise
        return HandedFile(file_fd, path, info)

    def walk(self) -> Iterator[tuple[str, os.stat_result]]:
        """Every entry under the folder, depth first in name order: (relative POSIX path,
        ``lstat``). Folders are entered through descriptors opened without following a
        link and checked to be the folder listed; links and other entries are not entered.
        A folder nested more than :data:`MAX_DEPTH` deep raises :class:`FolderTooDeep`. The
        walk keeps a stack, not the interpreter's (a thousand levels raised RecursionError),
        and holds one descriptor per level it is in."""
        stack: list[tuple[int, str, Iterator[str]]] = [(self.fd, "", iter(sorted(os.listdir(self.fd))))]
        try:
            while stack:
                fd, prefix, names = stack[-1]
                name = next(names, None)
                if name is None:
                    stack.pop()
                    if fd != self.fd:
                        os.close(fd)
                    continue
                try:
                    info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # gone since it was listed: as if never there
                relative = f"{prefix}{name}"
                yield relative, info
                if stat.S_ISDIR(info.st_mode):
                    if len(stack) > MAX_DEPTH:
                        raise FolderTooDeep(
                            f"{shown(self.path)} nests folders more than {MAX_DEPTH} deep ({shown(relative)}): no "
                            "model or checkpoint folder does"
                        )
                    child = self._enter(fd, name, relative, info)
                    stack.append((child, f"{relative}/", iter(())))  # on the stack: closed if listing fails
                    stack[-1] = (child, f"{relative}/", iter(sorted(os.listdir(child))))
        finally:
            for fd, _, _ in stack:
                if fd != self.fd:
                    os.close(fd)

    def _enter(self, fd: int, name: str, relative: str, info: os.stat_result) -> int:
        """The descriptor of folder ``name`` of ``fd``, checked to be the folder listed."""
        try:
            child = os.open(name, _DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            if exc.errno in _LINK_ERRNOS:
                raise FileChanged(self.path / relative, "now a link or not a folder") from None
            raise
        entered = os.fstat(child)
        if (entered.st_dev, entered.st_ino) != (info.st_dev, info.st_ino):
            os.close(child)
            raise FileChanged(self.path / relative, "now another folder")
        return child


def read_regular(path: str | Path, limit: int, *, follow: bool = True) -> bytes:
    """A file a user named on the command line (links followed: they named it; ``follow=False``
    for a file the pipeline itself wrote, which a link then is not), opened ``O_NONBLOCK`` and
    refused unless regular (a FIFO or device would block or never end), read within ``limit``
    bytes. A refusal is a ``ValueError`` saying why, without the path (the caller names the
    option); a file that changes while read, :class:`FileChanged`."""
    path = Path(path)
    fd = os.open(
        path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    )
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"is {_kind(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise ValueError(f"is {info.st_size:,} bytes, over the {limit:,}-byte limit")
        return b"".join(HandedFile(fd, path, info).chunks())
    finally:
        os.close(fd)


def read_own(path: str | Path, limit: int) -> bytes:
    """A file the pipeline itself wrote (a checkpoint's ``meta.json``, a data manifest), read
    as :func:`read_regular` reads it with ``follow=False``: a link, a FIFO, a device, a
    folder, a file over ``limit`` bytes or one that changes while read is a ``ValueError``
    saying what it is (without the path: the caller names the file and the fix); a missing
    one, ``FileNotFoundError``."""
    try:
        return read_regular(path, limit, follow=False)
    except FileChanged as changed:
        raise ValueError(changed.reason) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError("is a symbolic link") from None
        if exc.errno == errno.ENXIO:  # a socket cannot be opened as a file
            raise ValueError("is a socket, not a regular file") from None
        raise
