"""Fault injection and request accounting for localhub (thread-safe, in memory only): requests
and response bytes per "METHOD /path", admin calls excluded.

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
        self._xorb_drops: list[int | None] = []  # the same for Xet xorb uploads
        self._xorb_corruptions = 0  # xorb uploads to damage in transit (one byte flipped)
        self._shard_failures: list[int] = []  # one HTTP status per Xet shard upload to fail
        self._token_expiry: list[int] = []  # CAS requests still served before every Xet token expires
        self._other_bytes = 0  # commits whose first LFS file is stored with other bytes
        self._other_xet_hash = 0  # commits whose first Xet-stored file is listed with another Xet hash
        self._other_xet_file = 0  # commits whose first Xet-stored file is mixed up with their second
        self._trickles: list[dict[str, Any]] = []  # answers sent one byte at a time
        self._counts: Counter[str] = Counter()
        self._sent: Counter[str] = Counter()  # response bytes (headers and body) per "METHOD /path"

    # ------------------------------------------------------------------ arming
    def fail_next_commit(self, times: int = 1, status: int = 500) -> None:
        """The next `times` commit requests answer `status` and write nothing."""
        with self._lock:
            self._commit_failures.extend([int(status)] * int(times))

    def rate_limit(
        self,
        times: int = 1,
        retry_after: int | None = 1,
        method: str | None = None,
        path: str | None = None,
        status: int = 429,
    ) -> None:
        """The next `times` requests matching `method` and regex `path` answer `status` (429: too
        many requests; a 5xx for a failing server) with `Retry-After` (none when None)."""
        rule = {
            "remaining": int(times),
            "retry_after": None if retry_after is None else int(retry_after),
            "method": method.upper() if method else None,
            "path": path,
            "status": int(status),
        }
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

    def drop_next_xorb(self, times: int = 1, after_bytes: int | None = None) -> None:
        """The next `times` xorb uploads read `after_bytes` (default: half), then drop the socket."""
        with self._lock:
            self._xorb_drops.extend([after_bytes] * int(times))

    def corrupt_next_xorb(self, times: int = 1) -> None:
        """The next `times` xorb uploads arrive with one byte flipped (after the client hashed them)."""
        with self._lock:
            self._xorb_corruptions += int(times)

    def fail_next_shard(self, times: int = 1, status: int = 500) -> None:
        """The next `times` shard uploads answer `status` and record nothing."""
        with self._lock:
            self._shard_failures.extend([int(status)] * int(times))

    def expire_xet_tokens(self, after_requests: int = 0) -> None:
        """After `after_requests` more CAS requests, every Xet token issued so far expires (401)."""
        with self._lock:
            self._token_expiry.append(int(after_requests))

    def store_other_lfs_bytes(self, times: int = 1) -> None:
        """The next `times` commits store their first LFS file with other bytes of the same size
        (one bit flipped), and list the SHA-256 of what they stored: a Hub that lost the bytes."""
        with self._lock:
            self._other_bytes += int(times)

    def list_other_xet_hash(self, times: int = 1) -> None:
        """The next `times` commits list their first Xet-stored file with another Xet hash (one bit
        flipped): a Hub whose CAS holds other chunks than the ones the client hashed."""
        with self._lock:
            self._other_xet_hash += int(times)

    def store_other_xet_file(self, times: int = 1) -> None:
        """The next `times` commits holding two Xet-stored files name, for the first, the second's
        Xet file (in the listing and in the CAS's SHA-256 index): the Hub serves other bytes for it."""
        with self._lock:
            self._other_xet_file += int(times)

    def trickle(
        self, times: int = 1, method: str | None = None, path: str | None = None, interval: float = 1.0
    ) -> None:
        """The next `times` requests matching `method` and regex `path` are answered one byte every
        `interval` seconds (status line, headers, body): a server that never stops sending, so a
        timeout on each socket read never trips. Ends when the client hangs up or faults are cleared."""
        rule = {
            "remaining": int(times),
            "method": method.upper() if method else None,
            "path": path,
            "interval": float(interval),
        }
        re.compile(path or "")
        with self._lock:
            self._trickles.append(rule)
            self._released.clear()

    def clear(self) -> None:
        with self._lock:
            self._trickles.clear()
            self._commit_failures.clear()
            self._rate_limits.clear()
            self._drops.clear()
            self._withheld.clear()
            self._xorb_drops.clear()
            self._xorb_corruptions = 0
            self._shard_failures.clear()
            self._token_expiry.clear()
            self._other_bytes = 0
            self._other_xet_hash = 0
            self._other_xet_file = 0
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
        if "drop_xorb" in spec:
            self.drop_next_xorb(**spec["drop_xorb"])
        if "corrupt_xorb" in spec:
            self.corrupt_next_xorb(**spec["corrupt_xorb"])
        if "fail_shard" in spec:
            self.fail_next_shard(**spec["fail_shard"])
        if "expire_xet_tokens" in spec:
            self.expire_xet_tokens(**spec["expire_xet_tokens"])
        if "other_lfs_bytes" in spec:
            self.store_other_lfs_bytes(**spec["other_lfs_bytes"])
        if "other_xet_hash" in spec:
            self.list_other_xet_hash(**spec["other_xet_hash"])
        if "other_xet_file" in spec:
            self.store_other_xet_file(**spec["other_xet_file"])
        if "trickle" in spec:
            self.trickle(**spec["trickle"])

    def pending(self) -> dict:
        with self._lock:
            return {
                "fail_commit": list(self._commit_failures),
                "rate_limit": [dict(r) for r in self._rate_limits],
                "drop_upload": list(self._drops),
                "withhold_commit_answer": list(self._withheld),
                "drop_xorb": list(self._xorb_drops),
                "corrupt_xorb": self._xorb_corruptions,
                "fail_shard": list(self._shard_failures),
                "expire_xet_tokens": list(self._token_expiry),
                "other_lfs_bytes": self._other_bytes,
                "other_xet_hash": self._other_xet_hash,
                "other_xet_file": self._other_xet_file,
                "trickle": [dict(r) for r in self._trickles],
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

    def take_rate_limit(self, method: str, path: str) -> tuple[int, int | None] | None:
        """(status, Retry-After) for this request, or None to answer it normally."""
        with self._lock:
            for rule in self._rate_limits:
                if rule["method"] not in (None, method) or not re.search(rule["path"] or "", path):
                    continue
                rule["remaining"] -= 1
                if rule["remaining"] <= 0:
                    self._rate_limits.remove(rule)
                return rule["status"], rule["retry_after"]
        return None

    def take_trickle(self, method: str, path: str) -> float | None:
        """Seconds between two bytes of this request's answer, or None to answer it normally."""
        with self._lock:
            for rule in self._trickles:
                if rule["method"] not in (None, method) or not re.search(rule["path"] or "", path):
                    continue
                rule["remaining"] -= 1
                if rule["remaining"] <= 0:
                    self._trickles.remove(rule)
                return rule["interval"]
        return None

    def trickling(self, seconds: float) -> bool:
        """Wait `seconds` before the next byte of a trickled answer; False once the faults are cleared."""
        return not self._released.wait(seconds)

    def take_other_lfs_bytes(self) -> bool:
        with self._lock:
            if not self._other_bytes:
                return False
            self._other_bytes -= 1
            return True

    def take_other_xet_hash(self) -> bool:
        with self._lock:
            if not self._other_xet_hash:
                return False
            self._other_xet_hash -= 1
            return True

    def take_other_xet_file(self) -> bool:
        with self._lock:
            if not self._other_xet_file:
                return False
            self._other_xet_file -= 1
            return True

    def take_drop(self) -> tuple[bool, int | None]:
        with self._lock:
            if not self._drops:
                return False, None
            return True, self._drops.pop(0)

    def take_xorb_drop(self) -> tuple[bool, int | None]:
        with self._lock:
            if not self._xorb_drops:
                return False, None
            return True, self._xorb_drops.pop(0)

    def take_xorb_corruption(self) -> bool:
        with self._lock:
            if not self._xorb_corruptions:
                return False
            self._xorb_corruptions -= 1
            return True

    def take_shard_failure(self) -> int | None:
        with self._lock:
            return self._shard_failures.pop(0) if self._shard_failures else None

    def take_token_expiry(self) -> bool:
        """True when the tokens must expire now (called once per CAS request)."""
        with self._lock:
            if not self._token_expiry:
                return False
            if self._token_expiry[0] > 0:
                self._token_expiry[0] -= 1
                return False
            self._token_expiry.pop(0)
            return True

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

    def record_sent(self, key: str, n: int) -> None:
        with self._lock:
            self._sent[key] += n

    def bytes_sent(self, method: str | None = None, path: str | None = None) -> int:
        """Response bytes sent for requests whose method equals `method` and whose path matches regex `path`."""
        with self._lock:
            sent = dict(self._sent)
        total = 0
        for key, n in sent.items():
            m, p = key.split(" ", 1)
            if (method is None or m == method.upper()) and (path is None or re.search(path, p)):
                total += n
        return total

    def reset_counts(self) -> None:
        with self._lock:
            self._counts.clear()
            self._sent.clear()
