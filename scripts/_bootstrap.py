"""The scripts' imports of the project, checked: run by a Python that cannot import the
project or a library it needs (the system's, or the environment not activated), a script
says so in one line with the fix, instead of a ModuleNotFoundError traceback.

    with project_imports():
        from pipeline.cli import run_main

A SIGTERM or SIGINT while a script imports (torch takes seconds) ends it at once in one line,
exit 128 + N: nothing has started, so nothing is left (a Ctrl-C is never a traceback, nor
swallowed by a library's import). ``run_main`` takes over from there (pipeline/stops.py).

Only the standard library here: it runs before anything of the project can be imported.
"""

from __future__ import annotations

import contextlib
import os
import signal
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


def _stopped_while_starting(signum: int, frame: object) -> None:
    name = signal.Signals(signum).name
    os.write(2, f"error: stopped by {name} while starting; nothing was done\n".encode())
    os._exit(128 + signum)


@contextlib.contextmanager
def project_imports(*, until_run_main: bool = True) -> Iterator[None]:
    """Turn a module missing from this interpreter into one ``error:`` line and exit 2; a stop
    while importing into one line and exit 128 + N. The stop handler stays for ``run_main`` to
    replace (``until_run_main``), so no instant is left without one; a script that does not end
    through ``run_main`` passes False, and the previous handlers come back after the imports.
    Installed only for a signal nothing else handles yet (a second import block keeps
    ``run_main``'s; one the parent ignores, as ``nohup`` does, stays ignored)."""
    defaults = (signal.SIG_DFL, signal.default_int_handler)
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    previous = {signum: handler for signum, handler in previous.items() if handler in defaults}
    for signum in previous:
        signal.signal(signum, _stopped_while_starting)
    try:
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
    finally:
        if not until_run_main:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
