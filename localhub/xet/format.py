"""Xet object formats, server side: hashes, xorbs and shards, parsed and checked.

Written from the public Xet protocol specification (huggingface/xet-core, "Xet Protocol
Specification"): chunk hashes are keyed BLAKE3 of the chunk bytes; a xorb hash and a file hash
are the root of an aggregated Merkle tree over (chunk hash, chunk size) pairs (the file hash
then keyed once more with a zero key); a shard lists files (segments of xorb chunk ranges, one
verification hash per segment, optional SHA-256) and the xorbs it created.

Everything here is pure computation on bytes: it never trusts a length or count before checking
it against the bytes actually present, and raises `FormatError` with a one-line reason.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

try:
    import blake3
    import lz4.frame
except ImportError:  # the optional extra `localhub`: without it the local Hub speaks LFS only
    blake3 = lz4 = None

__all__ = [
    "AVAILABLE",
    "FormatError",
    "MAX_CHUNK_SIZE",
    "MAX_XORB_SIZE",
    "FileSegment",
    "ShardFile",
    "Shard",
    "Xorb",
    "chunk_hash",
    "decode_chunk",
    "dedup_shard",
    "file_hash",
    "hash_from_hex",
    "hash_hex",
    "merkle_root",
    "parse_shard",
    "parse_xorb",
    "verification_hash",
]

AVAILABLE = blake3 is not None and lz4 is not None
MAX_CHUNK_SIZE = 128 * 1024  # twice the 64 KiB target; the spec caps chunks here
MAX_XORB_SIZE = 64 * 1024 * 1024  # serialized; the CAS refuses larger xorbs

# Keys of the keyed BLAKE3 hashes, as published in the specification.
_DATA_KEY = bytes(
    [
        102,
        151,
        245,
        119,
        91,
        149,
        80,
        222,
        49,
        53,
        203,
        172,
        165,
        151,
        24,
        28,
        157,
        228,
        33,
        16,
        155,
        235,
        43,
        88,
        180,
        208,
        176,
        75,
        147,
        173,
        242,
        41,
    ]
)
_INTERNAL_NODE_KEY = bytes(
    [
        1,
        126,
        197,
        199,
        165,
        71,
        41,
        150,
        253,
        148,
        102,
        102,
        180,
        138,
        2,
        230,
        93,
        221,
        83,
        111,
        55,
        199,
        109,
        210,
        248,
        99,
        82,
        230,
        74,
        83,
        113,
        63,
    ]
)
_VERIFICATION_KEY = bytes(
    [
        127,
        24,
        87,
        214,
        206,
        86,
        237,
        102,
        18,
        127,
        249,
        19,
        231,
        165,
        195,
        243,
        164,
        205,
        38,
        213,
        181,
        219,
        73,
        230,
        65,
        36,
        152,
        127,
        40,
        251,
        148,
        195,
    ]
)
_ZERO_KEY = bytes(32)
_BRANCHING = 4  # mean fan-out of the aggregated tree: a node closes on a hash that is 0 mod 4

_XORB_IDENT, _HASHES_IDENT, _BOUNDARIES_IDENT = b"XETBLOB", b"XBLBHSH", b"XBLBBND"
_SHARD_TAG = b"HFRepoMetaData\x00" + bytes(
    [85, 105, 103, 69, 106, 123, 129, 87, 131, 165, 189, 217, 92, 205, 209, 74, 169]
)
_SHARD_VERSION = 2
_ENTRY = 48  # every shard record (file or xorb header and entry) is 48 bytes
_BOOKEND = b"\xff" * 32
_FLAG_VERIFICATION = 1 << 31
_FLAG_METADATA_EXT = 1 << 30
_COMPRESSION = {0: "none", 1: "lz4", 2: "bg4-lz4"}


class FormatError(ValueError):
    """Bytes that are not a well-formed, self-consistent Xet object."""


# ---------------------------------------------------------------------- hashes
def hash_hex(digest: bytes) -> str:
    """The protocol's hex form of a 32-byte hash: four little-endian u64 words, each printed as hex."""
    return "".join(digest[i : i + 8][::-1].hex() for i in range(0, 32, 8))


def hash_from_hex(text: str) -> bytes:
    """Inverse of `hash_hex`; FormatError unless `text` is 64 hex digits."""
    if not isinstance(text, str) or len(text) != 64:
        raise FormatError(f"not a Xet hash: {text!r}")
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise FormatError(f"not a Xet hash: {text!r}") from None
    return b"".join(raw[i : i + 8][::-1] for i in range(0, 32, 8))


def chunk_hash(data: bytes) -> bytes:
    return blake3.blake3(data, key=_DATA_KEY).digest()


