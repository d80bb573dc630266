"""Signed publications: 05 --sign-key, 06's check, and a consumer's stock `model_signing verify`.

Real keys (made here with `cryptography`), the real model-signing library and CLI, the real
05/06 scripts as subprocesses, and the real huggingface_hub client against localhub.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import test_publish
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from test_publish import TOKEN, commit_titles, one_error_line, run_publish, write_requests

from pipeline.audit import parse_manifest

# The loopback Hub fixtures of test_publish.py (hf_env is autouse there, and so here).
hf_env, hub = test_publish.hf_env, test_publish.hub

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

CLI = Path(sys.executable).with_name("model_signing")


def write_key(folder: Path, name: str, key=None) -> tuple[Path, Path]:
    """A fresh private key (PEM) and its public key, in ``folder`` (never a stage)."""
    key = key or ec.generate_private_key(ec.SECP256R1())
    private = folder / f"{name}.pem"
    public = folder / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


def fingerprint(public: Path) -> str:
    key = serialization.load_pem_public_key(public.read_bytes())
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(der).hexdigest()


def stock_verify(public: Path, folder: Path) -> subprocess.CompletedProcess:
    """What the card tells a consumer to run on a download folder."""
    return subprocess.run(
        [
            str(CLI),
            "verify",
            "key",
            "--public_key",
            str(public),
            "--signature",
            str(folder / "model.sig"),
            "--ignore-paths",
            str(folder / ".cache"),
            "--allow_symlinks",
            str(folder),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def card_recipe(card: str) -> list[str]:
    """The lines of the shell block of the card's Signature section: install, download, verify."""
    section = card[card.index("## Signature") :]
    return section[section.index("```sh\n") + 6 : section.index("\n```", section.index("```sh"))].splitlines()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    private, public = write_key(folder, "release")
    other_private, other_public = write_key(folder, "other")
    return {
        "private": private,
        "public": public,
        "other_private": other_private,
        "other_public": other_public,
    }


# The tests that read the signed stage go to one xdist worker, so it is signed once.
SIGNED_RUN = pytest.mark.xdist_group("signed-run")


@pytest.fixture(scope="module")
def signed_run(evaluated_run, keys, tmp_path_factory):
    run = evaluated_run.copy_to(tmp_path_factory.mktemp("signed_run") / "run")
    result = run.ok("05_stage.py", "--sign-key", str(keys["private"]), "--repo-id", "alice/signed")
    return run, result


@SIGNED_RUN
def test_05_signs_the_stage_and_the_card_says_how_to_verify(signed_run, keys):
    run, result = signed_run
    stage = run.stage
    names = sorted(p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file())
    assert {
        "MANIFEST.sha256",
        "README.md",
        "meta.json",
        "model.sig",
        "modelo.safetensors",
        "signing_key.pub",
        "training_curve.png",
        "config.json",
        "model.safetensors.index.json",
    } <= set(names)
    # The manifest lists everything but the signature; the signature covers everything else.
    manifest = parse_manifest((stage / "MANIFEST.sha256").read_bytes())
    assert set(manifest) == set(names) - {"MANIFEST.sha256", "model.sig"}
    for name, sha in manifest.items():
        assert hashlib.sha256((stage / name).read_bytes()).hexdigest() == sha
    assert (stage / "signing_key.pub").read_bytes() == keys["public"].read_bytes()
    verified = stock_verify(keys["public"], stage)
    assert verified.returncode == 0, verified.stderr
    card = (stage / "README.md").read_text()
    assert f"`{fingerprint(keys['public'])}`" in card and "not signed" not in card
    assert card_recipe(card) == [
        "pip install huggingface_hub model-signing==1.1.1 pyopenssl",
        "hf download alice/signed --local-dir model  # --revision <commit> for a fixed commit",
        "model_signing verify key --public_key model/signing_key.pub --signature model/model.sig "
        "--ignore-paths model/.cache --allow_symlinks model",
    ]
    assert fingerprint(keys["public"]) in result.stdout


@SIGNED_RUN  # the worker that signs already: model_signing is imported there once
def test_a_folder_staged_with_from_folder_is_signed_with_its_public_key_in_the_manifest(keys, tmp_path):
    from test_hostile_folders import stage, tiny_folder

    from pipeline.signing import ExpectedSigner, key_signer, verify_stage

    target = tmp_path / "stage"
    stage(tiny_folder(tmp_path / "model"), target, signer=key_signer(keys["private"], target))
    assert (target / "signing_key.pub").read_bytes() == keys["public"].read_bytes()
    listed = parse_manifest((target / "MANIFEST.sha256").read_bytes())
    assert "signing_key.pub" in listed and "model.sig" not in listed
    assert verify_stage(target, ExpectedSigner(verify_key=keys["public"])) is not None
    assert "## Signature" in (target / "README.md").read_text(encoding="utf-8")


