"""The leak scan's edges (pipeline.leaks): each credential format at the shortest value it claims
and one character short of it, at its word boundaries; this machine's rules as they are read from
the environment; the card.allow_leaks refusals word for word; a text file's encoding told at the
exact fractions of control characters and NUL bytes.

In-process tables: a slip in a quantifier, a boundary or a threshold fails an exact expectation on
one side of it. Values are built by concatenation: no file of the tree holds a credential.
"""

from __future__ import annotations

import base64

import pytest
from test_leaks import rules, scan_bytes

from pipeline.leaks import KINDS

WHAT = {kind.id: kind.what for kind in KINDS}
_ALNUM = "Zq7Xw2Lm9Kp4Rt6Vb1Nc8Hd3Jf5Gs0Ty" * 4
_UPPER = "Q7RTX2MZP4LKWN3DY8VB"
_HEX = "3f9a1c7e5b2d8f6a0c4e9b7d1a3f5c8e2b6d0a94" * 2
_B64 = "u8Qz3LkP7mWx2Rt9Vb1Nc8Hd5Jf0Gs4Ty6Ea+Ko/Ui"


def al(n: int) -> str:
    return _ALNUM[:n]


def hx(n: int) -> str:
    return _HEX[:n]


def sendgrid(first: int, second: int) -> str:
    return "S" + "G." + al(first) + "." + al(second)


def telegram(digits: int, rest: int) -> str:
    return "1234567890123"[:digits] + ":A" + "A" + (al(30) + "_-xyz")[:rest]


def jwt(header: int, claims: int, signature: int) -> str:
    return "ey" + "J" + al(header) + ".ey" + "J" + al(claims) + "." + al(signature)


