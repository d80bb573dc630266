"""The Xet side of publishing, in one place: how the Hub stores a file, the Xet hash of staged
files, the client's Xet upload held to the deadline, and the check of a Xet-stored file.

**Storage.** The Hub stores a file as a regular git blob, as an LFS object (a SHA-256 it computed
from the bytes it received), or in its Xet CAS: then it lists the SHA-256 the client *declared*
and a ``xetHash`` derived from chunks the CAS verified. Only the Xet hash speaks for the bytes,
so a Xet-stored file is compared by it, before a commit (is it unchanged?) and after (did it land?).

**Hashing.** ``hf_xet.hash_files`` (public) computes the Xet hash of a path. It takes paths
only, so when the client uploads over Xet the audit feeds it the bytes of its own read through a
named pipe (:class:`XetDigest`): one read of each staged file gives its SHA-256, its leak scan and
its Xet hash, of exactly the audited bytes. :class:`StagedXetHashes` computes any other when first
needed (an LFS publish keeping a file the branch stores over Xet). The upload then reads each file
once more to send it: the SHA-256 goes with it (``UploadInfo.sha256``), so hf_xet does not
compute it again, but its chunk hashes it computes while it sends (huggingface_hub offers no
way to hand over the ones known, nor to get back the Xet hash its upload computed).

**The upload within the deadline** (:func:`upload_within`). hf_xet reads its settings from its
documented environment variables when a Xet session starts; :func:`capped` sets them from the time
left and starts a new session for the upload. :func:`stop` ends the session, cancelling what it is
doing: the deadline's watchdog calls it when the time is up, as a server that answers one byte per
second trips none of hf_xet's timeouts. huggingface_hub keeps the session it uploads through to itself; the one way to
end it is ``huggingface_hub.utils._xet.abort_xet_session``, the function the client itself calls
on Ctrl-C (a private module: where a release removes it, the deadline still caps hf_xet's retries
and timeouts, but no longer cuts a trickling upload).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib.util
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Sequence

from huggingface_hub import constants

from .deadline import REQUEST_TIMEOUT_S, Deadline

if TYPE_CHECKING:
    from ..audit import AuditedFile
    from .client import RemoteFile

__all__ = [
    "Storage",
    "StagedXetHashes",
    "XetCheck",
    "XetDigest",
    "capped",
    "check_landed",
    "client_uploads_over_xet",
    "hash_files",
    "new_digest",
    "stop",
    "storage_of",
    "upload_within",
]


class Storage(str, Enum):
    """How the Hub stores a file (the receipt's ``storage``)."""

    LFS = "lfs"
    XET = "xet"
    REGULAR = "regular"


def storage_of(remote: RemoteFile) -> Storage:
    if remote.sha256 is None:
        return Storage.REGULAR
    return Storage.XET if remote.xet_hash else Storage.LFS


def client_uploads_over_xet() -> bool:
    """huggingface_hub uploads through Xet whenever hf_xet is installed, unless ``HF_HUB_DISABLE_XET``."""
    return not constants.HF_HUB_DISABLE_XET and importlib.util.find_spec("hf_xet") is not None


def hash_files(paths: Sequence[Path]) -> list[str | None]:
    """Each file's Xet hash (hf_xet's public ``hash_files``, which releases the GIL while it
    reads); all None when hf_xet is missing or fails: a Xet-stored file is then downloaded and
    hashed to be verified."""
    if not paths or importlib.util.find_spec("hf_xet") is None:
        return [None] * len(paths)
    import hf_xet

    try:
        return [info.hash for info in hf_xet.hash_files([str(path) for path in paths])]
    except Exception:  # hf_xet reports its own failures as plain exceptions
        return [None] * len(paths)


class XetDigest:
    """The Xet hash of the bytes fed to it, hashlib-style: :meth:`update`, then :meth:`hexdigest`.

    hf_xet hashes paths only, so its ``hash_files`` reads a named pipe (in a private folder)
    that :meth:`update` writes into: the audit's one read of a file feeds its SHA-256, its leak
    scan and this hash, and the hash is of exactly the bytes audited. hf_xet reads a path from
    start to end; ``tests/test_publish.py`` pins that a piped hash equals the file's.
    :meth:`hexdigest` is None when hf_xet fails or stops reading."""

    def __init__(self) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="xet-hash-")
        self._pipe = os.path.join(self._folder.name, "bytes")
        os.mkfifo(self._pipe, 0o600)
        self._hash: str | None = None
        self._fd: int | None = None
        self._broken = False
        self._reader = threading.Thread(target=self._read, name="xet-hash", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        self._hash = hash_files([Path(self._pipe)])[0]

    def _writer(self) -> int | None:
        """The pipe's write end, once hf_xet has opened the other one (None if it never does)."""
        while self._fd is None and not self._broken:
            try:
                self._fd = os.open(self._pipe, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO or not self._reader.is_alive():  # ENXIO: no reader yet
                    self._broken = True
                else:
                    time.sleep(0.0005)
            else:
                os.set_blocking(self._fd, True)
                with contextlib.suppress(OSError, AttributeError):  # fewer wake-ups (Linux only)
                    fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        return self._fd

    def update(self, data: bytes | bytearray | memoryview) -> None:
        fd = self._writer()
        if fd is None:
            return
        view = memoryview(data).cast("B")
        try:
            while view:
                view = view[os.write(fd, view) :]
        except OSError:  # hf_xet stopped reading
            self._broken = True

    def hexdigest(self) -> str | None:
        """End the input and return the hash (the pipe and its folder removed)."""
        fd = self._writer()  # opened even for no bytes at all: hf_xet then reads an empty input
        if fd is not None:
            os.close(fd)
            self._fd = None
        self._reader.join()
        self._folder.cleanup()
        return None if self._broken else self._hash


def new_digest() -> XetDigest | None:
    """A :class:`XetDigest` for the audit's read, or None where there is no hf_xet or named pipe."""
    if not hasattr(os, "mkfifo") or importlib.util.find_spec("hf_xet") is None:
        return None
    return XetDigest()


class StagedXetHashes:
    """The Xet hash of each staged file: the audit's, else computed once when first asked."""

    def __init__(self, stage: Path, audited: Mapping[str, AuditedFile]) -> None:
        self._stage = stage
        self._known = {name: entry.xet_hash for name, entry in audited.items() if entry.xet_hash}

    def of(self, name: str) -> str | None:
        if name not in self._known:
            self._known[name] = hash_files([self._stage / name])[0]
        return self._known[name]


# -- the upload, within the deadline -------------------------------------------------------------

# hf_xet's settings (its defaults when unset) and how much of the time left each may take.
_SETTINGS = {
    "HF_XET_CLIENT_RETRY_MAX_DURATION": (360.0, 1 / 3),
    "HF_XET_CLIENT_RETRY_BASE_DELAY": (3.0, 1 / 30),
    "HF_XET_CLIENT_READ_TIMEOUT": (300.0, 1.0),
    "HF_XET_CLIENT_CONNECT_TIMEOUT": (60.0, 1.0),
}
# The pipe's buffer: large enough that hf_xet rarely waits for the audit, or the audit for it.
_PIPE_BYTES = 1 << 20
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, None: 1.0, "m": 60.0, "h": 3600.0}


def _seconds(text: str | None, default: float) -> float:
    match = _DURATION.match(text or "")
    return float(match.group(1)) * _UNITS[match.group(2)] if match else default


@contextlib.contextmanager
def capped(remaining: float) -> Iterator[None]:
    """hf_xet's retry budget and timeouts capped by ``remaining`` seconds for an upload in this
    block (a user's smaller values are kept), in a session started for it."""
    left = max(remaining, 1.0)
    saved = {name: os.environ.get(name) for name in _SETTINGS}
    for name, (default, share) in _SETTINGS.items():
        limit = left * share if "TIMEOUT" not in name else min(left, REQUEST_TIMEOUT_S)
        os.environ[name] = f"{int(1000 * min(_seconds(saved[name], default), limit))}ms"
    stop()  # the next session reads the settings above
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def upload_within(deadline: Deadline) -> Iterator[None]:
    """The block may upload through Xet: hf_xet's settings capped by the time ``deadline`` has
    left, and the upload stopped by its watchdog when the time is up."""
    if not client_uploads_over_xet():
        yield
        return
    with capped(deadline.remaining()), deadline.stopping("the Xet upload", stop):
        yield


def stop() -> None:
    """End the client's Xet session now, cancelling its uploads; the next upload starts a new one."""
    try:
        from huggingface_hub.utils._xet import abort_xet_session  # see the module docstring
    except ImportError:
        return
    abort_xet_session()


# -- after landing --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class XetCheck:
    """A Xet-stored file checked: ``found`` is the audit's SHA-256 when the Hub holds the audited
    bytes (else the downloaded bytes' SHA-256, or None when no hash of them is known),
    ``checked_by`` how that was established."""

    found: str | None
    checked_by: str
    problem: str | None


def check_landed(
    path: str,
    expected: AuditedFile,
    remote: RemoteFile,
    ours: str | None,
    download_sha256: Callable[[], str | None],
) -> XetCheck:
    """``remote`` (Xet-stored) against the audited file whose Xet hash is ``ours``: equal Xet
    hashes, and the declared SHA-256 and size the audit's. Without ``ours`` (no hf_xet here), the
    file is downloaded and hashed (``download_sha256``)."""
    if ours is None:
        found = download_sha256()
        problem = None
        if found is None:  # read no further than the audited size: no hash of it to name
            problem = f"{path}: the Hub serves more than the audit's {expected.size} bytes (Xet)"
        elif found != expected.sha256:
            problem = (
                f"{path}: the Hub holds SHA-256 {found} (downloaded bytes (Xet)), the audit {expected.sha256}"
            )
        return XetCheck(found, "downloaded bytes (Xet)", problem)
    if remote.xet_hash != ours:
        problem = f"{path}: the Hub lists Xet hash {remote.xet_hash}, the audited bytes hash to {ours}"
        return XetCheck(None, "Hub Xet hash", problem)
    if remote.sha256 != expected.sha256 or remote.size != expected.size:
        problem = (
            f"{path}: the Hub lists SHA-256 {remote.sha256} and {remote.size} bytes, the audit "
            f"{expected.sha256} and {expected.size}"
        )
        return XetCheck(None, "Hub Xet hash", problem)
    return XetCheck(expected.sha256, "Hub Xet hash", None)
