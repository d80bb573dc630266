"""Shared command-line plumbing for the steps (the numbered scripts and ``python -m pipeline``):
config flags and error handling.
The commands the pipeline prints (each repeats the config it was given) are
:mod:`pipeline.commands`'s, named here too for the scripts."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from . import stops
from .commands import python_command, resume_command, script_command, torchrun_launcher
from .config import Config, load_config, parse_set_overrides
from .errors import (
    CapturedTraceback,
    PipelineError,
    Preempted,
    Stopped,
    describe_os_error,
    missing_module,
    out_of_tasks,
)
from .stops import stopping

__all__ = [
    "add_config_arguments",
    "add_checkpoint_dir_argument",
    "config_from_args",
    "run_main",
    "stopping",
    "resume_command",
    "script_command",
    "python_command",
    "torchrun_launcher",
]

DEBUG_FLAG = "--debug"
_OS_HINTS = {
    errno.ENOSPC: "; nothing half-written was kept: free some space and run the command again",
    errno.EDQUOT: "; nothing half-written was kept: free some space and run the command again",
    errno.EROFS: ": write somewhere else (see --help for the folder options)",
    errno.EACCES: ": fix the permissions or write somewhere else",
    errno.EPERM: ": fix the permissions or write somewhere else",
}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, default=Path("config.yaml"), help="YAML config (default: config.yaml)"
    )
    parser.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        default=[],
        help="override any config key, e.g. --set training.max_steps=20 (repeatable)",
    )
    parser.add_argument(
        DEBUG_FLAG,
        action="store_true",
        help="on a failure, print the traceback of the exception behind the one-line error",
    )


def add_checkpoint_dir_argument(parser: argparse.ArgumentParser) -> None:
    """``--checkpoint-dir``: the run's checkpoint folder (``checkpoint.dir``), for the scripts
    that write or read a run's checkpoints (02, 04, 05)."""
    parser.add_argument("--checkpoint-dir", metavar="DIR", help="checkpoint folder (checkpoint.dir)")


def config_from_args(args: argparse.Namespace, flag_overrides: dict[str, Any] | None = None) -> Config:
    """Load ``--config``, then apply ``--set`` items, then dedicated flags (which win)."""
    overrides = parse_set_overrides(args.set)
    overrides.update({k: v for k, v in (flag_overrides or {}).items() if v is not None})
    return load_config(args.config, overrides)


def run_main(main: Callable[[], int | None]) -> None:
    """Run a script's ``main``; expected failures print one line and exit non-zero, no traceback.

    A graceful stop (:class:`Preempted`: SIGTERM/SIGINT, checkpoint saved) prints its line
    without ``error:``, with its exit code 128+N. With ``--debug`` on the command line, an
    error caused by another exception (a factory's, torch's) prints that traceback first.
    Besides :class:`PipelineError`: an operating-system error (full disk, read-only file
    system, permissions; also from the background checkpoint writer, re-raised in the
    training thread) names the path and the cause, exit 2; ``MemoryError`` (a task's params
    asking for more memory than there is) says so, exit 2; so does a thread or process that
    could not start because the machine is out of them (:func:`~pipeline.errors.out_of_tasks`); so
    does a library this Python cannot import (:func:`~pipeline.errors.missing_module`). Whatever was being written is
    removed by the atomic writers before the error gets here. A traceback captured in another
    process (a DataLoader worker's, :class:`CapturedTraceback`) is printed as it was captured.
    A SIGTERM or SIGINT from the first line of ``main`` to the exit is one line saying what it
    left, exit 128+N (:mod:`pipeline.stops`).
    """
    debug = DEBUG_FLAG in sys.argv[1:]
    stops.install()  # takes over from scripts/_bootstrap.py's handler (pipeline/stops.py)
    try:
        code = main()
    except BaseException as exc:
        stops.finishing()
        _end(exc, debug)
        raise  # argparse's SystemExit, or an unexpected error: as it is
    stops.finishing()
    sys.exit(code or 0)


def _end(exc: BaseException, debug: bool) -> None:
    """Print ``exc`` as one line and exit with its code; return for anything else (SystemExit
    from argparse, an unexpected exception: the caller re-raises it as it is)."""
    if isinstance(exc, Preempted):
        # A requested stop that saved its checkpoint: reported as what it is, not as an error.
        line = str(exc).replace("\n", " ")
        if not exc.quiet:
            print(line, file=sys.stderr, flush=True)
        _tell_launcher(line)
        sys.exit(exc.exit_code)
    if isinstance(exc, PipelineError):
        if debug and isinstance(exc.__cause__, CapturedTraceback):
            print(exc.__cause__.text.rstrip("\n"), file=sys.stderr)
        elif debug and exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        if not getattr(exc, "quiet", False):
            _error(str(exc))
        else:  # another rank printed it; torchrun's report names it for this rank too
            _tell_launcher(_ERROR + str(exc).replace("\n", " "))
        sys.exit(getattr(exc, "exit_code", 2))
    if isinstance(exc, OSError):
        _error(out_of_tasks(exc) or describe_os_error(exc) + _OS_HINTS.get(exc.errno or 0, ""))
        sys.exit(2)
    if isinstance(exc, ModuleNotFoundError):  # a library imported on first use (06's Hub client)
        _error(missing_module(exc))
        sys.exit(2)
    if isinstance(exc, RuntimeError):
        line = out_of_tasks(exc)  # Python's threads: any other RuntimeError is a bug, with its traceback
        if line is None:
            return
        _error(line)
        sys.exit(2)
    if isinstance(exc, MemoryError):
        _error(
            f"out of memory ({str(exc).strip() or 'an allocation failed'}): check the sizes in the config's "
            "data/model params"
        )
        sys.exit(2)
    if isinstance(exc, Stopped):
        _error(str(exc))
        sys.exit(exc.exit_code)
    if isinstance(exc, KeyboardInterrupt):
        _error("interrupted")
        sys.exit(130)


_ERROR = "error: "


def _error(message: str) -> None:
    # One line, always: a message built from a path or an exception may hold a newline.
    line = _ERROR + message.replace("\n", " ")
    print(line, file=sys.stderr, flush=True)
    _tell_launcher(line)


def _tell_launcher(line: str) -> None:
    """Under torchrun, the line this process ends with also goes to the error file its agent
    reads (``TORCHELASTIC_ERROR_FILE``, JSON as torch.distributed.elastic's ``record`` writes
    it), so the "Root Cause" of torchrun's failure report, the last thing it prints, names
    the line instead of "To enable traceback see ...". Every rank that exits non-zero writes
    the launch's one line (:meth:`pipeline.distributed.world.LaunchWorld.together`), so whichever
    rank torchrun picks, the report names it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {
        "message": {
            "message": line,
            "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))},
        }
    }
    try:
        with open(path, "w", encoding="utf-8") as out:
            json.dump(record, out)
    except OSError:
        pass  # the report then says less; the line itself is printed
