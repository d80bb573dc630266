"""Command line: `python -m localhub --root DIR [--port N] [--host 127.0.0.1] [--token T]`."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from .hub import LocalHub, check_loopback

__all__ = ["main"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m localhub",
        description=("Loopback-only Hugging Face Hub double. Prints 'localhub listening on URL' once ready."),
    )
    parser.add_argument("--root", required=True, help="state directory (created if missing)")
    parser.add_argument("--port", type=int, default=0, help="TCP port; 0 picks a free one (default)")
    parser.add_argument("--host", default="127.0.0.1", help="loopback address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--token",
        default=None,
        help="write token; prefer env LOCALHUB_TOKEN (argv is visible in ps). Without one: read-only",
    )
    parser.add_argument(
        "--user", default="localhub", help="user name reported by whoami and used as commit author"
    )
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")
    return parser.parse_args(argv)


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds serve_forever() in the main thread, then we close cleanly


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        check_loopback(args.host)
    except ValueError as exc:
        print(f"localhub: {exc}", file=sys.stderr)
        return 2
    token = args.token or os.environ.get("LOCALHUB_TOKEN") or None
    try:
        hub = LocalHub(
            args.root, token=token, host=args.host, port=args.port, user=args.user, verbose=args.verbose
        )
    except (OSError, RuntimeError) as exc:
        print(f"localhub: cannot start: {exc}", file=sys.stderr)
        return 1
    if token is None:
        print("localhub: no token configured (LOCALHUB_TOKEN/--token): serving read-only", file=sys.stderr)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    print(f"localhub listening on {hub.url}", flush=True)
    try:
        hub.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        hub.stop()
    return 0
