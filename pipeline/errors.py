"""Domain exceptions: every expected failure of the pipeline is one of these, so the
scripts can print a single line that says what is wrong and what to do, and exit with
``exit_code`` (2 unless stated) without a traceback. Torch-free."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import unicodedata
from pathlib import Path
from typing import Iterator

__all__ = [
    "naming",
    "shown",
    "PipelineError",
    "ConfigError",
    "FactoryFailed",
    "OutOfMemory",
    "MachineLimit",
    "out_of_tasks",
    "missing_module",
    "CodeChanged",
    "DataError",
    "InputFailed",
    "UserCodeExited",
    "CapturedTraceback",
    "DeadlinePassed",
    "WorkerExited",
    "CheckpointError",
    "ChecksumMismatch",
    "SchemaMismatch",
    "ConfigMismatch",
    "StateMismatch",
    "EnvironmentMismatch",
    "CheckpointLocked",
    "NoCheckpoint",
    "UnsealedCheckpoint",
    "FileChanged",
    "FolderTooDeep",
    "LockRefused",
    "Stopped",
    "LaunchMismatch",
    "WorldSizeMismatch",
    "PeerFailed",
    "Preempted",
    "TrainingDiverged",
    "ProofIncomplete",
    "MetricsError",
    "StageError",
    "StageAuditError",
    "SecretInStage",
    "NonFiniteWeights",
    "ProofMismatch",
    "PublishError",
    "TokenRejected",
    "StaleBranch",
    "HubUnavailable",
    "UploadInterrupted",
    "PublishTimedOut",
    "DeadlinePassed",
    "StageChanged",
    "VerificationFailed",
    "ReceiptNotWritten",
    "SigningError",
    "DemoFailed",
    "InternalError",
    "describe_os_error",
    "SEALED_BUT_UNFIT",
]

# How a refusal of a checkpoint's content ends once its seal (meta.json's meta_sha256) and
# file hashes verified: the bytes are what a writer sealed, so they are not damaged; a
# writer of another version, or someone who edited and resealed them, made them so.
SEALED_BUT_UNFIT = (
    "the checkpoint is sealed but does not fit this code (another version wrote it, or it was edited "
    "and resealed)"
)

# The causes a user can act on, in words (strerror's wording varies by platform).
_OS_CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


def first_line(exc: BaseException, *, named: bool = False, limit: int | None = 300) -> str:
    """The first line of ``exc``'s message, at most ``limit`` characters (None: all of it), for a
    one-line error (``named``: ``"ValueError: row 21 is corrupt"``); the type's name when the
    message is empty."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    line = text.splitlines()[0][:limit]
    return f"{type(exc).__name__}: {line}" if named else line


# What a name shows as \xNN (or \uNNNN) in a message or a card: control, format (a bidi
# override) and separator characters (a line break of any kind), lone surrogates, and the
# characters that end a card's code span or table cell. The backslash too, so that an escape
# shown is never a name's own text.
_SHOWN_AS_IS = frozenset("\\`|")


def shown(name: str | os.PathLike) -> str:
    """A name read from a user's folder (a file, a tensor, a path) as every message and card
    shows it: one line of inert text. A line break, a Markdown or HTML control cannot act:
    each character that could is written as ``\\xNN`` (``\\uNNNN``); a plain name is
    returned unchanged. Cards put it in a code span (:func:`pipeline.stage.card_parts.code`)."""
    text = os.fspath(name) if not isinstance(name, str) else name
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    out = []
    for char in text:
        if char in _SHOWN_AS_IS or unicodedata.category(char) in ("Cc", "Cf", "Cs", "Zl", "Zp"):
            code = ord(char)
            out.append(
                f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
            )
        else:
            out.append(char)
    return "".join(out)


def describe_os_error(exc: OSError) -> str:
    """``"<path>: <cause>"`` for an operating-system error (the cause alone when the call
    named no path), e.g. ``"estados_local/.tmp-step-…: no space left on the device"``."""
    cause = _OS_CAUSES.get(exc.errno or 0) or exc.strerror or str(exc) or exc.__class__.__name__
    path = f"{exc.filename} -> {exc.filename2}" if exc.filename and exc.filename2 else exc.filename
    return f"{path}: {cause}" if path else cause


class PipelineError(Exception):
    """Base class: an expected failure whose message is meant for the user."""

    exit_code = 2


class ConfigError(PipelineError, ValueError):
    """The configuration file or a command-line override is invalid."""


class FactoryFailed(ConfigError):
    """A configured factory (or torch, called by it) raised while building the run; the
    message names the config key and the factory, ``__cause__`` holds the original exception
    (scripts print its traceback with ``--debug``)."""


class CallbackFailed(FactoryFailed):
    """A callback of ``training.callbacks`` raised during the run; the message names it and the
    event, and where the run can go on from."""


class OutOfMemory(PipelineError):
    """An allocation failed (``MemoryError``, or torch's allocator refusing): the sizes in the
    config ask for more memory than there is."""


