"""A fork server for the scripts the tests run: torch (and ``torch._dynamo``, which the first
``Optimizer()`` of every training process imports) is imported once, every script run is
a forked child of this process (``python -B tests/helpers/zygote.py SOCKET``, started by tests/helpers/support.py).

Importing torch costs 2-4 s of CPU on the 2-core test machine, and the suite runs a few hundred
scripts; forked from here, a script starts in milliseconds. Each child is still a real process
with its own pid, working folder, environment, file descriptors and exit status: it runs the
script as ``python -B SCRIPT ARGS...`` would (``__main__``, ``sys.argv``, ``sys.path[0]`` the
script's folder, ``PYTHONPATH`` first on the path, atexit handlers at exit), and the test side
reads its stdout and stderr through pipes and can kill it.

What a fork cannot give is a fresh interpreter: the modules imported below are shared, and so is
the string-hash seed. tests/helpers/support.py therefore runs a real ``exec`` whenever the environment
asks for something these imports read at load time (OMP_*, MKL_*, TORCH_*, ...), and the resume
proofs (03) start their legs as real processes, so cross-process exactness is still proven under
hash randomisation. Nothing of ``pipeline`` is imported here: each child imports the tree under test.

Protocol, one connection per run: the client sends a JSON request (argv, cwd, env) with its
stdin, stdout and stderr descriptors attached (SCM_RIGHTS); the server answers the child's pid
on one line, then, when the child has ended, its exit status on a second line.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import traceback

import numpy  # noqa: F401 - the point of this process: imported once, inherited by every child
import safetensors.torch  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401 - what the first Optimizer() imports (about 2 s here)
import yaml  # noqa: F401

# What a training run's traces and 05's training curve import (optional extras, read by every
# run that has them: about 0.1 s and 0.6 s of each run's CPU here). matplotlib reads its MPL*
# settings at load time, so support.py sends a run that sets them to a real exec.
try:
    import tensorboard.compat.proto.event_pb2  # noqa: F401
    import tensorboard.compat.proto.summary_pb2  # noqa: F401
    import tensorboard.summary.writer.record_writer  # noqa: F401
except ImportError:
    pass
try:
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.figure  # noqa: F401
    import matplotlib.ticker  # noqa: F401
except ImportError:
    pass
# The Hub client's HTTP stack (05 and 06 import it through huggingface_hub: about 0.1 s). Not
# huggingface_hub itself: it reads its HF_* settings at load time, and most runs set their own.
try:
    import filelock  # noqa: F401
    import httpx2  # noqa: F401
except ImportError:
    pass

_PYTHONPATH_AT_START = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
# The interpreter's own entries (stdlib, site-packages), without this script's folder and PYTHONPATH.
_BASE_PATH = [p for p in sys.path[1:] if p not in _PYTHONPATH_AT_START]


def _run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: become ``python -B SCRIPT ARGS...`` and never return."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True
        )
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False),
            write_through=True,
            line_buffering=True,
            errors="backslashreplace",
        )
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        script = request["argv"][0]
        pythonpath = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.path.dirname(os.path.abspath(script)), *pythonpath, *_BASE_PATH]
        sys.argv[:] = request["argv"]
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - what the interpreter would print for an uncaught error
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - a closed pipe: nothing left to say
                pass
        os._exit(code & 0xFF)


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    # SIGCHLD wakes select() through this pipe; children are reaped without a thread (fork-safe).
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}
    # What the imports above set for themselves (torch's inductor sets its cache folder): the
    # client takes a run whose environment lacks such a variable as the same environment.
    print(json.dumps({"ready": dict(os.environ)}), flush=True)
    while True:
        readable, _, _ = select.select([listener, wake_read], [], [])
        if wake_read in readable:
            os.read(wake_read, 4096)
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = waiting.pop(pid, None)
            if connection is not None:
                try:
                    connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass  # the test side gave up (timeout) and closed its end
                connection.close()
        if listener in readable:
            connection, _ = listener.accept()
            fds: list[int] = []
            try:
                message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
                while not message.endswith(b"\n"):
                    more = connection.recv(1 << 20)
                    if not more:
                        break
                    message += more
                request = json.loads(message)
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    connection.close()
                    os.close(wake_read)
                    os.close(wake_write)
                    _run_child(request, fds)
                waiting[pid] = connection
                connection.sendall(f"{pid}\n".encode())
            except (OSError, ValueError) as exc:
                # One client's broken request or hung-up socket must not end the server for the others.
                print(f"zygote: dropped a request: {exc!r}", file=sys.stderr, flush=True)
                if connection not in waiting.values():
                    connection.close()
            finally:
                for fd in fds:
                    os.close(fd)


if __name__ == "__main__":
    serve(sys.argv[1])