# (kind, found, value): each written alone on a line of a text file, between spaces; a value not
# found is a near miss of the kind, and no other kind may be found in it either.
EDGES = [
    # hf_: 30 characters on, glued to anything before it.
    ("hf-token", True, "hf" + "_" + al(30)),
    ("hf-token", False, "hf" + "_" + al(29)),
    ("hf-token", True, "my" + "hf" + "_" + al(30)),
    # A PEM header: up to 4 blanks between words, up to 2 words of 2 to 10 characters before PRIVATE.
    ("private-key", True, "-----BEGIN    ABCDEFGHIJ\t\t\t\tXY\r\n\r\nPRIVATE    KEY" + "-----"),
    ("private-key", True, "-----END AB " + "PRIVATE KEY-----"),
    ("private-key", False, "-----BEGIN     " + "PRIVATE KEY-----"),
    ("private-key", False, "-----BEGIN" + "PRIVATE KEY-----"),
    ("private-key", False, "-----BEGIN ABCDEFGHIJK " + "PRIVATE KEY-----"),
    ("private-key", False, "-----BEGIN A " + "PRIVATE KEY-----"),
    ("private-key", False, "-----BEGIN AB CD EF " + "PRIVATE KEY-----"),
    ("private-key", False, "----BEGIN " + "PRIVATE KEY-----"),
    ("private-key", False, "-----BEGIN " + "PRIVATE KEY----"),
    ("private-key", False, "-----begin " + "private key-----"),
    # api_org_: 30 characters on, starting a word.
    ("hf-org-token", True, "api" + "_org_" + al(30)),
    ("hf-org-token", True, "-api" + "_org_" + al(30)),
    ("hf-org-token", False, "api" + "_org_" + al(29)),
    ("hf-org-token", False, "x" + "api" + "_org_" + al(30)),
    ("hf-org-token", False, "_" + "api" + "_org_" + al(30)),
    # An access key id: exactly 16 capitals or digits after its prefix, not inside a longer one.
    *(("aws-key", True, prefix + _UPPER[:16]) for prefix in ("AK" + "IA", "AS" + "IA", "AB" + "IA", "AC" + "CA")),
    ("aws-key", False, "AK" + "IA" + _UPPER[:15]),
    ("aws-key", False, "AK" + "IA" + _UPPER[:17]),
    ("aws-key", False, "X" + "AK" + "IA" + _UPPER[:16]),
    ("aws-key", False, "9" + "AK" + "IA" + _UPPER[:16]),
    ("aws-key", False, "AK" + "IA" + _UPPER[:15] + "q"),
    ("aws-key", False, "AZ" + "IA" + _UPPER[:16]),
    # A secret access key: exactly 40 base64 characters after the name, quoted or not.
    ("aws-key", True, "aws_secret_access_key = " + _B64[:40]),
    ("aws-key", True, "AWS_SECRET_ACCESS_KEY:" + _B64[1:41]),
    ("aws-key", True, "aws_secret_access_key='" + _B64[2:42] + "'"),
    ("aws-key", False, "aws_secret_access_key = " + _B64[:39]),
    ("aws-key", False, "aws_secret_access_key = " + _B64[:41]),
    # GitHub: 36 characters after gh?_, 22 after github_pat_ (underscores included).
    *(("github-token", True, "gh" + letter + "_" + al(36)) for letter in "pousr"),
    ("github-token", False, "gh" + "p_" + al(35)),
    ("github-token", False, "gh" + "a_" + al(36)),
    ("github-token", False, "x" + "gh" + "p_" + al(36)),
    ("github-token", False, "_" + "gh" + "p_" + al(36)),
    ("github-token", True, "github" + "_pat_" + al(10) + "_" + al(11)),
    ("github-token", False, "github" + "_pat_" + al(21)),
    # Anthropic: 32 characters after sk-ant-.
    ("anthropic-key", True, "sk" + "-ant-" + al(16) + "_-" + al(14)),
    ("anthropic-key", False, "sk" + "-ant-" + al(31)),
    ("anthropic-key", False, "x-" + "sk" + "-ant-" + al(32)),
    # OpenAI: 20 after a scope, 32 bare.
    *(("openai-key", True, "sk" + f"-{scope}-" + al(20)) for scope in ("proj", "svcacct", "admin")),
    ("openai-key", False, "sk" + "-proj-" + al(19)),
    ("openai-key", True, "sk" + "-" + al(32)),
    ("openai-key", False, "sk" + "-" + al(31)),
    ("openai-key", False, "task" + "-" + al(32)),
    # Slack: 10 after xox?-, starting a word.
    *(("slack-token", True, "xo" + "x" + letter + "-" + al(10)) for letter in "abeoprs"),
    ("slack-token", False, "xo" + "xb-" + al(9)),
    ("slack-token", False, "xo" + "xc-" + al(10)),
    ("slack-token", False, "a" + "xo" + "xb-" + al(10)),
    # Google: exactly 35 after AIza.
    ("google-api-key", True, "AI" + "za" + al(33) + "_-"),
    ("google-api-key", False, "AI" + "za" + al(34)),
    ("google-api-key", False, "-" + "AI" + "za" + al(35)),
    # Stripe: 20 after sk_/rk_ and the mode; not a publishable pk_ key.
    *(("stripe-key", True, f"{prefix}k_{mode}_" + al(20)) for prefix in "sr" for mode in ("live", "test")),
    ("stripe-key", False, "sk" + "_live_" + al(19)),
    ("stripe-key", False, "pk" + "_live_" + al(20)),
    ("stripe-key", False, "x" + "sk" + "_live_" + al(20)),
    # GitLab: 20 after the prefix.
    *(("gitlab-token", True, "gl" + f"{kind}-" + al(18) + "._") for kind in ("pat", "dt", "rt", "ptt")),
    ("gitlab-token", False, "gl" + "pat-" + al(19)),
    ("gitlab-token", False, "-" + "gl" + "pat-" + al(20)),
    # npm: exactly 36.
    ("npm-token", True, "np" + "m_" + al(36)),
    ("npm-token", False, "np" + "m_" + al(35)),
    ("npm-token", False, "np" + "m_" + al(37)),
    ("npm-token", False, "x" + "np" + "m_" + al(36)),
    # SendGrid: exactly 22 and 43.
    ("sendgrid-key", True, sendgrid(22, 43)),
    ("sendgrid-key", False, sendgrid(21, 43)),
    ("sendgrid-key", False, sendgrid(23, 43)),
    ("sendgrid-key", False, sendgrid(22, 42)),
    ("sendgrid-key", False, sendgrid(22, 44)),
    # Azure: 40 base64 characters on, blanks around "=".
    ("azure-key", True, "Account" + "Key=" + _B64[:40]),
    ("azure-key", True, "SharedAccess" + "Key = " + _B64[:40] + "=="),
    ("azure-key", False, "Account" + "Key=" + _B64[:39]),
    # A service account key id: exactly 40 lower-case hex digits.
    ("gcp-service-account", True, '"private' + '_key_id": "' + hx(40) + '"'),
    ("gcp-service-account", True, "private" + "_key_id=" + hx(40)),
    ("gcp-service-account", False, '"private' + '_key_id": "' + hx(39) + '"'),
    ("gcp-service-account", False, '"private' + '_key_id": "' + hx(41) + '"'),
    ("gcp-service-account", False, '"private' + '_key_id": "' + hx(40).upper() + '"'),
    # A database URL: a password that is one (not empty, not a placeholder) and a host after it.
    ("database-url", True, "postgres" + "://u:p@h"),
    ("database-url", True, "mysql+pymysql" + "://:pw@db.example"),
    ("database-url", False, "postgres" + "://u:@h"),
    ("database-url", False, "postgres" + "://u:p@"),
    ("database-url", False, "postgres" + "://u:$PW@h"),
    ("database-url", False, "mysql" + "://u:***@h"),
    ("database-url", False, "mysql" + "://u:<pw>@h"),
    ("database-url", False, "xpostgres" + "://u:p@h"),
    ("database-url", False, "postgres" + "://u:p/q@h"),
    # Telegram: 8 to 10 digits, :AA, exactly 33 more.
    ("telegram-bot-token", True, telegram(8, 33)),
    ("telegram-bot-token", True, telegram(10, 33)),
    ("telegram-bot-token", False, telegram(7, 33)),
    ("telegram-bot-token", False, telegram(11, 33)),
    ("telegram-bot-token", False, telegram(9, 32)),
    ("telegram-bot-token", False, telegram(9, 34)),
    # Databricks: exactly 32 lower-case hex digits, a -N suffix allowed.
    ("databricks-token", True, "da" + "pi" + hx(32)),
    ("databricks-token", True, "da" + "pi" + hx(32) + "-12"),
    ("databricks-token", False, "da" + "pi" + hx(31)),
    ("databricks-token", False, "da" + "pi" + hx(33)),
    ("databricks-token", False, "da" + "pi" + hx(32).upper()),
    ("databricks-token", False, "x" + "da" + "pi" + hx(32)),
    # W&B: 40 lower-case hex digits at most 80 characters after a W&B name.
    ("wandb-key", True, "WANDB_API_" + "KEY=" + hx(40)),
    ("wandb-key", True, "wandb" + "_key" + " " * 80 + hx(40)),
    ("wandb-key", True, "machine api.wandb" + ".ai\npassword " + hx(40)),
    ("wandb-key", False, "wandb" + "_key" + " " * 81 + hx(40)),
    ("wandb-key", False, "WANDB_API_" + "KEY=" + hx(39)),
    ("wandb-key", False, "WANDB_API_" + "KEY=" + hx(41)),
    ("wandb-key", False, "WANDB_API_" + "KEY=" + hx(40).upper()),
    # A JSON Web Token: 10, 10 and 16 characters on.
    ("jwt", True, jwt(10, 10, 16)),
    ("jwt", False, jwt(9, 10, 16)),
    ("jwt", False, jwt(10, 9, 16)),
    ("jwt", False, jwt(10, 10, 15)),
    ("jwt", False, "x" + jwt(10, 10, 16)),
]


@pytest.mark.parametrize("kind", sorted(WHAT))
def test_each_format_is_found_from_its_shortest_value_on_and_not_one_character_short_of_it(kind):
    """Each case of ``kind`` in EDGES, written as it is and, for one that must be found,
    base64-encoded (searched with the pattern without its word boundaries)."""
    rule_set = rules(hostname="")
    cases = [(found, value) for of, found, value in EDGES if of == kind]
    assert {found for found, _ in cases} == {True, False}, kind  # both sides of the edges
    for expected, value in cases:
        found = scan_bytes(f"x = {value} .\n", rule_set)
        assert found == ({kind: WHAT[kind]} if expected else {}), (value, found)
        if expected:
            encoded = base64.b64encode(value.encode()).decode()
            assert scan_bytes(f"x = {encoded} .\n", rule_set) == {kind: f"{WHAT[kind]} (base64-encoded)"}, value
