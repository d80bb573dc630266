"""Persistent state of localhub: repos, branches, commits and content-addressed objects.

Layout under ``root`` (everything written atomically: temp file + fsync + rename)::

    objects/<sha256[:2]>/<sha256>      file contents (regular and LFS), content-addressed
    repos/<type>/<namespace>/<name>.json   one JSON document per repo (refs, commits, LFS oids)
    tmp/                               staging area on the same filesystem (for atomic renames)
    localhub.lock                      flock held by the one server using this root

Each commit stores a full snapshot of its tree (path -> entry), which keeps reads trivial and is
cheap enough for the small repos a test double sees. Ids are real git object ids (blob, tree and
commit sha1), so what clients see looks like what the Hub would report.
"""

from __future__ import annotations

import base64
import fcntl
import fnmatch
import hashlib
import json
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Iterable

__all__ = [
    "GITATTRIBUTES",
    "LFS_SIZE_THRESHOLD",
    "HubError",
    "Store",
    "git_blob_sha1",
    "lfs_pointer",
    "validate_path",
]

# Files at or above this size must go through LFS (the Hub rejects larger inline blobs).
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024

# Patterns of the .gitattributes the Hub writes in every repo's initial commit.
_DEFAULT_LFS_PATTERNS = (
    "*.7z *.arrow *.bin *.bz2 *.ckpt *.ftz *.gz *.h5 *.joblib *.lfs.* *.mlmodel *.model *.msgpack"
    " *.npy *.npz *.onnx *.ot *.parquet *.pb *.pickle *.pkl *.pt *.pth *.rar *.safetensors"
    " saved_model/**/* *.tar.* *.tar *.tflite *.tgz *.wasm *.xz *.zip *.zst *tfevents*"
).split()
GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in _DEFAULT_LFS_PATTERNS)

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
REPO_TYPES = ("model", "dataset", "space")


class HubError(Exception):
    """An error answered to the client: HTTP status, message and optional `X-Error-Code`."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        headers: dict | None = None,
        extra: dict | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}
        self.extra = extra or {}  # more fields for the JSON error body


def git_blob_sha1(data: bytes) -> str:
    """Git object id of a blob (same as `git hash-object`)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The git-lfs pointer file that stands in the git tree for an LFS file."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(ts))


def _fsync_dir(path: Path) -> None:
    # The rename is only durable once the directory entry itself is flushed.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes, tmp_dir: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=tmp_dir, prefix="w-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def validate_path(path: Any) -> str:
    """Reject paths a git tree cannot hold (or that would escape the repo)."""
    if not isinstance(path, str) or not path or path.startswith("/") or path.endswith("/"):
        raise HubError(400, f"Invalid path in repo: {path!r}")
    parts = path.split("/")
    if any(p in ("", ".", "..", ".git") for p in parts) or "\0" in path:
        raise HubError(400, f"Invalid path in repo: {path!r}")
    return path


def _git_tree_sha(files: dict[str, dict], folders: dict[str, str] | None = None) -> str:
    """Git tree id of a snapshot; fills `folders` with the tree id of every sub-folder."""
    nested: dict[str, Any] = {}
    for path, entry in files.items():
        node = nested
        *dirs, name = path.split("/")
        for d in dirs:
            node = node.setdefault(d, {})
        node[name] = ("file", entry)  # tuple marks a file: a folder may contain any file name

    def tree_of(node: dict, prefix: str) -> str:
        rows = []
        for name, child in node.items():
            is_dir = isinstance(child, dict)
            oid = tree_of(child, f"{prefix}{name}/") if is_dir else child[1]["oid"]
            # git sorts tree entries as if directory names ended with "/"
            rows.append((name + "/" if is_dir else name, b"40000" if is_dir else b"100644", name, oid))
        body = b"".join(
            mode + b" " + name.encode() + b"\0" + bytes.fromhex(oid) for _, mode, name, oid in sorted(rows)
        )
        sha = hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()
        if folders is not None and prefix:
            folders[prefix.rstrip("/")] = sha
        return sha

    return tree_of(nested, "")


def is_lfs_by_gitattributes(path: str, gitattributes: str) -> bool:
    for line in gitattributes.splitlines():
        parts = line.split()
        if len(parts) < 2 or parts[0].startswith("#") or "filter=lfs" not in parts[1:]:
            continue
        pattern = parts[0].lstrip("/")
        # Like git: a pattern without "/" matches the basename at any depth.
        target = path if "/" in pattern else path.rsplit("/", 1)[-1]
        if fnmatch.fnmatchcase(target, pattern):
            return True
    return False


