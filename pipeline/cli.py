"""Shared command-line plumbing for the numbered scripts: config flags and error handling."""

from __future__ import annotations

import argparse
import errno
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

from .config import Config, load_config, parse_set_overrides
from .errors import PipelineError, describe_os_error

__all__ = ["add_config_arguments", "config_from_args", "run_main", "resume_command"]

# Options that choose where a run starts, or extend it (the checkpoint then records the new
# length); a resume replaces them with --resume latest.
_START_OPTIONS = ("--resume", "--init-from", "--extend-to")

_OS_HINTS = {
    errno.ENOSPC: "; nothing half-written was kept: free some space and run the command again",
    errno.EDQUOT: "; nothing half-written was kept: free some space and run the command again",
    errno.EROFS: ": write somewhere else (see --help for the folder options)",
    errno.EACCES: ": fix the permissions or write somewhere else",
    errno.EPERM: ": fix the permissions or write somewhere else",
}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=Path("config.yaml"), help="YAML config (default: config.yaml)")
    parser.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", default=[],
                        help="override any config key, e.g. --set training.max_steps=20 (repeatable)")


def config_from_args(args: argparse.Namespace, flag_overrides: dict[str, Any] | None = None) -> Config:
    """Load ``--config``, then apply ``--set`` items, then dedicated flags (which win)."""
    overrides = parse_set_overrides(args.set)
    overrides.update({k: v for k, v in (flag_overrides or {}).items() if v is not None})
    return load_config(args.config, overrides)


def resume_command(argv: list[str], launcher: list[str] | None = None) -> str:
    """The command that continues the run started by ``argv`` (``sys.argv`` of a parser
    built with ``allow_abbrev=False``, so every option is spelled out): this interpreter
    (or ``launcher``: a torchrun launch), the script path as invoked, every option as given
    (config, checkpoint folder, each ``--set``) except where the run started from and
    ``--extend-to``, then ``--resume latest``; shell-quoted."""
    kept, rest = [], iter(argv[1:])
    for token in rest:
        if token in _START_OPTIONS:
            next(rest, None)
        elif not token.startswith(tuple(f"{option}=" for option in _START_OPTIONS)):
            kept.append(token)
    return shlex.join([*(launcher or [sys.executable]), argv[0], *kept, "--resume", "latest"])


def run_main(main: Callable[[], int | None]) -> None:
    """Run a script's ``main``; expected failures print one line and exit non-zero, no traceback.

    Besides :class:`PipelineError`: an operating-system error (full disk, read-only file
    system, permissions; also from the background checkpoint writer, re-raised in the
    training thread) names the path and the cause, exit 2; ``MemoryError`` (a task's params
    asking for more memory than there is) says so, exit 2. Whatever was being written is
    removed by the atomic writers before the error gets here.
    """
    try:
        code = main()
    except PipelineError as exc:
        if not getattr(exc, "quiet", False):
            _error(str(exc))
        sys.exit(getattr(exc, "exit_code", 2))
    except OSError as exc:
        _error(describe_os_error(exc) + _OS_HINTS.get(exc.errno or 0, ""))
        sys.exit(2)
    except MemoryError as exc:
        _error(f"out of memory ({str(exc).strip() or 'an allocation failed'}): check the sizes in the config's "
               "data/model params")
        sys.exit(2)
    except KeyboardInterrupt:
        _error("interrupted")
        sys.exit(130)
    sys.exit(code or 0)


def _error(message: str) -> None:
    # One line, always: a message built from a path or an exception may hold a newline.
    print("error: " + message.replace("\n", " "), file=sys.stderr, flush=True)