@SIGNED_RUN
def test_the_private_key_is_never_staged_or_printed(signed_run, keys):
    run, result = signed_run
    secret = keys["private"].read_bytes()
    body = b"".join(line for line in secret.splitlines()[1:-1])
    for path in (p for p in run.stage.rglob("*") if p.is_file()):
        data = path.read_bytes()
        assert b"PRIVATE KEY" not in data and body[:40] not in data, path.name
    assert "PRIVATE KEY" not in result.stdout + result.stderr and body[:40].decode() not in result.stdout


def test_an_unsigned_stage_says_so_in_its_card(staged_run):
    card = (staged_run.stage / "README.md").read_text()
    assert "This repo is **not signed**" in card
    assert not (staged_run.stage / "model.sig").exists()


def test_a_key_inside_the_stage_or_of_an_unsupported_kind_is_refused(evaluated_run, run_copy, tmp_path):
    run = run_copy(evaluated_run)
    run.ok("05_stage.py")
    before = {
        p.relative_to(run.stage).as_posix(): p.read_bytes() for p in run.stage.rglob("*") if p.is_file()
    }
    inside, _ = write_key(tmp_path, "inside")
    shutil.copy(inside, run.stage / "key.pem")
    line = run.refused("05_stage.py", "--sign-key", str(run.stage / "key.pem"))
    assert "is inside the stage" in line and "PRIVATE" not in line
    (run.stage / "key.pem").unlink()
    edwards, _ = write_key(tmp_path, "edwards", ed25519.Ed25519PrivateKey.generate())
    line = run.refused("05_stage.py", "--sign-key", str(edwards))
    assert "ECDSA keys only" in line
    assert {
        p.relative_to(run.stage).as_posix(): p.read_bytes() for p in run.stage.rglob("*") if p.is_file()
    } == before


def test_sigstore_keyless_signing_refuses_in_one_line_when_offline(evaluated_run, run_copy, tmp_path):
    run = run_copy(evaluated_run)
    # Offline: every HTTPS request goes to a closed local port.
    offline = {
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "NO_PROXY": "",
        "HOME": str(tmp_path),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "XDG_DATA_HOME": str(tmp_path / "data"),
    }
    line = run.refused("05_stage.py", "--sign-sigstore", env=offline)
    assert "Sigstore keyless signing needs network access" in line and "--sign-key" in line
    assert not run.stage.exists()


@SIGNED_RUN
@pytest.mark.heavy
def test_signed_publish_verifies_with_the_cards_own_recipe_in_a_new_virtualenv_and_one_flipped_byte_fails(
    signed_run, keys, hub, tmp_path
):
    """Acceptance: in a new virtualenv holding only what the card's pip line installs, the
    card's download step and verify command exit 0 as printed; the same command verifies the
    Hub-cache folder (symlinks) that the card's loading snippet downloads into. (Without
    pyopenssl, which model-signing 1.1.1 imports but does not declare, the verify command
    fails in such an environment: tests/mutation/publish.toml plants exactly that.)"""
    from fresh_venv import fresh_venv

    run, _ = signed_run
    result = run_publish(
        run.stage, hub, "alice/signed", tmp_path / "receipts", "--sign-key", str(keys["private"])
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"key fingerprint {fingerprint(keys['public'])}" in result.stdout
    assert (
        len(commit_titles(hub, "alice/signed")) == 2
    )  # "initial commit" + ours: the signature in the same one
    [receipt] = (tmp_path / "receipts").glob("*.json")
    record = json.loads(receipt.read_text())
    assert record["signature"]["fingerprint"] == fingerprint(keys["public"])
    assert record["files"]["model.sig"]["ok"]

    install, download, verify = card_recipe((run.stage / "README.md").read_text())
    requirements = install.split()[2:]
    user = tmp_path / "user"
    user.mkdir()

    def as_user(line: str, bin_dir: Path) -> subprocess.CompletedProcess:
        env = {
            key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))
        }
        env.update(
            PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            VIRTUAL_ENV=str(bin_dir.parent),
            HF_ENDPOINT=hub.url,
            HF_TOKEN=TOKEN,
            HF_HOME=str(tmp_path / "user_hf_home"),
        )
        return subprocess.run(
            line, shell=True, cwd=user, env=env, capture_output=True, text=True, timeout=180
        )

    clean = fresh_venv(tmp_path / "venv", requirements)
    for line in (download, verify):
        ran = as_user(line, clean)
        assert ran.returncode == 0, f"{line}\n{ran.stdout}\n{ran.stderr}"
    cached = as_user(
        "python -c 'from huggingface_hub import snapshot_download; print(snapshot_download(\"alice/signed\"))'",
        clean,
    ).stdout.strip()
    assert Path(cached, "modelo.safetensors").is_symlink()
    ran = as_user(verify.replace(" model/", f" {cached}/").removesuffix(" model") + f" {cached}", clean)
    assert ran.returncode == 0, ran.stdout + ran.stderr

    local = user / "model"
    assert (local / ".gitattributes").exists() and (local / ".cache").is_dir()
    weights = local / "modelo.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    tampered = stock_verify(keys["public"], local)
    assert tampered.returncode != 0 and "modelo.safetensors" in tampered.stdout + tampered.stderr


