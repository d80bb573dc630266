"""The leak scan where text is harder to read: UTF-16/UTF-32 text that a stray byte or a join of
two byte orders puts out of step with its decoder, every character Unicode says renders as
nothing (Default_Ignorable_Code_Point), the string escapes and HTML references that common tools
write; and the saved login read without hanging on a FIFO or reading /dev/zero for ever.
End to end: 05 --from-folder refuses a folder hiding a token each of these ways, naming each file.
"""

from __future__ import annotations

import json
import os
import re
import resource
import secrets
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file
from test_leak_encodings import WRITTEN, fed_in_two, machine
from test_leaks import SAMPLES, rules, scan_bytes

from pipeline.leaks import KINDS
from pipeline.leaks.views import DEFAULT_IGNORABLE, reader_view, utf8_ranges

from support import PYTHON, one_line_error, run_script, script_env

HF = SAMPLES["hf-token"][1]  # an invented hf_ token
AWS = SAMPLES["aws-key"][1]

# -- UTF-16/UTF-32 text out of step with its decoder -----------------------------------------------

# Each puts ``text`` where the file's decoder, which never resynchronises, reads garbage.
OUT_OF_STEP = {
    "UTF-16LE with BOM, a stray newline before": lambda text: (
        b"\xff\xfe" + "tokens\n".encode("utf-16-le") + b"\n" + text.encode("utf-16-le")
    ),
    "UTF-16BE without BOM, a stray byte before": lambda text: (
        ("word\n" * 50).encode("utf-16-be") + b"\x00" + text.encode("utf-16-be")
    ),
    "UTF-16LE then UTF-16BE (cat of a Windows and a Java file)": lambda text: (
        "a\nb\n".encode("utf-16") + b"\xfe\xff" + text.encode("utf-16-be")
    ),
    "UTF-16BE then UTF-16LE": lambda text: (
        b"\xfe\xff" + "a\nb\n".encode("utf-16-be") + b"\xff\xfe" + text.encode("utf-16-le")
    ),
    "UTF-32LE with BOM, a stray byte before": lambda text: (
        "x\n".encode("utf-32") + b"\n" + text.encode("utf-32-le")
    ),
    "UTF-32LE with BOM, three stray bytes before": lambda text: (
        "x\n".encode("utf-32") + b"\n\n\n" + text.encode("utf-32-le")
    ),
    "UTF-32BE with BOM, two stray bytes before": lambda text: (
        b"\0\0\xfe\xff" + "x\n".encode("utf-32-be") + b"\r\n" + text.encode("utf-32-be")
    ),
}


@pytest.mark.parametrize("layout", sorted(OUT_OF_STEP))
def test_wide_text_out_of_step_with_its_decoder_is_still_searched(layout):
    """A UTF-16 vocab.txt to which `echo` appended one byte, or two UTF-16 files of either byte
    order joined by `cat`: the decoder reads the rest as CJK garbage, so neither the text views
    nor the runs of other widths saw it: a secret there was published."""
    value = f"Lq8-local-{secrets.token_hex(6)}"
    width = "UTF-32" if "UTF-32" in layout else "UTF-16"
    for secret, kind, what in (
        (HF, "hf-token", "an hf_ token"),
        (AWS, "aws-key", SAMPLES["aws-key"][0]),
        (value, "secret", "the value of HF_TOKEN"),
    ):
        data = OUT_OF_STEP[layout](f"key {secret}\nmore words\n")
        for chunk in (None, 4097, 7):
            found = scan_bytes(data, machine(value), chunk)
            assert found == {kind: f"{what} ({width})"}, (secret[:8], chunk, found)


def test_wide_text_in_step_is_searched_once_and_says_how_it_was_written():
    """The decoder's own text is not searched again as runs of its width: the same findings,
    named by the decoder (with the views it applied)."""
    escaped = "see \\u0068" + HF[1:] + "\n"
    for encoding, bom in (("utf-16-le", b"\xff\xfe"), ("utf-16-be", b""), ("utf-32-be", b"\0\0\xfe\xff")):
        width = encoding[:6].upper()
        assert scan_bytes(bom + escaped.encode(encoding), rules()) == {
            "hf-token": f"an hf_ token ({width}, escaped)"
        }


@st.composite
def out_of_step(draw):
    kind = draw(st.sampled_from(KINDS))
    secret = draw(st.sampled_from([example for example in kind.examples if example.isascii()]))
    written = draw(st.sampled_from(sorted(set(WRITTEN) - {"zero-width space"})))  # runs are ASCII
    encode, glue = WRITTEN[written]
    text = draw(st.text(glue, max_size=5)) + encode(secret) + draw(st.text(glue, max_size=3)) + "\n"
    layout = draw(st.sampled_from(sorted(OUT_OF_STEP)))
    seam = draw(st.none() | st.floats(0.01, 0.99))
    return kind.id, written, layout, text, seam


