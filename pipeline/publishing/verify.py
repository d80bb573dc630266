"""After a publish lands: check what the Hub holds against the audit, and write the receipt.

What the Hub's SHA-256 of a large file proves depends on how it was uploaded. Over Git LFS the
server hashed the bytes it received (the upload is refused otherwise), so that SHA-256 is the
server's own and is checked without downloading. Over Xet the server verified chunk, xorb and
file hashes, but the SHA-256 it lists is only what the client declared in its shard: a Xet-stored
file (one with a ``xetHash``) is therefore downloaded from the commit, rebuilt from the CAS, and
hashed, like the small (regular) files, of which the Hub lists only the git blob id.
"Verified" means the same under both protocols: the audit's SHA-256 matches bytes the server holds.
The receipt (``hub_receipts/<namespace>--<name>-<commit12>.json``) records the repo, the
commit and its URL, the time, every file's hash and how it was checked, and the stage
signature's key fingerprint (``signature``, null for an unsigned stage). It is written
atomically, outside the stage, and never holds the token.
"""

from __future__ import annotations

import datetime as _dt
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from huggingface_hub import HfApi

from ..audit import AuditedFile
from ..durable import write_json_atomic
from ..hashing import sha256_file

__all__ = [
    "RECEIPT_SCHEMA",
    "VerifiedFile",
    "verify_commit",
    "receipt_path",
    "write_receipt",
]

RECEIPT_SCHEMA = "pipeline.publish-receipt/1"


@dataclass(frozen=True, slots=True)
class VerifiedFile:
    """One staged file as found in the commit. ``found`` is the SHA-256 the check saw."""

    path_in_repo: str
    size: int
    sha256: str
    storage: str  # "lfs", "xet" or "regular"
    checked_by: str
    found: str | None

    @property
    def ok(self) -> bool:
        return self.found == self.sha256


def _check_file(api: HfApi, repo_id: str, commit: str, expected: AuditedFile, path: str, remote: Any,
                cache_dir: Path) -> VerifiedFile:
    if remote.lfs is not None and remote.xet_hash:
        # The listed SHA-256 is the client's own claim here: hash what the CAS rebuilds instead.
        downloaded = api.hf_hub_download(repo_id, path, revision=commit, cache_dir=cache_dir)
        return VerifiedFile(path, expected.size, expected.sha256, "xet", "downloaded bytes (Xet)",
                            sha256_file(downloaded))
    if remote.lfs is not None:
        # The Hub's own record of the LFS object: no need to download the weights again.
        found = remote.lfs.sha256 if remote.lfs.size == expected.size else None
        return VerifiedFile(path, expected.size, expected.sha256, "lfs", "Hub LFS SHA-256", found)
    downloaded = api.hf_hub_download(repo_id, path, revision=commit, cache_dir=cache_dir)
    return VerifiedFile(path, expected.size, expected.sha256, "regular", "downloaded bytes",
                        sha256_file(downloaded))


def verify_commit(api: HfApi, repo_id: str, commit: str, expected: Mapping[str, AuditedFile],
                  remote: Mapping[str, Any], kept: frozenset[str]) -> tuple[list[VerifiedFile], list[str]]:
    """Check ``remote`` (``{path: RepoFile}`` listed at ``commit``) against ``expected``
    (``{path_in_repo: AuditedFile}``). Returns the checked files and a list of problems
    (empty when the commit holds exactly the stage; paths in ``kept`` may also be there)."""
    problems = [f"{path} is in the commit but not in the stage"
                for path in sorted(remote) if path not in expected and path not in kept]
    checked: list[VerifiedFile] = []
    # A private cache: verification must download from the Hub, not reuse a cached copy.
    with tempfile.TemporaryDirectory(prefix="publish-verify-") as cache:
        for path, entry in expected.items():
            if path not in remote:
                problems.append(f"{path} is missing from the commit")
                continue
            result = _check_file(api, repo_id, commit, entry, path, remote[path], Path(cache))
            checked.append(result)
            if not result.ok:
                problems.append(f"{path}: the Hub holds SHA-256 {result.found} ({result.checked_by}), "
                                f"the audit {entry.sha256}")
    return checked, problems


def receipt_path(receipt_dir: Path, repo_id: str, commit: str) -> Path:
    return receipt_dir / f"{repo_id.replace('/', '--')}-{commit[:12]}.json"


def write_receipt(receipt_dir: Path, *, endpoint: str, repo_id: str, revision: str, path_in_repo: str,
                  commit: str, commit_url: str, parent: str | None, status: str, step: int,
                  files: list[VerifiedFile], problems: list[str],
                  signature: Mapping[str, Any] | None = None) -> Path:
    """Write the receipt atomically and return its path. ``signature`` is the verified
    stage signature (kind, key fingerprint, where the key came from), None when unsigned."""
    receipt_dir.mkdir(parents=True, exist_ok=True)
    path = receipt_path(receipt_dir, repo_id, commit)
    write_json_atomic(path, {
        "schema": RECEIPT_SCHEMA,
        "status": status,
        "repo_id": repo_id,
        "repo_type": "model",
        "endpoint": endpoint,
        "revision": revision,
        "path_in_repo": path_in_repo,
        "commit": commit,
        "commit_url": commit_url,
        "parent_commit": parent,
        "step": step,
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "verified": not problems,
        "signature": None if signature is None else dict(signature),
        "problems": problems,
        "files": {f.path_in_repo: {**asdict(f), "ok": f.ok} for f in files},
    })
    return path
