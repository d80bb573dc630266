"""The leak scan's edges (pipeline.leaks): each credential format at the shortest value it claims
and one character short of it, at its word boundaries; this machine's rules as they are read from
the environment; the card.allow_leaks refusals word for word; a text file's encoding told at the
exact fractions of control characters and NUL bytes.

In-process tables: a slip in a quantifier, a boundary or a threshold fails an exact expectation on
one side of it. Values are built by concatenation: no file of the tree holds a credential.
"""

from __future__ import annotations

import base64
import json

import pytest
from huggingface_hub import constants
from test_leaks import rules, scan_bytes

from pipeline.errors import ConfigError, SecretInStage
from pipeline.leaks import KINDS, FileScan, allowance_problem, leak_rules, refuse_findings, scan_secrets
from pipeline.leaks.encodings import text_encoding
from pipeline.leaks.views import encoded_runs, reader_view
from pipeline.safetensors_header import DTYPE_SIZES

from support import REPO

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
    *(
        ("aws-key", True, prefix + _UPPER[:16])
        for prefix in ("AK" + "IA", "AS" + "IA", "AB" + "IA", "AC" + "CA")
    ),
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
    *(
        ("aws-key", True, name + "=" + _B64[:40])
        for name in (
            "awssecretaccesskey",
            "AWSSECRETACCESSKEY",
            "Aws_Secret_Access_Key",
            "AwsSecretAccessKey",
        )
    ),
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
    ("openai-key", True, "sk" + "-learn" + " " * 1100 + "sk" + "-" + al(32)),
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
    # A driver after the +srv of an Atlas scheme: both suffixes.
    ("database-url", True, "mongodb+srv+motor" + "://u:p@h"),
    # A scheme in capitals is the same scheme.
    ("database-url", True, "MONGODB+SRV" + "://u:p@h"),
    ("database-url", True, "PostgreSQL" + "://u:p@h"),
    # A driver in any case, its scheme and driver 19 bytes before the "://" looked for first.
    ("database-url", True, "PostgreSQL+PsyCopg2" + "://u:p@h"),
    # A capital before the scheme is a letter of a longer one.
    ("database-url", False, "XPOSTGRES" + "://u:p@h"),
    ("database-url", False, "postgres" + "://u:@h"),
    ("database-url", False, "postgres" + "://u:p@"),
    ("database-url", False, "postgres" + "://u:$PW@h"),
    ("database-url", False, "mysql" + "://u:***@h"),
    ("database-url", False, "mysql" + "://u:<pw>@h"),
    ("database-url", False, "xpostgres" + "://u:p@h"),
    ("database-url", False, "postgres" + "://u:p/q@h"),
    # Each needle found is tried, not only the first: "://" of another URL a window before it.
    ("database-url", True, "https" + "://example.com/" + " " * 1100 + "postgres" + "://u:p@h"),
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
    """Each case of ``kind`` in EDGES, written as it is and, for one that must be found, as the
    whole file and base64-encoded (searched with the pattern without its word boundaries)."""
    rule_set = rules(hostname="")
    cases = [(found, value) for of, found, value in EDGES if of == kind]
    assert {found for found, _ in cases} == {True, False}, kind  # both sides of the edges
    for expected, value in cases:
        found = scan_bytes(f"x = {value} .\n", rule_set)
        assert found == ({kind: WHAT[kind]} if expected else {}), (value, found)
        if expected:  # the whole file too: from offset 0 to the end of the file
            assert scan_bytes(value, rule_set) == {kind: WHAT[kind]}, value
            encoded = base64.b64encode(value.encode()).decode()
            assert scan_bytes(f"x = {encoded} .\n", rule_set) == {kind: f"{WHAT[kind]} (base64-encoded)"}, (
                value
            )


# -- this machine's rules ------------------------------------------------------------------------

# The environment variables whose values are secrets wherever they appear.
SECRET_NAMES = [
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
]


@pytest.fixture
def no_saved_login(tmp_path, monkeypatch):
    """The saved login's files, at paths of this test (none written yet)."""
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "stored_tokens"))
    return tmp_path


