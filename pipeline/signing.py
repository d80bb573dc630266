"""Sign a stage with OpenSSF model signing, and verify it before publishing (optional extra ``[sign]``).

05 ``--sign-key`` writes ``signing_key.pub`` (listed in the manifest) and ``model.sig``, made
last over every other file, the manifest included; 06 verifies it before any request. The
private key is read where it lies, never copied, printed or staged. Torch-free; model-signing
is imported lazily. User guide: docs/stage.md, "Signed publications".
"""

from __future__ import annotations

import base64
import hashlib
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .commands import step_command
from .errors import SigningError
from .layout import PUBLIC_KEY_FILE, SIGNATURE_FILE

__all__ = [
    "SIGNATURE_FILE",
    "PUBLIC_KEY_FILE",
    "VERIFY_REQUIREMENTS",
    "StageSigner",
    "ExpectedSigner",
    "SignatureCheck",
    "key_signer",
    "sigstore_signer",
    "sign_stage",
    "verify_stage",
    "card_section",
]

_SUPPORTED_CURVES = ("secp256r1", "secp384r1", "secp521r1")
_EXTRA = "install the signing extra: pip install -e '.[sign]' (model-signing)"
_MAX_KEY_FILE = 64 * 1024


@dataclass(frozen=True, slots=True)
class StageSigner:
    """How 05 signs: with a private key file (offline), or with Sigstore (online)."""

    key_path: Path | None
    """The private key's path (never its content), or None for Sigstore."""
    public_pem: bytes | None
    """The public key staged as signing_key.pub (None for Sigstore)."""
    fingerprint: str | None
    """``sha256:<hex>`` of the public key (None for Sigstore)."""
    certificate: bool = False
    """The signature carries a certificate chain (05 --sign-certificate)."""
    config: Any = field(default=None, repr=False, compare=False)
    """model_signing's signing configuration, ready to sign."""


@dataclass(kw_only=True, slots=True)
class ExpectedSigner:
    """Who 06 expects to have signed the stage (all None: the stage's own public key, if signed)."""

    sign_key: Path | None = None
    """The private key 05 signed with; only its public half is used."""
    verify_key: Path | None = None
    """The signer's public key (PEM), e.g. from a channel you trust."""
    identity: str | None = None
    """Sigstore: the signer's identity (e.g. an e-mail address)."""
    issuer: str | None = None
    """Sigstore: the OpenID issuer of that identity."""
    verify_chain: tuple[Path, ...] = ()
    """Certificate signatures: the trusted root (and intermediate) CA certificates, PEM."""

    @property
    def given(self) -> bool:
        return bool(self.verify_chain) or any(
            value is not None for value in (self.sign_key, self.verify_key, self.identity, self.issuer)
        )


@dataclass(frozen=True, slots=True)
class SignatureCheck:
    """A verified stage signature, for the receipt and 06's report."""

    kind: str
    """``key`` or ``sigstore``."""
    fingerprint: str | None
    """The public key's ``sha256:<hex>`` fingerprint (key signatures)."""
    key_source: str
    """Where the expected key came from (``--sign-key``, ``--verify-key`` or the stage)."""


def _model_signing() -> Any:
    try:
        import model_signing.hashing
        import model_signing.signing
        import model_signing.verifying
    except ImportError as exc:
        raise SigningError(
            f"signing needs model-signing, which is not installed ({exc.name} missing): {_EXTRA}"
        ) from None
    return model_signing


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import serialization

        return serialization
    except ImportError:
        raise SigningError(f"signing needs the cryptography package: {_EXTRA}") from None


def _fingerprint(public_key: Any) -> str:
    serialization = _crypto()
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(der).hexdigest()


def _public_pem(public_key: Any) -> bytes:
    serialization = _crypto()
    return public_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _read_key_file(path: Path, what: str) -> bytes:
    try:
        size = path.stat().st_size
        if size > _MAX_KEY_FILE:
            raise SigningError(f"{what} {path} is {size} bytes, too large for a PEM key")
        return path.read_bytes()
    except FileNotFoundError:
        raise SigningError(f"{what} {path} not found") from None
    except IsADirectoryError:
        raise SigningError(f"{what} {path} is a folder, not a PEM key file") from None
    except OSError as exc:
        raise SigningError(f"{what} {path} cannot be read: {exc.strerror}") from None


