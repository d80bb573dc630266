"""How text lies in bytes that are not plain UTF-8 text, and how a literal secret is encoded.

- :func:`text_encoding`: a file's text encoding, from its first bytes: UTF-32 or UTF-16 by
  their byte order mark or, without one, by the NUL bytes ASCII leaves in every character;
  UTF-8 when nearly every byte is text, NUL bytes allowed (one NUL in a ``merges.txt`` does
  not make it binary) unless they are most of them; None for binary bytes.
- :func:`text_runs`: the printable ASCII of binary bytes, one character every 1, 2, 4 or 8
  bytes: plain strings, UTF-16 and UTF-32 text of either byte order, an integer tensor
  holding character codes (int8/uint8, int16, int32, int64). Found by one ``translate`` and a
  ``memmem`` per width (C loops at GB/s, no regular expression tried at every byte), so the
  scan keeps its speed on gigabytes of weights.
- :func:`literal_forms`: a literal secret as hex and base64 write it, wherever the encoding
  starts: the needles the scan searches text for, so a value of 8 bytes is found encoded
  (a decoded run would need 16 characters or more to be told from an identifier).

Torch-free and NumPy-free (the publish side runs it).
"""

from __future__ import annotations

import base64
import ctypes
import re
from typing import Any, Callable, Iterator

__all__ = [
    "MEMMEM",
    "MEMMEM_MIN",
    "SEPARATOR",
    "STRIDES",
    "literal_forms",
    "marked_runs",
    "text_encoding",
    "text_runs",
]

# Bytes from one character to the next: plain bytes, UTF-16, UTF-32, 64-bit integers.
STRIDES = (1, 2, 4, 8)
# The shortest run searched. Printable bytes are common in binary (38% of random bytes), so a plain
# run must be long to be rare in noise: 11 characters hold the shortest credential (12) and this
# machine's shortest value (8 bytes) base64-encoded without padding. A wide run is rare from its
# second character: 8 hold that value as it is.
_PLAIN_RUN = 11
_WIDE_RUN = 8
# Between runs: no pattern may join the end of one with the start of the next.
SEPARATOR = b"\n\0\n"

_PRINTABLE = frozenset(range(0x20, 0x7F)) | frozenset(b"\t\n\r")
# Each byte as a mark: "a" printable ASCII, "z" NUL, "." anything else.
_MARKS = bytes(ord("a") if c in _PRINTABLE else ord("z") if c == 0 else ord(".") for c in range(256))
_UNITS = {stride: b"a" + b"z" * (stride - 1) for stride in STRIDES}
_EXTENTS = {stride: re.compile(b"(?:" + unit + b")*") for stride, unit in _UNITS.items()}
# The shortest run, up to its last character.
_NEEDLES = {
    stride: (unit * (_PLAIN_RUN if stride == 1 else _WIDE_RUN)).rstrip(b"z")
    for stride, unit in _UNITS.items()
}
# Both memmem and find crawl through zeros (at a hundred MB/s) looking for a needle made mostly of
# NUL marks: a wide run's is searched between stretches of zeros, which are skipped at GB/s.
_ZEROS = b"z" * 64
_ZEROS_EXTENT = re.compile(b"z*")
_BIG_ENDIAN_LAST = re.compile(b"a")

# Byte order marks, longest first (UTF-32LE's starts with UTF-16LE's); the codecs named read them.
_BOMS = (
    (b"\xff\xfe\x00\x00", "utf-32"),
    (b"\x00\x00\xfe\xff", "utf-32"),
    (b"\xff\xfe", "utf-16"),
    (b"\xfe\xff", "utf-16"),
)
# Control characters that text does not hold (NUL aside: see text_encoding).
_CONTROLS = bytes(c for c in range(1, 32) if c not in b"\t\n\v\f\r\x1b") + b"\x7f"
_NOT_TEXT_PER_MILLE = 10  # of the probe's bytes, undecodable or control characters, at most