def test_every_secret_variable_and_saved_token_is_searched_from_8_characters_on_named_by_where_it_came_from(
    no_saved_login,
):
    for name in SECRET_NAMES:
        assert leak_rules({name: "  Ab3dEf6h\n"}).secrets == ((b"Ab3dEf6h", f"the value of {name}"),), name
        assert leak_rules({name: "Ab3dEf6"}).secrets == (), name  # 7 characters: found by chance in weights
    # One value under two names is named by the first; a saved token by where it was saved.
    (no_saved_login / "token").write_text("saved-login-token\n")
    (no_saved_login / "stored_tokens").write_text(
        "[work]\nhf_token = stored-work-token\n\n[same]\nhf_token = Ab3dEf6h-shared\n\n[short]\nhf_token = abc\n"
    )
    saved = "a token saved by `hf auth login`"
    assert leak_rules({"HF_TOKEN": "Ab3dEf6h-shared", "GH_TOKEN": "Ab3dEf6h-shared"}).secrets == (
        (b"Ab3dEf6h-shared", "the value of HF_TOKEN"),
        (b"saved-login-token", saved),
        (b"stored-work-token", saved),
    )
    # A saved token that is not UTF-8 text is no token (not a crash); a stored_tokens file that is
    # not an INI file: the saved token is still searched.
    (no_saved_login / "token").write_bytes(b"\xff\xfesaved-login-token")
    assert leak_rules({"HF_TOKEN": "Ab3dEf6h"}).secrets == (
        (b"Ab3dEf6h", "the value of HF_TOKEN"),
        (b"stored-work-token", saved),
        (b"Ab3dEf6h-shared", saved),
    )
    (no_saved_login / "token").write_text("saved-login-token\n")
    (no_saved_login / "stored_tokens").write_text("hf_token = no section header\n")
    assert leak_rules({}).secrets == ((b"saved-login-token", saved),)


def test_this_machines_paths_are_its_absolute_folders_and_its_host_name_any_but_localhost(no_saved_login):
    checkout = (str(REPO.resolve()).encode(), "this checkout's absolute path")
    assert leak_rules({}, home="/home/alice/", cwd="/srv/runs/../jobs", hostname=" Node-7 ").machine == (
        (b"/home/alice", "the home folder's path"),
        (b"/srv/jobs", "the working folder's absolute path"),
        checkout,
        (b"Node-7", "the host name"),
    )
    # The root, a relative path and an empty one name no folder; the same one twice, once.
    for home, cwd in (("/", "relative/dir"), ("", "//"), ("/home/alice", "/home/alice/")):
        expected = ((b"/home/alice", "the home folder's path"),) if home == "/home/alice" else ()
        assert leak_rules({}, home=home, cwd=cwd, hostname="").machine == (*expected, checkout), (home, cwd)
    for anonymous in ("localhost", "LocalHost", "localhost.localdomain", " ", ""):
        assert leak_rules({}, home="/", cwd="/", hostname=anonymous).machine == (checkout,), anonymous


def test_a_home_folder_spelled_with_a_leading_double_slash_is_found_in_either_spelling(no_saved_login):
    """POSIX keeps a path's leading "//": HOME=//home/alice is /home/alice, which tools write."""
    machine = leak_rules({}, home="//home/alice", cwd="/", hostname="")
    assert machine.machine[0] == (b"/home/alice", "the home folder's path")
    for written in ("/home/alice/runs/a.txt", "//home/alice/runs/a.txt"):
        assert scan_bytes(f"data in {written}\n", machine) == {"path": "the home folder's path"}, written


# Each written alone on a line (or as the whole file), with this machine's home folder
# /home/alice and host name gpu-node-7: found where it is not part of a longer name.
WHOLE_WORDS = {
    "/home/alice": "path",
    "/home/alice/runs/a.txt": "path",
    "(/home/alice).": "path",
    "'/home/alice':": "path",
    "~/home/alice": "path",
    "/home/alicette": None,
    "/home/alice-2": None,
    "/home/alice_old": None,
    "/mnt/home/alice": None,
    "gpu-node-7": "host-name",
    "GPU-Node-7.corp": "host-name",
    "(gpu-node-7)": "host-name",
    "gpu-node-70": None,
    "gpu-node-7b": None,
    "gpu-node-7_x": None,
    "my-gpu-node-7": None,
    "a.gpu-node-7": None,
}


