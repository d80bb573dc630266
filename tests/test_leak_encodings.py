"""The leak scan at every alignment and in every text encoding (pipeline.leaks).

A secret is found however its bytes lie: base64 or hex glued to other characters of their
alphabet (any alignment), cut by a read's seam, in UTF-16 or UTF-32 text with or without a byte
order mark, in a text file holding a NUL byte, in the bytes of an integer tensor, and a value of
this machine from 8 bytes on, encoded. Example tests name each gap; a property test (Hypothesis)
plants any kind in any listed encoding after any prefix in any carrier, across a seam or not.
End to end: 05 --from-folder and 06 --dry-run refuse a UTF-16 vocab.txt holding HF_TOKEN's value.
"""

from __future__ import annotations

import base64
import json
import random
import secrets

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save as safetensors_save
from test_leaks import HARMLESS, SAMPLES, refused, rules, scan_bytes

from pipeline.leaks import KINDS, FileScan, scan_secrets

from support import one_line_error, run_script, script_env

NOISE = random.Random(0).randbytes(4096)  # binary bytes around a planted string
SAMPLES_OF = {kind.id: kind.examples for kind in KINDS}


def machine(value: str):
    """This machine's rules with ``value`` as HF_TOKEN (and no host name, which a short random
    string could hold by chance)."""
    return rules(environ={"HF_TOKEN": value}, hostname="")


def fed_in_two(data: bytes, rule_set, boundary: int) -> dict[str, str]:
    """``data`` scanned as two reads, the first ``boundary`` bytes long."""
    scan = FileScan(rule_set, size=len(data))
    for piece in (data[:boundary], data[boundary:]):
        if piece:
            scan.feed(bytearray(piece), len(piece))
    return scan.found


