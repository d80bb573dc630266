"""Talking to the Hub for :mod:`pipeline.publishing`: where we publish, what the client's
exceptions mean in one line, and the idempotent requests (reads, creating the repo or the
branch), retried on 429/5xx and lost connections within the deadline (never on a host name that
does not resolve: that is a wrong endpoint, not a passing failure).

Every error leaving this module is a :class:`~pipeline.errors.PublishError` whose message names
the action, the repo and what it means for the repo ("nothing was committed"), never the token.
"""

from __future__ import annotations

import contextlib
import re
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import HfApi
from huggingface_hub.errors import (
    HfHubHTTPError,
    HFValidationError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from ..errors import (
    DeadlinePassed,
    PipelineError,
    PublishError,
    PublishTimedOut,
    StaleBranch,
    TokenRejected,
    UploadInterrupted,
    first_line,
)
from .deadline import REQUEST_TIMEOUT_S, RETRYABLE, Deadline, describe_request, retry_after_s

# Attempts of an idempotent request (the first one included), each wait within the deadline.
READ_ATTEMPTS = 5
NOTHING_COMMITTED = "nothing was committed"
RERUN = "rerun: it skips blobs already uploaded and never makes a second commit"
T = TypeVar("T")


def _quiet(line: str) -> None:
    pass


@dataclass(frozen=True, slots=True)
class Target:
    """Where we publish, and what every request and message needs."""

    api: HfApi = field(repr=False)  # holds the token
    endpoint: str
    repo_id: str
    revision: str
    prefix: str  # "" for the repo root, else "folder/"
    token: str | None = field(repr=False)
    deadline: Deadline = field(repr=False)
    create_pr: bool = False  # open a pull request against `revision` instead of pushing to it
    say: Callable[[str], None] = field(repr=False, default=_quiet)


@dataclass(frozen=True, slots=True)
class RemoteFile:
    """A file as the Hub lists it. ``sha256``: the LFS pointer's (None for a regular file);
    ``xet_hash``: for a Xet-stored file, when the listing gives it (the file listing does, the
    repo info does not)."""

    path: str
    size: int
    blob_id: str
    sha256: str | None = None
    xet_hash: str | None = None


def http_status(exc: HfHubHTTPError) -> int | None:
    return getattr(getattr(exc, "response", None), "status_code", None)


def answered(exc: HfHubHTTPError) -> str:
    """What the request that got this error answer did, in words ("the commit", "the preupload request")."""
    try:
        return describe_request(exc.response.request.method, exc.response.request.url)
    except (AttributeError, RuntimeError):  # httpx raises when the response carries no request
        return "the commit"


def retry_after(exc: HfHubHTTPError) -> float | None:
    response = getattr(exc, "response", None)
    return retry_after_s(response.headers) if response is not None else None


def find_cause(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of ``kinds`` in ``exc``'s chain (failed uploads come wrapped in RuntimeError)."""
    seen: BaseException | None = exc
    for _ in range(16):
        if seen is None or isinstance(seen, kinds):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


# -- error translation ----------------------------------------------------------------------


def _scrub(target: Target, text: str) -> str:
    text = " ".join(str(text).split())
    return text.replace(target.token, "<token>") if target.token else text


def http_error(target: Target, action: str, exc: HfHubHTTPError, consequence: str) -> PublishError:
    status = http_status(exc)
    if status in (401, 403):
        return TokenRejected(
            f"token rejected or no write access to {target.repo_id} at {target.endpoint} "
            f"(HTTP {status} while {action}): check HF_TOKEN / `hf auth login` and that the token "
            f"may write to this namespace; {consequence}"
        )
    if status == 412:
        return StaleBranch(
            f"someone pushed to {target.revision} of {target.repo_id} since it was read; nothing "
            "was written; rerun to publish on top of the new head"
        )
    detail = getattr(exc, "server_message", None) or first_line(exc, limit=None)
    return PublishError(
        f"the Hub answered HTTP {status} while {action} on {target.repo_id}: "
        f"{_scrub(target, detail)}; {consequence}"
    )


def unresolved(exc: BaseException) -> socket.gaierror | None:
    """The name lookup failure behind ``exc``: the resolver has already retried, so we do not."""
    return find_cause(exc, (socket.gaierror,))  # type: ignore[return-value]


def network_words(target: Target, network: BaseException) -> str:
    """What a lost request means, in words. The Xet client reports every CAS failure (a refused
    xorb, a shard answered 503) as ConnectionError once its own retries are spent: say which."""
    lookup = unresolved(network)
    if lookup is not None:
        host = urlsplit(target.endpoint).hostname
        return (
            f"the host {host} of the endpoint {target.endpoint} cannot be resolved ({lookup.strerror}): "
            "check --endpoint / HF_ENDPOINT and the network"
        )
    if isinstance(network, httpx2.TimeoutException):
        try:
            what = describe_request(network.request.method, network.request.url)
        except RuntimeError:  # httpx raises when the exception carries no request
            what = "a request"
        bound = target.deadline.bounds.get(what, REQUEST_TIMEOUT_S)
        cut = ", all the --timeout had left" if bound < REQUEST_TIMEOUT_S else ""
        return (
            f"no answer from {target.endpoint} to {what} within {bound:.3g}s{cut} ({type(network).__name__})"
        )
    # Scrubbed whole, then cut: a token cut in two would pass the scrub.
    said = _scrub(target, first_line(network, named=True, limit=None))[:300]
    url = re.search(r"https?://[^\s),]+", said)
    if isinstance(network, ConnectionError) and url is not None:
        return (
            f"the Xet client gave up on {describe_request('POST', url.group(0))} after its retries, capped by "
            f"the {target.deadline.timeout:g}s --timeout ({said})"
        )
    return f"connection to {target.endpoint} lost ({said})"


@contextlib.contextmanager
def hub_errors(target: Target, action: str, consequence: str = NOTHING_COMMITTED) -> Iterator[None]:
    """Turn client exceptions into one-line domain errors (none of which contains the token).
    ``consequence`` ends the message: what this failure means for the repo."""
    try:
        yield
    except PipelineError:
        raise
    except HFValidationError as exc:
        raise PublishError(
            f"the Hub client refused a value while {action}: {_scrub(target, str(exc))}; {consequence}"
        ) from None
    except Exception as exc:
        passed = find_cause(exc, (DeadlinePassed,))
        if passed is None and target.deadline.expired():
            # The watchdog cut this request (the Xet client reports that as a cancelled task).
            passed = DeadlinePassed(f"cut at the deadline ({type(exc).__name__})")
        if passed is not None:
            raise PublishTimedOut(f"{target.deadline.why(action, passed)}; {consequence}; {RERUN}") from None  # type: ignore[arg-type]
        http = find_cause(exc, (HfHubHTTPError,))
        if http is not None:
            raise http_error(target, action, http, consequence) from None  # type: ignore[arg-type]
        network = find_cause(exc, (httpx2.TransportError, ConnectionError))
        if network is None:
            raise
        if unresolved(network) is not None:
            raise PublishError(f"{network_words(target, network)} while {action}; {consequence}") from None
        raise UploadInterrupted(
            f"{network_words(target, network)} while {action}; {consequence}; {RERUN}"
        ) from None


# -- idempotent requests, retried -------------------------------------------------------------


def _retry_wait(target: Target, exc: Exception, attempt: int) -> float | None:
    """Seconds to wait before the next attempt, or None when ``exc`` is not worth retrying."""
    http = find_cause(exc, (HfHubHTTPError,))
    if http is not None:
        if http_status(http) not in RETRYABLE:  # type: ignore[arg-type]
            return None
        asked = retry_after(http)  # type: ignore[arg-type]
        return asked if asked is not None else float(2 ** (attempt - 1))
    if find_cause(exc, (DeadlinePassed,)) is not None:
        return None
    network = find_cause(exc, (httpx2.TransportError,))
    if network is None or unresolved(network) is not None:
        return None
    target.deadline.note(network_words(target, network))
    return float(2 ** (attempt - 1))


def call(target: Target, action: str, request: Callable[[], T], consequence: str = NOTHING_COMMITTED) -> T:
    """``request()``, an idempotent request, retried on 429/5xx and lost connections: waits
    ``Retry-After`` when given, else 1, 2, 4, 8 s, at most ``READ_ATTEMPTS`` tries, all within the deadline."""
    attempt = 0
    while True:
        attempt += 1
        with hub_errors(target, action, consequence):
            target.deadline.follow_session()
            try:
                return request()
            except Exception as exc:
                wait = _retry_wait(target, exc, attempt)
                if wait is None or attempt == READ_ATTEMPTS:
                    raise
                target.say(
                    f"{action}: {target.deadline.last_error or type(exc).__name__}; retrying in {wait:g}s"
                )
                target.deadline.wait(wait, action)


def read_head(target: Target, revision: str) -> str | None:
    """Commit id at the head of ``revision``, or None when the repo or the branch is missing."""
    return read_branch(target, revision, files=False)[0]


def read_branch(
    target: Target, revision: str, *, files: bool = True
) -> tuple[str | None, dict[str, RemoteFile]]:
    """The head of ``revision`` and, with ``files``, the files under the target folder there,
    in one request (the repo info with its files' metadata, which lists no Xet hash): (None, {})
    when the repo or the branch is missing."""

    def head() -> tuple[str | None, dict[str, RemoteFile]]:
        try:
            info = target.api.repo_info(target.repo_id, revision=revision, files_metadata=files)
        except (RepositoryNotFoundError, RevisionNotFoundError):
            return None, {}
        listed = {
            entry.rfilename: RemoteFile(
                entry.rfilename, entry.size, entry.blob_id, entry.lfs.sha256 if entry.lfs else None
            )
            for entry in (info.siblings or ())
            if files and entry.rfilename.startswith(target.prefix)
        }
        return info.sha, listed

    return call(target, f"reading branch {revision}", head)


def pull_requests(target: Target) -> dict[str, str]:
    """``{"refs/pr/N": commit}`` of every pull request of the repo (empty while it does not exist)."""

    def refs() -> Any:
        try:
            return target.api.list_repo_refs(target.repo_id, include_pull_requests=True).pull_requests or ()
        except RepositoryNotFoundError:
            return ()

    return {ref.ref: ref.target_commit for ref in call(target, "listing the pull requests", refs)}


def tags(target: Target) -> dict[str, str]:
    """``{tag: commit}`` of the repo (empty while it does not exist)."""

    def refs() -> Any:
        try:
            return target.api.list_repo_refs(target.repo_id).tags
        except RepositoryNotFoundError:
            return ()

    return {
        ref.name: ref.target_commit for ref in call(target, f"reading the tags of {target.repo_id}", refs)
    }


def remote_files(target: Target, commit: str, consequence: str = NOTHING_COMMITTED) -> dict[str, RemoteFile]:
    """Every file under the target folder (the whole repo for the root) at ``commit``, with
    their Xet hashes."""

    def listing() -> dict[str, RemoteFile]:
        try:
            entries = target.api.list_repo_tree(
                target.repo_id, target.prefix.rstrip("/") or None, recursive=True, revision=commit
            )
            return {
                entry.path: RemoteFile(
                    entry.path,
                    entry.size,
                    entry.blob_id,
                    entry.lfs.sha256 if entry.lfs else None,
                    entry.xet_hash,
                )
                for entry in entries
                if hasattr(entry, "blob_id")
            }
        except RemoteEntryNotFoundError:
            return {}  # the folder does not exist yet

    return call(target, "listing the repo files", listing, consequence)