def _merge(nodes: list[tuple[bytes, int]]) -> tuple[bytes, int]:
    text = "".join(f"{hash_hex(h)} : {size}\n" for h, size in nodes)
    return blake3.blake3(text.encode(), key=_INTERNAL_NODE_KEY).digest(), sum(size for _, size in nodes)


def _next_cut(nodes: list[tuple[bytes, int]], start: int) -> int:
    remaining = len(nodes) - start
    if remaining <= 2:
        return len(nodes)
    end = start + min(2 * _BRANCHING + 1, remaining)
    for i in range(start + 2, end):
        if int.from_bytes(nodes[i][0][24:32], "little") % _BRANCHING == 0:
            return i + 1
    return end


def merkle_root(chunks: list[tuple[bytes, int]]) -> bytes:
    """Root of the aggregated hash tree over (chunk hash, size) pairs: the xorb hash."""
    if not chunks:
        return _ZERO_KEY
    level = list(chunks)
    while len(level) > 1:
        merged, i = [], 0
        while i < len(level):
            cut = _next_cut(level, i)
            merged.append(_merge(level[i:cut]))
            i = cut
        level = merged
    return level[0][0]


def file_hash(chunks: list[tuple[bytes, int]]) -> bytes:
    if not chunks:
        return _ZERO_KEY
    return blake3.blake3(merkle_root(chunks), key=_ZERO_KEY).digest()


def verification_hash(chunk_hashes: list[bytes]) -> bytes:
    """Hash proving that a shard's author knew the chunks of a segment (not just the xorb's name)."""
    return blake3.blake3(b"".join(chunk_hashes), key=_VERIFICATION_KEY).digest()


# ---------------------------------------------------------------------- xorbs
def _decompress(scheme: int, payload: bytes, size: int) -> bytes:
    if scheme == 0:
        data = payload
    elif scheme in (1, 2):
        try:
            data = lz4.frame.decompress(payload)
        except RuntimeError as exc:
            raise FormatError(f"chunk does not decompress ({_COMPRESSION[scheme]}): {exc}") from None
        if scheme == 2 and len(data) == size:
            # Byte grouping: the bytes at positions 0 mod 4 come first, then 1 mod 4, and so on.
            out, pos = bytearray(size), 0
            for group in range(4):
                n = size // 4 + (1 if group < size % 4 else 0)
                out[group::4] = data[pos : pos + n]
                pos += n
            data = bytes(out)
    else:
        raise FormatError(f"unknown chunk compression scheme {scheme}")
    if len(data) != size:
        raise FormatError(f"chunk decompresses to {len(data)} bytes, its header says {size}")
    return data


@dataclass(frozen=True, slots=True)
class Xorb:
    """A checked xorb: per chunk its hash, its byte end in the serialized object and its size."""

    hash: bytes
    chunk_hashes: list[bytes]
    chunk_ends: list[int]  # offset just past chunk i (header included) in the serialized xorb
    chunk_sizes: list[int]  # uncompressed

    def chunk_start(self, index: int) -> int:
        return self.chunk_ends[index - 1] if index else 0


def decode_chunk(data: bytes, start: int, stop: int) -> bytes:
    """The bytes of the chunk serialized at data[start:stop] (header included)."""
    return _decompress(
        data[start + 4], data[start + 8 : stop], int.from_bytes(data[start + 5 : start + 8], "little")
    )


def _iter_chunks(data: bytes, end: int):
    """Yield (start, stop, scheme, uncompressed size) of each chunk in data[:end]."""
    pos = 0
    while pos < end:
        if end - pos < 8:
            raise FormatError(f"truncated chunk header at byte {pos}")
        version, scheme = data[pos], data[pos + 4]
        stored = int.from_bytes(data[pos + 1 : pos + 4], "little")
        size = int.from_bytes(data[pos + 5 : pos + 8], "little")
        if version != 0:
            raise FormatError(f"chunk header version {version} at byte {pos} (expected 0)")
        if size == 0 or size > MAX_CHUNK_SIZE or stored > 2 * MAX_CHUNK_SIZE:
            raise FormatError(f"chunk at byte {pos} has an impossible size ({stored} stored, {size} bytes)")
        stop = pos + 8 + stored
        if stop > end:
            raise FormatError(f"chunk at byte {pos} runs past the end of the xorb")
        yield pos, stop, scheme, size
        pos = stop


def _footer_bounds(data: bytes) -> int:
    """Length of the chunk section: the whole object, or up to the footer if it carries one."""
    if len(data) >= 4:
        info_length = int.from_bytes(data[-4:], "little")
        start = len(data) - 4 - info_length
        if info_length >= 8 and start >= 0 and data[start : start + 7] == _XORB_IDENT:
            return start
    return len(data)


