"""Record, and fail on demand, the file-system calls a commit protocol makes (test-owned).

:class:`Recorder` replaces ``os.mkdir``, ``os.open`` (creating), ``open`` (writing),
``os.fsync``, ``os.rename``, ``os.replace``, ``os.unlink``, ``os.rmdir`` and
``shutil.rmtree`` in the running process with wrappers that note every call on a path
under ``root`` as an :class:`Op`, and can end the process (``os._exit``, a crash: no
cleanup runs) or raise ``OSError`` (an I/O error: the code's own cleanup runs) right
*before* the N-th such call. Nothing in ``pipeline/`` knows about it: the real code runs,
its calls are intercepted from outside, as a crash would intercept them.

:func:`ordering_problems` checks a recorded run of a protocol: every file is fsynced before
the rename that publishes it, the folder's own entries before that rename, the parent
folder after it, and nothing that existed before is deleted before the new commit is
durable. :class:`PageCache` models a power cut: only what was fsynced survives.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

__all__ = ["CRASH_EXIT", "Op", "Recorder", "ordering_problems", "PageCache"]

# Exit status of a process ended at a crash point (anything else is a real failure).
CRASH_EXIT = 86


@dataclass(frozen=True)
class Op:
    """One intercepted call. ``kind``: mkdir, create, fsync, rename, unlink, rmdir, rmtree;
    ``target`` is the destination of a rename; ``is_dir`` for fsync and rmtree."""

    kind: str
    path: str
    target: str | None = None
    is_dir: bool = False

    def __str__(self) -> str:
        what = f"{self.kind}{'(dir)' if self.kind == 'fsync' and self.is_dir else ''}"
        return f"{what} {self.path}" + (f" -> {self.target}" if self.target else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_WRITE_FLAGS = os.O_CREAT | os.O_WRONLY | os.O_RDWR


class Recorder:
    """Intercept the calls on paths under ``root`` while installed (a context manager).

    ``fail_at``: the index of the call to fail, *before* it runs; ``how``: ``"exit"``
    (``os._exit(CRASH_EXIT)``) or ``"raise"`` (``OSError(EIO)``). ``after``: called with
    each op once it has run (the page-cache model snapshots what an fsync made durable).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        fail_at: int | None = None,
        how: str = "exit",
        after: Callable[[Op], None] | None = None,
    ) -> None:
        assert how in ("exit", "raise"), how
        self.root = os.path.abspath(root)
        self.fail_at = fail_at
        self.how = how
        self.after = after
        self.ops: list[Op] = []
        self._inside_rmtree = 0
        self._saved: dict[tuple[Any, str], Any] = {}

    # -- bookkeeping ---------------------------------------------------------------------
    def _ours(self, path: Any) -> str | None:
        if isinstance(path, int):
            return None
        text = os.path.abspath(os.fsdecode(path))
        return text if text == self.root or text.startswith(self.root + os.sep) else None

    def _note(self, op: Op, call: Callable[[], Any]) -> Any:
        if self._inside_rmtree:
            return call()
        if len(self.ops) == self.fail_at:
            self.ops.append(op)
            if self.how == "exit":
                os._exit(CRASH_EXIT)
            raise OSError(errno.EIO, f"injected failure before {op}")
        self.ops.append(op)
        result = call()
        if self.after is not None:
            self.after(op)
        return result

    # -- wrappers ------------------------------------------------------------------------
    def _wrap(self) -> dict[tuple[Any, str], Any]:
        real = {
            name: getattr(os, name)
            for name in ("mkdir", "open", "fsync", "rename", "replace", "unlink", "rmdir")
        }
        real_open, real_rmtree = builtins.open, shutil.rmtree

        def mkdir(path, *args, **kwargs):
            mine = self._ours(path)
            if mine is None or kwargs.get("dir_fd") is not None:
                return real["mkdir"](path, *args, **kwargs)
            return self._note(Op("mkdir", mine), lambda: real["mkdir"](path, *args, **kwargs))

        def os_open(path, flags, *args, **kwargs):
            mine = self._ours(path) if kwargs.get("dir_fd") is None else None
            if mine is None or not flags & os.O_CREAT or not flags & _WRITE_FLAGS:
                return real["open"](path, flags, *args, **kwargs)
            return self._note(Op("create", mine), lambda: real["open"](path, flags, *args, **kwargs))

        def py_open(file, mode="r", *args, **kwargs):
            mine = self._ours(file) if isinstance(file, (str, bytes, os.PathLike)) else None
            if mine is None or not set(mode) & set("wxa"):
                return real_open(file, mode, *args, **kwargs)
            return self._note(Op("create", mine), lambda: real_open(file, mode, *args, **kwargs))

        def fsync(fd):
            fd_number = fd if isinstance(fd, int) else fd.fileno()
            try:
                mine = self._ours(os.readlink(f"/proc/self/fd/{fd_number}"))
            except OSError:
                mine = None
            if mine is None:
                return real["fsync"](fd)
            is_dir = stat.S_ISDIR(os.fstat(fd_number).st_mode)
            return self._note(Op("fsync", mine, is_dir=is_dir), lambda: real["fsync"](fd))

        def rename_like(name):
            def wrapper(src, dst, *args, **kwargs):
                mine, theirs = self._ours(src), self._ours(dst)
                if mine is None or theirs is None or kwargs:
                    return real[name](src, dst, *args, **kwargs)
                return self._note(Op("rename", mine, theirs), lambda: real[name](src, dst, *args, **kwargs))

            return wrapper

        def unlink_like(name):
            def wrapper(path, *args, **kwargs):
                mine = self._ours(path) if kwargs.get("dir_fd") is None else None
                if mine is None:
                    return real[name](path, *args, **kwargs)
                return self._note(Op(name, mine), lambda: real[name](path, *args, **kwargs))

            return wrapper

        def rmtree(path, *args, **kwargs):
            mine = self._ours(path)
            if mine is None or self._inside_rmtree:
                return real_rmtree(path, *args, **kwargs)

            def run():
                self._inside_rmtree += 1
                try:
                    return real_rmtree(path, *args, **kwargs)
                finally:
                    self._inside_rmtree -= 1

            return self._note(Op("rmtree", mine, is_dir=True), run)

        return {
            (os, "mkdir"): mkdir,
            (os, "open"): os_open,
            (os, "fsync"): fsync,
            (os, "rename"): rename_like("rename"),
            (os, "replace"): rename_like("replace"),
            (os, "unlink"): unlink_like("unlink"),
            (os, "rmdir"): unlink_like("rmdir"),
            (builtins, "open"): py_open,
            (io, "open"): py_open,
            (shutil, "rmtree"): rmtree,
        }

    def __enter__(self) -> "Recorder":
        for (module, name), wrapper in self._wrap().items():
            self._saved[(module, name)] = getattr(module, name)
            setattr(module, name, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        for (module, name), original in self._saved.items():
            setattr(module, name, original)
        self._saved.clear()


# -- ordering --------------------------------------------------------------------------------


def _under(path: str, folder: str) -> bool:
    return path.startswith(folder + os.sep)


def ordering_problems(ops: list[Op]) -> list[str]:
    """What a complete, unfailed run of a protocol did out of order (empty: nothing).

    A *publishing* rename gives an entry a visible name (one not starting with "."). Before
    it, every file created in the entry (or the file itself) must have been fsynced after it
    was written, and a published folder itself fsynced after its last file was created;
    after it, its parent folder must be fsynced before the run ends, and nothing that
    existed before the run may be deleted or renamed away before that fsync (moving the
    old version of the very entry aside just before the rename is the one exception).
    """
    problems: list[str] = []
    live: dict[str, int] = {}  # paths created by this run -> index of their creation
    ever_created: set[str] = set()
    removals: list[tuple[int, Op]] = []  # deletions and moves of what existed before the run
    publishing: list[tuple[int, Op, dict[str, int]]] = []
    for index, op in enumerate(ops):
        if op.kind in ("create", "mkdir"):
            live[op.path] = index
            ever_created.add(op.path)
        elif op.kind == "rename":
            inside = {p: i for p, i in live.items() if p == op.path or _under(p, op.path)}
            if op.path not in inside:
                removals.append((index, op))
            for path in inside:
                moved = op.target + path[len(op.path) :]
                live[moved] = live.pop(path)
                ever_created.add(moved)
            if op.path in inside and not os.path.basename(op.target).startswith("."):
                publishing.append((index, op, inside))
        elif op.kind in ("rmtree", "unlink", "rmdir") and op.path not in ever_created:
            removals.append((index, op))
    for index, op, inside in publishing:
        for path, at in sorted(inside.items(), key=lambda item: item[1]):
            if ops[at].kind == "create" and not any(
                o.kind == "fsync" and not o.is_dir and o.path == path for o in ops[at + 1 : index]
            ):
                problems.append(
                    f"{path} is published by rename #{index} without an fsync after it was written"
                )
        if ops[inside[op.path]].kind == "mkdir":
            last_create = max(inside.values())
            if not any(
                o.kind == "fsync" and o.is_dir and o.path == op.path for o in ops[last_create + 1 : index]
            ):
                problems.append(
                    f"{op.path} is renamed into place (#{index}) before the folder itself was fsynced"
                )
        parent = os.path.dirname(op.target)
        synced = next(
            (
                i
                for i in range(index + 1, len(ops))
                if ops[i].kind == "fsync" and ops[i].is_dir and ops[i].path == parent
            ),
            None,
        )
        if synced is None:
            problems.append(f"{parent} is never fsynced after rename #{index} publishes {op.target}")
        for at, gone in removals:
            move_aside = gone.kind == "rename" and gone.path == op.target and at < index
            if at < (synced if synced is not None else len(ops)) and not move_aside:
                problems.append(
                    f"#{at} {gone} removes what existed before the commit of {op.target} was durable"
                )
    if not publishing:
        problems.append("the run published nothing (no rename to a visible name)")
    return problems


# -- power loss ------------------------------------------------------------------------------


class PageCache:
    """What survives a power cut, following a run's ops: a file's bytes only once the file
    was fsynced, a folder's entries only once that folder was fsynced. Everything that
    existed when the model was built counts as durable.

    Feed every op to :meth:`after` (it reads the real file system at that moment), take
    :meth:`durable` at a crash point, and :meth:`materialize` it into an empty folder.
    Files and folders are tracked by inode, so renames carry content along.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(os.path.abspath(root))
        self.root_inode = self.root.stat().st_ino
        self.files: dict[int, bytes] = {}
        self.folders: dict[int, dict[str, int]] = {}
        self.is_folder: dict[int, bool] = {}
        for folder, names, files in os.walk(self.root):
            self._snapshot_folder(Path(folder))
            for name in files:
                self._snapshot_file(Path(folder) / name)

    def _snapshot_folder(self, folder: Path) -> None:
        entries = {}
        for entry in os.scandir(folder):
            info = entry.stat(follow_symlinks=False)
            entries[entry.name] = info.st_ino
            self.is_folder[info.st_ino] = stat.S_ISDIR(info.st_mode)
        self.folders[folder.stat().st_ino] = entries

    def _snapshot_file(self, path: Path) -> None:
        self.files[path.stat().st_ino] = path.read_bytes()

    def after(self, op: Op) -> None:
        if op.kind == "fsync":
            (self._snapshot_folder if op.is_dir else self._snapshot_file)(Path(op.path))
        elif op.kind in ("create", "mkdir"):
            self.is_folder[os.stat(op.path).st_ino] = op.kind == "mkdir"

    def durable(self) -> tuple[dict[int, bytes], dict[int, dict[str, int]]]:
        return dict(self.files), {k: dict(v) for k, v in self.folders.items()}

    def materialize(self, state: tuple[dict[int, bytes], dict[int, dict[str, int]]], into: Path) -> None:
        """Write the durable tree under ``into`` (an existing, empty folder). A file whose
        data was never fsynced is empty; a folder never fsynced has no entries."""
        files, folders = state

        def build(inode: int, path: Path) -> None:
            for name, child in folders.get(inode, {}).items():
                if self.is_folder.get(child):
                    (path / name).mkdir()
                    build(child, path / name)
                else:
                    (path / name).write_bytes(files.get(child, b""))

        build(self.root_inode, into)
