"""The start of a publish (:func:`publish`): its checks, the stage lock, and the audit, which
reads on its own thread while the Hub client is imported; :mod:`.commit` does the rest.

Importing the Hub client (huggingface_hub's ``HfApi``, httpx) is most of the Python work a
publish does besides the audit, about a third of a second; the audit is reading, SHA-256 and
the leak scan, mostly outside the GIL. So this module, and everything it imports, leaves the
client out (``tests/test_publish_safety.py`` pins it): the audit starts first, the client
loads beside it. Nothing is sent before the audit ends, not even a read request: the first
request waits for its result (:func:`.commit.publish_audited`), and a stage it refuses sends
none.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..audit import audit_stage, stage_lock
from ..errors import StageChanged
from ..leaks import leak_rules
from . import xet
from .audited import Audit, stat_key
from .deadline import default_timeout
from .plan import Publication, check_receipt_dir, check_timeout, clean_prefix

if TYPE_CHECKING:
    from .commit import PublishResult

__all__ = ["NOTHING_SENT", "publish"]

NOTHING_SENT = "nothing was published (no request was sent)"


def _quiet(line: str) -> None:
    pass


def publish(publication: Publication, *, say: Callable[[str], None] = _quiet) -> PublishResult:
    """Publish ``publication.stage`` to ``publication.repo_id`` as one commit; see :mod:`.commit`.

    ``say`` receives progress lines. Raises a :class:`~pipeline.errors.PublishError` (exit 2,
    nothing published), :class:`~pipeline.errors.VerificationFailed` (exit 1, the commit landed
    but does not match the audit) or :class:`~pipeline.errors.ReceiptNotWritten` (exit 1, landed
    and verified, no receipt). The token comes from :func:`huggingface_hub.get_token` only.
    """
    stage = Path(publication.stage)
    receipts = check_receipt_dir(publication.receipt_dir, stage)
    clean_prefix(publication.path_in_repo)
    timeout = check_timeout(publication.timeout_s)
    timeout_s = timeout if timeout is not None else default_timeout(_stage_bytes(stage))
    # Hold the stage lock from the audit to the end of the publish: 05 cannot rebuild the stage meanwhile.
    with stage_lock(stage), ThreadPoolExecutor(1, thread_name_prefix="publish-audit") as reader:
        # Re-audit and re-scan every staged file right before uploading, in one read; any
        # difference or leak refuses before any request.
        auditing = reader.submit(_audit, stage, verify_later=not publication.dry_run)
        from .commit import publish_audited  # the Hub client, imported while the audit reads

        return publish_audited(publication, receipts, timeout_s, auditing, say)


def _stage_bytes(stage: Path) -> int:
    """What the default deadline is derived from (0 for a missing stage: the audit refuses it)."""
    return sum(entry.stat().st_size for entry in stage.rglob("*") if entry.is_file()) if stage.is_dir() else 0


def _audit(stage: Path, *, verify_later: bool) -> Audit:
    """audit_stage with the leak scan and (for a Xet upload to verify later) the Xet hashes in
    the same read, with stat snapshots around it so later edits are noticed without reading again."""
    before = (
        {p.relative_to(stage).as_posix(): stat_key(p) for p in stage.rglob("*") if p.is_file()}
        if stage.is_dir()
        else {}
    )
    # Uploaded over Xet, the files are verified by their Xet hash: computed from the audit's read.
    xet_digest = xet.new_digest if verify_later and xet.client_uploads_over_xet() else None
    audited = audit_stage(stage, leaks=leak_rules(), xet_digest=xet_digest, consequence=NOTHING_SENT)
    snapshot = {name: stat_key(stage / name) for name in audited}
    if any(before.get(name) != key for name, key in snapshot.items()):
        raise StageChanged(f"{stage}/ changed while it was being audited; nothing was sent; rerun")
    return audited, snapshot
