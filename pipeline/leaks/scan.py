"""The scan itself: this machine's rules, one file streamed through them, the refusal.

See the package docstring for what is refused where. Torch-free (the publish side runs it).
"""

from __future__ import annotations

import codecs
import configparser
import ctypes
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import ConfigError, InternalError, SecretInStage
from ..hashing import CHUNK
from ..safe_read import read_regular
from ..safetensors_header import DTYPE_SIZES, header_span, parse_header
from .encodings import MEMMEM as _MEMMEM
from .encodings import MEMMEM_MIN as _MEMMEM_MIN
from .encodings import STRIDES, literal_forms, text_encoding, text_runs
from .kinds import ALLOWABLE, BEFORE, HOST_NAME, KINDS, OVERLAP, near_needles
from .views import encoded_runs, reader_view

__all__ = [
    "SECRET_VARIABLES",
    "FileScan",
    "LeakRules",
    "allowance_problem",
    "leak_rules",
    "refuse_findings",
    "scan_secrets",
]

# Environment variables whose values are secrets wherever they appear.
SECRET_VARIABLES = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "WANDB_API_KEY",
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "GITHUB_TOKEN",
    "GH_TOKEN",
    "GITLAB_TOKEN",
    "NPM_TOKEN",
    "DATABRICKS_TOKEN",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "SLACK_BOT_TOKEN",
)
# Shorter values would match by chance inside binary weights.
_MIN_LITERAL_SECRET = 8
# The saved login's files hold a token or a few named ones: anything larger is not one.
_MAX_SAVED_LOGIN = 64 * 1024
# How much of a file tells its text encoding (git reads as much to tell text from binary).
_TEXT_PROBE = 8000
_CONTEXT = 16  # bytes before the seam that look-behinds may read
# Where a text file's text ends: nowhere.
_ALL_OF_IT = 2**63
# Host names that identify no machine.
_ANONYMOUS_HOSTS = frozenset({"localhost", "localhost.localdomain"})
_PACKAGE_CHECKOUT = Path(__file__).resolve().parents[2]
# The order kinds are named in: this machine's values, the formats of the table, its paths and name.
_ORDER = {"secret": 0, **{kind.id: n for n, kind in enumerate(KINDS, 1)}, "path": len(KINDS) + 1}

Search = Callable[[Any, int, int], bool]
"""``search(buffer, start, end)``: whether a rule matches in ``buffer[start:end]``."""
Rule = tuple[str, str, Search, str]
"""``(kind, words, search, form)``: ``form`` says how the rule's value is written ("hex-encoded")."""
# How the characters of a run lie in the bytes, in words ("" for plain bytes).
_WIDTHS = {1: "", 2: "UTF-16", 4: "UTF-32", 8: "8 bytes a character"}


@dataclass(frozen=True, slots=True)
class LeakRules:
    """What this machine must not publish beyond :data:`KINDS`. Build it with :func:`leak_rules`."""

    secrets: tuple[tuple[bytes, str], ...] = field(repr=False)
    """Literal secret values with the words that name them (never the value)."""
    machine: tuple[tuple[bytes, str], ...] = ()
    """Absolute paths and the host name, each with its description; refused in text files."""


def _saved_text(path: str) -> str | None:
    """A saved-login file's text, or None: missing, unreadable, not a regular file (a FIFO
    would block the read for ever, a device such as /dev/zero never end), over the bound."""
    try:
        return read_regular(path, _MAX_SAVED_LOGIN).decode("utf-8")
    except (OSError, ValueError):  # ValueError: refused by read_regular, or not UTF-8
        return None


def _saved_tokens() -> list[str]:
    """The token `hf auth login` saved and every named one it stored, read from the files
    the client documents (HF_TOKEN_PATH, HF_STORED_TOKENS_PATH), each through the safe reader.
    Read directly: the client's get_token() may refresh an OAuth token over the network.
    Never raises."""
    from huggingface_hub import constants

    values: list[str] = []
    token = _saved_text(constants.HF_TOKEN_PATH)
    if token is not None:
        values.append(token)
    text = _saved_text(constants.HF_STORED_TOKENS_PATH)
    stored = configparser.ConfigParser(interpolation=None)
    try:
        stored.read_string(text or "")
    except configparser.Error:
        return values
    values += [stored[name].get("hf_token", "") for name in stored.sections()]
    return values


