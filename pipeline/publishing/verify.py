"""After a publish lands: check what the Hub holds against the audit, and write the receipt.

How each file is checked depends on how the Hub stores it (:class:`~.xet.Storage`), and never
downloads the weights:

- **LFS**: the Hub hashed the bytes it received (the upload is refused otherwise), so the
  SHA-256 it lists is its own: compared with the audit's.
- **Xet** (a file listed with a ``xetHash``): the Xet hash of the audited bytes against the one
  the Hub lists, and the declared SHA-256 and size against the audit's (:func:`.xet.check_landed`).
- **regular** (small files): the Hub lists only a git blob id, so they are downloaded from the
  commit (one GET each, side by side) and hashed.

"Verified" means the same under each: the audit's SHA-256 matches bytes the server holds. The
receipt (``hub_receipts/<namespace>--<name>-<commit12>.json`` beside the stage) records the
repo, the commit and its URL, the time, every file's hash and how it was checked, and the stage
signature's key fingerprint (``signature``, null for an unsigned stage). It is written
atomically, outside the stage, and never holds the token.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from huggingface_hub import get_session, hf_hub_url
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

from ..audit import AuditedFile
from ..durable import utc_now, write_json_atomic
from ..hashing import CHUNK
from .client import RemoteFile, Target
from .xet import StagedXetHashes, Storage, check_landed, storage_of

__all__ = ["RECEIPT_SCHEMA", "Receipt", "VerifiedFile", "verify_commit", "receipt_path", "write_receipt"]

RECEIPT_SCHEMA = "pipeline.publish-receipt/1"
# Small files are downloaded side by side: each is a round trip or two, not a transfer.
_DOWNLOADS = 8


@dataclass(frozen=True, slots=True)
class VerifiedFile:
    """One staged file as found in the commit. ``found`` is the SHA-256 the check confirmed
    (None when it differs); ``xet_hash`` the Xet hash the Hub lists for a Xet-stored file."""

    path_in_repo: str
    size: int
    sha256: str
    storage: Storage
    checked_by: str
    found: str | None
    xet_hash: str | None = None

    @property
    def ok(self) -> bool:
        return self.found == self.sha256


def _download_sha256(target: Target, commit: str, path: str, size: int) -> str | None:
    """SHA-256 of the file as the Hub serves it from ``commit`` (in memory, never cached on disk,
    never more than ``size`` + 1 bytes); None when the Hub sends more than ``size`` bytes."""
    url = hf_hub_url(target.repo_id, path, revision=commit, endpoint=target.endpoint)
    digest, received = hashlib.sha256(), 0
    with get_session().stream("GET", url, headers=build_hf_headers(token=target.token)) as response:
        hf_raise_for_status(response)
        for chunk in response.iter_bytes(CHUNK):
            received += len(chunk)
            if received > size:
                return None
            digest.update(chunk)
    return digest.hexdigest()


def _check_file(
    target: Target,
    commit: str,
    expected: AuditedFile,
    path: str,
    remote: RemoteFile,
    xet_hashes: StagedXetHashes,
) -> tuple[VerifiedFile, str | None]:
    try:
        return _check(target, commit, expected, path, remote, xet_hashes)
    except HfHubHTTPError as exc:  # its download answered with an error: this file cannot be checked
        status = getattr(exc.response, "status_code", None)
        refused = VerifiedFile(
            path,
            expected.size,
            expected.sha256,
            storage_of(remote),
            "download refused",
            None,
            remote.xet_hash,
        )
        return refused, f"{path}: the Hub answers HTTP {status} to its download, so it cannot be checked"


def _check(
    target: Target,
    commit: str,
    expected: AuditedFile,
    path: str,
    remote: RemoteFile,
    xet_hashes: StagedXetHashes,
) -> tuple[VerifiedFile, str | None]:
    storage = storage_of(remote)
    checked: VerifiedFile
    if storage is Storage.XET:
        xet = check_landed(
            path,
            expected,
            remote,
            xet_hashes.of(expected.name),
            lambda: _download_sha256(target, commit, path, expected.size),
        )
        checked = VerifiedFile(
            path, expected.size, expected.sha256, storage, xet.checked_by, xet.found, remote.xet_hash
        )
        return checked, xet.problem
    if storage is Storage.LFS:
        # The Hub's own record of the LFS object: no need to download the weights again.
        found = remote.sha256 if remote.size == expected.size else None
        checked = VerifiedFile(path, expected.size, expected.sha256, storage, "Hub LFS SHA-256", found)
        if remote.size != expected.size:  # its SHA-256 may be ours: a record of other bytes all the same
            return (
                checked,
                f"{path}: the Hub's LFS record lists {remote.size} bytes, the audit {expected.size}",
            )
    else:
        found = _download_sha256(target, commit, path, expected.size)
        checked = VerifiedFile(path, expected.size, expected.sha256, storage, "downloaded bytes", found)
        if found is None:  # read no further than the audited size: no hash of it to name
            return checked, f"{path}: the Hub serves more than the audit's {expected.size} bytes"
    problem = (
        None
        if checked.ok
        else f"{path}: the Hub holds SHA-256 {checked.found} ({checked.checked_by}), the audit {expected.sha256}"
    )
    return checked, problem


def verify_commit(
    target: Target,
    commit: str,
    expected: Mapping[str, AuditedFile],
    remote: Mapping[str, RemoteFile],
    kept: frozenset[str],
    xet_hashes: StagedXetHashes,
) -> tuple[list[VerifiedFile], list[str]]:
    """Check ``remote`` (the files listed at ``commit``) against ``expected`` (``{path_in_repo:
    AuditedFile}`` of the staged files). Returns the checked files and a list of problems (empty
    when the commit holds exactly the stage; paths in ``kept`` may also be there)."""
    problems = [
        f"{path} is in the commit but not in the stage"
        for path in sorted(remote)
        if path not in expected and path not in kept
    ]
    problems += [f"{path} is missing from the commit" for path in expected if path not in remote]
    present = [path for path in expected if path in remote]
    target.deadline.follow_session()
    with ThreadPoolExecutor(_DOWNLOADS) as pool:
        results = list(
            pool.map(
                lambda path: _check_file(target, commit, expected[path], path, remote[path], xet_hashes),
                present,
            )
        )
    problems += [problem for _, problem in results if problem]
    return [checked for checked, _ in results], problems


@dataclass(kw_only=True, slots=True)
class Receipt:
    """What a receipt records about one publish (see the module docstring)."""

    endpoint: str
    """The Hub's URL."""
    repo_id: str
    """The repo published to."""
    revision: str
    """The branch the commit was made on (or proposed against, for a pull request)."""
    path_in_repo: str
    """The repo folder that received the stage ('' for the root)."""
    commit: str
    """The commit that holds the stage."""
    commit_url: str
    """Its URL."""
    parent: str | None
    """The branch head it was made on top of; None when it was published before."""
    status: str
    """``published`` or ``already published``."""
    step: int | None
    """The training step of the published weights (None: unknown, a folder staged by 05 --from-folder)."""
    files: list[VerifiedFile]
    """Every staged file as the check after landing found it."""
    problems: list[str]
    """What differs from the audit (empty: verified)."""
    signature: Mapping[str, Any] | None = None
    """The verified stage signature (kind, key fingerprint, where the key came from); None when unsigned."""