def text_encoding(probe: bytes) -> str | None:
    """The codec of the text a file starts with (``probe``, its first bytes): ``utf-8``;
    ``utf-16`` or ``utf-32`` (a byte order mark, which the codec reads); ``utf-16-le``,
    ``utf-16-be``, ``utf-32-le`` or ``utf-32-be`` (none); or None for binary."""
    for bom, encoding in _BOMS:
        if probe.startswith(bom):
            return encoding
    nuls = probe.count(0)
    if nuls and (wide := _wide_encoding(probe)) is not None:
        return wide
    # NUL bytes do not count against text (a stray one does not make text binary, and a reader
    # skips it) unless they are most of it: zeros are binary, searched fast as such.
    undecodable = probe.decode("utf-8", "replace").count("\ufffd")
    controls = len(probe) - len(probe.translate(None, _CONTROLS))
    text = (undecodable + controls) * 1000 <= len(probe) * _NOT_TEXT_PER_MILLE
    return "utf-8" if text and nuls * 2 <= len(probe) else None


def _wide_encoding(probe: bytes) -> str | None:
    """UTF-32 or UTF-16 without a byte order mark, told by where ASCII (and Latin) characters
    leave their NUL bytes: UTF-32LE ``h\\0\\0\\0``, UTF-16BE ``\\0h``..."""
    length = len(probe) // 4 * 4
    per_lane = length // 4
    if per_lane < 4:
        return None
    nuls = [probe[lane:length:4].count(0) for lane in range(4)]
    mostly = [count * 8 >= per_lane * 7 for count in nuls]  # 7 of 8 bytes of the lane
    rarely = [count * 16 <= per_lane for count in nuls]  # 1 of 16
    half = [count * 2 >= per_lane for count in nuls]
    if mostly[2] and mostly[3] and rarely[0]:
        return "utf-32-le"
    if mostly[0] and mostly[1] and rarely[3]:
        return "utf-32-be"
    if half[1] and half[3] and rarely[0] and rarely[2]:
        return "utf-16-le"
    if half[0] and half[2] and rarely[1] and rarely[3]:
        return "utf-16-be"
    return None


def _libc_memmem() -> Any:
    """The C library's ``memmem`` (glibc, musl, the BSDs and macOS have it), or None."""
    try:
        memmem = ctypes.CDLL(None).memmem  # the symbols the interpreter is linked with: its C library
    except (OSError, AttributeError, TypeError):  # TypeError: Windows takes no None
        return None
    memmem.restype = ctypes.c_void_p
    memmem.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t)
    return memmem


# A chunk of the weights is searched for each literal secret, and its marks for runs, by
# ``memmem``, through ctypes, which releases the GIL for the call: a third of bytes.find's time
# (a sixth for the runs' needles), and 06's audit hashes, reads and loads the Hub client on other
# threads meanwhile. Smaller buffers (seams, text, where runs are many) keep bytes.find.
MEMMEM = _libc_memmem()
MEMMEM_MIN = 1 << 20


def _finder(marks: bytes | bytearray) -> Callable[[bytes, int, int], int]:
    """``marks.find(needle, start, end)``, by ``memmem`` on a large bytearray (``find`` slows
    down on marks: most needles repeat one letter)."""
    if MEMMEM is None or not isinstance(marks, bytearray) or len(marks) < MEMMEM_MIN:
        return marks.find
    window = (ctypes.c_char * len(marks)).from_buffer(marks)
    base = ctypes.addressof(window)

    def find(needle: bytes, start: int, end: int) -> int:
        at = MEMMEM(base + start, max(0, end - start), needle, len(needle))
        return -1 if at is None else at - base

    return find