def leak_rules(
    environ: Mapping[str, str] | None = None,
    *,
    hostname: str | None = None,
    home: str | None = None,
    cwd: str | None = None,
) -> LeakRules:
    """The rules for this process: secrets from ``environ`` (default ``os.environ``) and the
    saved login, this machine's home folder, working folder, checkout path and host name
    (each argument overrides what is read from the system)."""
    environ = os.environ if environ is None else environ
    named = [(environ.get(name, ""), f"the value of {name}") for name in SECRET_VARIABLES]
    named += [(value, "a token saved by `hf auth login`") for value in _saved_tokens()]
    secrets: dict[bytes, str] = {}
    for value, what in named:
        value = (value or "").strip()
        if len(value) >= _MIN_LITERAL_SECRET:
            secrets.setdefault(value.encode(), what)
    places = [
        (home if home is not None else os.path.expanduser("~"), "the home folder's path"),
        (cwd if cwd is not None else os.getcwd(), "the working folder's absolute path"),
        (str(_PACKAGE_CHECKOUT), "this checkout's absolute path"),
    ]
    machine: dict[bytes, str] = {}
    for path, what in places:
        path = os.path.normpath(path) if path else ""
        # Not the root. POSIX keeps a leading "//" ("//home/alice" is /home/alice, and "//" is
        # the root): the one-slash form finds both spellings.
        if path.startswith("/") and path.strip("/"):
            machine.setdefault(("/" + path.lstrip("/")).encode(), what)
    host = (hostname if hostname is not None else socket.gethostname()).strip()
    if host and host.lower() not in _ANONYMOUS_HOSTS:
        machine.setdefault(host.encode(), "the host name")
    return LeakRules(tuple(secrets.items()), tuple(machine.items()))


def _whole_word(value: bytes, what: str) -> re.Pattern[bytes]:
    # A path or name counts only where it is not part of a longer name; host names ignore case.
    flags = re.IGNORECASE if what == "the host name" else 0
    return re.compile(rb"(?<![A-Za-z0-9_.-])" + re.escape(value) + rb"(?![A-Za-z0-9_-])", flags)


