"""A rank whose torchrun agent dies under it, below a subreaper:

    python orphaned_rank.py RANK_SCRIPT DEADLINE_S

This process becomes a child subreaper (as systemd, ``tini -s`` or a container runtime's
shim are for the processes below them) and forks an "agent", which forks the rank. The rank
runs RANK_SCRIPT (with ``ready()`` defined: call it once the rank is in the state to test);
then the agent is SIGKILLed. The orphaned rank is reparented to this process, not to init,
so its exit status can be read here. Prints one JSON line: ``{"status": exit code (negative:
the signal), "seconds": from the agent's death to the rank's end}``, or ``{"status": null}``
when the rank still runs DEADLINE_S seconds after the agent died (it is killed then).

Nothing of ``pipeline`` is imported before the rank forks: its watchdog must watch the
agent, its parent when the package loads, as under torchrun.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import select
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def _rank(script: str, ready_fd: int) -> None:
    def ready() -> None:
        os.write(ready_fd, f"{os.getpid()}\n".encode())

    code = 0
    try:
        runpy.run_path(script, init_globals={"ready": ready}, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> int:
    script, deadline = sys.argv[1], float(sys.argv[2])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"error: prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}", file=sys.stderr)
        return 2
    ready_r, ready_w = os.pipe()
    agent = os.fork()
    if agent == 0:  # the agent: starts the rank, then waits to be killed
        os.close(ready_r)
        if os.fork() == 0:
            _rank(script, ready_w)
        while True:
            signal.pause()
    os.close(ready_w)
    readable, _, _ = select.select([ready_r], [], [], 60)
    line = os.read(ready_r, 64).decode().strip() if readable else ""
    if not line:
        os.kill(agent, signal.SIGKILL)
        print("error: the rank never became ready", file=sys.stderr)
        return 2
    rank = int(line)
    died = time.monotonic()  # before the kill: the rank may notice it before waitpid returns here
    os.kill(agent, signal.SIGKILL)
    os.waitpid(agent, 0)
    while time.monotonic() - died < deadline:
        pid, status = os.waitpid(rank, os.WNOHANG)
        if pid:
            seconds = time.monotonic() - died
            print(json.dumps({"status": os.waitstatus_to_exitcode(status), "seconds": seconds}), flush=True)
            return 0
        time.sleep(0.05)
    os.kill(rank, signal.SIGKILL)
    os.waitpid(rank, 0)
    print(json.dumps({"status": None}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