def test_this_machines_path_and_host_name_count_only_as_whole_names_anywhere_in_a_text_file(no_saved_login):
    machine = leak_rules({}, home="/home/alice", cwd="/", hostname="gpu-node-7")
    words = {"path": "the home folder's path", "host-name": "the host name"}
    for text, kind in WHOLE_WORDS.items():
        expected = {kind: words[kind]} if kind else {}
        for written in (text, f"saved at {text}\n", f"# log\n{text}"):
            assert scan_bytes(written, machine) == expected, (written, kind)
    # A host name given in capitals is found in any case; a path only as written.
    machine = leak_rules({}, home="/home/Alice", cwd="/", hostname="GPU-Node-7")
    assert scan_bytes("ran on gpu-node-7 and GPU-NODE-7\n", machine) == {"host-name": "the host name"}
    assert scan_bytes("/home/alice and /HOME/ALICE\n", machine) == {}
    # A UTF-16 string inside a UTF-8 text file (a NUL every other byte) is read for credentials.
    wide = b"# notes\n" * 40 + f"token {HF}".encode("utf-16-le") + b"\n"
    assert scan_bytes(wide, machine) == {"hf-token": "an hf_ token (UTF-16)"}


# -- card.allow_leaks and the refusal ------------------------------------------------------------

ALLOWABLE_KINDS = ", ".join(sorted([kind.id for kind in KINDS if kind.id != "private-key"] + ["host-name"]))


@pytest.mark.parametrize(
    "allow, problem",
    [
        (["README.md"], "must map a staged file to the kinds it may hold, e.g. {README.md: [jwt]}"),
        ({"": ["jwt"]}, "names '', which is not a relative path of a staged file such as 'README.md'"),
        (
            {"/etc/x": ["jwt"]},
            "names '/etc/x', which is not a relative path of a staged file such as 'README.md'",
        ),
        (
            {"a/../b": ["jwt"]},
            "names 'a/../b', which is not a relative path of a staged file such as 'README.md'",
        ),
        ({3: ["jwt"]}, "names 3, which is not a relative path of a staged file such as 'README.md'"),
        ({"README.md": "jwt"}, "gives README.md 'jwt', which is not a non-empty list of kinds"),
        ({"README.md": []}, "gives README.md [], which is not a non-empty list of kinds"),
        ({"README.md": ["jwt", 3]}, "gives README.md ['jwt', 3], which is not a non-empty list of kinds"),
        *(
            (
                {"docs/a..b.md": ["host-name", never]},
                f"allows {never!r} in docs/a..b.md, which is not a kind that may be allowed (one of "
                f"{ALLOWABLE_KINDS}); tokens of this machine, private keys and paths never are",
            )
            for never in ("private-key", "secret", "path", "JWT")
        ),
        ({}, None),
        ({"docs/a..b.md": ["host-name", "jwt"], "README.md": ["aws-key"]}, None),
    ],
)
def test_a_malformed_allow_leaks_is_refused_naming_the_entry_and_what_it_may_be(tmp_path, allow, problem):
    assert allowance_problem(allow) == problem
    if problem is not None:
        with pytest.raises(ConfigError) as caught:
            scan_secrets(tmp_path, rules(hostname=""), allow=allow)
        assert str(caught.value) == f"card.allow_leaks {problem}"