class FileScan:
    """One file's bytes streamed through the rules, in the order they are read.

    ``feed(buffer, n)`` searches ``buffer[:n]`` in place (bytes or bytearray: no copy) and the
    seam it makes with the previous chunk; the first chunk tells how the file's text is encoded
    (its first 8000 bytes, or all of a shorter file). ``size`` is the file's size (a safetensors
    header is checked against it). ``found`` maps each kind found to its words: a kind id of
    :data:`KINDS`, ``host-name``, or ``secret``/``path`` for what no entry may allow.

    Every byte is searched for this machine's secret values. The text of a file is searched
    for every rule, as written and as its reader sees it (:mod:`.views`): a text file whole
    (UTF-8, whatever NUL bytes it holds; UTF-16 and UTF-32 decoded first), and the JSON header
    of a file shaped like safetensors (its ``__metadata__`` and tensor names). Outside its
    text and outside the floating-point tensors that the strict parser
    (:mod:`pipeline.safetensors_header`) finds in that header, the printable runs of a file's
    bytes (:func:`.encodings.text_runs`: strings of a binary format, UTF-16 or UTF-32 text,
    integer tensors of character codes) are searched for this machine's values and the
    credential formats. A header the parser refuses marks no byte as numbers.
    """

    def __init__(self, rules: LeakRules, *, size: int) -> None:
        literals = [("secret", what, _literal(value), "") for value, what in rules.secrets]
        forms = [
            ("secret", what, _any_needle(needles), how)
            for value, what in rules.secrets
            for how, needles in literal_forms(value)
        ]
        kinds = [(kind.id, kind.what, kind.search, "") for kind in KINDS]
        machine = [
            (HOST_NAME if what == "the host name" else "path", what, _machine_word(value, what), "")
            for value, what in rules.machine
        ]
        self._text: list[Rule] = literals + forms + kinds + machine
        # Runs of binary bytes and decoded runs are mostly noise, in which a short host name would
        # turn up by chance; decoded bytes next to a credential are noise too (no word boundaries).
        # A value of this machine is found encoded by its forms; decoded, in mixed-case hex too.
        self._runs = literals + forms + kinds
        self._decoded = literals + [(kind.id, kind.what, kind.search_decoded, "") for kind in KINDS]
        self._literals = literals
        self._size = size
        self._text_end: int | None = None  # file offset where the UTF-8 text ends (0: no text)
        self._strides: tuple[int, ...] = STRIDES  # of the runs searched outside the text
        self._decoder: codecs.IncrementalDecoder | None = None  # a UTF-16 or UTF-32 file's text
        # (width, phase): a file offset equal to phase modulo width holds a character the decoder reads.
        self._read_by_decoder: tuple[int, int] | None = None
        self._how = ""  # how the file's text is encoded, in words ("" for UTF-8)
        self._header: bytearray | None = None  # a safetensors header, while it is read
        self._numbers: list[tuple[int, int]] = []  # floating-point tensors: this machine's values only
        self._position = 0  # of the next chunk in the file
        self._tail = b""  # the end of the previous chunk, as read
        self._text_tail = b""  # the end of the text searched so far (UTF-8)
        # A literal secret, even encoded (URL-encoding triples it), still fits in a seam of text;
        # a run of bytes holds a character in up to 8 bytes.
        self._text_overlap = max(
            [OVERLAP] + [3 * len(value) + BEFORE for value, _ in rules.secrets + rules.machine]
        )
        self._overlap = max(STRIDES) * self._text_overlap
        self.found: dict[str, str] = {}

    def feed(self, buffer: bytes | bytearray, n: int) -> None:
        start = self._position
        if self._text_end is None:
            self._classify(buffer, n)
        if self._header is not None:
            self._read_header(buffer, n)
        text = max(0, min(n, self._text_end - start))  # buffer[:text] is UTF-8 text
        if self._tail:  # the seam: the end of the previous chunk (with left context) and this one's start
            seam = self._tail + bytes(buffer[: min(n, self._overlap)])
            context = max(0, len(self._tail) - self._overlap)
            self._search(self._literals, seam, context, len(seam))
            for a, b in self._outside_numbers(start - len(self._tail), context, len(seam)):
                self._search_runs(seam, a, b, self._strides, start - len(self._tail))
        self._search(self._literals, buffer, 0, n)
        # Plain runs of the text are the text itself, searched below; wide runs are not.
        self._search_runs(buffer, 0, text, tuple(stride for stride in self._strides if stride > 1), start)
        for a, b in self._outside_numbers(start, text, n):
            self._search_runs(buffer, a, b, self._strides, start)
        if text:
            self._search_text_stream(buffer, text)
        elif self._decoder is not None:
            decoded = self._decoder.decode(bytes(buffer[:n])).encode("utf-8", "replace")
            self._search_text_stream(decoded, len(decoded))
        self._tail = _kept(self._tail, buffer, n, self._overlap + _CONTEXT)
        self._position += n

    def _classify(self, buffer: bytes | bytearray, n: int) -> None:
        """Where the file's text is and how it is encoded, from its first chunk."""
        end = header_span(bytes(buffer[: min(n, 9)]), self._size)
        if end is not None:  # shaped like safetensors: its header is text
            self._header = bytearray()
            self._text_end = end
            return
        probe = bytes(buffer[: min(n, _TEXT_PROBE)])
        encoding = text_encoding(probe)
        self._text_end = _ALL_OF_IT if encoding == "utf-8" else 0
        if encoding == "utf-8":  # plain runs of UTF-8 text are the text itself (UTF-8 resynchronises)
            self._strides = tuple(stride for stride in STRIDES if stride != 1)
        elif encoding is not None:
            self._decoder = codecs.getincrementaldecoder(encoding)("replace")
            self._how = encoding[:6].upper()  # "UTF-16", "UTF-32"
            # The decoder reads every character from the start, never resynchronising: after a
            # stray byte, or a part in the other byte order (two files joined), it reads garbage.
            # The runs of its width are searched but where it reads ASCII right.
            width = 2 if encoding.startswith("utf-16") else 4
            big = encoding.endswith("-be") or probe.startswith((b"\xfe\xff", b"\0\0\xfe\xff"))
            self._read_by_decoder = (width, width - 1 if big else 0)

    def _read_header(self, buffer: bytes | bytearray, n: int) -> None:
        """Collect the safetensors header (it starts the file); once whole, learn where the
        floating-point tensors lie from the strict parser (none if it refuses the file)."""
        header = self._header
        if header is None or self._text_end is None:
            raise InternalError("a safetensors header is read only once its extent is known")
        header += buffer[: min(n, self._text_end - len(header))]
        if len(header) == self._text_end:
            self._numbers = _float_tensors(bytes(header), self._size)
            self._header = None

    def _search(self, checks: list[Rule], buffer: Any, start: int, end: int, how: str = "") -> None:
        for kind, what, search, form in checks:
            if kind not in self.found and search(buffer, start, end):
                words = ", ".join(word for word in (how, form) if word)
                self.found[kind] = f"{what} ({words})" if words else what

    def _search_text_stream(self, data: bytes | bytearray, n: int) -> None:
        """The file's text ``data[:n]``, next after the text searched so far, and the seam between."""
        if self._text_tail:
            seam = self._text_tail + bytes(data[: min(n, self._text_overlap)])
            self._search_text(
                seam, max(0, len(self._text_tail) - self._text_overlap), len(seam), how=self._how
            )
        self._search_text(data, 0, n, how=self._how)
        self._text_tail = _kept(self._text_tail, data, n, self._text_overlap + _CONTEXT)

    def _search_text(
        self, buffer: bytes | bytearray, start: int, end: int, rules: list[Rule] | None = None, how: str = ""
    ) -> None:
        """``rules`` (default: every rule) on the text ``buffer[start:end]``, as written and as a
        reader sees it, and the base64 and hex runs in it decoded."""
        rules = self._text if rules is None else rules
        self._search(rules, buffer, start, end, how)
        view, changes = reader_view(bytes(buffer[start:end]))
        if changes:
            self._search(rules, view, 0, len(view), ", ".join((how, *changes) if how else changes))
        for decoded, encoding in zip(encoded_runs(view), ("base64-encoded", "hex-encoded")):
            if decoded:
                said = f"{how}, {encoding}" if how else encoding
                for stride, runs in text_runs(decoded, 0, len(decoded), STRIDES):
                    self._search(
                        self._decoded, runs, 0, len(runs), ", ".join(filter(None, (said, _WIDTHS[stride])))
                    )

    def _search_runs(
        self, buffer: bytes | bytearray, start: int, end: int, strides: tuple[int, ...], at: int
    ) -> None:
        """The printable runs of the bytes ``buffer[start:end]``, as text; ``buffer`` holds the
        file from offset ``at``."""
        decoded = None
        if self._read_by_decoder is not None:
            width, phase = self._read_by_decoder
            decoded = (width, (phase - at) % width)
        for stride, runs in text_runs(buffer, start, end, strides, decoded):
            self._search_text(runs, 0, len(runs), self._runs, _WIDTHS[stride])

    def _outside_numbers(self, start: int, first: int, n: int) -> list[tuple[int, int]]:
        """The parts of ``buffer[first:n]`` outside floating-point tensors, for a buffer that
        holds the file from offset ``start``."""
        parts, at = [], first
        for begin, end in self._numbers:
            if end <= start + at or begin >= start + n:
                continue
            if begin > start + at:
                parts.append((at, begin - start))
            at = max(at, min(n, end - start))
        if at < n:
            parts.append((at, n))
        return parts