def marked_runs(
    marks: bytes | bytearray,
    needle: bytes,
    extent: re.Pattern[bytes],
    start: int = 0,
    end: int | None = None,
) -> Iterator[tuple[int, int]]:
    """``(first, last)`` of each run of ``marks`` that starts with ``needle`` (its shortest
    form) in ``marks[start:end]`` and that ``extent`` matches from there: found by ``find``
    rather than a regular expression, which would try every position."""
    end = len(marks) if end is None else end
    find = _finder(marks)
    at = find(needle, start, end)
    while at >= 0:
        last = extent.match(marks, at).end()  # type: ignore[union-attr] - `*` always matches
        yield at, last
        at = find(needle, last, end)


def _between_zeros(marks: bytes | bytearray) -> list[tuple[int, int]]:
    """The parts of ``marks`` between stretches of 64 NUL marks or more."""
    parts, at, find = [], 0, _finder(marks)
    while (zeros := find(_ZEROS, at, len(marks))) >= 0:
        if zeros > at:
            parts.append((at, zeros))
        at = _ZEROS_EXTENT.match(marks, zeros).end()  # type: ignore[union-attr] - `*` always matches
    if at < len(marks):
        parts.append((at, len(marks)))
    return parts


def text_runs(
    data: bytes | bytearray,
    start: int,
    end: int,
    strides: tuple[int, ...],
    decoded: tuple[int, int] | None = None,
) -> Iterator[tuple[int, bytes]]:
    """For each stride of ``strides`` that finds any: ``(stride, text)``, the printable ASCII
    runs of ``data[start:end]`` with one character every ``stride`` bytes and NUL bytes
    between (UTF-16/UTF-32 of either byte order, integer tensors of character codes),
    joined by :data:`SEPARATOR`. ``decoded``: ``(width, phase)``, a UTF-16 or UTF-32 file's
    decoder reads the characters that lie at offsets of ``data`` equal to ``phase`` modulo
    ``width``: runs of that width there are text it searched, left out; the others (after a
    stray byte, in the other byte order) are text it read as garbage, and are searched here."""
    if start >= end:
        return
    # A whole buffer is translated as it is (no copy); a part, from a copy of it.
    offset, marks = (
        (0, data.translate(_MARKS))
        if end - start == len(data)
        else (start, data[start:end].translate(_MARKS))
    )
    between_zeros = _between_zeros(marks) if any(stride > 1 for stride in strides) else []
    for stride in strides:
        runs = []
        parts = between_zeros if stride > 1 else [(0, len(marks))]
        found = (
            run for a, b in parts for run in marked_runs(marks, _NEEDLES[stride], _EXTENTS[stride], a, b)
        )
        for first, last in found:
            if decoded is not None and (stride, (offset + first) % stride) == decoded:
                continue
            # Big-endian: the NULs come first, so the run found starts at the first character
            # and its last character has no NULs after it.
            if stride > 1 and _BIG_ENDIAN_LAST.match(marks, last) is not None:
                last += 1
            runs.append(bytes(data[offset + first : offset + last : stride]))
        if runs:
            yield stride, SEPARATOR.join(runs)


_URL_SAFE = bytes.maketrans(b"+/", b"-_")


def literal_forms(value: bytes) -> tuple[tuple[str, tuple[bytes, ...]], ...]:
    """``(how, needles)``: ``value`` hex-encoded (lower and upper case) and base64-encoded
    (standard and URL-safe, at each of the 3 places a byte can take in a 3-byte group: the
    characters that depend on ``value``'s bytes alone), so it is found at any alignment,
    glued to anything, inside a longer encoded blob."""
    cores = []
    for phase in range(3):
        encoded = base64.b64encode(b"\0" * phase + value)
        # Character i holds bits 6i to 6i+6; the value holds bits 8*phase to 8*(phase+len).
        first, last = -(-8 * phase // 6), 8 * (phase + len(value)) // 6
        cores += [encoded[first:last], encoded[first:last].translate(_URL_SAFE)]
    return (
        ("hex-encoded", tuple(dict.fromkeys((value.hex().encode(), value.hex().upper().encode())))),
        ("base64-encoded", tuple(dict.fromkeys(cores))),
    )