def receipt_path(receipt_dir: Path, repo_id: str, commit: str) -> Path:
    return receipt_dir / f"{repo_id.replace('/', '--')}-{commit[:12]}.json"


def write_receipt(receipt_dir: Path, receipt: Receipt) -> Path:
    """Write ``receipt`` atomically into ``receipt_dir`` and return its path."""
    receipt_dir.mkdir(parents=True, exist_ok=True)
    path = receipt_path(receipt_dir, receipt.repo_id, receipt.commit)
    write_json_atomic(
        path,
        {
            "schema": RECEIPT_SCHEMA,
            "status": receipt.status,
            "repo_id": receipt.repo_id,
            "repo_type": "model",
            "endpoint": receipt.endpoint,
            "revision": receipt.revision,
            "path_in_repo": receipt.path_in_repo,
            "commit": receipt.commit,
            "commit_url": receipt.commit_url,
            "parent_commit": receipt.parent,
            "step": receipt.step,
            "time": utc_now(),
            "verified": not receipt.problems,
            "signature": None if receipt.signature is None else dict(receipt.signature),
            "problems": receipt.problems,
            "files": {
                f.path_in_repo: {**asdict(f), "storage": f.storage.value, "ok": f.ok} for f in receipt.files
            },
        },
    )
    return path
