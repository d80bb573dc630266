"""Run localhub as a real subprocess (what tests and `make demo` do) and talk to its admin API."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["LocalHubProcess", "admin_request"]

_URL_LINE = re.compile(r"^localhub listening on (http://\S+)\s*$")
_PROJECT_ROOT = Path(__file__).resolve().parents[1]  # the folder holding the `localhub` package


def admin_request(
    url: str, token: str, method: str, path: str, payload: Any = None, timeout: float = 10
) -> Any:
    """Call an admin endpoint, e.g. `admin_request(url, tok, "POST", "/_localhub/faults", {...})`."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(
        url.rstrip("/") + path,
        data=data,
        method=method,
        headers={
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/json",
        },
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"null")


class LocalHubProcess:
    """`python -m localhub` in a child process; the token travels via env, never argv.

    with LocalHubProcess(root, token="t") as hub:
        HfApi(endpoint=hub.url, token="t")...
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        token: str | None = None,
        port: int = 0,
        host: str = "127.0.0.1",
        startup_timeout: float = 20,
        python: str = sys.executable,
        extra_args: tuple[str, ...] = (),
        stderr: Any = None,
    ):
        self.root, self.token, self.port, self.host = Path(root), token, port, host
        self.startup_timeout, self.python, self.extra_args, self.stderr = (
            startup_timeout,
            python,
            extra_args,
            stderr,
        )
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    def start(self) -> "LocalHubProcess":
        env = {k: v for k, v in os.environ.items() if k != "LOCALHUB_TOKEN"}
        if self.token:
            env["LOCALHUB_TOKEN"] = self.token
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PROJECT_ROOT), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        cmd = [
            self.python,
            "-m",
            "localhub",
            "--root",
            str(self.root),
            "--port",
            str(self.port),
            "--host",
            self.host,
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.stderr, env=env, text=True)
        self.url = self._read_url()
        return self

    def _read_url(self) -> str:
        if self.proc is None or self.proc.stdout is None:
            raise RuntimeError("the local Hub process was not started")
        lines: queue.Queue[str] = queue.Queue()

        def pump(stream) -> None:  # keep draining stdout so the child can never block on a full pipe
            for line in stream:
                lines.put(line)
            lines.put("")

        threading.Thread(target=pump, args=(self.proc.stdout,), daemon=True).start()
        try:
            first = lines.get(timeout=self.startup_timeout)
        except queue.Empty:
            self.stop()
            raise RuntimeError(f"localhub did not print its URL within {self.startup_timeout}s") from None
        match = _URL_LINE.match(first)
        if not match:
            code = self.proc.wait(timeout=5) if first == "" else None
            self.stop()
            raise RuntimeError(f"localhub failed to start (exit code {code}, first line {first!r})")
        return match.group(1)

    def stop(self, timeout: float = 10) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code (0 on a clean stop)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "LocalHubProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ admin API
    def admin(self, method: str, path: str, payload: Any = None) -> Any:
        if not self.url or not self.token:
            raise RuntimeError("admin calls need a started server with a token")
        return admin_request(self.url, self.token, method, path, payload)

    def set_faults(self, **spec: Any) -> dict:
        """E.g. `set_faults(fail_commit={"times": 1}, rate_limit={"times": 2, "retry_after": 0})`."""
        return self.admin("POST", "/_localhub/faults", spec)

    def request_counts(self) -> dict[str, int]:
        return self.admin("GET", "/_localhub/requests")["counts"]

    def reset_request_counts(self) -> None:
        self.admin("DELETE", "/_localhub/requests")
