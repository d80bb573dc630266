"""The publish's deadline: ``--timeout`` bounds the whole publish, not each request.

A :class:`Deadline` is set when :func:`~pipeline.publishing.publish` starts (default
:func:`default_timeout`: 5 minutes plus 1 second per MB staged). While it is installed:

- every request of the client's shared HTTP session waits at most ``min(REQUEST_TIMEOUT_S,
  time left)`` for the Hub (a request hook sets the bound on the request itself, also on those
  the client sends with its own ``timeout=``), and no request starts once the time is up;
- an answer asking to wait (``Retry-After``) past the deadline ends the publish at once;
- our own retries (reads, repo creation, the commit) wait only within it;
- the Xet client's retry budget and timeouts are capped by the time left: hf_xet reads them
  from its documented environment variables (``HF_XET_CLIENT_RETRY_*``, ``HF_XET_CLIENT_*_TIMEOUT``)
  when a process first uploads through Xet, so the cap holds for a process's first publish
  (scripts/06 is one; a later one in the same process keeps the first one's values).

Once the commit was sent, finding out whether it landed, verifying it and writing the receipt
get ``min(timeout, SETTLE_S)`` more seconds (:meth:`Deadline.settle`). The deadline counts what
was retried and the last error, for the one line that says why the publish stopped.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections import Counter
from typing import Iterator
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import get_session

__all__ = [
    "REQUEST_TIMEOUT_S",
    "SETTLE_S",
    "Deadline",
    "DeadlinePassed",
    "default_timeout",
    "describe_request",
]

# Longest wait for any one answer of the Hub (within the deadline).
REQUEST_TIMEOUT_S = 60.0
# After the commit was sent: time to find out whether it landed, verify it, write the receipt.
SETTLE_S = 30.0
# The default deadline: a fixed part, plus a transfer rate no real uplink is slower than.
BASE_TIMEOUT_S = 300.0
SECONDS_PER_MB = 1.0
RETRYABLE = frozenset({429, 500, 502, 503, 504})
# The Xet client's settings (hf_xet's defaults when unset) and how much of the time left they may take.
_XET_SETTINGS = {
    "HF_XET_CLIENT_RETRY_MAX_DURATION": (360.0, 1 / 3),
    "HF_XET_CLIENT_RETRY_BASE_DELAY": (3.0, 1 / 30),
    "HF_XET_CLIENT_READ_TIMEOUT": (300.0, 1.0),
    "HF_XET_CLIENT_CONNECT_TIMEOUT": (60.0, 1.0),
}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, None: 1.0, "m": 60.0, "h": 3600.0}


def default_timeout(stage_bytes: int) -> float:
    """The deadline when ``--timeout`` is not given: 5 minutes plus 1 s per MB staged."""
    return BASE_TIMEOUT_S + SECONDS_PER_MB * stage_bytes / 1e6


class DeadlinePassed(Exception):
    """Raised inside a client call when a request would start past the deadline, or the Hub asks
    to wait past it (``asked``: the wait); :func:`~pipeline.publishing.client.hub_errors` turns
    it into one line."""

    def __init__(self, message: str, asked: float | None = None) -> None:
        super().__init__(message)
        self.asked = asked


def describe_request(method: str, url: str | httpx2.URL) -> str:
    """What a request does, in words: "the Xet shard upload", "reading the branch head"..."""
    path = urlsplit(str(url)).path
    rules = (
        ("/v1/shards", "the Xet shard upload"),
        ("/xorbs/", "the Xet xorb upload"),
        ("/xorb-grants/", "the Xet xorb upload"),
        ("/reconstructions/", "a Xet download"),
        ("/preupload/", "the preupload request"),
        ("/objects/batch", "the LFS batch request"),
        ("/commit/", "the commit"),
        ("/xet-write-token/", "the Xet token request"),
        ("/repos/create", "the repo creation"),
        ("/branch/", "the branch creation"),
        ("/tag/", "tagging"),
        ("/tree/", "the file listing"),
        ("/paths-info/", "the file listing"),
        ("/refs", "reading the refs"),
        ("/resolve/", "a download"),
    )
    found = next((words for part, words in rules if part in path), None)
    if found is not None:
        return found
    if method == "GET" and path.startswith("/api/"):
        return "reading the branch head"
    return "an upload" if method == "PUT" else f"a {method} request to {urlsplit(str(url)).netloc}"


def retry_after_s(headers: httpx2.Headers) -> float | None:
    raw = headers.get("Retry-After")
    try:
        return max(0.0, float(raw)) if raw is not None else None
    except ValueError:
        return None  # an HTTP date: use our own backoff


def _seconds(text: str | None, default: float) -> float:
    match = _DURATION.match(text or "")
    return float(match.group(1)) * _UNITS[match.group(2)] if match else default


class Deadline:
    """The publish's time budget, and what was retried within it (see the module docstring)."""

    # A test records waits instead of sleeping by replacing this (the clock stays real).
    sleep = staticmethod(time.sleep)

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.end = time.monotonic() + timeout
        # Settling never goes past this: the whole publish ends within timeout + min(timeout, SETTLE_S).
        self._last_end = self.end + min(timeout, SETTLE_S)
        self.sent: Counter[str] = Counter()  # requests by what they do
        self.bounds: dict[
            str, float
        ] = {}  # the longest wait for an answer, set on the last request of each kind
        self.last_error: str | None = None
        self._unanswered: set[str] = set()
        self._sessions: list[tuple[httpx2.Client, dict]] = []

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def settle(self) -> None:
        """Before finding out whether a commit landed, or verifying one that did: at least
        ``min(timeout, SETTLE_S)`` seconds from now, never past ``timeout + min(timeout, SETTLE_S)``."""
        self.end = min(self._last_end, max(self.end, time.monotonic() + min(self.timeout, SETTLE_S)))

    def note(self, error: str) -> None:
        self.last_error = " ".join(error.split())[:300]

    def retried(self) -> str:
        """'the Xet shard upload sent 6 times, ...' for what was sent more than once."""
        repeated = [f"{what} sent {count} times" for what, count in self.sent.items() if count > 1]
        return ", ".join(repeated)

    def why(self, action: str, passed: DeadlinePassed) -> str:
        """Why the publish stopped while ``action``: what was retried and the last error."""
        if passed.asked is not None:
            return f"publishing cannot finish within its {self.timeout:g}s --timeout while {action}: {passed}"
        words = f"publishing ran out of its {self.timeout:g}s --timeout while {action}"
        if self.retried():
            words += f" ({self.retried()})"
        return words + (f"; last error: {self.last_error}" if self.last_error else "")

    def wait(self, seconds: float, what: str) -> None:
        """Sleep before retrying ``what``, or raise :class:`DeadlinePassed` when the deadline comes first."""
        if seconds >= self.remaining():
            raise DeadlinePassed(f"no time left to retry {what}")
        self.sleep(seconds)

    # -- the client's requests ---------------------------------------------------------------

    def _before_request(self, request: httpx2.Request) -> None:
        what = describe_request(request.method, request.url)
        if what in self._unanswered:
            self.note(f"no answer to {what} (timed out or connection lost)")
        left = self.remaining()
        if left <= 0:
            raise DeadlinePassed(f"{what} was not sent")
        self.sent[what] += 1
        self._unanswered.add(what)
        self.bounds[what] = min(REQUEST_TIMEOUT_S, left)
        request.extensions["timeout"] = httpx2.Timeout(self.bounds[what]).as_dict()

    def _after_response(self, response: httpx2.Response) -> None:
        what = describe_request(response.request.method, response.request.url)
        self._unanswered.discard(what)
        if response.status_code not in RETRYABLE:
            return
        self.note(f"HTTP {response.status_code} to {what}")
        wait = retry_after_s(response.headers)
        if wait is not None and wait >= self.remaining():
            response.close()
            raise DeadlinePassed(f"the Hub asks to wait {wait:g}s before retrying {what}", wait)

    def _install_on(self, session: httpx2.Client) -> None:
        if any(session is installed for installed, _ in self._sessions):
            return
        hooks = session.event_hooks
        self._sessions.append((session, hooks))
        session.event_hooks = {
            **hooks,
            "request": [*hooks.get("request", []), self._before_request],
            "response": [*hooks.get("response", []), self._after_response],
        }

    def follow_session(self) -> None:
        """Install on the client's current session: it replaces its session after a connection error."""
        self._install_on(get_session())

    @contextlib.contextmanager
    def installed(self) -> Iterator["Deadline"]:
        """Bound the client's requests by this deadline for the block; restore its hooks afterwards."""
        self.follow_session()
        try:
            yield self
        finally:
            for session, hooks in self._sessions:
                session.event_hooks = hooks
            self._sessions.clear()

    @contextlib.contextmanager
    def xet_capped(self) -> Iterator[None]:
        """The Xet client's retry budget and timeouts, capped by the time left, for a Xet session
        created in this block (a user's smaller values are kept)."""
        left = max(self.remaining(), 1.0)
        saved = {name: os.environ.get(name) for name in _XET_SETTINGS}
        for name, (default, share) in _XET_SETTINGS.items():
            limit = left * share if "TIMEOUT" not in name else min(left, REQUEST_TIMEOUT_S)
            os.environ[name] = f"{int(1000 * min(_seconds(saved[name], default), limit))}ms"
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
