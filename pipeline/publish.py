"""Publish the audited stage to the Hugging Face Hub as ONE atomic commit, verified after landing.

:func:`publish` runs, in order::

    audit    audit_stage(hub_stage/) under stage_lock: every file against MANIFEST.sha256
    token    huggingface_hub.get_token() (HF_TOKEN or `hf auth login`); never printed or stored
    read     repo_info -> the branch head; list_repo_tree at that head (GET requests only)
    compare  remote LFS SHA-256 / git blob ids against the audit: equal -> nothing to commit
    commit   create_repo / create_branch if missing, then ONE create_commit(parent_commit=head)
             holding every staged file, plus deletions of files under the target folder that
             the stage no longer has (``.gitattributes`` stays)
    verify   Hub LFS SHA-256s, downloaded Xet and small files against the audit (publish_verify)
    receipt  hub_receipts/<namespace>--<name>-<commit12>.json, outside the stage

Why one commit: a trainer that pushes on every save makes one commit per save, runs into
the Hub's commit rate limit (HTTP 429) and can leave a half-pushed repo behind.
``parent_commit`` makes the commit fail with 412 rather than land on top of someone else's
push that we never looked at.

No file is hashed twice: the audit's SHA-256 is handed to each ``CommitOperationAdd``
through the public ``UploadInfo.sha256`` setter. The pinned client (2.4) hashes lazily, so
building the operation reads only the size and the first 512 bytes, and it skips its own
hashing (LFS and Xet paths alike) for operations whose hash is already set. The upload still
reads the bytes, of course; a size/mtime/inode check before each commit attempt, and the
check after landing, catch a file edited between the audit and the upload.

Retries: the client retries preupload, LFS batch, PUT and verify requests on 429/5xx and
network errors by itself, but never the commit request. :func:`publish` retries the commit
on 429 and 5xx only, at most ``COMMIT_ATTEMPTS`` times, waiting ``Retry-After`` when given
(else 1, 2, 4 s), never longer than ``max_backoff_s``. 412 is never retried.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import httpx2
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, constants, get_token
from huggingface_hub.errors import (
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from .audit import AuditedFile, audit_stage, stage_lock
from .errors import (
    HubUnavailable,
    PipelineError,
    PublishError,
    StageChanged,
    StaleBranch,
    TokenRejected,
    UploadInterrupted,
    VerificationFailed,
)
from .layout import META_FILE, MODEL_FILE, RECEIPT_DIR
from .publish_verify import VerifiedFile, receipt_path, verify_commit, write_receipt

__all__ = [
    "COMMIT_ATTEMPTS",
    "PublishPlan",
    "PublishResult",
    "publish",
    "format_plan",
]

# Commit attempts on 429/5xx answers, the first one included.
COMMIT_ATTEMPTS = 4
# Longest single wait before retrying the commit; PUBLISH_MAX_BACKOFF_S overrides it.
DEFAULT_MAX_BACKOFF_S = 60.0
# Kept in the repo although not staged: the Hub writes it, and it routes files to LFS.
KEPT_REMOTE_FILES = frozenset({".gitattributes"})
_RETRYABLE = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class PlannedFile:
    """One staged file of the commit; ``action`` is ``add``, ``update`` or ``unchanged``."""

    name: str
    path_in_repo: str
    size: int
    sha256: str
    action: str


@dataclass(frozen=True, slots=True)
class PublishPlan:
    """What a publish would do, computed from the audit and read requests only.

    ``head`` is the branch head the commit will name as its parent (None while the repo
    or the branch does not exist yet)."""

    endpoint: str
    repo_id: str
    revision: str
    path_in_repo: str
    repo_exists: bool
    head: str | None
    step: int
    model_sha256: str
    title: str
    description: str
    files: tuple[PlannedFile, ...]
    deletions: tuple[str, ...]

    @property
    def repo_url(self) -> str:
        return f"{self.endpoint}/{self.repo_id}"

    @property
    def up_to_date(self) -> bool:
        """The branch already holds exactly the stage: publishing makes no commit."""
        return self.head is not None and not self.deletions and all(f.action == "unchanged" for f in self.files)


@dataclass(frozen=True, slots=True)
class PublishResult:
    """``status``: ``dry run``, ``published`` or ``already published``. ``receipt_written``
    is False when an earlier receipt for the same commit was kept."""

    plan: PublishPlan
    status: str
    commit: str | None = None
    commit_url: str | None = None
    receipt: Path | None = None
    receipt_written: bool = False
    files: tuple[VerifiedFile, ...] = ()


@dataclass(frozen=True, slots=True)
class _Target:
    """Where we publish: the client, and what error messages need to name."""

    api: HfApi
    endpoint: str
    repo_id: str
    revision: str
    prefix: str  # "" for the repo root, else "folder/"
    token: str | None


# -- small helpers --------------------------------------------------------------------------

def resolve_endpoint(endpoint: str | None = None) -> str:
    """``--endpoint``, else ``HF_ENDPOINT``, else the client's default (https://huggingface.co)."""
    return (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def git_blob_sha1_file(path: str | Path, size: int) -> str:
    """Git blob id of a file: what the Hub lists as ``oid`` for a file not stored in LFS."""
    digest = hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _max_backoff(value: float | None) -> float:
    raw = os.environ.get("PUBLISH_MAX_BACKOFF_S") if value is None else value
    try:
        return DEFAULT_MAX_BACKOFF_S if raw in (None, "") else float(raw)
    except ValueError:
        raise PublishError(f"PUBLISH_MAX_BACKOFF_S={raw!r} is not a number of seconds") from None


def _clean_prefix(path_in_repo: str | None) -> str:
    """'' for the repo root, else ``folder/`` (no leading slash, no '.' or '..' parts)."""
    text = (path_in_repo or "").strip("/")
    if text and any(part in ("", ".", "..") for part in text.split("/")):
        raise PublishError(f"--path-in-repo {path_in_repo!r} must be a plain folder path such as 'model' or 'v1/model'")
    return text + "/" if text else ""


def _check_receipt_dir(receipt_dir: str | Path, stage: Path) -> Path:
    folder = Path(receipt_dir)
    if folder.resolve().is_relative_to(stage.resolve()):
        raise PublishError(f"--receipt-dir {folder} is inside the stage {stage}/, which is uploaded as it is: "
                           "write receipts elsewhere (default: hub_receipts/)")
    return folder


def _status(exc: HfHubHTTPError) -> int | None:
    return getattr(getattr(exc, "response", None), "status_code", None)


def _retry_after(exc: HfHubHTTPError) -> float | None:
    response = getattr(exc, "response", None)
    raw = response.headers.get("Retry-After") if response is not None else None
    try:
        return max(0.0, float(raw)) if raw is not None else None
    except ValueError:
        return None  # an HTTP date: use our own backoff


def _cause(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of ``kinds`` in ``exc``'s chain (failed uploads come wrapped in RuntimeError)."""
    seen: BaseException | None = exc
    for _ in range(16):
        if seen is None or isinstance(seen, kinds):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


# -- error translation ----------------------------------------------------------------------

def _http_error(target: _Target, action: str, exc: HfHubHTTPError) -> PublishError:
    status = _status(exc)
    if status in (401, 403):
        return TokenRejected(f"token rejected or no write access to {target.repo_id} at {target.endpoint} "
                             f"(HTTP {status} while {action}): check HF_TOKEN / `hf auth login` and that the token "
                             "may write to this namespace; nothing was published")
    if status == 412:
        return StaleBranch(f"someone pushed to {target.revision} of {target.repo_id} since it was read; nothing "
                           "was written; rerun to publish on top of the new head")
    detail = getattr(exc, "server_message", None) or (str(exc).strip().splitlines() or [""])[0]
    detail = " ".join(str(detail).split())
    if target.token:
        detail = detail.replace(target.token, "<token>")
    return PublishError(f"the Hub answered HTTP {status} while {action} on {target.repo_id}: {detail}; "
                        "nothing was committed")


@contextlib.contextmanager
def _hub_errors(target: _Target, action: str) -> Iterator[None]:
    """Turn client exceptions into one-line domain errors (none of which contains the token)."""
    try:
        yield
    except PipelineError:
        raise
    except Exception as exc:
        http = _cause(exc, (HfHubHTTPError,))
        if http is not None:
            raise _http_error(target, action, http) from None  # type: ignore[arg-type]
        network = _cause(exc, (httpx2.TransportError, ConnectionError))
        if network is None:
            raise
        # The Xet client reports every CAS failure (a refused xorb too) as ConnectionError: say which.
        detail = " ".join((str(network).splitlines() or [""])[0].split())[:300]
        if target.token:
            detail = detail.replace(target.token, "<token>")
        raise UploadInterrupted(
            f"connection to {target.endpoint} lost while {action} ({type(network).__name__}: {detail}): no commit exists "
            "unless the commit request itself was cut; rerun: it skips blobs already uploaded and never makes "
            "a second commit") from None


# -- reading the remote ---------------------------------------------------------------------

def _read_head(target: _Target, revision: str) -> str | None:
    """Commit id at the head of ``revision``, or None when the repo or the branch is missing."""
    with _hub_errors(target, f"reading branch {revision}"):
        try:
            return target.api.repo_info(target.repo_id, revision=revision).sha
        except (RepositoryNotFoundError, RevisionNotFoundError):
            return None


def _remote_files(target: _Target, commit: str) -> dict[str, Any]:
    """``{path: RepoFile}`` under the target folder (the whole repo for the root) at ``commit``."""
    with _hub_errors(target, "listing the repo files"):
        try:
            entries = target.api.list_repo_tree(target.repo_id, target.prefix.rstrip("/") or None,
                                                recursive=True, revision=commit)
            return {entry.path: entry for entry in entries if hasattr(entry, "blob_id")}
        except RemoteEntryNotFoundError:
            return {}  # the folder does not exist yet


def _action(stage: Path, audited: AuditedFile, remote: Any | None) -> str:
    """Compare one staged file with the remote entry at the same path."""
    if remote is None:
        return "add"
    if remote.size != audited.size:
        return "update"
    if remote.lfs is not None:
        return "unchanged" if remote.lfs.sha256 == audited.sha256 else "update"
    # A regular file is listed by its git blob id (SHA-1 of header + bytes): hash the small local file.
    return "unchanged" if remote.blob_id == git_blob_sha1_file(stage / audited.name, audited.size) else "update"


def _compare(stage: Path, audited: Mapping[str, AuditedFile], remote: Mapping[str, Any],
             prefix: str) -> tuple[tuple[PlannedFile, ...], tuple[str, ...]]:
    files = tuple(PlannedFile(name, prefix + name, entry.size, entry.sha256,
                              _action(stage, entry, remote.get(prefix + name)))
                  for name, entry in audited.items())
    staged = {f.path_in_repo for f in files}
    return files, tuple(sorted(p for p in remote if p not in staged and p not in KEPT_REMOTE_FILES))


# -- planning -------------------------------------------------------------------------------

def _messages(stage: Path, audited: Mapping[str, AuditedFile], message: str | None) -> tuple[int, str, str, str]:
    """Step, weights SHA-256, commit title and description (meta.json was checked by the audit)."""
    step = int(json.loads((stage / META_FILE).read_bytes())["step"])
    sha = audited[MODEL_FILE].sha256
    title = message or f"Publish step {step}: {MODEL_FILE} sha256 {sha}"
    table = "\n".join(f"{e.sha256}  {e.size:>12}  {e.name}" for e in audited.values())
    return step, sha, title, f"Step {step}. {MODEL_FILE} SHA-256 {sha}.\n\nStaged files (SHA-256, bytes, name):\n{table}\n"


def _read_plan(target: _Target, stage: Path, audited: Mapping[str, AuditedFile], message: str | None) -> PublishPlan:
    """The plan from read requests only; a missing branch is compared with main, where it would start."""
    head = _read_head(target, target.revision)
    base = head or (_read_head(target, constants.DEFAULT_REVISION) if target.revision != constants.DEFAULT_REVISION
                    else None)
    files, deletions = _compare(stage, audited, _remote_files(target, base) if base else {}, target.prefix)
    step, sha, title, description = _messages(stage, audited, message)
    return PublishPlan(endpoint=target.endpoint, repo_id=target.repo_id, revision=target.revision,
                       path_in_repo=target.prefix.rstrip("/"), repo_exists=base is not None, head=head, step=step,
                       model_sha256=sha, title=title, description=description, files=files, deletions=deletions)


def _create_missing(target: _Target, plan: PublishPlan, private: bool | None, say: Callable[[str], None]) -> None:
    """Create the repo and the branch when missing: the only writes before the commit."""
    if not plan.repo_exists:
        say(f"creating repo {target.repo_id} at {target.endpoint}")
        with _hub_errors(target, "creating the repo"):
            target.api.create_repo(target.repo_id, private=private, exist_ok=True)
    if target.revision != constants.DEFAULT_REVISION:
        say(f"creating branch {target.revision} from {constants.DEFAULT_REVISION}")
        with _hub_errors(target, f"creating branch {target.revision}"):
            target.api.create_branch(target.repo_id, branch=target.revision, exist_ok=True)


# -- the commit -----------------------------------------------------------------------------

def _stat_key(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


def _check_unchanged(stage: Path, snapshot: Mapping[str, tuple[int, int, int]]) -> None:
    """Cheap guard between audit and upload: size, mtime and inode of every staged file."""
    for name, key in snapshot.items():
        path = stage / name
        if not path.is_file() or _stat_key(path) != key:
            raise StageChanged(f"{path} changed on disk after it was audited; nothing was committed; rebuild "
                               "the stage with scripts/05_stage.py, then rerun")


def _operations(stage: Path, plan: PublishPlan, audited: Mapping[str, AuditedFile]) -> list[Any]:
    """Fresh operations for one attempt (the client refuses to reuse committed ones)."""
    ops: list[Any] = []
    for planned in plan.files:
        entry = audited[planned.name]
        op = CommitOperationAdd(path_in_repo=planned.path_in_repo, path_or_fileobj=str(stage / entry.name))
        if op.upload_info.size != entry.size:
            raise StageChanged(f"{stage / entry.name} is {op.upload_info.size} bytes, not the {entry.size} it had "
                               "when audited; nothing was committed; rerun")
        # The audit's SHA-256, so the client does not read and hash the file a second time.
        op.upload_info.sha256 = bytes.fromhex(entry.sha256)
        ops.append(op)
    return ops + [CommitOperationDelete(path_in_repo=path) for path in plan.deletions]


def _try_commit(target: _Target, plan: PublishPlan, stage: Path,
                audited: Mapping[str, AuditedFile]) -> str | HfHubHTTPError:
    """One attempt: the new commit id, or the 429/5xx answer to retry on."""
    with _hub_errors(target, "uploading and committing"):
        try:
            info = target.api.create_commit(
                target.repo_id, _operations(stage, plan, audited), commit_message=plan.title,
                commit_description=plan.description, revision=target.revision, parent_commit=plan.head)
            return info.oid
        except HfHubHTTPError as exc:
            if _status(exc) in _RETRYABLE:
                return exc
            raise


def _wait(exc: HfHubHTTPError, attempt: int, max_backoff: float, target: _Target) -> float:
    """Seconds before the next attempt: Retry-After when given, else 1, 2, 4; refuse past the budget."""
    asked = _retry_after(exc)
    wait = asked if asked is not None else min(max_backoff, float(2 ** (attempt - 1)))
    if wait > max_backoff:
        raise HubUnavailable(f"the Hub answered HTTP {_status(exc)} to the commit on {target.repo_id} and asks to "
                             f"wait {wait:.0f}s, over this run's {max_backoff:g}s limit (PUBLISH_MAX_BACKOFF_S); "
                             "nothing was committed; rerun after that")
    return wait


def _landed(target: _Target, plan: PublishPlan, stage: Path, audited: Mapping[str, AuditedFile]) -> str | None:
    """After an error answer: the new head, if the branch moved and holds exactly our stage."""
    head = _read_head(target, target.revision)
    if head is None or head == plan.head:
        return None
    files, deletions = _compare(stage, audited, _remote_files(target, head), target.prefix)
    return head if not deletions and all(f.action == "unchanged" for f in files) else None


def _commit(target: _Target, plan: PublishPlan, stage: Path, audited: Mapping[str, AuditedFile],
            snapshot: Mapping[str, tuple[int, int, int]], *, sleep: Callable[[float], None], max_backoff: float,
            say: Callable[[str], None]) -> str:
    """ONE create_commit naming ``plan.head`` as parent, retried on 429/5xx only."""
    for attempt in range(1, COMMIT_ATTEMPTS + 1):
        _check_unchanged(stage, snapshot)
        answer = _try_commit(target, plan, stage, audited)
        if isinstance(answer, str):
            return answer
        if attempt == COMMIT_ATTEMPTS:
            break
        wait = _wait(answer, attempt, max_backoff, target)
        say(f"the commit got HTTP {_status(answer)}; retrying in {wait:g}s (attempt {attempt + 1} of {COMMIT_ATTEMPTS})")
        sleep(wait)
        # The answer can be lost after the commit landed: then there is nothing left to retry.
        landed = _landed(target, plan, stage, audited)
        if landed is not None:
            say(f"the commit had landed despite the error answer: {landed}")
            return landed
    raise HubUnavailable(f"the Hub answered HTTP {_status(answer)} to the commit on {target.repo_id} "
                         f"{COMMIT_ATTEMPTS} times; nothing was committed; rerun later (uploaded blobs are kept)")


# -- verification and receipt ---------------------------------------------------------------

def _finish(target: _Target, plan: PublishPlan, audited: Mapping[str, AuditedFile], commit: str, status: str,
            receipts: Path, say: Callable[[str], None]) -> PublishResult:
    """Verify ``commit`` against the audit, write the receipt, raise VerificationFailed on a difference."""
    url = f"{target.endpoint}/{target.repo_id}/commit/{commit}"
    expected = {target.prefix + name: entry for name, entry in audited.items()}
    say(f"verifying {commit[:12]}: Hub LFS SHA-256s, downloaded bytes of Xet-stored and small files")
    try:
        remote = _remote_files(target, commit)
        with _hub_errors(target, "verifying"):
            files, problems = verify_commit(target.api, target.repo_id, commit, expected, remote,
                                            KEPT_REMOTE_FILES if not target.prefix else frozenset())
    except PublishError as exc:
        raise VerificationFailed(f"commit {url} landed but could not be verified: {exc}; rerun to verify "
                                 "(it makes no second commit)") from None
    path = receipt_path(receipts, target.repo_id, commit)
    # A no-op rerun keeps the receipt of the publish itself, with its original time.
    keep = status == "already published" and path.exists() and not problems
    if not keep:
        write_receipt(receipts, endpoint=target.endpoint, repo_id=target.repo_id, revision=target.revision,
                      path_in_repo=plan.path_in_repo, commit=commit, commit_url=url,
                      parent=plan.head if status == "published" else None, status=status, step=plan.step,
                      files=files, problems=problems)
    if problems:
        raise VerificationFailed(f"commit {url} landed but differs from the audited stage: {'; '.join(problems)}; "
                                 f"receipt {path}")
    return PublishResult(plan, status, commit, url, path, not keep, tuple(files))


# -- entry point ----------------------------------------------------------------------------

def _token(dry_run: bool) -> str | None:
    token = get_token()
    if token is None and not dry_run:
        raise TokenRejected("no Hugging Face token: set HF_TOKEN or run `hf auth login` (a token is never "
                            "taken from the command line); nothing was published")
    return token


def _audit(stage: Path, say: Callable[[str], None]) -> tuple[dict[str, AuditedFile], dict[str, tuple[int, int, int]]]:
    """audit_stage, with stat snapshots around it so later edits are noticed without hashing again."""
    before = {p.name: _stat_key(p) for p in stage.iterdir() if p.is_file()} if stage.is_dir() else {}
    audited = audit_stage(stage)
    snapshot = {name: _stat_key(stage / name) for name in audited}
    if any(before.get(name) != key for name, key in snapshot.items()):
        raise StageChanged(f"{stage}/ changed while it was being audited; nothing was sent; rerun")
    say(f"audited {len(audited)} files in {stage}/ against its MANIFEST.sha256")
    return audited, snapshot


def publish(stage_dir: str | Path, repo_id: str, *, endpoint: str | None = None,
            revision: str = constants.DEFAULT_REVISION, private: bool | None = None,
            path_in_repo: str | None = None, message: str | None = None, dry_run: bool = False,
            receipt_dir: str | Path = RECEIPT_DIR, max_backoff_s: float | None = None,
            sleep: Callable[[float], None] = time.sleep,
            say: Callable[[str], None] = lambda line: None) -> PublishResult:
    """Publish ``stage_dir`` to ``repo_id`` as one commit; see the module docstring.

    The token comes from :func:`huggingface_hub.get_token` only. ``say`` receives progress
    lines. Raises a :class:`PublishError` (exit 2, nothing published) or
    :class:`VerificationFailed` (exit 1, the commit landed but does not match the audit).
    """
    stage = Path(stage_dir)
    receipts = _check_receipt_dir(receipt_dir, stage)
    endpoint = resolve_endpoint(endpoint)
    prefix = _clean_prefix(path_in_repo)
    max_backoff = _max_backoff(max_backoff_s)
    # Hold the stage lock from the audit to the end of the commit: 05 cannot rebuild the stage meanwhile.
    with stage_lock(stage):
        # Re-audit every staged file right before uploading; any difference refuses before any request.
        audited, snapshot = _audit(stage, say)
        token = _token(dry_run)
        target = _Target(HfApi(endpoint=endpoint, token=token), endpoint, repo_id,
                         revision or constants.DEFAULT_REVISION, prefix, token)
        # Read the branch head and compare the files under it with the audit (read requests only).
        plan = _read_plan(target, stage, audited, message)
        if dry_run:
            return PublishResult(plan, "dry run")
        if not plan.up_to_date and plan.head is None:
            # Create what is missing, then plan again against the new head.
            _create_missing(target, plan, private, say)
            plan = _read_plan(target, stage, audited, message)
        if plan.up_to_date:
            say(f"{repo_id}@{target.revision} already holds exactly this stage at {plan.head}: no commit")
            return _finish(target, plan, audited, plan.head, "already published", receipts, say)
        if plan.head is None:
            raise PublishError(f"{repo_id}@{target.revision} is still missing after creating it; rerun")
        changed = sum(f.action != "unchanged" for f in plan.files)
        say(f"committing {changed} new or changed file(s) and {len(plan.deletions)} deletion(s) "
            f"onto {plan.head[:12]} of {target.revision}")
        commit = _commit(target, plan, stage, audited, snapshot, sleep=sleep, max_backoff=max_backoff, say=say)
    # The client returns the old head when it found nothing to change (a race with an identical push).
    status = "already published" if commit == plan.head else "published"
    return _finish(target, plan, audited, commit, status, receipts, say)


def format_plan(plan: PublishPlan) -> str:
    """The planned commit as text: target and parent, then each file with size and SHA-256."""
    if plan.head is not None:
        where = f"branch {plan.revision} at {plan.head}"
    elif plan.repo_exists:
        where = f"new branch {plan.revision}, would be created from {constants.DEFAULT_REVISION}"
    else:
        where = f"new repo, would be created; branch {plan.revision}"
    width = max(len(f.path_in_repo) for f in plan.files)
    lines = [f"target  {plan.repo_url} ({where})", f"commit  {plan.title}"]
    lines += [f"  {f.action:<9}  {f.path_in_repo:<{width}}  {f.size:>10} B  sha256 {f.sha256}" for f in plan.files]
    lines += [f"  {'delete':<9}  {path}" for path in plan.deletions]
    if plan.up_to_date:
        lines.append(f"nothing to publish: {plan.repo_id}@{plan.revision} already holds exactly this stage")
    return "\n".join(lines)
