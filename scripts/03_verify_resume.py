"""Prove that resuming from a checkpoint is exact, for your model and config, in one command.

The step itself, its flags and examples: pipeline/entry/verify_resume.py (``--help`` shows them).
"""

from _bootstrap import project_imports

with project_imports():
    from pipeline.cli import run_main
    from pipeline.entry.verify_resume import main

if __name__ == "__main__":
    run_main(main)