def parse_xorb(data: bytes, expected_hash: bytes) -> Xorb:
    """Decode every chunk, hash it, and check the xorb hash (and the footer, when present)."""
    if len(data) > MAX_XORB_SIZE:
        raise FormatError(f"xorb of {len(data)} bytes exceeds the {MAX_XORB_SIZE}-byte limit")
    chunks_end = _footer_bounds(data)
    hashes, ends, sizes = [], [], []
    for start, stop, scheme, size in _iter_chunks(data, chunks_end):
        chunk = _decompress(scheme, data[start + 8 : stop], size)
        hashes.append(chunk_hash(chunk))
        ends.append(stop)
        sizes.append(size)
    if not hashes:
        raise FormatError("xorb holds no chunk")
    computed = merkle_root(list(zip(hashes, sizes)))
    if computed != expected_hash:
        raise FormatError(
            f"xorb hash mismatch: its chunks hash to {hash_hex(computed)},"
            f" it was sent as {hash_hex(expected_hash)}"
        )
    xorb = Xorb(computed, hashes, ends, sizes)
    if chunks_end < len(data):
        _check_xorb_footer(data[chunks_end:-4], xorb)
    return xorb


def _check_xorb_footer(footer: bytes, xorb: Xorb) -> None:
    n = len(xorb.chunk_hashes)
    if footer[7] != 1:
        raise FormatError(f"xorb footer version {footer[7]} is not supported (expected 1)")
    if len(footer) != 92 + 40 * n:
        raise FormatError(f"xorb footer is {len(footer)} bytes, expected {92 + 40 * n} for {n} chunks")
    if footer[8:40] != xorb.hash:
        raise FormatError("xorb footer names another xorb hash")
    pos = 40
    if footer[pos : pos + 7] != _HASHES_IDENT or int.from_bytes(footer[pos + 8 : pos + 12], "little") != n:
        raise FormatError("xorb footer hash section is malformed")
    pos += 12
    if [footer[pos + 32 * i : pos + 32 * i + 32] for i in range(n)] != xorb.chunk_hashes:
        raise FormatError("xorb footer chunk hashes differ from the chunks")
    pos += 32 * n
    if (
        footer[pos : pos + 7] != _BOUNDARIES_IDENT
        or int.from_bytes(footer[pos + 8 : pos + 12], "little") != n
    ):
        raise FormatError("xorb footer boundary section is malformed")
    pos += 12
    ends = list(struct.unpack_from(f"<{n}I", footer, pos))
    unpacked = list(struct.unpack_from(f"<{n}I", footer, pos + 4 * n))
    running, expected_unpacked = 0, []
    for size in xorb.chunk_sizes:
        running += size
        expected_unpacked.append(running)
    if ends != xorb.chunk_ends or unpacked != expected_unpacked:
        raise FormatError("xorb footer chunk boundaries differ from the chunks")
    if int.from_bytes(footer[pos + 8 * n : pos + 8 * n + 4], "little") != n:
        raise FormatError("xorb footer chunk count is inconsistent")


# ---------------------------------------------------------------------- shards
@dataclass(frozen=True, slots=True)
class FileSegment:
    xorb: bytes
    chunk_start: int
    chunk_end: int  # exclusive
    size: int  # uncompressed bytes of the chunk range
    verification: bytes | None


@dataclass(frozen=True, slots=True)
class ShardFile:
    hash: bytes
    segments: list[FileSegment]
    sha256: bytes | None  # as declared by the client (metadata extension)


@dataclass(frozen=True, slots=True)
class Shard:
    files: list[ShardFile]
    xorbs: dict[bytes, list[tuple[bytes, int]]]  # xorb hash -> [(chunk hash, size)] it declares


def parse_shard(data: bytes) -> Shard:
    """Parse the header, the file section and the xorb section (the footer, if any, is only sized)."""
    if len(data) < 48 or data[:32] != _SHARD_TAG:
        raise FormatError("not a shard (wrong magic tag)")
    version, footer_size = struct.unpack_from("<QQ", data, 32)
    if version != _SHARD_VERSION:
        raise FormatError(f"shard header version {version} is not supported (expected {_SHARD_VERSION})")
    return _parse_sections(data, footer_size)


def _entry_header(data: bytes, pos: int, section: str) -> tuple[bytes | None, int]:
    """The entry header at ``pos`` and the position after it; None at the section's end marker."""
    if pos + _ENTRY > len(data):
        raise FormatError(f"shard {section} section is truncated (no end marker)")
    header = data[pos : pos + _ENTRY]
    return (None if header[:32] == _BOOKEND else header), pos + _ENTRY


