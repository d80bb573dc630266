"""tests/mutation/mutate.py --whole-suite, run on a tiny tree of its own.

The runner and its plugin are copied into a folder that holds a two-function module and a
few tests, so the "whole suite" takes a second: what is checked is the runner's verdicts (the
first failing test, named or not; a stale search string an error; a survivor) and the order
the plugin gives the suite (the tests a mutation names, then their files, then the rest).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO

MODULE = """\
def add(a, b):
    return a + b


def sub(a, b):
    return a - b
"""

# The unrelated test's file sorts first: without the plugin's order it would fail first.
TESTS = {
    "tests/test_a_unrelated.py": "import calc\n\n\ndef test_add_here_too():\n    assert calc.add(2, 2) == 4\n",
    "tests/test_calc.py": (
        "import calc\n\n\n"
        "def test_sub():\n    assert calc.sub(3, 1) == 2\n\n\n"
        "def test_add():\n    assert calc.add(1, 2) == 3\n\n\n"
        "def test_add_zero():\n    assert calc.add(0, 0) == 0\n"
    ),
    "tests/test_z_more.py": "import calc\n\n\ndef test_sub_again():\n    assert calc.sub(5, 5) == 0\n",
}

MUTATIONS = """\
[[mutation]]
name = "add subtracts"
area = "calc"
tests = ["tests/test_calc.py::test_add"]
[[mutation.edit]]
file = "calc.py"
search = "return a + b"
replace = "return a - b"

[[mutation]]
name = "sub adds, caught only by a test it does not name"
area = "calc"
tests = ["tests/test_calc.py::test_add"]
[[mutation.edit]]
file = "calc.py"
search = "return a - b"
replace = "return a + b"

[[mutation]]
name = "a search that no longer matches"
area = "calc"
tests = ["tests/test_calc.py::test_add"]
[[mutation.edit]]
file = "calc.py"
search = "return a * b"
replace = "return a / b"

[[mutation]]
name = "an edit no test sees"
area = "calc"
tests = ["tests/test_calc.py::test_add"]
[[mutation.edit]]
file = "calc.py"
search = "def sub(a, b):"
replace = "def sub(a, b):  # unseen"
"""


def _tiny_tree(root: Path) -> Path:
    (root / "tests" / "mutation").mkdir(parents=True)
    for name in ("mutate.py", "suite_order.py"):
        shutil.copy(REPO / "tests" / "mutation" / name, root / "tests" / "mutation" / name)
    (root / "calc.py").write_text(MODULE)
    for path, text in TESTS.items():
        (root / path).write_text(text)
    (root / "list.toml").write_text(MUTATIONS)
    return root


def _env(root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MUTATE_", "PYTEST_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests" / "mutation")])
    # The tiny suite needs no installed plugin but xdist: loading them all would take most of its time.
    env.update(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PYTEST_PLUGINS="xdist.plugin")
    return {**env, **extra}


def _mutate(root: Path, *options: str) -> subprocess.CompletedProcess:
    """The tiny tree's copy of mutate.py over its list, one job."""
    return subprocess.run(
        [sys.executable, str(root / "tests/mutation/mutate.py"), *options]
        + ["--list-file", str(root / "list.toml"), "--jobs", "1"],
        cwd=root,
        env=_env(root),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_plugin_runs_the_named_tests_first_then_their_files_then_the_rest(tmp_path):
    root = _tiny_tree(tmp_path)
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider"]
        + ["-p", "suite_order"],
        cwd=root,
        env=_env(root, MUTATE_FIRST=json.dumps(["tests/test_calc.py::test_add"])),
        capture_output=True,
        text=True,
        timeout=120,
    )
    order = [line for line in collected.stdout.splitlines() if "::" in line]
    assert order == [
        "tests/test_calc.py::test_add",
        "tests/test_calc.py::test_sub",
        "tests/test_calc.py::test_add_zero",
        "tests/test_a_unrelated.py::test_add_here_too",
        "tests/test_z_more.py::test_sub_again",
    ], collected.stdout + collected.stderr


def test_each_defect_reports_its_first_failing_test_named_or_not_and_a_stale_one_is_an_error(tmp_path):
    result = _mutate(_tiny_tree(tmp_path), "--whole-suite")
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    lines = {line.split("] ", 1)[1].split(":", 1)[0]: line for line in out.splitlines() if "] " in line}
    assert lines["add subtracts"].startswith("killed"), out
    assert "first failure tests/test_calc.py::test_add, a test it names" in lines["add subtracts"], out
    unrelated = lines["sub adds, caught only by a test it does not name"]
    assert unrelated.startswith("killed"), out
    assert "first failure tests/test_calc.py::test_sub, NOT a test it names" in unrelated, out
    assert lines["a search that no longer matches"].startswith("error"), out
    assert "found 0 times in calc.py" in lines["a search that no longer matches"], out
    assert lines["an edit no test sees"].startswith("survived"), out
    assert "the whole suite passed: 5 passed" in lines["an edit no test sees"], out
    assert "kill rate: 2/4" in out, out
    summary = out.split("kill rate:", 1)[1]
    assert "killed first by a test they do not name:\n  - sub adds" in summary, out
    assert "survivors:\n  - an edit no test sees" in summary, out


def test_a_run_of_the_named_tests_reports_the_test_that_killed_each_defect(tmp_path):
    result = _mutate(_tiny_tree(tmp_path), "--only", "add subtracts")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    line = next(line for line in out.splitlines() if line.startswith("killed"))
    assert line.split("] ", 1)[1].startswith("add subtracts: by tests/test_calc.py::test_add: 1 failed"), out


@pytest.mark.parametrize(
    ("name", "code", "test", "outcome"),
    [
        (
            "test_setup.py",
            "import calc\nimport pytest\n\n\n@pytest.fixture\ndef two():\n    assert calc.add(1, 1) == 2\n"
            "    return 2\n\n\ndef test_two(two):\n    assert two == 2\n",
            "tests/test_setup.py::test_two",
            "1 error",
        ),
        # pytest prints a failing test's captured log in its report, "ERROR    dcp:test_logs.py:7 ..."
        # for a record at level ERROR (torch's checkpoint logger writes one when a load fails),
        # above the FAILED line of the short summary: the killer is the test, not that line.
        (
            "test_logs.py",
            "import logging\n\nimport calc\n\n\ndef test_logs():\n"
            "    logging.getLogger('dcp').error('load failed')\n    assert calc.add(1, 1) == 2\n",
            "tests/test_logs.py::test_logs",
            "1 failed",
        ),
    ],
    ids=["its-fixture-fails", "it-logged-an-error"],
)
def test_the_killer_is_named_by_its_test_id(tmp_path, name, code, test, outcome):
    root = _tiny_tree(tmp_path)
    (root / "tests" / name).write_text(code)
    first = MUTATIONS.split("\n\n[[mutation]]")[0]
    (root / "list.toml").write_text(first.replace("tests/test_calc.py::test_add", test))
    out = _mutate(root).stdout
    line = next(line for line in out.splitlines() if line.startswith("killed"))
    assert line.split("] ", 1)[1].startswith(f"add subtracts: by {test}: {outcome}"), out
