"""Publish hub_stage/ to the Hugging Face Hub as ONE audited commit, then verify what landed.

The step itself, its flags and examples: pipeline/entry/publish.py (``--help`` shows them).
"""

from _bootstrap import project_imports

with project_imports():
    from pipeline.cli import run_main
    from pipeline.entry.publish import main

if __name__ == "__main__":
    run_main(main)