@settings(
    max_examples=200,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(out_of_step())
def test_any_kind_in_any_listed_encoding_out_of_step_with_the_decoder_is_found(case):
    kind, written, layout, text, seam = case
    data = OUT_OF_STEP[layout](text)
    found = (
        scan_bytes(data, rules(hostname=""))
        if seam is None
        else fed_in_two(data, rules(hostname=""), int(seam * len(data)) or 1)
    )
    assert kind in found, (kind, written, layout, text[:40], seam, found)


# -- characters that render as nothing ---------------------------------------------------------------


# Characters that render as nothing, named here, not read from the table under test: each of
# Default_Ignorable_Code_Point's ranges at its ends (and inside the long ones).
INVISIBLE = {
    "soft hyphen": [0x00AD],
    "combining grapheme joiner": [0x034F],
    "Arabic letter mark": [0x061C],
    "Hangul choseong and jungseong fillers": [0x115F, 0x1160],
    "Khmer inherent vowels": [0x17B4, 0x17B5],
    "Mongolian variation selectors and vowel separator": [0x180B, 0x180C, 0x180D, 0x180E, 0x180F],
    "zero-width space, joiners, direction marks": [0x200B, 0x200C, 0x200D, 0x200E, 0x200F],
    "bidi embeddings and overrides": [0x202A, 0x202E],
    "word joiner, invisible operators, isolates, deprecated formats": [
        0x2060,
        0x2064,
        0x2065,
        0x2069,
        0x206A,
        0x206F,
    ],
    "Hangul filler": [0x3164],
    "variation selectors 1-16": [0xFE00, 0xFE0F],
    "byte order mark": [0xFEFF],
    "halfwidth Hangul filler": [0xFFA0],
    "reserved FFF0-FFF8": [0xFFF0, 0xFFF8],
    "shorthand format controls": [0x1BCA0, 0x1BCA3],
    "musical symbol format controls": [0x1D173, 0x1D17A],
    "tag characters (ASCII smuggling)": [0xE0000, 0xE0001, 0xE0020, 0xE0041, 0xE007F],
    "variation selectors 17-256": [0xE0100, 0xE01EF],
    "reserved up to E0FFF": [0xE01F0, 0xE0FFF],
}


@pytest.mark.parametrize("name", sorted(INVISIBLE))
def test_a_token_split_by_any_character_that_renders_as_nothing_is_found(name):
    """Variation selectors (VS16 after an emoji), tag characters, Hangul fillers, U+206A-206F...:
    a page shows the token whole; the scan saw two words, and it was published."""
    value = f"Lq8-local-{secrets.token_hex(6)}"
    for code in INVISIBLE[name]:
        for secret, kind in ((HF, "hf-token"), (value, "secret")):
            split = secret[:6] + chr(code) + secret[6:]
            found = scan_bytes(f"merges: {split}\n", machine(value))
            assert kind in found and found[kind].endswith("(split by invisible characters)"), (
                hex(code),
                found,
            )
            wide = b"\xff\xfe" + f"vocab {split}\n".encode("utf-16-le")
            assert kind in scan_bytes(wide, machine(value)), (hex(code), "UTF-16")


def test_the_invisible_characters_are_exactly_unicodes_default_ignorable_code_points():
    """The table against an independent source (the regex package reads Unicode's
    DerivedCoreProperties.txt), and its byte pattern against every code point's UTF-8."""
    regex = pytest.importorskip("regex")
    property_ = regex.compile(r"\p{Default_Ignorable_Code_Point}")
    table = {code for first, last in DEFAULT_IGNORABLE for code in range(first, last + 1)}
    every = [code for code in range(0x110000) if not 0xD800 <= code <= 0xDFFF]
    assert {code for code in every if property_.match(chr(code))} == table
    removed = [code for code in every if reader_view(b"a" + chr(code).encode() + b"b")[0] == b"ab"]
    assert set(removed) == table
    # The UTF-8 byte ranges of any span, checked at its edges and around them.
    for first, last in (
        (0x7E, 0x800),
        (0xFFF0, 0x10010),
        (0x1BCA0, 0x1BCA3),
        (0xE000, 0xE0FFF),
        (0x80, 0x10FFFF),
    ):
        pattern = b"|".join(
            b"".join(b"[\\x%02x-\\x%02x]" % pair for pair in seq) for seq in utf8_ranges(first, last)
        )
        compiled = re.compile(pattern)
        for code in {first - 1, first, first + 1, last - 1, last, last + 1} - set(range(0xD800, 0xE000)):
            if 0 <= code <= 0x10FFFF:
                assert (compiled.fullmatch(chr(code).encode()) is not None) == (first <= code <= last), hex(
                    code
                )


# -- the escapes and references common tools write ----------------------------------------------------

ESCAPED = {
    "Python octal escapes": lambda text: "".join(f"\\{ord(c):03o}" for c in text),
    "Python \\U escapes": lambda text: "".join(f"\\U{ord(c):08x}" for c in text),
    "JavaScript \\u{} escapes": lambda text: "".join(f"\\u{{{ord(c):x}}}" for c in text),
    "HTML decimal references without ;": lambda text: "".join(f"&#{ord(c)}" for c in text[:3]) + text[3:],
    "HTML hex references without ;": lambda text: (
        "".join(f"&#x{ord(c):x}" for c in text[:2]) + " " + text[2:]
    ),
    "HTML named references": lambda text: text.replace("_", "&lowbar;"),
    "HTML named references, other names": lambda text: text.replace("_", "&UnderBar;"),
}


@pytest.mark.parametrize("how", sorted(ESCAPED))
def test_escapes_and_references_that_common_tools_write_are_decoded(how):
    text = ESCAPED[how](HF)
    if how == "HTML hex references without ;":  # "&#x68&#x66 f_…": the space is text, not a token
        text = "".join(f"&#x{ord(c):x}" for c in HF[:3]) + HF[3:]
    found = scan_bytes(f'<p>{text}</p>\ns = "{text}"\n', rules())
    assert found == {"hf-token": "an hf_ token (escaped)"}, (how, text[:40], found)


def test_references_that_name_nothing_and_plain_ampersands_are_left_as_they_are():
    view, changes = reader_view(b"a=1&b=2&notaname; &amp Q&A \\9 \\8")
    assert view == b"a=1&b=2&notaname; &amp Q&A \\9 \\8" and changes == ()
    assert reader_view(b"&lt;&#x5f;&#95&lowbar;\\137\\U0000005f\\u{5f}")[0] == b"<______"


# -- the saved login, read safely ------------------------------------------------------------------------


_SAVED_SECRETS = """
import json, sys
from pipeline.leaks import leak_rules
print(json.dumps(sorted(value.decode() for value, _ in leak_rules(environ={}).secrets)))
"""


def saved_secrets(token: Path, stored: Path) -> list[str]:
    """The secrets this machine's rules take from the saved login at ``token`` and ``stored``,
    computed in a process of its own: one that hangs or reads without bound is stopped (30 s, 4 GiB
    of address space) and fails the test, not the machine."""

    def bounded() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    env = script_env(HF_TOKEN_PATH=str(token), HF_STORED_TOKENS_PATH=str(stored))
    try:
        done = subprocess.run(
            [PYTHON, "-B", "-c", _SAVED_SECRETS],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            preexec_fn=bounded,
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the rules hung reading the saved login {token} / {stored}") from None
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_a_saved_login_that_is_a_fifo_or_a_device_is_skipped_never_waited_on_or_read_for_ever(tmp_path):
    """HF_TOKEN_PATH a FIFO hung 05 and 06 for ever; /dev/zero read until memory ran out and
    blamed the config. Only a regular file within a bound is read."""
    token = tmp_path / "token"
    stored = tmp_path / "stored_tokens"
    saved = f"hf_{secrets.token_hex(17)}"
    token.write_text(saved + "\n")
    stored.write_text(f"[work]\nhf_token = {saved[::-1]}\n")
    assert saved_secrets(token, stored) == sorted([saved, saved[::-1]])
    for path in (token, stored):
        path.unlink()
        os.mkfifo(path)
    assert saved_secrets(token, stored) == []  # at once: the open does not wait for a writer
    for path in (token, stored):
        path.unlink()
        path.symlink_to("/dev/zero")
    assert saved_secrets(token, stored) == []
    token.unlink()
    token.write_bytes(b"x" * (1 << 20))  # larger than any token file: not read
    assert saved_secrets(token, stored) == []


def test_05_refuses_a_folder_hiding_tokens_out_of_step_behind_invisibles_and_escapes_naming_each_file(
    tmp_path,
):
    value = f"Lq8-local-only-{secrets.token_hex(8)}"
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"w": np.ones(4, np.float32)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"width": 4}\n')
    (folder / "vocab.txt").write_bytes(
        OUT_OF_STEP["UTF-16LE then UTF-16BE (cat of a Windows and a Java file)"](f"token {value}\n")
    )
    (folder / "merges.txt").write_text(f"#version: 0.2\n{AWS[:8]}\ufe0f{AWS[8:]}\n", encoding="utf-8")
    octal = "".join(f"\\{ord(c):03o}" for c in HF)
    (folder / "chat_template.jinja").write_text('{{ "' + octal + '" }}\n')
    fifo = tmp_path / "token-fifo"
    os.mkfifo(fifo)  # the saved login: a FIFO, which 05 used to wait on for ever
    env = script_env(HF_TOKEN=value, HF_TOKEN_PATH=str(fifo), HF_HOME=str(tmp_path / "hf_home"))
    result = run_script(
        "05_stage.py",
        "--from-folder",
        str(folder),
        "--stage",
        str(tmp_path / "stage"),
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    line = one_line_error(result)
    assert result.returncode == 2, line
    assert f"merges.txt holds {SAMPLES['aws-key'][0]} (split by invisible characters)" in line, line
    assert "chat_template.jinja holds an hf_ token (escaped)" in line, line
    assert "vocab.txt holds the value of HF_TOKEN (UTF-16)" in line, line
    assert value not in result.stdout + result.stderr and not (tmp_path / "stage").exists()
