"""What a publish is asked to do (:class:`Publication`) and what it would do (:class:`PublishPlan`).

The plan is computed from the audit and read requests only: the branch head the commit will
name as its parent, and each staged file compared with the file at the same path under it
(LFS files by their SHA-256, Xet-stored files also by their Xet hash, regular files by their git
blob id), plus the files under the target folder that the stage no longer has. One request reads
the head and its files; the file listing, which alone gives Xet hashes, is read too when a file
may be unchanged (its SHA-256 is the audit's), and the check after landing reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Mapping

from huggingface_hub import constants

from ..audit import AuditedFile
from ..commands import with_option
from ..errors import PublishError
from ..layout import (
    HUB_MODEL_FILE,
    INDEX_FILE,
    META_FILE,
    MODEL_FILE,
    RECEIPT_DIR,
    STAGE_DIR,
    receipts_beside,
)
from ..signing import ExpectedSigner
from .deadline import MAX_TIMEOUT_S
from .xet import StagedXetHashes

if TYPE_CHECKING:
    from .client import RemoteFile, Target

__all__ = [
    "KEPT_REMOTE_FILES",
    "Action",
    "PlannedFile",
    "Publication",
    "PublishPlan",
    "format_plan",
    "read_plan",
]

# Kept in the repo although not staged: the Hub writes it, and it routes files to LFS.
KEPT_REMOTE_FILES = frozenset({".gitattributes"})
# What the commit does with a staged file. "repair": the branch has the file's SHA-256 but another
# Xet hash (the Hub holds other bytes): the file is deleted and added again in the same commit,
# since the client drops an addition whose SHA-256 the branch already holds.
Action = Literal["add", "update", "repair", "unchanged"]


@dataclass(kw_only=True, slots=True)
class Publication:
    """One publish: which stage goes where, and how (the flags of scripts/06_publish.py)."""

    repo_id: str
    """The model repo, ``namespace/name`` (or its page's address, ``https://huggingface.co/namespace/name``)."""
    stage: str | Path = STAGE_DIR
    """The stage folder scripts/05_stage.py built."""
    endpoint: str | None = None
    """Hub URL; None: ``HF_ENDPOINT``, else https://huggingface.co."""
    revision: str = constants.DEFAULT_REVISION
    """Branch to commit to; created from main when missing."""
    private: bool | None = None
    """Create the repo private when it is missing (None: the Hub's default)."""
    path_in_repo: str = ""
    """Folder of the repo that receives the stage ('' for the root)."""
    message: str | None = None
    """Commit title; None names the step and the weights' SHA-256."""
    dry_run: bool = False
    """Plan only: read requests, no write, no receipt."""
    receipt_dir: str | Path | None = None
    """Where the receipt is written; never inside the stage. None: ``hub_receipts`` beside the
    stage (:func:`pipeline.layout.receipts_beside`), with the outputs of the config that staged it."""
    timeout_s: float | None = None
    """Deadline of the whole publish, in seconds; None: the default publish timeout
    (:func:`~pipeline.publishing.default_timeout`)."""
    signer: ExpectedSigner | None = None
    """Who must have signed a signed stage (:mod:`pipeline.signing`); None: the stage's own key."""
    force_repo_id: bool = False
    """Publish a stage whose card names another repo."""
    create_pr: bool = False
    """Open a pull request against ``revision`` instead of pushing to it."""
    tag: str | None = None
    """Tag the verified commit; a tag that names another commit is refused, never moved."""
    restage: str = "python scripts/05_stage.py"
    """The command that rebuilds this stage, as a refusal tells it, when 05 left no record of
    the command that built it (:func:`pipeline.commands.staged_command`; 06 adds its ``--config``)."""


@dataclass(frozen=True, slots=True)
class PlannedFile:
    """One staged file of the commit, and what the commit does with it."""

    name: str
    path_in_repo: str
    size: int
    sha256: str
    action: Action


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
    step: int | None
    """The training step of the staged weights (None: a folder staged without one, 05 --from-folder)."""
    model_sha256: str
    title: str
    description: str
    files: tuple[PlannedFile, ...]
    deletions: tuple[str, ...]
    # With create_pr: the pull requests (refs/pr/N) open before the commit, so that after a
    # lost answer a new one holding the stage is known to be ours.
    pull_requests: tuple[str, ...] = ()
    # The file listing of ``head`` with Xet hashes, when the plan read it (the check after landing
    # reuses it when nothing was committed).
    listing: Mapping[str, RemoteFile] | None = None

    @property
    def repo_url(self) -> str:
        return f"{self.endpoint}/{self.repo_id}"

    @property
    def up_to_date(self) -> bool:
        """The branch already holds exactly the stage: publishing makes no commit."""
        return (
            self.head is not None and not self.deletions and all(f.action == "unchanged" for f in self.files)
        )


# -- the arguments, checked before anything is read ---------------------------------------


def resolve_endpoint(endpoint: str | None = None) -> str:
    """``--endpoint``, else ``HF_ENDPOINT``, else the client's default (https://huggingface.co)."""
    return (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def clean_prefix(path_in_repo: str | None) -> str:
    """'' for the repo root, else ``folder/`` (no leading slash, no '.' or '..' parts)."""
    text = (path_in_repo or "").strip("/")
    if text and any(part in ("", ".", "..") for part in text.split("/")):
        raise PublishError(
            f"--path-in-repo {path_in_repo!r} must be a plain folder path such as 'model' or 'v1/model'"
        )
    return text + "/" if text else ""


def check_receipt_dir(receipt_dir: str | Path | None, stage: Path) -> Path:
    """The receipt folder (None: :func:`~pipeline.layout.receipts_beside` the stage), refused
    inside the stage."""
    folder = Path(receipts_beside(str(stage)) if receipt_dir is None else receipt_dir)
    if folder.resolve().is_relative_to(stage.resolve()):
        raise PublishError(
            f"--receipt-dir {folder} is inside the stage {stage}/, which is uploaded as it is: "
            f"write receipts elsewhere (default: {RECEIPT_DIR}/ beside the stage)"
        )
    return folder


def check_timeout(timeout: float | None) -> float | None:
    """``--timeout`` in seconds: above 0 and at most :data:`~.deadline.MAX_TIMEOUT_S` (not
    nan, inf or a bool), or None for the default."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise PublishError(
            f"--timeout {timeout!r} must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:.0f} "
            "(a week): it is the deadline of the whole publish, which ends one that hangs"
        )
    return float(timeout)


def prepare_receipt_dir(folder: Path) -> None:
    """Before any write request: the receipt folder must exist and be writable, or be creatable."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PublishError(
            f"--receipt-dir {folder} cannot be created ({exc.strerror}); nothing was published"
        ) from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PublishError(f"--receipt-dir {folder} is not writable; nothing was published")


def check_staged_repo_id(stage: Path, repo_id: str, force: bool, restage: str) -> None:
    """The card's snippet names the repo it was staged for: publishing it elsewhere would
    ship a card that downloads from another repo."""
    staged_for = json.loads((stage / META_FILE).read_bytes()).get("repo_id")
    if staged_for and staged_for != repo_id and not force:
        raise PublishError(
            f"{stage}/ was staged for {staged_for} (its card loads from there), not {repo_id}: "
            f"restage with {with_option(restage, '--repo-id', repo_id)}, or pass --force-repo-id"
        )


# -- comparing with the remote ---------------------------------------------------------------


def git_blob_sha1_file(path: str | Path, size: int) -> str:
    """Git blob id of a file: what the Hub lists as ``oid`` for a file not stored in LFS."""
    digest = hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _action(
    stage: Path, audited: AuditedFile, remote: RemoteFile | None, xet_hashes: StagedXetHashes
) -> Action:
    """Compare one staged file with the remote entry at the same path."""
    if remote is None:
        return "add"
    if remote.size != audited.size:
        return "update"
    if remote.sha256 is not None:
        if remote.sha256 != audited.sha256:
            return "update"
        if remote.xet_hash is None:
            return "unchanged"
        # Stored over Xet: the SHA-256 is only what a client declared; the Xet hash speaks for the
        # bytes. Unknown here (no hf_xet): the check after landing downloads the file instead.
        ours = xet_hashes.of(audited.name)
        return "unchanged" if ours is None or ours == remote.xet_hash else "repair"
    # A regular file is listed by its git blob id (SHA-1 of header + bytes): hash the small local file.
    return (
        "unchanged" if remote.blob_id == git_blob_sha1_file(stage / audited.name, audited.size) else "update"
    )


def compare(
    stage: Path,
    audited: Mapping[str, AuditedFile],
    remote: Mapping[str, RemoteFile],
    prefix: str,
    xet_hashes: StagedXetHashes,
) -> tuple[tuple[PlannedFile, ...], tuple[str, ...]]:
    files = tuple(
        PlannedFile(
            name,
            prefix + name,
            entry.size,
            entry.sha256,
            _action(stage, entry, remote.get(prefix + name), xet_hashes),
        )
        for name, entry in audited.items()
    )
    staged = {f.path_in_repo for f in files}
    return files, tuple(sorted(p for p in remote if p not in staged and p not in KEPT_REMOTE_FILES))


def _messages(
    stage: Path, audited: Mapping[str, AuditedFile], message: str | None
) -> tuple[int | None, str, str, str]:
    """Step, weights SHA-256, commit title and description (meta.json was checked by the audit)."""
    recorded = json.loads((stage / META_FILE).read_bytes())["step"]
    step = None if recorded is None else int(recorded)
    # Sharded weights are named by their index, which lists every shard.
    weights = next((name for name in (MODEL_FILE, HUB_MODEL_FILE) if name in audited), INDEX_FILE)
    sha = audited[weights].sha256
    what = "the model" if step is None else f"step {step}"
    title = message or f"Publish {what}: {weights} sha256 {sha}"
    table = "\n".join(f"{e.sha256}  {e.size:>12}  {e.name}" for e in audited.values())
    return (
        step,
        sha,
        title,
        f"{what.capitalize()}. {weights} SHA-256 {sha}.\n\nStaged files (SHA-256, bytes, name):\n{table}\n",
    )


def _may_be_unchanged(
    audited: Mapping[str, AuditedFile], remote: Mapping[str, RemoteFile], prefix: str
) -> bool:
    """Does the branch hold a staged file's SHA-256 at its path? Only the file listing can
    then tell whether the Hub stores it over Xet, and with which Xet hash."""
    return any(
        (found := remote.get(prefix + name)) is not None and found.sha256 == entry.sha256
        for name, entry in audited.items()
    )


def read_plan(
    target: Target,
    stage: Path,
    audited: Mapping[str, AuditedFile],
    message: str | None,
    xet_hashes: StagedXetHashes,
) -> PublishPlan:
    """The plan from read requests only; a missing branch is compared with main, where it would start."""
    # Not imported with this module: the Hub client loads while the audit reads (.start).
    from .client import pull_requests, read_branch, remote_files

    head, remote = read_branch(target, target.revision)
    base = head
    if head is None and target.revision != constants.DEFAULT_REVISION:
        base, remote = read_branch(target, constants.DEFAULT_REVISION)
    listing = None
    if base is not None and _may_be_unchanged(audited, remote, target.prefix):
        listing = remote = remote_files(target, base)
    files, deletions = compare(stage, audited, remote, target.prefix, xet_hashes)
    step, sha, title, description = _messages(stage, audited, message)
    pulls = tuple(pull_requests(target)) if target.create_pr and base is not None else ()
    return PublishPlan(
        endpoint=target.endpoint,
        repo_id=target.repo_id,
        revision=target.revision,
        path_in_repo=target.prefix.rstrip("/"),
        repo_exists=base is not None,
        head=head,
        step=step,
        model_sha256=sha,
        title=title,
        description=description,
        files=files,
        deletions=deletions,
        pull_requests=pulls,
        listing=listing if base == head else None,
    )


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
    lines += [
        f"  {f.action:<9}  {f.path_in_repo:<{width}}  {f.size:>10} B  sha256 {f.sha256}" for f in plan.files
    ]
    lines += [f"  {'delete':<9}  {path}" for path in plan.deletions]
    if plan.up_to_date:
        lines.append(f"nothing to publish: {plan.repo_id}@{plan.revision} already holds exactly this stage")
    return "\n".join(lines)