def test_the_refusal_names_each_kind_in_the_tables_order_and_offers_allow_leaks_only_where_every_kind_may_be():
    found = {
        "a.md": {
            "host-name": "the host name",
            "path": "the working folder's absolute path",
            "jwt": "a JSON Web Token",
            "secret": "the value of HF_TOKEN (hex-encoded)",
            "hf-token": "an hf_ token",
        }
    }
    with pytest.raises(SecretInStage) as caught:
        refuse_findings(found, consequence="nothing was sent")
    assert str(caught.value) == (
        "a.md holds the value of HF_TOKEN (hex-encoded), an hf_ token, a JSON Web Token, the working "
        "folder's absolute path and the host name; nothing was sent. Remove it from where it came from "
        "(config card section, data, task sample, code, edits to the stage) and stage again"
    )
    # Allowed kinds are returned; a kind that may never be allowed is refused even if listed.
    found = {
        "a.md": {"jwt": "a JSON Web Token", "hf-token": "an hf_ token"},
        "b.md": {"jwt": "a JSON Web Token"},
    }
    assert refuse_findings(found, {"a.md": ["hf-token", "jwt"], "b.md": ["jwt"]}) == [
        ("a.md", "an hf_ token"),
        ("a.md", "a JSON Web Token"),
        ("b.md", "a JSON Web Token"),
    ]
    with pytest.raises(SecretInStage) as caught:
        refuse_findings(found, {"a.md": ["jwt"]})
    assert str(caught.value) == (
        "a.md holds an hf_ token; b.md holds a JSON Web Token; nothing was staged. Remove it from where it "
        "came from (config card section, data, task sample, code, edits to the stage) and stage again; if "
        "it is not a secret (a documented example), allow it per file in the config: card.allow_leaks: "
        "{a.md: [hf-token], b.md: [jwt]} (docs/publishing.md)"
    )
    with pytest.raises(SecretInStage, match=r"^a\.md holds a PEM private key; nothing was staged\. Remove"):
        refuse_findings({"a.md": {"private-key": "a PEM private key"}}, {"a.md": ["private-key"]})


# -- how a file's text is told -----------------------------------------------------------------


def utf32le(ascii_count: int, astral: int = 0, low_nul: int = 0) -> bytes:
    """16 characters of UTF-32LE without a byte order mark: ``astral`` of them above U+FFFF (a
    byte in the third lane), ``low_nul`` with a NUL low byte (U+0100), the rest ASCII."""
    assert ascii_count + astral + low_nul == 16
    return ("a" * ascii_count + "\U00010041" * astral + "\u0100" * low_nul).encode("utf-32-le")


@pytest.mark.parametrize(
    "probe, encoding",
    [
        # Control characters and undecodable bytes: 1% of the probe at most.
        (b"a" * 990 + b"\x01" * 10, "utf-8"),
        (b"a" * 989 + b"\x01" * 11, None),
        (b"a" * 989 + b"\x7f" * 11, None),
        (b"a" * 990 + b"\xff" * 10, "utf-8"),
        (b"a" * 989 + b"\xff" * 11, None),
        (b"\t\n\v\f\r\x1b[0m" * 100, "utf-8"),
        # NUL bytes: half the probe at most.
        (b"a" * 500 + b"\0" * 500, "utf-8"),
        (b"a" * 499 + b"\0" * 501, None),
        # Wide text without a byte order mark, from 16 bytes on.
        ("abcdef".encode("utf-16-le"), "utf-8"),
        ("abcdefgh".encode("utf-16-le"), "utf-16-le"),
        ("abcdefgh".encode("utf-16-be"), "utf-16-be"),
        ("abcdefgh".encode("utf-16-le") + b"\0", "utf-16-le"),  # bytes past the last group of 4 not counted
        ("abcd".encode("utf-32-be"), "utf-32-be"),
        (utf32le(14, astral=2), "utf-32-le"),  # 7 of 8 NULs in the third lane
        (utf32le(13, astral=3), None),
        (utf32le(15, low_nul=1), "utf-32-le"),  # 1 of 16 NULs in the first lane
        (utf32le(14, low_nul=2), None),
        (("a\u0141" * 4 + "ab" * 4).encode("utf-16-le"), "utf-16-le"),  # half the high bytes NUL
        (("a\u0141" * 5 + "ab" * 3).encode("utf-16-le"), None),
        # A byte order mark: the codec that reads it (UTF-32LE's starts with UTF-16LE's).
        ("x".encode("utf-32"), "utf-32"),
        ("x".encode("utf-32-be").join([b"\0\0\xfe\xff", b""]), "utf-32"),
        ("x".encode("utf-16"), "utf-16"),
        (b"\xfe\xff" + "x".encode("utf-16-be"), "utf-16"),
    ],
    ids=lambda value: f"{len(value)} bytes" if isinstance(value, bytes) else str(value),
)
def test_a_files_text_encoding_is_told_at_the_exact_fractions_of_its_bytes(probe, encoding):
    assert text_encoding(probe) == encoding


