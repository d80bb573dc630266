"""HTTP front of localhub: the subset of the Hub API that `huggingface_hub` uses.

Routes (repo ids are always "namespace/name"; `{t}` is models|datasets|spaces):

    GET  /api/whoami-v2                         POST /api/repos/create     DELETE /api/repos/delete
    GET  /api/{t}/{id}[/revision/{rev}]         GET  /api/{t}/{id}/refs    GET /api/{t}/{id}/commits/{rev}
    GET  /api/{t}/{id}/tree/{rev}[/{path}]      POST /api/{t}/{id}/paths-info/{rev}
    POST /api/{t}/{id}/preupload/{rev}          POST /api/{t}/{id}/commit/{rev}  (NDJSON)
    POST|DELETE /api/{t}/{id}/branch/{branch}   POST /api/validate-yaml
    POST /[{t}/]{id}.git/info/lfs/objects/batch  (git-lfs batch API, upload only)
    PUT  /_localhub/lfs/{type}/{id}/{oid}       POST /_localhub/lfs-verify/{type}/{id}
    HEAD|GET /[{t}/]{id}/resolve/{rev}/{path}
    GET  /api/{t}/{id}/xet-{read,write}-token/{rev}   and the Xet CAS under /_xet/ (see xet/http.py)
    admin (token): GET|POST|DELETE /_localhub/faults, GET|DELETE /_localhub/requests; GET /_localhub/health
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import socket
import sys
import traceback
from functools import partial
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any, Iterator
from urllib.parse import parse_qs, unquote, urlsplit

from .lfs import LfsRoutes
from .store import HubError, lfs_pointer, validate_path
from .xet import http as xet_http

if TYPE_CHECKING:
    from .hub import LocalHub

__all__ = ["Handler"]

_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_MAX_DRAIN = 64 << 20  # above this, close the connection instead of reading an unwanted body
_WITHHELD_ANSWER_S = 120.0  # how long a withheld commit answer is held at most (faults.py)


class _CountingWriter:
    """The connection's write side, counting what each request's response sends (faults.py)."""

    def __init__(self, inner: Any, handler: "Handler") -> None:
        self._inner, self._handler = inner, handler

    def write(self, data: bytes) -> int:
        interval = getattr(self._handler, "_trickle", None)
        if interval is not None:
            return self._trickle(data, interval)
        written = self._inner.write(data)
        self._count(len(data))
        return written

    def _count(self, n: int) -> None:
        key = getattr(self._handler, "_key", None)
        if key is not None:
            self._handler.hub.faults.record_sent(key, n)

    def _trickle(self, data: bytes, interval: float) -> int:
        """Fault: one byte, then a wait, until the answer is sent or the faults are cleared."""
        faults = self._handler.hub.faults
        try:
            for at in range(len(data)):
                self._inner.write(data[at : at + 1])
                self._count(1)
                if not faults.trickling(interval):
                    self._inner.write(data[at + 1 :])
                    self._count(len(data) - at - 1)
                    break
        except OSError:  # the client hung up
            raise _ClientGone() from None
        return len(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _ClientGone(Exception):
    """The connection is gone (client hung up, or we dropped it on purpose)."""


def _truthy(values: list[str] | None) -> bool:
    return bool(values) and values[-1].lower() in ("1", "true", "yes")


class Handler(LfsRoutes, BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the Hub; every response carries Content-Length
    server_version = "localhub"
    timeout = 120  # idle keep-alive connections end eventually
    # A response is two writes (headers, then body): with Nagle's algorithm on, the body waits
    # for the client's delayed ACK of the headers, 40 ms on every request over loopback.
    disable_nagle_algorithm = True

    # ------------------------------------------------------------------ plumbing
    @property
    def hub(self) -> "LocalHub":
        return self.server.hub  # type: ignore[attr-defined]

    def setup(self) -> None:
        super().setup()
        self.wfile = _CountingWriter(self.wfile, self)  # type: ignore[assignment]
        self.server.track(self.connection, True)  # type: ignore[attr-defined]

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        self.server.track(self.connection, False)  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        if self.hub.verbose:
            super().log_message(format, *args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        self._method, self._body_read = method, False
        url = urlsplit(self.path)
        self._query = parse_qs(url.query)
        segs = [unquote(s) for s in url.path.split("/")[1:]]
        is_admin = segs[:1] == ["_localhub"] and segs[1:2] not in (["lfs"], ["lfs-verify"])
        self._key = None if is_admin else f"{method} {url.path}"
        self._trickle = None
        try:
            if not is_admin:  # admin calls are neither counted nor rate limited: tests must reach them
                self.hub.faults.record(method, url.path)
                self._trickle = self.hub.faults.take_trickle(method, url.path)
                limited = self.hub.faults.take_rate_limit(method, url.path)
                if limited is not None:
                    status, retry_after = limited
                    raise HubError(
                        status,
                        f"{'Too Many Requests' if status == 429 else 'Server error'} (injected by localhub)",
                        headers={} if retry_after is None else {"Retry-After": str(retry_after)},
                    )
            self._route(method, segs)
        except HubError as err:
            self._send_error(err)
        except _ClientGone:
            self.close_connection = True
        except Exception as exc:  # a bug must still answer something the client can report
            traceback.print_exc(file=sys.stderr)
            self._send_error(HubError(500, f"localhub internal error: {exc!r}"))

    # ------------------------------------------------------------------ bodies and responses
    def _body_chunks(self) -> Iterator[bytes]:
        self._body_read = True
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._chunked_body()
        return self._sized_body(int(self.headers.get("Content-Length") or 0))

    def _sized_body(self, remaining: int) -> Iterator[bytes]:
        while remaining > 0:
            chunk = self.rfile.read(min(remaining, 1 << 20))
            if not chunk:
                raise _ClientGone()
            remaining -= len(chunk)
            yield chunk

    def _chunked_body(self) -> Iterator[bytes]:
        while True:
            size = int(self.rfile.readline(65537).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            yield from self._sized_body(size)
            self.rfile.readline()  # CRLF after each chunk

    def _body(self) -> bytes:
        return b"".join(self._body_chunks())

    def _json_body(self) -> Any:
        try:
            return json.loads(self._body() or b"{}")
        except ValueError:
            raise HubError(400, "Request body is not valid JSON") from None

    def _send(
        self,
        status: int,
        body: bytes = b"",
        content_type: str = "application/json",
        headers: dict | None = None,
    ) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, str(value))
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self._method != "HEAD":
            self.wfile.write(body)

    def _send_json(
        self, obj: Any, status: int = 200, headers: dict | None = None, content_type: str = "application/json"
    ) -> None:
        self._send(status, json.dumps(obj).encode(), content_type, headers)

    def _send_error(self, err: HubError) -> None:
        if not self._body_read:  # read the unwanted body so the keep-alive connection stays usable
            try:
                if int(self.headers.get("Content-Length") or 0) > _MAX_DRAIN:
                    self.close_connection = True
                else:
                    for _ in self._body_chunks():
                        pass
            except (OSError, ValueError, _ClientGone):
                self.close_connection = True
        # Header values must be one latin-1 line; the JSON body keeps the full message.
        one_line = " ".join(err.message.split()).encode("ascii", "replace").decode()
        headers = {"X-Error-Message": one_line, **err.headers}
        if err.code:
            headers["X-Error-Code"] = err.code
        try:
            self._send_json({"error": err.message, **err.extra}, err.status, headers)
        except (OSError, _ClientGone):
            self.close_connection = True

    # ------------------------------------------------------------------ auth
    def _authorized(self) -> bool:
        """False without credentials; 401 for wrong ones (the Hub rejects bad tokens even on reads)."""
        header = self.headers.get("Authorization")
        if header is None:
            return False
        scheme, _, value = header.partition(" ")
        token = self.hub.token
        if (
            scheme.lower() != "bearer"
            or not token
            or not hmac.compare_digest(value.strip().encode(), token.encode())
        ):
            raise HubError(401, "Invalid credentials in Authorization header")
        return True

    def _require_write(self) -> None:
        if not self.hub.token:
            raise HubError(
                403,
                "localhub was started without a token, so it is read-only"
                " (start it with LOCALHUB_TOKEN or --token)",
            )
        if not self._authorized():
            raise HubError(401, "You must be authenticated to write: send 'Authorization: Bearer <token>'")

    def _readable_repo(self, repo_type: str, repo_id: str) -> dict:
        authorized = self._authorized()
        repo = self.hub.store.get_repo(repo_type, repo_id)
        if repo["private"] and not authorized:  # like the Hub: a private repo is invisible, not forbidden
            raise HubError(404, f"Repository Not Found: {repo_type} {repo_id}", "RepoNotFound")
        return repo

    def _writable_repo(self, repo_type: str, repo_id: str) -> dict:
        self._require_write()
        return self.hub.store.get_repo(repo_type, repo_id)

    # ------------------------------------------------------------------ routing
    def _route(self, method: str, segs: list[str]) -> None:
        if segs[:1] == ["_localhub"]:
            return self._route_localhub(method, segs[1:])
        if segs[:1] == ["api"]:
            return self._route_api(method, segs[1:])
        if segs[:1] == ["_xet"]:
            return xet_http.route(self, method, segs[1:])
        repo_type = "model"
        if segs[:1] in (["datasets"], ["spaces"]) and len(segs) > 3:
            repo_type, segs = _TYPES[segs[0]], segs[1:]
        if len(segs) == 6 and segs[1].endswith(".git") and segs[2:] == ["info", "lfs", "objects", "batch"]:
            if method == "POST":
                return self._lfs_batch(repo_type, f"{segs[0]}/{segs[1][:-4]}")
        if len(segs) >= 5 and segs[2] == "resolve" and method in ("GET", "HEAD"):
            return self._resolve(repo_type, f"{segs[0]}/{segs[1]}", segs[3], "/".join(segs[4:]))
        raise HubError(404, f"Not Found: {method} {self.path}")

    def _route_api(self, method: str, segs: list[str]) -> None:
        simple = {
            ("GET", "whoami-v2"): self._whoami,
            ("POST", "repos/create"): self._create_repo,
            ("DELETE", "repos/delete"): self._delete_repo,
            ("POST", "validate-yaml"): self._validate_yaml,
        }
        if (method, "/".join(segs)) in simple:
            return simple[(method, "/".join(segs))]()
        if len(segs) < 3 or segs[0] not in _TYPES:
            raise HubError(404, f"Not Found: {method} {self.path}")
        repo_type, repo_id, action, args = (
            _TYPES[segs[0]],
            f"{segs[1]}/{segs[2]}",
            "/".join(segs[3:4]),
            segs[4:],
        )
        routes = {
            ("GET", ""): self._info,
            ("GET", "revision"): self._info,
            ("GET", "refs"): self._refs,
            ("GET", "commits"): self._commits,
            ("GET", "tree"): self._tree,
            ("POST", "paths-info"): self._paths_info,
            ("POST", "preupload"): self._preupload,
            ("POST", "commit"): self._commit,
            ("POST", "branch"): self._branch,
            ("DELETE", "branch"): self._branch,
            ("POST", "tag"): self._tag,
            ("GET", "xet-write-token"): partial(xet_http.token, self, "write"),
            ("GET", "xet-read-token"): partial(xet_http.token, self, "read"),
        }
        handler = routes.get((method, action))
        if handler is None or (action not in ("", "refs", "tree") and not args):
            raise HubError(404, f"Not Found: {method} {self.path}")
        handler(repo_type, repo_id, args)

    def _route_localhub(self, method: str, segs: list[str]) -> None:
        if segs[:1] == ["lfs"] and len(segs) == 5 and method == "PUT":
            return self._lfs_upload(segs[1], f"{segs[2]}/{segs[3]}", segs[4])
        if segs[:1] == ["lfs-verify"] and len(segs) == 4 and method == "POST":
            return self._lfs_verify(segs[1], f"{segs[2]}/{segs[3]}")
        if segs == ["health"]:
            return self._send_json({"ok": True})
        if segs in (["faults"], ["requests"]):
            return self._admin(method, segs[0])
        raise HubError(404, f"Not Found: {method} {self.path}")

    # ------------------------------------------------------------------ account & repos
    def _whoami(self) -> None:
        if not self._authorized():
            raise HubError(401, "Authorization header is required")
        user = self.hub.user
        self._send_json(
            {
                "type": "user",
                "id": f"localhub-{user}",
                "name": user,
                "fullname": user,
                "email": None,
                "emailVerified": False,
                "isPro": False,
                "orgs": [],
                "auth": {"type": "access_token", "accessToken": {"displayName": "localhub", "role": "write"}},
            }
        )

    def _repo_url(self, repo_type: str, repo_id: str) -> str:
        return f"{self.hub.url}/{_URL_PREFIX[repo_type]}{repo_id}"

    def _create_repo(self) -> None:
        self._require_write()
        body = self._json_body()
        repo_type = body.get("type") or "model"
        if not isinstance(body.get("name"), str):
            raise HubError(400, "Missing repo 'name'")
        repo_id = f"{body.get('organization') or self.hub.user}/{body['name']}"
        private = bool(body.get("private")) or body.get("visibility") in ("private", "protected")
        extra = {"sdk": body.get("sdk")} if repo_type == "space" else {}
        url = self._repo_url(repo_type, repo_id) if repo_type in _URL_PREFIX else ""
        try:
            self.hub.store.create_repo(repo_type, repo_id, private=private, extra=extra)
        except HubError as err:
            if err.status == 409:  # the client reads "url" from the 409 body when exist_ok=True
                err.extra = {"url": url}
            raise
        self._send_json({"url": url, "name": repo_id, "id": hashlib.sha1(url.encode()).hexdigest()[:24]})

    def _delete_repo(self) -> None:
        self._require_write()
        body = self._json_body()
        repo_id = f"{body.get('organization') or self.hub.user}/{body.get('name')}"
        self.hub.store.delete_repo(body.get("type") or "model", repo_id)
        self._send_json({})

    def _validate_yaml(self) -> None:
        self._body()
        self._send_json({"errors": [], "warnings": []})  # no YAML parser in the stdlib: accept all

    # ------------------------------------------------------------------ reads
    def _file_json(self, path: str, entry: dict) -> dict:
        out = {"type": "file", "oid": entry["oid"], "size": entry["size"], "path": path}
        if entry["lfs"]:
            pointer_size = len(lfs_pointer(entry["sha256"], entry["size"]))
            out["lfs"] = {"oid": entry["sha256"], "size": entry["size"], "pointerSize": pointer_size}
        if entry.get("xetHash"):
            out["xetHash"] = entry["xetHash"]
        return out

    def _info(self, repo_type: str, repo_id: str, args: list[str]) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        commit_id = self.hub.store.resolve(repo, args[0] if args else "main")
        commit = repo["commits"][commit_id]
        blobs = _truthy(self._query.get("blobs"))
        siblings = []
        for path, entry in sorted(commit["files"].items()):
            sibling: dict[str, Any] = {"rfilename": path}
            if blobs:
                sibling.update(size=entry["size"], blobId=entry["oid"])
                if entry["lfs"]:
                    info = self._file_json(path, entry)["lfs"]
                    sibling["lfs"] = {
                        "size": info["size"],
                        "sha256": info["oid"],
                        "pointerSize": info["pointerSize"],
                    }
            siblings.append(sibling)
        self._send_json(
            {
                "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
                "id": repo_id,
                "author": repo_id.split("/")[0],
                "sha": commit_id,
                "lastModified": commit["date"],
                "createdAt": repo["createdAt"],
                "private": repo["private"],
                "gated": False,
                "disabled": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "siblings": siblings,
                "usedStorage": sum(e["size"] for e in commit["files"].values()),
                **({"sdk": repo.get("sdk")} if repo_type == "space" else {}),
            }
        )

    def _refs(self, repo_type: str, repo_id: str, args: list[str]) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        branches = sorted(repo["branches"].items(), key=lambda kv: (kv[0] != "main", kv[0]))
        self._send_json(
            {
                "branches": [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": c} for b, c in branches],
                "converts": [],
                "tags": [
                    {"name": t, "ref": f"refs/tags/{t}", "targetCommit": c}
                    for t, c in sorted(repo.get("tags", {}).items())
                ],
                "pullRequests": [
                    {"name": f"refs/pr/{n}", "ref": f"refs/pr/{n}", "targetCommit": c}
                    for n, c in sorted(repo.get("pulls", {}).items(), key=lambda kv: int(kv[0]))
                ],
            }
        )

    def _commits(self, repo_type: str, repo_id: str, args: list[str]) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        history = self.hub.store.history(repo, self.hub.store.resolve(repo, args[0]))
        self._send_json(
            [
                {
                    "id": cid,
                    "title": c["title"],
                    "message": c["message"],
                    "date": c["date"],
                    "authors": [{"user": c["author"], "avatar": None}],
                }
                for cid, c in history
            ]
        )

    def _tree(self, repo_type: str, repo_id: str, args: list[str]) -> None:
        if not args:
            raise HubError(404, "Missing revision in tree URL")
        repo = self._readable_repo(repo_type, repo_id)
        commit_id = self.hub.store.resolve(repo, args[0])
        files, folders = self.hub.store.files(repo, commit_id), self.hub.store.folders(repo, commit_id)
        path = "/".join(args[1:]).strip("/")
        if path and path not in folders:
            raise HubError(404, f"Entry not found: {path} is not a folder at {args[0]}", "EntryNotFound")
        prefix, recursive = (path + "/" if path else ""), _truthy(self._query.get("recursive"))

        def listed(p: str) -> bool:
            return p.startswith(prefix) and (recursive or "/" not in p[len(prefix) :])

        out = [
            {"type": "directory", "oid": oid, "size": 0, "path": p}
            for p, oid in sorted(folders.items())
            if listed(p)
        ]
        out += [self._file_json(p, e) for p, e in sorted(files.items()) if listed(p)]
        self._send_json(out)

    def _paths_info(self, repo_type: str, repo_id: str, args: list[str]) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        commit_id = self.hub.store.resolve(repo, args[0])
        raw = self._body()
        if self.headers.get("Content-Type", "").startswith("application/json"):
            paths = json.loads(raw or b"{}").get("paths", [])
        else:  # the client posts a form: paths=a&paths=b&expand=false
            paths = parse_qs(raw.decode()).get("paths", [])
        files, folders = self.hub.store.files(repo, commit_id), self.hub.store.folders(repo, commit_id)
        out = []
        for path in (p.strip("/") for p in paths):
            if path in files:
                out.append(self._file_json(path, files[path]))
            elif path in folders:
                out.append({"type": "directory", "oid": folders[path], "size": 0, "path": path})
        self._send_json(out)

    def _resolve(self, repo_type: str, repo_id: str, revision: str, path: str) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        commit_id = self.hub.store.resolve(repo, revision)
        entry = self.hub.store.files(repo, commit_id).get(path)
        if entry is None:  # X-Repo-Commit lets the client cache the non-existence
            raise HubError(
                404, f"Entry not found: {path}", "EntryNotFound", headers={"X-Repo-Commit": commit_id}
            )
        size = entry["size"]
        etag = entry["sha256"] if entry["lfs"] else entry["oid"]
        headers = {"X-Repo-Commit": commit_id, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if entry["lfs"]:
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(size)})
        if entry.get("xetHash"):
            return xet_http.resolve(self, repo_type, repo_id, commit_id, entry, headers)
        stored = self.hub.store.object_path(entry["sha256"])
        if not stored.is_file() or stored.stat().st_size != size:
            # Say so rather than promise `size` bytes and send fewer: the client would wait
            # for the rest until its timeout.
            raise HubError(500, f"stored object for {path} is missing or damaged on this server")
        start, end = self._byte_range(size)
        status = 200
        if (start, end) != (0, size - 1) and size > 0:
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(max(0, end - start + 1)))
        self.end_headers()
        if self._method == "GET" and end >= start:
            with self.hub.store.open_object(entry["sha256"]) as f:
                f.seek(start)
                self._copy(f, end - start + 1)

    def _byte_range(self, size: int) -> tuple[int, int]:
        header = self.headers.get("Range")
        match = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header or "")
        if header is None or not match or match.groups() == ("", ""):
            return 0, size - 1
        first, last = match.groups()
        if first == "":  # suffix range: the last N bytes
            start, end = max(0, size - int(last)), size - 1
        else:
            start, end = int(first), min(size - 1, int(last)) if last else size - 1
        if start >= size or start > end:
            raise HubError(
                416, f"Range not satisfiable: {header}", headers={"Content-Range": f"bytes */{size}"}
            )
        return start, end

    def _copy(self, f, remaining: int) -> None:
        try:
            while remaining > 0:
                chunk = f.read(min(remaining, 1 << 20))
                if not chunk:
                    self.close_connection = True  # the object shrank mid-send: end the response
                    break
                self.wfile.write(chunk)
                remaining -= len(chunk)
        except OSError:
            raise _ClientGone() from None

    # ------------------------------------------------------------------ commits
    def _preupload(self, repo_type: str, repo_id: str, args: list[str]) -> None:
        repo = self._writable_repo(repo_type, repo_id)
        commit_id = self.hub.store.resolve(repo, args[0])
        files = self.hub.store.files(repo, commit_id)
        out = []
        for item in self._json_body().get("files", []):
            path = validate_path(item.get("path"))
            try:
                sample, size = base64.b64decode(item.get("sample") or ""), int(item.get("size") or 0)
            except (TypeError, ValueError):
                raise HubError(
                    400, f"Invalid preupload entry for {path}: 'sample' must be base64, 'size' an int"
                )
            mode = self.hub.store.upload_mode(repo, commit_id, path, size, sample)
            existing = files.get(path)
            # The client skips unchanged files: LFS files compare sha256, regular ones the git blob id.
            oid = None if existing is None else existing["sha256"] if existing["lfs"] else existing["oid"]
            out.append({"path": path, "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        self._send_json({"files": out, "commitOid": commit_id})

    def _commit(self, repo_type: str, repo_id: str, args: list[str]) -> None:
        self._writable_repo(repo_type, repo_id)
        raw = self._body()
        status = self.hub.faults.take_commit_failure()
        if status is not None:
            raise HubError(
                status, "Injected failure (localhub): the commit was rejected and nothing was written"
            )
        try:
            lines = [json.loads(line) for line in raw.splitlines() if line.strip()]
        except ValueError:
            raise HubError(400, "Commit payload must be NDJSON (one JSON object per line)") from None
        if not lines or not isinstance(lines[0], dict) or lines[0].get("key") != "header":
            raise HubError(400, "Commit payload must start with a {'key': 'header'} line")
        withheld = self.hub.faults.take_withheld_answer()
        if withheld is False:
            self._withhold_answer()
        commit_id, number = self.hub.store.commit(
            repo_type,
            repo_id,
            args[0],
            lines[0].get("value") or {},
            lines[1:],
            author=self.hub.user,
            create_pr=_truthy(self._query.get("create_pr")),
        )
        lfs_paths = [(op.get("value") or {}).get("path") for op in lines[1:] if op.get("key") == "lfsFile"]
        if lfs_paths and self.hub.faults.take_other_lfs_bytes():
            self.hub.store.store_other_bytes(repo_type, repo_id, commit_id, lfs_paths[0])
        if lfs_paths and self.hub.faults.take_other_xet_hash():
            self.hub.store.list_other_xet_hash(repo_type, repo_id, commit_id, lfs_paths)
        if lfs_paths and self.hub.faults.take_other_xet_file():
            self.hub.store.store_other_xet_file(repo_type, repo_id, commit_id, lfs_paths)
        if withheld:
            self._withhold_answer()
        pr_url = None if number is None else f"{self._repo_url(repo_type, repo_id)}/discussions/{number}"
        self._send_json(
            {
                "success": True,
                "commitOid": commit_id,
                "hookOutput": "",
                "pullRequestUrl": pr_url,
                "commitUrl": f"{self._repo_url(repo_type, repo_id)}/commit/{commit_id}",
            }
        )

    def _withhold_answer(self) -> None:
        """Fault: hold the request without answering (until the faults are cleared), then hang up."""
        self.hub.faults.hold(_WITHHELD_ANSWER_S)
        raise _ClientGone()

    def _branch(self, repo_type: str, repo_id: str, args: list[str]) -> None:
        self._writable_repo(repo_type, repo_id)
        branch = "/".join(args)
        if self._method == "DELETE":
            self.hub.store.delete_branch(repo_type, repo_id, branch)
        else:
            self.hub.store.create_branch(repo_type, repo_id, branch, self._json_body().get("startingPoint"))
        self._send_json({})

    def _tag(self, repo_type: str, repo_id: str, args: list[str]) -> None:
        self._writable_repo(repo_type, repo_id)
        tag = self._json_body().get("tag")
        self.hub.store.create_tag(repo_type, repo_id, str(tag or ""), "/".join(args))
        self._send_json({})

    def _drop_connection(self, after_bytes: int | None) -> None:
        """Injected fault: read part of the upload, then hang up without answering (nothing stored)."""
        length = int(self.headers.get("Content-Length") or 2)
        self._body_read = True
        self.rfile.read(max(0, min(length - 1, length // 2 if after_bytes is None else after_bytes)))
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        raise _ClientGone()

    # ------------------------------------------------------------------ admin
    def _admin(self, method: str, what: str) -> None:
        if not self.hub.token:
            raise HubError(403, "Admin endpoints are disabled: localhub was started without a token")
        if not self._authorized():
            raise HubError(401, "Admin endpoints need 'Authorization: Bearer <token>'")
        faults = self.hub.faults
        if what == "faults" and method == "POST":
            try:
                faults.configure(self._json_body())
            except (TypeError, ValueError, re.error) as exc:
                raise HubError(400, f"Invalid fault spec: {exc}") from None
        elif what == "faults" and method == "DELETE":
            faults.clear()
        elif what == "requests" and method == "DELETE":
            faults.reset_counts()
        elif method != "GET":
            raise HubError(405, f"Method not allowed: {method} /_localhub/{what}")
        if what == "faults":
            return self._send_json(faults.pending())
        counts = faults.counts()
        self._send_json({"counts": counts, "total": sum(counts.values()), "bytes_sent": faults.bytes_sent()})
