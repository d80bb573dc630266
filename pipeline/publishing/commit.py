"""Publish the audited stage to the Hugging Face Hub as ONE atomic commit, verified after landing.

:func:`publish` runs, in order::

    audit    audit_stage(hub_stage/) under stage_lock: every file against MANIFEST.sha256
    scan     pipeline.leaks, the same scanner 05 runs: tokens (HF_TOKEN, the saved login, hf_...),
             private keys, and this machine's paths and host name; refuses before any request
    sign     a signed stage's model.sig verified with the expected key (pipeline.signing)
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

Bounded time: every request waits at most ``timeout_s`` (default 60 s) for the Hub, the
commit included: a request hook on the client's shared session sets the bound on every
request it sends (also those the client sends with its own ``timeout=``), and the documented
download and metadata timeouts follow; all is restored afterwards. The client may retry a
timed-out read a few times, each attempt bounded the same way. When the commit
request times out or its answer is lost, the branch head is read again: if it holds our
commit, publishing goes on to verification and succeeds, saying the answer was lost; if
not, nothing was committed (exit 2). A rerun never makes a second commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import httpx2
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, constants, get_token
from huggingface_hub.errors import (
    HfHubHTTPError,
    HFValidationError,
    RepositoryNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from ..audit import AuditedFile, audit_stage, stage_lock
from ..errors import (
    HubUnavailable,
    PublishError,
    ReceiptNotWritten,
    StageChanged,
    TokenRejected,
    UploadInterrupted,
    VerificationFailed,
)
from ..layout import INDEX_FILE, META_FILE, MODEL_FILE, RECEIPT_DIR
from ..leaks import leak_rules, scan_secrets
from ..signing import ExpectedSigner, SignatureCheck, verify_stage
from .client import (
    DEFAULT_TIMEOUT_S,
    Target,
    bounded_requests,
    find_cause,
    http_status,
    hub_errors,
    network_words,
    pull_requests,
    read_head,
    remote_files,
    retry_after,
)
from .verify import VerifiedFile, receipt_path, verify_commit, write_receipt

__all__ = [
    "COMMIT_ATTEMPTS",
    "DEFAULT_TIMEOUT_S",
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
    # With create_pr: the pull requests (refs/pr/N) open before the commit, so that after a
    # lost answer a new one holding the stage is known to be ours.
    pull_requests: tuple[str, ...] = ()

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
    answer_lost: bool = False
    """The commit's answer timed out or was cut; the commit was found on the branch."""
    signature: SignatureCheck | None = None


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


def _check_repo_id(repo_id: str) -> None:
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise PublishError(f"--repo-id {repo_id!r} is not a valid Hub repo id: use 'name' or 'namespace/name' "
                           "(letters, digits, '-', '_', '.'; no spaces, no '..'); nothing was published") from None


def _check_timeout(timeout: float) -> float:
    if not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
        raise PublishError(f"--timeout {timeout!r} must be a positive number of seconds")
    return float(timeout)