# -- what a reader sees ------------------------------------------------------------------------

ESCAPES = [
    # \u: 4 hex digits; \U: 8; \u{}: 1 to 6; \x: 2; octal: 1 to 3 (a byte; above \377 a character).
    (b"\\u005F\\u005fx", b"__x", ("escaped",)),
    (b"\\u05f", b"\\u05f", ()),
    (b"\\U0000005F", b"_", ("escaped",)),
    (b"\\U000005F", b"\\U000005F", ()),
    (b"\\u{10ffff}\\u{5f}", "\U0010ffff_".encode(), ("escaped",)),
    (b"\\x5F\\x5", b"_\\x5", ("escaped",)),
    (b"\\150\\1500\\7", b"hh0\x07", ("escaped",)),
    (b"\\377\\400", b"\xff\xc4\x80", ("escaped",)),
    (b"a\\nb\\rc\\td\\\\u0068\\/\\\"\\'", b"a\nb\rc\td\\u0068/\"'", ("escaped",)),
    # Character references: 1 to 16 digits, ";" or not; a named one with its ";".
    (b"&#x5F;&#X5f&#95;&#95", b"____", ("escaped",)),
    (b"&#x000000000000005f;&#0000000000000095;", b"__", ("escaped",)),
    (b"&lowbar;&lowbar", b"_&lowbar", ("escaped",)),
    # No such character: nothing (not a crash); a lone surrogate as a JSON writer escapes it.
    (b"a&#x110000;b&#99999999999;c\\U00110000d", b"abcd", ("escaped",)),
    (b"\\ud83d\\ude00", b"\xed\xa0\xbd\xed\xb8\x80", ("escaped",)),
    # URL-encoding, escapes, then invisible characters, each said once.
    (
        b"%5f%5F\\x5f\xe2\x80\x8b%E2%80%8B\\u200b!",
        b"___!",
        ("URL-encoded", "escaped", "split by invisible characters"),
    ),
    (b"100% sure, 5%, %zz, %5 off", b"100% sure, 5%, %zz, %5 off", ()),
    (b"%5f%5 off", b"_%5 off", ("URL-encoded",)),
]


@pytest.mark.parametrize("text, view, changes", ESCAPES)
def test_a_reader_sees_each_escape_at_its_exact_length_and_nothing_else(text, view, changes):
    assert reader_view(text) == (view, changes)


def test_a_token_after_an_escaped_line_break_starts_a_word_for_a_reader():
    npm = "np" + "m_" + al(36)  # a word boundary before it: written after "\n" only its reader sees it
    for escape in ("\\n", "\\t", "\\r"):
        found = scan_bytes(f'{{"note": "line one{escape}{npm}"}}\n', rules(hostname=""))
        assert found == {"npm-token": "an npm token (escaped)"}, escape


def test_base64_and_hex_runs_are_decoded_from_16_and_24_characters_on():
    assert encoded_runs(b"x " + base64.b64encode(b"ABCDEFGHIJKL") + b" y")[0].count(b"ABCDEFGHIJKL") >= 1
    assert encoded_runs(b"x " + base64.b64encode(b"ABCDEFGHIJKL")[:15] + b" y") == (b"", b"")
    assert encoded_runs(b"x " + b"ABCDEFGHIJKL".hex().encode() + b" y")[1].count(b"ABCDEFGHIJKL") >= 1
    assert encoded_runs(b"x " + b"ABCDEFGHIJKL".hex().encode()[:23] + b" y")[1] == b""
    # A run of an odd length (a hex digit glued after it) is completed to whole bytes, not refused;
    # the runs after it keep their own alignment.
    odd = b"ABCDEFGHIJKL".hex().encode() + b"f"
    decoded = encoded_runs(b"x " + odd + b" y " + b"MNOPQRSTUVWX".hex().encode())[1]
    at_lead_0, at_lead_1 = decoded.split(b"\n\0\n")
    assert at_lead_0 == b"ABCDEFGHIJKL\xf0\0MNOPQRSTUVWX"
    assert at_lead_1 == bytes.fromhex("0" + odd.decode() + "0" + "00" + b"MNOPQRSTUVWX".hex() + "0")


