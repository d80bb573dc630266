"""The one scanner for what must never leave the machine, shared by 05 (stage) and 06 (publish).

It refuses a staged file that holds:

- in every byte of every file, weights included: the value of a token this machine holds
  (``HF_TOKEN`` and the other variables of ``SECRET_VARIABLES``, or a token saved by
  ``hf auth login``);
- in any file, but outside the floating-point tensors of a safetensors file (numbers, where a
  format would match by chance and each format would cost a pass): an ``hf_…`` token and a PEM
  private key block;
- in text files: the credential formats of :data:`KINDS` (AWS, GitHub, OpenAI, Slack,
  ``api_org_``, Google, W&B, JWT), this machine's home folder, working folder or checkout
  path, and its host name.

Why text files only for the second group: those formats and values are short and would
match by chance inside gigabytes of weights (and searching weights for each would cost a read
per pattern). A file is text when its first 8000 bytes hold no NUL byte, the rule ``git``
uses. Paths and host names match only as whole words, so ``/root`` does not match ``/rootfs``.

A file is streamed through :class:`FileScan` chunk by chunk (the audit feeds it the same
chunks it hashes); a secret that straddles two chunks is searched in the seam between them, so
it is found and no chunk is copied. Findings are collected and refused together by
:func:`refuse_findings`: the message names the file and the kind of leak, never the value.
A false positive of a *format* (a documented example key in a card, a test vector in code) can
be allowed for one file by ``card.allow_leaks`` (see docs/publishing.md); a token this machine
holds, a private key or a path never can. Torch-free.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError, SecretInStage
from .hashing import CHUNK

__all__ = [
    "KINDS",
    "SECRET_VARIABLES",
    "FileScan",
    "LeakKind",
    "LeakRules",
    "allowance_problem",
    "leak_rules",
    "refuse_findings",
    "scan_secrets",
]


@dataclass(frozen=True, slots=True)
class LeakKind:
    """One curated credential format."""

    id: str
    """Stable name, used in ``card.allow_leaks``."""
    what: str
    """Words for messages ("an AWS access key"); never the value."""
    pattern: re.Pattern[bytes]
    """What a value of this kind looks like (bounded context, at most ``_OVERLAP`` bytes long)."""
    anywhere: bool = False
    """Searched in binary files too (long, distinctive prefixes only)."""
    allowable: bool = True
    """May be allowed for a file by ``card.allow_leaks`` (a format can match a non-secret)."""
    needles: tuple[bytes, ...] = ()
    """Literals of which every match holds one, near its start: looked for first."""

    def search(self, buffer: bytes | bytearray, start: int, end: int) -> bool:
        return _near_needles(self.pattern, self.needles, buffer, start, end)


def _near_needles(
    pattern: re.Pattern[bytes],
    needles: tuple[bytes, ...],
    buffer: bytes | bytearray,
    start: int,
    end: int,
    haystack: bytes | bytearray | None = None,
    span: int = 0,
) -> bool:
    """Whether ``pattern`` matches in ``buffer[start:end]``, tried only around each needle found
    (in ``haystack``, e.g. a lowercased copy, default ``buffer``). ``bytes.find`` runs at GB/s
    where a pattern that starts with a look-behind would run at tens of MB/s."""
    haystack = buffer if haystack is None else haystack
    span = max(span, _OVERLAP)
    for needle in needles:
        at = haystack.find(needle, start, end)
        while at >= 0:
            # Look-behinds still see the bytes before the window: it starts inside the buffer.
            if pattern.search(buffer, max(0, at - _BEFORE), min(end, at + span)) is not None:
                return True
            at = haystack.find(needle, at + 1, end)
    return False


def _kind(id: str, what: str, pattern: bytes, **flags: Any) -> LeakKind:  # noqa: A002 - the field's name
    return LeakKind(id, what, re.compile(pattern), **flags)


# Left context: a credential starts a word, so "task-…" or "xyzAKIA…" do not match.
KINDS: tuple[LeakKind, ...] = (
    _kind("hf-token", "an hf_ token", rb"hf_[A-Za-z0-9]{30,}", anywhere=True, needles=(b"hf_",)),
    _kind(
        "private-key",
        "a PEM private key",
        rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----",
        anywhere=True,
        allowable=False,
        needles=(b"PRIVATE KEY-----",),
    ),
    _kind(
        "hf-org-token",
        "an api_org_ token",
        rb"(?<![A-Za-z0-9_])api_org_[A-Za-z0-9]{30,}",
        needles=(b"api_org_",),
    ),
    _kind(
        "aws-key",
        "an AWS access key",
        rb"(?<![A-Z0-9])(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}(?![A-Z0-9])"
        rb"|(?i:aws_?secret_?access_?key)[\"']?\s*[:=]\s*[\"']?[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+])",
        needles=(b"AKIA", b"ASIA", b"ABIA", b"ACCA", b"ccess_key", b"CCESS_KEY", b"ccessKey"),
    ),
    _kind(
        "github-token",
        "a GitHub token",
        rb"(?<![A-Za-z0-9_])(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})",
        needles=(b"ghp_", b"gho_", b"ghu_", b"ghs_", b"ghr_", b"github_pat_"),
    ),
    _kind(
        "openai-key",
        "an OpenAI API key",
        rb"(?<![A-Za-z0-9_-])sk-(?:(?:proj|svcacct|admin)-[A-Za-z0-9_-]{20,}|[A-Za-z0-9]{32,}"
        rb"|[A-Za-z0-9]{20}T3BlbkFJ[A-Za-z0-9]{20})",
        needles=(b"sk-",),
    ),
    _kind(
        "slack-token", "a Slack token", rb"(?<![A-Za-z0-9])xox[abeoprs]-[A-Za-z0-9-]{10,}", needles=(b"xox",)
    ),
    _kind(
        "google-api-key", "a Google API key", rb"(?<![A-Za-z0-9_-])AIza[0-9A-Za-z_-]{35}", needles=(b"AIza",)
    ),
    # A W&B key is 40 hex digits, like a git commit id: only with a W&B name in front of it
    # (WANDB_API_KEY=…, wandb.login(key=…), the api.wandb.ai entry of a .netrc).
    _kind(
        "wandb-key",
        "a W&B API key",
        rb"(?i:wandb[A-Za-z0-9_.]*(?:key|login|password)|api\.wandb\.ai)[\s\S]{0,80}?"
        rb"(?<![0-9A-Fa-f])[0-9a-f]{40}(?![0-9A-Fa-f])",
        needles=(b"andb", b"ANDB", b"andB"),
    ),
    _kind(
        "jwt",
        "a JSON Web Token",
        rb"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{16,}",
        needles=(b"eyJ",),
    ),
)
_KIND_BY_ID = {kind.id: kind for kind in KINDS}
# The host name can be a common word ("gpu" in a card): a file may allow it, never a path.
HOST_NAME = "host-name"
ALLOWABLE = frozenset([kind.id for kind in KINDS if kind.allowable] + [HOST_NAME])

# Environment variables whose values are secrets wherever they appear.
SECRET_VARIABLES = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "WANDB_API_KEY",
    "OPENAI_API_KEY",
    "GITHUB_TOKEN",
    "GH_TOKEN",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "SLACK_BOT_TOKEN",
)
# Shorter values would match by chance inside binary weights.
_MIN_LITERAL_SECRET = 8
# git's rule: a NUL byte in the first 8000 bytes makes a file binary.
_TEXT_PROBE = 8000
# Longest match a pattern needs to be recognised (the W&B context is the longest): a secret
# that straddles two chunks lies in the last and first _OVERLAP bytes of them.
_OVERLAP = 256
_CONTEXT = 16  # bytes before the seam that look-behinds may read
_BEFORE = (
    32  # bytes between a match's start and its needle, at most ("-----BEGIN ENCRYPTED PRIVATE KEY-----")
)
# Host names that identify no machine.
_ANONYMOUS_HOSTS = frozenset({"localhost", "localhost.localdomain"})
_PACKAGE_CHECKOUT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class LeakRules:
    """What this machine must not publish beyond :data:`KINDS`. Build it with :func:`leak_rules`."""

    secrets: tuple[tuple[bytes, str], ...] = field(repr=False)
    """Literal secret values with the words that name them (never the value)."""
    machine: tuple[tuple[bytes, str], ...] = ()
    """Absolute paths and the host name, each with its description; refused in text files."""


def _saved_tokens() -> list[str]:
    """The token `hf auth login` saved and every named one it stored, read from the files
    the client documents (HF_TOKEN_PATH, HF_STORED_TOKENS_PATH). Read directly: the client's
    get_token() may refresh an OAuth token over the network. Never raises."""
    from huggingface_hub import constants

    values: list[str] = []
    try:
        values.append(Path(constants.HF_TOKEN_PATH).read_text())
    except (OSError, UnicodeDecodeError):
        pass
    stored = configparser.ConfigParser(interpolation=None)
    try:
        stored.read(constants.HF_STORED_TOKENS_PATH, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError):
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
        if path.startswith("/") and path != "/":
            machine.setdefault(path.encode(), what)
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
    seam it makes with the previous chunk. ``found`` maps each kind found to its words:
    a kind id of :data:`KINDS`, ``host-name``, or ``secret``/``path`` for what no entry may allow.
    """

    def __init__(self, rules: LeakRules) -> None:
        self._rules = rules
        self._checks: list[tuple[str, str, Any]] | None = (
            None  # (kind id, words, search) once text/binary is known
        )
        self._numbers: list[tuple[int, int]] = []  # floating-point tensors: this machine's secret values only
        self._position = 0  # of the next chunk in the file
        self._tail = b""
        # A literal secret longer than the patterns' longest match still fits in a seam.
        self._overlap = max([_OVERLAP] + [len(value) + _BEFORE for value, _ in rules.secrets + rules.machine])
        self.found: dict[str, str] = {}

    def _choose(self, text: bool) -> list[tuple[str, str, Any]]:
        literals = [("secret", what, _literal(value)) for value, what in self._rules.secrets]
        kinds = [(kind.id, kind.what, kind.search) for kind in KINDS if text or kind.anywhere]
        machine = (
            [
                (HOST_NAME if what == "the host name" else "path", what, _machine_word(value, what))
                for value, what in self._rules.machine
            ]
            if text
            else []
        )
        return literals + kinds + machine

    def feed(self, buffer: bytes | bytearray, n: int) -> None:
        if self._checks is None:
            text = buffer.find(b"\0", 0, min(n, _TEXT_PROBE)) < 0
            self._checks = self._choose(text)
            self._numbers = [] if text else _float_tensors(buffer, n)
        # The seam: the end of the previous chunk (with a few bytes of left context) and the start of this one.
        context = max(0, len(self._tail) - self._overlap)
        seam = self._tail + bytes(buffer[: min(n, self._overlap)])
        parts = self._parts(n)
        for kind, what, search in self._checks:
            if kind in self.found:
                continue
            everywhere = ((0, n),) if kind == "secret" else parts
            if search(seam, context, len(seam)) or any(search(buffer, a, b) for a, b in everywhere):
                self.found[kind] = what
        self._tail = bytes(buffer[max(0, n - self._overlap - _CONTEXT) : n])
        self._position += n

    def _parts(self, n: int) -> list[tuple[int, int]]:
        """The parts of this chunk outside floating-point tensors, relative to the chunk."""
        parts, at, start = [], 0, self._position
        for first, last in self._numbers:
            if last <= start + at or first >= start + n:
                continue
            if first > start + at:
                parts.append((at, first - start))
            at = max(at, min(n, last - start))
        if at < n:
            parts.append((at, n))
        return parts


