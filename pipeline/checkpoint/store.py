"""Local checkpoint store: atomic, hashed, rolling step folders under ``estados_local/``.

Layout of one checkpoint::

    estados_local/step-00000010/
        modelo.safetensors         model weights only (the publishable artifact)
        estado_treino.safetensors  optimizer, RNG and other training-state tensors
        meta.json                  schema, step, config, fingerprints, JSON state, file hashes

A save writes into ``.tmp-step-…`` (every file fsynced, ``meta.json`` last), renames the
folder into place and fsyncs the parent. Only folders named by :func:`step_dir_name` and
holding ``meta.json`` count as checkpoints; "latest" is the highest integer step. Old
checkpoints are pruned only after the new one is committed, by a thread of their own while
training goes on (deleting gigabytes is not a save's cost); every other method of the store
first waits for it. A prune that fails is a warning (the new checkpoint is safe) and the next
save retries it.

Readers (scripts 04 and 05) :func:`pin` the folder they read with a shared ``flock``;
:meth:`CheckpointStore.prune` takes an exclusive one without waiting and skips a pinned
folder, so a running trainer never pulls a checkpoint away from under a reader.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from ..commands import step_command
from ..durable import (
    FolderLock,
    atomic_folder,
    close_lock_fd,
    fsync_dir,
    lock_folder,
    open_lock_fd,
    write_atomic,
)
from ..errors import (
    CheckpointError,
    CheckpointLocked,
    InternalError,
    NoCheckpoint,
    SchemaMismatch,
    describe_os_error,
)
from ..hashing import chunk_size_for
from ..layout import LOCK_FILE, META_FILE, MODEL_FILE, RESUME_FILE, STATE_FILE, parse_step_dir, step_dir_name
from .best import BestRule, read_best, write_best
from .meta import (
    CHECKPOINT_FILES,
    DIST_META_KEYS,
    DIST_SCHEMA,
    LINEAGE_KEYS,
    META_KEYS,
    SCHEMA_VERSION,
    SEAL_KEY,
    build_meta,
    check_listing,
    file_entry,
    is_distributed,
    meta_sha256,
    read_meta,
    write_meta,
)
from .tensorfile import write_safetensors_files

__all__ = [
    "SCHEMA_VERSION",
    "DIST_SCHEMA",
    "META_KEYS",
    "DIST_META_KEYS",
    "SEAL_KEY",
    "CheckpointStore",
    "SavedCheckpoint",
    "step_dir_name",
    "parse_step_dir",
    "meta_sha256",
    "read_meta",
    "write_meta",
    "is_distributed",
    "check_listing",
    "resolve",
    "best_folder",
    "pin",
    "LINEAGE_KEYS",
]

_TRASH_PREFIX = ".deleting-"
# Exactly the names this module gives a save in progress (durable.atomic_folder) or a
# checkpoint being pruned: nothing else in the folder is ever deleted.
# \Z, not $: a user's ".tmp-step-00000001-0badf00d\n" is not ours to delete; nor, [0-9] not \d,
# is ".tmp-step-١٢٣٤٥٦٧٨-0badf00d".
_STALE_DIR = re.compile(r"\.(?:tmp|deleting)-step-[0-9]{8,}-[0-9a-f]{8}\Z")
_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SavedCheckpoint:
    step: int
    path: Path
    files: dict[str, dict[str, Any]]


class CheckpointStore:
    """Owns one checkpoint folder. Use as a context manager to hold its lock while writing."""

    def __init__(self, root: str | Path, *, keep_last: int = 1) -> None:
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        self.root = Path(root)
        self.keep_last = keep_last
        self._lock = FolderLock(
            self.root / LOCK_FILE,
            lambda holder: CheckpointLocked(
                f"{self.root}/ is in use by another trainer (pid {holder}); wait for it "
                "to finish or use another --checkpoint-dir"
            ),
        )
        self._pruning: threading.Thread | None = None
        self._prune_error: BaseException | None = None
        self.best: BestRule | None = None
        """The run's best rule and evaluations as of the save in progress, set by the
        checkpointer before each save; the commit marks the best committed step under it
        before anything is pruned (:meth:`_mark_best`)."""

    # -- locking -------------------------------------------------------------------------
    def __enter__(self) -> "CheckpointStore":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        """Take an exclusive ``flock`` so two trainers never write one folder."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock.acquire()

    def release(self) -> None:
        try:
            self.wait_for_prune()
        finally:
            self._lock.release()

    # -- listing -------------------------------------------------------------------------
    def resume_target(self, resume: str | None) -> str | None:
        """What a trainer started with ``--resume resume`` continues from: ``None`` for a fresh
        run (``auto`` in an empty store), else the spec to load (``auto`` -> ``latest``). A fresh
        run over committed checkpoints is refused: two runs' steps would interleave here."""
        existing = self.committed_steps()
        if resume == "auto":
            resume = "latest" if existing else None
        if resume is None and existing:
            raise CheckpointError(
                f"{self.root}/ already holds checkpoints up to step {existing[-1]}: continue "
                "with --resume latest, or pass another --checkpoint-dir for a new run"
            )
        return resume

    def committed_steps(self) -> list[int]:
        """Steps of committed checkpoints, ascending as integers."""
        self.wait_for_prune()
        return self._listed_steps()

    def _listed_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        steps = []
        for entry in self.root.iterdir():
            step = parse_step_dir(entry.name)
            if step is not None and (entry / META_FILE).is_file():
                steps.append(step)
        return sorted(steps)

    def path_for(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def _require_lock(self, action: str) -> None:
        if not self._lock.held:
            raise InternalError(f"{action} in {self.root}/ without holding its lock (a bug in the caller)")

    def clean_stale(self) -> list[Path]:
        """Remove the temporary and half-deleted folders a crash left (only names this
        module gives them). Requires the lock."""
        self._require_lock("clean_stale")
        self.wait_for_prune()
        removed = []
        if self.root.is_dir():
            for entry in self.root.iterdir():
                if _STALE_DIR.match(entry.name) and entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                    removed.append(entry)
        if removed:
            fsync_dir(self.root)
        return removed

    # -- the resume note -----------------------------------------------------------------
    @property
    def resume_note_path(self) -> Path:
        return self.root / RESUME_FILE

    def note_resume(self, command: str | None) -> Path:
        """Write ``command``, which continues the run stopped here, to ``RESUME`` (under
        torchrun the stop's own line scrolls away under torchrun's report); ``None`` removes
        it, once the run continues. Requires the lock."""
        self._require_lock("note_resume")
        path = self.resume_note_path
        if command is not None:
            write_atomic(path, (command + "\n").encode("utf-8"))
        elif path.is_file() and not path.is_symlink():
            path.unlink()
            fsync_dir(self.root)
        return path

    # -- saving --------------------------------------------------------------------------
    def save(
        self,
        step: int,
        model_tensors: Mapping[str, torch.Tensor],
        state_tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any],
    ) -> SavedCheckpoint:
        """Write one checkpoint atomically, then prune. Requires the lock.

        An error before the commit raises (the temporary folder is removed, older checkpoints
        are untouched). A prune that fails after the commit only logs a warning: the new
        checkpoint is safe, and the next save retries the prune."""
        self._require_lock("save")
        self.wait_for_prune()
        final = self.path_for(step)
        if final.exists():
            raise CheckpointError(f"{final} already exists; refusing to overwrite a committed checkpoint")
        files: dict[str, dict[str, Any]] = {}
        with atomic_folder(final, files_synced=True) as temporary:
            metadata = {"format": "pt", "step": str(step)}
            written = write_safetensors_files(
                [
                    (temporary / name, tensors, metadata)
                    for name, tensors in ((MODEL_FILE, model_tensors), (STATE_FILE, state_tensors))
                ],
                chunk_size=chunk_size_for,
            )
            for name, (sha256, size, chunk_size, chunks) in zip(CHECKPOINT_FILES, written):
                files[name] = file_entry(sha256, size, chunks, chunk_size)
            write_meta(temporary, build_meta(meta, step=step, files=files))
        self.prune_after_commit(step)
        return SavedCheckpoint(step=step, path=final, files=files)

    def prune_after_commit(self, step: int) -> None:
        """Start :meth:`prune` once ``step`` is committed (durable), on a thread of its own, and
        return: the caller goes back to training while the old folders are deleted. A failure
        is a warning, as the new checkpoint is safe, and the next save retries. Requires the
        lock, which :meth:`release` keeps until the prune is done."""
        self._require_lock("prune")
        self.wait_for_prune()
        if not self._mark_best(step):
            return  # the old mark stands, and so does every checkpoint: nothing is pruned
        # Not a daemon: an interpreter that exits mid-prune finishes it rather than leaving
        # a half-deleted folder for the next start to sweep.
        pruning = threading.Thread(
            target=self._prune_logged, args=(step,), name=f"prune-after-step-{step}", daemon=False
        )
        pruning.start()  # kept only once started: wait_for_prune joins it
        self._pruning = pruning

    def _mark_best(self, step: int) -> bool:
        """Mark the best committed step under :attr:`best` once ``step`` is committed: the run's
        best, or after a resume that changed the rule, the best of the kept checkpoints (the
        run's best under the new rule may have no checkpoint). False when the mark could not be
        written (a warning: the prune is skipped, the next save retries)."""
        rule = self.best
        if rule is None:
            return True  # no checkpoint.best_metric: nothing to mark
        # A linked step folder is not one this store wrote: never marked (readers refuse it).
        best = rule.among([kept for kept in self._listed_steps() if not self.path_for(kept).is_symlink()])
        if best is None:
            return True  # no kept checkpoint evaluated at its own step: the old mark stands
        try:
            if read_best(self.root) == best:
                return True
        except CheckpointError:
            pass  # replaced by the right one
        try:
            write_best(self.root, best)
        except OSError as exc:
            _log.warning(
                "warning: step %d is committed, but marking step %d as the best in %s/ failed (%s); "
                "nothing is pruned, and the next save retries",
                step,
                best["step"],
                self.root,
                describe_os_error(exc),
            )
            return False
        return True

    def mark_best_again(self, evaluations: Mapping[str, list], metric: str, mode: str) -> None:
        """At a resume, before anything is trained or saved: mark the best committed step under
        this rule (``metric``, ``mode``; none without ``metric``) where the mark is missing,
        unreadable or of this same rule. A stop between a save's commit and the mark's move
        leaves the old best marked, and after the run's last save no next save moves it. A mark
        of another rule stays until the first save moves it. Nothing is pruned. Requires the lock."""
        rule = BestRule.of(evaluations, metric, mode)
        if rule is None:
            return
        self._require_lock("mark the best")
        try:
            mark = read_best(self.root)
        except CheckpointError:
            mark = None
        if mark is None or (mark["metric"], mark["mode"]) == (metric, mode):
            self.best = rule
            self._mark_best(max(self._listed_steps(), default=0))

    def wait_for_prune(self) -> None:
        """Wait for the prune :meth:`prune_after_commit` started, if any; raise here what it
        raised other than an OS error (those were logged as warnings)."""
        pruning, self._pruning = self._pruning, None
        if pruning is not None:
            pruning.join()
        error, self._prune_error = self._prune_error, None
        if error is not None:
            raise error

    def _prune_logged(self, step: int) -> None:
        try:
            self._prune()
        except OSError as exc:
            _log.warning(
                "warning: step %d is committed, but pruning older checkpoints in %s/ failed (%s); "
                "training goes on and the next save retries",
                step,
                self.root,
                describe_os_error(exc),
            )
        except BaseException as exc:  # raised in the thread that waits for this prune
            self._prune_error = exc

    def prune(self) -> list[int]:
        """Delete all but the newest ``keep_last`` committed checkpoints, oldest first;
        returns the steps deleted. Requires the lock.

        A folder a reader has pinned (:func:`pin`) is skipped this time, and so is one whose
        meta.json is not ours (it stays for the user to look at). Each victim is renamed out
        of the step namespace (atomic) while its exclusive lock is held, so a crash while
        deleting never leaves a half-deleted folder that looks like a checkpoint.
        """
        self._require_lock("prune")
        self.wait_for_prune()
        return self._prune()

    def _prune(self) -> list[int]:
        try:
            best = read_best(self.root)
        except CheckpointError as exc:
            _log.warning("warning: nothing is pruned while the best checkpoint is unknown: %s", exc)
            return []
        steps = self._listed_steps()
        victims = steps[: -self.keep_last] if len(steps) > self.keep_last else []
        if best is not None:  # kept besides the last keep_last
            victims = [step for step in victims if step != best["step"]]
        pruned = []
        for step in victims:
            folder = self.path_for(step)
            if folder.is_symlink():  # not a folder this store wrote: never renamed, never deleted
                _log.warning("warning: not pruning %s: %s", folder, _SYMLINK_REASON)
                continue
            try:
                read_meta(folder)
            except SchemaMismatch as exc:
                _log.warning("warning: not pruning %s: %s", folder, exc)
                continue
            doomed = self.root / f"{_TRASH_PREFIX}{step_dir_name(step)}-{secrets.token_hex(4)}"
            fd = lock_folder(folder)
            if fd is None:
                continue  # a reader holds it (or it is gone): retried at the next save
            try:
                os.rename(folder, doomed)
            finally:
                close_lock_fd(fd)
            fsync_dir(self.root)
            shutil.rmtree(doomed)
            pruned.append(step)
        return pruned


