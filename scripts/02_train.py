"""Train with exact resume on local, atomic, hashed checkpoints. Nothing is uploaded.

The step itself, its flags and examples: pipeline/entry/train.py (``--help`` shows them).
"""

from _bootstrap import project_imports

with project_imports():
    from pipeline.cli import run_main
    from pipeline.entry.train import main

if __name__ == "__main__":
    run_main(main)
