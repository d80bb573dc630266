"""Prepare the training data and record its SHA-256 fingerprint.

    python scripts/01_prepare_data.py
    python scripts/01_prepare_data.py --config examples/charlm/config.yaml

Writes the files of ``data.prepare`` into ``data.dir`` with a ``manifest.json`` of SHA-256
hashes. Rerunning with the same config keeps the existing data; different existing data is
never overwritten.
"""

import argparse

from _bootstrap import project_imports

with project_imports():
    from pipeline.cli import add_config_arguments, config_from_args, run_main
    from pipeline.data import prepare_data


def main() -> int:
    # No abbreviations: a hint to run this script again repeats its arguments as given.
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    add_config_arguments(parser)
    config = config_from_args(parser.parse_args())
    folder, manifest, changed = prepare_data(config)
    state = "prepared" if changed else "unchanged, already prepared"
    print(f"data {state}: {folder}/ ({len(manifest['files'])} files)")
    for name, entry in sorted(manifest["files"].items()):
        print(f"  {entry['sha256']}  {entry['size']:>10}  {name}")
    print(f"fingerprint {manifest['fingerprint']}")
    return 0


if __name__ == "__main__":
    run_main(main)
