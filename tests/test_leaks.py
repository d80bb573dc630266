"""The shared leak scanner (pipeline.leaks) that 05 runs on a new stage and 06 runs again before sending anything.

In-process and fast: each test writes a few files into ``tmp_path`` and scans them with the
real scanner. The end-to-end refusals (05 and 06 as subprocesses) are in test_stage.py,
test_publish_safety.py and test_signing.py.
"""

from __future__ import annotations

import base64
import json
import random
import secrets
import sys
import urllib.parse

import numpy as np
import pytest
from huggingface_hub import constants

from pipeline.errors import ConfigError, SecretInStage
from pipeline.hashing import CHUNK
from pipeline.leaks import KINDS, FileScan, leak_rules, refuse_findings, scan_secrets

from support import REPO

HF_SHAPED = "hf_" + "Ab3" * 12


def rules(**kwargs):
    """This machine's rules with a fixed environment (no real token can leak into a test)."""
    kwargs.setdefault("environ", {})
    return leak_rules(**kwargs)


def refused(folder, rule_set) -> str:
    with pytest.raises(SecretInStage) as caught:
        scan_secrets(folder, rule_set, consequence="nothing was published")
    return str(caught.value)


@pytest.mark.parametrize("secret_kind", ["hf_pattern", "literal"])
def test_a_secret_spanning_two_read_chunks_is_found(tmp_path, secret_kind):
    literal = f"plain-{secrets.token_hex(12)}"
    secret = HF_SHAPED if secret_kind == "hf_pattern" else literal
    # The file is read in CHUNK-sized reads: put the secret across the first boundary.
    start = CHUNK - len(secret) // 2
    data = bytearray(random.Random(0).randbytes(CHUNK + 4096))  # binary bytes
    data[start : start + len(secret)] = secret.encode()
    (tmp_path / "modelo.safetensors").write_bytes(bytes(data))
    message = refused(tmp_path, rules(environ={"HF_TOKEN": literal}))
    assert message.startswith("modelo.safetensors holds ")
    assert ("an hf_ token" if secret_kind == "hf_pattern" else "the value of HF_TOKEN") in message
    assert secret not in message and literal not in message


def test_the_token_saved_by_hf_auth_login_is_found_without_being_shown(tmp_path, monkeypatch):
    saved = f"saved-login-{secrets.token_hex(10)}"
    token_file = tmp_path / "token"
    token_file.write_text(saved)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(token_file))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "stored_tokens"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "README.md").write_text(f"contact: {saved}\n")
    message = refused(stage, rules())
    assert "README.md holds a token saved by `hf auth login`" in message and saved not in message


def test_a_pem_private_key_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text(
        "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEE...\n-----END EC PRIVATE KEY-----\n"
    )
    assert "notes.txt holds a PEM private key" in refused(tmp_path, rules())


@pytest.mark.parametrize("kind", ["home", "working", "checkout", "host"])
def test_this_machines_paths_and_host_name_are_refused_in_text(tmp_path, kind):
    machine = rules(home="/home/alice", cwd="/srv/projects/mine", hostname="builder-17.corp")
    from pipeline.leaks.scan import _PACKAGE_CHECKOUT

    leaked, words = {
        "home": ("/home/alice/.cache/x", "the home folder's path"),
        "working": ("/srv/projects/mine/estados_local", "the working folder's absolute path"),
        "checkout": (f"{_PACKAGE_CHECKOUT}/pipeline", "this checkout's absolute path"),
        "host": ("trained on BUILDER-17.corp overnight", "the host name"),
    }[kind]
    (tmp_path / "meta.json").write_text(f'{{"where": "{leaked}"}}\n')
    message = refused(tmp_path, machine)
    assert message.startswith(f"meta.json holds {words}; nothing was published")


