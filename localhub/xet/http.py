"""HTTP side of localhub's Xet support: the Hub's token endpoints, the CAS API and Xet resolves.

    GET  /api/{t}/{id}/xet-write-token/{rev}    GET /api/{t}/{id}/xet-read-token/{rev}
    POST /_xet/{cas}/v1/xorbs/default/{hash}    POST /_xet/{cas}/v1/shards
    GET  /_xet/{cas}/v{1,2}/reconstructions/{file hash}   (Range: bytes=a-b for part of a file)
    GET  /_xet/{cas}/v1/chunks/default/{chunk hash}   (global dedup query)
    GET  /_xet/data/{xorb hash}?exp=..&sig=..   (signed, like a presigned URL; Range: bytes=a-b)

`{cas}` is the random id of the CAS under this root (see cas.py). The CAS answers like the real
service: 401 for a missing or expired token (the client refreshes a token through the Hub
before its `exp`; a token revoked earlier fails the upload), 400 for a xorb or shard that does
not verify, 404 for unknown hashes (and for the /v2 shard and upload-grant APIs, so the client
falls back to the /v1 ones).
The functions take the request handler (`localhub.handler.Handler`) as first argument.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import TYPE_CHECKING

from ..store import HubError
from .format import AVAILABLE, MAX_XORB_SIZE, FormatError, hash_from_hex

if TYPE_CHECKING:
    from ..handler import Handler

__all__ = ["resolve", "route", "token"]

_URL_TTL = 3600  # seconds a signed xorb download URL stays valid


def token(h: "Handler", scope: str, repo_type: str, repo_id: str, args: list[str]) -> None:
    """The Hub's xet-{read,write}-token endpoint: a short-lived CAS token, in headers and JSON."""
    _require_extra()
    if scope == "write":
        h._writable_repo(repo_type, repo_id)
    else:
        h._readable_repo(repo_type, repo_id)
    access, exp = h.hub.xet_tokens.issue(scope, f"{repo_type}/{repo_id}")
    cas = f"{h.hub.url}/_xet/{h.hub.store.xet.id}"
    h._send_json(
        {"accessToken": access, "exp": exp, "casUrl": cas},
        headers={"X-Xet-Cas-Url": cas, "X-Xet-Access-Token": access, "X-Xet-Token-Expiration": str(exp)},
    )


def _require_extra() -> None:
    if not AVAILABLE:
        raise HubError(
            501,
            "this local Hub speaks Xet only with the optional extra installed"
            " (pip install -e '.[localhub]': blake3, lz4); or set HF_HUB_DISABLE_XET=1 to use LFS",
        )


def route(h: "Handler", method: str, segs: list[str]) -> None:
    _require_extra()
    if segs[:1] == ["data"] and len(segs) == 2 and method in ("GET", "HEAD"):
        return _xorb_data(h, segs[1])
    if segs[:1] != [h.hub.store.xet.id]:
        raise HubError(404, f"Not Found: {method} {h.path}")
    api = "/".join(segs[1:4])
    if h.hub.faults.take_token_expiry():
        h.hub.xet_tokens.expire_all()
    if method == "POST" and api == "v1/xorbs/default" and len(segs) == 5:
        return _upload_xorb(h, segs[4])
    if method == "POST" and segs[1:] == ["v1", "shards"]:
        return _upload_shard(h)
    if method == "GET" and segs[2:3] == ["reconstructions"] and segs[1] in ("v1", "v2") and len(segs) == 4:
        return _reconstruction(h, segs[1], segs[3])
    if method == "GET" and segs[1:3] == ["v1", "chunks"] and len(segs) == 5:
        h.hub.xet_tokens.check(h.headers.get("Authorization"), "read")
        shard = h.hub.store.xet.dedup(segs[4])
        if shard is None:
            raise HubError(404, "No xorb of this CAS holds that chunk")
        return h._send(200, shard, "application/octet-stream")
    raise HubError(404, f"Not Found: {method} {h.path}")


def _upload_xorb(h: "Handler", name: str) -> None:
    h.hub.xet_tokens.check(h.headers.get("Authorization"), "write")
    length = h.headers.get("Content-Length") or ""
    if not length.isdigit():
        raise HubError(411, "A xorb upload needs a Content-Length")
    if int(length) > MAX_XORB_SIZE + (1 << 20):
        raise HubError(413, f"Xorb of {length} bytes exceeds the {MAX_XORB_SIZE}-byte limit")
    dropped, after_bytes = h.hub.faults.take_xorb_drop()
    if dropped:
        h._drop_connection(after_bytes)
    data = h._body()
    if h.hub.faults.take_xorb_corruption() and data:
        data = (
            bytes([data[0] ^ 0x01]) + data[1:]
            if len(data) < 9
            else data[:8] + bytes([data[8] ^ 0x01]) + data[9:]
        )
    inserted = h.hub.store.xet.put_xorb(name, data)
    h._send_json({"was_inserted": inserted})


