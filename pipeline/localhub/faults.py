"""Fault injection and request counting for localhub (thread-safe, in memory only).

Faults are "armed" for the next N matching requests and disarm themselves once used, so a test
states exactly how many failures the client will meet.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from typing import Any

__all__ = ["Faults"]


class Faults:
    """Pending faults plus a per-"METHOD /path" request counter."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._commit_failures: list[int] = []  # one HTTP status per commit to fail
        self._rate_limits: list[dict[str, Any]] = []
        self._drops: list[int | None] = []  # one entry per LFS PUT to cut: bytes to read first
        self._withheld: list[bool] = []  # one entry per commit whose answer never comes: apply it first?
        self._released = threading.Event()  # set by clear(): withheld answers stop waiting
        self._counts: Counter[str] = Counter()

    # ------------------------------------------------------------------ arming
    def fail_next_commit(self, times: int = 1, status: int = 500) -> None:
        """The next `times` commit requests answer `status` and write nothing."""
        with self._lock:
            self._commit_failures.extend([int(status)] * int(times))

    def rate_limit(self, times: int = 1, retry_after: int = 1, method: str | None = None,
                   path: str | None = None) -> None:
        """The next `times` requests matching `method` and regex `path` answer 429 + `Retry-After`."""
        rule = {"remaining": int(times), "retry_after": int(retry_after),
                "method": method.upper() if method else None, "path": path}
        re.compile(path or "")  # fail now, in the caller, on a bad pattern
        with self._lock:
            self._rate_limits.append(rule)

    def drop_next_upload(self, times: int = 1, after_bytes: int | None = None) -> None:
        """The next `times` LFS PUTs read `after_bytes` (default: half the body), then drop the socket."""
        with self._lock:
            self._drops.extend([after_bytes] * int(times))

    def withhold_next_commit_answer(self, times: int = 1, apply: bool = True) -> None:
        """The next `times` commits are applied (or not, with `apply=False`), then get no answer: the
        request is held until the client gives up or the faults are cleared, and the socket is closed."""
        with self._lock:
            self._withheld.extend([bool(apply)] * int(times))
            self._released.clear()

    def clear(self) -> None:
        with self._lock:
            self._commit_failures.clear()
            self._rate_limits.clear()
            self._drops.clear()
            self._withheld.clear()
        self._released.set()

    def configure(self, spec: dict) -> None:
        """Arm faults from the admin endpoint's JSON (same keys as the methods' arguments)."""
        if spec.get("clear"):
            self.clear()
        if "fail_commit" in spec:
            self.fail_next_commit(**spec["fail_commit"])
        if "rate_limit" in spec:
            self.rate_limit(**spec["rate_limit"])
        if "drop_upload" in spec:
            self.drop_next_upload(**spec["drop_upload"])
        if "withhold_commit_answer" in spec:
            self.withhold_next_commit_answer(**spec["withhold_commit_answer"])

    def pending(self) -> dict:
        with self._lock:
            return {
                "fail_commit": list(self._commit_failures),
                "rate_limit": [dict(r) for r in self._rate_limits],
                "drop_upload": list(self._drops),
                "withhold_commit_answer": list(self._withheld),
            }

    # ------------------------------------------------------------------ consuming (server side)
    def take_commit_failure(self) -> int | None:
        with self._lock:
            return self._commit_failures.pop(0) if self._commit_failures else None

    def take_withheld_answer(self) -> bool | None:
        """None: answer normally; else whether to apply the commit before withholding the answer."""
        with self._lock:
            return self._withheld.pop(0) if self._withheld else None

    def hold(self, seconds: float) -> None:
        """Wait up to `seconds`, or until the faults are cleared."""
        self._released.wait(seconds)

    def take_rate_limit(self, method: str, path: str) -> int | None:
        with self._lock:
            for rule in self._rate_limits:
                if rule["method"] not in (None, method) or not re.search(rule["path"] or "", path):
                    continue
                rule["remaining"] -= 1
                if rule["remaining"] <= 0:
                    self._rate_limits.remove(rule)
                return rule["retry_after"]
        return None

    def take_drop(self) -> tuple[bool, int | None]:
        with self._lock:
            if not self._drops:
                return False, None
            return True, self._drops.pop(0)

    # ------------------------------------------------------------------ counting
    def record(self, method: str, path: str) -> None:
        with self._lock:
            self._counts[f"{method} {path}"] += 1

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def count(self, method: str | None = None, path: str | None = None) -> int:
        """Sum of requests whose method equals `method` and whose path matches regex `path`."""
        total = 0
        for key, n in self.counts().items():
            m, p = key.split(" ", 1)
            if (method is None or m == method.upper()) and (path is None or re.search(path, p)):
                total += n
        return total

    def reset_counts(self) -> None:
        with self._lock:
            self._counts.clear()
