"""Prepare the training data and record its SHA-256 fingerprint.

    python scripts/01_prepare_data.py
    python scripts/01_prepare_data.py --config examples/charlm/config.yaml

Writes the files of ``data.prepare`` into ``data.dir`` with a ``manifest.json`` of SHA-256
hashes. Rerunning with the same config keeps the existing data; different existing data is
never overwritten.
"""

from __future__ import annotations

from typing import Sequence

from ..cli import add_config_arguments, config_from_args
from ..data import prepare_data
from . import step_parser


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    parser = step_parser(__doc__, prog)
    add_config_arguments(parser)
    config = config_from_args(parser.parse_args(argv))
    folder, manifest, changed = prepare_data(config)
    state = "prepared" if changed else "unchanged, already prepared"
    print(f"data {state}: {folder}/ ({len(manifest['files'])} files)")
    for name, entry in sorted(manifest["files"].items()):
        print(f"  {entry['sha256']}  {entry['size']:>10}  {name}")
    print(f"fingerprint {manifest['fingerprint']}")
    return 0
