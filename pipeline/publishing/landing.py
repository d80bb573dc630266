"""The one commit of a publish: sent, retried within the deadline, and found where its answer was lost.

:func:`land` sends ONE ``create_commit`` naming the head the plan read as ``parent_commit``, so
a push in between fails with 412 instead of being overwritten. Before each attempt, a size,
mtime, ctime and inode check of every staged file (:func:`stat_key`) catches an edit since the
audit. Only new and changed files are handed to the client, each with the audit's SHA-256
(the public ``UploadInfo.sha256`` setter): the client skips its own hashing (LFS and Xet paths
alike) for an operation whose hash is set, and reads the bytes only to send them.

Retries, all within the deadline: the client retries preupload, LFS batch, PUT and verify
requests on 429/5xx and network errors by itself, and hf_xet its CAS requests (budget capped
by the deadline, :func:`.xet.upload_within`); the commit is retried here on 429 and 5xx only,
at most ``COMMIT_ATTEMPTS`` times, waiting ``Retry-After`` when given (else 1, 2, 4 s). 412 is
never retried. When the commit's answer is lost or an error answer may hide a landed commit,
the branch head is read again (a pull request: the pull requests opened since the plan): if
it holds exactly our stage, the commit landed; if not, nothing was committed (exit 2). A rerun
never makes a second commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import httpx2
from huggingface_hub import CommitOperationAdd, CommitOperationDelete
from huggingface_hub.errors import HfHubHTTPError

from ..audit import AuditedFile
from ..errors import (
    DeadlinePassed,
    HubUnavailable,
    PublishError,
    PublishTimedOut,
    StageChanged,
    UploadInterrupted,
    shown,
)
from ..signing import SignatureCheck
from . import xet
from .audited import StatKey, stat_key
from .client import (
    RERUN,
    Target,
    answered,
    find_cause,
    http_status,
    hub_errors,
    network_words,
    pull_requests,
    read_head,
    remote_files,
    retry_after,
)
from .deadline import RETRYABLE
from .plan import PublishPlan, compare

__all__ = ["COMMIT_ATTEMPTS", "Publishing", "land"]

# Commit attempts on 429/5xx answers, the first one included.
COMMIT_ATTEMPTS = 4


@dataclass(slots=True)
class Publishing:
    """One publish in progress: what every step after the plan needs."""

    target: Target
    stage: Path
    audited: dict[str, AuditedFile]
    snapshot: dict[str, StatKey]
    """Size, mtime and inode of every staged file when audited."""
    receipts: Path
    signature: SignatureCheck | None
    plan: PublishPlan
    restage: str
    """The command that rebuilds the stage (:attr:`Publication.restage`)."""
    xet_hashes: xet.StagedXetHashes
    """The Xet hash of each staged file (the audit's, or computed when first needed)."""


def land(run: Publishing) -> tuple[str, bool]:
    """ONE create_commit naming ``plan.head`` as parent, retried on 429/5xx only, within the
    deadline. Returns the commit id and whether it was found on the branch after an error
    answer or none (its answer was lost)."""
    deadline, say = run.target.deadline, run.target.say
    for attempt in range(1, COMMIT_ATTEMPTS + 1):
        _check_unchanged(run.stage, run.snapshot, run.restage)
        answer = _try_commit(run)
        if isinstance(answer, str):
            return answer, False
        if not isinstance(answer, HfHubHTTPError):
            return _after_lost_answer(run, answer), True
        asked = retry_after(answer)
        wait = float(2 ** (attempt - 1)) if asked is None else asked
        status = http_status(answer)
        if attempt == COMMIT_ATTEMPTS or wait >= deadline.remaining():
            break
        say(
            f"{answered(answer)} got HTTP {status}; retrying the commit in {wait:g}s (attempt {attempt + 1} of "
            f"{COMMIT_ATTEMPTS})"
        )
        deadline.sleep(wait)
        # The answer can be lost after the commit landed: then there is nothing left to retry.
        landed, _ = _landed(run)
        if landed is not None:
            say(f"the commit had landed despite the error answer: {landed}")
            return landed, True
    # Giving up: an error answer may still hide a commit that landed.
    deadline.settle()
    landed, _ = _landed(run)
    if landed is not None:
        say(f"the commit had landed despite the error answer: {landed}")
        return landed, True
    if attempt == COMMIT_ATTEMPTS:
        reason = f"{COMMIT_ATTEMPTS} times"
    else:  # our backoff, or a Retry-After that passed the deadline's own check moments ago
        reason = f"and a retry after {wait:g}s would be past the {deadline.timeout:g}s --timeout"
    raise HubUnavailable(
        f"the Hub answered HTTP {status} to {answered(answer)} on {run.target.repo_id} {reason}; "
        "nothing was committed; rerun later (uploaded blobs are kept)"
    )


def _check_unchanged(stage: Path, snapshot: Mapping[str, StatKey], restage: str) -> None:
    """Cheap guard between audit and upload: size, mtime, ctime and inode of every staged file."""
    for name, key in snapshot.items():
        path = stage / name
        if not path.is_file() or stat_key(path) != key:
            raise StageChanged(
                f"{path} changed on disk after it was audited; nothing was committed; rebuild "
                f"the stage with {restage}, then rerun"
            )


def _operations(run: Publishing) -> list[Any]:
    """Fresh operations for one attempt (the client refuses to reuse committed ones): the new and
    changed files, a file to repair deleted first, then the deletions of files no longer staged."""
    ops: list[Any] = []
    for planned in run.plan.files:
        if planned.action == "unchanged":
            continue
        entry = run.audited[planned.name]
        op = CommitOperationAdd(
            path_in_repo=planned.path_in_repo, path_or_fileobj=str(run.stage / entry.name)
        )
        if op.upload_info.size != entry.size:
            raise StageChanged(
                f"{run.stage / entry.name} is {op.upload_info.size} bytes, not the {entry.size} it "
                "had when audited; nothing was committed; rerun"
            )
        # The audit's SHA-256, so the client does not read and hash the file a second time.
        op.upload_info.sha256 = bytes.fromhex(entry.sha256)
        if planned.action == "repair":
            ops.append(CommitOperationDelete(path_in_repo=planned.path_in_repo))
        ops.append(op)
    return ops + [CommitOperationDelete(path_in_repo=path) for path in run.plan.deletions]


def _try_commit(run: Publishing) -> str | HfHubHTTPError | BaseException:
    """One attempt: the new commit id, the 429/5xx answer to retry on, or what cut it short
    (a timeout, a cut connection, the Xet client giving up, the deadline), after which only
    the branch head can tell whether the commit landed."""
    target, plan = run.target, run.plan
    with hub_errors(target, "uploading and committing"), xet.upload_within(target.deadline):
        target.deadline.follow_session()
        try:
            info = target.api.create_commit(
                target.repo_id,
                _operations(run),
                commit_message=plan.title,
                commit_description=plan.description,
                revision=target.revision,
                parent_commit=plan.head,
                create_pr=target.create_pr,
            )
            return info.oid
        except HfHubHTTPError as exc:
            if http_status(exc) in RETRYABLE:
                target.deadline.note(f"HTTP {http_status(exc)} to the commit")
                return exc
            raise
        except Exception as exc:
            if target.deadline.expired() and find_cause(exc, (DeadlinePassed,)) is None:
                # The watchdog cut the upload (the Xet client reports a cancelled task).
                return DeadlinePassed(f"the upload was cut at the deadline ({type(exc).__name__})")
            cut = find_cause(exc, (DeadlinePassed, httpx2.TransportError, ConnectionError))
            if cut is None or (
                find_cause(exc, (HfHubHTTPError,)) is not None and not isinstance(cut, DeadlinePassed)
            ):
                raise
            return cut


def _after_lost_answer(run: Publishing, cut: BaseException) -> str:
    """The commit (or an upload before it) got no answer: the branch head says whether it landed."""
    target = run.target
    action = "uploading and committing"
    timed_out = isinstance(cut, DeadlinePassed)
    what = target.deadline.why(action, cut) if timed_out else f"{network_words(target, cut)} while {action}"  # type: ignore[arg-type]
    target.say(f"{what}; reading the branch head to see whether the commit landed")
    target.deadline.settle()
    try:
        landed, not_ours = _landed(run)
    except PublishError as exc:
        raise UploadInterrupted(
            f"{what}, and the branch head could not be read afterwards ({exc}): the commit "
            "may or may not have landed; rerun: it finds a landed commit and never makes a "
            "second one"
        ) from None
    if landed is None:
        error = PublishTimedOut if timed_out else UploadInterrupted
        raise error(f"{what}, and {not_ours}: nothing was committed; {RERUN}")
    target.say(f"the answer to the commit was lost, but the commit landed: {landed}")
    return landed


def _holds_the_stage(run: Publishing, commit: str) -> bool:
    remote = remote_files(run.target, commit)
    files, deletions = compare(run.stage, run.audited, remote, run.target.prefix, run.xet_hashes)
    return not deletions and all(f.action == "unchanged" for f in files)


def _landed(run: Publishing) -> tuple[str | None, str]:
    """After an error answer: the commit, if it landed, else what the Hub shows instead. Pushed
    to a branch, the branch moved and holds exactly our stage; as a pull request (which leaves
    the branch where it was), a pull request opened since the plan was read holds exactly our stage."""
    target, plan = run.target, run.plan
    if target.create_pr:
        opened = {
            ref: commit for ref, commit in pull_requests(target).items() if ref not in plan.pull_requests
        }
        ours = next(
            (
                commit
                for _, commit in sorted(opened.items(), key=lambda kv: -int(kv[0].rsplit("/", 1)[-1]))
                if _holds_the_stage(run, commit)
            ),
            None,
        )
        return ours, "no pull request opened since the plan holds the stage"
    head = read_head(target, target.revision)
    if head is None:
        # The plan read a head there, so the branch (or the repo) was deleted since.
        return None, f"branch {target.revision} no longer exists"
    if head == plan.head:
        return None, f"the head of {target.revision} did not move"
    if _holds_the_stage(run, head):
        return head, ""
    # The id is the Hub's text: shown inert, so a hostile answer cannot break or forge the line.
    return (
        None,
        f"the head of {target.revision} moved to {shown(head)}, which is not this stage (someone else pushed)",
    )
