"""The git-lfs routes of localhub's HTTP front (a mixin of :class:`~.handler.Handler`): the batch
API hands out signed upload URLs, the upload stores a blob only if its bytes hash to its oid,
and verify confirms what is stored. Upload URLs carry no Authorization header, like the Hub's
presigned S3 URLs, so each one is signed with the hub's secret instead.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from .store import HubError

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class LfsRoutes:
    """Uses the handler's plumbing: ``_writable_repo``, ``_json_body``, ``_send_json``, ``_send``,
    ``_body_chunks``, ``_query``, ``_drop_connection`` and ``hub``."""

    def _upload_signature(self, repo_type: str, repo_id: str, oid: str, size: int) -> str:
        # Upload URLs carry no Authorization header (the client treats them like presigned S3 URLs).
        message = f"{repo_type}/{repo_id}/{oid}/{size}".encode()
        return hmac.new(self.hub.secret, message, hashlib.sha256).hexdigest()

    def _lfs_batch(self, repo_type: str, repo_id: str) -> None:
        repo = self._writable_repo(repo_type, repo_id)
        body = self._json_body()
        if body.get("operation") != "upload":
            raise HubError(422, "localhub's LFS batch endpoint only supports operation=upload")
        objects = []
        for obj in body.get("objects", []):
            oid, size = str(obj.get("oid", "")), obj.get("size")
            if not _SHA256_RE.match(oid) or not isinstance(size, int) or size < 0:
                error = {"code": 422, "message": "Invalid oid (sha256 hex) or size"}
                objects.append({"oid": oid, "size": size if isinstance(size, int) else 0, "error": error})
            elif self.hub.store.has_lfs_object(repo, oid, size):
                objects.append(
                    {"oid": oid, "size": size, "authenticated": True}
                )  # no actions: already stored
            else:
                base = f"{self.hub.url}/_localhub"
                sig = self._upload_signature(repo_type, repo_id, oid, size)
                objects.append(
                    {
                        "oid": oid,
                        "size": size,
                        "authenticated": True,
                        "actions": {
                            "upload": {
                                "href": f"{base}/lfs/{repo_type}/{repo_id}/{oid}?size={size}&sig={sig}"
                            },
                            "verify": {"href": f"{base}/lfs-verify/{repo_type}/{repo_id}"},
                        },
                    }
                )
        self._send_json(
            {"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
            content_type="application/vnd.git-lfs+json",
        )

    def _lfs_upload(self, repo_type: str, repo_id: str, oid: str) -> None:
        if not _SHA256_RE.match(oid):
            raise HubError(400, f"Invalid LFS oid: {oid!r}")
        size_values = self._query.get("size", [""])
        size = int(size_values[-1]) if size_values[-1].isdigit() else -1
        expected = self._upload_signature(repo_type, repo_id, oid, size)
        if not hmac.compare_digest(self._query.get("sig", [""])[-1], expected):
            raise HubError(403, "Invalid upload signature: get upload URLs from the LFS batch endpoint")
        self.hub.store.get_repo(repo_type, repo_id)
        dropped, after_bytes = self.hub.faults.take_drop()
        if dropped:
            self._drop_connection(after_bytes)
        self.hub.store.put_stream(self._body_chunks(), oid, size)
        self.hub.store.add_lfs_object(repo_type, repo_id, oid)
        self._send(200, b"", headers={"ETag": f'"{oid}"'})

    def _lfs_verify(self, repo_type: str, repo_id: str) -> None:
        repo = self._writable_repo(repo_type, repo_id)
        body = self._json_body()
        if not self.hub.store.has_lfs_object(repo, str(body.get("oid")), body.get("size")):
            raise HubError(404, f"LFS object {body.get('oid')} (size {body.get('size')}) is not stored")
        self._send_json({})
