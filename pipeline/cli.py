"""Shared command-line plumbing for the numbered scripts: config flags and error handling."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

from .config import Config, load_config, parse_set_overrides
from .errors import PipelineError

__all__ = ["add_config_arguments", "config_from_args", "run_main", "resume_command"]

# Options that choose where a run starts; a resume replaces them with --resume latest.
_START_OPTIONS = ("--resume", "--init-from")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=Path("config.yaml"), help="YAML config (default: config.yaml)")
    parser.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", default=[],
                        help="override any config key, e.g. --set training.max_steps=20 (repeatable)")


def config_from_args(args: argparse.Namespace, flag_overrides: dict[str, Any] | None = None) -> Config:
    """Load ``--config``, then apply ``--set`` items, then dedicated flags (which win)."""
    overrides = parse_set_overrides(args.set)
    overrides.update({k: v for k, v in (flag_overrides or {}).items() if v is not None})
    return load_config(args.config, overrides)


def resume_command(argv: list[str]) -> str:
    """The command that continues the run started by ``argv`` (``sys.argv`` of a parser
    built with ``allow_abbrev=False``, so every option is spelled out): this interpreter,
    the script path as invoked, every option as given (config, checkpoint folder, each
    ``--set``) except where the run started from, then ``--resume latest``; shell-quoted."""
    kept, rest = [], iter(argv[1:])
    for token in rest:
        if token in _START_OPTIONS:
            next(rest, None)
        elif not token.startswith(tuple(f"{option}=" for option in _START_OPTIONS)):
            kept.append(token)
    return shlex.join([sys.executable, argv[0], *kept, "--resume", "latest"])


def run_main(main: Callable[[], int | None]) -> None:
    """Run a script's ``main``; expected failures print one line and exit non-zero, no traceback."""
    try:
        code = main()
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(getattr(exc, "exit_code", 2))
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    sys.exit(code or 0)