def test_the_working_folder_read_from_the_system_is_refused_wherever_it_is_outside_home(
    tmp_path, monkeypatch
):
    """Run from /data/runs/x while HOME is /home/alice: the working folder is the one the
    process runs in, not one under home."""
    working = tmp_path.resolve() / "runs" / "x"
    working.mkdir(parents=True)
    monkeypatch.setenv("HOME", "/home/alice")
    monkeypatch.chdir(working)
    machine = rules(hostname="")
    assert machine.machine[:2] == (
        (b"/home/alice", "the home folder's path"),
        (str(working).encode(), "the working folder's absolute path"),
    )
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "meta.json").write_text(f'{{"where": "{working}/estados_local"}}\n')
    assert refused(stage, machine) == (
        "meta.json holds the working folder's absolute path; nothing was published. Remove it from where it "
        "came from (config card section, data, task sample, code, edits to the stage) and stage again"
    )


def test_paths_match_as_whole_names_and_only_in_text_files(tmp_path):
    machine = rules(home="/root", cwd="/srv/x", hostname="vm")
    # Longer names that merely start with the values, and the values inside a binary file.
    (tmp_path / "README.md").write_text("mounted at /rootfs; see /srv/xyz; vmware, kvm\n")
    (tmp_path / "modelo.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0 /root/ vm /srv/x/ " * 100)
    scan_secrets(tmp_path, machine)
    (tmp_path / "README.md").write_text("written in /root/run by the vm\n")
    assert "README.md holds the home folder's path" in refused(tmp_path, machine)


def test_short_token_values_are_not_matched_by_chance(tmp_path):
    (tmp_path / "modelo.safetensors").write_bytes(b"\0abc123\0" * 64)
    scan_secrets(tmp_path, rules(environ={"HF_TOKEN": "abc123"}))


# -- the credential formats ------------------------------------------------------------------
# The rules' own table carries invented examples of every form each rule claims (built by
# concatenation there, so no file of the tree holds a credential-shaped string).
SAMPLES = {kind.id: (kind.what, kind.examples[0]) for kind in KINDS}
# The providers whose keys the scan must know; a rule deleted with its examples fails here.
PROVIDERS = {
    "hf-token",
    "hf-org-token",
    "private-key",
    "aws-key",
    "github-token",
    "openai-key",
    "anthropic-key",
    "slack-token",
    "google-api-key",
    "stripe-key",
    "gitlab-token",
    "npm-token",
    "sendgrid-key",
    "azure-key",
    "gcp-service-account",
    "database-url",
    "telegram-bot-token",
    "databricks-token",
    "wandb-key",
    "jwt",
}
# Look like the formats above but are not credentials: they must pass.
HARMLESS = [
    "see the sk-learn-compatible-estimators-and-pipelines guide",
    "commit " + "0123456789abcdef" * 2 + "01234567 of wandb.ai/team/project",  # a git sha near a W&B URL
    "aws_access_key_id = " + "akia" + "q7rtx2mzp4lkwn3d",  # lowercase: not an access key id
    "x" + "AKIA" + "Q7RTX2MZP4LKWN3D" + "Q",  # inside a longer word
    "ey" + "JhbGciOiJub25lIn0" + "." + "ey" + "JzdWIiOiIxIn0" + ".",  # an unsigned token: no signature
    "task-" + "a" * 40,
    "connect with postgresql" + "://trainer@db.example.com:5432/runs (the password comes from PGPASSFILE)",
    "DATABASE_URL=postgres" + "://app:${DB_PASSWORD}@db/app",
    "Connect with PostgreSQL" + "://trainer@db:5432/runs or POSTGRES" + "://app:${DB_PASSWORD}@db/app",
    "redis" + "://localhost:6379/0 and mysql" + "://admin:<password>@127.0.0.1/db",
    "sk" + "_live_ keys start with that prefix; np" + "m_ tokens too",
    "AccountKey=" + "<your key>",
    "SG." + "intro paragraph",
    "the dapi" + "ece of the model",  # "dapi" inside a word
    "tensor model.layers.0.self_attn.q_proj.weight, shape [4096, 4096], sha256 " + "ab12" * 16,
]


