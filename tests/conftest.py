"""Shared fixtures: the default config trained, evaluated and staged by the real scripts.

Each fixture is a :class:`RunFolder`, a temporary folder that is the working directory of
the scripts run in it, so it holds the same on-disk names as the real flow::

    <root>/data/regression/                 01_prepare_data.py (data.dir)
    <root>/estados_local/step-00000010/     02_train.py        (checkpoint.dir)
    <root>/metrics.json                     04_evaluate.py
    <root>/hub_stage/                       05_stage.py

Fixtures (the session ones are built once and shared: treat them as read-only):

``data_dir``      session: the default data prepared by script 01 into a temporary folder.
``trained_run``   session: data prepared and ``config.yaml`` trained to its last step.
``evaluated_run`` session: ``trained_run`` plus ``metrics.json``.
``staged_run``    session: ``evaluated_run`` plus ``hub_stage/``.
``restaged_run``  session: the same config trained, evaluated and staged again from scratch in
                  another folder, at least a second later (another wall-clock ``created``).
``run_copy``      function: ``run_copy(run)`` returns a private, writable copy in
                  ``tmp_path`` (relative paths in saved configs keep working).

Scripts run as subprocesses with ``RunFolder.script(name, *args, env={...})`` (always
passes the repository's ``config.yaml``; ``HF_TOKEN`` is removed from the environment
unless ``env`` sets it),
``RunFolder.ok(...)`` to also require exit 0, ``RunFolder.refused(...)`` to require exit 2
with a single ``error: ...`` line and return that line. Nothing touches the repository's
own ``data/``, ``estados_local/``, ``metrics.json`` or ``hub_stage/``.
"""

from __future__ import annotations

import datetime
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import pytest

# The tests' helpers (tests/helpers/) import as top-level modules, here and in every subprocess.
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

from support import REPO, prepare_data, run_python, script_env, use_tree_under_test

use_tree_under_test()

CONFIG = REPO / "config.yaml"


def pytest_configure(config) -> None:
    """Byte-compile the tree under test once, here in the controller before any worker starts.
    Every script the tests run imports ``pipeline`` afresh (forked from the zygote, which holds
    none of it, or a real exec) under ``python -B``, and machines that set
    PYTHONDONTWRITEBYTECODE never cache it: each of several hundred runs would compile its ~70
    modules again (0.2-0.4 s of CPU each). ``-B`` only stops writing; the cached files are
    read, and checked against their sources' size and mtime, so an edited file is recompiled."""
    if not hasattr(config, "workerinput"):
        import compileall

        for folder in ("pipeline", "tests/helpers"):
            compileall.compile_dir(REPO / folder, quiet=1)


def pytest_sessionstart(session) -> None:
    import pipeline

    where = Path(pipeline.__file__).resolve()
    assert where.is_relative_to(REPO), f"the tests import {where}, not the tree under test {REPO}"


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``heavy`` (a proof, a torchrun launch, a real SIGKILL loop: tens of
    seconds each) first. pytest-xdist hands out the groups, then single tests in this order,
    so a long test never starts last while the other worker has nothing left to do."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


def pytest_runtest_setup(item) -> None:
    """Under ``--dist loadgroup`` a test marked ``xdist_group`` must carry its group, or the
    tests that share an expensive module fixture (a proof, a published repo, the torchrun
    launches) would each build it again on both workers: slower, and silent. pytest-xdist
    appends the group to the node id on each worker; pytest 9.2 broke that (constraints.txt).
    Checked before the test's fixtures are built, so the failure is immediate."""
    if (
        item.config.getoption("loadgroup", False)
        and item.get_closest_marker("xdist_group")
        and "@" not in item.nodeid
    ):
        pytest.fail(
            "--dist loadgroup did not group this xdist_group test: this pytest and pytest-xdist do not "
            "work together (see constraints.txt)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """The default config's data, prepared once by script 01 (read-only)."""
    folder = tmp_path_factory.mktemp("data") / "data"
    prepare_data(folder)
    return folder


@dataclass(frozen=True)
class RunFolder:
    """One run's working folder; see the module docstring for its layout."""

    root: Path

    @property
    def data_dir(self) -> Path:
        return self.root / "data" / "regression"

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "estados_local"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    @property
    def stage(self) -> Path:
        return self.root / "hub_stage"

    @property
    def checkpoint(self) -> Path:
        """The newest committed step folder."""
        steps = sorted(p for p in self.checkpoint_dir.glob("step-*") if (p / "meta.json").is_file())
        assert steps, f"no committed checkpoint in {self.checkpoint_dir}"
        return steps[-1]

    @property
    def overrides(self) -> dict[str, str]:
        """Config overrides that point in-process code (cwd = repo) at this folder."""
        return {"data.dir": str(self.data_dir), "checkpoint.dir": str(self.checkpoint_dir)}

    def script(
        self, name: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        """Run ``scripts/<name> --config <repo>/config.yaml *args`` here; never raises.
        ``env`` adds variables to :func:`script_env`."""
        return run_python(
            [REPO / "scripts" / name, "--config", CONFIG, *args],
            cwd=self.root,
            env=script_env(**(env or {})),
            timeout=timeout,
        )

    def ok(self, name: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
        result = self.script(name, *args, **kwargs)
        assert result.returncode == 0, f"{name} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        return result

    def refused(self, name: str, *args: str, **kwargs) -> str:
        """The single ``error: ...`` line of a run that must exit 2 without a traceback."""
        result = self.script(name, *args, **kwargs)
        assert result.returncode == 2, f"{name} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        assert "Traceback" not in result.stderr, result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        return lines[0]

    def copy_to(self, destination: Path) -> "RunFolder":
        shutil.copytree(self.root, destination, symlinks=True)
        return RunFolder(destination)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> RunFolder:
    run = RunFolder(tmp_path_factory.mktemp("trained_run"))
    run.ok("01_prepare_data.py")
    run.ok("02_train.py", "--quiet")
    return run


@pytest.fixture(scope="session")
def evaluated_run(trained_run, tmp_path_factory) -> RunFolder:
    run = trained_run.copy_to(tmp_path_factory.mktemp("evaluated_run") / "run")
    run.ok("04_evaluate.py")
    return run


@pytest.fixture(scope="session")
def staged_run(evaluated_run, tmp_path_factory) -> RunFolder:
    run = evaluated_run.copy_to(tmp_path_factory.mktemp("staged_run") / "run")
    run.ok("05_stage.py")
    return run


@pytest.fixture(scope="session")
def restaged_run(staged_run, tmp_path_factory) -> RunFolder:
    run = RunFolder(tmp_path_factory.mktemp("restaged_run") / "run")
    run.root.mkdir()
    created = json.loads((staged_run.checkpoint / "meta.json").read_text())["created"]
    while datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds") <= created:
        time.sleep(0.1)
    for script in ("01_prepare_data.py", "02_train.py", "04_evaluate.py", "05_stage.py"):
        run.ok(script, *(("--quiet",) if script == "02_train.py" else ()))
    return run


@pytest.fixture
def run_copy(tmp_path) -> Callable[[RunFolder], RunFolder]:
    """``run_copy(run)``: a writable copy of a shared run, for tests that change files."""
    count = 0

    def make(run: RunFolder) -> RunFolder:
        nonlocal count
        count += 1
        return run.copy_to(tmp_path / f"run{count}")

    return make
