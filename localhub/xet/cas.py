"""The content-addressed store behind localhub's Xet CAS: xorbs, file reconstructions, tokens.

Layout under ``<root>/xet`` (every write atomic: temp file + fsync + rename, like the rest of localhub)::

    id                       random name of this CAS, part of its URL
    xorbs/<h[:2]>/<h>        a verified xorb, exactly as uploaded (downloads read byte ranges of it)
    files/<h[:2]>/<h>.json   a verified file: its size, declared SHA-256 and segments (xorb, chunk range)
    sha256/<sha256>.json     declared SHA-256 -> Xet file hash (how a commit's LFS pointer finds the file)
    shards/<sha256>          every accepted shard, kept as received
    chunks.idx               append-only (chunk hash, xorb hash) pairs: answers global dedup queries
    related/<h>.json         the xorbs of the last accepted shard that used xorb h (answered together)

A xorb is stored only once its chunks hash to its name; a file only once every segment's chunks exist,
its verification hashes match and its chunks hash to its file hash. The SHA-256 is what the client
declared in the shard: the CAS has no way to check it without rebuilding the file (neither does the Hub's).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Iterator

from ..store import HubError, _atomic_write
from .format import (
    FormatError,
    Xorb,
    decode_chunk,
    dedup_shard,
    file_hash,
    hash_from_hex,
    hash_hex,
    parse_shard,
    parse_xorb,
    verification_hash,
)

__all__ = ["Cas", "TokenIssuer"]

_MAX_RELATED = 64  # xorbs in one dedup answer (about 4 GB of data)


class TokenIssuer:
    """Short-lived CAS tokens (HMAC-signed, scoped to read or write), revocable all at once."""

    def __init__(self, secret: bytes, ttl: int = 3600):
        self._secret = secret
        self.ttl = ttl
        self._generation = 0  # bumping it expires every token issued so far
        self._lock = threading.Lock()

    def issue(self, scope: str, repo: str) -> tuple[str, int]:
        exp = int(time.time()) + self.ttl
        with self._lock:
            payload = json.dumps({"s": scope, "r": repo, "e": exp, "g": self._generation}).encode()
        body = base64.urlsafe_b64encode(payload).decode().rstrip("=")
        return f"{body}.{self._sign(body)}", exp

    def expire_all(self) -> None:
        with self._lock:
            self._generation += 1

    def check(self, authorization: str | None, scope: str) -> None:
        """HubError 401 unless `authorization` is 'Bearer <valid, unexpired token with this scope>'."""
        scheme, _, token = (authorization or "").partition(" ")
        body, _, sig = token.strip().partition(".")
        if scheme.lower() != "bearer" or not hmac.compare_digest(sig.encode(), self._sign(body).encode()):
            raise HubError(
                401, "Missing or invalid Xet access token: get one from the Hub's xet-*-token endpoint"
            )
        payload = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        with self._lock:
            generation = self._generation
        if payload["e"] <= time.time() or payload["g"] != generation:
            raise HubError(401, "Xet access token expired: refresh it from the Hub")
        if scope == "write" and payload["s"] != "write":
            raise HubError(403, "This Xet access token is read-only")

    def _sign(self, body: str) -> str:
        return hmac.new(self._secret, body.encode(), hashlib.sha256).hexdigest()


def _shard_path(root: Path, kind: str, name: str, suffix: str = "") -> Path:
    return root / kind / name[:2] / f"{name}{suffix}"


class Cas:
    """Verified xorbs and files of one localhub root. Thread-safe (writes are idempotent renames)."""

    def __init__(self, root: Path, tmp: Path):
        self.root, self.tmp = root, tmp
        for sub in ("xorbs", "files", "sha256", "shards", "related"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        self._xorbs: dict[str, Xorb] = {}  # parsed xorbs, so downloads don't re-hash them
        # Clients cache "this xorb is uploaded" per CAS URL; a new root must get a new URL, or a client
        # would skip uploads to a CAS that never saw them (a real CAS keeps its data forever).
        id_file = root / "id"
        if not id_file.is_file():
            _atomic_write(id_file, secrets.token_hex(8).encode(), tmp)
        self.id = id_file.read_text().strip()
        self._chunk_index: dict[bytes, bytes] = {}
        index = root / "chunks.idx"
        raw = index.read_bytes() if index.is_file() else b""
        for pos in range(0, len(raw) - len(raw) % 64, 64):  # a torn last record (crash) is ignored
            self._chunk_index.setdefault(raw[pos : pos + 32], raw[pos + 32 : pos + 64])
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ xorbs
    def xorb_path(self, name: str) -> Path:
        return _shard_path(self.root, "xorbs", name)

    def put_xorb(self, name: str, data: bytes) -> bool:
        """Verify and store a xorb; False if it was already stored. HubError 400 for bad data."""
        try:
            xorb = parse_xorb(data, hash_from_hex(name))
        except FormatError as exc:
            raise HubError(400, f"Xorb {name} refused: {exc}. Nothing was stored.") from None
        path = self.xorb_path(name)
        if path.is_file():
            return False
        _atomic_write(path, data, self.tmp)
        with self._lock:
            self._xorbs[name] = xorb
        # Every chunk, not only those a client asks about once its file is registered: a rerun after a
        # failed shard upload then finds the data already here and sends none of it again.
        records = b"".join(digest + xorb.hash for digest in xorb.chunk_hashes)
        with self._lock, open(self.root / "chunks.idx", "ab") as index:
            index.write(records)
            index.flush()
            os.fsync(index.fileno())
            for digest in xorb.chunk_hashes:
                self._chunk_index.setdefault(digest, xorb.hash)
        return True

    def dedup(self, chunk_name: str) -> bytes | None:
        """The answer to a global dedup query: a shard listing the xorb that holds this chunk."""
        try:
            digest = hash_from_hex(chunk_name)
        except FormatError:
            return None
        with self._lock:
            xorb_hash = self._chunk_index.get(digest)
        if xorb_hash is None:
            return None
        name = hash_hex(xorb_hash)
        try:
            names = json.loads((self.root / "related" / f"{name}.json").read_bytes())
        except (OSError, ValueError):
            names = [name]  # uploaded, but no shard registered it yet
        xorbs = [x for x in (self.xorb(n) for n in dict.fromkeys([name, *names])) if x is not None]
        return dedup_shard(xorbs, int(time.time()), 24 * 3600) if xorbs else None

    def xorb(self, name: str) -> Xorb | None:
        """The stored xorb `name` (chunk table), or None. A damaged file on disk counts as absent."""
        with self._lock:
            cached = self._xorbs.get(name)
        if cached is not None:
            return cached
        try:
            data = self.xorb_path(name).read_bytes()
            xorb = parse_xorb(data, hash_from_hex(name))
        except (OSError, FormatError):
            return None
        with self._lock:
            self._xorbs[name] = xorb
        return xorb

    # ------------------------------------------------------------------ shards and files
    def put_shard(self, data: bytes) -> int:
        """Verify a shard against the stored xorbs and record its files. Returns 1 if anything was new."""
        try:
            shard = parse_shard(data)
        except FormatError as exc:
            raise HubError(400, f"Shard refused: {exc}. Nothing was recorded.") from None
        for name, chunks in shard.xorbs.items():
            stored = self.xorb(hash_hex(name))
            if stored is None:
                raise HubError(
                    400, f"Shard refused: it lists xorb {hash_hex(name)}, which was never uploaded"
                )
            if chunks != list(zip(stored.chunk_hashes, stored.chunk_sizes)):
                raise HubError(
                    400, f"Shard refused: its chunk list for xorb {hash_hex(name)} differs from the xorb"
                )
        records = [self._check_file(entry) for entry in shard.files]
        new = 0
        for name, record in records:
            path = _shard_path(self.root, "files", name, ".json")
            if not path.is_file():
                _atomic_write(path, json.dumps(record).encode(), self.tmp)
                new = 1
            if record["sha256"]:
                self.index_sha256(record["sha256"], name)
        # A dedup answer lists the xorbs uploaded together, as the real CAS answers with the shard that
        # registered a chunk: one query then covers a whole file, not only the xorb of the chunk asked.
        related = list(
            dict.fromkeys(
                [hash_hex(s.xorb) for f in shard.files for s in f.segments]
                + [hash_hex(name) for name in shard.xorbs]
            )
        )[:_MAX_RELATED]
        for name in related:
            _atomic_write(self.root / "related" / f"{name}.json", json.dumps(related).encode(), self.tmp)
        _atomic_write(self.root / "shards" / hashlib.sha256(data).hexdigest(), data, self.tmp)
        return new

    def _check_file(self, entry) -> tuple[str, dict]:
        name = hash_hex(entry.hash)
        chunks, segments = [], []
        for seg in entry.segments:
            xorb = self.xorb(hash_hex(seg.xorb))
            if xorb is None:
                raise HubError(
                    400, f"Shard refused: file {name} uses xorb {hash_hex(seg.xorb)}, which is not stored"
                )
            if seg.chunk_end > len(xorb.chunk_hashes):
                raise HubError(400, f"Shard refused: file {name} asks for chunks past the end of a xorb")
            hashes = xorb.chunk_hashes[seg.chunk_start : seg.chunk_end]
            sizes = xorb.chunk_sizes[seg.chunk_start : seg.chunk_end]
            if sum(sizes) != seg.size:
                raise HubError(
                    400, f"Shard refused: file {name} declares {seg.size} bytes for a range of {sum(sizes)}"
                )
            if seg.verification is None or seg.verification != verification_hash(hashes):
                raise HubError(
                    400,
                    f"Shard refused: file {name} lacks a valid verification hash for xorb"
                    f" {hash_hex(seg.xorb)}",
                )
            chunks.extend(zip(hashes, sizes))
            segments.append([hash_hex(seg.xorb), seg.chunk_start, seg.chunk_end, seg.size])
        if file_hash(chunks) != entry.hash:
            raise HubError(400, f"Shard refused: the chunks of file {name} do not hash to its file hash")
        sha256 = (
            hash_hex(entry.sha256) if entry.sha256 is not None else None
        )  # stored as a hash: same word order
        return name, {"size": sum(s[3] for s in segments), "sha256": sha256, "segments": segments}

    def index_sha256(self, sha256: str, name: str) -> None:
        """Record that the file declared with this SHA-256 is the stored file ``name`` (the last shard wins)."""
        record = self.file(name)
        size = record["size"] if record is not None else None
        index = self.root / "sha256" / f"{sha256}.json"
        _atomic_write(index, json.dumps({"xetHash": name, "size": size}).encode(), self.tmp)

    def file(self, name: str) -> dict | None:
        try:
            return json.loads(_shard_path(self.root, "files", name, ".json").read_bytes())
        except (OSError, ValueError):
            return None

    def file_for_sha256(self, sha256: str, size: int | None) -> str | None:
        """The Xet hash of a stored file declared with this SHA-256 (and size), or None."""
        try:
            index = json.loads((self.root / "sha256" / f"{sha256}.json").read_bytes())
        except (OSError, ValueError):
            return None
        record = self.file(index["xetHash"])
        if record is None or (size is not None and record["size"] != size):
            return None
        return index["xetHash"]

    # ------------------------------------------------------------------ reads
    def reconstruction(self, name: str, first: int, last: int) -> tuple[int, list[tuple[str, int, int, int]]]:
        """Terms (xorb, chunk start, chunk end, bytes) covering bytes [first, last] of file `name`,
        and the offset of `first` into the first term."""
        record = self.file(name)
        if record is None:
            raise HubError(404, f"File {name} is not in this CAS")
        terms, pos, offset = [], 0, 0
        for xorb_name, start, end, _size in record["segments"]:
            xorb = self.xorb(xorb_name)
            if xorb is None:
                raise HubError(500, f"xorb {xorb_name} is missing or damaged on this server")
            for index in range(start, end):
                size = xorb.chunk_sizes[index]
                if pos + size > first and pos <= last:
                    if not terms:
                        offset = first - pos
                    if terms and terms[-1][0] == xorb_name and terms[-1][2] == index:
                        x, s, _, n = terms[-1]
                        terms[-1] = (x, s, index + 1, n + size)
                    else:
                        terms.append((xorb_name, index, index + 1, size))
                pos += size
        return offset, terms

    def read(self, name: str, first: int, last: int) -> Iterator[bytes]:
        """Bytes [first, last] of file `name`, rebuilt from its xorbs."""
        offset, terms = self.reconstruction(name, first, last)
        remaining = last - first + 1
        for xorb_name, start, end, _ in terms:
            xorb = self.xorb(xorb_name)
            data = self.xorb_path(xorb_name).read_bytes()
            for index in range(start, end):
                piece = decode_chunk(data, xorb.chunk_start(index), xorb.chunk_ends[index])[
                    offset : offset + remaining
                ]
                offset = 0
                remaining -= len(piece)
                yield piece
                if remaining <= 0:
                    return
