"""Publish hub_stage/ to the Hugging Face Hub as ONE audited commit, then verify what landed.

    HF_TOKEN=hf_... python scripts/06_publish.py --repo-id you/regression-mlp
    python scripts/06_publish.py --repo-id you/regression-mlp --dry-run        # plan only, no write request
    python scripts/06_publish.py --repo-id you/regression-mlp --private --message "First release"
    python scripts/06_publish.py --repo-id you/models --path-in-repo regression-mlp --revision staging
    python scripts/06_publish.py --repo-id demo/m --endpoint http://127.0.0.1:8080          # a local Hub
    python scripts/06_publish.py --repo-id you/regression-mlp --verify-key release.pub   # signed stage
    python scripts/06_publish.py --repo-id you/charlm --config examples/charlm/config.yaml  # its outputs.stage

The token is read from HF_TOKEN or the one saved by `hf auth login`; it is never a command-line
argument and is never printed or written. Every staged file is re-audited against
MANIFEST.sha256 and scanned again for tokens, credentials, private keys and this machine's
paths and host name, in one read (the stage may have changed since 05); a signed stage's
model.sig must verify with the key of --sign-key, --verify-key, or else the stage's own
signing_key.pub. Only then is any request sent. The repo is created if missing, and one commit
holding the whole stage is made on top of the branch head that was read (a push in between
fails with 412 instead of being overwritten). A rerun when the Hub already holds the stage
makes no commit. After landing, the Hub's LFS SHA-256s and Xet hashes are checked against the
audit (the weights are not downloaded again), the small files downloaded and hashed, and a
receipt (with the signing key's fingerprint) is written to hub_receipts/ beside the stage
(runs/<name>/hub_receipts/ for another config than config.yaml).

--timeout bounds the whole publish (default: the default publish timeout, docs/publishing.md):
no request or retry starts after it, the Xet client's retries are capped by it, and when it
passes whatever still runs is cut, however slowly a server answers; if the commit was sent,
finding out whether it landed and verifying it get min(--timeout, 30 s) more. A commit
whose answer was lost is looked up on the branch: a landed commit is verified and reported
(exit 0); otherwise nothing was committed (exit 2). A rerun never makes a second commit.

Exit codes: 0 published, or nothing to publish; 1 published but the check after landing
failed, or the receipt could not be written; 2 not published (one line on stderr says why
and what to do).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from ..cli import script_command, stopping
from ..config import DEFAULT_CONFIG_PATH, Config, load_config
from ..errors import PipelineError
from ..layout import RECEIPT_DIR, STAGE_DIR
from . import step_parser


def _parse(argv: Sequence[str] | None, prog: str | None) -> argparse.Namespace:
    parser = step_parser(__doc__, prog)
    parser.add_argument("--repo-id", required=True, metavar="NAMESPACE/NAME", help="model repo to publish to")
    parser.add_argument(
        "--endpoint", metavar="URL", help="Hub URL (default: HF_ENDPOINT or https://huggingface.co)"
    )
    parser.add_argument(
        "--revision", default="main", metavar="BRANCH", help="branch to commit to (default: main)"
    )
    parser.add_argument(
        "--private", action="store_true", default=None, help="create the repo private (if missing)"
    )
    parser.add_argument(
        "--path-in-repo", default="", metavar="DIR", help="folder in the repo (default: the root)"
    )
    parser.add_argument(
        "--message", metavar="TEXT", help="commit title (default names the step and weights SHA-256)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the planned commit; send no write request"
    )
    parser.add_argument(
        "--create-pr",
        action="store_true",
        help="open a pull request against --revision instead of pushing to it",
    )
    parser.add_argument(
        "--tag", metavar="NAME", help="tag the published commit (a card can then pin revision=NAME)"
    )
    parser.add_argument(
        "--force-repo-id",
        action="store_true",
        help="publish even though the stage's card was staged for another --repo-id",
    )
    parser.add_argument(
        "--stage",
        type=Path,
        help=f"stage folder (default: the outputs.stage of --config; {STAGE_DIR} for config.yaml)",
    )
    parser.add_argument(
        "--config", type=Path, help="the config whose stage to publish (default: config.yaml)"
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="on a failure, print the traceback of the exception behind the one-line error",
    )
    parser.add_argument(
        "--receipt-dir",
        type=Path,
        help=f"where the receipt is written (default: {RECEIPT_DIR}/ beside the stage, with the config's "
        "other outputs)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="deadline of the whole publish in seconds (default: the default publish timeout, "
        "pipeline.publishing.default_timeout)",
    )
    signer = parser.add_argument_group("signature (stages signed by 05 --sign-key / --sign-sigstore)")
    keys = signer.add_mutually_exclusive_group()
    keys.add_argument(
        "--sign-key",
        type=Path,
        metavar="KEY.pem",
        help="the private key 05 signed with; its public half must verify model.sig",
    )
    keys.add_argument(
        "--verify-key", type=Path, metavar="PUB.pem", help="public key that must verify model.sig"
    )
    signer.add_argument(
        "--verify-chain",
        type=Path,
        action="append",
        default=[],
        metavar="CA.pem",
        help="certificate signatures: a trusted root or intermediate CA certificate (repeatable)",
    )
    signer.add_argument("--verify-identity", metavar="ID", help="Sigstore: the signer identity (online)")
    signer.add_argument(
        "--verify-issuer", metavar="URL", help="Sigstore: the identity's OpenID issuer (online)"
    )
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # Never echo unknown arguments: a mistyped flag may carry a secret.
        token_flag = any(arg.split("=", 1)[0] == "--token" for arg in unknown)
        reason = (
            "--token is not accepted" if token_flag else f"{len(unknown)} unrecognized argument(s), not shown"
        )
        raise PipelineError(
            f"{reason}: the token is read from HF_TOKEN or `hf auth login`, never from the command "
            "line; see --help"
        )
    # The stage of the config 05 ran with (config.yaml's by default; without it, the default name).
    # A refusal's fix rebuilds this stage: the command repeats --config and --stage.
    if args.config is not None:
        config = load_config(args.config)
    elif args.stage is None and DEFAULT_CONFIG_PATH.is_file():
        config = load_config(DEFAULT_CONFIG_PATH)
    else:
        config = Config()  # its outputs.stage is the default name, and it adds no --config
    args.restage = script_command(
        config, "05_stage.py", *(["--stage", str(args.stage)] if args.stage else [])
    )
    args.stage = args.stage or Path(config.outputs.stage)
    return args


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = _parse(argv, prog)
    # Imported after parsing, so --help and a bad command line answer without loading torch.
    from ..progress import quiet_hub_progress_unless_terminal
    from ..publishing import Publication, format_plan, publish
    from ..signing import ExpectedSigner

    quieted: list[bool] = []

    def say(line: str) -> None:
        # The Hub client's progress bars go off (unless stderr is a terminal) with the first line,
        # the audit's, which comes before any request and so before any bar; not at start, so
        # that loading the client's progress utilities (tqdm, asyncio) runs beside the audit.
        if not quieted:
            quiet_hub_progress_unless_terminal()
            quieted.append(True)
        print(line, flush=True)

    signer = ExpectedSigner(
        sign_key=args.sign_key,
        verify_key=args.verify_key,
        identity=args.verify_identity,
        issuer=args.verify_issuer,
        verify_chain=tuple(args.verify_chain),
    )
    publication = Publication(
        repo_id=args.repo_id,
        stage=args.stage,
        endpoint=args.endpoint,
        revision=args.revision,
        private=args.private,
        path_in_repo=args.path_in_repo,
        message=args.message,
        dry_run=args.dry_run,
        receipt_dir=args.receipt_dir,
        timeout_s=args.timeout,
        signer=signer,
        force_repo_id=args.force_repo_id,
        create_pr=args.create_pr,
        tag=args.tag,
        restage=args.restage,
    )
    # The one commit is atomic on the Hub: sent or not, a rerun finds out and never sends a second.
    with stopping(
        "anything half-written was removed; if the commit was sent, the same command run again finds it "
        "on the branch and commits nothing twice"
    ):
        result = publish(publication, say=say)
    if result.status == "dry run":
        print(format_plan(result.plan))
        print("dry run: no write request was sent")
        return 0
    what = "the model" if result.plan.step is None else f"step {result.plan.step}"
    if result.status == "already published":
        print(f"nothing to publish: {args.repo_id} already holds this stage at {result.commit}")
    elif args.create_pr:
        print(
            f"published {what} to {result.plan.repo_url} in one commit, as a pull request "
            f"against {args.revision}"
        )
    else:
        lost = " (the Hub's answer to the commit was lost; the commit was found on the branch)"
        print(f"published {what} to {result.plan.repo_url} in one commit{lost if result.answer_lost else ''}")
    if result.signature is not None:
        print(
            f"signed: model.sig verified, key fingerprint {result.signature.fingerprint or 'Sigstore identity'}"
        )
    else:
        print("unsigned: the stage has no model.sig (stage with 05 --sign-key to sign it)")
    width = max((len(item.path_in_repo) for item in result.files), default=0)
    for item in result.files:
        print(f"  verified  {item.path_in_repo:<{width}}  sha256 {item.sha256}  ({item.checked_by})")
    state = "written" if result.receipt_written else "kept from the publish"
    print(f"receipt {result.receipt} ({state})")
    print(f"commit {result.commit_url}")
    return 0