def test_a_long_secret_url_encoded_across_a_read_seam_is_found_wherever_the_seam_cuts_it():
    """URL-encoding triples a value: the text kept across a seam holds three times the longest."""
    value = ("plain-" + _HEX * 5)[:400]
    encoded = "".join(f"%{byte:02X}" for byte in value.encode()).encode()  # 1200 characters
    rule_set = rules(environ={"HF_TOKEN": value}, hostname="")
    for cut in (1, 600, 1100, 1199):
        text = b"x " * 2048 + encoded + b" tail\n"
        boundary = 4096 + cut
        scan = FileScan(rule_set, size=len(text))
        for piece in (text[:boundary], text[boundary:]):
            scan.feed(piece, len(piece))
        assert scan.found == {"secret": "the value of HF_TOKEN (URL-encoded)"}, cut


# -- how a finding was written, in words -----------------------------------------------------------

HF = "hf" + "_" + al(34)
VALUE = "plain-" + hx(18)  # this machine's HF_TOKEN
_NOISE = bytes(range(128, 256)) * 4  # binary bytes, no printable run


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


WRITTEN_AS = [
    (("x " + HF).encode("utf-16"), "an hf_ token (UTF-16)"),
    (("x " + HF).encode("utf-32-be"), "an hf_ token (UTF-32)"),
    (("x hf%5F" + HF[3:]).encode("utf-16"), "an hf_ token (UTF-16, URL-encoded)"),
    (("x " + _b64(HF)).encode("utf-16"), "an hf_ token (UTF-16, base64-encoded)"),
    (("x " + HF.encode().hex()).encode("utf-16"), "an hf_ token (UTF-16, hex-encoded)"),
    (_NOISE + HF.encode() + _NOISE, "an hf_ token"),
    (_NOISE + HF.encode("utf-16-le") + _NOISE, "an hf_ token (UTF-16)"),
    (_NOISE + HF.encode("utf-32-be") + _NOISE, "an hf_ token (UTF-32)"),
    (
        _NOISE + b"".join(ord(c).to_bytes(8, "little") for c in HF) + _NOISE,
        "an hf_ token (8 bytes a character)",
    ),
    (_NOISE + _b64(HF).encode() + _NOISE, "an hf_ token (base64-encoded)"),
    (_NOISE + _b64(HF).encode("utf-16-le") + _NOISE, "an hf_ token (UTF-16, base64-encoded)"),
    (_NOISE + b"hf%5F" + HF[3:].encode() + _NOISE, "an hf_ token (URL-encoded)"),
    (("x " + _b64(HF.encode("utf-16-le")) + "\n").encode(), "an hf_ token (base64-encoded, UTF-16)"),
    (("x " + HF.encode("utf-32-le").hex() + "\n").encode(), "an hf_ token (hex-encoded, UTF-32)"),
    (("x " + _b64(VALUE) + "\n").encode(), "the value of HF_TOKEN (base64-encoded)"),
    (("x " + VALUE.encode().hex().upper()).encode("utf-16"), "the value of HF_TOKEN (UTF-16, hex-encoded)"),
    (_NOISE + VALUE.encode("utf-32-le") + _NOISE, "the value of HF_TOKEN (UTF-32)"),
    # A base64 run is decoded as a reader sees it: one invisible character does not cut it in two.
    (("x " + _b64(HF)[:24] + "\u200b" + _b64(HF)[24:] + "\n").encode(), "an hf_ token (base64-encoded)"),
]


@pytest.mark.parametrize(
    "data, words", WRITTEN_AS, ids=[f"{n}: {words}" for n, (_, words) in enumerate(WRITTEN_AS)]
)
def test_a_finding_says_every_way_its_value_was_written_in_order(data, words):
    kind = "secret" if words.startswith("the value") else "hf-token"
    assert scan_bytes(data, rules(environ={"HF_TOKEN": VALUE}, hostname="")) == {kind: words}


