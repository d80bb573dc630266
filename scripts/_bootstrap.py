"""The scripts' imports of the project, checked: run by a Python that cannot import the
project or a library it needs (the system's, or the environment not activated), a script
says so in one line with the fix, instead of a ModuleNotFoundError traceback.

    with project_imports():
        from pipeline.cli import run_main

A SIGTERM or SIGINT while a script imports (torch takes seconds) ends it at once in one line,
exit 128 + N: nothing has started, so nothing is left (a Ctrl-C is never a traceback, nor
swallowed by a library's import): ``pipeline.stops.starting``, as ``python -m pipeline`` has it.
``run_main`` takes over from there (pipeline/stops.py).

Only the standard library here: it runs before anything of the project can be imported.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

__all__ = ["project_imports"]

_ROOT = Path(__file__).resolve().parent.parent
_VENV = _ROOT / ".venv"


def _shown(path: Path) -> str:
    """``path`` relative to the working folder when it is under it (as a command would name it)."""
    try:
        return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)
    except (OSError, ValueError):
        return str(path)


@contextlib.contextmanager
def project_imports(*, until_run_main: bool = True) -> Iterator[None]:
    """Turn a module missing from this interpreter into one ``error:`` line and exit 2; a stop
    while importing into one line and exit 128 + N (``pipeline.stops.starting``: its handler
    stays for ``run_main`` unless ``until_run_main`` is False). A Python that cannot import the
    project gets no handler: the first import in the block fails at once, naming what is missing."""
    try:
        from pipeline.stops import starting
    except ModuleNotFoundError:
        stops: contextlib.AbstractContextManager = contextlib.nullcontext()
    else:
        stops = starting(until_run_main=until_run_main)
    try:
        with stops:
            yield
    except ModuleNotFoundError as exc:
        script = _shown(Path(sys.argv[0])) if sys.argv and sys.argv[0] else "scripts/<script>.py"
        venv = _shown(_VENV)
        made = "" if (_VENV / "bin" / "python").exists() else f"; make venv creates {venv}"
        print(
            f"error: this Python ({sys.executable}) cannot import {exc.name or 'a module'}, which the scripts "
            f"need: activate the project's environment (source {venv}/bin/activate) or run "
            f"{venv}/bin/python {script}{made}; or install the project into this Python: pip install -e .",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(2)
