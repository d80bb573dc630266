"""What the scripts tell a user to do next: a mistyped checkpoint name lists the names
accepted, and a printed command repeats every flag the user gave, so that running it
as printed does what it says (never a second error)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("script", ["04_evaluate.py", "05_stage.py"])
def test_a_mistyped_checkpoint_name_lists_latest_best_and_path(script, evaluated_run, run_copy):
    run = run_copy(evaluated_run)
    before = sorted(p.name for p in run.root.iterdir())
    line = run.refused(script, "--checkpoint", "bset")
    assert line.startswith("error: bset is neither latest, best nor an existing folder: "), line
    assert "latest|best|PATH" in line, line
    line = run.refused(script, "--checkpoint", str(run.root / "data"))  # a folder, not a checkpoint
    assert "is not a committed checkpoint folder" in line and "latest|best|PATH" in line, line
    assert sorted(p.name for p in run.root.iterdir()) == before