class MachineLimit(ConfigError):
    """A count of the config that becomes threads or processes (``training.threads``,
    ``data.num_workers``) is more than this machine can start or run usefully
    (:mod:`pipeline.limits`); refused before any of them starts."""


def out_of_tasks(exc: BaseException) -> str | None:
    """The one line for a thread or process that could not start because the machine is out
    of them (``RuntimeError: can't start new thread``, a fork's ``EAGAIN``); else ``None``."""
    if isinstance(exc, RuntimeError) and str(exc).startswith("can't start new thread"):
        what = "a thread could not start"
    elif isinstance(exc, OSError) and exc.errno == errno.EAGAIN:
        what = f"a process or thread could not start ({exc.strerror or 'Resource temporarily unavailable'})"
    else:
        return None
    return (
        f"{what}: this machine is out of processes and threads (this user's limit, ulimit -u, or a "
        "container's pids.max): stop other processes, lower data.num_workers or training.threads, or "
        "raise the limit"
    )


def missing_module(exc: ModuleNotFoundError) -> str:
    """The one line for a library this interpreter cannot import (a Python without the
    project's dependencies: the system's, or an environment not activated)."""
    return (
        f"this Python ({sys.executable}) cannot import {exc.name or 'a module'}, which the pipeline needs: "
        "run the Python of the environment the project is installed in, or install it into this one "
        "(pip install -e . in the project's folder)"
    )


class DataError(PipelineError, ValueError):
    """Prepared data is missing or does not match its recorded fingerprint."""


class InputFailed(DataError):
    """Reading a batch failed mid-run: a sample, a collate or a stream raised, a DataLoader
    worker died, or ``data.sample_timeout`` passed. The training loop adds where the run
    can go on from (the last committed checkpoint, or none yet)."""


class UserCodeExited(PipelineError):
    """The task's code raised ``SystemExit`` (or another ``BaseException`` that is not an
    error class) in the middle of a run: the run did not finish, so it must not exit 0."""


class CapturedTraceback(Exception):
    """The traceback of an exception raised where the exception itself could not be kept (a
    DataLoader worker process), as text: the ``__cause__`` of the one-line error it led to,
    printed as it is by ``--debug``."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


class WorkerExited(BaseException):
    """Raised by the training process's SIGCHLD handler into a wait for a batch when a
    DataLoader worker ends; turned into :class:`InputFailed` naming how it ended."""

    def __init__(self, pid: int) -> None:
        super().__init__(pid)
        self.pid = pid


class SampleDeadlinePassed(BaseException):
    """Raised by the ``data.sample_timeout`` timer inside the task's code, which may catch
    ``Exception`` broadly; turned into :class:`InputFailed` where the timer was set."""


# -- checkpoints (pipeline.checkpoint) ------------------------------------------------------


class CheckpointError(PipelineError):
    """A checkpoint is missing, damaged, or cannot be used for this run."""


class ChecksumMismatch(CheckpointError, ValueError):
    """A file's SHA-256 or size differs from what its meta.json records."""


class SchemaMismatch(CheckpointError, ValueError):
    """meta.json is malformed or written by an unknown schema version."""


class ConfigMismatch(CheckpointError, ValueError):
    """The checkpoint was written by a run whose config differs from this one."""


class StateMismatch(CheckpointError, ValueError):
    """Saved tensors do not fit the objects built from the current config."""


class CodeChanged(CheckpointError):
    """A source file that counts for a checkpoint (the model's code, the data, optimizer or
    scheduler factory) differs from the one it was trained with."""


class EnvironmentMismatch(CheckpointError):
    """This process cannot reproduce what the checkpoint recorded of its environment
    (thread counts, determinism switches, device type, torch/NumPy versions)."""


class CheckpointLocked(CheckpointError):
    """Another trainer holds the checkpoint folder's lock."""


class NoCheckpoint(CheckpointError, FileNotFoundError):
    """No committed checkpoint exists where one was asked for."""


class UnsealedCheckpoint(CheckpointError, ValueError):
    """A folder another tool wrote has no seal, or its seal (``pipeline.integrations.seal``)
    is malformed or does not match the files: the folder is incomplete or damaged."""


class FileChanged(PipelineError):
    """A file of a folder someone handed over is not, once opened, what was checked
    (:mod:`pipeline.safe_read`): now a link, a FIFO or device, another file or another size.
    ``path`` names it, ``reason`` says what it is now; callers say what they were doing."""

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(f"{shown(path)} changed while it was read ({reason})")
        self.path = Path(path)
        self.reason = reason


class FolderTooDeep(PipelineError):
    """A folder someone handed over nests folders deeper than any model or checkpoint folder
    does (:data:`pipeline.safe_read.MAX_DEPTH`): refused rather than walked without bound."""


class LockRefused(PipelineError):
    """A lock file is a link, a FIFO or device, a file with other hard links, or holds what
    the pipeline never writes there: it is never written through."""


# -- training (pipeline.train, pipeline.proof) ---------------------------------------------


