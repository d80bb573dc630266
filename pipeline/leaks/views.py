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
# Runs long enough to hold the shortest credential (or a token value of this machine).
_BASE64_RUN = re.compile(rb"[A-Za-z0-9+/_-]{20,}")
_HEX_RUN = re.compile(rb"[0-9A-Fa-f]{32,}")
_URL_SAFE = bytes.maketrans(b"-_", b"+/")
# A run is decoded from each of its first characters (a credential's encoding may be glued to
# other text of the alphabet, "token_aGZf…"); a longer one, a blob such as an embedded image,
# from its start only: decoding it four times would cost more than the rest of the scan.
_SHIFTED_RUN = 1024
# Between decoded runs: no pattern may join the end of one with the start of the next.
_SEPARATOR = b"\n\0\n"


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


def encoded_runs(data: bytes) -> tuple[bytes, bytes]:
    """(base64, hex): every long run of ``data`` decoded (at each alignment, if not a blob),
    the decodings joined by a separator no pattern crosses. Standard and URL-safe base64,
    padded or not."""
    base64 = []
    # Each distinct run once: code and JSON repeat the same identifiers and keys many times.
    for run in dict.fromkeys(_BASE64_RUN.findall(data)):
        run = run.translate(_URL_SAFE)
        for shift in range(4) if len(run) <= _SHIFTED_RUN else (0,):
            part = run[shift:]
            # The last group, padded back ("=" ends no run); a lone last character holds no byte.
            part = part[: len(part) - (len(part) % 4 == 1)]
            part += b"=" * (-len(part) % 4)
            base64.append(binascii.a2b_base64(part))
    hexes = []
    for run in dict.fromkeys(_HEX_RUN.findall(data)):
        for shift in range(2) if len(run) <= _SHIFTED_RUN else (0,):
            hexes.append(bytes.fromhex(run[shift : shift + (len(run) - shift) // 2 * 2].decode("ascii")))
    return _SEPARATOR.join(base64), _SEPARATOR.join(hexes)