def _check_curve(public_key: Any, path: Path, what: str) -> None:
    from cryptography.hazmat.primitives.asymmetric import ec

    if not isinstance(public_key, ec.EllipticCurvePublicKey):
        raise SigningError(
            f"{what} {path} is a {type(public_key).__name__.removeprefix('_')} key: model-signing "
            f"1.1.1 signs with ECDSA keys only ({', '.join(_SUPPORTED_CURVES)}); make one with "
            "`openssl ecparam -name prime256v1 -genkey -noout -out key.pem`"
        )
    if public_key.curve.name not in _SUPPORTED_CURVES:
        raise SigningError(
            f"{what} {path} uses curve {public_key.curve.name}; model-signing 1.1.1 accepts "
            f"{', '.join(_SUPPORTED_CURVES)}"
        )


def _load_private_key(path: Path) -> Any:
    serialization = _crypto()
    data = _read_key_file(path, "--sign-key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise SigningError(
            f"--sign-key {path} is encrypted; model-signing reads unencrypted PEM keys here: "
            "decrypt a copy with `openssl ec -in KEY -out PLAIN` kept outside the stage"
        ) from None
    except (ValueError, Exception):
        raise SigningError(f"--sign-key {path} is not a PEM private key") from None
    _check_curve(key.public_key(), path, "--sign-key")
    return key