@contextlib.contextmanager
def pin(folder: str | Path) -> Iterator[Path]:
    """Hold a shared ``flock`` on a checkpoint folder while reading it, so that a trainer's
    :meth:`CheckpointStore.prune` leaves it alone. Raises :class:`NoCheckpoint` if the folder
    is gone (pruned before it could be pinned)."""
    folder = Path(folder)
    try:
        fd = open_lock_fd(folder, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        raise NoCheckpoint(
            f"{folder} is not a checkpoint folder (or was just pruned by a running trainer)"
        ) from None
    try:
        # Waits only while a prune renames the folder away; then it no longer has this name.
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(folder))
        except FileNotFoundError:
            same = False
        if not same:
            raise NoCheckpoint(f"{folder} was pruned by a running trainer before it could be read")
        yield folder
    finally:
        close_lock_fd(fd)


# What a checkpoint may be named by, as every refusal of a name lists it.
_SPECS = (
    "name latest|best|PATH (the newest committed checkpoint, the one checkpoint.best_metric marked, "
    "or a step-NNNNNNNN folder)"
)


def resolve(spec: str | Path, root: str | Path, *, committed: bool = False) -> tuple[Path, list[Path]]:
    """The one place that turns ``"latest"``, ``"best"`` (the step ``BEST.json`` marks, see
    :mod:`.best`) or a folder path into a folder to load.

    Returns ``(folder, older)``: ``older`` are the older committed folders, newest first,
    that a caller may name when ``folder`` fails verification (only for ``"latest"``).
    ``committed``: the caller consumes finished checkpoints (evaluate, stage): an explicit
    path must be a committed ``step-…`` folder, and "none yet" points at training.
    Nothing is verified here; :func:`pipeline.checkpoint.load.load_checkpoint` does that.
    """
    if str(spec) == "best":
        return best_folder(root)[0], []
    if str(spec) != "latest":
        folder = Path(spec)
        _refuse_symlink(folder)
        if not folder.exists():  # a mistyped keyword ("bset") is a path to nowhere
            raise NoCheckpoint(f"{spec} is neither latest, best nor an existing folder: {_SPECS}")
        if committed and parse_step_dir(folder.resolve().name) is None:
            raise CheckpointError(
                f"{spec} is not a committed checkpoint folder (step-NNNNNNNN): only committed "
                f"checkpoints are evaluated or staged; {_SPECS}"
            )
        return folder, []
    store = CheckpointStore(root)
    steps = store.committed_steps()
    if not steps:
        where = (
            "pass --checkpoint PATH, or --checkpoint-dir DIR for the folder that holds them"
            if committed
            else "point --checkpoint-dir at the folder that holds them"
        )
        raise NoCheckpoint(
            f"no committed checkpoint in {Path(root)}/: train first with {step_command('02_train.py')}, or {where}"
        )
    _refuse_symlink(store.path_for(steps[-1]))
    older = [store.path_for(step) for step in reversed(steps[:-1])]
    return store.path_for(steps[-1]), [folder for folder in older if not folder.is_symlink()]