class Store:
    """All repos of one localhub root. Thread-safe: every mutation holds `self.lock`."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        self.tmp = self.root / "tmp"
        for sub in ("objects", "repos", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # State lives in memory too, so two servers on one root would overwrite each other: refuse.
        self._lock_file = open(self.root / "localhub.lock", "w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise RuntimeError(f"another localhub is already serving {self.root}") from None
        for leftover in self.tmp.iterdir():  # temp files of writes interrupted by a crash
            leftover.unlink(missing_ok=True)
        self.lock = threading.RLock()
        from .xet.cas import Cas  # here, not at the top: the CAS module builds on this one

        self.xet = Cas(self.root / "xet", self.tmp)
        self._repos: dict[tuple[str, str], dict] = {}
        for path in sorted((self.root / "repos").glob("*/*/*.json")):
            repo = json.loads(path.read_text())
            self._repos[(repo["type"], repo["id"])] = repo

    def close(self) -> None:
        """Release the root (another server may then use it)."""
        self._lock_file.close()

    # ------------------------------------------------------------------ objects
    def object_path(self, sha256: str) -> Path:
        return self.root / "objects" / sha256[:2] / sha256

    def has_object(self, sha256: str) -> bool:
        return bool(_SHA256_RE.match(sha256)) and self.object_path(sha256).is_file()

    def put_bytes(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        if not self.has_object(sha):
            _atomic_write(self.object_path(sha), data, self.tmp)
        return sha

    def put_stream(self, chunks: Iterable[bytes], sha256: str, size: int) -> None:
        """Store an upload only if its bytes hash to `sha256` and have exactly `size` bytes."""
        hasher, total = hashlib.sha256(), 0
        fd, tmp = tempfile.mkstemp(dir=self.tmp, prefix="u-")
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    hasher.update(chunk)
                    total += len(chunk)
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            if total != size or hasher.hexdigest() != sha256:
                raise HubError(
                    400,
                    f"Uploaded content does not match its LFS oid/size: expected sha256={sha256} size={size},"
                    f" got sha256={hasher.hexdigest()} size={total}. Nothing was stored.",
                )
            target = self.object_path(sha256)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, target)
            _fsync_dir(target.parent)
        finally:
            Path(tmp).unlink(missing_ok=True)

    def open_object(self, sha256: str) -> BinaryIO:
        return open(self.object_path(sha256), "rb")

    # ------------------------------------------------------------------ repos
    def _save(self, repo: dict) -> None:
        ns, name = repo["id"].split("/")
        path = self.root / "repos" / repo["type"] / ns / f"{name}.json"
        _atomic_write(path, json.dumps(repo, sort_keys=True).encode(), self.tmp)
        self._repos[(repo["type"], repo["id"])] = repo

    def get_repo(self, repo_type: str, repo_id: str) -> dict:
        repo = self._repos.get((repo_type, repo_id))
        if repo is None:
            raise HubError(404, f"Repository Not Found: {repo_type} {repo_id}", "RepoNotFound")
        return repo

    def list_repos(self) -> list[dict]:
        with self.lock:
            return list(self._repos.values())

    def create_repo(self, repo_type: str, repo_id: str, *, private: bool, extra: dict | None = None) -> dict:
        ns, _, name = repo_id.partition("/")
        if repo_type not in REPO_TYPES or not _NAME_RE.match(ns) or not _NAME_RE.match(name):
            raise HubError(400, f"Invalid repo type or name: {repo_type} {repo_id!r}")
        with self.lock:
            if (repo_type, repo_id) in self._repos:
                raise HubError(409, f"You already created this {repo_type} repo: {repo_id}")
            now = time.time()
            repo = {
                "type": repo_type,
                "id": repo_id,
                "private": bool(private),
                "createdAt": _iso(now),
                "branches": {},
                "commits": {},
                "lfsObjects": [],
                **(extra or {}),
            }
            # Like the Hub: every repo starts with a system "initial commit" holding .gitattributes.
            files = {".gitattributes": self._regular_entry(GITATTRIBUTES.encode())}
            commit_id = self._make_commit(repo, None, files, "initial commit", "", "system", now)
            repo["branches"]["main"] = commit_id
            self._save(repo)
            return repo

    def delete_repo(self, repo_type: str, repo_id: str) -> None:
        with self.lock:
            repo = self.get_repo(repo_type, repo_id)
            ns, name = repo["id"].split("/")
            (self.root / "repos" / repo_type / ns / f"{name}.json").unlink()
            del self._repos[(repo_type, repo_id)]

    def add_lfs_object(self, repo_type: str, repo_id: str, sha256: str) -> None:
        with self.lock:
            repo = self.get_repo(repo_type, repo_id)
            if sha256 not in repo["lfsObjects"]:
                self._save({**repo, "lfsObjects": repo["lfsObjects"] + [sha256]})

    def has_lfs_object(self, repo: dict, sha256: str, size: int | None = None) -> bool:
        if sha256 not in repo["lfsObjects"] or not self.has_object(sha256):
            return False
        return size is None or self.object_path(sha256).stat().st_size == size

    # ------------------------------------------------------------------ revisions & reads
    def resolve(self, repo: dict, revision: str) -> str:
        """Branch, tag, ``refs/pr/N`` or full commit id -> commit id (404 RevisionNotFound otherwise)."""
        if revision.startswith("refs/heads/"):
            revision = revision[len("refs/heads/") :]
        if revision in repo["branches"]:
            return repo["branches"][revision]
        tags, pulls = repo.get("tags", {}), repo.get("pulls", {})
        if revision.removeprefix("refs/tags/") in tags:
            return tags[revision.removeprefix("refs/tags/")]
        if revision.startswith("refs/pr/") and revision[len("refs/pr/") :] in pulls:
            return pulls[revision[len("refs/pr/") :]]
        if _COMMIT_RE.match(revision) and revision in repo["commits"]:
            return revision
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def files(self, repo: dict, commit_id: str) -> dict[str, dict]:
        return repo["commits"][commit_id]["files"]

    def folders(self, repo: dict, commit_id: str) -> dict[str, str]:
        folders: dict[str, str] = {}
        _git_tree_sha(self.files(repo, commit_id), folders)
        return folders

    def history(self, repo: dict, commit_id: str) -> list[tuple[str, dict]]:
        out = []
        while commit_id is not None:
            commit = repo["commits"][commit_id]
            out.append((commit_id, commit))
            commit_id = commit["parent"]
        return out

    def read_text(self, entry: dict) -> str:
        with self.open_object(entry["sha256"]) as f:
            return f.read().decode("utf-8", errors="replace")

    def upload_mode(self, repo: dict, commit_id: str, path: str, size: int, sample: bytes) -> str:
        """Decide "lfs" vs "regular" like the Hub: size, .gitattributes rules, binary content."""
        if size >= LFS_SIZE_THRESHOLD or b"\0" in sample:
            return "lfs"
        attributes = self.files(repo, commit_id).get(".gitattributes")
        if attributes and is_lfs_by_gitattributes(path, self.read_text(attributes)):
            return "lfs"
        return "regular"

    # ------------------------------------------------------------------ writes
    def _regular_entry(self, data: bytes, pending: dict[str, bytes] | None = None) -> dict:
        """Entry for an inline file; its bytes go to `pending` (written once the commit is valid)."""
        sha = hashlib.sha256(data).hexdigest()
        if pending is None:
            self.put_bytes(data)
        else:
            pending[sha] = data
        return {"sha256": sha, "size": len(data), "lfs": False, "oid": git_blob_sha1(data)}

    def _make_commit(
        self, repo: dict, parent: str | None, files: dict, title: str, message: str, author: str, ts: float
    ) -> str:
        """Add a commit object to `repo` (in memory) and return its git commit id."""
        tree = _git_tree_sha(files)
        ident = f"{author} <{author}@localhub> {int(ts)} +0000"
        body = f"tree {tree}\n" + (f"parent {parent}\n" if parent else "")
        body += f"author {ident}\ncommitter {ident}\n\n{title}\n" + (f"\n{message}\n" if message else "")
        raw = body.encode()
        commit_id = hashlib.sha1(b"commit %d\0" % len(raw) + raw).hexdigest()
        repo["commits"][commit_id] = {
            "parent": parent,
            "title": title,
            "message": message,
            "author": author,
            "date": _iso(ts),
            "tree": tree,
            "files": files,
        }
        return commit_id

    def commit(
        self,
        repo_type: str,
        repo_id: str,
        branch: str,
        header: dict,
        operations: list[dict],
        author: str,
        create_pr: bool = False,
    ) -> tuple[str, int | None]:
        """Apply all `operations` as one commit on `branch`, or nothing at all. With `create_pr`
        the branch stays where it is and the commit opens pull request N (``refs/pr/N``).
        Returns the commit id and the pull request number (None without `create_pr`)."""
        if not isinstance(header, dict) or not all(isinstance(op, dict) for op in operations):
            raise HubError(400, "Each NDJSON line of a commit must be a JSON object")
        with self.lock:
            repo = self.get_repo(repo_type, repo_id)
            if branch not in repo["branches"]:
                raise HubError(
                    404, f"Invalid rev id: {branch} (commits must target a branch)", "RevisionNotFound"
                )
            head = repo["branches"][branch]
            parent = header.get("parentCommit")
            if parent and not head.startswith(str(parent).lower()):
                raise HubError(
                    412,
                    f"A commit has happened since the parent commit {parent}: the head of '{branch}' is now {head}."
                    " Refresh and try again.",
                )
            files, pending = dict(self.files(repo, head)), {}
            for op in operations:
                self._apply(repo, files, pending, op)
            self._check_no_file_dir_clash(files)
            # Only now that every operation is valid: store the new blobs (content-addressed, so harmless if
            # we crash right after), then publish by replacing the repo document in one atomic rename.
            for data in pending.values():
                self.put_bytes(data)
            new_repo = {**repo, "commits": dict(repo["commits"]), "branches": dict(repo["branches"])}
            commit_id = self._make_commit(
                new_repo,
                head,
                files,
                str(header.get("summary") or "").strip() or "Update",
                str(header.get("description") or ""),
                author,
                time.time(),
            )
            number = None
            if create_pr:
                pulls = dict(repo.get("pulls", {}))
                number = len(pulls) + 1
                new_repo["pulls"] = {**pulls, str(number): commit_id}
            else:
                new_repo["branches"][branch] = commit_id
            self._save(new_repo)
            return commit_id, number

    def store_other_bytes(self, repo_type: str, repo_id: str, commit_id: str, path: str) -> None:
        """Injected fault: the LFS file `path` of `commit_id` now holds other bytes of the same size
        (content-addressed under their own SHA-256, which the listing then reports)."""
        with self.lock:
            repo = self.get_repo(repo_type, repo_id)
            entry = repo["commits"][commit_id]["files"][path]
            data = bytearray(self.object_path(entry["sha256"]).read_bytes())
            data[-1] ^= 0x01
            sha = self.put_bytes(bytes(data))
            files = {
                **repo["commits"][commit_id]["files"],
                path: {**entry, "sha256": sha, "oid": git_blob_sha1(lfs_pointer(sha, len(data)))},
            }
            commits = {**repo["commits"], commit_id: {**repo["commits"][commit_id], "files": files}}
            self._save({**repo, "commits": commits, "lfsObjects": repo["lfsObjects"] + [sha]})

    def list_other_xet_hash(self, repo_type: str, repo_id: str, commit_id: str, paths: list[str]) -> None:
        """Injected fault: the first Xet-stored file among `paths` of `commit_id` is listed with
        another Xet hash (its last hex digit changed), as if the CAS held other chunks for it."""
        with self.lock:
            repo = self.get_repo(repo_type, repo_id)
            files = dict(repo["commits"][commit_id]["files"])
            path = next((p for p in paths if files.get(p, {}).get("xetHash")), None)
            if path is None:
                return
            name = files[path]["xetHash"]
            files[path] = {**files[path], "xetHash": name[:-1] + format(int(name[-1], 16) ^ 1, "x")}
            commits = {**repo["commits"], commit_id: {**repo["commits"][commit_id], "files": files}}
            self._save({**repo, "commits": commits})

    def store_other_xet_file(self, repo_type: str, repo_id: str, commit_id: str, paths: list[str]) -> None:
        """Injected fault: the first Xet-stored file among `paths` of `commit_id` now names the Xet
        file of the second (other bytes the CAS really holds), in the commit and in the CAS's index
        of declared SHA-256s: a Hub that mixed two files up, serving the other's bytes for it."""
        with self.lock:
            repo = self.get_repo(repo_type, repo_id)
            files = dict(repo["commits"][commit_id]["files"])
            stored = [p for p in paths if files.get(p, {}).get("xetHash")]
            if len(stored) < 2:
                return
            first, other = files[stored[0]], files[stored[1]]
            files[stored[0]] = {**first, "xetHash": other["xetHash"]}
            self.xet.index_sha256(first["sha256"], other["xetHash"])
            commits = {**repo["commits"], commit_id: {**repo["commits"][commit_id], "files": files}}
            self._save({**repo, "commits": commits})

    def _apply(self, repo: dict, files: dict, pending: dict, op: dict) -> None:
        key, value = op.get("key"), op.get("value") or {}
        raw_path = value.get("path")
        if key == "deletedFolder" and isinstance(raw_path, str):
            raw_path = raw_path.rstrip("/")  # the client sends folders as "a/"
        path = validate_path(raw_path)
        if key == "file":
            files[path] = self._inline_entry(path, value, pending)
        elif key == "lfsFile":
            files[path] = self._lfs_entry(repo, path, value)
        elif key == "deletedFile":
            if files.pop(path, None) is None:
                raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
        elif key == "deletedFolder":
            prefix = path + "/"
            doomed = [p for p in files if p.startswith(prefix)]
            if not doomed:
                raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
            for p in doomed:
                del files[p]
        else:
            raise HubError(400, f"Unknown commit operation key: {key!r}")

    def _inline_entry(self, path: str, value: dict, pending: dict) -> dict:
        if value.get("encoding", "base64") != "base64":
            raise HubError(400, f"Unsupported encoding for {path}: {value.get('encoding')!r}")
        try:
            data = base64.b64decode(value.get("content") or "", validate=True)
        except ValueError:
            raise HubError(400, f"Invalid base64 content for {path}") from None
        if len(data) >= LFS_SIZE_THRESHOLD:
            raise HubError(400, f"Your push was rejected because {path} is larger than 10 MiB: use LFS.")
        if b"\0" in data:  # the Hub refuses a regular file holding a NUL byte anywhere
            raise HubError(400, f"Your push was rejected because {path} is a binary file: use LFS.")
        return self._regular_entry(data, pending)

    def _lfs_entry(self, repo: dict, path: str, value: dict) -> dict:
        oid, size = str(value.get("oid", "")), value.get("size")
        if value.get("algo", "sha256") != "sha256" or not _SHA256_RE.match(oid):
            raise HubError(400, f"Invalid LFS pointer for {path}: oid must be a sha256 hex digest")
        if not self.has_lfs_object(repo, oid, size):
            xet_hash = self.xet.file_for_sha256(oid, size)  # uploaded through the Xet CAS instead
            if xet_hash is not None:
                pointer = git_blob_sha1(lfs_pointer(oid, size))
                return {"sha256": oid, "size": size, "lfs": True, "oid": pointer, "xetHash": xet_hash}
            raise HubError(
                422,
                f"Your push was rejected because an LFS pointer pointed to a file that does not exist: {path}"
                f" (sha256 {oid}, size {size}) was never uploaded to this repo. The whole commit was rejected.",
            )
        size = self.object_path(oid).stat().st_size
        return {"sha256": oid, "size": size, "lfs": True, "oid": git_blob_sha1(lfs_pointer(oid, size))}

    @staticmethod
    def _check_no_file_dir_clash(files: dict) -> None:
        dirs = set()
        for path in files:
            parts = path.split("/")[:-1]
            dirs.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        clash = sorted(dirs & files.keys())
        if clash:
            raise HubError(400, f"A path cannot be both a file and a folder: {clash[0]}")

    def create_branch(self, repo_type: str, repo_id: str, branch: str, starting_point: str | None) -> str:
        if not branch or branch.startswith(("refs/", "/")) or ".." in branch or branch.endswith("/"):
            raise HubError(400, f"Invalid branch name: {branch!r}")
        with self.lock:
            repo = self.get_repo(repo_type, repo_id)
            if branch in repo["branches"]:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            target = self.resolve(repo, starting_point or "main")
            self._save({**repo, "branches": {**repo["branches"], branch: target}})
            return target

    def create_tag(self, repo_type: str, repo_id: str, tag: str, revision: str) -> str:
        """Tag the commit `revision` resolves to; an existing tag is never moved (409)."""
        if not tag or tag.startswith(("refs/", "/")) or ".." in tag or tag.endswith("/") or " " in tag:
            raise HubError(400, f"Invalid tag name: {tag!r}")
        with self.lock:
            repo = self.get_repo(repo_type, repo_id)
            if tag in repo.get("tags", {}):
                raise HubError(409, f"Tag reference {tag} already exists")
            target = self.resolve(repo, revision)
            self._save({**repo, "tags": {**repo.get("tags", {}), tag: target}})
            return target

    def delete_branch(self, repo_type: str, repo_id: str, branch: str) -> None:
        with self.lock:
            repo = self.get_repo(repo_type, repo_id)
            if branch == "main" or branch not in repo["branches"]:
                raise HubError(
                    404 if branch != "main" else 403,
                    f"Cannot delete branch {branch!r}",
                    "RevisionNotFound" if branch != "main" else None,
                )
            self._save({**repo, "branches": {k: v for k, v in repo["branches"].items() if k != branch}})
