"""THE table of credential formats the leak scan knows, each with made-up examples.

Every rule of :data:`KINDS` carries ``examples``: invented values of every form the rule
claims to match (each prefix, each variant). The tests plant each one, plain and encoded,
in every kind of staged file, so a rule that stops matching one of its forms fails a test.
The examples are written as concatenations so that this file itself holds nothing shaped
like a credential (secret scanners of code hosts would flag it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["ALLOWABLE", "HOST_NAME", "KINDS", "LeakKind", "near_needles"]

# Longest stretch a match needs to be recognised in (the W&B context and an encoded form are
# the longest): a secret that straddles two read chunks lies in the last and first _OVERLAP
# bytes of them.
OVERLAP = 1024
# Bytes between a match's start and its needle, at most ("-----BEGIN ENCRYPTED PRIVATE ", a
# database URL's scheme and driver).
BEFORE = 64


@dataclass(frozen=True, slots=True)
class LeakKind:
    """One curated credential format."""

    id: str
    """Stable name, used in ``card.allow_leaks``."""
    what: str
    """Words for messages ("an AWS access key"); never the value."""
    pattern: re.Pattern[bytes]
    """What a value of this kind looks like (bounded context, at most ``OVERLAP`` bytes long)."""
    decoded: re.Pattern[bytes]
    """``pattern`` without its word boundaries, for bytes decoded from base64 or hex: the bytes
    next to a decoded credential come from whatever text its encoding was glued to (noise), and
    a boundary there would miss it. Chance matches in decoded noise are too rare to matter."""
    needles: tuple[bytes, ...]
    """Literals of which every match holds one (or one of ``any_case``), near its start: looked
    for first."""
    examples: tuple[str, ...]
    """Invented values of each form the pattern matches (the tests plant every one)."""
    any_case: tuple[bytes, ...] = ()
    """Lowercase literals looked for in a lowercased copy of the bytes: for a name the pattern
    takes in any case (``(?i:...)``), whose spellings no list of needles covers."""
    allowable: bool = True
    """May be allowed for a file by ``card.allow_leaks`` (a format can match a non-secret)."""

    def search(self, buffer: bytes | bytearray, start: int, end: int) -> bool:
        return near_needles(self.pattern, self.needles, buffer, start, end, any_case=self.any_case)

    def search_decoded(self, buffer: bytes | bytearray, start: int, end: int) -> bool:
        return near_needles(self.decoded, self.needles, buffer, start, end, any_case=self.any_case)


def near_needles(
    pattern: re.Pattern[bytes],
    needles: tuple[bytes, ...],
    buffer: bytes | bytearray,
    start: int,
    end: int,
    *,
    any_case: tuple[bytes, ...] = (),
    span: int = 0,
) -> bool:
    """Whether ``pattern`` matches in ``buffer[start:end]``, tried only around each needle found
    (``any_case``: lowercase needles, found in a lowercased copy of the window). ``bytes.find``
    runs at GB/s where a pattern that starts with a look-behind would run at tens of MB/s."""
    span = max(span, OVERLAP)
    if _near(pattern, needles, buffer, buffer, 0, start, end, span):
        return True
    # bytes.lower folds ASCII only, as (?i) does on bytes.
    return bool(any_case) and _near(
        pattern, any_case, buffer, bytes(buffer[start:end]).lower(), start, start, end, span
    )


def _near(
    pattern: re.Pattern[bytes],
    needles: tuple[bytes, ...],
    buffer: bytes | bytearray,
    haystack: bytes | bytearray,
    base: int,
    start: int,
    end: int,
    span: int,
) -> bool:
    """``near_needles`` with the needles looked for in ``haystack``, which holds the bytes of
    ``buffer`` from offset ``base`` on (as they are or lowercased)."""
    for needle in needles:
        at = haystack.find(needle, start - base, end - base)
        while at >= 0:
            at += base
            # Look-behinds still see the bytes before the window: it starts inside the buffer.
            if pattern.search(buffer, max(0, at - BEFORE), min(end, at + span)) is not None:
                return True
            at = haystack.find(needle, at - base + 1, end - base)
    return False


# A word boundary: a look-around that asks only what the neighbouring character is (one
# character class). Dropped from the pattern searched in decoded bytes (``LeakKind.decoded``).
_BOUNDARY = re.compile(rb"\(\?<?!\[(?:\\.|[^\]\\])*\]\)")


def _kind(id: str, what: str, pattern: bytes, **fields: Any) -> LeakKind:  # noqa: A002 - the field's name
    return LeakKind(id, what, re.compile(pattern), re.compile(_BOUNDARY.sub(b"", pattern)), **fields)


# Invented filler for the examples.
_ALNUM = "Zq7Xw2Lm9Kp4Rt6Vb1Nc8Hd3Jf5Gs0Ty"
_HEX = "3f9a1c7e5b2d8f6a0c4e9b7d1a3f5c8e2b6d0a94"
_B64 = "u8Qz3LkP7mWx2Rt9Vb1Nc8Hd5Jf0Gs4Ty6Ea+Ko/Ui"
# Whitespace a PEM header may be split by: a line break in a card or a JSON string's "\n".
_GAP = rb"[ \t\r\n]{1,4}"

# Left context: a credential starts a word, so "task-…" or "xyzAKIA…" do not match.
KINDS: tuple[LeakKind, ...] = (
    _kind(
        "hf-token",
        "an hf_ token",
        rb"hf_[A-Za-z0-9]{30,}",
        needles=(b"hf_",),
        examples=("hf" + "_" + _ALNUM + "Qa",),
    ),
    _kind(
        "private-key",
        "a PEM private key",
        rb"-----(?:BEGIN|END)"
        + _GAP
        + rb"(?:[A-Z0-9]{2,10}"
        + _GAP
        + rb"){0,2}PRIVATE"
        + _GAP
        + rb"KEY-----",
        allowable=False,
        needles=(b"KEY-----",),
        examples=(
            "-----BEGIN " + "PRIVATE KEY-----",
            "-----BEGIN RSA " + "PRIVATE KEY-----",
            "-----BEGIN OPENSSH " + "PRIVATE KEY-----",
            "-----BEGIN ENCRYPTED " + "PRIVATE KEY-----",
            "-----BEGIN EC\n" + "PRIVATE\nKEY-----",
            "-----END " + "PRIVATE KEY-----",
        ),
    ),
    _kind(
        "hf-org-token",
        "an api_org_ token",
        rb"(?<![A-Za-z0-9_])api_org_[A-Za-z0-9]{30,}",
        needles=(b"api_org_",),
        examples=("api" + "_org_" + _ALNUM + "Qa",),
    ),
    _kind(
        "aws-key",
        "an AWS access key",
        rb"(?<![A-Z0-9])(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}(?![A-Z0-9])"
        rb"|(?i:aws_?secret_?access_?key)[\"']?\s*[:=]\s*[\"']?[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+])",
        needles=(b"AKIA", b"ASIA", b"ABIA", b"ACCA"),
        # The name in any case the pattern takes, with or without underscores.
        any_case=(b"ccess_key", b"ccesskey"),
        examples=(
            *(prefix + "Q7RTX2MZP4LKWN3D" for prefix in ("AK" + "IA", "AS" + "IA", "AB" + "IA", "AC" + "CA")),
            "aws_secret_access_key = " + _B64[:40],
            "AWS_SECRET_ACCESS_KEY=" + _B64[2:42],
            '"awsSecretAccessKey": "' + _B64[1:41] + '"',
            "Aws_Secret_Access_Key: " + _B64[:40],
        ),
    ),
    _kind(
        "github-token",
        "a GitHub token",
        rb"(?<![A-Za-z0-9_])(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})",
        needles=(b"ghp_", b"gho_", b"ghu_", b"ghs_", b"ghr_", b"github_pat_"),
        examples=(
            *("gh" + letter + "_" + _ALNUM + "a1B2" for letter in "pousr"),
            "github" + "_pat_" + "11ABCDEFG0" * 3 + "_" + _ALNUM,
        ),
    ),
    _kind(
        "anthropic-key",
        "an Anthropic API key",
        rb"(?<![A-Za-z0-9_-])sk-ant-[A-Za-z0-9_-]{32,}",
        needles=(b"sk-ant-",),
        examples=("sk" + "-ant-api03-" + _ALNUM * 3 + "AA", "sk" + "-ant-admin01-" + _ALNUM * 2),
    ),
    _kind(
        "openai-key",
        "an OpenAI API key",
        rb"(?<![A-Za-z0-9_-])sk-(?:(?:proj|svcacct|admin)-[A-Za-z0-9_-]{20,}|[A-Za-z0-9]{32,}"
        rb"|[A-Za-z0-9]{20}T3BlbkFJ[A-Za-z0-9]{20})",
        needles=(b"sk-",),
        examples=(
            *("sk" + f"-{scope}-" + _ALNUM + "Ab_cD-eF" for scope in ("proj", "svcacct", "admin")),
            "sk" + "-" + _ALNUM + "Ab3dEf6hIj9kLm2n",
            "sk" + "-" + _ALNUM[:20] + "T3Blbk" + "FJ" + _ALNUM[5:25],
        ),
    ),
    _kind(
        "slack-token",
        "a Slack token",
        rb"(?<![A-Za-z0-9])xox[abeoprs]-[A-Za-z0-9-]{10,}",
        needles=(b"xox",),
        examples=tuple(
            "xo" + "x" + letter + "-123456789012-1234567890123-" + _ALNUM[:24] for letter in "abeoprs"
        ),
    ),
    _kind(
        "google-api-key",
        "a Google API key",
        rb"(?<![A-Za-z0-9_-])AIza[0-9A-Za-z_-]{35}",
        needles=(b"AIza",),
        examples=("AI" + "za" + "SyD3" + "x7Yk_9-Qp2Lm4Nw6Rt8Zv0Bc1De3Fg5",),
    ),
    _kind(
        "stripe-key",
        "a Stripe secret key",
        rb"(?<![A-Za-z0-9_])[rs]k_(?:live|test)_[0-9A-Za-z]{20,}",
        needles=(b"k_live_", b"k_test_"),
        examples=tuple(f"{prefix}k_{mode}_" + _ALNUM for prefix in "sr" for mode in ("live", "test")),
    ),
    _kind(
        "gitlab-token",
        "a GitLab token",
        rb"(?<![A-Za-z0-9_-])gl(?:pat|dt|rt|ptt)-[0-9A-Za-z_.-]{20,}",
        needles=(b"glpat-", b"gldt-", b"glrt-", b"glptt-"),
        examples=tuple("gl" + f"{kind}-" + _ALNUM[:20] for kind in ("pat", "dt", "rt", "ptt")),
    ),
    _kind(
        "npm-token",
        "an npm token",
        rb"(?<![A-Za-z0-9_])npm_[A-Za-z0-9]{36}(?![A-Za-z0-9])",
        needles=(b"npm_",),
        examples=("np" + "m_" + _ALNUM + "Ab3d",),
    ),
    _kind(
        "sendgrid-key",
        "a SendGrid API key",
        rb"(?<![A-Za-z0-9_-])SG\.[A-Za-z0-9_-]{22}\.[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])",
        needles=(b"SG.",),
        examples=("S" + "G." + _ALNUM[:22] + "." + _ALNUM + "Ab_cD-eF9Kj",),
    ),
    _kind(
        "azure-key",
        "an Azure storage or service bus key",
        rb"(?:AccountKey|SharedAccessKey)\s*=\s*[A-Za-z0-9+/]{40,}={0,2}",
        needles=(b"AccountKey", b"AccessKey"),
        examples=(
            "DefaultEndpointsProtocol=https;AccountName=runs;Account" + "Key=" + _B64 * 2 + "==",
            "Endpoint=sb://runs.servicebus.windows.net/;SharedAccess" + "Key=" + _B64 + "=",
        ),
    ),
    _kind(
        "gcp-service-account",
        "a Google Cloud service account key",
        rb"private_key_id[\"']?\s*[:=]\s*[\"']?[0-9a-f]{40}(?![0-9a-f])",
        needles=(b"private_key_id",),
        examples=('"private' + '_key_id": "' + _HEX[:40] + '"',),
    ),
    # A password in a database URL; an environment placeholder ("${DB_PASSWORD}", "<password>",
    # "***") is not one. A URL's scheme is read in any case (RFC 3986), so it is matched so.
    _kind(
        "database-url",
        "a database URL with a password",
        rb"(?<![A-Za-z0-9+.-])(?i:postgres(?:ql)?|mysql|mariadb|mongodb(?:\+srv)?|rediss?|amqps?|mssql"
        rb"|sqlserver|clickhouse|cockroachdb|oracle)(?:\+[A-Za-z0-9_]+)?://[^\s:/@'\"<>]*"
        rb":(?!\$|<|\*)[^\s/@'\"<>]+@[A-Za-z0-9.-]+",
        needles=(b"://",),
        examples=(
            "postgresql" + "://trainer:" + "s3cr3t-Pw9" + "@db.example.com:5432/runs",
            "postgres" + "://user:" + "Pa55word-x" + "@host/db",
            "mysql+pymysql" + "://u:" + "Hunter2x" + "@10.0.0.7/db",
            "mongodb+srv" + "://app:" + "Xk9pQ2w" + "@cluster0.example.net/?retryWrites=true",
            "redis" + "://:" + "cachePw77" + "@cache:6379/0",
        ),
    ),
    _kind(
        "telegram-bot-token",
        "a Telegram bot token",
        rb"(?<![0-9])[0-9]{8,10}:AA[0-9A-Za-z_-]{33}(?![0-9A-Za-z_-])",
        needles=(b":AA",),
        examples=("123456789" + ":AA" + _ALNUM + "b",),
    ),
    _kind(
        "databricks-token",
        "a Databricks token",
        rb"(?<![A-Za-z0-9_])dapi[0-9a-f]{32}(?:-[0-9]+)?(?![0-9a-f])",
        needles=(b"dapi",),
        examples=("da" + "pi" + _HEX[:32], "da" + "pi" + _HEX[4:36] + "-2"),
    ),
    # A W&B key is 40 hex digits, like a git commit id: only with a W&B name in front of it
    # (WANDB_API_KEY=…, wandb.login(key=…), the api.wandb.ai entry of a .netrc).
    _kind(
        "wandb-key",
        "a W&B API key",
        rb"(?i:wandb[A-Za-z0-9_.]*(?:key|login|password)|api\.wandb\.ai)[\s\S]{0,80}?"
        rb"(?<![0-9A-Fa-f])[0-9a-f]{40}(?![0-9A-Fa-f])",
        needles=(),
        any_case=(b"andb",),
        examples=(
            "WANDB_API_" + "KEY=" + _HEX[:40],
            "wandb.login(key=" + '"' + _HEX[:40] + '")',
            "machine api.wandb" + ".ai\n  login user\n  password " + _HEX[:40] + "\n",
        ),
    ),
    _kind(
        "jwt",
        "a JSON Web Token",
        rb"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{16,}",
        needles=(b"eyJ",),
        examples=(
            "ey"
            + "JhbGciOiJIUzI1NiJ9"
            + "."
            + "ey"
            + "JzdWIiOiIxMjM0NTY3ODkwIn0"
            + "."
            + _ALNUM[:27]
            + "R8U",
        ),
    ),
)
# The host name can be a common word ("gpu" in a card): a file may allow it, never a path.
HOST_NAME = "host-name"
ALLOWABLE = frozenset([kind.id for kind in KINDS if kind.allowable] + [HOST_NAME])
