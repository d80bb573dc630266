"""Publish the audited stage to the Hugging Face Hub as ONE atomic commit, verified after landing.

:func:`~.start.publish` runs, in order (:mod:`.start` up to the audit, then :func:`publish_audited`)::

    check    the Publication's values: folders, timeout, then the repo id while the audit reads
             (nothing sent yet)
    deadline --timeout starts once the Hub client is loaded (its import, which runs beside the
             audit, is not counted): it bounds everything below (deadline.py)
    audit    audit_stage(hub_stage/) under stage_lock, one read of every byte: each file against
             MANIFEST.sha256, scanned for leaks (pipeline.leaks: tokens, credential formats,
             private keys, this machine's paths and host name) and, when the client uploads
             over Xet, Xet-hashed for the check after landing; a leak refuses before any request.
             It reads on its own thread while this module, the Hub client, is imported
    sign     a signed stage's model.sig verified with the expected key (pipeline.signing)
    token    huggingface_hub.get_token() (HF_TOKEN or `hf auth login`); never printed or stored
    read     repo_info -> the branch head and its files; list_repo_tree at that head when a file
             may be unchanged, for its Xet hash (GET requests, retried)
    compare  remote LFS SHA-256s, Xet hashes, git blob ids against the audit: equal -> no commit
    commit   create_repo / create_branch if missing (retried: both exist_ok), then ONE
             create_commit(parent_commit=head) holding every new or changed staged file, plus
             deletions of files under the target folder that the stage no longer has
             (``.gitattributes`` stays)
    verify   LFS SHA-256s and Xet hashes the Hub lists, downloaded small files, against the audit
    receipt  hub_receipts/<namespace>--<name>-<commit12>.json beside the stage (--receipt-dir)
    tag      the verified commit, with --tag

Why one commit: a trainer that pushes on every save makes one commit per save, runs into
the Hub's commit rate limit (HTTP 429) and can leave a half-pushed repo behind.
``parent_commit`` makes the commit fail with 412 rather than land on top of someone else's
push that we never looked at.

No file is hashed twice, and an unchanged one is not read again: the upload takes the audit's
SHA-256 (:mod:`.landing`; the Xet hash: :mod:`.xet`). A check of every staged file before each
commit attempt, and the check after landing, catch a file edited between the audit and the upload.

Retries, all within the deadline: reads and repo creation are retried by :mod:`.client`; the
commit's attempts, and how a commit whose answer was lost is found on the branch (publishing
then goes on to verification and succeeds, saying so), are :mod:`.landing`'s. A rerun never
makes a second commit.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from huggingface_hub import HfApi, constants, get_token

from ..audit import AuditedFile
from ..commands import staged_command
from ..errors import PublishError, ReceiptNotWritten, TokenRejected, VerificationFailed
from ..layout import MANIFEST_FILE
from ..repo_ids import hub_repo_id
from ..signing import ExpectedSigner, SignatureCheck, verify_stage
from . import xet
from .audited import Audit, audit_result
from .client import Target, call, hub_errors, remote_files, tags
from .deadline import Deadline
from .landing import Publishing, land
from .plan import (
    KEPT_REMOTE_FILES,
    Publication,
    PublishPlan,
    check_staged_repo_id,
    clean_prefix,
    prepare_receipt_dir,
    read_plan,
    resolve_endpoint,
)
from .verify import Receipt, VerifiedFile, receipt_path, verify_commit, write_receipt

__all__ = ["PublishResult", "publish_audited"]


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
    audited: tuple[AuditedFile, ...] = ()
    """Every staged file as the audit found it (its hashes, and the leaks ``card.allow_leaks`` allowed)."""


# -- the whole publish, step by step, once the audit has started ---------------------------------


def publish_audited(
    publication: Publication,
    receipts: Path,
    timeout_s: float,
    auditing: Future[Audit],
    say: Callable[[str], None],
) -> PublishResult:
    """The rest of :func:`~.start.publish`, which checked ``publication``'s folders and timeout,
    holds the stage lock and started the audit (``auditing``): no request before its result."""
    deadline = Deadline(timeout_s)  # from now: importing this module is not the Hub's time
    wanted = replace(publication, repo_id=hub_repo_id(publication.repo_id))
    stage = Path(wanted.stage)
    endpoint, prefix = resolve_endpoint(wanted.endpoint), clean_prefix(wanted.path_in_repo)
    with deadline.installed():
        audited, snapshot = audit_result(auditing, stage, say)
        # A refusal's fix repeats the command that built this very stage, every flag of it.
        restage = staged_command(stage, audited[MANIFEST_FILE].sha256)
        wanted = replace(wanted, restage=restage or wanted.restage)
        check_staged_repo_id(stage, wanted.repo_id, wanted.force_repo_id, wanted.restage)
        signature = _signature(stage, wanted.signer, say)
        token = _token(wanted.dry_run)
        target = Target(
            HfApi(endpoint=endpoint, token=token),
            endpoint,
            wanted.repo_id,
            wanted.revision or constants.DEFAULT_REVISION,
            prefix,
            token,
            deadline,
            wanted.create_pr,
            say,
        )
        # Read the branch head and compare the files under it with the audit (read requests only).
        xet_hashes = xet.StagedXetHashes(stage, audited)
        plan = read_plan(target, stage, audited, wanted.message, xet_hashes)
        _check_tag(target, wanted.tag, plan)
        if wanted.dry_run:
            return PublishResult(plan, "dry run", signature=signature, audited=tuple(audited.values()))
        prepare_receipt_dir(receipts)
        if not plan.up_to_date and plan.head is None:
            # Create what is missing (the only writes before the commit), then plan again against the new head.
            _create_missing(target, plan, wanted.private)
            plan = read_plan(target, stage, audited, wanted.message, xet_hashes)
        run = Publishing(
            target, stage, audited, snapshot, receipts, signature, plan, wanted.restage, xet_hashes
        )
        if plan.up_to_date:
            say(
                f"{wanted.repo_id}@{target.revision} already holds exactly this stage at {plan.head}: no commit"
            )
            return _tagged(run, wanted.tag, _finish(run, plan.head, "already published"))  # type: ignore[arg-type]
        if plan.head is None:
            raise PublishError(
                f"{wanted.repo_id}@{target.revision} is still missing after creating it; rerun"
            )
        changed = sum(f.action != "unchanged" for f in plan.files)
        say(
            f"committing {changed} new or changed file(s) and {len(plan.deletions)} deletion(s) "
            f"onto {plan.head[:12]} of {target.revision}"
        )
        commit, lost = land(run)
        # The client returns the old head when it found nothing to change (a race with an identical push).
        status = "already published" if commit == plan.head else "published"
        return _tagged(run, wanted.tag, _finish(run, commit, status, answer_lost=lost))


# -- before any request -------------------------------------------------------------------------


def _signature(
    stage: Path, signer: ExpectedSigner | None, say: Callable[[str], None]
) -> SignatureCheck | None:
    signature = verify_stage(stage, signer)
    if signature is not None:
        say(
            f"signature {stage}/model.sig verified ({signature.kind}, {signature.fingerprint or 'Sigstore'}, "
            f"expected key from {signature.key_source})"
        )
    return signature


def _token(dry_run: bool) -> str | None:
    token = get_token()
    if token is None and not dry_run:
        raise TokenRejected(
            "no Hugging Face token: set HF_TOKEN or run `hf auth login` (a token is never "
            "taken from the command line); nothing was published"
        )
    return token


def _check_tag(target: Target, tag: str | None, plan: PublishPlan) -> None:
    """Before any write: an existing tag may only already name the commit that holds this stage."""
    existing = tags(target).get(tag) if tag else None
    if existing is not None and not (plan.up_to_date and existing == plan.head):
        raise PublishError(
            f"tag {tag} of {target.repo_id} already names commit {existing[:12]}, which does not "
            "hold this stage; tags are never moved: choose another --tag; nothing was sent"
        )


def _create_missing(target: Target, plan: PublishPlan, private: bool | None) -> None:
    """Create the repo and the branch when missing (both exist_ok, so a retry is harmless)."""
    if not plan.repo_exists:
        target.say(f"creating repo {target.repo_id} at {target.endpoint}")
        call(
            target,
            "creating the repo",
            lambda: target.api.create_repo(target.repo_id, private=private, exist_ok=True),
        )
    if target.revision != constants.DEFAULT_REVISION:
        target.say(f"creating branch {target.revision} from {constants.DEFAULT_REVISION}")
        call(
            target,
            f"creating branch {target.revision}",
            lambda: target.api.create_branch(target.repo_id, branch=target.revision, exist_ok=True),
        )


# -- verification, receipt and tag ----------------------------------------------------------------


def _finish(run: Publishing, commit: str, status: str, *, answer_lost: bool = False) -> PublishResult:
    """Verify ``commit`` against the audit, write the receipt, raise VerificationFailed on a difference."""
    target, plan = run.target, run.plan
    url = f"{target.endpoint}/{target.repo_id}/commit/{commit}"
    expected = {target.prefix + name: entry for name, entry in run.audited.items()}
    target.say(f"verifying {commit[:12]}: the Hub's LFS SHA-256s and Xet hashes, downloaded small files")
    landed = "is on the Hub" if status == "already published" else "landed"
    consequence = f"commit {url} {landed}"
    target.deadline.settle()
    try:
        with hub_errors(target, "verifying", consequence=consequence):
            # A commit the plan already listed (nothing was committed) is not listed again.
            listed = plan.listing if commit == plan.head else None
            remote = listed if listed is not None else remote_files(target, commit, consequence)
            files, problems = verify_commit(
                target,
                commit,
                expected,
                remote,
                KEPT_REMOTE_FILES if not target.prefix else frozenset(),
                run.xet_hashes,
            )
    except PublishError as exc:
        raise VerificationFailed(
            f"could not verify what landed: {exc}; rerun to verify (it makes no second commit)"
        ) from None
    path = receipt_path(run.receipts, target.repo_id, commit)
    # A no-op rerun keeps the receipt of the publish itself, with its original time.
    keep = status == "already published" and path.exists() and not problems
    if not keep:
        receipt = Receipt(
            endpoint=target.endpoint,
            repo_id=target.repo_id,
            revision=target.revision,
            path_in_repo=plan.path_in_repo,
            commit=commit,
            commit_url=url,
            parent=plan.head if status == "published" else None,
            status=status,
            step=plan.step,
            files=files,
            problems=problems,
            signature=None if run.signature is None else asdict(run.signature),
        )
        try:
            write_receipt(run.receipts, receipt)
        except OSError as exc:
            verified = "and differs from the audit" if problems else "and was verified"
            raise ReceiptNotWritten(
                f"commit {url} {landed} {verified}, but the receipt could not be written to "
                f"{path} ({exc.strerror or exc}); rerun with a writable --receipt-dir to write "
                "it (no second commit is made)"
            ) from None
    if problems:
        raise VerificationFailed(
            f"commit {url} landed but differs from the audited stage: {'; '.join(problems)}; receipt {path}"
        )
    return PublishResult(
        plan,
        status,
        commit,
        url,
        path,
        not keep,
        tuple(files),
        answer_lost,
        run.signature,
        tuple(run.audited.values()),
    )


def _tagged(run: Publishing, tag: str | None, result: PublishResult) -> PublishResult:
    """Tag the verified commit (kept as it is when the tag already names it)."""
    target = run.target
    if tag and tags(target).get(tag) is None:
        with hub_errors(
            target, f"tagging {tag}", consequence=f"commit {result.commit_url} landed and was verified"
        ):
            target.api.create_tag(target.repo_id, tag=tag, revision=result.commit)
        target.say(f"tagged {result.commit[:12]} as {tag}")  # type: ignore[index]
    return result
