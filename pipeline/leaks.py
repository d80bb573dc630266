"""The one scanner for what must never leave the machine, shared by 05 (stage) and 06 (publish).

It refuses a staged file that holds:

- an ``hf_…`` token, the value of ``HF_TOKEN`` / ``HUGGING_FACE_HUB_TOKEN``, or a token saved
  by ``hf auth login`` (any file, weights included);
- a PEM private key block (``-----BEGIN … PRIVATE KEY-----``), e.g. the ``--sign-key`` file;
- in text files only: the home folder, the working folder's or this checkout's absolute path,
  or the host name.

Why text files only for the last group: these values are short ("/root", a 2-letter host
name) and would match by chance inside megabytes of weights. A file is text when its first
8000 bytes hold no NUL byte, the rule ``git`` uses. Paths and host names match only as
whole words, so ``/root`` does not match ``/rootfs``.

Files are streamed in chunks with an overlap at least as long as the longest pattern, so a
secret that straddles two chunks is still found and a large file is never read whole. The
message names the file and the kind of leak, never a secret's value. Torch-free.
"""

from __future__ import annotations

import configparser
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from .errors import SecretInStage
from .hashing import CHUNK

__all__ = ["LeakRules", "leak_rules", "scan_secrets"]

_TOKEN_PATTERN = re.compile(rb"hf_[A-Za-z0-9]{30,}")
_PRIVATE_KEY = re.compile(rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----")
# Shorter token values would match by chance inside binary weights.
_MIN_LITERAL_SECRET = 8
# git's rule: a NUL byte in the first 8000 bytes makes a file binary.
_TEXT_PROBE = 8000
_TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
# Host names that identify no machine.
_ANONYMOUS_HOSTS = frozenset({"localhost", "localhost.localdomain"})
_PACKAGE_CHECKOUT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class LeakRules:
    """What :func:`scan_secrets` refuses. Build it with :func:`leak_rules`."""

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


def leak_rules(environ: Mapping[str, str] | None = None, *, hostname: str | None = None,
               home: str | None = None, cwd: str | None = None) -> LeakRules:
    """The rules for this process: tokens from ``environ`` (default ``os.environ``) and the
    saved login, this machine's home folder, working folder, checkout path and host name
    (each argument overrides what is read from the system)."""
    environ = os.environ if environ is None else environ
    named = [(environ.get(name, ""), f"the value of {name}") for name in _TOKEN_VARIABLES]
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


def scan_secrets(folder: str | Path, rules: LeakRules | None = None, *,
                 consequence: str = "nothing was staged") -> None:
    """Refuse (:class:`SecretInStage`) if any plain file in ``folder`` (subfolders included) leaks what
    ``rules`` (default :func:`leak_rules`) name. The message names the file, the kind of
    leak and ``consequence``; it never holds a secret's value."""
    rules = leak_rules() if rules is None else rules
    anywhere = [(_TOKEN_PATTERN, "an hf_ token"), (_PRIVATE_KEY, "a PEM private key")]
    anywhere += [(re.compile(re.escape(value)), what) for value, what in rules.secrets]
    in_text = [(_whole_word(value, what), what) for value, what in rules.machine]
    longest = max([len(value) for value, _ in rules.secrets + rules.machine] + [64])
    overlap = longest + 2  # the look-around bytes of a whole-word match
    folder = Path(folder)
    for path in sorted(folder.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        with open(path, "rb") as handle:
            tail, first = b"", True
            patterns = anywhere
            while chunk := handle.read(CHUNK):
                if first:
                    patterns = anywhere + (in_text if b"\0" not in chunk[:_TEXT_PROBE] else [])
                    first = False
                window = tail + chunk
                for pattern, what in patterns:
                    if pattern.search(window):
                        name = path.relative_to(folder).as_posix()
                        raise SecretInStage(f"{name} holds {what}; {consequence}. Remove it from where it "
                                            "came from (config card section, data, task sample, edits to the "
                                            "stage) and stage again")
                tail = window[-overlap:]