def _prepare_receipt_dir(folder: Path) -> None:
    """Before any write request: the receipt folder must exist and be writable, or be creatable."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PublishError(f"--receipt-dir {folder} cannot be created ({exc.strerror}); "
                           "nothing was published") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PublishError(f"--receipt-dir {folder} is not writable; nothing was published")


# -- comparing with the remote ---------------------------------------------------------------

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

def _check_staged_repo_id(stage: Path, repo_id: str, force: bool) -> None:
    """The card's snippet names the repo it was staged for: publishing it elsewhere would
    ship a card that downloads from another repo."""
    staged_for = json.loads((stage / META_FILE).read_bytes()).get("repo_id")
    if staged_for and staged_for != repo_id and not force:
        raise PublishError(f"{stage}/ was staged for {staged_for} (its card loads from there), not {repo_id}: "
                           f"restage with scripts/05_stage.py --repo-id {repo_id}, or pass --force-repo-id")


def _messages(stage: Path, audited: Mapping[str, AuditedFile], message: str | None) -> tuple[int, str, str, str]:
    """Step, weights SHA-256, commit title and description (meta.json was checked by the audit)."""
    step = int(json.loads((stage / META_FILE).read_bytes())["step"])
    # Sharded weights are named by their index, which lists every shard.
    weights = MODEL_FILE if MODEL_FILE in audited else INDEX_FILE
    sha = audited[weights].sha256
    title = message or f"Publish step {step}: {weights} sha256 {sha}"
    table = "\n".join(f"{e.sha256}  {e.size:>12}  {e.name}" for e in audited.values())
    return step, sha, title, f"Step {step}. {weights} SHA-256 {sha}.\n\nStaged files (SHA-256, bytes, name):\n{table}\n"


def _read_plan(target: Target, stage: Path, audited: Mapping[str, AuditedFile], message: str | None) -> PublishPlan:
    """The plan from read requests only; a missing branch is compared with main, where it would start."""
    head = read_head(target, target.revision)
    base = head or (read_head(target, constants.DEFAULT_REVISION) if target.revision != constants.DEFAULT_REVISION
                    else None)
    files, deletions = _compare(stage, audited, remote_files(target, base) if base else {}, target.prefix)
    step, sha, title, description = _messages(stage, audited, message)
    pulls = tuple(pull_requests(target)) if target.create_pr and base is not None else ()
    return PublishPlan(endpoint=target.endpoint, repo_id=target.repo_id, revision=target.revision,
                       path_in_repo=target.prefix.rstrip("/"), repo_exists=base is not None, head=head, step=step,
                       model_sha256=sha, title=title, description=description, files=files, deletions=deletions,
                       pull_requests=pulls)


def _create_missing(target: Target, plan: PublishPlan, private: bool | None, say: Callable[[str], None]) -> None:
    """Create the repo and the branch when missing: the only writes before the commit."""
    if not plan.repo_exists:
        say(f"creating repo {target.repo_id} at {target.endpoint}")
        with hub_errors(target, "creating the repo"):
            target.api.create_repo(target.repo_id, private=private, exist_ok=True)
    if target.revision != constants.DEFAULT_REVISION:
        say(f"creating branch {target.revision} from {constants.DEFAULT_REVISION}")
        with hub_errors(target, f"creating branch {target.revision}"):
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


def _try_commit(target: Target, plan: PublishPlan, stage: Path,
                audited: Mapping[str, AuditedFile]) -> str | HfHubHTTPError | BaseException:
    """One attempt: the new commit id, the 429/5xx answer to retry on, or the network error
    (timeout, cut connection) after which only the branch head can tell what happened."""
    with hub_errors(target, "uploading and committing"):
        try:
            info = target.api.create_commit(
                target.repo_id, _operations(stage, plan, audited), commit_message=plan.title,
                commit_description=plan.description, revision=target.revision, parent_commit=plan.head,
                create_pr=target.create_pr)
            return info.oid
        except HfHubHTTPError as exc:
            if http_status(exc) in _RETRYABLE:
                return exc
            raise
        except Exception as exc:
            network = find_cause(exc, (httpx2.TransportError, ConnectionError))
            if network is None or find_cause(exc, (HfHubHTTPError,)) is not None:
                raise
            return network


def _wait(exc: HfHubHTTPError, attempt: int, max_backoff: float, target: Target) -> float:
    """Seconds before the next attempt: Retry-After when given, else 1, 2, 4; refuse past the budget."""
    asked = retry_after(exc)
    wait = asked if asked is not None else min(max_backoff, float(2 ** (attempt - 1)))
    if wait > max_backoff:
        raise HubUnavailable(f"the Hub answered HTTP {http_status(exc)} to the commit on {target.repo_id} and asks to "
                             f"wait {wait:.0f}s, over this run's {max_backoff:g}s limit (PUBLISH_MAX_BACKOFF_S); "
                             "nothing was committed; rerun after that")
    return wait


def _holds_the_stage(target: Target, commit: str, stage: Path, audited: Mapping[str, AuditedFile]) -> bool:
    files, deletions = _compare(stage, audited, remote_files(target, commit), target.prefix)
    return not deletions and all(f.action == "unchanged" for f in files)


def _landed(target: Target, plan: PublishPlan, stage: Path, audited: Mapping[str, AuditedFile]) -> str | None:
    """After an error answer: the commit, if it landed. Pushed to a branch, the branch moved
    and holds exactly our stage; as a pull request (which leaves the branch where it was), a
    pull request opened since the plan was read holds exactly our stage."""
    if target.create_pr:
        opened = {ref: commit for ref, commit in pull_requests(target).items() if ref not in plan.pull_requests}
        return next((commit for _, commit in sorted(opened.items(), key=lambda kv: -int(kv[0].rsplit("/", 1)[-1]))
                     if _holds_the_stage(target, commit, stage, audited)), None)
    head = read_head(target, target.revision)
    if head is None or head == plan.head:
        return None
    return head if _holds_the_stage(target, head, stage, audited) else None


def _after_lost_answer(target: Target, plan: PublishPlan, stage: Path, audited: Mapping[str, AuditedFile],
                       network: BaseException, say: Callable[[str], None]) -> str:
    """The commit (or an upload before it) got no answer: the branch head says whether it landed."""
    what = network_words(target, network)
    say(f"{what} while uploading and committing; reading the branch head to see whether the commit landed")
    try:
        landed = _landed(target, plan, stage, audited)
    except PublishError as exc:
        raise UploadInterrupted(f"{what} while committing, and the branch head could not be read afterwards "
                                f"({exc}): the commit may or may not have landed; rerun: it finds a landed commit "
                                "and never makes a second one") from None
    if landed is None:
        raise UploadInterrupted(f"{what} while uploading and committing, and the head of {target.revision} did not "
                                "move: nothing was committed; rerun: it skips blobs already uploaded") from None
    say(f"the answer to the commit was lost, but the commit landed: {landed}")
    return landed


def _commit(target: Target, plan: PublishPlan, stage: Path, audited: Mapping[str, AuditedFile],
            snapshot: Mapping[str, tuple[int, int, int]], *, sleep: Callable[[float], None], max_backoff: float,
            say: Callable[[str], None]) -> tuple[str, bool]:
    """ONE create_commit naming ``plan.head`` as parent, retried on 429/5xx only. Returns the
    commit id and whether its answer was lost (the commit was found on the branch)."""
    for attempt in range(1, COMMIT_ATTEMPTS + 1):
        _check_unchanged(stage, snapshot)
        answer = _try_commit(target, plan, stage, audited)
        if isinstance(answer, str):
            return answer, False
        if not isinstance(answer, HfHubHTTPError):
            return _after_lost_answer(target, plan, stage, audited, answer, say), True
        if attempt == COMMIT_ATTEMPTS:
            break
        wait = _wait(answer, attempt, max_backoff, target)
        say(f"the commit got HTTP {http_status(answer)}; retrying in {wait:g}s (attempt {attempt + 1} of {COMMIT_ATTEMPTS})")
        sleep(wait)
        # The answer can be lost after the commit landed: then there is nothing left to retry.
        landed = _landed(target, plan, stage, audited)
        if landed is not None:
            say(f"the commit had landed despite the error answer: {landed}")
            return landed, True
    raise HubUnavailable(f"the Hub answered HTTP {http_status(answer)} to the commit on {target.repo_id} "
                         f"{COMMIT_ATTEMPTS} times; nothing was committed; rerun later (uploaded blobs are kept)")


# -- verification and receipt ---------------------------------------------------------------

def _finish(target: Target, plan: PublishPlan, audited: Mapping[str, AuditedFile], commit: str, status: str,
            receipts: Path, say: Callable[[str], None], *, answer_lost: bool = False,
            signature: SignatureCheck | None = None) -> PublishResult:
    """Verify ``commit`` against the audit, write the receipt, raise VerificationFailed on a difference."""
    url = f"{target.endpoint}/{target.repo_id}/commit/{commit}"
    expected = {target.prefix + name: entry for name, entry in audited.items()}
    say(f"verifying {commit[:12]}: Hub LFS SHA-256s, downloaded bytes of Xet-stored and small files")
    landed = "is on the Hub" if status == "already published" else "landed"
    try:
        with hub_errors(target, "verifying", consequence=f"commit {url} {landed}"):
            remote = remote_files(target, commit)
            files, problems = verify_commit(target.api, target.repo_id, commit, expected, remote,
                                            KEPT_REMOTE_FILES if not target.prefix else frozenset())
    except PublishError as exc:
        raise VerificationFailed(f"could not verify what landed: {exc}; rerun to verify (it makes no second "
                                 "commit)") from None
    path = receipt_path(receipts, target.repo_id, commit)
    # A no-op rerun keeps the receipt of the publish itself, with its original time.
    keep = status == "already published" and path.exists() and not problems
    if not keep:
        try:
            write_receipt(receipts, endpoint=target.endpoint, repo_id=target.repo_id, revision=target.revision,
                          path_in_repo=plan.path_in_repo, commit=commit, commit_url=url,
                          parent=plan.head if status == "published" else None, status=status, step=plan.step,
                          files=files, problems=problems,
                          signature=None if signature is None else asdict(signature))
        except OSError as exc:
            verified = "and differs from the audit" if problems else "and was verified"
            raise ReceiptNotWritten(f"commit {url} {landed} {verified}, but the receipt could not be written to "
                                    f"{path} ({exc.strerror or exc}); rerun with a writable --receipt-dir to write "
                                    "it (no second commit is made)") from None
    if problems:
        raise VerificationFailed(f"commit {url} landed but differs from the audited stage: {'; '.join(problems)}; "
                                 f"receipt {path}")
    return PublishResult(plan, status, commit, url, path, not keep, tuple(files), answer_lost, signature)


def _existing_tag(target: Target, tag: str) -> str | None:
    with hub_errors(target, f"reading the tags of {target.repo_id}"):
        try:
            refs = target.api.list_repo_refs(target.repo_id)
        except RepositoryNotFoundError:
            return None
    return next((ref.target_commit for ref in refs.tags if ref.name == tag), None)


def _check_tag(target: Target, tag: str | None, plan: PublishPlan) -> None:
    """Before any write: an existing tag may only already name the commit that holds this stage."""
    existing = _existing_tag(target, tag) if tag else None
    if existing is not None and not (plan.up_to_date and existing == plan.head):
        raise PublishError(f"tag {tag} of {target.repo_id} already names commit {existing[:12]}, which does not "
                           "hold this stage; tags are never moved: choose another --tag; nothing was sent")


def _tagged(target: Target, tag: str | None, result: PublishResult, say: Callable[[str], None]) -> PublishResult:
    """Tag the verified commit (kept as it is when the tag already names it)."""
    if tag and _existing_tag(target, tag) is None:
        with hub_errors(target, f"tagging {tag}"):
            target.api.create_tag(target.repo_id, tag=tag, revision=result.commit)
        say(f"tagged {result.commit[:12]} as {tag}")
    return result


# -- entry point ----------------------------------------------------------------------------

def _token(dry_run: bool) -> str | None:
    token = get_token()
    if token is None and not dry_run:
        raise TokenRejected("no Hugging Face token: set HF_TOKEN or run `hf auth login` (a token is never "
                            "taken from the command line); nothing was published")
    return token


def _audit(stage: Path, say: Callable[[str], None]) -> tuple[dict[str, AuditedFile], dict[str, tuple[int, int, int]]]:
    """audit_stage, with stat snapshots around it so later edits are noticed without hashing again."""
    before = ({p.relative_to(stage).as_posix(): _stat_key(p) for p in stage.rglob("*") if p.is_file()}
              if stage.is_dir() else {})
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
            timeout_s: float = DEFAULT_TIMEOUT_S, signer: ExpectedSigner | None = None,
            force_repo_id: bool = False, create_pr: bool = False, tag: str | None = None,
            sleep: Callable[[float], None] = time.sleep,
            say: Callable[[str], None] = lambda line: None) -> PublishResult:
    """Publish ``stage_dir`` to ``repo_id`` as one commit; see the module docstring.

    The token comes from :func:`huggingface_hub.get_token` only. ``timeout_s`` bounds each
    Hub request; ``signer`` says who must have signed a signed stage. ``force_repo_id``
    publishes a stage whose card names another repo; ``create_pr`` opens a pull request
    against ``revision`` instead of pushing to it; ``tag`` tags the verified commit (a tag
    that names another commit is refused, never moved). ``say`` receives progress lines.
    Raises a :class:`PublishError` (exit 2, nothing published), :class:`VerificationFailed`
    (exit 1, the commit landed but does not match the audit) or :class:`ReceiptNotWritten`
    (exit 1, landed and verified, no receipt).
    """
    stage = Path(stage_dir)
    _check_repo_id(repo_id)
    receipts = _check_receipt_dir(receipt_dir, stage)
    endpoint = resolve_endpoint(endpoint)
    prefix = _clean_prefix(path_in_repo)
    max_backoff = _max_backoff(max_backoff_s)
    timeout = _check_timeout(timeout_s)
    with bounded_requests(timeout):
        # Hold the stage lock from the audit to the end of the commit: 05 cannot rebuild the stage meanwhile.
        with stage_lock(stage):
            # Re-audit every staged file right before uploading; any difference refuses before any request.
            audited, snapshot = _audit(stage, say)
            # The stage may have been edited since 05 scanned it: the same scan again, before any request.
            scan_secrets(stage, leak_rules(), consequence="nothing was published (no request was sent)")
            _check_staged_repo_id(stage, repo_id, force_repo_id)
            signature = verify_stage(stage, signer)
            if signature is not None:
                say(f"signature {stage}/model.sig verified ({signature.kind}, {signature.fingerprint or 'Sigstore'}, "
                    f"expected key from {signature.key_source})")
            token = _token(dry_run)
            target = Target(HfApi(endpoint=endpoint, token=token), endpoint, repo_id,
                             revision or constants.DEFAULT_REVISION, prefix, token, timeout, create_pr)
            # Read the branch head and compare the files under it with the audit (read requests only).
            plan = _read_plan(target, stage, audited, message)
            _check_tag(target, tag, plan)
            if dry_run:
                return PublishResult(plan, "dry run", signature=signature)
            _prepare_receipt_dir(receipts)
            if not plan.up_to_date and plan.head is None:
                # Create what is missing, then plan again against the new head.
                _create_missing(target, plan, private, say)
                plan = _read_plan(target, stage, audited, message)
            if plan.up_to_date:
                say(f"{repo_id}@{target.revision} already holds exactly this stage at {plan.head}: no commit")
                return _tagged(target, tag, _finish(target, plan, audited, plan.head, "already published", receipts,
                                                    say, signature=signature), say)
            if plan.head is None:
                raise PublishError(f"{repo_id}@{target.revision} is still missing after creating it; rerun")
            changed = sum(f.action != "unchanged" for f in plan.files)
            say(f"committing {changed} new or changed file(s) and {len(plan.deletions)} deletion(s) "
                f"onto {plan.head[:12]} of {target.revision}")
            commit, lost = _commit(target, plan, stage, audited, snapshot, sleep=sleep, max_backoff=max_backoff,
                                   say=say)
        # The client returns the old head when it found nothing to change (a race with an identical push).
        status = "already published" if commit == plan.head else "published"
        return _tagged(target, tag, _finish(target, plan, audited, commit, status, receipts, say, answer_lost=lost,
                                            signature=signature), say)


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