@pytest.mark.parametrize("kind", [kind.id for kind in KINDS])
def test_each_credential_format_in_a_text_file_is_refused_without_being_shown(tmp_path, kind):
    rule = next(rule for rule in KINDS if rule.id == kind)
    (tmp_path / "code").mkdir()
    for example in rule.examples:
        (tmp_path / "code" / "model.py").write_text(f"# setup\nKEY = {example}\n")
        message = refused(tmp_path, rules())
        assert message.startswith(f"code/model.py holds {rule.what}; nothing was published"), (
            example,
            message,
        )
        assert example[-12:] not in message


def test_the_table_has_a_rule_for_each_provider_and_an_example_of_each_form():
    assert PROVIDERS <= {kind.id for kind in KINDS}
    assert all(kind.examples and (kind.needles or kind.any_case) for kind in KINDS)
    github = next(kind for kind in KINDS if kind.id == "github-token")
    assert {example[:4] for example in github.examples} >= {"ghp_", "gho_", "ghu_", "ghs_", "ghr_", "gith"}
    assert len({kind.id for kind in KINDS}) == len(KINDS)


def in_cases(text: str, rng: random.Random, odds: float) -> str:
    """``text`` with each letter's case flipped at ``odds``."""
    return "".join(c.swapcase() if c.isalpha() and rng.random() < odds else c for c in text)


def test_whatever_a_rule_matches_with_letters_in_another_case_its_needles_find():
    """A pattern may take a name in any case (``(?i:...)``): every spelling it matches, the search
    (tried only near a needle) finds; a value's own letters flipped mostly fall out of the pattern."""
    rng, missed = random.Random(20261205), []
    for kind in KINDS:
        for example in kind.examples:
            for odds in (0.1, 0.5):
                for _ in range(200):
                    text = f"x = {in_cases(example, rng, odds)} .".encode()
                    if kind.pattern.search(text) and not kind.search(text, 0, len(text)):
                        missed.append(f"{kind.id}: {text[4:30]!r}")
    assert missed == []


@pytest.mark.parametrize(
    "name",
    ["AWS_Secret_Access_Key", "awsSecretAccessKEY", "AWSSECRETACCESSKEY", "aws_secretAccessKey"]
    + ["AWS_SECRET_ACCESS_Key", "aws_secret_accessKEY", "AWS_SECRET_ACCESSkey", "aws_secret_access_KEY"],
)
def test_an_aws_secret_access_key_named_in_any_case_is_found_plain_utf16_and_base64(name):
    value = "u8Qz3LkP7mWx2Rt9Vb1Nc8Hd5Jf0Gs4Ty6Ea+Ko/Ui"[:40]
    line, rule_set = f"[default]\n{name} = {value}\n", rules(hostname="")
    assert scan_bytes(line, rule_set) == {"aws-key": "an AWS access key"}
    assert scan_bytes(line.encode("utf-16"), rule_set) == {"aws-key": "an AWS access key (UTF-16)"}
    assert scan_bytes(base64.b64encode(line.encode()), rule_set) == {
        "aws-key": "an AWS access key (base64-encoded)"
    }


def every_case(word: str) -> list[str]:
    return [
        "".join(c.upper() if mask >> n & 1 else c for n, c in enumerate(word))
        for mask in range(1 << len(word))
    ]


def test_every_case_of_the_letters_a_needle_sits_on_is_found():
    """The letters of "access_key" (with and without its underscore) and of "wandb", in each of
    their cases: a list of literal spellings misses most of them."""
    aws, wandb = (next(kind for kind in KINDS if kind.id == id_) for id_ in ("aws-key", "wandb-key"))
    value, digest = "u8Qz3LkP7mWx2Rt9Vb1Nc8Hd5Jf0Gs4Ty6Ea+Ko/", "3f9a1c7e5b2d8f6a0c4e9b7d1a3f5c8e2b6d0a94"
    spellings = [(aws, f"aws_secret_{name} = {value}") for name in every_case("access_key")]
    spellings += [(aws, f"AwsSecret{name}={value}") for name in every_case("accesskey")]
    spellings += [(wandb, f"{name}_API_KEY: {digest}") for name in every_case("wandb")]
    spellings += [(wandb, f"machine api.{name}.ai password {digest}") for name in every_case("wandb")]
    missed = []
    for kind, text in spellings:
        assert kind.pattern.search(text.encode()), text
        if not kind.search(text.encode(), 0, len(text)):
            missed.append(text[:24])
    assert missed == []