# The payload of a floating-point tensor is numbers: a token format there would be chance, and
# searching gigabytes for each format costs a pass per format. It is searched for this machine's
# secret values (long literals, found at memory speed), like every byte.
_FLOATS = frozenset(
    {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4"}
)


def _float_tensors(buffer: bytes | bytearray, n: int) -> list[tuple[int, int]]:
    """File offsets of the floating-point tensors of a safetensors file whose header lies in
    ``buffer[:n]``, merged; [] for any other file (every part of it is searched)."""
    size = int.from_bytes(buffer[:8], "little") if n >= 9 else 0
    if not 2 <= size <= n - 8 or buffer[8:9] != b"{":
        return []
    try:
        header = json.loads(bytes(buffer[8 : 8 + size]))
    except (ValueError, UnicodeDecodeError):
        return []
    ranges = []
    for name, entry in header.items() if isinstance(header, dict) else ():
        if name == "__metadata__" or not isinstance(entry, dict):
            continue
        offsets = entry.get("data_offsets")
        if (
            entry.get("dtype") in _FLOATS
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            ranges.append((8 + size + offsets[0], 8 + size + offsets[1]))
    merged: list[tuple[int, int]] = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return merged


def _machine_word(value: bytes, what: str):
    pattern, span = _whole_word(value, what), len(value) + _CONTEXT
    if what != "the host name":
        return lambda buffer, start, end: _near_needles(pattern, (value,), buffer, start, end, span=span)

    def search(
        buffer: bytes | bytearray, start: int, end: int
    ) -> bool:  # any case: find it in a lowercased copy
        return _near_needles(pattern, (value.lower(),), buffer, start, end, buffer[:end].lower(), span)

    return search


def _literal(value: bytes):
    return lambda buffer, start, end: buffer.find(value, start, end) >= 0


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
    """Raise :class:`SecretInStage` naming the first file (in order) holding something that ``allow``
    (``card.allow_leaks``) does not allow, with every such kind and file; return the allowed
    findings as ``(file, words)``."""
    allow = allow or {}
    allowed: list[tuple[str, str]] = []
    refused: dict[str, dict[str, str]] = {}
    for name in sorted(found):
        for kind, what in found[name].items():
            if kind in allow.get(name, ()) and kind in ALLOWABLE:
                allowed.append((name, what))
            else:
                refused.setdefault(name, {})[kind] = what
    if not refused:
        return allowed
    first, *others = refused
    also = f" (and in {', '.join(others)})" if others else ""
    message = (
        f"{first} holds {_words(list(refused[first].values()))}{also}; {consequence}. Remove it from where "
        "it came from (config card section, data, task sample, code, edits to the stage) and stage again"
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
        scan = FileScan(rules)
        with open(path, "rb", buffering=0) as handle:
            while n := handle.readinto(buffer):
                scan.feed(buffer, n)
        if scan.found:
            found[path.relative_to(folder).as_posix()] = scan.found
    return refuse_findings(found, allow, consequence=consequence)
