"""The one scanner for what must never leave the machine, shared by 05 (stage) and 06 (publish).

=============  ===============================================================
``kinds``      THE table of credential formats (:data:`KINDS`), each with examples
``views``      text as its reader sees it: escapes, URL-encoding, invisible
               characters, base64 and hex runs decoded at every alignment
``encodings``  text in other bytes: a file's text encoding (UTF-8, UTF-16,
               UTF-32), the printable runs of binary bytes at each width, a
               secret value's hex and base64 forms
``scan``       this machine's rules, :class:`FileScan` (one file, streamed),
               :func:`refuse_findings`, :func:`scan_secrets` (a folder)
=============  ===============================================================

A staged file is refused when it holds:

- in every byte of every file, weights included: the value of a token this machine holds
  (``HF_TOKEN`` and the other variables of ``SECRET_VARIABLES``, or a token saved by
  ``hf auth login``);
- in any file, but outside the floating-point tensors of a safetensors file (numbers, where a
  format would match by chance and each format would cost a pass): the credential formats of
  :data:`KINDS` and those values encoded, in the printable runs of its bytes (strings of a
  binary format, UTF-16 or UTF-32 text, integer tensors of character codes);
- in text, as written and as its reader sees it (escapes, URL-encoding and character
  references decoded, invisible characters removed, base64 and hex runs decoded at every
  alignment): the credential formats of :data:`KINDS`, this machine's values in every listed
  encoding, its home folder, working folder or checkout path, and its host name. Text is a
  text file (UTF-8 whatever NUL bytes it holds, UTF-16 or UTF-32 with or without a byte order
  mark: :func:`.encodings.text_encoding`) and the JSON header of a safetensors file (its
  ``__metadata__`` and tensor names, which any reader prints). Where a UTF-16 or UTF-32
  file's decoder reads out of step (after a stray byte, in the other byte order), its
  characters are searched as printable runs of its width, like binary bytes.

Paths and host names match only as whole words, so ``/root`` does not match ``/rootfs``.
A file is streamed chunk by chunk (the audit feeds the scan the chunks it hashes); a secret
that straddles two chunks is searched in the seam between them, its bytes as read and its
text as decoded. The refusal names each file and the kinds it holds, and how the value was
written, never a value. A false positive of a *format* (a documented example key in a card, a
test vector in code) can be allowed for one file by ``card.allow_leaks`` (docs/publishing.md);
a token this machine holds, a private key or a path never can. Torch- and NumPy-free. What the
scan cannot see is listed in docs/publishing.md.
"""

from .kinds import ALLOWABLE, HOST_NAME, KINDS, LeakKind
from .scan import (
    SECRET_VARIABLES,
    FileScan,
    LeakRules,
    allowance_problem,
    leak_rules,
    refuse_findings,
    scan_secrets,
)

__all__ = [
    "ALLOWABLE",
    "HOST_NAME",
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
