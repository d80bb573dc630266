"""What the audit of a publish hands on: every staged file as audited, the stat snapshot that
notices a later edit without reading again, and the result said once it is in.

Shared by :mod:`.start` (which runs the audit), :mod:`.commit` (which waits for its result)
and :mod:`.landing` (which checks the snapshot before each commit attempt), and importing none
of them: the imports of the publish go one way. Like :mod:`.start`, it leaves the Hub client
out (the client loads while the audit reads).
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Callable

from ..audit import AuditedFile

__all__ = ["Audit", "StatKey", "audit_result", "stat_key"]

# Size, mtime, ctime and inode: a process can set a file's mtime back after writing it, never its ctime.
StatKey = tuple[int, int, int, int]
# What the audit hands on: every staged file, and the stat snapshot that notices a later edit.
Audit = tuple[dict[str, AuditedFile], dict[str, StatKey]]


def stat_key(path: Path) -> StatKey:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def audit_result(auditing: Future[Audit], stage: Path, say: Callable[[str], None]) -> Audit:
    """The audit's result (its refusal raised), said once it is in."""
    files, snapshot = auditing.result()
    say(f"audited {len(files)} files in {stage}/ against its MANIFEST.sha256 and scanned them for leaks")
    for entry in files.values():
        for words in entry.allowed_leaks:
            say(f"leak scan: {entry.name} holds {words}, allowed by the stage's card.allow_leaks")
    return files, snapshot
