"""A numbered script, run as it is, that sends itself a signal at one chosen instant.

    python -B tests/helpers/signalled_script.py SIGNAL WHEN SCRIPT [ARGS...]

Runs ``scripts/SCRIPT`` as ``python scripts/SCRIPT ARGS...`` would (``__main__``, its argv),
after wrapping, from the test's side, the call named by WHEN so that the process sends itself
SIGNAL (``SIGTERM``, ``SIGINT``) right before it:

- ``step:NAME``: the atomic-folder step NAME (``pipeline.durable.step``: ``rename``,
  ``fsync_parent``, ``remove_old``, ...), the n-th time it runs with ``step:NAME:N``;
- ``call:MODULE:FUNCTION``: a function of the project (``pipeline.commands:record_stage_command``);
- ``exit``: once ``main`` has returned or failed (``pipeline.stops.finishing``).

So the signal lands in that phase every time, on the real script; nothing in ``pipeline/``
knows about it.
"""

from __future__ import annotations

import importlib
import os
import runpy
import signal
import sys
from pathlib import Path


def _signalling(call, signum: int, nth: int = 1):
    seen = []

    def wrapped(*args, **kwargs):
        seen.append(None)
        if len(seen) == nth:
            os.kill(os.getpid(), signum)
        return call(*args, **kwargs)

    return wrapped


def main() -> None:
    name, when, script, *args = sys.argv[1:]
    signum = signal.Signals[name]
    kind, _, what = when.partition(":")
    if kind == "step":
        import pipeline.durable as durable

        real_step = durable.step
        wanted, _, nth = what.partition(":")
        send = _signalling(lambda: None, signum, int(nth or 1))

        def step(step_name, call, *step_args):
            if step_name == wanted:
                send()
            return real_step(step_name, call, *step_args)

        durable.step = step
    elif kind == "call":
        module_name, _, function = what.partition(":")
        module = importlib.import_module(module_name)
        setattr(module, function, _signalling(getattr(module, function), signum))
    elif kind == "exit":
        import pipeline.stops as stops

        finishing = stops.finishing

        def then_signal() -> None:
            finishing()
            os.kill(os.getpid(), signum)

        stops.finishing = then_signal
    else:
        raise SystemExit(f"unknown instant {when}")
    path = Path(__file__).resolve().parents[2] / "scripts" / script
    sys.argv[:] = [str(path), *args]
    sys.path.insert(0, str(path.parent))
    runpy.run_path(str(path), run_name="__main__")


if __name__ == "__main__":
    main()
