"""The tests run the code of the tree they belong to, in this process and in every subprocess.

Without this a worktree, or a scratch copy made by ``make mutate``, would import the package
of whatever checkout the editable install points at, and its tests would prove nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pipeline

from support import PYTHON, REPO, script_env


def test_this_process_and_script_subprocesses_import_the_tree_under_test(tmp_path):
    assert Path(pipeline.__file__).resolve() == REPO / "pipeline" / "__init__.py"
    code = "import pipeline, support; print(pipeline.__file__); print(support.__file__)"
    for env in (script_env(), None):  # None: a subprocess that inherits this process's environment
        out = subprocess.run([PYTHON, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                             check=True).stdout.split()
        assert [Path(p).resolve() for p in out] == [REPO / "pipeline" / "__init__.py", REPO / "tests" / "support.py"]
    assert sys.path[0] in (str(REPO), str(REPO / "tests"))
