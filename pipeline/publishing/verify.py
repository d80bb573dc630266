"""After a publish lands: check what the Hub holds against the audit, and write the receipt.

How each file is checked depends on how the Hub stores it, and never downloads the weights:

- **LFS**: the Hub hashed the bytes it received (the upload is refused otherwise), so the
  SHA-256 it lists is its own: compared with the audit's.
- **Xet** (a file listed with a ``xetHash``): the SHA-256 the Hub lists is only what the client
  declared in its shard, but the Xet hash is derived from chunks the CAS verified. The audit
  computed the Xet hash of the audited bytes (``hf_xet.hash_files``); the two must be equal,
  and the declared SHA-256 must be the audit's.
- **regular** (small files): the Hub lists only a git blob id, so they are downloaded from the
  commit into a private cache and hashed.

"Verified" means the same under each: the audit's SHA-256 matches bytes the server holds. The
receipt (``hub_receipts/<namespace>--<name>-<commit12>.json``) records the repo, the commit and
its URL, the time, every file's hash and how it was checked, and the stage signature's key
fingerprint (``signature``, null for an unsigned stage). It is written atomically, outside the
stage, and never holds the token.
"""

from __future__ import annotations

import datetime as _dt
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from huggingface_hub import HfApi

from ..audit import AuditedFile
from ..durable import write_json_atomic
from ..hashing import sha256_file

__all__ = ["RECEIPT_SCHEMA", "Receipt", "VerifiedFile", "verify_commit", "receipt_path", "write_receipt"]

RECEIPT_SCHEMA = "pipeline.publish-receipt/1"


@dataclass(frozen=True, slots=True)
class VerifiedFile:
    """One staged file as found in the commit. ``found`` is the SHA-256 the check confirmed
    (None when it differs); ``xet_hash`` the Xet hash the Hub lists for a Xet-stored file."""

    path_in_repo: str
    size: int
    sha256: str
    storage: str  # "lfs", "xet" or "regular"
    checked_by: str
    found: str | None
    xet_hash: str | None = None

    @property
    def ok(self) -> bool:
        return self.found == self.sha256


def _xet_hash_of(path: Path) -> str | None:
    """The Xet hash of a local file (hf_xet's public ``hash_files``), None without hf_xet."""
    try:
        import hf_xet

        return hf_xet.hash_files([str(path)])[0].hash
    except Exception:  # not installed, or it failed: the file is downloaded and hashed instead
        return None


def _check_xet(
    api: HfApi,
    repo_id: str,
    commit: str,
    expected: AuditedFile,
    path: str,
    remote: Any,
    local: Path,
    cache_dir: Path,
) -> tuple[VerifiedFile, str | None]:
    ours = expected.xet_hash or _xet_hash_of(local)
    if ours is None:  # no hf_xet here: rebuild the file from the CAS and hash it
        downloaded = api.hf_hub_download(repo_id, path, revision=commit, cache_dir=cache_dir)
        found = sha256_file(downloaded)
        return VerifiedFile(
            path, expected.size, expected.sha256, "xet", "downloaded bytes (Xet)", found, remote.xet_hash
        ), None
    same = remote.xet_hash == ours and remote.lfs.sha256 == expected.sha256 and remote.size == expected.size
    checked = VerifiedFile(
        path,
        expected.size,
        expected.sha256,
        "xet",
        "Hub Xet hash",
        expected.sha256 if same else None,
        remote.xet_hash,
    )
    if same:
        return checked, None
    if remote.xet_hash != ours:
        return checked, f"{path}: the Hub lists Xet hash {remote.xet_hash}, the audited bytes hash to {ours}"
    return checked, (
        f"{path}: the Hub lists SHA-256 {remote.lfs.sha256} and {remote.size} bytes, the audit "
        f"{expected.sha256} and {expected.size}"
    )


def _check_file(
    api: HfApi,
    repo_id: str,
    commit: str,
    expected: AuditedFile,
    path: str,
    remote: Any,
    local: Path,
    cache_dir: Path,
) -> tuple[VerifiedFile, str | None]:
    if remote.lfs is not None and remote.xet_hash:
        return _check_xet(api, repo_id, commit, expected, path, remote, local, cache_dir)
    if remote.lfs is not None:
        # The Hub's own record of the LFS object: no need to download the weights again.
        found = remote.lfs.sha256 if remote.lfs.size == expected.size else None
        checked = VerifiedFile(path, expected.size, expected.sha256, "lfs", "Hub LFS SHA-256", found)
    else:
        downloaded = api.hf_hub_download(repo_id, path, revision=commit, cache_dir=cache_dir)
        checked = VerifiedFile(
            path, expected.size, expected.sha256, "regular", "downloaded bytes", sha256_file(downloaded)
        )
    problem = (
        None
        if checked.ok
        else (
            f"{path}: the Hub holds SHA-256 {checked.found} ({checked.checked_by}), "
            f"the audit {expected.sha256}"
        )
    )
    return checked, problem


def verify_commit(
    api: HfApi,
    repo_id: str,
    commit: str,
    expected: Mapping[str, AuditedFile],
    remote: Mapping[str, Any],
    kept: frozenset[str],
    stage: Path,
) -> tuple[list[VerifiedFile], list[str]]:
    """Check ``remote`` (``{path: RepoFile}`` listed at ``commit``) against ``expected``
    (``{path_in_repo: AuditedFile}`` of the files in ``stage``). Returns the checked files and a
    list of problems (empty when the commit holds exactly the stage; paths in ``kept`` may also be there)."""
    problems = [
        f"{path} is in the commit but not in the stage"
        for path in sorted(remote)
        if path not in expected and path not in kept
    ]
    problems += [f"{path} is missing from the commit" for path in expected if path not in remote]
    present = [path for path in expected if path in remote]
    # A private cache: verification must download from the Hub, not reuse a cached copy. The small
    # files download side by side (each is a round trip or two, not a transfer).
    with tempfile.TemporaryDirectory(prefix="publish-verify-") as cache, ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(
                lambda path: _check_file(
                    api,
                    repo_id,
                    commit,
                    expected[path],
                    path,
                    remote[path],
                    stage / expected[path].name,
                    Path(cache),
                ),
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
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "verified": not receipt.problems,
            "signature": None if receipt.signature is None else dict(receipt.signature),
            "problems": receipt.problems,
            "files": {f.path_in_repo: {**asdict(f), "ok": f.ok} for f in receipt.files},
        },
    )
    return path
