"""Text as its reader sees it: what the leak scan searches besides the bytes themselves.

A JSON parser turns ``\\u0068f_…`` into ``hf_…``, a browser turns ``hf%5F…``, ``&#104f_…``
and ``hf&lowbar;…`` into it, and a zero-width space or a variation selector inside a token is
invisible on the page but breaks a byte pattern. :func:`reader_view` undoes these;
:func:`encoded_runs` decodes the long base64 and hex runs of a text, whose contents are one
call away for any reader.

Only local transformations, so a chunk of a file can be viewed on its own (the scan
streams files). What no view undoes (see docs/publishing.md): encryption, compression,
encodings other than these, a value built by code at run time, numbers in tensors.
"""

from __future__ import annotations

import binascii
import re
from html.entities import html5

from .encodings import SEPARATOR, marked_runs

__all__ = ["DEFAULT_IGNORABLE", "encoded_runs", "reader_view", "utf8_ranges"]

_URL = re.compile(rb"%([0-9A-Fa-f]{2})")
# The string escapes of JSON, Python, C and JavaScript (one pass, so an escaped backslash stays
# one backslash): \uXXXX, \UXXXXXXXX, \u{X...}, \xXX, octal \NNN, \\ \/ \" \' \n \r \t; and the
# character references of HTML (a model card is rendered as HTML): numeric, decimal or hex, with
# or without their ";" (browsers read both), and named ones (&lowbar;), with their ";".
_ESCAPE = re.compile(
    rb"\\(?:u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8})|u\{([0-9A-Fa-f]{1,6})\}|x([0-9A-Fa-f]{2})|([0-7]{1,3})"
    rb"|([\\/\"'nrt]))"
    rb"|&#(?:[xX]([0-9A-Fa-f]{1,16})|([0-9]{1,16}));?"
    rb"|&([A-Za-z][A-Za-z0-9]{1,31};)"
)
_SIMPLE = {b"n": b"\n", b"r": b"\r", b"t": b"\t"}
# Characters that render as nothing, removed: Unicode's Default_Ignorable_Code_Point property
# (DerivedCoreProperties.txt; a test checks this table against the `regex` package's): the soft
# hyphen, zero-width and joiner characters, direction marks and isolates, invisible operators,
# variation selectors (VS16 follows emoji everywhere), the Hangul fillers, the tag characters
# ("ASCII smuggling"), the byte order mark, and the unassigned code points kept for more.
DEFAULT_IGNORABLE = (
    (0x00AD, 0x00AD),
    (0x034F, 0x034F),
    (0x061C, 0x061C),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x206F),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
)


def utf8_ranges(first: int, last: int) -> list[tuple[tuple[int, int], ...]]:
    """The UTF-8 encodings of the code points ``first`` to ``last`` (no surrogate in between) as
    sequences of byte ranges, one range per byte: split where the encoded length changes, then
    where a continuation byte would not span its whole range. A regular expression over bytes
    matches them without decoding the text (which may not be UTF-8)."""
    for edge in (0x7F, 0x7FF, 0xFFFF):
        if first <= edge < last:
            return utf8_ranges(first, edge) + utf8_ranges(edge + 1, last)
    low, high = chr(first).encode(), chr(last).encode()
    for tail in range(1, len(low)):
        mask = (1 << 6 * tail) - 1
        if first & ~mask != last & ~mask:
            if first & mask:
                return utf8_ranges(first, first | mask) + utf8_ranges((first | mask) + 1, last)
            if last & mask != mask:
                return utf8_ranges(first, (last & ~mask) - 1) + utf8_ranges(last & ~mask, last)
    return [tuple(zip(low, high))]


def _alternatives(sequences: list[tuple[tuple[int, int], ...]]) -> bytes:
    """One pattern for ``sequences`` of byte ranges, those sharing a first range under it
    (``\\xe2(?:\\x80[…]|\\x81[…])``): a lead byte is tried once, not once per sequence."""
    groups: dict[tuple[int, int], list[tuple[tuple[int, int], ...]]] = {}
    for sequence in sequences:
        groups.setdefault(sequence[0], []).append(sequence[1:])
    pieces = []
    for (low, high), tails in groups.items():
        one = re.escape(bytes([low]))
        head = one if low == high else b"[" + one + b"-" + re.escape(bytes([high])) + b"]"
        tails = [tail for tail in tails if tail]
        pieces.append(head + (b"(?:" + _alternatives(tails) + b")" if tails else b""))
    return b"|".join(pieces)


_INVISIBLE = re.compile(
    _alternatives([sequence for first, last in DEFAULT_IGNORABLE for sequence in utf8_ranges(first, last)])
)
_MARKERS = re.compile(
    rb"%[0-9A-Fa-f]{2}|\\[uUx0-7\\/\"'nrt]|&(?:#|[A-Za-z][A-Za-z0-9]{1,31};)|" + _INVISIBLE.pattern
)
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
    unicode, long, braced, byte, octal, simple, hex_entity, decimal_entity, named = match.groups()
    for digits in (unicode, long, braced, hex_entity):
        if digits is not None:
            return _character(int(digits, 16))
    if byte is not None:
        return bytes([int(byte, 16)])
    if octal is not None:  # a byte, as \x writes it (C, bytes literals); above \377 a character
        value = int(octal, 8)
        return bytes([value]) if value < 0x100 else _character(value)
    if simple is not None:
        return _SIMPLE.get(simple, simple)
    if decimal_entity is not None:
        return _character(int(decimal_entity))
    name = named.decode("ascii")
    return html5[name].encode("utf-8") if name in html5 else match.group(0)


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
