"""`LocalHub`: the localhub server object, run in a background thread or in the foreground (CLI)."""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

from .faults import Faults
from .handler import Handler
from .store import Store
from .xet.cas import TokenIssuer

__all__ = ["LocalHub", "check_loopback"]


def check_loopback(host: str) -> str:
    """Return `host` if it is a loopback address, else raise ValueError (we never expose the server)."""
    if host == "localhost":
        return host
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return host.strip("[]")
    except ValueError:
        pass
    raise ValueError(
        f"refusing to bind to non-loopback host {host!r}: localhub only listens on 127.0.0.1/::1"
    )


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], hub: "LocalHub"):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.hub = hub
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, Handler)

    def track(self, conn: socket.socket, alive: bool) -> None:
        with self._connections_lock:
            (self._connections.add if alive else self._connections.discard)(conn)

    def close_connections(self) -> None:
        # Keep-alive handler threads would otherwise keep serving after stop().
        with self._connections_lock:
            conns = list(self._connections)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class LocalHub:
    """A Hub double bound to loopback. `with LocalHub(root, token="t") as hub: HfApi(endpoint=hub.url)`.

    Faults (`fail_next_commit`, `rate_limit_next`, `drop_next_upload`, `withhold_next_commit_answer`,
    `store_other_lfs_bytes`; for Xet `drop_next_xorb`, `corrupt_next_xorb`, `fail_next_shard`,
    `expire_xet_tokens`, `list_other_xet_hash`, `store_other_xet_file`; `trickle_next` for any request) and request
    counts (`request_counts`, `count`) are exposed here and through the admin endpoints. Xet CAS tokens
    live `xet_token_ttl` s.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        token: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        user: str = "localhub",
        verbose: bool = False,
        xet_token_ttl: int = 3600,
    ):
        host = check_loopback(host)
        self.root = Path(root)
        self.token = token or None
        self.user = user
        self.verbose = verbose
        self.secret = secrets.token_bytes(32)  # signs LFS upload URLs; new each start, like expiring URLs
        self.store = Store(root)
        self.faults = Faults()
        # CAS tokens live xet_token_ttl seconds (clients refresh them) and die with the server.
        self.xet_tokens = TokenIssuer(self.secret, xet_token_ttl)
        try:
            self._server = _Server((host, port), self)
        except OSError:
            self.store.close()
            raise
        self.port = self._server.server_address[1]
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "LocalHub":
        """Serve in a daemon thread; returns self."""
        if self._thread is None:
            # A short poll interval makes stop() quick (shutdown() waits for the next poll).
            self._thread = threading.Thread(
                target=self._server.serve_forever,
                kwargs={"poll_interval": 0.05},
                name="localhub",
                daemon=True,
            )
            self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in the calling thread until `stop()` (or KeyboardInterrupt)."""
        self._server.serve_forever()

    def stop(self) -> None:
        self.faults.clear()  # release requests held by a withheld-answer fault
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.close_connections()
        self._server.server_close()
        self.store.close()

    def __enter__(self) -> "LocalHub":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ faults and counts
    def fail_next_commit(self, times: int = 1, status: int = 500) -> None:
        self.faults.fail_next_commit(times, status)

    def rate_limit_next(
        self,
        times: int = 1,
        retry_after: int | None = 1,
        method: str | None = None,
        path: str | None = None,
        status: int = 429,
    ) -> None:
        self.faults.rate_limit(times, retry_after, method, path, status)

    def drop_next_upload(self, times: int = 1, after_bytes: int | None = None) -> None:
        self.faults.drop_next_upload(times, after_bytes)

    def withhold_next_commit_answer(self, times: int = 1, apply: bool = True) -> None:
        self.faults.withhold_next_commit_answer(times, apply)

    def drop_next_xorb(self, times: int = 1, after_bytes: int | None = None) -> None:
        self.faults.drop_next_xorb(times, after_bytes)

    def corrupt_next_xorb(self, times: int = 1) -> None:
        self.faults.corrupt_next_xorb(times)

    def fail_next_shard(self, times: int = 1, status: int = 500) -> None:
        self.faults.fail_next_shard(times, status)

    def expire_xet_tokens(self, after_requests: int = 0) -> None:
        self.faults.expire_xet_tokens(after_requests)

    def store_other_lfs_bytes(self, times: int = 1) -> None:
        self.faults.store_other_lfs_bytes(times)

    def list_other_xet_hash(self, times: int = 1) -> None:
        self.faults.list_other_xet_hash(times)

    def store_other_xet_file(self, times: int = 1) -> None:
        self.faults.store_other_xet_file(times)

    def trickle_next(
        self, times: int = 1, method: str | None = None, path: str | None = None, interval: float = 1.0
    ) -> None:
        self.faults.trickle(times, method, path, interval)

    def clear_faults(self) -> None:
        self.faults.clear()

    def request_counts(self) -> dict[str, int]:
        """{"METHOD /raw/path": n} for every non-admin request received (including failed ones)."""
        return self.faults.counts()

    def count(self, method: str | None = None, path: str | None = None) -> int:
        """Number of requests with this method whose path matches regex `path`."""
        return self.faults.count(method, path)

    def bytes_sent(self, method: str | None = None, path: str | None = None) -> int:
        """Response bytes (headers and bodies) sent to requests with this method whose path matches regex `path`."""
        return self.faults.bytes_sent(method, path)

    def reset_request_counts(self) -> None:
        self.faults.reset_counts()