def _kept(tail: bytes, buffer: bytes | bytearray, n: int, keep: int) -> bytes:
    """The last ``keep`` bytes of the stream so far: ``tail``, then ``buffer[:n]`` (reads
    shorter than a seam keep the end of the ones before)."""
    if n >= keep:
        return bytes(buffer[n - keep : n])
    return (tail + bytes(buffer[:n]))[-keep:]


# The payload of a floating-point tensor is numbers: a token format there would be chance, and
# searching gigabytes for each format costs a pass per format. It is searched for this machine's
# secret values (long literals, found at memory speed), like every byte.
_FLOATS = frozenset(name for name in DTYPE_SIZES if name.startswith(("F", "BF")))


def _float_tensors(header: bytes, size: int) -> list[tuple[int, int]]:
    """File offsets of the floating-point tensors of a safetensors file whose length and
    header are ``header``, merged; [] if the strict parser refuses it (every byte is searched)."""
    try:
        parsed, data_start = parse_header(header, size=size)
    except ValueError:
        return []
    ranges = sorted(
        (data_start + entry["data_offsets"][0], data_start + entry["data_offsets"][1])
        for name, entry in parsed.items()
        if name != "__metadata__" and entry["dtype"] in _FLOATS
    )
    merged: list[tuple[int, int]] = []
    for first, last in ranges:
        if merged and first <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return merged


def _machine_word(value: bytes, what: str):
    pattern, span = _whole_word(value, what), len(value) + _CONTEXT
    if what != "the host name":
        return lambda buffer, start, end: near_needles(pattern, (value,), buffer, start, end, span=span)

    def search(buffer: bytes | bytearray, start: int, end: int) -> bool:
        return near_needles(pattern, (), buffer, start, end, any_case=(value.lower(),), span=span)

    return search


def _any_needle(needles: tuple[bytes, ...]) -> Search:
    def search(buffer: bytes | bytearray, start: int, end: int) -> bool:
        return any(buffer.find(needle, start, end) >= 0 for needle in needles)

    return search


