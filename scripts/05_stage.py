"""Stage the last verified checkpoint for the Hub: weights, record, card, curve, manifest.

The step itself, its flags and examples: pipeline/entry/stage.py (``--help`` shows them).
"""

from _bootstrap import project_imports

with project_imports():
    from pipeline.cli import run_main
    from pipeline.entry.stage import main

if __name__ == "__main__":
    run_main(main)