def _load_public_key(path: Path) -> Any:
    serialization = _crypto()
    data = _read_key_file(path, "--verify-key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, Exception):
        raise SigningError(
            f"--verify-key {path} is not a PEM public key (a private key goes to --sign-key)"
        ) from None
    _check_curve(key, path, "--verify-key")
    return key


def key_signer(
    key_path: str | Path,
    stage_dir: str | Path,
    *,
    certificate: str | Path | None = None,
    chain: tuple[str | Path, ...] = (),
) -> StageSigner:
    """A signer for ``key_path`` (with its ``certificate`` and intermediate ``chain``, when
    given); refuses a key kept inside the stage (it would be uploaded)."""
    path = Path(key_path)
    if path.resolve().is_relative_to(Path(stage_dir).resolve()):
        raise SigningError(
            f"--sign-key {path} is inside the stage {stage_dir}/, which is published: keep the "
            "private key outside it; nothing was staged"
        )
    public = _load_private_key(path).public_key()
    ms = _model_signing()
    if certificate is None:
        config = ms.signing.Config().use_elliptic_key_signer(private_key=path)
    else:
        for pem in (certificate, *chain):
            _read_key_file(Path(pem), "certificate")
        try:
            config = ms.signing.Config().use_certificate_signer(
                private_key=path,
                signing_certificate=Path(certificate),
                certificate_chain=[Path(c) for c in chain],
            )
        except ValueError as exc:  # e.g. the certificate is not for this key
            raise SigningError(
                f"--sign-certificate {certificate}: {' '.join(str(exc).split())[:200]}"
            ) from None
    return StageSigner(
        key_path=path,
        public_pem=_public_pem(public),
        fingerprint=_fingerprint(public),
        certificate=certificate is not None,
        config=config,
    )


def _sigstore_failure(exc: Exception, doing: str) -> SigningError:
    detail = " ".join(str(exc).split())[:200] or type(exc).__name__
    return SigningError(
        f"Sigstore keyless {doing} needs network access to Sigstore's services and an OpenID "
        f"identity, and failed: {detail}; offline, sign with --sign-key"
    )


def sigstore_signer() -> StageSigner:
    """A Sigstore keyless signer (online: fetches Sigstore's trust root now, asks for an identity when signing)."""
    ms = _model_signing()
    try:
        config = ms.signing.Config().use_sigstore_signer()
    except Exception as exc:  # sigstore raises its own network and TUF errors
        raise _sigstore_failure(exc, "signing") from None
    return StageSigner(key_path=None, public_pem=None, fingerprint=None, config=config)


def _hashing_config(ms: Any) -> Any:
    # The signature file is the one staged file the signature cannot cover.
    return ms.hashing.Config().set_ignored_paths(paths=[SIGNATURE_FILE])


def sign_stage(folder: Path, signer: StageSigner) -> None:
    """Write ``folder/model.sig`` over every other file in ``folder`` (MANIFEST.sha256 included)."""
    ms = _model_signing()
    try:
        signer.config.set_hashing_config(_hashing_config(ms)).sign(folder, folder / SIGNATURE_FILE)
    except Exception as exc:
        if signer.key_path is None:
            raise _sigstore_failure(exc, "signing") from None
        raise SigningError(
            f"signing {folder.name}/ with {signer.key_path} failed: {exc}; nothing was staged"
        ) from None


def _bundle_material(path: Path) -> tuple[str, dict]:
    """``key`` for a bundle made with a bare key, ``certificate`` for one with a certificate
    chain (05 --sign-certificate), ``sigstore`` for a keyless one; and its material."""
    try:
        material = json.loads(path.read_bytes())["verificationMaterial"]
        if not isinstance(material, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise SigningError(f"{path} is not a model-signing signature (a Sigstore bundle in JSON)") from None
    if "publicKey" in material:
        return "key", material
    return ("certificate" if "x509CertificateChain" in material else "sigstore"), material


def _certificate_key(material: dict, signature: Path) -> Any:
    """The public key of the signing certificate in the bundle (checked by model-signing first)."""
    from cryptography import x509

    try:
        raw = material["x509CertificateChain"]["certificates"][0]["rawBytes"]
        return x509.load_der_x509_certificate(base64.b64decode(raw)).public_key()
    except (KeyError, IndexError, TypeError, ValueError):
        raise SigningError(f"{signature} holds no readable signing certificate") from None


def _expected_key(stage: Path, expected: ExpectedSigner) -> tuple[Any, str]:
    if expected.sign_key is not None:
        return _load_private_key(expected.sign_key).public_key(), f"--sign-key {expected.sign_key}"
    if expected.verify_key is not None:
        return _load_public_key(expected.verify_key), f"--verify-key {expected.verify_key}"
    return _load_public_key(stage / PUBLIC_KEY_FILE), f"the stage's own {PUBLIC_KEY_FILE} (integrity only)"


def verify_stage(stage: Path, expected: ExpectedSigner | None = None) -> SignatureCheck | None:
    """Check ``stage/model.sig`` against every staged file; None for an unsigned stage.

    The expected key is the public half of ``expected.sign_key``, else ``verify_key``, else
    the stage's own ``signing_key.pub`` (which proves integrity, not who signed). A Sigstore
    bundle needs ``identity`` and ``issuer`` and network access. Raises :class:`SigningError`
    when the stage is unsigned but a signer was expected, or the signature does not verify.
    """
    expected = expected or ExpectedSigner()
    identity, issuer = expected.identity, expected.issuer
    signature = stage / SIGNATURE_FILE
    if not signature.is_file():
        if (stage / PUBLIC_KEY_FILE).exists():
            raise SigningError(
                f"{stage}/ holds {PUBLIC_KEY_FILE} but no {SIGNATURE_FILE}: the signature was "
                "removed after staging; stage again with --sign-key"
            )
        if expected.given:
            raise SigningError(
                f"{stage}/ is not signed ({SIGNATURE_FILE} missing) but a key or identity was "
                f"given to check it: stage with {step_command('05_stage.py')} --sign-key"
            )
        return None
    ms = _model_signing()
    kind, material = _bundle_material(signature)
    config = ms.verifying.Config().set_hashing_config(_hashing_config(ms))
    if kind == "certificate":
        return _verify_certificate(stage, signature, material, config, expected)
    if kind == "sigstore":
        if not (identity and issuer):
            raise SigningError(
                f"{signature} is a Sigstore (keyless) signature: pass --verify-identity and "
                "--verify-issuer to check who signed it"
            )
        try:
            config.use_sigstore_verifier(identity=identity, oidc_issuer=issuer)
            config.verify(stage, signature)
        except Exception as exc:
            raise _sigstore_failure(exc, "verification") from None
        return SignatureCheck(kind="sigstore", fingerprint=None, key_source=f"identity {identity} ({issuer})")
    public, source = _expected_key(stage, expected)
    fingerprint = _fingerprint(public)
    staged_pem = stage / PUBLIC_KEY_FILE
    if not staged_pem.is_file() or _fingerprint(_load_public_key(staged_pem)) != fingerprint:
        raise SigningError(
            f"{stage}/{PUBLIC_KEY_FILE} is missing or is not the key of {source} "
            f"({fingerprint}): the stage was signed with another key"
        )
    with tempfile.TemporaryDirectory(prefix="verify-key-") as scratch:
        key_file = Path(scratch) / "key.pub"
        key_file.write_bytes(_public_pem(public))
        try:
            config.use_elliptic_key_verifier(public_key=key_file).verify(stage, signature)
        except Exception as exc:
            detail = " ".join(str(exc).split())[:300]
            raise SigningError(
                f"{signature} does not verify with {source} ({fingerprint}): {detail}; the stage "
                "was changed after signing or signed with another key"
            ) from None
    return SignatureCheck(kind="key", fingerprint=fingerprint, key_source=source)


def _verify_certificate(
    stage: Path, signature: Path, material: dict, config: Any, expected: ExpectedSigner
) -> SignatureCheck:
    if not expected.verify_chain:
        raise SigningError(
            f"{signature} is signed with a certificate: pass --verify-chain with the root CA "
            "certificate you trust (PEM) to check it"
        )
    try:
        config.use_certificate_verifier(certificate_chain=list(expected.verify_chain)).verify(
            stage, signature
        )
    except Exception as exc:
        detail = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise SigningError(
            f"{signature} does not verify against --verify-chain: {detail}; the stage was changed "
            "after signing or signed under another CA"
        ) from None
    fingerprint = _fingerprint(_certificate_key(material, signature))
    staged_pem = stage / PUBLIC_KEY_FILE
    if not staged_pem.is_file() or _fingerprint(_load_public_key(staged_pem)) != fingerprint:
        raise SigningError(
            f"{stage}/{PUBLIC_KEY_FILE} is missing or is not the certificate's key ({fingerprint})"
        )
    if expected.sign_key is not None or expected.verify_key is not None:
        public, source = _expected_key(stage, expected)
        if _fingerprint(public) != fingerprint:
            raise SigningError(
                f"{signature} was signed by the certificate of key {fingerprint}, not by the key of {source}"
            )
    return SignatureCheck(
        kind="certificate",
        fingerprint=fingerprint,
        key_source=f"certificate chain {', '.join(str(p) for p in expected.verify_chain)}",
    )


# What the card's verify recipe installs: model-signing 1.1.1 imports OpenSSL (pyopenssl)
# without declaring it, and `hf download` comes with huggingface_hub.
VERIFY_REQUIREMENTS = ("huggingface_hub", "model-signing==1.1.1", "pyopenssl")
_FOLDER = "model"


def card_section(signer: StageSigner | None, repo_id: str | None = None) -> str:
    """The model card's "Signature" section: signed or not, the fingerprint, and how to
    verify on a clean machine (install, download, verify: each line runs as printed)."""
    if signer is None:
        return (
            "## Signature\n\nThis repo is **not signed**. The SHA-256 values above prove only that the files "
            "match each other, not who published them."
        )
    # --ignore-paths: the bookkeeping a --local-dir download leaves; --allow_symlinks: a
    # snapshot_download folder in the Hub cache (the loading snippet's) is made of symlinks.
    tail = (
        f"--signature {_FOLDER}/{SIGNATURE_FILE} --ignore-paths {_FOLDER}/.cache --allow_symlinks {_FOLDER}"
    )
    command = f"model_signing verify key --public_key {_FOLDER}/{PUBLIC_KEY_FILE} {tail}"
    if signer.certificate:
        command = (
            f"model_signing verify certificate --certificate_chain <root CA certificate you trust> {tail}"
        )
    if signer.fingerprint is None:
        command = (
            f"model_signing verify sigstore --identity <signer identity> --identity_provider <issuer> {tail}"
        )
        how = (
            "signed with [OpenSSF model signing](https://github.com/sigstore/model-transparency) through "
            "Sigstore (keyless): the signer's identity is in the certificate inside `model.sig`."
        )
    else:
        how = (
            f"signed with [OpenSSF model signing](https://github.com/sigstore/model-transparency) using an ECDSA "
            f"key whose public key fingerprint is `{signer.fingerprint}` (SHA-256 of its DER "
            f"SubjectPublicKeyInfo). `{PUBLIC_KEY_FILE}` is published beside the weights for integrity; for "
            "authenticity, take the public key from a channel you trust, or check that "
            f"`openssl pkey -pubin -in {PUBLIC_KEY_FILE} -outform DER | sha256sum` prints that fingerprint."
        )
        if signer.certificate:
            how += (
                " The signature also carries the key's certificate chain: check it against a root CA you "
                "trust with the command below."
            )
    download = (
        f"hf download {repo_id} --local-dir {_FOLDER}  # --revision <commit> for a fixed commit"
        if repo_id
        else f"hf download <this repository's id> --local-dir {_FOLDER}"
    )
    steps = f"pip install {' '.join(VERIFY_REQUIREMENTS)}\n{download}\n{command}"
    return (
        f"## Signature\n\nThis repo is {how} `{SIGNATURE_FILE}` covers every file (this card and "
        "`MANIFEST.sha256` included) except itself; the Hub's `.gitattributes` is ignored by the tool.\n\n"
        f"Verify on any machine, in a new virtual environment:\n\n```sh\n{steps}\n```\n\n"
        f"To verify the folder the loading snippet above downloaded, use its path (`folder`) for `{_FOLDER}`; "
        f"where you have a trusted copy of the public key, use it in place of `{_FOLDER}/{PUBLIC_KEY_FILE}`."
    )
