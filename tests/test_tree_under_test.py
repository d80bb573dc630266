"""The tests run the code of the tree they belong to, in this process and in every subprocess.

Without this a worktree, or a scratch copy made by ``make mutate``, would import the package
of whatever checkout the editable install points at, and its tests would prove nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import pipeline

from support import HELPERS, PYTHON, REPO, run_python, script_env


def test_this_process_and_script_subprocesses_import_the_tree_under_test(tmp_path):
    assert Path(pipeline.__file__).resolve() == REPO / "pipeline" / "__init__.py"
    code = "import pipeline, support; print(pipeline.__file__); print(support.__file__)"
    for env in (script_env(), None):  # None: a subprocess that inherits this process's environment
        out = subprocess.run(
            [PYTHON, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        assert [Path(p).resolve() for p in out] == [REPO / "pipeline" / "__init__.py", HELPERS / "support.py"]
    assert sys.path[0] in (str(REPO), str(REPO / "tests"), str(HELPERS))


def test_a_script_forked_from_the_zygote_sees_what_a_real_exec_sees(tmp_path):
    """tests/helpers/zygote.py forks the scripts the tests run; what the script sees must be what
    ``python -B SCRIPT ARGS`` would give it, and a load-time variable must force a real exec."""
    # As any test building an optimizer in this process does: torch then sets variables of its
    # own here (TORCHINDUCTOR_CACHE_DIR), which must not turn every later run into an exec.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, os, sys, pipeline\n"
        "print(json.dumps([sys.argv, os.getcwd(), os.environ.get('PROBE'), pipeline.__file__,\n"
        "                  sys.path[0], sys.flags.dont_write_bytecode]))\n"
        "print(os.getppid())\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    env = script_env(PROBE="x y")
    forked = run_python([probe, "a", "b c"], cwd=tmp_path, env=env)
    execed = run_python([probe, "a", "b c"], cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "3"})
    assert forked.returncode == execed.returncode == 3
    assert forked.stderr == execed.stderr == "to stderr\n"
    seen, parent = forked.stdout.splitlines()
    assert seen == execed.stdout.splitlines()[0]
    assert json.loads(seen) == [
        [str(probe), "a", "b c"],
        str(tmp_path),
        "x y",
        str(REPO / "pipeline" / "__init__.py"),
        str(tmp_path),
        True,
    ]
    # The forked one is a child of the zygote, the other one of this process.
    assert int(parent) != os.getpid() and int(execed.stdout.splitlines()[1]) == os.getpid()
