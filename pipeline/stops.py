"""SIGTERM and SIGINT in the numbered scripts: one line that tells the truth, exit 128 + N.

A script is stopped in one of four phases, each with its own way out:

1. while it imports (:func:`starting`, from ``scripts/_bootstrap.py`` or ``python -m pipeline``,
   before anything of the step runs): the line says nothing was done, and the process exits at once;
2. while its ``main`` runs (:func:`install`, from :func:`pipeline.cli.run_main`): the stop
   raises :class:`~pipeline.errors.Stopped` in the main thread, once, so every atomic writer
   and scratch folder cleans up on the way out; the line ends with what the innermost
   :func:`stopping` block says a stop there leaves (by default: anything half-written was
   removed). A second signal during that clean-up is ignored;
3. in the last steps of a commit (:func:`held`: an atomic folder renamed into place and the
   folder it replaced removed): the stop waits until they are done, then is raised saying
   what the commit left (``stopping(..., committed=...)``), never that it was undone;
4. once ``main`` has returned or failed (:func:`finishing`): its lines are printed or being
   printed, so a stop ends the process at once, in one line that says so.

Training installs a handler of its own while it trains (a graceful stop after the step, with a
checkpoint) and puts this one back after. Signal handlers run in the main thread only, so
each call here is a no-op elsewhere. Torch-free, standard library and errors only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Iterator

from .errors import Stopped

__all__ = ["DEFAULT_OUTCOME", "finishing", "held", "install", "is_installed", "starting", "stopping"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)
DEFAULT_OUTCOME = "anything half-written was removed"


class _State:
    def __init__(self) -> None:
        # (outcome, committed): what a stop leaves, innermost block last.
        self.outcomes: list[tuple[str, str | None]] = [(DEFAULT_OUTCOME, None)]
        self.raised = False  # a Stopped is on its way out: later signals must not cut its clean-up
        self.holding = 0  # depth of held() blocks
        self.pending: int | None = None  # a signal that came while held


_state = _State()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _stop(signum: int, frame: Any) -> None:
    if _state.raised:
        return
    if _state.holding:
        if _state.pending is None:
            _state.pending = signum
        return
    _state.raised = True
    raise Stopped(signum, _state.outcomes[-1][0])


def _stopped_while_starting(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    os.write(2, f"error: stopped by {name} while starting; nothing was done\n".encode())
    os._exit(128 + signum)


@contextlib.contextmanager
def starting(*, until_run_main: bool = True) -> Iterator[None]:
    """Phase 1, around a step's imports (torch takes seconds): a stop ends the process at once in
    one line, exit 128 + N; nothing has started, so nothing is left (a Ctrl-C is never a
    traceback, nor swallowed by a library's import). The handler stays for ``run_main`` to
    replace (``until_run_main``), so no instant is left without one; a caller that does not end
    through ``run_main`` passes False, and the previous handlers come back after the block.
    Installed only for a signal nothing else handles yet (a second block keeps ``run_main``'s;
    one the parent ignores, as ``nohup`` does, stays ignored)."""
    defaults = (signal.SIG_DFL, signal.default_int_handler)
    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    previous = {signum: handler for signum, handler in previous.items() if handler in defaults}
    # SIGTERM's last: Python handles SIGINT from its start, so only SIGTERM's handler shows
    # from outside (/proc's SigCgt) when it arrives; once it shows, SIGINT's is in place too.
    for signum in reversed(previous):
        signal.signal(signum, _stopped_while_starting)
    try:
        yield
    finally:
        if not until_run_main:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _exit_now(signum: int, frame: Any) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):  # closed, or interrupted in its own write
            pass
    name = signal.Signals(signum).name
    os.write(2, f"error: stopped by {name} as it exited; what it printed above stands\n".encode())
    os._exit(128 + signum)


def install() -> None:
    """From here on (the main thread, phase 2), a SIGTERM or SIGINT raises Stopped; a signal
    the process was started ignoring (``nohup``, a background job) stays ignored."""
    if _main_thread():
        _state.raised = False
        for signum in SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, _stop)


def is_installed(handler: Any) -> bool:
    """Whether ``handler`` (``signal.getsignal``'s) is this module's: a stop is then explained
    in one line and cleaned up, not a death without a word."""
    return handler in (_stop, _exit_now)


def finishing() -> None:
    """``main`` has returned or failed (phase 4): a stop from here ends the process at once."""
    if _main_thread():
        for signum in SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, _exit_now)


@contextlib.contextmanager
def stopping(outcome: str, *, committed: str | None = None) -> Iterator[None]:
    """While in this block, a stop's line ends with ``outcome`` (``error: stopped by SIGTERM;
    <outcome>``, exit 128 + N); one that waited for a commit (:func:`held`) ends with
    ``committed`` instead, when given. Installs the handler if no one did (a library caller)."""
    if not _main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    ours = all(handler in (_stop, signal.SIG_IGN) for handler in previous.values())
    if not ours:
        install()
    _state.outcomes.append((outcome, committed))
    try:
        yield
    finally:
        _state.outcomes.pop()
        if not ours:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            _state.raised = False


class _Hold:
    committed = False
    """Set by the holder once what it commits is in place: a stop that waited says so."""


@contextlib.contextmanager
def held() -> Iterator[_Hold]:
    """A stop that arrives in this block (the main thread) waits for its end, then is raised
    with the innermost :func:`stopping` block's ``committed`` outcome if the holder set
    ``committed``, else its ``outcome``. Keep it short: a stop waits for it."""
    hold = _Hold()
    if not _main_thread():
        yield hold
        return
    _state.holding += 1
    try:
        yield hold
    finally:
        _state.holding -= 1
        if not _state.holding and _state.pending is not None and not _state.raised:
            signum, _state.pending = _state.pending, None
            _state.raised = True
            outcome, committed = _state.outcomes[-1]
            raise Stopped(signum, (committed or outcome) if hold.committed else outcome)
