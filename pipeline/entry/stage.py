"""Stage the last verified checkpoint for the Hub: weights, record, card, curve, manifest.

    python scripts/05_stage.py                          # newest committed checkpoint -> hub_stage/
    python scripts/05_stage.py --config examples/charlm/config.yaml   # -> runs/charlm/hub_stage/
    python scripts/05_stage.py --checkpoint estados_local/step-00000010 --stage hub_stage
    python scripts/05_stage.py --checkpoint-dir runs/ft     # latest in 02's --checkpoint-dir
    python scripts/05_stage.py --no-metrics             # stage without running 04 first
    python scripts/05_stage.py --repo-id you/regression-mlp   # name the repo in the card's snippet
    python scripts/05_stage.py --max-shard-size 2GB     # modelo-0000i-of-0000N.safetensors + index
    python scripts/05_stage.py --proof runs/proof       # ship the resume proof; the card states its verdict
    cd hub_stage && sha256sum -c MANIFEST.sha256        # check the stage with standard tools
    python scripts/05_stage.py --sign-key ~/keys/release.pem  # sign it (pip install -e '.[sign]')
    python scripts/05_stage.py --from-folder out/checkpoint-500 --repo-id you/model  # what another tool wrote

Every checkpoint file is verified against its meta.json, the weights must fit the model
the checkpoint's config builds, the stage is built in a hidden sibling folder (the weights
one tensor at a time), audited, scanned for tokens, and only then renamed into place.
Nothing is uploaded. Refuses (exit 2, previous stage untouched) on a hash mismatch, weights
that do not fit the model, NaN/inf weights (unless --allow-nonfinite), a file above the
Hub's 50 GB maximum, a token, private key, home folder, absolute path or host name in a
staged file, or a metrics.json that was computed for other weights. docs/stage.md says more.

--sign-key signs the stage with OpenSSF model signing (an ECDSA P-256/384/521 private key
in PEM, kept outside the stage; it is read, never copied): model.sig and signing_key.pub
join the stage and the card says how to verify; --sign-certificate (with --sign-chain, the
issuing CA certificates up to the root) puts the key's certificate chain in the signature.
--sign-sigstore signs keylessly through Sigstore instead (online only).

--from-folder DIR stages a folder another tool wrote instead of a checkpoint: a save_pretrained
folder, a Trainer checkpoint-N, or safetensors weights beside a config.json (pickled weights
are refused). Only the config's card section and stage folder apply, and without --config none
is read; --metrics then names a JSON object of metrics to show as supplied (docs/other-trainers.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from ..audit import format_audit_table
from ..cli import add_checkpoint_dir_argument, add_config_arguments, config_from_args, stopping
from ..commands import record_stage_command
from ..config import Config, parse_set_overrides
from ..errors import shown
from ..layout import MANIFEST_FILE
from ..signing import StageSigner, key_signer, sigstore_signer
from ..stage import StageBuild, build_stage
from ..stage.build import StageResult
from ..stage.from_folder import FolderStage, folder_config, stage_folder
from ..stage.weights import DEFAULT_MAX_SHARD_SIZE, large_blocks_to_the_os
from . import step_parser


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    # The command 06's refusals repeat is this one, as given (sys.argv, no abbreviations).
    parser = step_parser(__doc__, prog)
    add_config_arguments(parser)
    parser.set_defaults(config=None)  # config.yaml, unless --from-folder (no config of ours needed)
    add_checkpoint_dir_argument(parser)
    parser.add_argument(
        "--checkpoint",
        default="latest",
        metavar="latest|best|PATH",
        help="checkpoint to stage (default: the newest committed one in checkpoint.dir; best: the one "
        "checkpoint.best_metric marked)",
    )
    parser.add_argument(
        "--stage",
        type=Path,
        help="stage folder (default: the config's outputs.stage, hub_stage for config.yaml)",
    )
    parser.add_argument(
        "--metrics",
        type=Path,
        help="metrics from scripts/04_evaluate.py (default: the config's outputs.metrics, "
        "metrics.json for config.yaml)",
    )
    parser.add_argument("--no-metrics", action="store_true", help="stage without metrics; the card says so")
    parser.add_argument("--allow-nonfinite", action="store_true", help="stage weights that hold NaN or inf")
    parser.add_argument(
        "--repo-id",
        metavar="NAMESPACE/NAME",
        help="repository the card's snippets download from (without it the card names none)",
    )
    signing = parser.add_mutually_exclusive_group()
    signing.add_argument(
        "--sign-key",
        type=Path,
        metavar="KEY.pem",
        help="sign the stage with this ECDSA private key (PEM, outside the stage)",
    )
    signing.add_argument(
        "--sign-sigstore",
        action="store_true",
        help="sign keylessly with Sigstore (needs network and an OpenID identity)",
    )
    parser.add_argument(
        "--sign-certificate",
        type=Path,
        metavar="CERT.pem",
        help="with --sign-key: the key's certificate, carried in the signature",
    )
    parser.add_argument(
        "--sign-chain",
        type=Path,
        action="append",
        default=[],
        metavar="CA.pem",
        help="with --sign-certificate: an issuing CA certificate, up to the root (repeatable)",
    )
    parser.add_argument(
        "--proof",
        type=Path,
        metavar="DIR",
        help="stage the resume proof in DIR (scripts/03_verify_resume.py --output) if it proves "
        "this checkpoint's config, code and data",
    )
    parser.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        metavar="SIZE",
        help="split the weights into modelo-0000i-of-0000N.safetensors files of at most SIZE "
        f"(e.g. 5GB, 500MB; default {DEFAULT_MAX_SHARD_SIZE}, as save_pretrained; the Hub "
        "refuses files above 50GB)",
    )
    parser.add_argument(
        "--from-folder",
        type=Path,
        metavar="DIR",
        help="stage a model folder another tool wrote (save_pretrained, a Trainer checkpoint-N, "
        "safetensors weights + config.json) instead of a checkpoint",
    )
    args = parser.parse_args(argv)
    if args.from_folder is not None and (
        args.checkpoint != "latest" or args.checkpoint_dir or args.proof or args.no_metrics
    ):
        parser.error(
            "--from-folder stages a folder, not a checkpoint: drop --checkpoint, --checkpoint-dir, --proof, "
            "--no-metrics"
        )
    if (args.sign_certificate or args.sign_chain) and args.sign_key is None:
        parser.error("--sign-certificate and --sign-chain need --sign-key (the certificate's private key)")
    if bool(args.sign_certificate) != bool(args.sign_chain):
        # model-signing 1.1.1 cannot sign with a certificate and an empty chain.
        parser.error("--sign-certificate needs --sign-chain (the issuing CA certificates, up to the root)")
    large_blocks_to_the_os()  # staging holds about one tensor; freed buffers must leave too
    from_folder = args.from_folder is not None and args.config is None
    if from_folder:
        config = folder_config(parse_set_overrides(args.set))
    else:
        config = config_from_args(args, {"checkpoint.dir": args.checkpoint_dir})
    stage = args.stage or Path(config.outputs.stage)
    signer = None
    if args.sign_key is not None:
        signer = key_signer(
            args.sign_key, stage, certificate=args.sign_certificate, chain=tuple(args.sign_chain)
        )
    elif args.sign_sigstore:
        signer = sigstore_signer()
    # A stop before the stage is in place undoes it; one as it is committed or after is told so.
    built = (
        f"the stage was built into {stage}/ before the stop; check it with: "
        f"cd {stage} && sha256sum -c MANIFEST.sha256"
    )
    with stopping("what was being staged was removed; an earlier stage is as it was", committed=built):
        result = _stage(args, config, stage, signer)
    with stopping(built):
        _report(result, signer)
    return 0


def _report(result: StageResult, signer: StageSigner | None) -> None:
    record_stage_command(result.stage, sys.argv, result.files[MANIFEST_FILE].sha256)
    for change in result.code_changes:
        print(
            f"warning: {change.describe()}; staged anyway, since this stage ships no code and the weights "
            "fit the model the code builds now (recorded in meta.json provenance.code_changes and on the card)",
            file=sys.stderr,
        )
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if result.nonfinite:
        print(
            f"warning: staged with non-finite tensors: {', '.join(map(shown, result.nonfinite))}",
            file=sys.stderr,
        )
    print(format_audit_table(result.report))
    metrics = "with metrics" if result.with_metrics else "without metrics"
    what = "the model" if result.step is None else f"step {result.step}"
    print(
        f"staged {what} from {shown(result.source)} into {result.stage}/ ({metrics}); "
        f"check it with: cd {result.stage} && sha256sum -c MANIFEST.sha256"
    )
    if signer is not None:
        print(
            f"signed: {result.stage}/model.sig, key fingerprint {signer.fingerprint or 'Sigstore identity'}"
        )


def _stage(args: argparse.Namespace, config: Config, stage: Path, signer: StageSigner | None) -> StageResult:
    if args.from_folder is not None:
        return stage_folder(
            config,
            FolderStage(
                folder=args.from_folder,
                stage_dir=stage,
                metrics=args.metrics,
                allow_nonfinite=args.allow_nonfinite,
                repo_id=args.repo_id,
                max_shard_size=args.max_shard_size,
                signer=signer,
            ),
        )
    return build_stage(
        config,
        StageBuild(
            checkpoint=args.checkpoint,
            stage_dir=stage,
            with_metrics=not args.no_metrics,
            metrics=args.metrics,
            allow_nonfinite=args.allow_nonfinite,
            repo_id=args.repo_id,
            max_shard_size=args.max_shard_size,
            proof=args.proof,
            signer=signer,
        ),
    )