def regenerate_manifest(stage: Path) -> None:
    """What someone editing the stage by hand would do: `sha256sum` over the listed files still there."""
    names = sorted(
        n for n in parse_manifest((stage / "MANIFEST.sha256").read_bytes()) if (stage / n).exists()
    )
    (stage / "MANIFEST.sha256").write_text(
        "".join(f"{hashlib.sha256((stage / n).read_bytes()).hexdigest()}  {n}\n" for n in names)
    )


@SIGNED_RUN
@pytest.mark.parametrize(
    "case", ["edited_after_signing", "another_key_given_to_06", "signature_removed", "unsigned_but_key_given"]
)
def test_06_refuses_a_stage_whose_signature_does_not_verify_and_commits_nothing(
    signed_run, keys, run_copy, hub, tmp_path, case
):
    run = run_copy(signed_run[0])
    args = ["--sign-key", str(keys["private"])]
    if case == "edited_after_signing":
        with open(run.stage / "README.md", "a") as card:
            card.write("\nOne more line.\n")
        regenerate_manifest(run.stage)
    elif case == "another_key_given_to_06":
        args = ["--verify-key", str(keys["other_public"])]
    elif case == "signature_removed":
        (run.stage / "model.sig").unlink()
    else:  # the stage as an unsigned 05 writes it, checked against a key
        (run.stage / "model.sig").unlink()
        (run.stage / "signing_key.pub").unlink(missing_ok=True)
        regenerate_manifest(run.stage)
        args = ["--verify-key", str(keys["public"])]
    line = one_error_line(run_publish(run.stage, hub, "alice/signed", tmp_path / "receipts", *args))
    expected = {
        "edited_after_signing": "does not verify with --sign-key",
        "another_key_given_to_06": "signed with another key",
        "signature_removed": "no model.sig",
        "unsigned_but_key_given": "05_stage.py --sign-key",
    }[case]
    assert expected in line, line
    assert write_requests(hub) == 0 and hub.count() == 0
    assert not (tmp_path / "receipts").exists()


def write_certificates(folder: Path, leaf_key_path: Path) -> tuple[Path, Path]:
    """A root CA (self-signed) and a code-signing certificate for the key at ``leaf_key_path``."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"test root {folder.name}")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    leaf_key = serialization.load_pem_private_key(leaf_key_path.read_bytes(), password=None)
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "model publisher")]))
        .issuer_name(ca_name)
        .public_key(leaf_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_path, leaf_path = folder / "root-ca.crt", folder / "publisher.crt"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    leaf_path.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    return ca_path, leaf_path


@pytest.mark.heavy
def test_certificate_signed_stage_publishes_with_its_root_and_is_refused_under_another_ca(
    evaluated_run, run_copy, keys, hub, tmp_path
):
    run = run_copy(evaluated_run)
    (tmp_path / "ours").mkdir()
    (tmp_path / "theirs").mkdir()
    root, certificate = write_certificates(tmp_path / "ours", keys["private"])
    other_root, _ = write_certificates(tmp_path / "theirs", keys["private"])
    run.ok(
        "05_stage.py",
        "--sign-key",
        str(keys["private"]),
        "--sign-certificate",
        str(certificate),
        "--sign-chain",
        str(root),
    )
    assert "model_signing verify certificate --certificate_chain" in (run.stage / "README.md").read_text()
    cli = subprocess.run(
        [
            str(CLI),
            "verify",
            "certificate",
            "--certificate_chain",
            str(root),
            "--signature",
            str(run.stage / "model.sig"),
            str(run.stage),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    line = one_error_line(
        run_publish(run.stage, hub, "alice/cert", tmp_path / "r1", "--verify-chain", str(other_root))
    )
    assert "does not verify against --verify-chain" in line and hub.count() == 0
    result = run_publish(run.stage, hub, "alice/cert", tmp_path / "r2", "--verify-chain", str(root))
    assert result.returncode == 0, result.stdout + result.stderr
    [receipt] = (tmp_path / "r2").glob("*.json")
    signature = json.loads(receipt.read_text())["signature"]
    assert signature["kind"] == "certificate" and signature["fingerprint"] == fingerprint(keys["public"])
