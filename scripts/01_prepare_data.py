"""Prepare the training data and record its SHA-256 fingerprint.

The step itself, its flags and examples: pipeline/entry/prepare.py (``--help`` shows them).
"""

from _bootstrap import project_imports

with project_imports():
    from pipeline.cli import run_main
    from pipeline.entry.prepare import main

if __name__ == "__main__":
    run_main(main)