def test_a_name_in_any_case_is_looked_for_inside_the_window_searched_and_only_there():
    aws = next(kind for kind in KINDS if kind.id == "aws-key")
    secret = b"AWS_Secret_ACCESS_Key = " + b"u8Qz3LkP7mWx2Rt9Vb1Nc8Hd5Jf0Gs4Ty6Ea+Ko/"
    buffer = b"x " * 2000 + secret + b" " + b"y " * 2000 + secret + b"\n"
    first, second = buffer.index(secret), buffer.rindex(secret)
    assert aws.search(buffer, second - 10, len(buffer))
    assert aws.search(buffer, first - 10, first + len(secret))
    assert not aws.search(buffer, first + len(secret), second - 10)
    assert not aws.search(buffer, 0, first + len(secret) - 1)  # the value cut one character short


def test_every_rule_is_named_in_the_documented_table():
    documented = (REPO / "docs" / "publishing.md").read_text()
    assert [kind.id for kind in KINDS if f"(`{kind.id}`)" not in documented] == []


# -- what a reader sees --------------------------------------------------------------------------
# How a credential may be written, whatever the file: each turns back into it for a reader.
ENCODINGS = {
    "plain": lambda text: text,
    "base64": lambda text: base64.b64encode(text.encode()).decode(),
    "base64url": lambda text: base64.urlsafe_b64encode(text.encode()).decode().rstrip("="),
    "glued base64": lambda text: "token_" + base64.b64encode(text.encode()).decode(),
    "hex": lambda text: text.encode().hex(),
    "URL-encoded": lambda text: text[:2] + urllib.parse.quote(text[2:], safe=""),
    "every byte URL-encoded": lambda text: "".join(f"%{byte:02X}" for byte in text.encode()),
    "zero-width space": lambda text: text[:3] + "\u200b" + text[3:],
    "soft hyphens": lambda text: "\u00ad".join(text),
}


def json_string(text: str, escape_first: bool) -> str:
    """``text`` inside a JSON string as a JSON writer puts it (``ensure_ascii``), the first
    character written as a ``\\u`` escape if asked."""
    if escape_first:
        return f"\\u{ord(text[0]):04x}" + json.dumps(text[1:])[1:-1]
    return json.dumps(text)[1:-1]


def safetensors_bytes(header: str) -> bytes:
    """A safetensors file with this JSON header (padded to 8 bytes) and 8 bytes of F32 data."""
    raw = header.encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + b"\0" * 8


TENSOR = '{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'


def card(text: str, escape_first: bool) -> str:
    return "# Model\n\nContact: " + (f"&#{ord(text[0])};" + text[1:] if escape_first else text) + "\n"


def code(text: str, escape_first: bool) -> str:
    return 'API_KEY = "' + ("\\x%02x" % ord(text[0]) + text[1:] if escape_first else text) + '"\n'


def tokenizer(text: str, escape_first: bool) -> str:
    return (
        '{"version":"1.0","added_tokens":[{"id":0,"content":"' + json_string(text, escape_first) + '"}],'
        '"model":{"type":"BPE","vocab":{"a":0}}}'
    )


def weights_metadata(text: str, escape_first: bool) -> bytes:
    return safetensors_bytes(
        '{"__metadata__":{"format":"pt","note":"' + json_string(text, escape_first) + '"},"w":' + TENSOR + "}"
    )


def weights_tensor_name(text: str, escape_first: bool) -> bytes:
    return safetensors_bytes('{"' + json_string(text, escape_first) + '":' + TENSOR + "}")