def _literal(value: bytes):
    def search(buffer: bytes | bytearray, start: int, end: int) -> bool:
        if _MEMMEM is not None and isinstance(buffer, bytearray) and end - start >= _MEMMEM_MIN:
            window = (ctypes.c_char * (end - start)).from_buffer(buffer, start)
            return _MEMMEM(ctypes.addressof(window), end - start, value, len(value)) is not None
        return buffer.find(value, start, end) >= 0

    return search


def allowance_problem(allow: Any) -> str | None:
    """Why ``allow`` (the value of ``card.allow_leaks``) is malformed, or None: a mapping of a
    staged file's relative path to a list of kind ids from :data:`ALLOWABLE`."""
    if not isinstance(allow, Mapping):
        return "must map a staged file to the kinds it may hold, e.g. {README.md: [jwt]}"
    for name, kinds in allow.items():
        if not isinstance(name, str) or not name or name.startswith("/") or ".." in name.split("/"):
            return f"names {name!r}, which is not a relative path of a staged file such as 'README.md'"
        if not isinstance(kinds, list) or not kinds or not all(isinstance(k, str) for k in kinds):
            return f"gives {name} {kinds!r}, which is not a non-empty list of kinds"
        for kind in kinds:
            if kind not in ALLOWABLE:
                return (
                    f"allows {kind!r} in {name}, which is not a kind that may be allowed (one of "
                    f"{', '.join(sorted(ALLOWABLE))}); tokens of this machine, private keys and paths never are"
                )
    return None


def _words(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def refuse_findings(
    found: Mapping[str, Mapping[str, str]],
    allow: Mapping[str, Any] | None = None,
    *,
    consequence: str = "nothing was staged",
) -> list[tuple[str, str]]:
    """Raise :class:`SecretInStage` if any file holds something that ``allow``
    (``card.allow_leaks``) does not allow, naming each such file once with every kind it
    holds (files holding the same kinds together, as a card's text repeated in README.md,
    config.json and meta.json); return the allowed findings as ``(file, words)``."""
    allow = allow or {}
    allowed: list[tuple[str, str]] = []
    refused: dict[str, dict[str, str]] = {}
    for name in sorted(found):
        for kind, what in sorted(found[name].items(), key=lambda item: _ORDER.get(item[0], len(_ORDER))):
            if kind in allow.get(name, ()) and kind in ALLOWABLE:
                allowed.append((name, what))
            else:
                refused.setdefault(name, {})[kind] = what
    if not refused:
        return allowed
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, kinds in refused.items():
        groups.setdefault(tuple(kinds), []).append(name)
    said = "; ".join(
        f"{_words(names)} {'holds' if len(names) == 1 else 'hold'} {_words(list(refused[names[0]].values()))}"
        for names in groups.values()
    )
    message = (
        f"{said}; {consequence}. Remove it from where it came from (config card section, data, task "
        "sample, code, edits to the stage) and stage again"
    )
    if all(kind in ALLOWABLE for kinds in refused.values() for kind in kinds):
        entries = ", ".join(f"{name}: [{', '.join(kinds)}]" for name, kinds in refused.items())
        message += (
            f"; if it is not a secret (a documented example), allow it per file in the config: "
            f"card.allow_leaks: {{{entries}}} (docs/publishing.md)"
        )
    raise SecretInStage(message)


def scan_secrets(
    folder: str | Path,
    rules: LeakRules | None = None,
    *,
    consequence: str = "nothing was staged",
    allow: Mapping[str, Any] | None = None,
) -> list[tuple[str, str]]:
    """Refuse (:class:`SecretInStage`) if any plain file in ``folder`` (subfolders included)
    leaks what :data:`KINDS` or ``rules`` (default :func:`leak_rules`) name, unless ``allow``
    (``card.allow_leaks``) allows that kind in that file. The message names the file, the kind
    of leak and ``consequence``; never a secret's value. Returns the allowed findings."""
    problem = allowance_problem(allow or {})
    if problem is not None:
        raise ConfigError(f"card.allow_leaks {problem}")
    rules = leak_rules() if rules is None else rules
    folder = Path(folder)
    found: dict[str, dict[str, str]] = {}
    buffer = bytearray(CHUNK)
    for path in sorted(folder.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        with open(path, "rb", buffering=0) as handle:
            scan = FileScan(rules, size=os.fstat(handle.fileno()).st_size)
            while n := handle.readinto(buffer):
                scan.feed(buffer, n)
        if scan.found:
            found[path.relative_to(folder).as_posix()] = scan.found
    return refuse_findings(found, allow, consequence=consequence)