def _parse_sections(data: bytes, footer_size: int) -> Shard:
    pos, files = 48, []
    while True:
        header, pos = _entry_header(data, pos, "file")
        if header is None:
            break
        flags, count = struct.unpack_from("<II", header, 32)
        needed = count * (2 if flags & _FLAG_VERIFICATION else 1) + (1 if flags & _FLAG_METADATA_EXT else 0)
        if count == 0 or pos + needed * _ENTRY > len(data):
            raise FormatError(f"shard file entry {hash_hex(header[:32])} is empty or truncated")
        raw = [struct.unpack_from("<32sIIII", data, pos + i * _ENTRY) for i in range(count)]
        pos += count * _ENTRY
        checks: list[bytes | None] = [None] * count
        if flags & _FLAG_VERIFICATION:
            checks = [data[pos + i * _ENTRY : pos + i * _ENTRY + 32] for i in range(count)]
            pos += count * _ENTRY
        sha256 = None
        if flags & _FLAG_METADATA_EXT:
            sha256 = data[pos : pos + 32]
            pos += _ENTRY
        segments = []
        for (xorb, _flags, size, first, last), check in zip(raw, checks):
            if last <= first:
                raise FormatError(f"shard file {hash_hex(header[:32])} has an empty chunk range")
            segments.append(FileSegment(xorb, first, last, size, check))
        files.append(ShardFile(header[:32], segments, sha256))
    xorbs: dict[bytes, list[tuple[bytes, int]]] = {}
    while True:
        header, pos = _entry_header(data, pos, "xorb")
        if header is None:
            break
        _flags, count = struct.unpack_from("<II", header, 32)
        if pos + count * _ENTRY > len(data):
            raise FormatError(f"shard xorb entry {hash_hex(header[:32])} is truncated")
        chunks = []
        for i in range(count):
            digest, _start, size, _f, _u = struct.unpack_from("<32sIIII", data, pos + i * _ENTRY)
            chunks.append((digest, size))
        pos += count * _ENTRY
        xorbs[header[:32]] = chunks
    if footer_size and pos + footer_size > len(data):
        raise FormatError(f"shard footer is {len(data) - pos} bytes, its header says {footer_size}")
    if not footer_size and pos != len(data):
        raise FormatError(f"{len(data) - pos} unexpected bytes after the shard's xorb section")
    return Shard(files, xorbs)


# ---------------------------------------------------------------------- global dedup answers
_FOOTER_SIZE = 200


def _truncated(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "little")


def dedup_shard(xorbs: list[Xorb], now: int, valid_for: int) -> bytes:
    """A shard (with footer and lookup tables, as clients cache it) listing the chunks of `xorbs`:
    the answer to a global dedup query, so a client can reference those chunks instead of sending them."""
    out = bytearray(_SHARD_TAG + struct.pack("<QQ", _SHARD_VERSION, _FOOTER_SIZE))
    out += _BOOKEND + bytes(16)  # no file
    xorb_section = len(out)
    xorb_lookup, chunk_lookup, index = [], [], 0
    for xorb in xorbs:
        n = len(xorb.chunk_hashes)
        out += xorb.hash + struct.pack("<IIII", 0, n, sum(xorb.chunk_sizes), xorb.chunk_ends[-1])
        for i, (digest, size) in enumerate(zip(xorb.chunk_hashes, xorb.chunk_sizes)):
            out += digest + struct.pack("<IIII", xorb.chunk_start(i), size, 0, 0)
            chunk_lookup.append((_truncated(digest), index, i))
        xorb_lookup.append((_truncated(xorb.hash), index))
        index += 1 + n
    out += _BOOKEND + bytes(16)
    file_lookup_at = xorb_lookup_at = len(out)
    for key, at in sorted(xorb_lookup):
        out += struct.pack("<QI", key, at)
    chunk_lookup_at = len(out)
    for key, at, i in sorted(chunk_lookup):
        out += struct.pack("<QII", key, at, i)
    stored = sum(sum(x.chunk_sizes) for x in xorbs)
    on_disk = sum(x.chunk_ends[-1] for x in xorbs)
    footer_at = len(out)
    out += struct.pack(
        "<9Q",
        1,
        48,
        xorb_section,
        file_lookup_at,
        0,
        xorb_lookup_at,
        len(xorb_lookup),
        chunk_lookup_at,
        len(chunk_lookup),
    )
    out += bytes(32)  # no HMAC key: chunk hashes in clear
    out += struct.pack("<2Q", now, now + valid_for) + bytes(48)
    out += struct.pack("<4Q", on_disk, stored, stored, footer_at)
    return bytes(out)