@pytest.mark.parametrize("dtype, size", sorted(DTYPE_SIZES.items()))
def test_only_floating_point_tensors_are_numbers_that_no_token_format_is_searched_in(dtype, size):
    """A tensor whose bytes spell an hf_ token: chance in floats of any width (BF16 and FP8
    too), a token anywhere else (an integer or boolean tensor holds what was put there)."""
    payload = (HF + "!" * 48).encode()[:48]
    header = json.dumps({"t": {"dtype": dtype, "shape": [48 // size], "data_offsets": [0, 48]}}).encode()
    header += b" " * (-len(header) % 8)
    data = len(header).to_bytes(8, "little") + header + payload
    floats = dtype.startswith(("F", "BF"))
    assert scan_bytes(data, rules(hostname="")) == ({} if floats else {"hf-token": "an hf_ token"})


# -- the reads themselves: a reused buffer, short reads, the probe's extent, links and empty files ----


def test_a_reused_buffer_read_short_is_searched_only_up_to_what_each_read_filled():
    """The audit reads into one buffer again and again; a read may fill less of it (a pipe, a
    network file system): the seam with the next read is the END OF WHAT WAS READ, not of the
    buffer, whose rest holds an older read's bytes."""
    value = "plain-" + _HEX[:30]
    data = ("x " * 10_000 + value + " tail\n").encode()  # reads longer than a seam
    cut = data.index(value.encode()) + len(value) // 2
    for pieces in ((data[:cut], data[cut:]), (data[:cut], data[cut : cut + 5], data[cut + 5 :])):
        buffer = bytearray(b"#" * 32768)  # larger than any read: stale bytes past each one
        scan = FileScan(rules(environ={"HF_TOKEN": value}, hostname=""), size=len(data))
        for piece in pieces:
            buffer[: len(piece)] = piece
            scan.feed(buffer, len(piece))
        assert scan.found == {"secret": "the value of HF_TOKEN"}, [len(p) for p in pieces]
    # The other side: the buffer still holds that file whole, past a clean file's one short read.
    buffer = bytearray(data)
    clean = b"x " * 100 + b"tail\n"
    buffer[: len(clean)] = clean
    scan = FileScan(rules(environ={"HF_TOKEN": value}, hostname=""), size=len(clean))
    scan.feed(buffer, len(clean))
    assert scan.found == {}


@pytest.mark.parametrize(
    "controls_in_probe, control_after_probe, found",
    [
        # 80 control bytes in the first 8000 (1%): text, so its paths are searched as text
        (80, False, {"path": "the home folder's path"}),
        # 81: binary, whose printable runs are searched for credentials only, never paths
        (81, False, {}),
        # a control byte past the 8000th does not count: the probe is the first 8000 bytes
        (80, True, {"path": "the home folder's path"}),
    ],
)
def test_a_files_encoding_is_told_from_exactly_its_first_8000_bytes(
    controls_in_probe, control_after_probe, found
):
    head = b"\x01" * controls_in_probe + b"a" * (8000 - controls_in_probe)
    data = head + (b"\x01" if control_after_probe else b"a") + b" log of /home/alice/runs/1\n"
    rule_set = rules(home="/home/alice", cwd="/", hostname="")
    assert scan_bytes(data, rule_set) == found


def test_a_secret_at_the_first_or_last_byte_of_a_file_is_found_and_an_empty_file_or_a_link_is_not_read(
    tmp_path,
):
    value = "plain-" + _HEX[:30]
    rule_set = rules(environ={"HF_TOKEN": value}, hostname="")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "notes.txt").write_text(value)
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "empty.bin").write_bytes(b"")
    (stage / "linked.txt").symlink_to(outside / "notes.txt")  # a link is no staged file: never followed
    assert scan_secrets(stage, rule_set) == []
    (stage / "first.bin").write_bytes(value.encode() + bytes(range(256)) * 600)
    (stage / "last.bin").write_bytes(bytes(range(256)) * 600 + value.encode())
    (stage / "only.txt").write_bytes(value.encode())
    with pytest.raises(SecretInStage) as refused:
        scan_secrets(stage, rule_set, consequence="nothing was published")
    assert str(refused.value) == (
        "first.bin, last.bin and only.txt hold the value of HF_TOKEN; nothing was published. Remove it from "
        "where it came from (config card section, data, task sample, code, edits to the stage) and stage again"
    )
