"""Talking to the Hub for :mod:`pipeline.publishing`: where we publish, how long a request may
wait, what the client's exceptions mean in one line, and the read requests.

Every error leaving this module is a :class:`~pipeline.errors.PublishError` whose message names
the action, the repo and what it means for the repo ("nothing was committed"), never the token.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import httpx2
from huggingface_hub import HfApi, constants, get_session
from huggingface_hub.errors import (
    HfHubHTTPError,
    HFValidationError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from ..errors import PipelineError, PublishError, StaleBranch, TokenRejected, UploadInterrupted

# Longest wait for any one Hub request (06 --timeout).
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Target:
    """Where we publish: the client, and what error messages need to name."""

    api: HfApi = field(repr=False)  # holds the token
    endpoint: str
    repo_id: str
    revision: str
    prefix: str  # "" for the repo root, else "folder/"
    token: str | None = field(repr=False)
    timeout: float = DEFAULT_TIMEOUT_S
    create_pr: bool = False  # open a pull request against `revision` instead of pushing to it


@contextlib.contextmanager
def bounded_requests(timeout: float) -> Iterator[None]:
    """Every Hub request of this block waits at most ``timeout`` seconds (see the module docstring).

    The client passes its own ``timeout=`` on some calls (``repo_info`` passes ``None``, which in
    httpx means "wait forever"), so a client-wide default is not enough: a request hook, run by
    httpx just before each request is sent, sets the bound on the request itself.
    """
    bound = httpx2.Timeout(timeout).as_dict()

    def bound_this_request(request: httpx2.Request) -> None:
        request.extensions["timeout"] = bound

    session = get_session()
    saved = session.timeout, constants.HF_HUB_ETAG_TIMEOUT, constants.HF_HUB_DOWNLOAD_TIMEOUT
    hooks = session.event_hooks
    session.event_hooks = {**hooks, "request": [*hooks.get("request", []), bound_this_request]}
    session.timeout = httpx2.Timeout(timeout)
    constants.HF_HUB_ETAG_TIMEOUT = constants.HF_HUB_DOWNLOAD_TIMEOUT = timeout
    try:
        yield
    finally:
        session.timeout, constants.HF_HUB_ETAG_TIMEOUT, constants.HF_HUB_DOWNLOAD_TIMEOUT = saved
        session.event_hooks = hooks


def http_status(exc: HfHubHTTPError) -> int | None:
    return getattr(getattr(exc, "response", None), "status_code", None)


def retry_after(exc: HfHubHTTPError) -> float | None:
    response = getattr(exc, "response", None)
    raw = response.headers.get("Retry-After") if response is not None else None
    try:
        return max(0.0, float(raw)) if raw is not None else None
    except ValueError:
        return None  # an HTTP date: use our own backoff


def find_cause(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of ``kinds`` in ``exc``'s chain (failed uploads come wrapped in RuntimeError)."""
    seen: BaseException | None = exc
    for _ in range(16):
        if seen is None or isinstance(seen, kinds):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


# -- error translation ----------------------------------------------------------------------

NOTHING_COMMITTED = "nothing was committed"


def http_error(target: Target, action: str, exc: HfHubHTTPError, consequence: str) -> PublishError:
    status = http_status(exc)
    if status in (401, 403):
        return TokenRejected(f"token rejected or no write access to {target.repo_id} at {target.endpoint} "
                             f"(HTTP {status} while {action}): check HF_TOKEN / `hf auth login` and that the token "
                             f"may write to this namespace; {consequence}")
    if status == 412:
        return StaleBranch(f"someone pushed to {target.revision} of {target.repo_id} since it was read; nothing "
                           "was written; rerun to publish on top of the new head")
    detail = getattr(exc, "server_message", None) or (str(exc).strip().splitlines() or [""])[0]
    detail = " ".join(str(detail).split())
    if target.token:
        detail = detail.replace(target.token, "<token>")
    return PublishError(f"the Hub answered HTTP {status} while {action} on {target.repo_id}: {detail}; "
                        f"{consequence}")


def network_words(target: Target, network: BaseException) -> str:
    if isinstance(network, httpx2.TimeoutException):
        return f"no answer from {target.endpoint} within {target.timeout:g}s ({type(network).__name__})"
    # The Xet client reports every CAS failure (a refused xorb too) as ConnectionError: say which.
    detail = " ".join((str(network).splitlines() or [""])[0].split())[:300]
    if target.token:
        detail = detail.replace(target.token, "<token>")
    return f"connection to {target.endpoint} lost ({type(network).__name__}{': ' + detail if detail else ''})"


@contextlib.contextmanager
def hub_errors(target: Target, action: str, consequence: str = NOTHING_COMMITTED) -> Iterator[None]:
    """Turn client exceptions into one-line domain errors (none of which contains the token).
    ``consequence`` ends the message: what this failure means for the repo."""
    try:
        yield
    except PipelineError:
        raise
    except HFValidationError as exc:
        detail = " ".join(str(exc).split())
        raise PublishError(f"the Hub client refused a value while {action}: {detail}; {consequence}") from None
    except Exception as exc:
        http = find_cause(exc, (HfHubHTTPError,))
        if http is not None:
            raise http_error(target, action, http, consequence) from None  # type: ignore[arg-type]
        network = find_cause(exc, (httpx2.TransportError, ConnectionError))
        if network is None:
            raise
        raise UploadInterrupted(f"{network_words(target, network)} while {action}; {consequence}; "
                                "rerun: it skips blobs already uploaded and never makes a second commit") from None


# -- reading the remote ---------------------------------------------------------------------

def read_head(target: Target, revision: str) -> str | None:
    """Commit id at the head of ``revision``, or None when the repo or the branch is missing."""
    with hub_errors(target, f"reading branch {revision}"):
        try:
            return target.api.repo_info(target.repo_id, revision=revision).sha
        except (RepositoryNotFoundError, RevisionNotFoundError):
            return None


def pull_requests(target: Target) -> dict[str, str]:
    """``{"refs/pr/N": commit}`` of every pull request of the repo (empty while it does not exist)."""
    with hub_errors(target, "listing the pull requests"):
        try:
            refs = target.api.list_repo_refs(target.repo_id, include_pull_requests=True)
        except RepositoryNotFoundError:
            return {}
    return {ref.ref: ref.target_commit for ref in refs.pull_requests or ()}


def remote_files(target: Target, commit: str) -> dict[str, Any]:
    """``{path: RepoFile}`` under the target folder (the whole repo for the root) at ``commit``."""
    with hub_errors(target, "listing the repo files"):
        try:
            entries = target.api.list_repo_tree(target.repo_id, target.prefix.rstrip("/") or None,
                                                recursive=True, revision=commit)
            return {entry.path: entry for entry in entries if hasattr(entry, "blob_id")}
        except RemoteEntryNotFoundError:
            return {}  # the folder does not exist yet


