"""Evaluate the newest verified checkpoint on the held-out split; write metrics.json.

The step itself, its flags and examples: pipeline/entry/evaluate.py (``--help`` shows them).
"""

from _bootstrap import project_imports

with project_imports():
    from pipeline.cli import run_main
    from pipeline.entry.evaluate import main

if __name__ == "__main__":
    run_main(main)