# Where a credential lands in a stage, each written as its own writer writes it; with
# ``escape_first`` the first character is escaped in that format's own syntax.
CARRIERS = {
    "README.md": card,
    "code/model.py": code,
    "tokenizer.json": tokenizer,
    "modelo.safetensors, __metadata__": weights_metadata,
    "modelo.safetensors, tensor name": weights_tensor_name,
}


def scan_bytes(data: bytes | str, rule_set, chunk: int | None = None) -> dict[str, str]:
    data = data.encode("utf-8") if isinstance(data, str) else data
    scan = FileScan(rule_set, size=len(data))
    chunk = chunk or len(data)
    for start in range(0, len(data), chunk):
        piece = data[start : start + chunk]
        scan.feed(piece, len(piece))
    return scan.found


@pytest.mark.parametrize("carrier", sorted(CARRIERS))
def test_every_example_is_found_as_its_kind_however_it_is_written_wherever_it_lands(carrier):
    """The planted-secret matrix: every form of every rule, each encoding, in each kind of file."""
    write, rule_set, missed = CARRIERS[carrier], rules(hostname=""), []
    for kind in KINDS:
        for example in kind.examples:
            written = {name: (encode(example), False) for name, encode in ENCODINGS.items()}
            written["escaped"] = (example, True)
            for how, (text, escape_first) in written.items():
                found = scan_bytes(write(text, escape_first), rule_set)
                if kind.id not in found:
                    missed.append(f"{kind.id} {how}: {example[:16]}…")
    assert missed == []


def test_the_value_of_a_token_of_this_machine_is_found_encoded(tmp_path):
    literal = f"plain-{secrets.token_hex(12)}"
    rule_set = rules(environ={"HF_TOKEN": literal})
    for how in ("base64", "hex", "every byte URL-encoded", "zero-width space"):
        found = scan_bytes(f"# Card\n\n{ENCODINGS[how](literal)}\n", rule_set)
        assert found.get("secret", "").startswith("the value of HF_TOKEN ("), (how, found)


def test_how_a_finding_was_written_is_said():
    hf = SAMPLES["hf-token"][1]
    rule_set = rules()
    assert scan_bytes(f"{hf}\n", rule_set) == {"hf-token": "an hf_ token"}
    assert scan_bytes(base64.b64encode(hf.encode()), rule_set) == {
        "hf-token": "an hf_ token (base64-encoded)"
    }
    assert scan_bytes(hf.encode().hex(), rule_set) == {"hf-token": "an hf_ token (hex-encoded)"}
    assert scan_bytes("hf%5F" + hf[3:], rule_set) == {"hf-token": "an hf_ token (URL-encoded)"}
    assert scan_bytes('"\\u0068' + hf[1:] + '"', rule_set) == {"hf-token": "an hf_ token (escaped)"}
    assert scan_bytes("hf_\u200b" + hf[3:], rule_set) == {
        "hf-token": "an hf_ token (split by invisible characters)"
    }


def test_strings_shaped_like_credentials_but_not_credentials_pass(tmp_path):
    (tmp_path / "README.md").write_text("\n".join(HARMLESS) + "\n")
    assert scan_secrets(tmp_path, rules()) == []