def _upload_shard(h: "Handler") -> None:
    h.hub.xet_tokens.check(h.headers.get("Authorization"), "write")
    data = h._body()
    status = h.hub.faults.take_shard_failure()
    if status is not None:
        raise HubError(status, "Injected failure (localhub): the shard was not recorded")
    h._send_json({"result": h.hub.store.xet.put_shard(data)})


def _reconstruction(h: "Handler", version: str, name: str) -> None:
    h.hub.xet_tokens.check(h.headers.get("Authorization"), "read")
    cas = h.hub.store.xet
    try:
        hash_from_hex(name)
    except FormatError:
        raise HubError(400, f"Invalid file hash: {name!r}") from None
    record = cas.file(name)
    if record is None:
        raise HubError(404, f"File {name} is not in this CAS")
    first, last = h._byte_range(record["size"])
    offset, terms = cas.reconstruction(name, first, last)
    exp = int(time.time()) + _URL_TTL
    out_terms, fetch = [], {}
    for xorb_name, start, end, size in terms:
        xorb = cas.xorb(xorb_name)
        chunks, span = (
            {"start": start, "end": end},
            {"start": xorb.chunk_start(start), "end": xorb.chunk_ends[end - 1] - 1},
        )
        out_terms.append({"hash": xorb_name, "unpacked_length": size, "range": chunks})
        url = f"{h.hub.url}/_xet/data/{xorb_name}?exp={exp}&sig={_sign(h, xorb_name, exp)}"
        if version == "v1":
            fetch.setdefault(xorb_name, []).append({"range": chunks, "url": url, "url_range": span})
        else:
            fetch.setdefault(xorb_name, []).append(
                {"url": url, "ranges": [{"chunks": chunks, "bytes": span}]}
            )
    key = "fetch_info" if version == "v1" else "xorbs"
    h._send_json({"offset_into_first_range": offset, "terms": out_terms, key: fetch})


def _sign(h: "Handler", name: str, exp: int) -> str:
    return hmac.new(h.hub.secret, f"xorb/{name}/{exp}".encode(), hashlib.sha256).hexdigest()


def _xorb_data(h: "Handler", name: str) -> None:
    exp = h._query.get("exp", [""])[-1]
    if not exp.isdigit() or not hmac.compare_digest(h._query.get("sig", [""])[-1], _sign(h, name, int(exp))):
        raise HubError(403, "Invalid signature: get xorb URLs from the CAS reconstruction API")
    if int(exp) < time.time():
        raise HubError(403, "Presigned URL expired")
    path = h.hub.store.xet.xorb_path(name)
    if not path.is_file():
        raise HubError(404, f"Xorb {name} is not stored")
    size = path.stat().st_size
    first, last = h._byte_range(size)
    with open(path, "rb") as f:
        f.seek(first)
        _send_bytes(h, [f.read(last - first + 1)], first, last, size, {})


def _send_bytes(h: "Handler", pieces, first: int, last: int, size: int, headers: dict) -> None:
    partial = (first, last) != (0, size - 1) and size > 0
    h.send_response(206 if partial else 200)
    for key, value in headers.items():
        h.send_header(key, value)
    if partial:
        h.send_header("Content-Range", f"bytes {first}-{last}/{size}")
    h.send_header("Accept-Ranges", "bytes")
    h.send_header("Content-Type", "application/octet-stream")
    h.send_header("Content-Length", str(max(0, last - first + 1)))
    h.end_headers()
    if h._method == "HEAD":
        return
    try:
        for piece in pieces:
            h.wfile.write(piece)
    except Exception:  # headers are out: all we can still do is end the response early
        h.close_connection = True


def resolve(h: "Handler", repo_type: str, repo_id: str, commit_id: str, entry: dict, headers: dict) -> None:
    """Serve a Xet-stored file: Xet headers for Xet clients, the rebuilt bytes for everyone else."""
    name = entry["xetHash"]
    record = h.hub.store.xet.file(name)
    if record is None or record["size"] != entry["size"]:
        raise HubError(500, f"Xet file {name} is missing or damaged on this server")
    headers = {
        **headers,
        "X-Xet-Hash": name,
        "Link": f'<{h.hub.url}/api/{repo_type}s/{repo_id}/xet-read-token/{commit_id}>; rel="xet-auth"',
    }
    size = entry["size"]
    first, last = h._byte_range(size)
    pieces = h.hub.store.xet.read(name, first, last) if h._method == "GET" and size else []
    _send_bytes(h, pieces, first, last, size, headers)