class LaunchMismatch(CheckpointError):
    """A checkpoint was written by another launch (one process or torchrun, another
    training.parallel or DDP bucket setting): see --reshard."""


class WorldSizeMismatch(LaunchMismatch):
    """A distributed checkpoint was written by another number of processes (see --reshard)."""


class Stopped(BaseException):
    """SIGTERM or SIGINT arrived while a script was working (:func:`pipeline.cli.stopping`):
    raised in the main thread so that every atomic writer and scratch folder cleans up on the
    way out, then printed by ``run_main`` as one line, exit 128 + the signal's number.
    ``outcome`` says what the stop left. Not an ``Exception``: code that catches those
    broadly must not swallow the stop."""

    def __init__(self, signum: int, outcome: str) -> None:
        import signal

        super().__init__(f"stopped by {signal.Signals(signum).name}; {outcome}")
        self.signum = signum
        self.exit_code = 128 + signum


class PeerFailed(PipelineError):
    """Another rank of a distributed run failed and printed why; this rank stops with the
    same exit code and prints nothing more (``quiet``), so a refusal reads as one line."""

    quiet = True

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Preempted(PipelineError):
    """SIGTERM/SIGINT arrived; the current step finished and a checkpoint was written.
    Exit code 128 + the signal number, as a shell reports a signal. ``quiet``: another rank
    of the launch prints the line."""

    def __init__(self, message: str, signum: int, *, quiet: bool = False) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum
        self.quiet = quiet


class TrainingDiverged(PipelineError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


class ProofIncomplete(PipelineError):
    """A leg of the resume proof failed or its results could not be read; ``report`` is
    what was written."""

    def __init__(self, message: str, report: dict) -> None:
        super().__init__(message)
        self.report = report


class MetricsError(PipelineError, ValueError):
    """metrics.json is missing, malformed, or a task returned unusable metrics."""


# -- the stage (pipeline.stage, pipeline.audit) --------------------------------------------


class StageError(PipelineError):
    """The stage cannot be built or replaced; the previous stage is untouched."""


class StageAuditError(StageError, ValueError):
    """A stage's files do not match its MANIFEST.sha256 or its meta.json."""


class SecretInStage(StageError):
    """A staged file holds a token, a private key, or a path or name of this machine."""


class NonFiniteWeights(StageError, ValueError):
    """A floating-point tensor of the weights holds NaN or infinite values."""


class ProofMismatch(StageError, ValueError):
    """A resume proof to stage is unreadable, incomplete, or proves another config, code or data."""


class RepoIdError(PipelineError, ValueError):
    """A --repo-id the Hub would refuse (05 and 06 apply one rule: pipeline.repo_ids)."""


# -- publishing (pipeline.publishing) ----------------------------------------------------------


class PublishError(PipelineError):
    """Nothing was published (exit 2). The message says what happened and what to do."""


class TokenRejected(PublishError):
    """No token, a token the Hub rejects, or one without write access to the repo."""


class StaleBranch(PublishError):
    """HTTP 412: someone pushed to the branch after we read its head; nothing was written."""


class HubUnavailable(PublishError):
    """429 or 5xx on the commit, still failing after the bounded retries."""


class UploadInterrupted(PublishError):
    """The connection was lost while uploading or committing."""


class PublishTimedOut(PublishError):
    """The publish ran out of its ``--timeout`` before the commit landed; nothing was committed."""


class DeadlinePassed(Exception):
    """Raised inside a Hub client call when a request would start past the publish's deadline,
    the Hub asks to wait past it (``asked``: the wait), or the deadline cut a connection. Not a
    :class:`PipelineError` on purpose: it travels through the client's own code and comes out
    wrapped, and ``pipeline.publishing.client.hub_errors`` turns it into a :class:`PublishTimedOut`."""

    def __init__(self, message: str, asked: float | None = None) -> None:
        super().__init__(message)
        self.asked = asked


class StageChanged(PublishError):
    """A staged file changed on disk after it was audited."""


class VerificationFailed(PublishError):
    """The commit landed, but what the Hub holds differs from the audit (exit 1)."""

    exit_code = 1


class ReceiptNotWritten(PublishError):
    """The commit landed and was verified, but the receipt could not be written (exit 1)."""

    exit_code = 1


class SigningError(PipelineError):
    """A stage cannot be signed, or its signature does not verify with the expected key."""


class InternalError(PipelineError):
    """A precondition of the pipeline's own code does not hold (a bug, not bad input):
    checked explicitly, never with ``assert``, so it holds under ``python -O`` too."""


class DemoFailed(PipelineError):
    """A step of ``make demo`` exited non-zero; ``exit_code`` is that step's exit code."""

    def __init__(self, step: str, code: int) -> None:
        super().__init__(f"demo: {step} failed with exit code {code}")
        self.exit_code = code


@contextlib.contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """An OS error raised by a call on a file descriptor (``fsync``, ``write``) names no file:
    give it ``path``, so every message says which file failed."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path)) from None
        raise