def test_a_credential_spanning_two_read_chunks_of_a_text_file_is_found(tmp_path):
    what, text = SAMPLES["aws-key"]
    secret = text.split()[-1]
    start = CHUNK - len(secret) // 2  # across the first chunk boundary
    data = bytearray((b"To be, or not to be, that is the question. " * (CHUNK // 32))[: CHUNK + 4096])
    data[start - 1] = ord(" ")
    data[start : start + len(secret)] = secret.encode()
    data[start + len(secret)] = ord(" ")
    (tmp_path / "notes.txt").write_bytes(bytes(data))
    assert refused(tmp_path, rules()).startswith(f"notes.txt holds {what};")


def test_a_false_positive_is_published_only_where_the_config_allows_it_and_never_a_private_key(tmp_path):
    what, text = SAMPLES["jwt"]
    (tmp_path / "README.md").write_text(f"Example header: {text}\n")
    (tmp_path / "other.md").write_text(f"{text}\n")
    assert "README.md and other.md hold a JSON Web Token;" in refused(tmp_path, rules())
    with pytest.raises(SecretInStage, match="other.md holds a JSON Web Token") as caught:
        scan_secrets(tmp_path, rules(), allow={"README.md": ["jwt"]})
    assert "card.allow_leaks: {other.md: [jwt]}" in str(caught.value)  # the fix names the entry
    (tmp_path / "other.md").unlink()
    assert scan_secrets(tmp_path, rules(), allow={"README.md": ["jwt"]}) == [("README.md", what)]
    for never in (
        {"README.md": ["private-key"]},
        {"README.md": ["secret"]},
        {"/etc/x": ["jwt"]},
        ["README.md"],
    ):
        with pytest.raises(ConfigError, match="card.allow_leaks"):
            scan_secrets(tmp_path, rules(), allow=never)


def test_weights_are_searched_for_this_machines_tokens_in_every_byte_and_for_token_formats_outside_float_tensors(
    tmp_path,
):
    from safetensors.numpy import save_file

    literal = f"plain-{secrets.token_hex(12)}"
    payload = (b"\x01" * 6 + literal.encode()).ljust(64, b"\x02")  # the value inside a float tensor's bytes
    tensors = {"a.weight": np.zeros(1024, np.float32), "b.weight": np.frombuffer(payload, np.float32)}
    save_file(tensors, str(tmp_path / "modelo.safetensors"))
    message = refused(tmp_path, rules(environ={"HF_TOKEN": literal}))
    assert message.startswith("modelo.safetensors holds the value of HF_TOKEN") and literal not in message
    # A token format in the file's header (its metadata) is searched like any other bytes.
    save_file(
        {"a.weight": np.zeros(4, np.float32)},
        str(tmp_path / "modelo.safetensors"),
        metadata={"note": f"pushed with {HF_SHAPED}"},
    )
    assert refused(tmp_path, rules()).startswith("modelo.safetensors holds an hf_ token")


def test_a_large_chunk_is_searched_for_a_secret_value_exactly_as_bytes_find_would():
    """A chunk of 1 MiB or more is searched for each literal secret by the C library's memmem
    (without the GIL): found at the window's first and last byte, never just outside it."""
    from pipeline.leaks import scan

    if sys.platform.startswith("linux"):
        assert scan._MEMMEM is not None  # the fast path is the one this test exercises
    value = f"plain-{secrets.token_hex(12)}".encode()
    search, size = scan._literal(value), 3 << 20
    start, end = 1000, size - 1000
    for where in (start - 1, start, start + 7, size // 2, end - len(value), end - len(value) + 1, end):
        buffer = bytearray(size)
        buffer[where : where + len(value)] = value
        assert search(buffer, start, end) == (where in range(start, end - len(value) + 1)), where
    # Fed whole, a binary file's chunk is searched from its first byte to its last.
    for where in (0, size - len(value)):
        buffer = bytearray(size)
        buffer[where : where + len(value)] = value
        fed = FileScan(rules(environ={"HF_TOKEN": value.decode()}), size=size)
        fed.feed(buffer, size)
        assert fed.found == {"secret": "the value of HF_TOKEN"}, where


def test_float_tensors_are_skipped_only_where_the_strict_parser_accepts_the_header():
    """Token formats are not searched in the numbers of a valid file's float tensors; a
    header the parser refuses marks no bytes as numbers, so its every byte is searched."""
    hf = SAMPLES["hf-token"][1].encode()
    payload = hf.ljust(48, b"x")  # 12 floats whose bytes spell an hf_ token
    header = '{"w":{"dtype":"F32","shape":[12],"data_offsets":[0,48]}}'
    raw = header.encode() + b" " * (-len(header) % 8)
    valid = len(raw).to_bytes(8, "little") + raw + payload
    assert scan_bytes(valid, rules()) == {}
    assert scan_bytes(valid + b"\0" * 8, rules()) == {"hf-token": "an hf_ token"}  # trailing bytes: refused


def test_a_safetensors_header_read_over_many_chunks_is_searched_whole_and_then_its_floats_skipped():
    hf = SAMPLES["hf-token"][1]
    stripe = SAMPLES["stripe-key"][1]
    names = ",".join(
        f'"layer.{i}.weight":{{"dtype":"F32","shape":[8],"data_offsets":[{32 * i},{32 * i + 32}]}}'
        for i in range(400)
    )
    header = "{" + names + ',"__metadata__":{"format":"pt","z":"' + json_string(stripe, True) + '"}}'
    raw = header.encode() + b" " * (-len(header) % 8)
    numbers = (hf.encode() * 400)[: 32 * 400]  # floats whose bytes spell hf_ tokens, over 3 reads
    data = len(raw).to_bytes(8, "little") + raw + numbers
    assert len(raw) > 6 * 4096 and len(data) > len(raw) + 3 * 4096
    assert scan_bytes(data, rules(), chunk=4096) == {"stripe-key": "a Stripe secret key (escaped)"}


def test_files_holding_the_same_kinds_are_named_together_each_once():
    card = {"stripe-key": "a Stripe secret key", "jwt": "a JSON Web Token"}
    with pytest.raises(SecretInStage) as caught:
        refuse_findings(
            {
                "config.json": dict(reversed(card.items())),  # found in another order: the same kinds
                "README.md": card,
                "meta.json": card,
                "code/model.py": {"hf-token": "an hf_ token (base64-encoded)"},
            },
            consequence="nothing was staged",
        )
    message = str(caught.value)
    assert message.startswith(
        "README.md, config.json and meta.json hold a Stripe secret key and a JSON Web Token; "
        "code/model.py holds an hf_ token (base64-encoded); nothing was staged. "
    ), message
    assert message.count("README.md") == 2  # once in the sentence, once in the allow_leaks entry


def test_a_trained_tokenizer_vocabulary_and_the_examples_pass(tmp_path):
    """No false positive on what a model repository normally holds."""
    tokenizers = pytest.importorskip("tokenizers")
    from examples.hf_llama.tokenizer import build_tokenizer

    text = (REPO / "examples" / "charlm" / "shakespeare.txt").read_text()
    for name, model, trainer in (
        ("bpe", tokenizers.models.BPE(unk_token="[UNK]"), tokenizers.trainers.BpeTrainer),
        ("wordpiece", tokenizers.models.WordPiece(unk_token="[UNK]"), tokenizers.trainers.WordPieceTrainer),
    ):
        tokenizer = tokenizers.Tokenizer(model)
        tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
        tokenizer.train_from_iterator(text.splitlines(), trainer(vocab_size=4000, special_tokens=["[UNK]"]))
        (tmp_path / f"{name}-tokenizer.json").write_text(tokenizer.to_str())
    (tmp_path / "byte-tokenizer.json").write_text(build_tokenizer().to_str())
    machine = rules(home="/home/alice", cwd="/srv/runs/alice", hostname="builder-17")
    assert scan_secrets(tmp_path, machine) == []
    assert scan_secrets(REPO / "examples", machine) == []


def test_a_stage_built_by_05_passes(staged_run):
    assert scan_secrets(staged_run.stage, rules()) == []


@pytest.mark.parametrize("how", ["base64", "every byte URL-encoded", "zero-width space"])
def test_an_encoded_secret_across_two_reads_of_a_text_file_is_found(how):
    encoded = ENCODINGS[how](SAMPLES["gitlab-token"][1]).encode()
    boundary = 4096
    for cut in (1, len(encoded) // 2, len(encoded) - 1):  # where the read boundary splits it
        text = b"x " * ((boundary - cut) // 2) + b" " * ((boundary - cut) % 2) + encoded + b" tail\n"
        assert text[boundary - cut : boundary - cut + len(encoded)] == encoded
        found = scan_bytes(text, rules(), chunk=boundary)
        assert "gitlab-token" in found, (how, cut, found)