def best_folder(root: str | Path) -> tuple[Path, dict[str, Any]]:
    """The folder ``BEST.json`` in ``root`` marks, and the mark (checked against that folder's
    own evaluations by the load, :func:`.best.check_best`)."""
    root = Path(root)
    best = read_best(root)
    if best is None:
        raise NoCheckpoint(
            f"no best checkpoint is marked in {root}/: train with checkpoint.best_metric and "
            "training.eval_every set, or pass --checkpoint latest or PATH"
        )
    folder = CheckpointStore(root).path_for(best["step"])
    _refuse_symlink(folder)
    if not (folder / META_FILE).is_file():
        raise NoCheckpoint(
            f"{root}/BEST.json marks step {best['step']}, which is not a committed checkpoint there: "
            "pass --checkpoint latest or PATH"
        )
    return folder, best


_SYMLINK_REASON = (
    "it is a symbolic link, and checkpoints are folders their store wrote (pruning one would "
    "delete what a link points to)"
)


def _refuse_symlink(folder: Path) -> None:
    """Every reader refuses a step folder that is a symbolic link, the same way (resolved
    here, the one place a spec becomes a folder); the folder holding them may be one."""
    if folder.is_symlink():
        raise CheckpointError(
            f"{folder} is not loaded: {_SYMLINK_REASON}; copy its target in its place "
            f"(cp -r --dereference), or pass the target folder itself"
        )
