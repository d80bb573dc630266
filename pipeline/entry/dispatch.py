"""``python -m pipeline STEP [flags]`` and the ``pipeline`` console command: the step's module of
this package run as its numbered script runs it (same flags, lines and exit codes), from any
folder; every relative path (``--config``, the config's folders) is the working folder's.

Before a step's module is imported (torch takes seconds), a stop is one line
(:func:`pipeline.stops.starting`); its ``main`` runs under :func:`pipeline.cli.run_main`.
``--help`` lists the steps without importing any of them."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Sequence

from ..commands import STEPS
from ..errors import missing_module, shown
from ..stops import starting

__all__ = ["console", "main"]

MODULE_PROG = "python -m pipeline"


def main(argv: Sequence[str] | None = None, prog: str = MODULE_PROG) -> None:
    """Run the step ``argv[0]`` (default ``sys.argv[1:]``) with the flags after it; exits."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with starting():
        if argv[:1] in (["-h"], ["--help"]):
            print(_usage(prog))
            sys.exit(0)
        if not argv or argv[0] not in STEPS:
            what = f"{shown(argv[0])} is not a step" if argv else "no step named"
            print(
                f"error: {what}: {prog} STEP, where STEP is one of {', '.join(STEPS)} (see {prog} --help)",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(2)
        step = argv[0]
        try:
            module = importlib.import_module(f"{__package__}.{_module(step)}")
            from ..cli import run_main
        except ModuleNotFoundError as exc:
            print(f"error: {missing_module(exc)}", file=sys.stderr, flush=True)
            sys.exit(2)
    run_main(lambda: module.main(argv[1:], prog=f"{prog} {step}"))


def console() -> None:
    """The ``pipeline`` console command: ``python -m pipeline`` under the interpreter it was
    installed for. ``sys.argv[0]`` becomes the package's ``__main__.py``, as ``python -m`` sets
    it, so the commands it prints name that form (:func:`pipeline.commands.invocation`)."""
    sys.argv[0] = str(Path(__file__).resolve().parent.parent / "__main__.py")
    main(prog="pipeline")


def _module(step: str) -> str:
    return step.replace("-", "_")


def _usage(prog: str) -> str:
    width = max(map(len, STEPS))
    lines = [f"usage: {prog} STEP [flags]", "", "The steps, in order (STEP --help shows a step's flags):"]
    lines += [f"  {step:<{width}}  {_summary(step)}" for step in STEPS]
    lines += [
        "",
        "Relative paths (--config, the config's folders) are the working folder's. In a clone, "
        f"scripts/{STEPS['prepare']} ... scripts/{STEPS['publish']} run the same steps.",
    ]
    return "\n".join(lines)


def _summary(step: str) -> str:
    """The first line of the step module's docstring, read without importing it (torch)."""
    spec = importlib.util.find_spec(f"{__package__}.{_module(step)}")
    source = Path(spec.origin).read_text(encoding="utf-8") if spec and spec.origin else ""
    return (ast.get_docstring(ast.parse(source)) or "").split("\n", 1)[0]
