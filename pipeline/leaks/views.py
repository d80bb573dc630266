"""Text as its reader sees it: what the leak scan searches besides the bytes themselves.

A JSON parser turns ``\\u0068f_…`` into ``hf_…``, a browser turns ``hf%5F…`` and
``&#104;f_…`` into it, and a zero-width space inside a token is invisible on the page but
breaks a byte pattern. :func:`reader_view` undoes these; :func:`encoded_runs` decodes the
long base64 and hex runs of a text, whose contents are one call away for any reader.

Only local transformations, so a chunk of a file can be viewed on its own (the scan
streams files). What no view undoes (see docs/publishing.md): encryption, compression,
encodings other than these, a value built by code at run time, numbers in tensors.
"""

from __future__ import annotations

import binascii
import re

from .encodings import SEPARATOR, marked_runs

__all__ = ["encoded_runs", "reader_view"]

_URL = re.compile(rb"%([0-9A-Fa-f]{2})")
# JSON and Python string escapes (one pass, so an escaped backslash stays one backslash) and
# the numeric character references of HTML (a model card is rendered as HTML).
_ESCAPE = re.compile(
    rb"\\(?:u([0-9A-Fa-f]{4})|x([0-9A-Fa-f]{2})|([\\/\"'nrt]))|&#(?:[xX]([0-9A-Fa-f]{1,6})|([0-9]{1,7}));"
)
_SIMPLE = {b"n": b"\n", b"r": b"\r", b"t": b"\t"}
# Characters that render as nothing: soft hyphen, zero-width and joiner characters,
# direction marks and isolates, word joiners, invisible operators, the byte order mark.
_INVISIBLE = re.compile(
    "|".join(
        re.escape(chr(code))
        for code in (0x00AD, 0x034F, 0x061C, 0x180E, *range(0x200B, 0x2010), *range(0x202A, 0x202F))
        + (*range(0x2060, 0x2065), *range(0x2066, 0x206A), 0xFEFF)
    ).encode("utf-8")
)
_MARKERS = re.compile(rb"%[0-9A-Fa-f]{2}|\\[ux\\/\"'nrt]|&#|" + _INVISIBLE.pattern)
# Runs long enough to hold the shortest credential (12 bytes: 16 base64 or 24 hex characters); a
# value of this machine is searched as its own encodings (encodings.literal_forms), whatever its length.
_BASE64_RUN = 16
_HEX_RUN = 24
_BASE64_MARKS = bytes(
    ord("a") if chr(c).isascii() and (chr(c).isalnum() or chr(c) in "+/_-") else ord(".") for c in range(256)
)
_HEX_MARKS = bytes(ord("a") if chr(c) in "0123456789abcdefABCDEF" else ord(".") for c in range(256))
_RUN_EXTENT = re.compile(b"a*")
_URL_SAFE = bytes.maketrans(b"-_", b"+/")
# Between the runs of an encoding: a whole base64 group (3 NUL bytes, 2 at least whatever the
# alignment), a whole hex byte (NUL), so each run keeps its place in a group.
_BASE64_GAP = b"AAAA"
_HEX_GAP = b"00"


def _character(code: int) -> bytes:
    try:
        return chr(code).encode("utf-8", "surrogatepass")
    except (ValueError, OverflowError):
        return b""


def _unescape(match: re.Match[bytes]) -> bytes:
    unicode, byte, simple, hex_entity, decimal_entity = match.groups()
    if unicode is not None:
        return _character(int(unicode, 16))
    if byte is not None:
        return bytes([int(byte, 16)])
    if simple is not None:
        return _SIMPLE.get(simple, simple)
    return _character(int(hex_entity, 16) if hex_entity is not None else int(decimal_entity))


def reader_view(data: bytes) -> tuple[bytes, tuple[str, ...]]:
    """``data`` with URL-encoding, string escapes and character references decoded and
    invisible characters removed (in that order, so ``%E2%80%8B`` and ``\\u200b`` are removed
    too), and the words for what changed; ``(data, ())`` when nothing did."""
    if _MARKERS.search(data) is None:
        return data, ()
    changed = []
    for words, step in (
        ("URL-encoded", lambda text: _URL.sub(lambda m: bytes([int(m.group(1), 16)]), text)),
        ("escaped", lambda text: _ESCAPE.sub(_unescape, text)),
        ("split by invisible characters", lambda text: _INVISIBLE.sub(b"", text)),
    ):
        after = step(data)
        if after != data:
            changed.append(words)
            data = after
    return data, tuple(changed)


def _runs(data: bytes, marks: bytes, minimum: int) -> list[bytes]:
    """The distinct runs of ``minimum`` characters or more marked ``a`` (code and JSON repeat
    the same identifiers and keys many times)."""
    found = marked_runs(data.translate(marks), b"a" * minimum, _RUN_EXTENT)
    return list(dict.fromkeys(data[first:last] for first, last in found))


def encoded_runs(data: bytes) -> tuple[bytes, bytes]:
    """(base64, hex): every long run of ``data`` decoded at each of its alignments (4 for
    base64, standard or URL-safe, padded or not; 2 for hex), so an encoding glued to other
    characters of its alphabet (``blob_aGZf…``, ``a6866…``) or cut by a read's seam decodes
    right at one of them. The bytes decoded next to a credential are noise from the glued
    characters: they are searched with patterns without word boundaries (``LeakKind.decoded``)."""
    # Each run completed to whole groups (its last bytes come out; a lone last character makes
    # one byte of noise) and all joined by whole groups: one decoding per alignment, the runs
    # moved to it together by the characters put in front.
    base64 = _runs(data, _BASE64_MARKS, _BASE64_RUN)
    joined = _BASE64_GAP.join(run + b"A" * (-len(run) % 4) for run in base64).translate(_URL_SAFE)
    decoded = [binascii.a2b_base64(b"A" * lead + joined + b"A" * (-lead % 4)) for lead in range(4)]
    hexes = _runs(data, _HEX_MARKS, _HEX_RUN)
    joined = _HEX_GAP.join(run + b"0" * (len(run) % 2) for run in hexes)
    decoded_hex = [binascii.a2b_hex(b"0" * lead + joined + b"0" * lead) for lead in range(2)]
    return (
        SEPARATOR.join(decoded) if base64 else b"",
        SEPARATOR.join(decoded_hex) if hexes else b"",
    )