def weights(payload: np.ndarray | None = None, metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file: float tensors around ``payload`` (an integer tensor)."""
    tensors = {"a.weight": np.linspace(-1, 1, 64, dtype=np.float32), "z.weight": np.ones(32, np.float16)}
    if payload is not None:
        tensors["m.tokens"] = payload
    return safetensors_save(tensors, metadata=metadata)


# -- base64 and hex at every alignment ---------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "b", "bl", "blo", "blob_", "data"])
def test_a_long_base64_blob_glued_to_a_prefix_is_decoded_at_its_alignment(prefix):
    """An embedded image or archive in base64 is one long run: a credential inside it, the run
    glued to any prefix of the alphabet, decodes right at one of the 4 alignments."""
    _, github = SAMPLES["github-token"]
    blob = NOISE[:1500] + b" " + github.encode() + b" " + NOISE[1500:3000]
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        text = f'{{"image": "{prefix}{encode(blob).decode()}"}}\n'
        assert scan_bytes(text, rules()) == {"github-token": "a GitHub token (base64-encoded)"}, (
            prefix,
            encode,
        )


@pytest.mark.parametrize("prefix", ["", "a", "0x", "abc"])
def test_a_long_hex_run_glued_to_a_prefix_is_decoded_at_its_alignment(prefix):
    _, slack = SAMPLES["slack-token"]
    blob = NOISE[:800] + b"\n" + slack.encode() + b"\n" + NOISE[800:1600]
    for digits in (blob.hex(), blob.hex().upper()):
        text = f"dump = {prefix}{digits}\n"
        assert scan_bytes(text, rules()) == {"slack-token": "a Slack token (hex-encoded)"}, prefix


@pytest.mark.parametrize(
    "lead, last, after", [(0, "C", b"\xff"), (1, "O", b"\xbf")], ids=["then-0xff", "then-0xbf"]
)
def test_a_base64url_run_holding_dash_or_underscore_where_a_token_ends_is_decoded_whole(lead, last, after):
    """URL-safe base64 writes 62 and 63 as '-' and '_': a token followed by a high byte
    (binary data, UTF-8) shares its last group with it, so a '-' or '_' stands right after the
    token's last character. It is one run: a token of fixed length (ghp_ and 36 characters)
    whose last character is cut off by reading '-' or '_' as the end of a run is not found."""
    _, github = SAMPLES["github-token"]
    token = (github[:-1] + last).encode()
    blob = NOISE[:lead] + token + after + NOISE[600:1200]
    encoded = base64.urlsafe_b64encode(blob).decode()
    ends = len(base64.urlsafe_b64encode(NOISE[:lead] + token)) - 4  # the group of its last character
    assert set(encoded[ends : ends + 4]) & {"-", "_"}, encoded[ends : ends + 4]
    assert scan_bytes(f"blob: {encoded}\n", rules()) == {"github-token": "a GitHub token (base64-encoded)"}


@pytest.mark.parametrize("glued", ["data", "token", "xyzAB", "ZZZ"])
def test_a_decoded_credential_is_found_whatever_bytes_the_glued_characters_decode_to(glued):
    """``data`` + base64 decodes ``data`` to ``u\\xabZ`` right before the key: that noise
    must not count as a word the key is part of."""
    for kind in ("hf-org-token", "aws-key", "npm-token", "telegram-bot-token", "databricks-token"):
        _, example = SAMPLES[kind]
        for suffix in ("", "Q", "x9"):  # characters glued after the encoding too
            text = f"blob: {glued}{base64.b64encode(example.encode()).decode().rstrip('=')}{suffix}\n"
            assert kind in scan_bytes(text, rules()), (kind, glued, suffix)


# -- text in other encodings ----------------------------------------------------------------------

BOMS = {
    "utf-16-le": b"\xff\xfe",
    "utf-16-be": b"\xfe\xff",
    "utf-32-le": b"\xff\xfe\0\0",
    "utf-32-be": b"\0\0\xfe\xff",
}


@pytest.mark.parametrize(
    ("encoding", "bom"),
    [(encoding, True) for encoding in BOMS]
    + [("utf-16-le", False), ("utf-16-be", False), ("utf-32-le", False)],
)
def test_utf16_and_utf32_text_is_scanned_as_text(encoding, bom):
    value = f"plain-{secrets.token_hex(10)}"
    _, github = SAMPLES["github-token"]
    text = f"[PAD]\n[UNK]\nhello\n{value}\nwörld\n{github}\nbuilt in /home/alice/runs\n"
    data = (BOMS[encoding] if bom else b"") + text.encode(encoding)
    rule_set = rules(environ={"HF_TOKEN": value}, home="/home/alice", hostname="")
    width = encoding[:6].upper()
    # Read whole, or in reads that split characters (with a byte order mark: without one, the
    # first read is what tells the encoding; the audit's first read is 8 MiB or the whole file).
    for chunk in (None, 4097, *((7,) if bom else ())):
        assert scan_bytes(data, rule_set, chunk) == {
            "secret": f"the value of HF_TOKEN ({width})",
            "github-token": f"a GitHub token ({width})",
            "path": f"the home folder's path ({width})",
        }, chunk
    # Text is read as text: what a reader would see decoded is found too.
    escaped = ("see \\u0068" + SAMPLES["hf-token"][1][1:] + "\n").encode(encoding)
    assert scan_bytes(BOMS[encoding] + escaped, rules()) == {"hf-token": f"an hf_ token ({width}, escaped)"}


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"])
def test_utf16_and_utf32_strings_inside_other_bytes_are_found(encoding):
    """A wide string in a binary format, or in a UTF-8 text file, the secret ending it."""
    value = f"plain-{secrets.token_hex(10)}"
    _, github = SAMPLES["github-token"]
    wide = f"owner={value};token={github}".encode(encoding)
    width = encoding[:6].upper()
    notes = b"# notes\n" + b"plain words of a UTF-8 text\n" * 100
    zeros = bytes(3000)  # padding: stretches of NUL bytes are skipped, not the strings next to them
    padded = (zeros + wide + zeros, zeros + wide, wide + zeros)
    for data in (NOISE + b"\x01" + wide + b"\xff" + NOISE, notes + wide + b"\nend\n", *padded):
        assert scan_bytes(data, machine(value)) == {
            "secret": f"the value of HF_TOKEN ({width})",
            "github-token": f"a GitHub token ({width})",
        }


def test_a_utf16_string_after_a_stray_byte_is_found_across_a_seam_starting_at_an_odd_byte():
    """After a stray byte the decoder reads a UTF-16 file's ASCII as garbage: those runs are
    searched. A first read one byte longer than the seam puts the seam's part at an odd offset
    of its buffer, where the token cut by the read is whole only in the seam."""
    _, github = SAMPLES["github-token"]
    rule_set = rules()
    overlap = FileScan(rule_set, size=0)._overlap  # the bytes of the next read a seam holds
    first = overlap + 1
    lead = first - 23  # bytes of text before the stray byte: the token starts 20 bytes before the cut
    data = (
        b"\xff\xfe" + ("x" * (lead // 2)).encode("utf-16-le") + b"\x01" + f"{github} end".encode("utf-16-le")
    )
    assert fed_in_two(data, rule_set, first) == {"github-token": "a GitHub token (UTF-16)"}


def test_harmless_text_in_utf16_and_binary_carriers_passes():
    text = "\n".join(HARMLESS) + "\n"
    machine_rules = rules(home="/home/alice", cwd="/srv/runs/alice", hostname="builder-17")
    for data in (
        b"\xff\xfe" + text.encode("utf-16-le"),
        text.encode("utf-32-be"),
        weights(np.frombuffer(text.encode(), np.uint8)),
        weights(np.array([ord(c) for c in text], np.int32)),
        NOISE + text.encode() + NOISE,
        random.Random(1).randbytes(1 << 20),
    ):
        assert scan_bytes(data, machine_rules) == {}


@pytest.mark.parametrize("where", [0, 100, 7999])
def test_a_text_file_holding_a_nul_byte_is_still_scanned_as_text(where):
    """One NUL in the first 8000 bytes (git's rule calls that binary) must not switch off
    the credential formats, paths and reader views of a merges.txt."""
    lines = [f"Ġ t{i}" for i in range(2000)]
    head = ("#version: 0.2\n" + "\n".join(lines)).encode()
    head = head[:where] + b"\0" + head[where:]
    machine_rules = rules(home="/home/alice", hostname="")
    for kind in KINDS:
        for example in kind.examples:
            found = scan_bytes(head + f"\n{example}\n".encode(), machine_rules)
            assert kind.id in found, (kind.id, example[:12], found)
    assert "path" in scan_bytes(head + b"\nsaved from /home/alice/data\n", machine_rules)
    padded = head.replace(b"\n", b"\0\n")  # a NUL ending every line: still text
    assert scan_bytes(padded + b"saved from /home/alice/data\n", machine_rules) == {
        "path": "the home folder's path"
    }
    assert "hf-token" in scan_bytes(head + b"\nhf%5f" + SAMPLES["hf-token"][1][3:].encode(), machine_rules)


def test_a_training_log_in_ansi_colours_is_text_and_its_paths_and_host_name_are_refused(tmp_path):
    """A log written to a terminal holds an ESC every few dozen bytes (colour codes): still text,
    so this machine's host name and paths in it are found, as in any text file."""
    colours = "".join(
        f"\x1b[32m{step:>5}\x1b[0m loss \x1b[1;33m{2.5 - step / 1000:.4f}\x1b[0m lr \x1b[36m3e-4\x1b[0m\n"
        for step in range(200)
    )
    machine_rules = rules(home="/home/alice", cwd="/srv/runs/alice", hostname="builder-17")
    for line, words in (
        ("\x1b[2mtraining on builder-17\x1b[0m\n", "the host name"),
        ("\x1b[2msaved /home/alice/ckpt/step-200\x1b[0m\n", "the home folder's path"),
    ):
        (tmp_path / "train.log").write_text(colours + line + colours)
        assert refused(tmp_path, machine_rules).startswith(f"train.log holds {words}; nothing was published")
    (tmp_path / "train.log").write_text(colours)
    scan_secrets(tmp_path, machine_rules)  # the colours alone are no leak


# -- this machine's values, from 8 bytes on --------------------------------------------------------


@pytest.mark.parametrize("length", [8, 9, 10, 11, 15, 16])
@pytest.mark.parametrize("alphabet", ["urlsafe", "punctuation"])
def test_this_machines_short_values_are_found_in_every_encoding_at_every_alignment(length, alphabet):
    # Only bytes such as '>', '?' and '~' give base64 characters 62 and 63, which its two
    # alphabets write apart ('+' '/' against '-' '_'): a password made of them tells them apart.
    value = secrets.token_urlsafe(length)[:length] if alphabet == "urlsafe" else ("a?~>" * 4)[:length]
    rule_set = machine(value)
    raw = value.encode()
    if alphabet == "punctuation":  # at each alignment, characters of the value alone are 62 or 63
        assert all(set(base64.b64encode(b"\0" * phase + raw)[2:-3]) & set(b"+/") for phase in range(3))
    forms = {
        "hex": raw.hex(),
        "HEX": raw.hex().upper(),
        **{
            f"base64 at byte {phase}": base64.b64encode(NOISE[:phase] + raw + NOISE[9:12]).decode()
            for phase in range(3)
        },
        **{
            f"base64url at byte {phase}": base64.urlsafe_b64encode(NOISE[20 : 20 + phase] + raw)
            .decode()
            .rstrip("=")
            for phase in range(3)
        },
        "URL-encoded": "".join(f"%{byte:02x}" for byte in raw),
    }
    for how, encoded in forms.items():
        for glue in ("", "a", "x_", "Qz9"):
            found = scan_bytes(f"note: {glue}{encoded}\n", rule_set)
            assert found.get("secret", "").startswith("the value of HF_TOKEN"), (how, glue, found)
        in_binary = NOISE[:999] + b"\0" + encoded.encode() + b"\0" + NOISE
        assert "secret" in scan_bytes(in_binary, rule_set), (how, "in binary bytes")


# -- secrets across a read's seam, in every encoding ------------------------------------------------


def test_a_secret_across_a_read_seam_is_found_in_every_encoding_and_carrier():
    value = f"plain-{secrets.token_hex(80)}"  # long: 8 bytes a character, URL-encoded, 4 KB
    _, gitlab = SAMPLES["gitlab-token"]
    both = f"{gitlab} {value} {SAMPLES['anthropic-key'][1]}"  # a long key: 111 characters
    rule_set = machine(value)
    texts = {
        "plain": both,
        "base64": base64.b64encode(both.encode()).decode(),
        "hex": both.encode().hex(),
        "URL-encoded": "".join(f"%{byte:02X}" for byte in both.encode()),
        "escaped": json.dumps(both)[1:-1].replace("g", "\\u0067"),
    }
    carriers = {
        "text": lambda text: ("x " * 3000 + text + " tail\n").encode(),
        "UTF-16 text": lambda text: b"\xff\xfe" + ("x " * 3000 + text + " tail\n").encode("utf-16-le"),
        "int32 tensor": lambda text: weights(np.array([ord(c) for c in "x " * 3000 + text], np.int32)),
        "int64 tensor": lambda text: weights(np.array([ord(c) for c in "x " * 3000 + text], np.int64)),
        "binary": lambda text: NOISE + b"\0" + text.encode() + b"\0" + NOISE,
    }
    missed = []
    for carrier, write in carriers.items():
        for how, text in texts.items():
            data = write(text)
            start, width = _planted_at(carrier, data, text), _width(carrier)
            for cut in (1, len(text) // 3, len(text) // 2, len(text) - 2):
                found = fed_in_two(data, rule_set, start + cut * width)
                if not {"gitlab-token", "secret", "anthropic-key"} <= set(found):
                    missed.append(f"{how} in {carrier}, cut at {cut}: {sorted(found)}")
    assert missed == []


@pytest.mark.parametrize("cut", [-7, -1, 0, 2, 9, 40])
def test_a_long_base64_run_cut_by_a_read_seam_is_decoded_at_its_alignment_on_both_sides(cut):
    """The seam starts a run mid-way: both reads and the seam between them see a run whose
    first character is not on a group boundary."""
    _, gitlab = SAMPLES["gitlab-token"]
    run = base64.b64encode(NOISE[:3001] + b" " + gitlab.encode() + b" " + NOISE[:2000]).decode()
    data = ("blob = " + run + "\n").encode()
    at = 7 + 3002 * 4 // 3  # about where the token's encoding starts
    for prefix in ("", "x"):
        found = fed_in_two(prefix.encode() + data, rules(), len(prefix) + at + cut)
        assert found == {"gitlab-token": "a GitLab token (base64-encoded)"}, (prefix, cut)


def _width(carrier: str) -> int:
    return {"UTF-16 text": 2, "int32 tensor": 4, "int64 tensor": 8}.get(carrier, 1)


def _planted_at(carrier: str, data: bytes, text: str) -> int:
    """Where ``text`` starts in ``data`` as ``carrier`` wrote it."""
    width = _width(carrier)
    if width == 2:
        return data.index(text.encode("utf-16-le"))
    if width in (4, 8):
        return data.index(np.array([ord(c) for c in text], np.int32 if width == 4 else np.int64).tobytes())
    return data.index(text.encode())


# -- integer tensors, URL escapes, database URLs -------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.int64])
def test_a_secret_held_in_an_integer_tensors_bytes_is_found(dtype):
    value = f"plain-{secrets.token_hex(8)}"
    pem_across_lines = next(example for example in SAMPLES_OF["private-key"] if "\n" in example)
    for kind, example in [
        (kind, SAMPLES[kind][1]) for kind in ("github-token", "openai-key", "database-url")
    ] + [("private-key", pem_across_lines)]:
        text = f"{example}\n{value}"
        # As bytes (a uint8 buffer reinterpreted) and as one character code per element.
        as_bytes = np.frombuffer(text.encode().ljust(-(-len(text) // 8) * 8, b" "), dtype)
        as_codes = np.array([ord(c) for c in text], dtype)
        for payload in (as_bytes, as_codes):
            found = scan_bytes(weights(payload), machine(value))
            assert {kind, "secret"} <= set(found), (kind, dtype, found)


# Binary carriers of one written text, and how a finding in each says it was written.
SPACED_CARRIERS = {
    "binary file": (lambda text: NOISE[:700] + b"\0" + text.encode() + b"\xff" + NOISE[700:1400], ""),
    "uint8 tensor": (lambda text: weights(np.frombuffer(text.encode(), np.uint8)), ""),
    "int16 tensor": (lambda text: _tensor(text, np.int16), " (UTF-16)"),
    "int32 tensor": (lambda text: _tensor(text, np.int32), " (UTF-32)"),
    "int64 tensor": (lambda text: _tensor(text, np.int64), " (8 bytes a character)"),
}


@pytest.mark.parametrize("carrier", sorted(SPACED_CARRIERS))
def test_a_secret_written_with_spaces_in_binary_bytes_is_found_whole(carrier):
    """A space is printable: 'aws_secret_access_key = …', '-----BEGIN RSA PRIVATE KEY-----' or
    '"private_key_id": "…"' in a binary file or an integer tensor is one run, not words cut
    apart where no format matches; a token after a space is found as well."""
    write, said = SPACED_CARRIERS[carrier]
    value = "pl41n-Zq"  # this machine's shortest value: 8 bytes
    spaced = {
        **{example: "aws-key" for example in SAMPLES_OF["aws-key"] if " " in example},
        "-----BEGIN RSA " + "PRIVATE KEY-----": "private-key",
        "-----BEGIN " + "PRIVATE KEY-----": "private-key",
        "-----END " + "PRIVATE KEY-----": "private-key",
        SAMPLES_OF["gcp-service-account"][0]: "gcp-service-account",
        f"Authorization: Bearer {SAMPLES['hf-token'][1]}": "hf-token",
        f"token {value}": "secret",
    }
    what = {kind.id: kind.what for kind in KINDS} | {"secret": "the value of HF_TOKEN"}
    missed = {}
    for text, kind in spaced.items():
        found = scan_bytes(write(text), machine(value))
        if found != {kind: what[kind] + said}:
            missed[text[:32]] = found
    assert missed == {}


def test_float_tensors_stay_numbers_for_the_formats():
    """The float tensors are still only searched for this machine's values: a format there is chance."""
    hf = SAMPLES["hf-token"][1].encode()
    floats = np.frombuffer(hf.ljust(48, b"x"), np.float32)
    assert scan_bytes(safetensors_save({"w": floats}), rules()) == {}
    value = f"plain-{secrets.token_hex(9)}"  # 24 bytes: 6 floats
    assert scan_bytes(safetensors_save({"w": np.frombuffer(value.encode(), np.float32)}), machine(value)) == {
        "secret": "the value of HF_TOKEN"
    }


def test_url_escapes_are_decoded_in_either_case():
    hf = SAMPLES["hf-token"][1]
    for escaped in (
        "hf%5f" + hf[3:],
        "hf%5F" + hf[3:],
        "%68%66%5f" + hf[3:],
        "".join(f"%{b:02x}" for b in hf.encode()),
    ):
        assert scan_bytes(f"[link](https://example.com/?t={escaped})\n", rules()) == {
            "hf-token": "an hf_ token (URL-encoded)"
        }, escaped


SCHEMES = [
    "postgres",
    "postgresql",
    "postgresql+psycopg2",
    "mysql",
    "mysql+pymysql",
    "mariadb",
    "mongodb",
    "mongodb+srv",
    "redis",
    "rediss",
    "amqp",
    "amqps",
    "mssql",
    "sqlserver",
    "clickhouse",
    "cockroachdb",
    "oracle",
]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_database_url_with_a_password_is_refused_for_every_common_scheme(scheme):
    url = scheme + "://user:" + "password" + "@host/db"
    assert scan_bytes(f"DATABASE_URL={url}\n", rules()) == {"database-url": "a database URL with a password"}
    for placeholder in ("${DB_PASSWORD}", "<password>", "***"):
        assert scan_bytes(f"{scheme}://user:{placeholder}@host/db\n", rules()) == {}
    assert scan_bytes(f"{scheme}://user@host/db\n", rules()) == {}  # no password


def test_a_database_url_in_capitals_is_found_in_every_reader_view_and_its_placeholder_passes():
    """A scheme in any case is found however the URL is written, across a read's seam too;
    the same URL with an environment placeholder or no password passes in each of the views."""
    url = "MongoDB+SRV+Motor" + "://app:" + "Xk9pQ2w" + "@cluster0.example.net"
    views = {
        "": lambda text: f"DB = {text}\n".encode(),
        " (UTF-16)": lambda text: f"DB = {text}\n".encode("utf-16"),
        " (UTF-32)": lambda text: f"DB = {text}\n".encode("utf-32"),
        # Glued to base64 characters that decode to letters before the scheme.
        " (base64-encoded)": lambda text: b"blob" + base64.b64encode(b"zz" + text.encode()) + b"\n",
        " (hex-encoded)": lambda text: b"0x" + ("q" + text).encode().hex().upper().encode() + b"\n",
        " (escaped)": lambda text: ('{"db": "' + text.replace("M", "\\u004d") + '"}').encode(),
        " (URL-encoded)": lambda text: ("?db=" + text.replace("://", "%3A%2F%2F")).encode(),
        " (split by invisible characters)": lambda text: f"DB = {text[:5]}\u200b{text[5:]}\n".encode(),
    }
    what = "a database URL with a password"
    rule_set = rules(hostname="")
    found = {how: scan_bytes(write(url), rule_set) for how, write in views.items()}
    assert found == {how: {"database-url": what + how} for how in views}
    seam = ("x " * 3000 + url + "\n").encode()
    at = seam.index(b"MongoDB")
    cuts = (at, at + 1, at + 17, at + 20, at + len(url) - 1)
    assert [fed_in_two(seam, rule_set, cut) for cut in cuts] == [{"database-url": what}] * len(cuts)
    for harmless in (
        url.replace("Xk9pQ2w", "${DB_PASSWORD}"),
        url.replace("Xk9pQ2w", "<password>"),
        "REDIS" + "://localhost:6379/0",
    ):
        assert {how: scan_bytes(write(harmless), rule_set) for how, write in views.items()} == dict.fromkeys(
            views, {}
        ), harmless


# -- any kind x any listed encoding x any prefix x any carrier (Hypothesis) ----------------------------

BASE64_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
# How a secret may be written in a text, each with the characters that may be glued to it.
WRITTEN = {
    "plain": (lambda text: text, " :=\"'(\n"),
    "base64": (lambda text: base64.b64encode(text.encode()).decode(), BASE64_ALPHABET + "+/"),
    "base64url": (
        lambda text: base64.urlsafe_b64encode(text.encode()).decode().rstrip("="),
        BASE64_ALPHABET + "-_",
    ),
    "hex": (lambda text: text.encode().hex(), "0123456789abcdef"),
    "HEX": (lambda text: text.encode().hex().upper(), "0123456789ABCDEF"),
    "URL-encoded": (lambda text: "".join(f"%{b:02X}" for b in text.encode()), " =?&"),
    "url-encoded": (lambda text: "".join(f"%{b:02x}" for b in text.encode()), " =?&"),
    "\\u-escaped": (lambda text: "".join(f"\\u{ord(c):04x}" for c in text), " \"'"),
    "HTML references": (lambda text: "".join(f"&#{ord(c)};" for c in text), " >"),
    "zero-width space": (lambda text: text[:3] + "\u200b" + text[3:], " \n"),
}


def _json_string(text: str) -> str:
    return json.dumps(text)[1:-1]


def _tensor(codes: str, dtype) -> bytes:
    return weights(np.array([ord(c) for c in codes], dtype))


# Where the written secret lands: each returns the file's bytes and the secret's bytes in it.
CARRIERS = {
    "README.md": lambda text: (f"# Model\n\nContact: {text}\n".encode(), text.encode()),
    "merges.txt, a NUL first": lambda text: (
        b"#version: 0.2\n\0a b\n" + f"{text}\nc d\n".encode(),
        text.encode(),
    ),
    "vocab.txt, UTF-16LE with BOM": lambda text: (
        b"\xff\xfe" + f"[PAD]\n{text}\nhello\n".encode("utf-16-le"),
        text.encode("utf-16-le"),
    ),
    "vocab.txt, UTF-16BE": lambda text: (
        f"[PAD]\n{text}\nhello\n".encode("utf-16-be"),
        text.encode("utf-16-be"),
    ),
    "vocab.txt, UTF-32LE with BOM": lambda text: (
        b"\xff\xfe\0\0" + f"[PAD]\n{text}\n".encode("utf-32-le"),
        text.encode("utf-32-le"),
    ),
    "tokenizer.json": lambda text: (
        json.dumps({"added_tokens": [{"id": 0, "content": text}], "model": {"vocab": {"a": 0}}}).encode(),
        _json_string(text).encode(),
    ),
    "safetensors __metadata__": lambda text: (
        weights(metadata={"note": text}),
        json.dumps(text, ensure_ascii=False)[1:-1].encode(),
    ),
    "uint8 tensor": lambda text: (
        weights(np.frombuffer(text.encode(), np.uint8)),
        text.encode(),
    ),
    "int16 tensor": lambda text: (
        _tensor(text, np.int16),
        np.array([ord(c) for c in text], np.int16).tobytes(),
    ),
    "int64 tensor": lambda text: (
        _tensor(text, np.int64),
        np.array([ord(c) for c in text], np.int64).tobytes(),
    ),
    "binary file": lambda text: (
        NOISE[:700] + b"\0" + text.encode() + b"\xff" + NOISE[700:1400],
        text.encode(),
    ),
}
# Two layers of escaping, and an invisible character (several bytes, not ASCII) in a binary
# string: what the scan does not see (docs/publishing.md).
UNSEEN = {
    ("tokenizer.json", "\\u-escaped"),
    ("safetensors __metadata__", "\\u-escaped"),
    *(
        (carrier, "zero-width space")
        for carrier in ("uint8 tensor", "int16 tensor", "int64 tensor", "binary file")
    ),
}


@st.composite
def planted(draw):
    if draw(st.booleans()):
        kind = draw(st.sampled_from(KINDS))
        kind, secret = kind.id, draw(st.sampled_from(kind.examples))
        rule_set = rules(hostname="")
    else:  # a value of this machine, from 8 bytes on
        secret = draw(st.text(BASE64_ALPHABET + "_-.", min_size=8, max_size=40))
        kind, rule_set = "secret", machine(secret)
    written = draw(st.sampled_from(sorted(WRITTEN)))
    carrier = draw(st.sampled_from(sorted(CARRIERS)))
    if (carrier, written) in UNSEEN:
        written = "plain"
    encode, glue = WRITTEN[written]
    prefix = draw(st.text(glue, max_size=7))
    suffix = draw(st.text(glue, max_size=3))
    seam = draw(st.none() | st.floats(0.01, 0.99))
    return kind, secret, rule_set, written, carrier, prefix + encode(secret) + suffix, seam


@settings(
    max_examples=600,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(planted())
def test_any_kind_in_any_listed_encoding_after_any_prefix_in_any_carrier_is_found(case):
    kind, secret, rule_set, written, carrier, text, seam = case
    data, form = CARRIERS[carrier](text)
    if seam is None:
        found = scan_bytes(data, rule_set)
    else:  # the read's seam inside the written secret
        start = data.index(form)
        found = fed_in_two(data, rule_set, start + max(1, int(seam * len(form))))
    assert kind in found, (kind, secret[:12], written, carrier, text[:40], seam, found)


# -- end to end: 05 --from-folder and 06 --dry-run --------------------------------------------------


def test_05_and_06_refuse_a_utf16_vocabulary_holding_the_tokens_value_naming_the_file(tmp_path):
    from safetensors.numpy import save_file

    value = f"plain-{secrets.token_hex(12)}"  # shaped like no format: only its value is a secret
    folder = tmp_path / "tiny"
    folder.mkdir()
    save_file(
        {"layer.weight": np.ones((3, 3), np.float32), "layer.bias": np.zeros(3, np.float32)},
        str(folder / "model.safetensors"),
    )
    (folder / "config.json").write_text('{"width": 3}\n')
    (folder / "vocab.txt").write_bytes(
        b"\xff\xfe" + f"[PAD]\n[UNK]\nhello\n{value}\nworld\n".encode("utf-16-le")
    )
    hf_home = str(tmp_path / "hf_home")
    stage = tmp_path / "stage"
    args = ("--from-folder", str(folder), "--stage", str(stage), "--repo-id", "you/tiny")
    refused = run_script("05_stage.py", *args, cwd=tmp_path, env=script_env(HF_TOKEN=value, HF_HOME=hf_home))
    line = one_line_error(refused)
    assert refused.returncode == 2 and line.startswith(
        "error: vocab.txt holds the value of HF_TOKEN (UTF-16); nothing was staged"
    ), line
    assert value not in refused.stdout + refused.stderr and not stage.exists()
    # Staged where the value is no secret, then published from a shell that holds it as HF_TOKEN.
    staged = run_script("05_stage.py", *args, cwd=tmp_path, env=script_env(HF_HOME=hf_home))
    assert staged.returncode == 0, staged.stdout + staged.stderr
    published = run_script(
        "06_publish.py",
        "--stage",
        str(stage),
        "--repo-id",
        "you/tiny",
        "--endpoint",
        "http://127.0.0.1:1",  # never reached: the audit refuses first
        "--dry-run",
        cwd=tmp_path,
        env=script_env(HF_TOKEN=value, HF_HOME=hf_home),
    )
    line = one_line_error(published)
    assert published.returncode == 2 and line.startswith(
        "error: vocab.txt holds the value of HF_TOKEN (UTF-16); nothing was published (no request was sent)"
    ), line
    assert value not in published.stdout + published.stderr
