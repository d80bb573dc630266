"""The shared leak scanner (pipeline.leaks) that 05 runs on a new stage and 06 runs again before sending anything.

In-process and fast: each test writes a few files into ``tmp_path`` and scans them with the
real scanner. The end-to-end refusals (05 and 06 as subprocesses) are in test_stage.py,
test_publish_safety.py and test_signing.py.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest
from huggingface_hub import constants

from pipeline.errors import ConfigError, SecretInStage
from pipeline.hashing import CHUNK
from pipeline.leaks import leak_rules, scan_secrets

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
    data = bytearray(b"\0" * (CHUNK + 4096))
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
    from pipeline.leaks import _PACKAGE_CHECKOUT

    leaked, words = {
        "home": ("/home/alice/.cache/x", "the home folder's path"),
        "working": ("/srv/projects/mine/estados_local", "the working folder's absolute path"),
        "checkout": (f"{_PACKAGE_CHECKOUT}/pipeline", "this checkout's absolute path"),
        "host": ("trained on BUILDER-17.corp overnight", "the host name"),
    }[kind]
    (tmp_path / "meta.json").write_text(f'{{"where": "{leaked}"}}\n')
    message = refused(tmp_path, machine)
    assert message.startswith(f"meta.json holds {words}; nothing was published")


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
# Each sample is built by concatenation, so this file never holds a credential-shaped string
# (and secret scanners do not flag it). Values are invented.
SAMPLES = {
    "aws-key": ("an AWS access key", "aws_access_key_id = " + "AKIA" + "Q7RTX2MZP4LKWN3D"),
    "aws-secret": (
        "an AWS access key",
        "AWS_SECRET_ACCESS_KEY=" + "wJalrXUtnFEMI/K7MDENG/" + "bPxRfiCYzq8Xv2Lm0T",
    ),
    "github-token": ("a GitHub token", "token: " + "gh" + "p_" + "a1B2c3D4e5F6g7H8i9J0" * 2),
    "github-pat": ("a GitHub token", "GH=" + "github" + "_pat_" + "11ABCDEFG0" * 3 + "_" + "xYz" * 20),
    "openai-key": (
        "an OpenAI API key",
        'openai.api_key = "' + "sk" + "-proj-" + "Ab3dEf6hIj9kLm2nOp5q" * 2 + '"',
    ),
    "openai-legacy": (
        "an OpenAI API key",
        "key " + "sk" + "-" + "Ab3dEf6hIj9kLm2nOp5q" + "T3Blbk" + "FJ" + "x" * 20,
    ),
    "slack-token": (
        "a Slack token",
        "SLACK=" + "xo" + "xb-" + "123456789012-1234567890123-" + "AbCdEfGh" * 3,
    ),
    "hf-org-token": ("an api_org_ token", "api" + "_org_" + "QwErTyUiOp" * 4),
    "google-api-key": (
        "a Google API key",
        "maps key " + "AI" + "za" + "SyD3" + "x7Yk_9-Qp2Lm4Nw6Rt8Zv0Bc1De3Fg5",
    ),
    "wandb-key": ("a W&B API key", "wandb.login(key=" + '"' + "0123456789abcdef" * 2 + "01234567" + '")'),
    "wandb-netrc": (
        "a W&B API key",
        "machine api.wandb" + ".ai\n  login user\n  password " + "fedcba9876543210" * 2 + "fedcba98\n",
    ),
    "jwt": (
        "a JSON Web Token",
        "Authorization: Bearer "
        + "ey"
        + "JhbGciOiJIUzI1NiJ9"
        + "."
        + "ey"
        + "JzdWIiOiIxMjM0NTY3ODkwIn0"
        + "."
        + "dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    ),
}
# Look like the formats above but are not credentials: they must pass.
HARMLESS = [
    "see the sk-learn-compatible-estimators-and-pipelines guide",
    "commit " + "0123456789abcdef" * 2 + "01234567 of wandb.ai/team/project",  # a git sha near a W&B URL
    "aws_access_key_id = " + "akia" + "q7rtx2mzp4lkwn3d",  # lowercase: not an access key id
    "x" + "AKIA" + "Q7RTX2MZP4LKWN3D" + "Q",  # inside a longer word
    "ey" + "JhbGciOiJub25lIn0" + "." + "ey" + "JzdWIiOiIxIn0" + ".",  # an unsigned token: no signature
    "task-" + "a" * 40,
]


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_each_credential_format_in_a_text_file_is_refused_without_being_shown(tmp_path, sample):
    what, text = SAMPLES[sample]
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "model.py").write_text(f"# setup\n{text}\n")
    message = refused(tmp_path, rules())
    assert message.startswith(f"code/model.py holds {what}; nothing was published"), message
    secret = text.split("=")[-1].split()[-1].strip('"()')
    assert secret[-12:] not in message


def test_strings_shaped_like_credentials_but_not_credentials_pass(tmp_path):
    (tmp_path / "README.md").write_text("\n".join(HARMLESS) + "\n")
    assert scan_secrets(tmp_path, rules()) == []


def test_a_credential_spanning_two_read_chunks_of_a_text_file_is_found(tmp_path):
    what, text = SAMPLES["aws-key"]
    secret = text.split()[-1]
    start = CHUNK - len(secret) // 2  # across the first chunk boundary
    data = bytearray(b"a" * (CHUNK + 4096))
    data[start - 1] = ord(" ")
    data[start : start + len(secret)] = secret.encode()
    data[start + len(secret)] = ord(" ")
    (tmp_path / "notes.txt").write_bytes(bytes(data))
    assert refused(tmp_path, rules()).startswith(f"notes.txt holds {what};")


def test_a_false_positive_is_published_only_where_the_config_allows_it_and_never_a_private_key(tmp_path):
    what, text = SAMPLES["jwt"]
    (tmp_path / "README.md").write_text(f"Example header: {text}\n")
    (tmp_path / "other.md").write_text(f"{text}\n")
    assert "README.md holds a JSON Web Token" in refused(tmp_path, rules())
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
