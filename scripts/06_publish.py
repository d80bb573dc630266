"""Publish hub_stage/ to the Hugging Face Hub as ONE audited commit, then verify what landed.

    HF_TOKEN=hf_... python scripts/06_publish.py --repo-id you/regression-mlp
    python scripts/06_publish.py --repo-id you/regression-mlp --dry-run        # plan only, no write request
    python scripts/06_publish.py --repo-id you/regression-mlp --private --message "First release"
    python scripts/06_publish.py --repo-id you/models --path-in-repo regression-mlp --revision staging
    python scripts/06_publish.py --repo-id demo/m --endpoint http://127.0.0.1:8080          # a local Hub

The token is read from HF_TOKEN or the one saved by `hf auth login`; it is never a command-line
argument and is never printed or written. Every staged file is re-audited against
MANIFEST.sha256 first; then the repo is created if missing, and one commit holding the whole
stage is made on top of the branch head that was read (a push in between fails with 412
instead of being overwritten). A rerun when the Hub already holds the stage makes no commit.
After landing, the Hub's LFS SHA-256s and the downloaded small files are checked against the
audit, and a receipt is written to hub_receipts/.

Exit codes: 0 published, or nothing to publish; 1 published but the check after landing
failed; 2 not published (one line on stderr says why and what to do).
"""

import argparse
from pathlib import Path

from pipeline.cli import run_main
from pipeline.errors import PipelineError
from pipeline.layout import RECEIPT_DIR, STAGE_DIR


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--repo-id", required=True, metavar="NAMESPACE/NAME", help="model repo to publish to")
    parser.add_argument("--endpoint", metavar="URL", help="Hub URL (default: HF_ENDPOINT or https://huggingface.co)")
    parser.add_argument("--revision", default="main", metavar="BRANCH", help="branch to commit to (default: main)")
    parser.add_argument("--private", action="store_true", default=None, help="create the repo private (if missing)")
    parser.add_argument("--path-in-repo", default="", metavar="DIR", help="folder in the repo (default: the root)")
    parser.add_argument("--message", metavar="TEXT", help="commit title (default names the step and weights SHA-256)")
    parser.add_argument("--dry-run", action="store_true", help="print the planned commit; send no write request")
    parser.add_argument("--stage", type=Path, default=Path(STAGE_DIR), help=f"stage folder (default: {STAGE_DIR})")
    parser.add_argument("--receipt-dir", type=Path, default=Path(RECEIPT_DIR),
                        help=f"where the receipt is written (default: {RECEIPT_DIR})")
    args, unknown = parser.parse_known_args()
    if unknown:
        # Never echo unknown arguments: a mistyped flag may carry a secret.
        token_flag = any(arg.split("=", 1)[0] == "--token" for arg in unknown)
        reason = "--token is not accepted" if token_flag else f"{len(unknown)} unrecognized argument(s), not shown"
        raise PipelineError(f"{reason}: the token is read from HF_TOKEN or `hf auth login`, never from the command "
                           "line; see --help")
    return args


def main() -> int:
    args = _parse()
    # Imported after parsing, so --help and a bad command line answer without loading torch.
    from pipeline.publish import format_plan, publish

    result = publish(args.stage, args.repo_id, endpoint=args.endpoint, revision=args.revision,
                     private=args.private, path_in_repo=args.path_in_repo, message=args.message,
                     dry_run=args.dry_run, receipt_dir=args.receipt_dir, say=lambda line: print(line, flush=True))
    if result.status == "dry run":
        print(format_plan(result.plan))
        print("dry run: no write request was sent")
        return 0
    if result.status == "already published":
        print(f"nothing to publish: {args.repo_id} already holds this stage at {result.commit}")
    else:
        print(f"published step {result.plan.step} to {result.plan.repo_url} in one commit")
    width = max((len(item.path_in_repo) for item in result.files), default=0)
    for item in result.files:
        print(f"  verified  {item.path_in_repo:<{width}}  sha256 {item.sha256}  ({item.checked_by})")
    state = "written" if result.receipt_written else "kept from the publish"
    print(f"receipt {result.receipt} ({state})")
    print(f"commit {result.commit_url}")
    return 0


if __name__ == "__main__":
    run_main(main)
