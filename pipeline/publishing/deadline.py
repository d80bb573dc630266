"""The publish's deadline: ``--timeout`` bounds the whole publish, not each request.

A :class:`Deadline` is set when :func:`~pipeline.publishing.publish` has loaded the Hub client,
the audit reading meanwhile (default :func:`default_timeout`). While it is installed
(:meth:`Deadline.installed`):

- every request of the client's shared HTTP session waits at most ``min(REQUEST_TIMEOUT_S,
  time left)`` for each read or write (a request hook sets the bound on the request itself, also on
  those the client sends with its own ``timeout=``), and no request starts once the time is up;
- a watchdog thread ends whatever is still running when the time is up: it shuts down every
  connection the publish opened and stops what runs outside those connections' reach (the
  Xet client's upload: :meth:`Deadline.stopping`, used by :func:`.xet.upload_within`). httpx's
  timeouts bound each socket operation, so a server that sends one byte per second never trips
  them: only this wall-clock cut bounds such a server. A request cut this way fails with
  :class:`~pipeline.errors.DeadlinePassed`, which the client does not retry;
- an answer asking to wait (``Retry-After``) past the deadline ends the publish at once;
- our own retries (reads, repo creation, the commit) wait only within it;
- the Xet client's retry budget and timeouts are capped by the time left (:func:`.xet.capped`).

Once the commit was sent, finding out whether it landed, verifying it and writing the receipt
get ``min(timeout, SETTLE_S)`` more seconds (:meth:`Deadline.settle`). The deadline counts what
was retried and the last error, for the one line that says why the publish stopped. Leaving
:meth:`Deadline.installed` stops the watchdog, removes the hooks and closes the connections,
so nothing of one publish outlives it (a second publish in the same process starts clean).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Iterator
from urllib.parse import urlsplit

from ..errors import DeadlinePassed

if TYPE_CHECKING:
    import httpx2

__all__ = [
    "MAX_TIMEOUT_S",
    "REQUEST_TIMEOUT_S",
    "SETTLE_S",
    "Deadline",
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
# The longest --timeout: a week. A deadline ends a publish that hangs; a week is 600 GB at the
# default's rate of 1 s per MB, twelve times the Hub's 50 GB per file. Beyond it a value means
# no deadline at all (1e308 s: the watchdog could not even wait that long; threading.TIMEOUT_MAX).
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def default_timeout(stage_bytes: int) -> float:
    """The default publish timeout, when ``--timeout`` is not given: ``BASE_TIMEOUT_S`` (5
    minutes) plus ``SECONDS_PER_MB`` (1 s) per MB staged. The one definition: docs/publishing.md
    states it for users, every other text cites it by this name."""
    return BASE_TIMEOUT_S + SECONDS_PER_MB * stage_bytes / 1e6


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
        # The longest wait for an answer, set on the last request of each kind.
        self.bounds: dict[str, float] = {}
        self.last_error: str | None = None
        self._unanswered: set[str] = set()
        self._sessions: list[tuple[httpx2.Client, dict]] = []
        # The watchdog's state, under one lock: the connections opened, what it must stop while
        # it runs (what it is, how to stop it), and every such stop used (called again at the end).
        self._changed = threading.Condition()
        self._streams: list[Any] = []
        self._running: list[tuple[str, Callable[[], None]]] = []
        self._stops_used: dict[Callable[[], None], None] = {}
        self._stopped = False

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def expired(self) -> bool:
        """The time is up (and not extended by :meth:`settle` since)."""
        return self.remaining() <= 0

    def settle(self) -> None:
        """Before finding out whether a commit landed, or verifying one that did: at least
        ``min(timeout, SETTLE_S)`` seconds from now, never past ``timeout + min(timeout, SETTLE_S)``."""
        with self._changed:
            self.end = min(self._last_end, max(self.end, time.monotonic() + min(self.timeout, SETTLE_S)))
            self._changed.notify_all()

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
        import httpx2  # loaded with the Hub client by then (see follow_session)

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
        parts = urlsplit(str(request.url))
        unanswered = (
            f"no answer from {parts.scheme}://{parts.netloc} to {what} within {self.bounds[what]:.3g}s, "
            "all the --timeout had left"
        )
        request.extensions["trace"] = self._tracer(request.extensions.get("trace"), unanswered)

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

    def _tracer(
        self, inner: Callable[[str, dict], Any] | None, unanswered: str
    ) -> Callable[[str, dict], None]:
        """httpcore's ``trace`` extension (public): it names each connection opened, so the
        watchdog can cut it, and turns a failure after the deadline into DeadlinePassed, which
        the client does not retry (it retries a plain read error after a pause); ``unanswered``
        says which request it was."""

        def trace(event: str, info: dict) -> None:
            if inner is not None:
                inner(event, info)
            if event.endswith((".connect_tcp.complete", ".start_tls.complete")):
                with self._changed:
                    self._streams.append(info["return_value"])
                    if self._stopped or self.expired():
                        _shut(info["return_value"])
            elif event.endswith(".failed") and self.expired():
                self.note(unanswered)
                raise DeadlinePassed(unanswered)

        return trace

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
        # Imported here: the publish imports the Hub client while the audit reads (.start).
        from huggingface_hub import get_session

        self._install_on(get_session())

    # -- the watchdog -------------------------------------------------------------------------

    def _watch(self) -> None:
        """Cut everything still running each time the deadline passes (settle may move it later)."""
        cut_for: float | None = None
        while True:
            with self._changed:
                left = self.remaining()
                if self._stopped:
                    return
                if left > 0 or cut_for == self.end:
                    self._changed.wait(left if left > 0 else None)
                    continue
                cut_for = self.end
                streams, running = list(self._streams), dict(self._running)
            for stream in streams:
                _shut(stream)
            for what, stop in running.items():
                self.note(f"{what} was still running when the time was up: stopped")
                stop()

    @contextlib.contextmanager
    def installed(self) -> Iterator["Deadline"]:
        """Bound the client's requests by this deadline for the block, with the watchdog running;
        afterwards: the watchdog stopped, the hooks removed, this publish's connections closed."""
        self.follow_session()
        watchdog = threading.Thread(target=self._watch, name="publish-deadline", daemon=True)
        watchdog.start()
        try:
            yield self
        finally:
            with self._changed:
                self._stopped = True
                self._changed.notify_all()
            watchdog.join()
            for session, hooks in self._sessions:
                session.event_hooks = hooks
            self._sessions.clear()
            for stream in self._streams:
                _shut(stream)
            self._streams.clear()
            for stop in self._stops_used:
                stop()  # the Xet runtime's threads end with the publish; a next upload starts anew
            self._stops_used.clear()

    @contextlib.contextmanager
    def stopping(self, what: str, stop: Callable[[], None]) -> Iterator[None]:
        """The block runs ``what`` (the Xet upload), which no request hook reaches: when the time
        is up while it runs, the watchdog notes it and calls ``stop``; leaving :meth:`installed`
        calls ``stop`` once more."""
        entry = (what, stop)
        with self._changed:
            self._running.append(entry)
            self._stops_used[stop] = None
        try:
            yield
        finally:
            with self._changed:
                self._running.remove(entry)


def _shut(stream: Any) -> None:
    """End a connection now, whichever thread waits on it: ``shutdown`` wakes a blocked read at
    once (closing the descriptor would not); the client then closes it as a broken connection."""
    sock = stream.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed
